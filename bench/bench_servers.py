"""The test suite's servers for benchmarks: started from the installed binaries (see tests/),
one fresh store URL on each, stopped afterwards."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Engine name -> (module in tests/, server class); SQL servers make a database per URL.
SERVERS = {
    "postgresql": ("servers", "PostgresServer"),
    "mysql": ("servers", "MariaDBServer"),
    "redis": ("server_redis", "RedisServer"),
    "etcd": ("server_etcd", "EtcdServer"),
    "zookeeper": ("server_zookeeper", "ZooKeeperServer"),
    "cassandra": ("server_cassandra", "CassandraServer"),
}


@contextlib.contextmanager
def started_servers(name: str, engines: tuple[str, ...] = tuple(SERVERS)) -> Iterator[list[str]]:
    """Start a server of each engine and yield a store URL named `name` on each."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    with contextlib.ExitStack() as stack:
        urls = []
        for engine in engines:
            module, cls = SERVERS[engine]
            server: Any = getattr(importlib.import_module(module), cls)()
            server.start()
            stack.callback(server.close)
            make = getattr(server, "create_database", None) or server.store_url
            urls.append(make(name))
        yield urls
