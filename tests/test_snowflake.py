"""Snowflake layouts and the generator under a controlled clock: steps back, full ticks, fences."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idmint import ClockMovedBackwards, LeaseLost, WorkerInUse, WorkersExhausted
from idmint.layout import JS53, LAYOUTS, SONYFLAKE, TWITTER, Layout
from idmint.stores import open_lease_store
from idmint.stores.base import LeaseStore
from idmint.stores.memory import MemoryLeaseStore
from idmint.stores.static import StaticLeaseStore
from idmint.strategies.snowflake import SnowflakeGenerator, SnowflakeOptions

from checks import assert_increasing, assert_unique, run_threads

START_MS = 1_795_000_000_000  # 2026-11-18, inside every preset's time


class FakeClock:
    """A wall clock the test moves; time.time_ns's signature."""

    def __init__(self, ms: int = START_MS) -> None:
        self.ns = ms * 1_000_000

    def __call__(self) -> int:
        return self.ns

    def step_ms(self, ms: float) -> None:
        self.ns += int(ms * 1_000_000)


@given(
    name=st.sampled_from(sorted(LAYOUTS)),
    data=st.data(),
)
def test_compose_and_decode_are_inverses(name: str, data: st.DataObject) -> None:
    layout = LAYOUTS[name]
    ticks = data.draw(st.integers(0, layout.max_ticks))
    worker = data.draw(st.integers(0, layout.workers - 1))
    seq = data.draw(st.integers(0, layout.sequences - 1))
    i = layout.compose(ticks, worker, seq)
    assert 0 <= i < 2**layout.bits
    parts = layout.decode(i)
    assert (parts.ticks, parts.worker, parts.sequence) == (ticks, worker, seq)
    assert layout.compose(parts.ticks, parts.worker, parts.sequence) == i


@given(
    time_bits=st.integers(1, 50),
    worker_bits=st.integers(1, 12),
    seq_bits=st.integers(1, 12),
    worker_low=st.booleans(),
    data=st.data(),
)
def test_custom_layouts_round_trip(
    time_bits: int, worker_bits: int, seq_bits: int, worker_low: bool, data: st.DataObject
) -> None:
    if time_bits + worker_bits + seq_bits > 63:
        with pytest.raises(ValueError, match="at most 63"):
            Layout("x", time_bits, worker_bits, seq_bits)
        return
    if (1 << time_bits) * 3 >= 253_402_300_800_000:  # ticks of 3 ms past the year 9999
        with pytest.raises(ValueError, match="year 9999"):
            Layout("x", time_bits, worker_bits, seq_bits, tick_ms=3)
        return
    layout = Layout("x", time_bits, worker_bits, seq_bits, tick_ms=3, worker_low=worker_low)
    i = data.draw(st.integers(0, 2**layout.bits - 1))
    parts = layout.decode(i)
    assert layout.compose(parts.ticks, parts.worker, parts.sequence) == i


def test_presets() -> None:
    assert (TWITTER.time_bits, TWITTER.worker_bits, TWITTER.sequence_bits) == (41, 10, 12)
    assert TWITTER.decode(1861905812123455488).worker == 425
    assert (SONYFLAKE.tick_ms, SONYFLAKE.sequence_bits, SONYFLAKE.worker_bits) == (10, 8, 16)
    assert JS53.bits <= 53 and 2**JS53.bits <= 2**53
    assert TWITTER.capacity_per_s == 4_096_000
    assert TWITTER.end.year == 2080 and SONYFLAKE.end.year == 2188
    with pytest.raises(ValueError, match="not an id"):
        JS53.decode(2**60)


def make(
    clock: FakeClock,
    store: LeaseStore | None = None,
    layout: str | Layout = "twitter",
    options: SnowflakeOptions | None = None,
) -> SnowflakeGenerator:
    return SnowflakeGenerator(store or MemoryLeaseStore(), layout, options, clock_ns=clock)


def test_ids_carry_time_worker_and_sequence() -> None:
    clock = FakeClock()
    gen = make(clock)
    ids = gen.next_ids(5)
    assert [gen.decode(i).sequence for i in ids] == [0, 1, 2, 3, 4]
    assert {gen.decode(i).unix_ms for i in ids} == {START_MS}
    clock.step_ms(1)
    assert gen.decode(gen.next_id()).sequence == 0
    gen.close()


