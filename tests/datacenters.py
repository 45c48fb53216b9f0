"""Two datacenters' stores on this machine, for the fault tests and bench/datacenter.py.

- etcd: a global etcd and one etcd per datacenter. The global one also listens on 127.0.0.11
  (dc1's processes use it) and 127.0.0.12 (dc2's): cutting .12 cuts dc2 off;
- Cassandra: n1 + n2 in dc1, n3 in dc2, keyspaces replicated dc1:2, dc2:1; the global cell
  at SERIAL, each datacenter's cell at LOCAL_SERIAL. Cutting n3 from n1 and n2 cuts dc2 off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import ClassVar, Protocol, TypeVar

from harness import Node, Partition, heal_all
from server_cassandra import CassandraCluster
from server_etcd import EtcdServer
from servers import LOOPBACK

DCS = ("dc1", "dc2")
STORE = "dcfaults"  # one keyspace (etcd prefix) for every key


class Datacenters(Protocol):
    """Two datacenters' stores: where each one's processes find the global level and their
    own, how to cut dc2 off, and the store nodes a nemesis may kill."""

    def global_url(self, dc: str) -> str: ...
    def dc_store(self, dc: str) -> str | None: ...
    def cut_off_dc2(self) -> Partition: ...
    def nodes(self) -> Mapping[str, Node]: ...
    def close(self) -> None: ...


class EtcdDatacenters:
    ADDRESSES: ClassVar[dict[str, str]] = {"dc1": "127.0.0.11", "dc2": "127.0.0.12"}

    def __init__(self) -> None:
        self.top = EtcdServer(addresses=(LOOPBACK, *self.ADDRESSES.values()))
        self.local = {dc: EtcdServer() for dc in DCS}
        for server in (self.top, *self.local.values()):
            server.start()

    def global_url(self, dc: str) -> str:
        return self.top.store_url(STORE, self.ADDRESSES[dc])

    def dc_store(self, dc: str) -> str | None:
        return self.local[dc].store_url(STORE)

    def cut_off_dc2(self) -> Partition:
        cut = Partition()
        cut.cut_address(self.ADDRESSES["dc2"], self.top.port)
        return cut

    def nodes(self) -> Mapping[str, Node]:
        return {"global": self.top, **{f"{dc}-etcd": s for dc, s in self.local.items()}}

    def close(self) -> None:
        for server in (self.top, *self.local.values()):
            server.close()


class CassandraDatacenters:
    def __init__(self) -> None:
        self.cluster = CassandraCluster()
        self.cluster.start()

    def global_url(self, dc: str) -> str:
        return self.cluster.store_url(STORE, dc)

    def dc_store(self, dc: str) -> str | None:
        return None  # the same cluster, at LOCAL_SERIAL in the datacenter

    def cut_off_dc2(self) -> Partition:
        n3 = self.cluster.nodes["n3"]
        assert n3.cgroup is not None
        cut = Partition()
        cut.isolate_node(n3.cgroup, n3.host, self.cluster.storage_port)
        return cut

    def nodes(self) -> Mapping[str, Node]:
        return self.cluster.nodes

    def close(self) -> None:
        self.cluster.close()


TOPOLOGIES: dict[str, Callable[[], Datacenters]] = {
    "etcd": EtcdDatacenters,
    "cassandra": CassandraDatacenters,
}
T = TypeVar("T", bound=Datacenters)


@contextlib.contextmanager
def running(make: Callable[[], T]) -> Iterator[T]:
    """A set-up started, with no cut left over before or after (a killed run's)."""
    heal_all()
    topology = make()
    try:
        yield topology
    finally:
        heal_all()
        topology.close()
