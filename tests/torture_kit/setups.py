"""The set-ups a torture run starts: stores (single, replicated under an HA recipe, or a
cluster), the keys, and what their nemesis may do to them.

A set-up is a context manager (`with SETUPS[name](workdir, unsafe) as setup`). It offers:

- `store`: the store URL clients and servers use (keys live there);
- `keys`: the keys made for the run, by name, with their kind and bounds;
- `clients`: which client processes to run (kinds and ways, as tests/torture/client.py takes);
- `nodes`: store nodes the nemesis may kill -9, restart, SIGSTOP and cut off, by name, each
  with the (address, port) clients reach it on (None: not cut off by address);
- `switch()`: a failover and a failback of a replicated store (None where there is none);
- `bounds`: the longest outage (seconds) each fault may cause that the docs promise;
- `unsafe`: when given, the set-up's negative control is on (its description in `unsafe_what`):
  a setting the docs call unsafe, which the checker must catch repeating ids.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusters import EtcdCluster, ZooKeeperEnsemble, loopback_addresses

import idmint

from .setup_cassandra import cassandra_2dc
from .setup_mariadb import mariadb_semisync
from harness import Partition
from postgres_ha import ha_pair, switch
from quorum_nodes import QuorumNodes
from replicated import Forwarder, redis_pair
from server_redis import Sentinels
from servers import LOOPBACK

#: A bounded key: 32-bit, above 1,000,000 legacy ids.
B32_START, B32_MAX = 1_000_001, 2**31 - 1


@dataclass(frozen=True)
class KeySpec:
    name: str
    kind: str  # segment | snowflake | quorum | datacenter
    first: int = 1
    last: int = 2**63 - 1
    increasing: bool = True  # each process's calls go up (one generator, one thread)


@dataclass(frozen=True)
class Node:
    name: str
    server: Any  # kill(), start(), pause(), resume()
    address: tuple[str, int] | None = None


@dataclass
class Setup:
    name: str
    store: str
    keys: dict[str, KeySpec]
    #: (name, spec for tests/torture/client.py without url), the processes to run
    clients: list[tuple[str, dict[str, Any]]]
    nodes: dict[str, Node] = field(default_factory=dict)
    switch: Callable[[], str] | None = None
    #: The servers' extra `idmint serve` arguments (quorum nodes, say).
    serve_args: list[str] = field(default_factory=list)
    servers: int = 1
    bounds: dict[str, float] = field(default_factory=dict)
    unsafe_what: str = ""
    #: The fault the negative control needs to show (the nemesis runs it early and often).
    unsafe_fault: str | None = None
    #: Nodes a power cut kills -9 with every client and server (a majority of a quorum).
    power_cut_nodes: int = 0
    #: Forwarders clients reach the store through, by name: the nemesis drops their replies
    #: (the write applied, its answer lost).
    proxies: dict[str, Forwarder] = field(default_factory=dict)
    #: Cuts between parts of the store, by name (a member from its peers, one datacenter
    #: from the other): each makes its cut and returns the Partition that heals it.
    splits: dict[str, Callable[[], Partition]] = field(default_factory=dict)
    #: Takes a backup of the store now and returns what restores it (None: no such fault).
    backup: Callable[[], Callable[[], None]] | None = None


def _make_keys(store: str, keys: dict[str, KeySpec], stripes: bool = True) -> None:
    with idmint.connect(store) as minter:
        minter.add_key("seg", step=50, exist_ok=True)
        minter.add_key("b32", step=50, start=B32_START, max=B32_MAX, exist_ok=True)
        if stripes:
            minter.add_key("str", step=50, stripes=3, exist_ok=True)
        for spec in keys.values():
            if spec.kind == "quorum":
                minter.add_quorum_key(spec.name, exist_ok=True)


SEGMENT_KEYS = {
    "seg": KeySpec("seg", "segment"),
    "b32": KeySpec("b32", "segment", B32_START, B32_MAX),
    "str": KeySpec("str", "segment", increasing=False),  # a stripe move may go down
    "flake": KeySpec("flake", "snowflake"),
}


def _segment_clients(snowflake: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """The mix every store set-up runs: the library on plain, bounded and striped keys (and
    snowflake), `idmint serve` over HTTP and through idmint.Client, and the CLI."""
    clients: list[tuple[str, dict[str, Any]]] = [
        ("lib-seg-0", {"via": "lib", "kind": "segment", "key": "seg", "batch": 20}),
        ("lib-seg-1", {"via": "lib", "kind": "segment", "key": "seg", "batch": 7}),
        ("lib-b32-0", {"via": "lib", "kind": "segment", "key": "b32", "batch": 20}),
        ("lib-str-0", {"via": "lib", "kind": "segment", "key": "str", "batch": 20}),
        ("lib-take-0", {"via": "lib", "kind": "take", "key": "seg", "batch": 5}),
        ("http-seg-0", {"via": "http", "kind": "segment", "key": "seg", "batch": 10}),
        ("client-b32-0", {"via": "client", "kind": "segment", "key": "b32", "batch": 10}),
        ("cli-seg-0", {"via": "cli", "kind": "segment", "key": "seg", "batch": 5, "pause": 0.5}),
    ]
    if snowflake:
        clients += [
            ("lib-flake-0", {"via": "lib", "kind": "snowflake", "key": "flake", "batch": 50}),
            ("lib-flake-1", {"via": "lib", "kind": "snowflake", "key": "flake", "batch": 50}),
        ]
    return clients


#: Outages the docs promise at most (seconds), per fault: a store fault is hidden by the
#: buffers for a while and then costs at most the store's own recovery; the client's own
#: kill or pause is its own outage, not counted.
STORE_BOUNDS = {
    "drop-replies": 15.0,
    "restore": 30.0,
    "kill-node": 15.0,
    "pause-node": 15.0,
    "partition": 15.0,
    "split": 15.0,
    "failover": 30.0,
    "kill-server": 10.0,
    "pause-server": 10.0,
    "clock": 2.0,
}


@contextlib.contextmanager
def sqlite(workdir: Path, unsafe: bool) -> Iterator[Setup]:
    """One SQLite file, every process on this machine. Negative control: two processes hold
    the same static snowflake worker id, each with its own state file and no shared lease
    store (the docs: a static id must be claimed through one store, or be unique by hand)."""
    store = f"sqlite:///{workdir / 'store.db'}"
    keys = dict(SEGMENT_KEYS)
    _make_keys(store, keys)
    setup = Setup("sqlite", store, keys, _segment_clients(), bounds=dict(STORE_BOUNDS))
    setup.backup = lambda: _sqlite_backup(workdir / "store.db", workdir / "backup.db")
    if unsafe:
        setup.clients += [
            (
                f"unsafe-flake-{n}",
                {
                    "via": "lib",
                    "kind": "snowflake",
                    "key": "flake",
                    "batch": 200,
                    "url": "memory://",  # no lease store: the state file alone fences
                    "worker_id": 7,
                    "state": str(workdir / f"worker7-{n}.json"),
                },
            )
            for n in range(2)
        ]
        setup.unsafe_what = "static worker id 7 held by two processes, no shared lease store"
    yield setup


def _sqlite_backup(db: Path, copy: Path) -> Callable[[], None]:
    """A consistent copy of the database now (SQLite's online backup), and what copies it
    back over the database (every process that uses it stopped first)."""

    def copy_over(source: Path, target: Path) -> None:
        with (
            contextlib.closing(sqlite3.connect(source)) as src,
            contextlib.closing(sqlite3.connect(target)) as dst,
        ):
            src.backup(dst)

    copy_over(db, copy)
    return lambda: copy_over(copy, db)


@contextlib.contextmanager
def redis_replica(workdir: Path, unsafe: bool) -> Iterator[Setup]:
    """A Redis primary and replica under three Sentinels (redis+sentinel:// URLs). The switch:
    Sentinel fails the primary over (kill -9 of it), and it rejoins as a replica. Negative
    control: `unsafe_replication=1&failover_gap=0` with the replica's link cut before the
    kill, so the promoted replica lacks the last ranges."""
    link = "127.0.0.61"  # the replica follows the primary here: the control cuts it
    with (
        redis_pair(link=link) as (primary, replica),
        Sentinels(3) as sentinels,
        Partition() as partition,
    ):
        # Sentinel repoints a replica that follows its primary at another address than the
        # one it knows (the link, which the control cuts) once it has known it for the
        # failover timeout: past the run for the control.
        timeout_ms = 60_000 if unsafe else 3000
        sentinels.monitor("torture", primary, down_after_ms=1000, failover_timeout_ms=timeout_ms)
        query = "prefix=t&unsafe_replication=1&failover_gap=0" if unsafe else "prefix=t"
        store = sentinels.url("torture", query)
        keys = dict(SEGMENT_KEYS)
        _make_keys(store, keys)
        servers = {"primary": primary, "replica": replica}

        def failover() -> str:
            addr = sentinels.primary("torture")
            old = next(s for s in servers.values() if (s.host, s.port) == addr)
            new = next(s for s in servers.values() if s is not old)
            if unsafe:  # the replica falls behind first (on the pair's first link only)
                partition.cut_address(link, old.port)
                time.sleep(2.0)
            old.kill()
            partition.heal()
            sentinels.await_primary("torture", new, 30)
            old.start()  # Sentinel makes it a replica of the new primary
            return f"port {old.port} -> {new.port}"

        nodes = {n: Node(n, s) for n, s in servers.items()}
        setup = Setup(
            "redis-replica", store, keys, _segment_clients(), nodes, failover,
            bounds=dict(STORE_BOUNDS), splits={"replica-link": lambda: _cut(link, primary.port)},
        )  # fmt: skip
        if unsafe:
            setup.unsafe_what = "unsafe_replication=1&failover_gap=0, replication cut"
            setup.unsafe_fault = "failover"
        yield setup


def _cut(address: str, port: int) -> Partition:
    """A split of a replicated pair: the link its first standby (replica) follows its first
    primary through (the primary also listens on `address`). Until the first failover: then
    the recipe points the new standby at the new primary's own address, which clients use too,
    and this cut cuts nothing."""
    cut = Partition()
    cut.cut_address(address, port)
    return cut


@contextlib.contextmanager
def postgres_sync(workdir: Path, unsafe: bool) -> Iterator[Setup]:
    """PostgreSQL with a synchronous standby (asynchronous for the negative control, with
    `unsafe_replication=1&failover_gap=0`), one URL naming both with target_session_attrs;
    the switch: kill -9 of the primary, promotion, pg_rewind, the old one attached back."""
    link = "127.0.0.62"  # the standby follows the primary here: the control cuts it
    with (
        ha_pair(synchronous=not unsafe, link=link) as (a, b),
        Partition() as partition,
        Forwarder(a.port) as to_a,
        Forwarder(b.port) as to_b,
    ):
        # Clients reach each server through a forwarder, which can lose its replies.
        hosts = ",".join(f"{LOOPBACK}:{proxy.port}" for proxy in (to_a, to_b))
        params = "&unsafe_replication=1&failover_gap=0" if unsafe else ""
        store = (
            f"postgresql://postgres@{hosts}/postgres"
            f"?target_session_attrs=read-write&connect_timeout=2{params}"
        )
        keys = dict(SEGMENT_KEYS)
        _make_keys(store, keys)
        pair = [a, b]

        def failover() -> str:
            old, new = pair
            if unsafe:  # the standby falls behind first (on the pair's first link only)
                partition.cut_address(link, old.port)
                time.sleep(2.0)
            switch(old, new, crash=True, before_promote=partition.heal)
            pair.reverse()
            return f"port {old.port} -> {new.port}"

        nodes = {"pg-a": Node("pg-a", a), "pg-b": Node("pg-b", b)}
        setup = Setup(
            "postgres-sync", store, keys, _segment_clients(), nodes, failover,
            bounds=dict(STORE_BOUNDS), proxies={"to-pg-a": to_a, "to-pg-b": to_b},
            splits={"standby-link": lambda: _cut(link, a.port)},
        )  # fmt: skip
        if unsafe:
            setup.unsafe_what = "asynchronous standby, unsafe_replication=1&failover_gap=0"
            setup.unsafe_fault = "failover"
        yield setup


@contextlib.contextmanager
def quorum_redis5(workdir: Path, unsafe: bool) -> Iterator[Setup]:
    """Quorum keys on five independent Redis nodes (appendfsync always), each on an address of
    its own so a client can be cut off from some; the key's bounds in a SQLite store. Callers
    through the library and through `idmint serve --quorum`. Negative control: nodes with no
    persistence at all (a restart comes back empty), accepted with QuorumOptions(unsafe)."""
    nodes = QuorumNodes(5, appendfsync=None if unsafe else "always")
    try:
        store = f"sqlite:///{workdir / 'store.db'}"
        keys = {"q": KeySpec("q", "quorum"), "q32": KeySpec("q32", "quorum", 1, B32_MAX)}
        with idmint.connect(store) as minter:
            minter.add_quorum_key("q")
            minter.add_quorum_key("q32", max=B32_MAX)
        urls = nodes.urls("t")
        spec = {"via": "lib", "kind": "quorum", "nodes": urls, "unsafe": unsafe}
        clients: list[tuple[str, dict[str, Any]]] = [
            (f"lib-q-{n}", {**spec, "key": "q", "batch": 1 + 4 * n}) for n in range(3)
        ]
        clients += [
            ("lib-q32-0", {**spec, "key": "q32", "batch": 10}),
            ("http-q-0", {"via": "http", "kind": "quorum", "key": "q", "batch": 5}),
        ]
        named = {
            name: Node(name, server, nodes.address(i, "a"))
            for i, (name, server) in enumerate(nodes.nodes().items())
        }
        setup = Setup(
            "quorum-redis5", store, keys, clients, named,
            serve_args=["--quorum", ",".join(urls), *(["--unsafe-nodes"] if unsafe else [])],
            bounds=dict(STORE_BOUNDS), power_cut_nodes=3,
        )  # fmt: skip
        if unsafe:
            setup.unsafe_what = "quorum nodes with no persistence (restarted empty)"
            setup.unsafe_fault = "power-cut"
        yield setup
    finally:
        nodes.close()


class _Member:
    """A cluster member as a nemesis node: start() does not wait for it to serve (with a
    majority down it cannot)."""

    def __init__(self, member: Any) -> None:
        self.member = member

    def kill(self) -> None:
        self.member.kill()

    def start(self) -> None:
        self.member.start(wait=False)

    def pause(self) -> None:
        self.member.pause()

    def resume(self) -> None:
        self.member.resume()


@contextlib.contextmanager
def _cluster(name: str, cluster: Any) -> Iterator[Setup]:
    """A three-member etcd or ZooKeeper cluster, each member on a loopback address of its own
    and in a cgroup of its own. Clients (and `idmint serve`) reach each member through a
    Forwarder, which can lose its replies (drop-replies), every URL naming all three. A
    partition cuts a member's client port (its address and port: the forwarder's link to it,
    so every client at once, whichever way it comes); a split cuts a member from its peers
    both ways (clusters.py, isolate()): a minority member that keeps its clients and has no
    quorum, or a leader that loses its followers."""
    with cluster, contextlib.ExitStack() as stack:
        proxies = {
            f"to-{m.name}": stack.enter_context(Forwarder(m.port, m.address))
            for m in cluster.members
        }
        hosts = ",".join(f"{LOOPBACK}:{proxy.port}" for proxy in proxies.values())
        store = f"{cluster.scheme}://{hosts}/t"
        keys = dict(SEGMENT_KEYS)
        _make_keys(store, keys)
        nodes = {m.name: Node(m.name, _Member(m), (m.address, m.port)) for m in cluster.members}
        yield Setup(
            name, store, keys, _segment_clients(), nodes, bounds=dict(STORE_BOUNDS),
            proxies=proxies, splits={m.name: m.isolate for m in cluster.members},
        )  # fmt: skip


def etcd3(workdir: Path, unsafe: bool) -> contextlib.AbstractContextManager[Setup]:
    """Three etcd members (Raft): kills, pauses, cuts and splits of members, a majority at
    times; replies lost after the write."""
    addresses = loopback_addresses(3, first=71)
    return _cluster("etcd-3", EtcdCluster(3, addresses=addresses, cgroups=True))


def zookeeper3(workdir: Path, unsafe: bool) -> contextlib.AbstractContextManager[Setup]:
    """Three ZooKeeper servers (ZAB), as etcd3."""
    addresses = loopback_addresses(3, first=74)
    return _cluster("zookeeper-3", ZooKeeperEnsemble(3, addresses=addresses, cgroups=True))


SETUPS: dict[str, Callable[[Path, bool], contextlib.AbstractContextManager[Setup]]] = {
    "sqlite": sqlite,
    "redis-replica": redis_replica,
    "postgres-sync": postgres_sync,
    "quorum-redis5": quorum_redis5,
    "etcd-3": etcd3,
    "zookeeper-3": zookeeper3,
    "cassandra-2dc": cassandra_2dc,
    "mariadb-semisync": mariadb_semisync,
}
#: Set-ups CI does not pick: three Cassandra nodes take 15-40 s to start and each node kill a
#: restart of 20-30 s, past CI's 90 s for the whole torture. bench/torture.py runs them.
SLOW = ("cassandra-2dc",)
#: The set-ups with a negative control (--unsafe).
UNSAFE = (
    "sqlite",
    "redis-replica",
    "postgres-sync",
    "quorum-redis5",
    "cassandra-2dc",
    "mariadb-semisync",
)
