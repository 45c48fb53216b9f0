"""Segment ids: ranges taken from a store's counter, served from memory.

A generator holds the range it is serving (the *current* segment) and, once 10% of it is used,
loads the *next* one in the background (Leaf's double buffer), so a caller waits for the store
only when both are gone. The loading runs on the process's refill pool (refills.py): a few
threads for every generator, the one closest to running dry first.

The hot path takes no lock. Each segment draws ids from an `itertools.count`, whose `next()` is
atomic under the GIL, and compares the draw with the segment's `limit`, which is read *after*
the draw. Everything that changes a segment's bounds holds `_cond`. That order is what makes
`close()` safe without locking `next_id()`: close first lowers `limit` and `stop` to `start`, then
draws once more itself. A caller's draw that came after close's draw sees the lowered limit and
is rejected; a draw that came before is below close's draw, and close gives back only ids from
its own draw upward. So no id is both served and given back.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from .._errors import (
    Closed,
    CounterWentBack,
    DatacenterRetired,
    Exhausted,
    IdmintError,
    InvalidArgument,
    KeyNotFound,
    RunwaySpent,
    StoreUnavailable,
)
from ..ids import Range, check_count, check_key_name
from ..stores.base import RangeStore
from .refills import RefillPool, Segment, SegmentOptions, SegmentRefills, shared_pool

log = logging.getLogger("idmint.segment")


class _WouldBlock(Exception):
    """Raised inside the slow path of a non-blocking call instead of waiting for the store."""


MAX_BATCH = 1_000_000


class GeneratorCounts(NamedTuple):
    """A generator's running totals, read without the lock: cheap enough to read for
    100,000 generators each second (stats() builds far more)."""

    issued: int
    refills: int
    refill_seconds: float
    conflicts: int
    failing: bool  # the last refill failed


@dataclass(frozen=True)
class SegmentStats:
    """A snapshot of a generator, for metrics and the dashboard.

    density is issued / (taken - given_back - held): the share of the integers this generator
    used up that became ids. Ids still held (the rest of the current range, the next one) are
    not used up yet, so a running generator shows 1.0 unless ids were skipped; after close, a
    tail that could not be given back counts against it.
    """

    key: str
    issued: int
    taken: int
    given_back: int
    held: int
    current: Range | None
    position: int | None
    next: Range | None
    step: int | None
    refills: int
    refilling: bool
    last_refill_at: datetime | None
    last_refill_seconds: float | None
    refill_seconds_total: float
    error: str | None
    closed: bool
    #: The stripe this generator takes ranges from, of how many (1 for a plain key; None
    #: until the first refill read the key).
    stripe: int = 0
    stripes: int | None = None
    #: Compare-and-set conflicts its allocations met (engines without row locks).
    conflicts: int = 0

    @property
    def density(self) -> float:
        used_up = self.taken - self.given_back - self.held
        return self.issued / used_up if used_up else 1.0


class SegmentGenerator(SegmentRefills):
    """Ids of one key, served from ranges taken from a store. Thread-safe.

    Ids increase within a thread and trend upwards across processes (see docs/guarantees.md).

        gen = SegmentGenerator(store, "order")
        gen.next_id()         # 100000000
        gen.next_ids(3)       # [100000001, 100000002, 100000003]
        gen.close()           # gives the unused tail back
    """

    # Every slot is declared by SegmentRefills (see why there); none here keeps a __dict__ away.
    __slots__ = ()

    def __init__(
        self,
        store: RangeStore,
        key: str,
        options: SegmentOptions | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        pool: RefillPool | None = None,
    ) -> None:
        self.key = check_key_name(key)
        self.options = options or SegmentOptions()
        self._store = store
        self._clock = clock
        self._pool = pool or shared_pool()
        self._closed = False
        self._fresh_state()
        self._watch_fork()
        with self._cond:
            self._start_refill()  # warm up in the background

    def _after_fork(self) -> None:
        # The parent goes on serving its ranges: the child drops them, never gives them back,
        # and takes its own on its first call (the parent's refill job is the parent's).
        closed = self._closed
        self._fresh_state()
        self._closed = closed

    # -- the hot path ------------------------------------------------------------------------

    def next_id(self) -> int:
        """The next id. Raises Exhausted, KeyNotFound, StoreUnavailable or Closed."""
        seg = self._seg
        i = next(seg.ids)
        if i < seg.limit:
            return i
        return self._next_id_slow(seg, i)

    def try_next_id(self) -> int | None:
        """Like next_id(), but None instead of waiting for the store: for event loops, which
        then call next_id() on a thread. Errors are raised as by next_id()."""
        seg = self._seg
        i = next(seg.ids)
        if i < seg.limit:
            return i
        try:
            return self._next_id_slow(seg, i, block=False)
        except _WouldBlock:
            return None

    def next_ids(self, count: int) -> list[int]:
        """`count` ids (1 to 1,000,000), increasing."""
        return self._next_ids(count, block=True)

    def try_next_ids(self, count: int) -> list[int]:
        """Up to `count` ids without waiting for the store: fewer (maybe none) when the buffered
        ranges run out; ask for the rest with next_ids() on a thread."""
        return self._next_ids(count, block=False)

    def _next_ids(self, count: int, *, block: bool) -> list[int]:
        check_count(count, maximum=MAX_BATCH)
        ids: list[int] = []
        while len(ids) < count:
            seg = self._seg
            # Never draw more than the segment holds: draws past its end are thrown away.
            drawn = list(itertools.islice(seg.ids, min(count - len(ids), max(1, len(seg)))))
            limit = seg.limit  # read after the draws, as in next_id
            if drawn[-1] < limit:
                ids += drawn
                continue
            cut = bisect.bisect_left(drawn, limit)
            ids += drawn[:cut]
            try:
                ids.append(self._next_id_slow(seg, drawn[cut], block=block))
            except _WouldBlock:
                return ids  # drawn[cut:] are past the range's end: not ids, nothing lost
            rest = drawn[cut + 1 :]
            ids += rest[: bisect.bisect_left(rest, seg.limit)]
        return ids

    def _next_id_slow(self, seg: Segment, i: int, *, block: bool = True) -> int:
        """`i` was drawn from `seg` at or past its limit: serve it if it is still inside the
        range (and start the preload), else move on to the next range."""
        if self._check_fork():  # a fork that bypassed the at-fork hook: `i` is the parent's
            seg = self._seg
            i = next(seg.ids)
        with self._cond:
            while True:
                if i < seg.stop:
                    if seg is self._seg and i >= seg.limit:
                        seg.limit = seg.stop
                        if self._next is None and not self._refilling:
                            self._start_refill()
                    return i
                self._advance(seg, block)
                seg = self._seg
                i = next(seg.ids)

    def _advance(self, spent: Segment, block: bool = True) -> None:
        """Replace the spent current segment with the next one, waiting for it up to
        `options.wait`; return at once if another thread already did. Called with `_cond` held.
        """
        deadline: float | None = None
        waited = False
        while self._seg is spent:
            # Closed first: close() leaves `_next` in place until it has given it back.
            if self._closed:
                raise Closed(f"the generator of key {self.key!r} is closed")
            if self._next is not None:
                self._issued_before += len(spent)
                self._seg, self._next = self._next, None
                self._seg_since = time.monotonic()
                return
            # A failing refill (still retrying, just failed, or the one we waited for) answers
            # for the store: fail fast rather than make every caller wait out the bound.
            if self._lost is not None:
                raise self._fresh(self._lost)
            error = self._error
            if error is not None and (
                waited
                or self._refilling
                or time.monotonic() - self._error_at < self.options.retry_after
            ):
                raise self._fresh(error)
            if not self._refilling:
                self._start_refill()
            if not block:
                raise _WouldBlock
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.options.wait
            if now >= deadline:
                raise StoreUnavailable(
                    f"no ids buffered for key {self.key!r} and the store gave no range within "
                    f"{self.options.wait:g} s ({self._store.display_url})"
                )
            self._cond.wait(deadline - now)
            waited = True

    def _fresh(self, error: IdmintError) -> IdmintError:
        """A new exception for a stored refill error: raising one instance from many threads
        would keep growing its traceback."""
        fresh: IdmintError
        if isinstance(error, KeyNotFound):
            fresh = error.again()
        elif isinstance(error, DatacenterRetired):
            fresh = DatacenterRetired(error.key, error.dc)
        elif isinstance(error, Exhausted):
            fresh = Exhausted(error.key, error.last_id)
        elif isinstance(error, RunwaySpent):
            fresh = RunwaySpent(error.key, error.dc, error.reason)
        elif isinstance(error, CounterWentBack):
            fresh = CounterWentBack(error.key, error.start, error.taken_up_to)
        elif isinstance(error, InvalidArgument):  # a store that refuses the key: say why
            fresh = InvalidArgument(str(error))
        else:
            fresh = StoreUnavailable(f"no ids buffered for key {self.key!r}: {error}")
        fresh.__cause__ = error
        return fresh

    # -- lifecycle and figures ---------------------------------------------------------------

    def close(self) -> list[Range]:
        """Stop serving and give back the unused ids when nobody allocated after them.
        Never raises on a store failure: the ids are then skipped, never reused. Returns the
        unused ranges that did not go back (someone allocated after them, or the store
        failed)."""
        with self._cond:
            if self._closed:
                return []
            self._closed = True
            tail = self._seg.retire()
            self._issued_before += (tail.start - self._seg.start) // tail.stride
            self._cond.notify_all()
            # A range arriving now would be wasted: wait a little for it so it can go back too.
            # (A refill still queued or backing off sees the close when it runs, and stops.)
            deadline = time.monotonic() + self.options.wait
            while self._loading and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            held = [tail] + ([self._next.range()] if self._next else [])
            self._next = None
        self._call_listeners()
        if not self.options.give_back:
            return [r for r in held if r]
        return self._give_back(held)

    def _give_back(self, held: list[Range]) -> list[Range]:
        # Per stripe, merge the held ranges that touch, then return them from the top down:
        # each return works only while the stripe's counter stands at that range's stop.
        stripes: dict[tuple[int, int], list[Range]] = {}
        for r in sorted(held, key=lambda r: r.start):
            if not r:
                continue
            merged = stripes.setdefault((r.stride, r.start % r.stride), [])
            if merged and merged[-1].stop == r.start:
                merged[-1] = Range(merged[-1].start, r.stop, r.stride)
            else:
                merged.append(r)
        kept: list[Range] = []
        for merged in stripes.values():
            while merged:
                r = merged[-1]
                try:
                    if not self._store.give_back(self.key, r):
                        break
                except IdmintError as exc:
                    log.warning("key %r: could not give back %s: %s", self.key, r, exc)
                    break
                merged.pop()
                with self._cond:
                    self._given_back += len(r)
            kept += merged
        return sorted(kept, key=lambda r: r.start)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def display_url(self) -> str:
        """The store's URL as messages show it (secrets redacted)."""
        return self._store.display_url

    def cold(self) -> bool:
        """Nothing buffered and a refill under way: still loading its first range, or its
        current range spent and its refills failing (the store down, or refusing writes: a
        server with such a key is not ready). A range spent while the next one loads, as a
        busy key's may be for a moment, is not cold. Read without the lock."""
        seg = self._seg
        if self._closed or self._next is not None or not self._refilling:
            return False
        never_loaded = seg.stop <= seg.start
        return never_loaded or (not len(seg.range(seg.position())) and self._error is not None)

    def failing(self) -> str | None:
        """Why its last refill failed, while no refill has succeeded since; None otherwise.
        Read without the lock (for probes)."""
        error = self._error
        return None if error is None else " ".join(str(error).split())

    def issued(self) -> int:
        """Ids handed out so far, read without the lock (a sample for rates, which a refill at
        the same moment may put one segment off): far cheaper than stats()."""
        seg, before = self._seg, self._issued_before
        return (
            before + (seg.position() - seg.start) // seg.stride if seg.stop > seg.start else before
        )

    def counts(self) -> GeneratorCounts:
        return GeneratorCounts(
            self.issued(),
            self._refills,
            self._refill_seconds_total,
            self._conflicts,
            self._error is not None,
        )

    def stats(self) -> SegmentStats:
        with self._cond:
            seg, nxt = self._seg, self._next
            serving = bool(seg.stop > seg.start) and not self._closed
            position = seg.position() if serving else None
            drawn = len(seg.range()) - len(seg.range(position)) if position is not None else 0
            issued = self._issued_before + drawn
            return SegmentStats(
                key=self.key,
                issued=issued,
                taken=self._taken,
                given_back=self._given_back,
                held=0
                if self._closed
                else (len(seg.range(position)) if position is not None else 0)
                + (len(nxt) if nxt else 0),
                current=seg.range() if serving else None,
                position=position,
                next=nxt.range() if nxt else None,
                step=self._step,
                refills=self._refills,
                refilling=self._refilling,
                last_refill_at=self._last_refill_at,
                last_refill_seconds=self._last_refill_seconds,
                refill_seconds_total=self._refill_seconds_total,
                error=str(self._error) if self._error else None,
                closed=self._closed,
                stripe=self._stripe,
                stripes=self._stripes,
                conflicts=self._conflicts,
            )

    def __enter__(self) -> SegmentGenerator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
