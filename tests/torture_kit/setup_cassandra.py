"""The torture set-up `cassandra-2dc`: Apache Cassandra in two datacenters (tests/datacenters.py:
n1 and n2 in dc1, n3 in dc2, one keyspace replicated dc1:2, dc2:1), datacenter keys served in
both, segment keys beside them.

- Datacenter keys: `dc` (64-bit) and `dc32` (32-bit), taken through the library by processes of
  each datacenter (each on its own datacenter's URL: its cell at LOCAL_SERIAL on its own nodes,
  the global cell at SERIAL), and through an `idmint serve --dc dc2` over HTTP and
  idmint.Client.
- Segment keys (plain, 32-bit, striped, snowflake, ranges straight from the store) on the same
  cluster at SERIAL, through dc1's nodes.
- Faults: kill -9 and SIGSTOP of each node, clients cut off from a node's CQL port, and the
  splits: dc2 cut off from dc1 (`cut_off_dc2`: the strategy's promise is that both sides keep
  serving), and n1 cut off from n2 (dc1's LOCAL_SERIAL needs both: dc1 serves from what it
  holds, its segment keys from SERIAL through n3).

Negative control (`--unsafe`): a datacenter moved to another store while its processes still
serve, which `idmint dc reset` says not to do. Processes named dc2 whose store is the keyspace at
SERIAL through dc1's nodes (`--dc-store`) run beside dc2's own (LOCAL_SERIAL on n3): one
keyspace, two Paxos groups, so the binding of dc2 to its store refuses whichever side it does
not name. The control's "failover" resets the binding to the other side (`dc reset`, as an
operator who moved the datacenter would), alternately: the side now bound reads dc2's cell as the
other side left it and serves the same reservation beside it. The nemesis cuts dc2 off often
(then the two groups see nothing of each other's writes).

Before the binding named where a store's compare-and-sets are decided, it took no reset: the
same processes, at LOCAL_SERIAL in dc1, were bound to the keyspace's identity like dc2's own,
and repeated ids (seed 1: 5,190) with nothing refused.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import idmint
from idmint import ReservationSizing, StoreUnavailable

from datacenters import DCS, CassandraDatacenters
from harness import Partition
from server_cassandra import CassandraServer

if TYPE_CHECKING:
    from .setups import Setup

#: A datacenter's reservation (ids): at the clients' rates (tens of thousands of ids a second
#: a datacenter on this machine) the reservation and the preloaded one last well past the
#: longest cut the nemesis makes (4 s) and the preload's retries after it.
RESERVATION = 2_000_000
#: Ids a datacenter client takes per call: enough for millions of checked ids in a long run,
#: few enough calls for the checker.
DC_BATCH = 1000
#: The 64-bit datacenter key's last id (a key's max is below 2**63 - 1).
DC_MAX = 2**63 - 2


@contextlib.contextmanager
def cassandra_2dc(workdir: Path, unsafe: bool) -> Iterator[Setup]:
    # setups.py imports this module to register it: its names are imported here, at run time.
    from .setups import B32_MAX, B32_START, STORE_BOUNDS, KeySpec, Node, Setup, _make_keys

    # Not datacenters.running(): its heal_all() on the way out would also lift the cuts of
    # other harness runs on this machine (torture() heals what a killed run left, at its start).
    dcs = CassandraDatacenters()
    with contextlib.closing(dcs):
        segment_url = _url(dcs, "dc1")
        keys = {
            "seg": KeySpec("seg", "segment"),
            "b32": KeySpec("b32", "segment", B32_START, B32_MAX),
            "str": KeySpec("str", "segment", increasing=False),  # a stripe move may go down
            "flake": KeySpec("flake", "snowflake"),
            "dc": KeySpec("dc", "datacenter", 1, DC_MAX),
            "dc32": KeySpec("dc32", "datacenter", B32_START, B32_MAX),
        }
        _retry(lambda: _make_keys(segment_url, keys))
        sizing = ReservationSizing(min_reservation=RESERVATION, max_reservation=RESERVATION)
        _retry(lambda: _make_dc_keys(segment_url, sizing, B32_START, B32_MAX))
        seg = {"via": "lib", "url": segment_url}
        clients: list[tuple[str, dict[str, Any]]] = [
            ("lib-seg-0", {**seg, "kind": "segment", "key": "seg", "batch": 20}),
            ("lib-b32-0", {**seg, "kind": "segment", "key": "b32", "batch": 20}),
            ("lib-str-0", {**seg, "kind": "segment", "key": "str", "batch": 20}),
            ("lib-take-0", {**seg, "kind": "take", "key": "seg", "batch": 5}),
            ("lib-flake-0", {**seg, "kind": "snowflake", "key": "flake", "batch": 50}),
        ]
        for dc in DCS:
            spec = {"via": "lib", "kind": "datacenter", "url": _url(dcs, dc), "dc": dc}
            clients += [
                (f"lib-dc-{dc}-{n}", {**spec, "key": "dc", "batch": DC_BATCH}) for n in range(2)
            ]
            clients.append((f"lib-dc32-{dc}-0", {**spec, "key": "dc32", "batch": DC_BATCH}))
            # A range from the datacenter's cell every call: a LOCAL_SERIAL round each.
            clients.append((f"lib-take-dc-{dc}", {**spec, "kind": "take", "key": "dc", "batch": 5}))
        # Through `idmint serve --dc dc2` (the set-up's store is dc2's URL: the server's).
        served = {"kind": "datacenter", "batch": 50}
        clients += [
            ("http-dc-dc2", {**served, "via": "http", "key": "dc"}),
            ("client-dc32-dc2", {**served, "via": "client", "key": "dc32"}),
        ]
        cluster = dcs.cluster
        nodes = {
            name: Node(name, node, (node.host, node.port)) for name, node in cluster.nodes.items()
        }
        splits: dict[str, Callable[[], Partition]] = {"dc2 cut off": dcs.cut_off_dc2}
        if not unsafe:  # the control wants dc2 cut off each time its fault comes
            splits["n1|n2"] = lambda: _cut_between(cluster.nodes["n1"], cluster.nodes["n2"])
        setup = Setup(
            "cassandra-2dc", dcs.global_url("dc2"), keys, clients, nodes,
            serve_args=["--dc", "dc2"], bounds={**STORE_BOUNDS, **BOUNDS}, splits=splits,
        )  # fmt: skip
        if unsafe:
            # dc2's cells through dc1's nodes at SERIAL: the keyspace, another Paxos group.
            shared = dcs.global_url("dc1")
            setup.clients += [
                (
                    f"unsafe-dc2-on-dc1-store-{n}",
                    {
                        "via": "lib",
                        "kind": "datacenter",
                        "key": key,
                        "batch": DC_BATCH,
                        "url": dcs.global_url("dc2"),
                        "dc": "dc2",
                        "dc_store": shared,
                    },
                )
                for n, key in enumerate(("dc", "dc32"))
            ]
            setup.unsafe_what = "dc2 reset to another Paxos group of its keyspace while serving"
            sides = [shared, None]  # the next `dc reset` binds dc2 to sides[0]

            def reset() -> str:
                store = sides[0]
                with idmint.connect(dcs.global_url("dc2"), timeout=10) as minter:
                    dcs2 = minter.datacenters("dc2", dc_store=store)
                    for key in ("dc", "dc32"):
                        _retry(lambda key=key: dcs2.reset(key))  # type: ignore[misc]
                sides.reverse()
                return "dc2 reset to " + ("SERIAL through dc1" if store else "its own nodes")

            setup.switch = reset
            setup.unsafe_fault = "failover"
        yield setup


#: Outages (s) per fault where Cassandra's differ from STORE_BOUNDS. A node killed is out for
#: Cassandra's restart (5 to 30 s on this loaded 2-core machine) and the driver's reconnection:
#: dc2 has one node, and dc1's LOCAL_SERIAL needs both of its own, so the processes' buffers
#: hide only the first seconds of it. A split costs nothing by the strategy's promise (each
#: side serves from what it holds), but its bound is per kind and overlapping faults count in
#: it: as STORE_BOUNDS.
BOUNDS = {"kill-node": 45.0}


def _url(dcs: CassandraDatacenters, dc: str) -> str:
    """Datacenter `dc`'s URL naming each of its nodes: a process started while one is down
    still connects (dc1's LOCAL_SERIAL needs both of its nodes; SERIAL any two of the three)."""
    cluster = dcs.cluster
    first, *others = cluster.addresses(dc)
    url = dcs.global_url(dc)
    return url.replace(f"//{first}:", f"//{','.join((first, *others))}:", 1)


def _make_dc_keys(url: str, sizing: ReservationSizing, first: int, last: int) -> None:
    with idmint.connect(url) as minter:
        for name, start, top in (("dc", 1, DC_MAX), ("dc32", first, last)):
            with contextlib.suppress(idmint.KeyExists):  # a retry after a timed-out create
                minter.add_datacenter_key(name, step=50, start=start, max=top, sizing=sizing)


def _retry(make: Callable[[], None], seconds: float = 60.0) -> None:
    """A fresh cluster's first schema changes and Paxos rounds may time out: again, a while."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            make()
            return
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _cut_between(a: CassandraServer, b: CassandraServer) -> Partition:
    """Two nodes cut from each other on the storage port (both still reach the third): what
    each one's processes send to the other, told apart by their cgroups (harness.Partition)."""
    cut = Partition()
    for src, dst in ((a, b), (b, a)):
        assert src.cgroup is not None  # CassandraCluster gives each node one
        cut.cut_from_cgroup(src.cgroup, dst.host, dst.storage_port)
    return cut
