"""The segment generator: preload, dynamic step, bounds, give-back, outages, close races."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

import idmint
from idmint import (
    Closed,
    Exhausted,
    KeyNotFound,
    Minter,
    Range,
    SegmentGenerator,
    SegmentOptions,
    StoreUnavailable,
)
from idmint.ids import UINT31_MAX
from idmint.stores.memory import MemoryRangeStore

from checks import assert_increasing, assert_unique, assert_within, run_threads
from faulty import FaultyStore


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


@pytest.fixture
def memory() -> MemoryRangeStore:
    return MemoryRangeStore()


@pytest.fixture
def minter(store_url: str) -> Iterator[Minter]:
    m = idmint.connect(store_url)
    yield m
    m.close()


def test_ids_increase_and_are_unique_across_threads(memory: MemoryRangeStore) -> None:
    memory.add_key("k", step=100, first_id=1, last_id=10**12)
    gen = SegmentGenerator(memory, "k", SegmentOptions(max_step=5000))
    per_thread: list[list[int]] = []

    def worker() -> None:
        ids = [gen.next_id() for _ in range(30_000)] + gen.next_ids(20_000)
        per_thread.append(ids)

    run_threads(worker, 8)
    for ids in per_thread:
        assert_increasing(ids)
    assert assert_unique(i for ids in per_thread for i in ids) == 8 * 50_000
    gen.close()


def test_next_range_is_loaded_when_ten_percent_is_used(memory: MemoryRangeStore) -> None:
    memory.add_key("k", step=1000, first_id=1, last_id=10**9)
    store = FaultyStore(memory)
    gen = SegmentGenerator(store, "k")
    assert gen.next_id() == 1
    wait_for(lambda: not gen.stats().refilling)
    assert store.calls == 1 and gen.stats().next is None
    gen.next_ids(98)  # 99 ids used: below 10%
    time.sleep(0.05)
    assert store.calls == 1
    gen.next_ids(2)  # the 100th and 101st id cross the mark
    wait_for(lambda: gen.stats().next is not None)
    assert store.calls == 2
    assert gen.stats().next == Range(1001, 3001)  # twice the step: the range lasted < 15 min
    gen.close()


def test_dynamic_step_doubles_holds_and_halves() -> None:
    store = MemoryRangeStore()
    store.add_key("k", step=10, first_id=1, last_id=10**12)
    now = [0.0]
    options = SegmentOptions(preload_at=1.0, max_step=80, grow_below=10, shrink_above=20)
    gen = SegmentGenerator(store, "k", options, clock=lambda: now[0])
    sizes = []
    for advance in (0, 1, 1, 1, 1, 15, 25, 25, 25, 25):
        now[0] += advance
        first = gen.next_id()  # preload_at=1.0: the refill happens here, in step with the clock
        current = gen.stats().current
        assert current is not None and current.start == first
        sizes.append(len(current))
        gen.next_ids(current.stop - first - 1)  # drain it
    # 10 (the key's step), doubling up to max_step 80, held at 80 for a 15 s range, then halved
    # down to the key's step.
    assert sizes == [10, 20, 40, 80, 80, 80, 40, 20, 10, 10]
    gen.close()


def test_32bit_key_to_exhaustion(store_url: str) -> None:
    with idmint.connect(store_url) as minter:
        minter.add_key("k32", step=700, start=UINT31_MAX - 4999, max=UINT31_MAX)
        gen = minter.segment("k32")
        ids = []
        with pytest.raises(Exhausted, match="k32"):
            while True:
                ids.append(gen.next_id())
        assert ids == list(range(UINT31_MAX - 4999, UINT31_MAX + 1))
        with pytest.raises(Exhausted):
            gen.next_ids(1)
        assert minter.key("k32").remaining == 0


def test_graceful_restart_resumes_at_the_next_unused_id(store_url: str) -> None:
    with idmint.connect(store_url) as minter:
        minter.add_key("order", step=1000, start=100_000_000)
        gen = minter.segment("order")
        ids = gen.next_ids(150)  # past the preload mark: a second range is buffered too
        wait_for(lambda: gen.stats().next is not None)
    with idmint.connect(store_url) as minter:
        assert minter.segment("order").next_id() == ids[-1] + 1
        stats = minter.segment("order").stats()
    assert stats.issued == 1
    with idmint.connect(store_url) as minter:
        assert minter.key("order").max_id == ids[-1] + 2


def test_density_after_close(memory: MemoryRangeStore) -> None:
    memory.add_key("k", step=100, first_id=1, last_id=10**9)
    gen = SegmentGenerator(memory, "k")
    gen.next_ids(250)
    running = gen.stats()
    assert running.held > 0 and running.density == 1.0  # nothing used up is lost yet
    gen.close()
    stats = gen.stats()
    assert stats.closed and stats.issued == 250
    assert stats.taken - stats.given_back == 250 and stats.density == 1.0


def test_give_back_fails_when_someone_allocated_after(memory: MemoryRangeStore) -> None:
    memory.add_key("k", step=100, first_id=1, last_id=10**9)
    gen = SegmentGenerator(memory, "k", SegmentOptions(preload_at=1.0))
    gen.next_ids(10)
    memory.allocate("k")  # another process
    gen.close()
    assert memory.get_key("k").max_id == 201
    assert gen.stats().given_back == 0 and gen.stats().density == 0.1


def test_raise_is_picked_up_by_the_next_range(memory: MemoryRangeStore) -> None:
    memory.add_key("k", step=10, first_id=1, last_id=10**9)
    gen = SegmentGenerator(memory, "k", SegmentOptions(preload_at=1.0))
    assert gen.next_id() == 1
    memory.raise_floor("k", 5000)
    ids = gen.next_ids(10)
    assert ids[:9] == list(range(2, 11))  # the range held is served out
    assert ids[9] == 5000


def test_key_added_while_running(memory: MemoryRangeStore) -> None:
    minter = Minter(memory, segment_options=SegmentOptions(retry_after=0.0))
    gen = minter.segment("late")
    with pytest.raises(KeyNotFound, match="late"):
        gen.next_id()
    minter.add_key("late", start=7)
    assert gen.next_id() == 7
    minter.close()


def test_store_down_serves_buffer_then_fails_fast_then_recovers(memory: MemoryRangeStore) -> None:
    memory.add_key("k", step=100, first_id=1, last_id=10**9)
    store = FaultyStore(memory)
    gen = SegmentGenerator(store, "k", SegmentOptions(max_step=100, wait=0.5))
    gen.next_ids(50)
    wait_for(lambda: gen.stats().next is not None)
    store.down = True
    served = gen.next_ids(150)  # what is buffered keeps flowing
    assert served[-1] == 200
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        gen.next_id()
    assert time.monotonic() - started < 0.5 + 0.2  # within the configured bound
    started = time.monotonic()
    for _ in range(100):  # while the refill keeps failing, errors come at once
        with pytest.raises(StoreUnavailable, match="down"):
            gen.next_id()
    assert time.monotonic() - started < 0.1
    store.down = False
    wait_for(lambda: gen.stats().next is not None)  # recovered in the background
    assert gen.next_id() > 200
    gen.close()


def test_slow_store_times_out_within_the_bound(memory: MemoryRangeStore) -> None:
    memory.add_key("k", step=10, first_id=1, last_id=10**9)
    store = FaultyStore(memory)
    store.delay = 1.0
    gen = SegmentGenerator(store, "k", SegmentOptions(wait=0.2))
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"within 0\.2 s"):
        gen.next_id()
    assert time.monotonic() - started < 0.4
    wait_for(lambda: gen.stats().next is not None)  # the slow answer still arrives
    assert gen.next_id() == 1
    gen.close()


def test_a_range_whose_commit_failed_is_never_served(memory: MemoryRangeStore) -> None:
    memory.add_key("k", step=10, first_id=1, last_id=10**9)
    store = FaultyStore(memory)
    store.fail_after = 1
    gen = SegmentGenerator(store, "k", SegmentOptions(max_step=10))
    wait_for(lambda: gen.stats().next is not None)
    assert store.allocations[0] == Range(1, 11)  # committed, but reported as failed
    assert gen.next_ids(10) == list(range(11, 21))
    gen.close()


def test_closed_generator_raises(memory: MemoryRangeStore) -> None:
    memory.add_key("k", step=10, first_id=1, last_id=10**9)
    gen = SegmentGenerator(memory, "k")
    gen.next_id()
    gen.close()
    gen.close()  # twice is fine
    with pytest.raises(Closed):
        gen.next_id()
    with pytest.raises(Closed):
        gen.next_ids(5)


@pytest.mark.parametrize("round_", range(20))
def test_close_while_threads_draw_never_duplicates(round_: int) -> None:
    store = MemoryRangeStore()
    store.add_key("k", step=50, first_id=1, last_id=10**12)
    taken: list[int] = []
    lock = threading.Lock()

    def run(gen: SegmentGenerator) -> None:
        mine = []
        try:
            while True:
                mine.append(gen.next_id())
                mine += gen.next_ids(3)
        except Closed:
            pass
        with lock:
            taken.extend(mine)

    for _ in range(5):  # five generations of a process on one key, each closed mid-flight
        gen = SegmentGenerator(store, "k", SegmentOptions(max_step=200))
        threads = [threading.Thread(target=run, args=(gen,)) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.002 * (round_ % 5 + 1))
        gen.close()
        for t in threads:
            t.join()
    assert_unique(taken)
    assert_within(taken, 1, store.get_key("k").max_id - 1)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="preload_at"):
        SegmentOptions(preload_at=2)
    with pytest.raises(ValueError, match="max_step"):
        SegmentOptions(max_step=0)
    with pytest.raises(ValueError, match="bad key name"):
        SegmentGenerator(MemoryRangeStore(), "no spaces")
    with pytest.raises(ValueError, match="count"):
        SegmentGenerator(MemoryRangeStore(), "k").next_ids(0)


def test_try_next_never_waits(memory: MemoryRangeStore) -> None:
    memory.add_key("k", step=10, first_id=1, last_id=10**9)
    store = FaultyStore(memory)
    store.delay = 0.3
    gen = SegmentGenerator(store, "k", SegmentOptions(max_step=10, wait=2.0))
    started = time.monotonic()
    assert gen.try_next_id() is None  # the first range is still on its way
    assert gen.try_next_ids(5) == []
    assert time.monotonic() - started < 0.1
    assert gen.next_ids(15) == list(range(1, 16))  # waits for the ranges
    store.delay = 0.0
    wait_for(lambda: gen.stats().next is not None)
    store.delay = 0.3
    got = gen.try_next_ids(50)  # what is buffered, and no more
    assert got == list(range(16, 31))
    assert gen.try_next_id() is None
    assert gen.next_id() == 31
    gen.close()


def test_issued_without_the_lock_agrees_with_stats(memory: MemoryRangeStore) -> None:
    memory.add_key("counted", step=10, first_id=1, last_id=10**6)
    gen = SegmentGenerator(memory, "counted")
    assert gen.issued() == 0
    gen.next_ids(37)  # across several ranges
    assert gen.issued() == gen.stats().issued == 37
    gen.close()
    assert gen.issued() == gen.stats().issued == 37