def test_a_full_tick_waits_for_the_next() -> None:
    layout = Layout("tiny", 41, 4, 2, tick_ms=1, epoch_ms=0)  # 4 ids per tick
    clock = FakeClock()
    gen = make(clock, layout=layout)
    assert len(gen.next_ids(4)) == 4
    threading.Timer(0.05, clock.step_ms, (1,)).start()
    fifth = gen.next_id()  # waits until the clock moves on
    assert gen.decode(fifth).unix_ms == START_MS + 1
    gen.close()


def test_small_step_back_is_waited_out() -> None:
    clock = FakeClock()
    gen = make(clock, options=SnowflakeOptions(max_backstep_ms=5))
    first = gen.next_id()
    clock.step_ms(-3)
    threading.Timer(0.05, clock.step_ms, (4,)).start()
    second = gen.next_id()  # same tick, drawn on: unique and increasing
    assert second > first


def test_large_step_back_raises_until_the_clock_catches_up() -> None:
    clock = FakeClock()
    gen = make(clock, options=SnowflakeOptions(max_backstep_ms=5))
    ids = [gen.next_id()]
    clock.step_ms(1)
    ids.append(gen.next_id())
    clock.step_ms(-1000)
    with pytest.raises(ClockMovedBackwards, match=r"100\d ms") as info:
        gen.next_id()
    assert info.value.behind_ms >= 999
    assert gen.stats()["rollbacks"] == 1
    clock.step_ms(1001)
    ids.append(gen.next_id())
    assert_increasing(ids)
    gen.close()


def test_a_jump_forward_moves_the_horizon_first() -> None:
    clock = FakeClock()
    store = MemoryLeaseStore()
    gen = make(clock, store)
    gen.next_id()
    clock.step_ms(3_600_000)  # +1 h: far past the lease's horizon
    i = gen.next_id()
    assert gen.decode(i).unix_ms == START_MS + 3_600_000
    [row] = store.holders("default")
    assert row.horizon_ms >= START_MS + 3_600_000  # recorded before the id was issued
    gen.close()


def test_a_new_holder_issues_only_above_the_old_horizon() -> None:
    store = MemoryLeaseStore()
    two = Layout("two", 41, 1, 12, epoch_ms=TWITTER.epoch_ms)  # worker ids 0 and 1
    ahead = FakeClock(START_MS + 2000)
    old = make(ahead, store, two, options=SnowflakeOptions(ttl=1.0))
    old_ids = old.next_ids(10)
    # The old holder dies without releasing; its lease expires by the store's clock.
    old._keeper._stop.set()
    time.sleep(1.1)
    # Worker 1 is busy, so the new holder must take worker 0 although its floor is ahead.
    store.acquire("default", workers=2, ttl=60, horizon_ms=START_MS, now_ms=START_MS)
    behind = FakeClock(START_MS)  # the new holder's clock is 2 s behind the old one's
    threading.Timer(0.1, behind.step_ms, (3100,)).start()
    new = make(behind, store, two, options=SnowflakeOptions(ttl=1.0))
    assert new.worker_id == old.worker_id == 0
    new_ids = new.next_ids(10)  # waits for its clock to pass the old horizon
    assert min(new.decode(i).unix_ms for i in new_ids) > max(old.decode(i).unix_ms for i in old_ids)
    assert_unique(old_ids + new_ids)


def test_renewal_failure_stops_issuing_at_the_deadline() -> None:
    clock = FakeClock()
    store = MemoryLeaseStore()
    gen = make(clock, store, options=SnowflakeOptions(ttl=1.0))
    gen.next_id()
    gen._keeper._stop.set()  # no more renewals, as when the store is unreachable
    time.sleep(0.6)  # past ttl minus the 0.5 s margin
    clock.step_ms(1)
    with pytest.raises(LeaseLost):
        gen.next_id()


def test_threads_share_a_generator() -> None:
    clock = FakeClock()
    gen = make(clock, layout=Layout("small", 41, 4, 8, epoch_ms=0))
    got: list[list[int]] = []
    lock = threading.Lock()

    def draw() -> None:
        mine = [gen.next_id() for _ in range(600)]
        with lock:
            got.append(mine)

    ticker = threading.Event()

    def tick() -> None:
        while not ticker.wait(0.002):
            clock.step_ms(1)

    threading.Thread(target=tick, daemon=True).start()
    try:
        run_threads(draw, 4)
    finally:
        ticker.set()
    for mine in got:
        assert_increasing(mine)
    assert_unique(i for mine in got for i in mine)


