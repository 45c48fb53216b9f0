"""Ambiguous writes: a compare-and-set whose outcome its caller never learns (a timeout after the
store applied it, or before it did). Ranges over cells (over_cas/ranges.py) and datacenter cells
(strategies/datacenter.py) must never serve a range twice whatever is applied and unreported.

Seeded and single-threaded, so each seed replays the same interleaving of callers and faults:
a failure found here is a failure found again.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest

from idmint import IdmintError, Range, ReservationSizing, StoreUnavailable
from idmint.stores import open_engine
from idmint.stores.base import CasStore, StoreIdentity
from idmint.stores.memory import MemoryCasStore
from idmint.stores.over_cas.ranges import CasRangeStore
from idmint.strategies.datacenter import DatacenterRanges

from checks import assert_disjoint


class Ambiguous:
    """A CasStore whose writes fail now and then, before reaching the store or after it
    applied them: either way the caller gets StoreUnavailable and cannot tell which."""

    #: Faults injected, by every wrapper: before the write, and after it applied.
    faults: ClassVar[dict[str, int]] = {"before": 0, "after": 0}

    def __init__(
        self, inner: CasStore, rng: random.Random, rate: float, *, trust: bool = False
    ) -> None:
        self.inner, self.rng, self.rate = inner, rng, rate
        self.display_url = inner.display_url
        # The unsafe caller of the negative control: an unknown outcome taken for applied.
        self.trust = trust

    def _write(self, write: Any) -> bool:
        if self.rng.random() < self.rate:
            self.faults["before"] += 1
            if self.trust:
                return True
            raise StoreUnavailable("timed out before the write (injected)")
        done = bool(write())
        if self.rng.random() < self.rate:
            self.faults["after"] += done
            raise StoreUnavailable("timed out after the write (injected)")
        return done

    def create(self, key: str, value: str) -> bool:
        return self._write(lambda: self.inner.create(key, value))

    def swap(self, key: str, version: int, value: str) -> bool:
        return self._write(lambda: self.inner.swap(key, version, value))

    def read(self, key: str) -> tuple[str, int] | None:
        return self.inner.read(key)

    def scan(self, prefix: str) -> list[tuple[str, str]]:
        return self.inner.scan(prefix)

    def init(self) -> None:
        self.inner.init()

    def identity(self) -> StoreIdentity | None:
        return self.inner.identity()

    def close(self) -> None:
        self.inner.close()


def _run(calls: list[Any], rng: random.Random, steps: int) -> None:
    """Run `steps` random calls (a call that raised handed out nothing)."""
    for _ in range(steps):
        try:
            rng.choice(calls)(rng)
        except IdmintError:
            continue


def _segment_callers(
    cas: CasStore, rng: random.Random, handed: list[Range], *, trust: bool = False
) -> list[Any]:
    """Four processes taking ranges of a striped key and giving back the tails of some: what
    each hands out goes in `handed` (a tail given back was never handed out, so it may come
    again, to anyone, whether the give-back applied or not)."""
    stores = [CasRangeStore(Ambiguous(cas, rng, 0.2, trust=trust)) for _ in range(4)]
    cas.init()
    CasRangeStore(cas).add_key("k", step=7, first_id=1, last_id=10**9, stripes=2)
    held: dict[int, int] = {}  # process -> its last range's place in `handed`

    def allocate(i: int) -> Any:
        def call(rng: random.Random) -> None:
            handed.append(stores[i].allocate("k", rng.randint(1, 20)).range)
            held[i] = len(handed) - 1

        return call

    def give_back(i: int) -> Any:
        def call(rng: random.Random) -> None:
            place = held.pop(i, None)
            last = None if place is None else handed[place]
            if place is not None and last is not None and len(last) > 1:
                cut = last.start + last.stride * rng.randint(1, len(last) - 1)
                handed[place] = Range(last.start, cut, last.stride)  # the tail: never handed
                stores[i].give_back("k", Range(cut, last.stop, last.stride))

        return call

    return [allocate(i) for i in range(4)] + [give_back(i) for i in range(4)]


@pytest.mark.parametrize("seed", range(8))
def test_segment_ranges_over_cells_never_serve_an_ambiguous_write_twice(seed: int) -> None:
    rng = random.Random(seed)
    handed: list[Range] = []
    before = dict(Ambiguous.faults)
    _run(_segment_callers(MemoryCasStore(), rng, handed), rng, 600)
    assert len(handed) > 100
    assert Ambiguous.faults["after"] > before["after"] + 20  # applied, never reported
    _assert_no_overlap(handed)


def _assert_no_overlap(served: list[Range]) -> None:
    """Ranges with a stride overlap only if they share an id: compare their ids."""
    seen: set[int] = set()
    for taken in served:
        ids = set(taken)
        assert not ids & seen, (taken, sorted(ids & seen)[:5])
        seen |= ids


def _datacenter_callers(top: CasStore, rng: random.Random, handed: list[Range]) -> list[Any]:
    DatacenterRanges(top).add_key(
        "k", step=5, last_id=10**9, sizing=ReservationSizing(min_reservation=50, preload_at=0.5)
    )
    locals_ = {dc: MemoryCasStore(f"memory://{dc}") for dc in ("eu", "us")}
    dcs = [
        DatacenterRanges(Ambiguous(top, rng, 0.15), Ambiguous(locals_[dc], rng, 0.15), dc)
        for dc in ("eu", "us", "eu", "us")  # two processes per datacenter
    ]

    def allocate(d: DatacenterRanges) -> Any:
        return lambda rng: handed.append(d.allocate("k", rng.randint(1, 12)).range)

    def reserve(d: DatacenterRanges) -> Any:
        def call(rng: random.Random) -> None:
            d.reserve("k")

        return call

    return [allocate(d) for d in dcs] * 3 + [reserve(d) for d in dcs]


@pytest.mark.parametrize("seed", range(6))
def test_datacenter_cells_never_serve_an_ambiguous_write_twice(seed: int) -> None:
    rng = random.Random(seed)
    handed: list[Range] = []
    before = dict(Ambiguous.faults)
    _run(_datacenter_callers(MemoryCasStore("memory://global"), rng, handed), rng, 500)
    assert len(handed) > 100
    assert Ambiguous.faults["after"] > before["after"] + 20  # applied, never reported
    assert_disjoint(handed)


def test_ambiguous_writes_on_a_real_engine(etcd_server: Any) -> None:
    """The same, on etcd: the store's own compare-and-set, every fault the wrapper's."""
    rng = random.Random(19)
    engine = open_engine(etcd_server.store_url(f"ambiguous{rng.randrange(10**9)}"))
    try:
        handed: list[Range] = []
        _run(_segment_callers(engine.cas(), rng, handed), rng, 150)
        assert len(handed) > 30
        _assert_no_overlap(handed)
    finally:
        engine.close()


def test_the_checker_catches_a_caller_that_trusts_an_unknown_outcome() -> None:
    """Negative control: a caller that takes a write whose outcome it never learnt for applied
    (it was not) serves a range the store never recorded, which is handed out again."""
    rng = random.Random(0)
    handed: list[Range] = []
    _run(_segment_callers(MemoryCasStore(), rng, handed, trust=True), rng, 600)
    with pytest.raises(AssertionError):
        _assert_no_overlap(handed)
