"""Stripes and compare-and-set back-off, through the segment generator, on every engine.

The store contract suite checks what one allocation does on a stripe; this file checks what
generators make of it: each serves its own stripe, together they use up a bounded key exactly,
they spread over the stripes when they contend, and contending clients back off at random
rather than in lockstep.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from idmint import Exhausted, SegmentGenerator, SegmentOptions, StoreUnavailable
from idmint.ids import UINT31_MAX, Range
from idmint.stores import open_engine
from idmint.stores.base import RangeStore
from idmint.stores.over_cas.ranges import Backoff, CasRangeStore
from idmint.strategies.refills import RefillPool

from checks import assert_disjoint, assert_unique, run_threads


@pytest.fixture
def ranges(store_url: str) -> Iterator[RangeStore]:
    engine = open_engine(store_url)
    yield engine.ranges()
    engine.close()


def test_a_generator_serves_its_stripe(ranges: RangeStore) -> None:
    ranges.add_key("s", step=5, first_id=10, last_id=10_000, stripes=4)
    with SegmentGenerator(ranges, "s", SegmentOptions(stripe=2)) as gen:
        ids = [gen.next_id() for _ in range(40)]
        assert gen.stats().stripe == 2 and gen.stats().stripes == 4
    assert ids == list(range(12, 12 + 40 * 4, 4))


def test_a_stripe_the_key_lacks_is_a_clear_error(ranges: RangeStore) -> None:
    ranges.add_key("s", step=5, first_id=1, last_id=10_000, stripes=2)
    with (
        SegmentGenerator(ranges, "s", SegmentOptions(stripe=7)) as gen,
        pytest.raises(ValueError, match="stripe must be an integer from 0 to 1"),
    ):
        gen.next_id()


def test_generators_use_up_a_striped_32_bit_key_exactly(ranges: RangeStore) -> None:
    first = UINT31_MAX - 999
    ranges.add_key("s32", step=13, first_id=first, last_id=UINT31_MAX, stripes=5)
    got: list[int] = []
    ends: list[int | None] = []
    lock = threading.Lock()
    options = SegmentOptions(retry_after=0.0, wait=5.0)

    def drain() -> None:
        mine = []
        with SegmentGenerator(ranges, "s32", options) as gen:
            while True:
                try:
                    mine.append(gen.next_id())
                except Exhausted as exc:
                    ends.append(exc.stripe)  # None: the whole key, not one stripe
                    break
        with lock:
            got.extend(mine)

    run_threads(drain, 4)
    assert ends == [None] * 4
    assert_unique(got)
    assert sorted(got) == list(range(first, UINT31_MAX + 1))


def test_contending_generators_spread_over_the_stripes(store_url: str) -> None:
    """Every allocation goes to the store (step 1) and through compare-and-set, so the
    generators collide; each moves to another stripe when it loses one."""
    engine = open_engine(store_url)
    # Over the engine's cells: on SQL engines the keys table (engine.ranges()) takes ranges
    # with row locks, not compare-and-set.
    CasRangeStore(engine.cas()).add_key("hot", step=1, first_id=0, last_id=10**9, stripes=4)
    options = SegmentOptions(max_step=1, preload_at=1.0, wait=30.0)  # 8 new sessions at once
    stripes_used: Counter[int] = Counter()
    errors: list[Exception] = []
    conflicts = []
    got: list[int] = []
    lock = threading.Lock()

    starts = iter(range(8))

    def client() -> None:
        own = open_engine(store_url)  # its own connection, as another process has
        # ... and its own refill thread: sharing one pool, the eight would take turns and
        # hardly contend (a process's generators of one key never need to). Two start on
        # each stripe: left to chance, five of eight on one stripe happened often enough to
        # fail the spread check on the memory engine, where conflicts are rare.
        with lock:
            start = next(starts) % 4
        gen = SegmentGenerator(
            CasRangeStore(own.cas()),
            "hot",
            dataclasses.replace(options, stripe=start),
            pool=RefillPool(1),
        )
        try:
            ids: list[int] = []
            give_up = time.monotonic() + 60
            while len(ids) < 40:
                try:
                    ids.append(gen.next_id())
                except StoreUnavailable:
                    # As an application would: Paxos reads time out under this much
                    # contention on one Cassandra node (8 clients, every id an allocation).
                    assert time.monotonic() < give_up, "no progress for 60 s"
                    time.sleep(0.05)
            stats = gen.stats()
        except Exception as exc:
            with lock:
                errors.append(exc)
            raise
        finally:
            gen.close()
            own.close()
        with lock:
            got.extend(ids)
            stripes_used.update(i % 4 for i in ids)
            conflicts.append(stats.conflicts)

    try:
        run_threads(client, 8)
    finally:
        engine.close()
    assert not errors, errors[:3]
    assert_unique(got)
    assert set(stripes_used) == {0, 1, 2, 3}, stripes_used
    # No stripe carries three quarters of the load, as it would if the generators that lose a
    # race all moved to the same stripe. The moves are random, so the spread is uneven: 30-45%
    # on the busiest stripe in most runs on SQLite, 52% seen once in CI (the bound was 50%).
    assert max(stripes_used.values()) <= 0.75 * len(got), stripes_used


def test_backoff_waits_are_random_then_grow_with_the_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr("idmint.stores.over_cas.loop.time.sleep", slept.append)
    backoff = Backoff(initial=0.01, longest=1.0, deadline=60.0)
    firsts = []
    for _ in range(20):
        wait = backoff.waits("test")
        slept.clear()
        for _ in range(4):
            wait()
        first = slept[0]
        assert 0 <= first < 0.02
        assert slept == pytest.approx([first, 2 * first, 3 * first, 4 * first])
        firsts.append(first)
    # Twenty clients that collided at once retry at twenty different moments.
    assert len(set(firsts)) == 20


def test_backoff_gives_up_at_its_deadline() -> None:
    wait = Backoff(initial=0.01, deadline=0.05).waits("allocate on key 'k'")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="compare-and-set attempts lost"):
        while True:
            wait()
    assert time.monotonic() - started < 1.0


def test_many_clients_on_one_counter_all_make_progress(store_url: str) -> None:
    """Ten clients hammer one plain counter through compare-and-set for a while: each takes
    ranges (no livelock, no starvation), none runs out of back-off, ranges are disjoint."""
    engine = open_engine(store_url)
    CasRangeStore(engine.cas()).add_key("one", step=3, first_id=1, last_id=10**12)
    taken: list[list[Range]] = []
    errors: list[Exception] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + 2.0

    def client() -> None:
        own = open_engine(store_url)
        store = CasRangeStore(own.cas())
        mine = []
        try:
            while time.monotonic() < stop_at:
                mine.append(store.allocate("one").range)
        except Exception as exc:
            with lock:
                errors.append(exc)
        finally:
            own.close()
        with lock:
            taken.append(mine)

    try:
        run_threads(client, 10)
    finally:
        engine.close()
    assert not errors, errors[:3]
    # Each made progress. (How evenly depends on the engine's own locks too: SQLite's busy
    # handler is unfair to a writer that waited, so no share is asserted.)
    assert all(mine for mine in taken), sorted(map(len, taken))
    assert_disjoint([r for mine in taken for r in mine])


def test_forked_children_back_off_at_different_moments() -> None:
    """A forked worker pool (gunicorn --preload, celery) must not inherit one random state:
    its workers would collide, then retry, in lockstep."""
    firsts = []
    for _ in range(4):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report its first wait, then leave at once
            slept: list[float] = []
            time.sleep = slept.append  # type: ignore[assignment]  # the child's own module
            Backoff(initial=0.01, deadline=60.0).waits("child")()
            os.write(write, repr(slept[0]).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as got:
            firsts.append(float(got.read()))
        os.waitpid(pid, 0)
    assert len(set(firsts)) == 4, firsts
