"""Independent Redis nodes for quorum keys, each on a loopback address of its own.

Node i listens on 127.0.0.(21 + i) for group "a" of clients and on 127.0.0.(41 + i) for group
"b", so that a harness.Partition can cut one group of clients off from some nodes while the
other group still reaches them (on loopback every client's address is 127.0.0.1: clients are
told apart by the address they connect to).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from server_redis import RedisServer
from servers import start_all

GROUP_BASE = {"a": 21, "b": 41}


class QuorumNodes:
    def __init__(self, count: int = 5, *, appendfsync: str | None = "always") -> None:
        self.servers = [
            RedisServer(
                host=f"127.0.0.{GROUP_BASE['a'] + i}",
                also=(f"127.0.0.{GROUP_BASE['b'] + i}",),
                appendfsync=appendfsync,
            )
            for i in range(count)
        ]
        start_all(self.servers)

    def urls(self, prefix: str, group: str = "a") -> list[str]:
        """The nodes' URLs for a key prefix, as clients of `group` reach them."""
        return [
            f"redis://127.0.0.{GROUP_BASE[group] + i}:{s.port}/0?prefix={prefix}"
            for i, s in enumerate(self.servers)
        ]

    def joined(self, prefix: str, group: str = "a") -> str:
        return ",".join(self.urls(prefix, group))

    def address(self, i: int, group: str) -> tuple[str, int]:
        return f"127.0.0.{GROUP_BASE[group] + i}", self.servers[i].port

    def nodes(self) -> dict[str, RedisServer]:
        return {f"r{i}": s for i, s in enumerate(self.servers)}

    def heal(self) -> None:
        """Every node running and answering (after a test's kills and pauses)."""
        for server in self.servers:
            server.resume()
            server.start()

    def close(self) -> None:
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.close()


@contextlib.contextmanager
def running(count: int = 5, *, appendfsync: str | None = "always") -> Iterator[QuorumNodes]:
    nodes = QuorumNodes(count, appendfsync=appendfsync)
    try:
        yield nodes
    finally:
        nodes.close()
