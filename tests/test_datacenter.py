"""Datacenter ranges (strategies/datacenter.py): two levels of compare-and-set cells.

Here on one store per test (both levels and every datacenter's cells in it, as on one Cassandra
cluster) over every engine, and on in-process stores for the bookkeeping; partitions, kill -9
and store restarts are in test_datacenter_faults.py.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
from dataclasses import replace

import pytest

import idmint
from idmint import (
    DatacenterRanges,
    DatacenterRetired,
    Exhausted,
    InvalidArgument,
    Range,
    ReservationSizing,
    StoreUnavailable,
)
from idmint.stores import fences, open_engine
from idmint.stores.base import CasStore
from idmint.stores.memory import MemoryCasStore
from idmint.strategies.datacenter_cells import GlobalRow, LocalRow, global_cell, local_cell
from idmint.strategies.refills import SegmentOptions
from idmint.strategies.segment import SegmentGenerator

from checks import assert_disjoint, assert_unique, assert_within
from servers import wait_until


def _global_row(dcs: DatacenterRanges, name: str) -> GlobalRow:
    got = dcs.global_cas.read(global_cell(name))
    assert got is not None
    return GlobalRow.decode(got[0])


def test_two_datacenters_on_every_engine(cas_store_url: str) -> None:
    """Two datacenters, two generators each, on one store: every id once, each process's ids
    inside its datacenter's reservations, and reservations disjoint."""

    # A round trip may take 10 s, not the default 2: the subject is uniqueness, and CI once saw
    # one Cassandra Paxos read time out at 2 s early in the run (RunwaySpent in a thread).
    def cas() -> CasStore:
        return open_engine(cas_store_url, timeout=10).cas()

    engine_cas = cas()
    eu = DatacenterRanges(engine_cas, engine_cas, "eu")
    us = DatacenterRanges(cas(), cas(), "us")
    eu.add_key("order", step=50, last_id=2**31 - 1, sizing=ReservationSizing(min_reservation=400))
    ids: dict[str, list[int]] = {"eu": [], "us": []}
    lock = threading.Lock()

    def work(dcs: DatacenterRanges) -> None:
        gen = SegmentGenerator(dcs, "order", SegmentOptions(wait=10))
        got = [gen.next_id() for _ in range(1500)]
        gen.close()
        with lock:
            ids[dcs.dc].extend(got)

    threads = [threading.Thread(target=work, args=(d,)) for d in (eu, us, eu, us)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert assert_unique(ids["eu"] + ids["us"]) == 6000
    assert_within(ids["eu"] + ids["us"], 1, 2**31 - 1)
    status = {s.dc: s for s in eu.status("order")}
    assert set(status) == {"eu", "us"}
    assert status["eu"].grants >= 4  # 3000 ids at 400 a reservation, minus what went back
    # One global compare-and-set won per reservation: the counts match the global cell, once
    # the preloads the last allocations started in the background are in.

    def counts_match() -> bool:
        top = _global_row(eu, "order")
        won = sum(d.counts.global_cas - d.counts.global_conflicts for d in (eu, us))
        # Binding a datacenter to its store rides on its first grant: no write of its own.
        return won == top.grants["eu"].seq + top.grants["us"].seq and len(top.stores) == 2

    wait_until(counts_match, 10, "the global compare-and-sets won to match the grants")
    eu.close()
    us.close()


def _pair(
    sizing: ReservationSizing | None = None, *, last_id: int = 2**31 - 1, step: int = 10
) -> tuple[DatacenterRanges, DatacenterRanges, MemoryCasStore]:
    """Two datacenters with stores of their own, as on etcd (the global level is a third)."""
    top = MemoryCasStore("memory://global")
    eu = DatacenterRanges(top, MemoryCasStore("memory://eu"), "eu")
    us = DatacenterRanges(top, MemoryCasStore("memory://us"), "us")
    eu.add_key(
        "k", step=step, last_id=last_id, sizing=sizing or ReservationSizing(min_reservation=100)
    )
    return eu, us, top


def test_a_datacenter_preloads_its_next_reservation_at_half() -> None:
    eu, _, _ = _pair(ReservationSizing(min_reservation=100, preload_at=0.5))
    eu.allocate("k", 40)
    assert _global_row(eu, "k").grants["eu"].seq == 1
    eu.allocate("k", 10)  # 50 of 100 handed out: the next reservation is loaded now
    for _ in range(200):
        if eu.status("k")[0].preloaded:
            break
        threading.Event().wait(0.01)
    status = eu.status("k")[0]
    assert status.preloaded == (101, 201)
    assert status.left == 150
    assert eu.allocate("k", 60).range == Range(51, 101)  # the end of the reservation: shorter
    assert eu.allocate("k", 10).range == Range(101, 111)  # then the preloaded one
    assert eu.counts.grants == 2


def test_reservations_are_sized_by_the_rate_over_the_window() -> None:
    clock = [1_000_000]
    top = MemoryCasStore()
    sizing = ReservationSizing(
        runway=100.0, window=10.0, min_reservation=50, max_reservation=100_000, preload_at=1.0
    )
    eu = DatacenterRanges(top, MemoryCasStore(), "eu", clock_ms=lambda: clock[0])
    eu.add_key("k", step=10, last_id=10**9, sizing=sizing)
    eu.allocate("k", 3)
    first = _global_row(eu, "k").grants["eu"]
    assert (first.seq, first.stop - first.start) == (1, 50)  # no rate known yet: the minimum
    # 30 ids a second (3 every 100 ms): the reservation runs out after 1.7 s, when the rate
    # over the window so far is known (after a tenth of the window).
    while _global_row(eu, "k").grants["eu"].seq == 1:
        clock[0] += 100
        eu.allocate("k", 3)
    grant = _global_row(eu, "k").grants["eu"]
    assert grant.rate is not None and 25 <= grant.rate <= 35
    assert grant.stop - grant.start == math.ceil(grant.rate * 100)


def test_reservations_stay_between_the_minimum_and_the_maximum() -> None:
    sizing = ReservationSizing(min_reservation=100, max_reservation=300).for_key(1, 10**9)
    assert sizing.size(None) == 100
    assert sizing.size(0.0001) == 100  # 8.64 ids a day
    assert sizing.size(1.0 / 86400 * 200) == 200
    assert sizing.size(1e9) == 300
    default = ReservationSizing().for_key(1, 2**31 - 1)
    assert default.min_reservation == 10_000_000  # a 32-bit key: 1/64 of it is more
    assert default.max_reservation == (2**31 - 1) // 8
    small = ReservationSizing().for_key(1, 6400)
    assert (small.min_reservation, small.max_reservation) == (100, 800)


def test_a_bounded_key_hands_out_every_id_once_across_datacenters() -> None:
    """A 1,000-id key, reservations of 64 and a short last one: every id goes to exactly one
    process of one datacenter, then Exhausted in both."""
    eu, us, _ = _pair(ReservationSizing(min_reservation=64, max_reservation=64), last_id=1000)
    got: list[int] = []
    lock = threading.Lock()

    def drain(dcs: DatacenterRanges) -> None:
        while True:
            try:
                r = dcs.allocate("k", 7).range
            except Exhausted:
                return
            with lock:
                got.extend(r)

    threads = [threading.Thread(target=drain, args=(d,)) for d in (eu, us, eu, us)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(1, 1001))
    with pytest.raises(Exhausted):
        eu.allocate("k")


def test_a_grant_made_but_not_applied_is_applied_once() -> None:
    """A crash between the global compare-and-set and the local one leaves a grant recorded
    for the datacenter: the next process applies that grant, not a new one."""
    eu, _, top = _pair()
    eu.allocate("k")
    row = eu._local_row("k")[0]
    crashed = eu._grant("k", row)  # the global half only
    assert crashed is not None
    grant, _ = crashed
    again = DatacenterRanges(top, eu.local_cas, "eu")
    again.allocate("k", 100)  # the rest of the first reservation
    assert again.allocate("k", 10).range == Range(grant.start, grant.start + 10)
    assert _global_row(eu, "k").grants["eu"].seq == 2
    assert _global_row(eu, "k").next == grant.stop


def test_retire_gives_the_unused_ids_to_the_other_datacenter() -> None:
    eu, us, _ = _pair(ReservationSizing(min_reservation=100, preload_at=0.5))
    eu.allocate("k", 60)  # [1, 61); the preload takes [101, 201) in the background
    for _ in range(200):
        if eu.status("k")[0].preloaded:
            break
        threading.Event().wait(0.01)
    back = eu.retire("k")
    assert back == [Range(61, 101), Range(101, 201)]
    assert eu.retire("k") == []  # once only
    with pytest.raises(DatacenterRetired):
        eu.allocate("k")
    taken = [us.allocate("k", 100).range for _ in range(3)]
    assert taken[0] == Range(61, 161)  # what eu gave back first, merged
    assert taken[1] == Range(161, 201)  # the rest of it: shorter
    assert taken[2].start >= 201
    eu.reopen("k")
    assert eu.allocate("k", 10).range.start >= 201
    assert_disjoint([*taken, Range(1, 61)])


def test_a_retired_datacenters_unapplied_grant_goes_back_too() -> None:
    eu, us, _ = _pair()
    eu.allocate("k")
    eu._grant("k", eu._local_row("k")[0])  # recorded, never applied
    back = eu.retire("k")
    assert Range(101, 201) in back
    assert us.allocate("k", 100).range == Range(11, 111)  # eu's unused tail and the grant


def _failover(cas: CasStore, cell: str, replica_had: str, gap: int = 1_000_000) -> None:
    """What a failover does to one cell: the replica's copy (`replica_had`, without the lost
    primary's later writes) comes back, fenced as the stores fence it (stores/fences.py)."""
    got = cas.read(cell)
    assert got is not None
    fenced = fences.fenced(cell, replica_had, gap)
    assert fenced is not None
    assert cas.swap(cell, got[1], fenced)


def test_a_fenced_datacenter_cell_gives_up_what_it_holds_and_skips_its_grants() -> None:
    """The lost primary may have served the reservation's rest, the preloaded range, and up
    to gap + 1 grants it applied: the cell keeps none of them, and its next grant is
    numbered past them all."""
    eu, _, _ = _pair()
    eu.allocate("k", 30)
    cell = local_cell("k", "eu")
    row = replace(
        eu._local_row("k")[0], preloaded=(101, 201), applied=2, returning=((5, 9),), issued=30
    )
    fenced = LocalRow.decode(fences.fenced(cell, row.encode(), 1000) or "")
    assert fenced == replace(row, next=row.stop, preloaded=None, returning=(), applied=1004)
    assert fenced.left == 0
    assert fences.fenced(cell, row.encode(), 0) == row.encode()  # gap 0: no fence
    reopened = replace(row, start=0, stop=0, next=0, preloaded=None)
    assert LocalRow.decode(fences.fenced(cell, reopened.encode(), 10) or "").next == 0


def test_a_fenced_global_cell_moves_past_two_maximum_reservations_per_datacenter() -> None:
    """gap + 2 maximum reservations for each datacenter it knows (one at least), never past
    one above the last id, never down; the ranges given back are dropped."""
    eu, us, _ = _pair(ReservationSizing(min_reservation=100, max_reservation=300))
    cell = global_cell("k")

    def fenced(row: GlobalRow, gap: int = 1000) -> GlobalRow:
        return GlobalRow.decode(fences.fenced(cell, row.encode(), gap) or "")

    fresh = _global_row(eu, "k")
    assert fenced(fresh).next == 1 + 1000 + 2 * 300  # no datacenter yet: one counts
    eu.allocate("k")
    us.allocate("k")
    row = replace(_global_row(eu, "k"), free=((3, 7),))
    assert fenced(row) == replace(row, next=row.next + 1000 + 2 * 2 * 300, free=())
    ending = replace(row, last_id=row.next + 50)
    assert fenced(ending).next == ending.last_id + 1  # spent: Exhausted, never a wrap
    spent = replace(row, next=row.last_id + 1)
    assert fenced(spent).next == row.last_id + 1
    assert fences.fenced(cell, row.encode(), 0) == row.encode()


def _settled(*dcs: DatacenterRanges) -> None:
    """Wait for the background grants allocations started (preloads) to be in."""
    wait_until(lambda: not any(d._preloading for d in dcs), 10, "the preloads")


def test_a_datacenter_store_failover_never_applies_a_grant_again() -> None:
    """The datacenter's own store fails over, losing the application of grant 3 and the ids
    served from it (the global cell keeps the grant): the fenced cell takes a new grant. With
    the fence as it was (`next` moved within the reservation only), the replica's cell applied
    grant 3 again, from its start: 50 of 50 ids repeated."""
    eu, _, _ = _pair(ReservationSizing(min_reservation=100, max_reservation=100, preload_at=1))
    cell = local_cell("k", "eu")
    served = [eu.allocate("k", 100).range]  # grant 1, spent: grant 2 is loaded
    _settled(eu)
    got = eu.local_cas.read(cell)
    assert got is not None
    served.append(eu.allocate("k", 100).range)  # on the lost primary: grant 2, then 3
    _settled(eu)
    served.append(eu.allocate("k", 50).range)
    _failover(eu.local_cas, cell, got[0])
    for _ in range(3):
        served.append(eu.allocate("k", 50).range)
        _settled(eu)
    assert_disjoint(served)
    assert served[3].start >= 301  # grant 3 skipped, never reused
    assert eu.status("k")[0].grants > 1_000_002


def test_a_global_store_failover_skips_every_grant_it_may_have_lost() -> None:
    """The global store fails over, losing grants of us (applied and served in its own
    store): reservations of 10 million, a gap of 1 million. eu's next grants stay clear of
    them; with the fence as it was, eu's next reservation overlapped one of us by 9 million."""
    size = 10_000_000
    eu, us, top = _pair(ReservationSizing(min_reservation=size, max_reservation=size))
    served = [eu.allocate("k", size).range, us.allocate("k", 10).range]  # eu preloads
    _settled(eu, us)
    got = top.read(global_cell("k"))
    assert got is not None
    for _ in range(2):  # the rest of us's first grant, then its second: the third preloads
        served.append(us.allocate("k", size).range)
        _settled(us)
    _failover(top, global_cell("k"), got[0])
    for d in (eu, eu, us):
        served.append(d.allocate("k", size).range)
        _settled(d)
    assert_disjoint(served)


def test_a_lost_datacenter_cell_is_refused_until_reset() -> None:
    eu, _, top = _pair()
    first = eu.allocate("k", 5).range
    wiped = DatacenterRanges(top, MemoryCasStore(), "eu")  # its store lost everything
    with pytest.raises(InvalidArgument, match=r"lost its data.*idmint dc reset k --dc eu"):
        wiped.allocate("k")
    wiped.reset("k")
    after = wiped.allocate("k", 5).range
    assert after.start >= 101  # the lost reservation is skipped, never reused
    assert_disjoint([first, after])


def test_a_key_made_again_is_refused() -> None:
    """The datacenter serves the reservations it holds, then refuses grants of the new key."""
    eu, _, top = _pair()
    eu.allocate("k", 100)
    top._cells.pop(global_cell("k"))
    eu.add_key("k", step=10, last_id=10**6)
    with pytest.raises(StoreUnavailable, match="made again"):
        for _ in range(30):
            eu.allocate("k", 10)


def test_bad_input_is_refused() -> None:
    top = MemoryCasStore()
    with pytest.raises(InvalidArgument, match="datacenter name"):
        DatacenterRanges(top, MemoryCasStore(), "e u")
    keys = DatacenterRanges(top)
    keys.add_key("k", step=10, last_id=100)
    with pytest.raises(InvalidArgument, match="which datacenter"):
        keys.allocate("k")
    with pytest.raises(InvalidArgument, match="stripes"):
        keys.add_key("s", step=10, last_id=100, stripes=2)
    with pytest.raises(InvalidArgument, match="cannot be raised"):
        keys.raise_floor("k", 50)
    with pytest.raises(InvalidArgument, match="runway"):
        keys.add_key("r", step=10, last_id=100, sizing=ReservationSizing(runway=0))
    with pytest.raises(InvalidArgument, match="min reservation"):
        ReservationSizing(min_reservation=10, max_reservation=5).check()


def test_the_minter_api(tmp_path: pytest.TempPathFactory) -> None:
    """connect(dc=) serves datacenter keys through the usual calls; minter.datacenter() gives
    a generator for any datacenter; both levels on SQLite files here."""
    top = f"sqlite:///{tmp_path}/global.db"
    with idmint.connect(top) as minter:
        minter.add_datacenter_key(
            "order", step=10, max=2**31 - 1, sizing=ReservationSizing(min_reservation=1000)
        )
        eu = minter.datacenter("order", "eu", dc_store=f"sqlite:///{tmp_path}/eu.db")
        us = minter.datacenter("order", "us", dc_store=f"sqlite:///{tmp_path}/us.db")
        in_eu, in_us = [eu.next_id() for _ in range(50)], [us.next_id() for _ in range(50)]
        assert_unique(in_eu + in_us)
        # One reservation of 1,000 each, [1, 1001) and [1001, 2001), whichever came first.
        assert {(i - 1) // 1000 for i in in_eu} != {(i - 1) // 1000 for i in in_us}
        assert len({(i - 1) // 1000 for i in in_eu + in_us}) == 2
        with pytest.raises(InvalidArgument, match="own store"):
            minter.datacenter("order", "asia")  # SQLite spans no datacenters
    with idmint.connect(top, dc="us", dc_store=f"sqlite:///{tmp_path}/us.db") as minter:
        assert [k.name for k in minter.keys()] == ["order"]  # noqa: SIM118 - a method
        taken = minter.take("order", 5)
        assert (taken.start - 1) // 1000 == (min(in_us) - 1) // 1000
        assert minter.segment("order").next_id() in range(taken.stop, 2001)


def test_a_cell_made_by_another_process_meanwhile_is_not_taken_for_lost() -> None:
    """First use in two processes of one datacenter at once: one finds no cell, then the other
    makes it and takes the first grant before the global cell is read. That grant must not
    read as a lost cell."""
    top, local = MemoryCasStore(), MemoryCasStore()
    first = DatacenterRanges(top, local, "eu")
    first.add_key("k", step=10, last_id=10**6, sizing=ReservationSizing(min_reservation=100))

    class Slow:
        """The datacenter's store, with the other process's first use run during this one's
        first read of its cell (after the read has found nothing)."""

        raced = False

        def read(self, cell: str) -> tuple[str, int] | None:
            got = local.read(cell)
            if not self.raced:
                self.raced = True
                first.allocate("k", 5)
            return got

        def __getattr__(self, name: str) -> object:
            return getattr(local, name)

    second = DatacenterRanges(top, Slow(), "eu")  # type: ignore[arg-type]
    assert second.allocate("k", 5).range == Range(6, 11)


def test_a_datacenter_server_stays_ready_while_its_global_store_is_frozen(
    tmp_path: pytest.TempPathFactory,
) -> None:
    """On main `/readyz` answered 503 "store not reachable" while the global store was frozen,
    though ids kept coming: a readiness probe took every pod of the cut-off datacenter out.
    Ready now means it can hand out ids now; the global level is reported beside it."""
    import httpx

    from http_server import ServerProcess
    from server_etcd import EtcdServer

    top = EtcdServer()
    top.start()
    server = None
    try:
        url = top.store_url("ready")
        with idmint.connect(url) as minter:
            minter.add_datacenter_key(
                "order", max=2**31 - 1, sizing=ReservationSizing(min_reservation=100_000)
            )
        eu = ["--dc", "eu", "--dc-store", f"sqlite:///{tmp_path}/eu.db", "--timeout", "0.5"]
        server = ServerProcess(url, args=eu).start()

        def get(path: str) -> httpx.Response:
            return httpx.get(server.url + path, timeout=10)

        assert get("/api/segment/get/order").text == "1"
        wait_until(lambda: "global level reachable" in get("/readyz").text, 10, "ready")
        top.pause()
        try:
            served = [int(get("/api/segment/get/order").text) for _ in range(20)]
            assert served == sorted(set(served))

            def cut_off() -> bool:
                probe = get("/readyz")
                assert probe.status_code == 200, probe.text
                return "global level not reachable" in probe.text

            wait_until(cut_off, 15, "/readyz to report the global level cut off")
            assert "shortest runway: key order" in get("/readyz").text
            stats = get("/v1/stats").json()["datacenter"]
            assert stats["global"]["reachable"] is False and stats["global"]["error"]
            assert 'idmint_dc_global_up{dc="eu"} 0.0' in get("/metrics").text
            # dc status failed while the global store was down; it shows eu's own cell now.
            argv = ["--store", url, "--timeout", "0.5", "dc", "status", "order", *eu[:4]]
            status = subprocess.run(
                [sys.executable, "-m", "idmint", *argv],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert status.returncode == 0, status.stderr
            assert "global store does not answer" in status.stderr
            assert status.stdout.splitlines()[1].split()[:2] == ["eu", "1..100000"], status.stdout
        finally:
            top.resume()
    finally:
        if server is not None:
            server.stop()
        top.close()
