"""Datacenter keys under faults, on real stores with the fault harness (tests/harness.py).

Two datacenters, processes in each, on etcd (a global etcd and one per datacenter) and on a
three-node Cassandra of two datacenters (tests/datacenters.py).

Every process records each call (start, end, id or error) and each range it drew; the checkers
find repeated ids, ids outside the ranges their process drew, and ranges drawn twice.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

import idmint
from idmint import InvalidArgument, KeyExists, Range, ReservationSizing, StoreUnavailable
from idmint.stores import open_engine
from idmint.stores.base import CasStore
from idmint.stores.engine import Engine
from idmint.strategies.datacenter import DatacenterRanges
from idmint.strategies.datacenter_cells import GlobalRow, LocalRow, global_cell, local_cell

from checks import works
from datacenters import (
    DCS,
    CassandraDatacenters,
    Datacenters,
    EtcdDatacenters,
    running,
)
from harness import (
    SOAK_SECONDS,
    Clock,
    History,
    Worker,
    duplicates,
    history,
    outside,
    overlaps,
    strays,
)
from server_cassandra import CassandraServer
from servers import wait_until

DC_WORKER = str(Path(__file__).with_name("dc_worker.py"))
LAST_ID = 2**31 - 1
_names = itertools.count()


@pytest.fixture(scope="module")
def etcd_dcs() -> Iterator[EtcdDatacenters]:
    with running(EtcdDatacenters) as topology:
        yield topology
        _close_engines()  # before the servers go


@pytest.fixture(scope="module")
def cassandra_dcs() -> Iterator[CassandraDatacenters]:
    with running(CassandraDatacenters) as topology:
        _race_schema(topology)
        yield topology
        _close_engines()


RACE_TABLES = ("race.local_serial", "race.serial")


def _race_schema(dcs: CassandraDatacenters) -> None:
    """The race test's keyspace and tables, made while the cluster is whole: a schema change
    after the faults of other tests can wait minutes for the nodes to agree (a CI run saw n3
    on another schema version until the test gave up)."""
    nodes = dcs.cluster.nodes
    sessions = [_session(nodes["n1"], "SERIAL"), _session(nodes["n3"], "SERIAL")]
    try:
        for statement in (
            "CREATE KEYSPACE IF NOT EXISTS race WITH replication = "
            "{'class': 'NetworkTopologyStrategy', 'dc1': 2, 'dc2': 1}",
            *(f"CREATE TABLE IF NOT EXISTS {t} (k int PRIMARY KEY, dc text)" for t in RACE_TABLES),
        ):
            wait_until(functools.partial(_answers, sessions[0], statement), 60, statement)
        for table in RACE_TABLES:  # known in dc2 too
            select = f"SELECT k FROM {table} LIMIT 1"
            wait_until(functools.partial(_answers, sessions[1], select), 60, table)
    finally:
        for session in sessions:
            session.cluster.shutdown()


@pytest.fixture(params=["etcd", "cassandra"])
def dcs(request: pytest.FixtureRequest) -> Datacenters:
    topology: Datacenters = request.getfixturevalue(f"{request.param}_dcs")
    return topology


_engines: dict[str, Engine] = {}
_local_stores: dict[tuple[str, str], CasStore] = {}


def _engine(url: str) -> Engine:
    """The test's own connection to a store, one per URL: a new driver session per read
    would load the test process (each reads the schema of every keyspace)."""
    if url not in _engines:
        _engines[url] = open_engine(url, timeout=10)
    return _engines[url]


def _close_engines() -> None:
    while _local_stores:
        _local_stores.popitem()[1].close()
    while _engines:
        _engines.popitem()[1].close()


_outputs: list[Path] = []  # where the workers write, under pytest's temporary directory


@pytest.fixture(autouse=True, scope="module")
def _module_resources(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    _outputs.append(tmp_path_factory.mktemp("workers"))
    yield
    _outputs.clear()


def _admin(dcs: Datacenters) -> DatacenterRanges:
    """The global level as dc1 sees it (the test's own reads and set-up)."""
    return DatacenterRanges(_engine(dcs.global_url("dc1")).cas())


def _new_key(dcs: Datacenters, prefix: str, reservation: int, **sizing: float) -> str:
    key = f"{prefix}{next(_names)}"
    sizing_ = ReservationSizing(min_reservation=reservation, max_reservation=reservation, **sizing)
    # The test's cached connection may be down for a few seconds after an earlier test cut or
    # restarted nodes (CI once saw NoHostAvailable: ConnectionShutdown here); the driver
    # reconnects by itself. A retry that finds the key made it: the name is this call's own.
    deadline = time.monotonic() + 30
    while True:
        try:
            _admin(dcs).add_key(key, step=50, last_id=LAST_ID, sizing=sizing_)
            return key
        except KeyExists:
            return key
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _worker(
    dcs: Datacenters,
    key: str,
    dc: str,
    n: int,
    *,
    rate: float,
    clock: Clock | None = None,
    extra: list[str] | None = None,
) -> Worker:
    argv = [DC_WORKER, dcs.global_url(dc), key, "--dc", dc, "--rate", str(rate)]
    argv += extra or []
    store = dcs.dc_store(dc)
    if store is not None:
        argv += ["--dc-store", store]
    if clock is not None:
        argv += ["--clock", str(clock.control)]
    return Worker(f"{dc}-{n}", argv, directory=_outputs[0] if _outputs else None)


def _top(dcs: Datacenters, key: str) -> GlobalRow:
    got = _admin(dcs).global_cas.read(global_cell(key))
    assert got is not None
    return GlobalRow.decode(got[0])


def _local_row(dcs: Datacenters, key: str, dc: str) -> LocalRow:
    """Datacenter `dc`'s cell, read through its own store (reachable while it is cut off)."""
    store = dcs.dc_store(dc)
    url = store or dcs.global_url(dc)
    if (url, dc) not in _local_stores:
        engine = _engine(url)
        _local_stores[url, dc] = engine.cas() if store else engine.local_cas(dc)
    got = _local_stores[url, dc].read(local_cell(key, dc))
    assert got is not None
    return LocalRow.decode(got[0])


def _counts(worker: Worker) -> dict[str, int]:
    lines = [line for line in worker.text().splitlines() if line.startswith("C ")]
    assert lines, f"{worker.name} printed no counts:\n{worker.text()[-2000:]}"
    counts: dict[str, int] = json.loads(lines[-1][2:])
    return counts


def _assert_safe(hist: History) -> None:
    """No id twice, none outside the key or the ranges its process drew, no range twice."""
    values = hist.values()
    assert values, "no id was handed out"
    assert not duplicates(values), f"repeated ids: {duplicates(values)[:10]}"
    assert not outside(values, 1, LAST_ID)
    assert not strays(hist), f"ids outside their process's ranges: {strays(hist)[:5]}"
    drawn = [(who, r) for who, ranges in hist.ranges.items() for r in ranges]
    assert not overlaps(drawn), f"ranges drawn twice: {overlaps(drawn)[:5]}"


def _stop(workers: list[Worker]) -> None:
    for w in workers:
        w.stop()


def _progress(workers: list[Worker], more_than: dict[str, int]) -> bool:
    return all(w.count() > more_than.get(w.name, 0) for w in workers)


def _serve_again(workers: list[Worker], when: str, timeout: float = 30) -> None:
    """Every worker serves more than it had (at first: serves at all), or a TimeoutError
    naming the stalled ones with their last words."""
    served = {w.name: w.count() for w in workers}
    try:
        wait_until(lambda: _progress(workers, served), timeout, f"every process to serve {when}")
    except TimeoutError as exc:
        # Which processes stalled, and the last things they said (errors, warnings): a
        # liveness failure in CI is otherwise a bare timeout.
        stalled = [w for w in workers if w.count() <= served[w.name]]
        said = {w.name: _last_words(w) for w in stalled}
        raise TimeoutError(f"{exc}: stalled {said}") from None


def _last_words(worker: Worker) -> list[str]:
    """A worker's first three errors in full (dc_worker's `#` lines) and its last five lines
    other than ids."""
    lines = [line for line in worker.text().splitlines() if not line.startswith("O ")]
    return [line for line in lines if line.startswith("# ")][:3] + lines[-5:]


def _checked(workers: list[Worker]) -> History:
    """What the workers recorded, checked by _assert_safe."""
    hist = history(workers)
    _assert_safe(hist)
    return hist


def test_a_datacenter_cut_off_keeps_serving_on_its_reservation(dcs: Datacenters) -> None:
    """dc2 is cut off from the global level until its preload of the next reservation (at half
    of 6,000 ids, 400 ids a second) has failed: no error in either datacenter, dc2's preload is
    retried until the link heals, and no id is handed out twice."""
    key = _new_key(dcs, "cut", 6000)
    workers = [_worker(dcs, key, dc, n, rate=200) for dc in DCS for n in range(2)]
    try:
        _serve_again(workers, "at first", 60)
        warm_at = time.monotonic()  # a cold keyspace's first calls may time out
        before = _top(dcs, key).grants["dc2"].seq
        with dcs.cut_off_dc2():
            cut_at = time.monotonic()
            probe = open_engine(dcs.global_url("dc2"), timeout=1)
            try:
                assert not works(probe.cas().read, global_cell(key)), "dc2 is not cut off"
            finally:
                probe.close()
            served = {w.name: w.count() for w in workers}
            wait_until(
                lambda: any("cannot preload" in w.text() for w in workers[2:]),
                40,
                "dc2's preload to fail",
            )
            assert _local_row(dcs, key, "dc2").preloaded is None
            assert _progress(workers, served), "a datacenter stopped serving during the cut"
            healed_at = time.monotonic()
            assert _top(dcs, key).grants["dc2"].seq == before  # no grant reached dc2
        wait_until(
            lambda: _top(dcs, key).grants["dc2"].seq > before, 60, "dc2's preload after the heal"
        )
        _serve_again(workers, "after the heal")
    finally:
        _stop(workers)
    hist = _checked(workers)
    errors = hist.errors(during=(warm_at, time.monotonic()))
    assert not errors, f"errors: {errors[:5]}"
    in_cut = [op for op in hist.ok if cut_at <= op.start and op.end <= healed_at]
    assert {op.process for op in in_cut} == {w.name for w in workers}
    assert sum(_counts(w)["preload_failures"] for w in workers if w.name.startswith("dc2")) > 0
    assert _top(dcs, key).grants["dc1"].seq >= 2  # dc1 reserved again meanwhile


def test_a_datacenter_that_spends_its_runway_fails_typed_and_recovers(dcs: Datacenters) -> None:
    """Reservations of 400 at 400 ids a second: dc2, cut off, spends its reservation and the
    preloaded one, then every call fails with RunwaySpent (dc1 serves on); after the heal
    dc2 serves again."""
    key = _new_key(dcs, "spent", 400)
    workers = [_worker(dcs, key, dc, 0, rate=400) for dc in DCS]
    try:
        _serve_again(workers, "at first", 60)
        warm_at = time.monotonic()
        with dcs.cut_off_dc2():
            cut_at = time.monotonic()
            wait_until(lambda: "RunwaySpent" in workers[1].text(), 30, "dc2 to spend its runway")
            time.sleep(1)
            healed_at = time.monotonic()
        _serve_again(workers, "after the heal")
    finally:
        _stop(workers)
    hist = _checked(workers)
    errors = hist.errors(during=(warm_at, time.monotonic()))
    # Say what dc1 met, and when against the cut: CI once saw dc1 fail here (not reproduced
    # in three runs alone), and the message did not say with what.
    dc1 = [
        (op.error, round(op.start - cut_at, 2), round(op.end - op.start, 2))
        for op in errors
        if op.process != "dc2-0"
    ]
    assert {op.process for op in errors} == {"dc2-0"}, (
        f"dc1 failed, or dc2 did not: (error, start after the cut, seconds) {dc1[:10]}; "
        f"the heal {healed_at - cut_at:.2f} s after the cut"
    )
    assert {op.error for op in errors} == {"RunwaySpent"}
    assert all(cut_at <= op.start <= healed_at + 5 for op in errors)
    assert _counts(workers[1])["runway_spent"] > 0


def test_the_checker_catches_a_global_level_at_local_serial(
    cassandra_dcs: CassandraDatacenters,
) -> None:
    """Negative control: with the global cell at LOCAL_SERIAL (each datacenter its own Paxos;
    connect() refuses it), dc2 cut off grants reservations that dc1 has granted too, and the
    checkers report ranges drawn twice and repeated ids."""
    dcs = cassandra_dcs
    key = _new_key(dcs, "unsafe", 200)
    with pytest.raises(InvalidArgument, match="needs serial=SERIAL"):
        idmint.connect(dcs.global_url("dc1") + "&serial=LOCAL_SERIAL", dc="dc1").keys()
    workers = [
        _worker(dcs, key, dc, 0, rate=1000, extra=["--unsafe-local-serial-global"]) for dc in DCS
    ]
    try:
        _serve_again(workers, "at first", 60)
        with dcs.cut_off_dc2():
            served = {w.name: w.count() for w in workers}
            # 1,000 ids each: five reservations of 200 in each datacenter
            wait_until(
                lambda: _progress(workers, {n: c + 1000 for n, c in served.items()}),
                60,
                "both datacenters to reserve in the cut",
            )
    finally:
        _stop(workers)
    hist = history(workers)
    drawn = [(who, r) for who, ranges in hist.ranges.items() for r in ranges]
    assert overlaps(drawn), "the checker missed ranges drawn by both datacenters"
    assert duplicates(hist.values()), "the checker missed repeated ids"
    with pytest.raises(AssertionError):
        _assert_safe(hist)


def _session(node: CassandraServer, serial: str) -> Any:
    """A driver session through `node` alone, for statements behind idmint's back."""
    from cassandra import ConsistencyLevel
    from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
    from cassandra.policies import WhiteListRoundRobinPolicy

    profile = ExecutionProfile(
        load_balancing_policy=WhiteListRoundRobinPolicy([node.host]),
        serial_consistency_level=getattr(ConsistencyLevel, serial),
        consistency_level=ConsistencyLevel.ONE,
        request_timeout=10,
    )
    cluster = Cluster(
        [node.host],
        port=node.port,
        protocol_version=3,
        execution_profiles={EXEC_PROFILE_DEFAULT: profile},
    )
    return cluster.connect()


def _both_won(cassandra_dcs: CassandraDatacenters, serial: str, rows: int) -> int:
    """Rows that both datacenters created with INSERT ... IF NOT EXISTS, sent at once from a
    coordinator in each, at `serial`."""
    nodes = cassandra_dcs.cluster.nodes
    table = f"race.{serial.lower()}"
    sessions = [_session(nodes["n1"], serial), _session(nodes["n3"], serial)]
    try:
        # The table was made with the cluster (_race_schema); nodes may still be catching up
        # after other tests' faults (commit log replays, hints): wait until both answer.
        for session in sessions:
            select = f"SELECT k FROM {table} LIMIT 1"
            wait_until(functools.partial(_answers, session, select), 60, table)
        insert = f"INSERT INTO {table} (k, dc) VALUES (%s, %s) IF NOT EXISTS"
        both = 0
        for k in range(rows):
            pairs = zip(sessions, DCS, strict=True)
            futures = [s.execute_async(insert, (k, dc)) for s, dc in pairs]
            both += all(_applied(f) for f in futures)
        return both
    finally:
        for s in sessions:
            s.cluster.shutdown()


def _applied(future: Any) -> bool:
    """Whether a lightweight transaction surely applied (a timed-out one may have: not
    counted, so timeouts can only hide a race, never show one)."""
    from cassandra import OperationTimedOut, WriteTimeout

    try:
        return bool(future.result().one()[0])
    except (WriteTimeout, OperationTimedOut):
        return False


def _answers(session: Any, statement: str) -> bool:
    """Whether the statement ran (the table may not be known there yet, the node busy)."""
    try:
        session.execute(statement)
    except Exception:
        return False
    return True


def test_local_serial_is_not_enough_across_datacenters_and_the_design_never_needs_it(
    cassandra_dcs: CassandraDatacenters,
) -> None:
    """The recipe's race: under LOCAL_SERIAL both datacenters win IF NOT EXISTS on one row
    (some of 200 rows), under SERIAL never. The design writes at LOCAL_SERIAL only cells that
    one datacenter alone writes (its own `dc/NAME@DC`); the shared global cell is at SERIAL,
    so the same race through DatacenterRanges, first reservations of 30 keys taken by both
    datacenters at once, never gives two datacenters one range."""
    assert _both_won(cassandra_dcs, "LOCAL_SERIAL", 200) > 0
    assert _both_won(cassandra_dcs, "SERIAL", 200) == 0

    dcs = cassandra_dcs
    keys = [_new_key(dcs, "race", 1000) for _ in range(30)]
    sides = {dc: idmint.connect(dcs.global_url(dc), dc=dc) for dc in DCS}
    taken: dict[str, list[Range]] = {dc: [] for dc in DCS}

    def first_reservations(dc: str) -> None:
        for key in keys:
            taken[dc].append(sides[dc].take(key, 10))

    threads = [threading.Thread(target=first_reservations, args=(dc,)) for dc in DCS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for minter in sides.values():
        minter.close()
    for i, key in enumerate(keys):
        top = _top(dcs, key)
        grants = {dc: (top.grants[dc].start, top.grants[dc].stop) for dc in DCS}
        assert grants["dc1"][1] <= grants["dc2"][0] or grants["dc2"][1] <= grants["dc1"][0]
        assert not overlaps([(dc, taken[dc][i]) for dc in DCS])


def test_a_fresh_keyspace_has_one_identity_whichever_datacenter_makes_it(
    cassandra_dcs: CassandraDatacenters,
) -> None:
    """The store's identity is made by a Paxos round across every datacenter, even through a
    LOCAL_SERIAL URL: with dc2 cut off while dc1 makes it, dc2 cannot make one of its own, and
    reads dc1's after the heal. At LOCAL_SERIAL dc2 made a second identity (its own Paxos
    group), the later write won, and a process that kept the other refused its datacenter's
    cell for good (CI, twice: the first Cassandra test of this module stalled on it)."""
    name = f"ident{os.getpid()}"
    engines = [
        open_engine(cassandra_dcs.cluster.store_url(name, dc, serial="LOCAL_SERIAL"), timeout=3)
        for dc in DCS
    ]
    dc1, dc2 = (engine.cas() for engine in engines)
    try:
        cast(Any, dc1)._open().init()  # the keyspace and its tables, no identity yet
        with cassandra_dcs.cut_off_dc2():
            made = dc1.identity()
            assert made is not None
            with pytest.raises(StoreUnavailable):
                dc2.identity()
        wait_until(lambda: works(dc2.identity), 60, "dc2 to read the identity after the heal")
        assert dc2.identity() == made
    finally:
        for engine in engines:
            engine.close()


# Last in the module: a Cassandra node killed or frozen here may leave the cluster in schema
# disagreement for minutes (a CI run's race test after it could not create its keyspace in 60 s).
def test_kill_9_pauses_cuts_and_clock_steps_repeat_no_id(dcs: Datacenters, tmp_path: Path) -> None:
    """Small reservations (300 ids: the reservation moves several times a second) while a
    nemesis kill -9s and pauses processes and store nodes, cuts dc2 off and steps the
    processes' wall clocks by an hour either way. Calls may fail while a store is down; no
    id is handed out twice."""
    key = _new_key(dcs, "chaos", 300, window=5)
    clocks = {dc: Clock(tmp_path / f"{dc}.clock") for dc in DCS}
    workers = [_worker(dcs, key, dc, n, rate=500, clock=clocks[dc]) for dc in DCS for n in (0, 1)]
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    nodes = dcs.nodes()
    log: list[str] = []
    try:
        _serve_again(workers, "at first", 60)
        deadline = time.monotonic() + SOAK_SECONDS
        while time.monotonic() < deadline:
            fault = rng.choice(["kill", "kill", "pause", "node", "freeze", "cut", "clock"])
            log.append(fault)
            if fault == "kill":
                w = rng.choice(workers)
                w.kill9()
                w.start()
            elif fault == "pause":
                w = rng.choice(workers)
                w.pause()
                time.sleep(rng.uniform(0.5, 2))
                w.resume()
            elif fault == "node":
                name, node = rng.choice(sorted(nodes.items()))
                log[-1] += f" {name}"
                node.kill()
                time.sleep(rng.uniform(0.2, 1))
                node.start()
            elif fault == "freeze":  # SIGSTOP: a hung node, its sockets open
                name, node = rng.choice(sorted(nodes.items()))
                log[-1] += f" {name}"
                node.pause()
                time.sleep(rng.uniform(0.5, 2))
                node.resume()
            elif fault == "cut":
                with dcs.cut_off_dc2():
                    time.sleep(rng.uniform(0.5, 3))
            else:
                clocks[rng.choice(DCS)].step(rng.choice([-3600, 3600]))
            time.sleep(rng.uniform(0.2, 1))
        _serve_again(workers, "after the faults", 60)
    finally:
        for w in workers:
            w.kill9()
    hist = _checked(workers)
    context = f"seed {seed}, faults {log}"
    assert {op.error for op in hist.errors()} <= {"StoreUnavailable", "RunwaySpent"}, context
    assert not any("Traceback" in w.text() for w in workers), context


def test_a_process_of_one_datacenter_runs_its_local_rounds_on_that_datacenters_nodes(
    cassandra_dcs: CassandraDatacenters,
) -> None:
    """A process of dc2 given dc1's URL (`?dc=dc1`) ran dc2's LOCAL_SERIAL rounds in dc1's
    Paxos group on main, apart from dc2's own processes (120 ids twice in 20 s): the URL won
    over --dc. Now that URL is refused at once; a URL without ?dc= reaching dc1's node first
    runs dc2's rounds on dc2's nodes only; a datacenter no node is in is refused before an id."""
    from cassandra.policies import HostDistance

    in_dc1 = cassandra_dcs.global_url("dc1")
    with pytest.raises(InvalidArgument, match=r"names datacenter 'dc1'.*serves datacenter 'dc2'"):
        idmint.connect(in_dc1, dc="dc2")
    plain = in_dc1.replace("&dc=dc1", "")
    assert "dc=" not in plain and plain.startswith("cassandra://127.0.0.1:")
    key = _new_key(cassandra_dcs, "placed", 1000)
    with idmint.connect(plain, dc="dc2") as minter:
        assert minter.segment(key).next_id() >= 1
        store = minter.store
        assert isinstance(store, DatacenterRanges)
        cluster = store.local_cas._conn._cluster  # type: ignore[attr-defined]
        policy = cluster.profile_manager.default.load_balancing_policy
        distances = {
            (host.address, host.datacenter): policy.distance(host)
            for host in cluster.metadata.all_hosts()
        }
        assert len(distances) == 3, distances
        for (_, dc), distance in distances.items():
            assert (distance == HostDistance.LOCAL) == (dc == "dc2"), distances
            assert distance in (HostDistance.LOCAL, HostDistance.IGNORED), distances
    nowhere = "no node of the cluster is in datacenter 'dc9'"
    with idmint.connect(plain, dc="dc9") as minter, pytest.raises(InvalidArgument, match=nowhere):
        minter.segment(key).next_id()


def test_a_cluster_not_answering_is_unavailable_not_a_wrong_datacenter() -> None:
    """CI caught it under kill -9: a process reconnecting while its contact points were down
    was told its datacenter was wrong (InvalidArgument, the driver had not learnt any node's
    datacenter) instead of StoreUnavailable, which callers retry."""
    engine = open_engine("cassandra://127.0.0.1:1/nowhere?dc=dc1", timeout=2)
    try:
        with pytest.raises(StoreUnavailable, match="unavailable"):
            engine.local_cas("dc1").read("a cell")
    finally:
        engine.close()
