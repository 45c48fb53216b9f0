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

Negative control (`--unsafe`): dc2 served from its store and, by two more processes, from a copy
of its keyspace that holds the store's identity (as a keyspace restored from a snapshot of it
would). The control's "failover" restores the copy again: dc2's cells copied from the store as
they are. Nothing tells the copy from the store, so the copy's processes serve the reservation
dc2's own are serving, and the checker sees its ids twice.

The control before it (issue 32) ran processes of dc2 on the keyspace at SERIAL through dc1's
nodes beside dc2's own at LOCAL_SERIAL, one keyspace decided by two Paxos groups, and moved the
binding between them with `dc reset`: it found that a process on the wrong side served what the
cell held until its next grant (seed 1: 801,600 ids twice). The cell now names the store that
last wrote it (`LocalRow.scope`), and such a process is refused at its first read of it. Before
the binding named where a store's compare-and-sets are decided, the same processes at
LOCAL_SERIAL in dc1 were accepted with no reset at all, and repeated ids (seed 1: 5,190).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import idmint
from idmint import ReservationSizing, StoreUnavailable
from idmint.stores import open_engine
from idmint.strategies.datacenter_cells import local_cell

from datacenters import DCS, STORE, CassandraDatacenters
from harness import Partition
from server_cassandra import CassandraCluster, CassandraServer, keyspace_name

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
            # Processes of dc2 on a copy of its keyspace (deciding as dc2 does, at LOCAL_SERIAL
            # in dc2), the store's identity and dc2's cells copied into it: nothing tells the
            # copy from the store, and both serve dc2's reservation.
            clone = cluster.store_url(f"{STORE}copy", "dc2", serial="LOCAL_SERIAL")
            _copy_identity(cluster, dcs.global_url("dc2"), clone)
            # dc2's cells made and granted, then copied: the copy's processes serve from the
            # start (the run waits for every client's first ids before its faults begin)
            with idmint.connect(dcs.global_url("dc2"), timeout=10) as minter:
                for key in ("dc", "dc32"):
                    _retry(lambda key=key: minter.datacenter(key, "dc2").next_id())  # type: ignore[misc]
            _copy_cells(cluster, ("dc", "dc32"))

            def copy_again() -> str:
                _copy_cells(cluster, ("dc", "dc32"))
                return "dc2's cells copied to the copy of its keyspace"

            # The control's "failover": the copy restored again from the store, dc2's cells as
            # they are now (the copy's processes could not start before: a cell missing while
            # the global cell shows grants is refused as lost, LostReservations).
            setup.switch = copy_again
            setup.unsafe_fault = "failover"
            setup.clients += [
                (
                    f"unsafe-dc2-on-a-copy-{n}",
                    {
                        "via": "lib",
                        "kind": "datacenter",
                        "key": key,
                        "batch": DC_BATCH,
                        "url": dcs.global_url("dc2"),
                        "dc": "dc2",
                        "dc_store": clone,
                    },
                )
                for n, key in enumerate(("dc", "dc32"))
            ]
            setup.unsafe_what = "dc2 served from its store and from a copy with its identity"
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


def _copy_identity(cluster: CassandraCluster, url: str, copy: str) -> None:
    """Make the keyspace of `copy` (idmint's tables) with the identity of `url`'s: what a
    keyspace restored from a snapshot of the other one holds (its cells are made as used)."""
    identities = []
    for each in (url, copy):
        with contextlib.closing(open_engine(each, timeout=10)) as engine:
            _retry(lambda engine=engine: identities.append(engine.cas().identity()))  # type: ignore[misc]
    made = identities[0]
    assert made is not None
    keyspace = keyspace_name(f"{STORE}copy")
    cluster.nodes["n3"].execute(
        f"INSERT INTO {keyspace}.idmint_meta (name, id, created_ms) VALUES (%s, %s, %s)",
        ("store", made.id, made.created_ms),
    )


def _copy_cells(cluster: CassandraCluster, keys: tuple[str, ...]) -> None:
    """dc2's cells of `keys` copied from the keyspace to its copy (value and version, as a
    restore would have them), read on dc2's node."""
    node = cluster.nodes["n3"]
    source, copy = keyspace_name(STORE), keyspace_name(f"{STORE}copy")
    for key in keys:
        rows = node.execute(
            f"SELECT name, value, version FROM {source}.idmint_cells WHERE name = %s",
            (local_cell(key, "dc2"),),
        )
        for row in rows:
            node.execute(
                f"INSERT INTO {copy}.idmint_cells (name, value, version) VALUES (%s, %s, %s)",
                (row["name"], row["value"], row["version"]),
            )


def _retry(make: Callable[[], object], seconds: float = 60.0) -> None:
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