def test_random_start_and_sonyflake_order() -> None:
    clock = FakeClock()
    gen = make(clock, layout="sonyflake", options=SnowflakeOptions(random_start=True))
    ids = gen.next_ids(3)
    parts = [gen.decode(i) for i in ids]
    assert parts[0].sequence < 100 and [p.sequence for p in parts] == list(
        range(parts[0].sequence, parts[0].sequence + 3)
    )
    assert {p.worker for p in parts} == {gen.worker_id}
    assert_increasing(ids)


def test_all_worker_ids_taken_names_the_namespace() -> None:
    clock = FakeClock()
    store = MemoryLeaseStore()
    layout = Layout("two", 41, 1, 12, epoch_ms=0)
    held = [make(clock, store, layout, SnowflakeOptions(namespace="orders")) for _ in range(2)]
    with pytest.raises(WorkersExhausted, match="'orders'"):
        make(clock, store, layout, SnowflakeOptions(namespace="orders"))
    held[0].close()
    assert make(clock, store, layout, SnowflakeOptions(namespace="orders")).worker_id == 0


def test_refuses_a_layout_past_its_end_of_time() -> None:
    short = Layout("short", 20, 4, 4, tick_ms=1, epoch_ms=START_MS - 2**20 - 5)
    with pytest.raises(ValueError, match="ran out of time"):
        make(FakeClock(), layout=short)


def test_static_worker_keeps_its_horizon_across_a_step_back(tmp_path: Path) -> None:
    state = tmp_path / "worker7.json"
    clock = FakeClock()
    gen = SnowflakeGenerator(StaticLeaseStore(7, state), "twitter", clock_ns=clock)
    first = gen.next_ids(3)
    gen._keeper._stop.set()
    gen._closed = True  # dies without a release: its horizon stays at now + ttl, locked
    store = StaticLeaseStore(7, state)
    with pytest.raises(WorkerInUse, match="held by another process"):
        store.acquire("default", workers=1024, ttl=10, horizon_ms=START_MS)
    gen._keeper.store._file.close()  # type: ignore[attr-defined]
    stepped_back = FakeClock(START_MS - 60_000)  # restarted with the clock a minute back
    with pytest.raises(ClockMovedBackwards):
        SnowflakeGenerator(
            store, "twitter", SnowflakeOptions(max_floor_wait=1), clock_ns=stepped_back
        ).next_id()
    assert store._file is not None
    store._file.close()
    later = FakeClock(START_MS + 20_000)
    again = SnowflakeGenerator(StaticLeaseStore(7, state), "twitter", clock_ns=later)
    assert again.worker_id == 7
    assert_unique(first + again.next_ids(3))
    again.close()


def test_after_a_jump_forward_a_restart_takes_a_worker_id_usable_now(tmp_path: Path) -> None:
    # A host's clock jumped an hour ahead; it issued, then closed (its horizon stays an hour
    # ahead: it issued there). After the clock is corrected, a new generator must not sit on
    # that worker id for an hour: it takes a free one it can use at once.
    store = open_lease_store(f"sqlite:///{tmp_path / 'jump.db'}")
    identity = store.identity()
    assert identity is not None and identity.created_ms is not None
    # A real store's clock: the right time is past the new store's first ttl (its quarantine).
    right = identity.created_ms + 11_000
    jumped = make(FakeClock(right + 3_600_000), store)
    late = jumped.next_id()
    jumped.close()
    corrected = make(FakeClock(right), store)
    assert corrected.worker_id == 1
    ids = corrected.next_ids(100)  # at once: no ClockMovedBackwards
    assert_unique([late, *ids])
    corrected.close()
    store.close()


def test_the_keeper_counts_on_the_ttl_the_store_granted(zookeeper_server: Any) -> None:
    # The test ZooKeeper caps sessions at 20 s; a 60 s lease there ends 20 s after its holder
    # is cut off, so the holder must stop (and renew) by 20 s, not 60.
    store = open_lease_store(zookeeper_server.store_url("granted"))
    with SnowflakeGenerator(store, options=SnowflakeOptions(ttl=60)) as gen:
        assert gen._keeper.lease().ttl == 20.0
        assert gen._keeper.deadline_in() <= 20.0
    store.close()
