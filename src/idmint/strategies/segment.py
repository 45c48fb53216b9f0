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
from datetime import UTC, datetime
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
from .._fork import ForkAware, private_random
from .._sync import WaitableLock
from ..ids import Allocation, Range, check_count, check_key_name, check_stripe
from ..stores.base import RangeStore
from .refills import RefillPool, shared_pool

log = logging.getLogger("idmint.segment")


class _WouldBlock(Exception):
    """Raised inside the slow path of a non-blocking call instead of waiting for the store."""


MAX_BATCH = 1_000_000
_jitter = private_random()


@dataclass(frozen=True)
class SegmentOptions:
    """How a segment generator sizes and refills its ranges. The defaults are Leaf's.

    preload_at: the fraction of the current range used when the next one is loaded.
    max_step: the largest range the dynamic step grows to (never below the key's step).
    grow_below / shrink_above: seconds a range lasted: under `grow_below` the next range is
        twice as large, over `shrink_above` half as large (never below the key's step).
    wait: seconds a caller waits for a range when nothing is buffered before it gets
        StoreUnavailable.
    retry_after: seconds a KeyNotFound or Exhausted answer is trusted before the store is asked
        again (a key may be created meanwhile).
    give_back: on close, return the unused tail to the store when nobody allocated after it.
    stripe: for a key with stripes, the stripe to start on (default: one chosen at random,
        which spreads processes over the stripes). A generator moves to another stripe when
        its own is contended (an allocation lost a compare-and-set) or exhausted.
    """

    preload_at: float = 0.1
    max_step: int = 1_000_000
    grow_below: float = 15 * 60.0
    shrink_above: float = 30 * 60.0
    wait: float = 1.0
    retry_after: float = 1.0
    give_back: bool = True
    stripe: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.preload_at <= 1.0:
            raise InvalidArgument(f"preload_at must be from 0 to 1, not {self.preload_at!r}")
        check_count(self.max_step, what="max_step")
        if not 0 <= self.grow_below <= self.shrink_above:
            raise InvalidArgument("grow_below must be from 0 to shrink_above")
        if self.wait <= 0 or self.retry_after < 0:
            raise InvalidArgument("wait must be above 0 and retry_after at least 0")
        if self.stripe is not None:
            check_stripe(self.stripe, 1 << 31)


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


class _Segment:
    """One range being served: ids are drawn from `ids`; only draws below `limit` are served
    without the lock (`limit` is the preload mark, then `stop` once the preload started)."""

    __slots__ = ("ids", "limit", "start", "stop", "stride")

    def __init__(self, taken: Range, preload_at: float) -> None:
        self.start = taken.start
        self.stop = taken.stop
        self.stride = taken.stride
        self.ids = itertools.count(taken.start, taken.stride)
        self.limit = min(taken.stop, taken.start + int(len(taken) * preload_at) * taken.stride)

    def __len__(self) -> int:
        return (self.stop - self.start) // self.stride

    def range(self, start: int | None = None) -> Range:
        """The segment's ids from `start` (default: all of them) as a Range."""
        return Range(self.start if start is None else start, self.stop, self.stride)

    def position(self) -> int:
        """The next id `ids` would yield, without drawing it (a draw would waste an id).
        itertools.count's repr ("count(5)" or "count(5, 3)") is its only side-effect-free
        view of its state."""
        return min(int(repr(self.ids)[6:-1].split(",")[0]), self.stop)

    def retire(self) -> Range:
        """Stop serving from this segment and return the part nobody drew (see module doc)."""
        stop = self.stop
        self.limit = self.stop = self.start  # first lower the bounds ...
        drawn = next(self.ids)  # ... then draw: every later draw is refused
        return Range(min(drawn, stop), stop, self.stride)


