"""The refill half of a segment generator (segment.py): its buffer of segments, the state both
halves share, and everything that takes ranges from the store on the refill pool's threads:
the dynamic step, the stripes, the back-off of a failing store, and the check that the store
never hands out a range below one it gave before.

SegmentGenerator (segment.py) is built on SegmentRefills and adds the half callers use: the
lock-free hot path, the switch to the next segment, close and the figures. The two halves
meet at `_next` (a refill installs it under `_cond`, the switch takes it) and `_refilling`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from .._errors import CounterWentBack, Exhausted, IdmintError, StoreUnavailable
from .._fork import ForkAware, private_random
from .._sync import WaitableLock
from ..ids import Allocation, Range
from ..stores.base import RangeStore
from .refills import RefillPool
from .segment_options import SegmentOptions

log = logging.getLogger("idmint.segment")

_jitter = private_random()


class Segment:
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
        """Stop serving from this segment and return the part nobody drew (see segment.py)."""
        stop = self.stop
        self.limit = self.stop = self.start  # first lower the bounds ...
        drawn = next(self.ids)  # ... then draw: every later draw is refused
        return Range(min(drawn, stop), stop, self.stride)


class SegmentRefills(ForkAware):
    """A segment generator's state and its refills (see the module doc); SegmentGenerator is
    the class to use."""

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

    # Set by SegmentGenerator.__init__ (the rest by _fresh_state).
    key: str
    options: SegmentOptions
    _store: RangeStore
    _clock: Callable[[], float]
    _pool: RefillPool
    _closed: bool

    def _fresh_state(self) -> None:
        """Nothing held, nothing issued, no refiller: a new generator, or a forked child's."""
        self._cond = WaitableLock()
        self._seg = Segment(Range(0, 0), 0.0)  # empty: the first call takes the slow path
        self._next: Segment | None = None
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
        self._next = Segment(taken, self.options.preload_at)
        self._taken += len(taken)
        self._step, self._key_step = step, key_step
        self._last_taken_at = self._clock()
        self._refills += 1
        self._last_refill_at = datetime.now(UTC)
        self._last_refill_seconds = time.monotonic() - started
        self._refill_seconds_total += self._last_refill_seconds