class SegmentGenerator(ForkAware):
    """Ids of one key, served from ranges taken from a store. Thread-safe.

    Ids increase within a thread and trend upwards across processes (see docs/guarantees.md).

        gen = SegmentGenerator(store, "order")
        gen.next_id()         # 100000000
        gen.next_ids(3)       # [100000001, 100000002, 100000003]
        gen.close()           # gives the unused tail back
    """

    # Slots, not a __dict__: a server may hold 100,000 generators (see bench/keys.py).
    __slots__ = (
        "_backoff",
        "_clock",
        "_closed",
        "_cond",
        "_conflicts",
        "_error",
        "_error_at",
        "_failing_since",
        "_given_back",
        "_issued_before",
        "_key_step",
        "_last_refill_at",
        "_last_refill_seconds",
        "_last_taken_at",
        "_listeners",
        "_loading",
        "_lost",
        "_next",
        "_pool",
        "_refill_seconds_total",
        "_refilling",
        "_refills",
        "_seg",
        "_seg_since",
        "_spent_stripes",
        "_step",
        "_store",
        "_stripe",
        "_stripes",
        "_taken",
        "_taken_up_to",
        "key",
        "options",
    )

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

    def _fresh_state(self) -> None:
        """Nothing held, nothing issued, no refiller: a new generator, or a forked child's."""
        self._cond = WaitableLock()
        self._seg = _Segment(Range(0, 0), 0.0)  # empty: the first call takes the slow path
        self._next: _Segment | None = None
        self._seg_since = 0.0  # when the current segment began serving (its rate, for urgency)
        # A refill asked of the pool (queued, loading or backing off), and one loading now.
        self._refilling = False
        self._loading = False
        self._backoff = 0.0
        self._failing_since: float | None = None
        # Called once when the next load ends (see on_refill).
        self._listeners: list[Callable[[], object]] | None = None
        self._error: IdmintError | None = None
        self._error_at = 0.0
        self._lost: CounterWentBack | None = None  # final: the store lost data
        # Per stripe, the highest range end taken: the stripe's counter never drops below it.
        self._taken_up_to: dict[tuple[int, int], int] = {}  # (stripe, epoch) -> stop
        # The key's stripes (None until the first refill reads the key), the one this
        # generator takes ranges from, those it found exhausted, and the conflicts it met.
        self._stripes: int | None = None
        self._stripe = 0
        self._spent_stripes: frozenset[int] = frozenset()  # the empty one is shared
        self._conflicts = 0
        # Dynamic step: the step of the last range and when it was taken.
        self._step: int | None = None
        self._key_step: int | None = None
        self._last_taken_at: float | None = None
        # Figures for stats(): ids served from finished segments, integers taken and returned.
        self._issued_before = 0
        self._taken = 0
        self._given_back = 0
        self._refills = 0
        self._last_refill_at: datetime | None = None
        self._last_refill_seconds: float | None = None
        self._refill_seconds_total = 0.0

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

    def _next_id_slow(self, seg: _Segment, i: int, *, block: bool = True) -> int:
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

    def _advance(self, spent: _Segment, block: bool = True) -> None:
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

    # -- refills -----------------------------------------------------------------------------

    def _start_refill(self) -> None:
        """Ask the refill pool for the next range. Called with `_cond` held."""
        if self._lost is not None:
            return  # never again from a store that lost data
        self._refilling = True
        self._error = None
        self._pool.submit(self)

    def refill_due(self) -> float:
        """When this generator runs dry at its current rate (see RefillJob): now if the
        current segment is spent or was never loaded. Reads without the lock (see RefillJob)."""
        now = time.monotonic()
        seg = self._seg
        left = len(seg.range(seg.position()))
        used = len(seg) - left
        if not left or not used:
            return now if not left else now + self.options.grow_below
        return now + left * (now - self._seg_since) / used

    def _choose_step(self) -> int | None:
        """Leaf's dynamic step: double while ranges last under `grow_below`, halve when one
        lasted over `shrink_above`; between the key's step and `max_step`. None (the key's
        own step) until the first range tells us the key's step."""
        if self._step is None or self._key_step is None or self._last_taken_at is None:
            return None
        lasted = self._clock() - self._last_taken_at
        if lasted < self.options.grow_below:
            return max(self._key_step, min(self._step * 2, self.options.max_step))
        if lasted >= self.options.shrink_above:
            return max(self._key_step, self._step // 2)
        return max(self._key_step, self._step)

    def run_refill(self) -> float | None:
        """The pool runs this: load one range (see RefillJob). Ends `_refilling` unless the
        store failed and the pool is to run it again after the returned back-off."""
        with self._cond:
            if self._closed or not self._refilling:
                self._refilling = False
                self._cond.notify_all()
                return None
            self._loading = True
            step = self._choose_step()
        try:
            return self._refill(step)
        finally:
            with self._cond:
                self._loading = False
                self._cond.notify_all()
            self._call_listeners()

    def on_refill(self, callback: Callable[[], object]) -> None:
        """Call `callback` once, on the refill pool's thread, when the next load ends (a range
        in, or a failure stored) or the generator closes: how an event loop waits for ids
        without holding a thread. It must be quick and must not raise."""
        with self._cond:
            closed = self._closed
            if not closed:
                self._listeners = [*(self._listeners or ()), callback]
        if closed:
            callback()

    def _call_listeners(self) -> None:
        with self._cond:
            listeners, self._listeners = self._listeners, None
        for callback in listeners or ():
            try:
                callback()
            except Exception:
                log.exception("a refill listener of key %r failed", self.key)

    def _refill(self, step: int | None) -> float | None:
        """Load one range: None when done (a range installed or a final error stored), else
        the seconds to back off before trying again (the store failed)."""
        started = time.monotonic()
        try:
            taken = self._allocate(step)
        except StoreUnavailable as exc:
            error: IdmintError = exc
        except IdmintError as exc:  # KeyNotFound, Exhausted: retrying will not help
            with self._cond:
                self._error, self._error_at = exc, time.monotonic()
                self._refilling = False
                self._cond.notify_all()
            return None
        except Exception as exc:  # an unmapped driver error: report it, keep trying
            log.exception("unexpected error loading a range for key %r", self.key)
            error = StoreUnavailable(f"{type(exc).__name__}: {exc}")
        else:
            taken_up_to = self._taken_up_to.get((taken.key.stripe, taken.epoch), 0)
            if taken.range.start < taken_up_to:
                # Counters only move up, and a give-back never reaches below a range
                # someone took after it: this store forgot what it handed out.
                lost = CounterWentBack(self.key, taken.range.start, taken_up_to)
                log.error("%s", lost)
                with self._cond:
                    self._lost = self._error = lost
                    self._error_at = time.monotonic()
                    self._refilling = False
                    self._cond.notify_all()
                return None
            with self._cond:
                self._taken_up_to[(taken.key.stripe, taken.epoch)] = taken.range.stop
                self._install(taken.range, step or taken.key.step, taken.key.step, started)
                self._refilling = False
                self._cond.notify_all()
            if self._failing_since is not None:
                log.warning("key %r: the store answers again", self.key)
                self._failing_since, self._backoff = None, 0.0
            return None
        with self._cond:
            self._error, self._error_at = error, time.monotonic()
            self._cond.notify_all()
        if self._failing_since is None:
            self._failing_since = started
            log.warning("key %r: cannot load a range, retrying: %s", self.key, error)
        self._backoff = min(self._backoff * 2, 1.0) if self._backoff else 0.01
        return self._backoff * _jitter.uniform(0.5, 1.5)

    def _allocate(self, step: int | None) -> Allocation:
        """Take a range from this generator's stripe. The first allocation tells the key's
        stripes (the store chooses the stripe unless the options give one); then one is
        chosen at random, so processes spread. Moves to another stripe when its own is
        exhausted (now) or was contended (from the next range)."""
        while True:
            stripe = self.options.stripe if self._stripes is None else self._stripe
            try:
                taken = self._store.allocate(self.key, step, stripe=stripe)
            except Exhausted as exc:
                if exc.stripe is None or not exc.stripes:
                    raise
                self._learn_stripes(exc.stripes, exc.stripe)
                self._spent_stripes |= {self._stripe}
                if not self._move_stripe():
                    raise Exhausted(self.key, exc.last_id) from exc
                continue
            self._conflicts += taken.conflicts
            if self._stripes is None:
                self._learn_stripes(taken.key.stripes, taken.key.stripe)
                if self.options.stripe is None and taken.key.stripes > 1:
                    self._stripe = _jitter.randrange(taken.key.stripes)
            elif taken.conflicts:
                self._move_stripe()
            return taken

    def _learn_stripes(self, stripes: int, stripe: int) -> None:
        if self._stripes is None:
            self._stripes, self._stripe = stripes, stripe

    def _move_stripe(self) -> bool:
        """Move to another stripe that is not exhausted, at random: False if there is none."""
        left = [
            s
            for s in range(self._stripes or 1)
            if s not in self._spent_stripes and s != self._stripe
        ]
        if not left:
            return self._stripe not in self._spent_stripes
        self._stripe = _jitter.choice(left)
        return True

    def _install(self, taken: Range, step: int, key_step: int, started: float) -> None:
        """Make a fresh range the next segment. Called with `_cond` held; if the generator
        closed meanwhile, close() gives it back (nobody draws from `_next`)."""
        self._next = _Segment(taken, self.options.preload_at)
        self._taken += len(taken)
        self._step, self._key_step = step, key_step
        self._last_taken_at = self._clock()
        self._refills += 1
        self._last_refill_at = datetime.now(UTC)
        self._last_refill_seconds = time.monotonic() - started
        self._refill_seconds_total += self._last_refill_seconds

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

    def cold(self) -> bool:
        """No range served yet and a refill under way: still loading its first range, or its
        refills failing. Read without the lock."""
        seg = self._seg
        return seg.stop <= seg.start and not self._closed and self._next is None and self._refilling

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
