"""Loading ranges in the background: one bounded pool of threads for every generator, and the
refill half of a segment generator.

A thread per key made 2,000 keys cost 2,001 threads and 64 MB. Here a process has a few refill
threads whatever its number of keys, and a generator that wants its next range submits a job.
Jobs run most urgent first: the job whose generator runs dry soonest (a caller already waiting
runs dry "now"). A job that meets a failing store does not sleep on its thread: it answers how
long to wait, and the pool runs it again then, so a store that is down holds no thread while
other keys' stores answer.

A store call that hangs with its socket open holds a thread until the store's own timeout;
with every thread so held, other keys' refills wait their turn (they are bounded by the same
timeouts). The pool is fork-aware: a child starts with no threads and no jobs (its generators
drop the parent's state and submit afresh).

The refill half of a segment generator (SegmentRefills): its options, its buffer of segments,
the state both halves share, and everything that takes ranges from the store on the pool's
threads: the dynamic step, the stripes, the back-off of a failing store, and the check that the
store never hands out a range below one it gave before. SegmentGenerator (segment.py) is built
on it and adds the half callers use: the lock-free hot path, the switch to the next segment,
close and the figures. The two halves meet at `_next` (a refill installs it under `_cond`, the
switch takes it) and `_refilling`. Also allocate_any, the stripes rule for a single allocation
(one-off batches, ranges handed to clients), which no generator serves.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from .._errors import CounterWentBack, Exhausted, IdmintError, InvalidArgument, StoreUnavailable
from .._fork import ForkAware, private_random
from .._sync import WaitableLock
from ..ids import Allocation, Range, check_count, check_stripe
from ..stores.base import RangeStore

pool_log = logging.getLogger("idmint.refills")
log = logging.getLogger("idmint.segment")

_jitter = private_random()

#: Threads of the process-wide pool unless IDMINT_REFILL_THREADS says otherwise.
DEFAULT_THREADS = 4
MAX_THREADS = 256
#: An idle pool thread ends after this long; the pool starts another when work comes.
IDLE_SECONDS = 60.0


class RefillJob(Protocol):
    """What a generator hands the pool."""

    def refill_due(self) -> float:
        """When (time.monotonic()) the generator runs dry if nothing is loaded: the pool runs
        the earliest first. The past, or now, for a caller already waiting. Called with the
        pool's lock held: it must take no lock (a racy read is fine; it only orders jobs)."""

    def run_refill(self) -> float | None:
        """Load once. None when done (loaded, failed for good, or closed); else seconds to wait
        before the pool runs it again (the store failed; the job keeps its back-off)."""


class RefillPool(ForkAware):
    """At most `threads` threads running RefillJobs, most urgent first. Threads start when
    there is work and none is free, and end after IDLE_SECONDS without work."""

    def __init__(self, threads: int = DEFAULT_THREADS, name: str = "refill") -> None:
        self.threads = check_threads(threads)
        self.name = name
        self._fresh_state()
        self._watch_fork()

    def _fresh_state(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._ready: list[tuple[float, int, RefillJob]] = []  # (due, order, job)
        self._later: list[tuple[float, int, RefillJob]] = []  # (run at, order, job)
        self._order = itertools.count()
        self._started = 0  # threads alive
        self._idle = 0  # threads waiting for work
        self.ran = 0  # jobs run, retries included
        self.retried = 0  # runs that asked to run again later

    def _after_fork(self) -> None:
        # The parent's threads did not survive the fork, and its jobs are its generators'.
        self._fresh_state()

    def submit(self, job: RefillJob, delay: float = 0.0) -> None:
        """Run `job` (after `delay` seconds). A job is submitted once at a time by its owner."""
        self._check_fork()
        with self._cond:
            if delay > 0:
                heapq.heappush(self._later, (time.monotonic() + delay, next(self._order), job))
            else:
                heapq.heappush(self._ready, (_due(job), next(self._order), job))
            if self._idle:
                self._cond.notify()
            elif self._started < self.threads:
                self._started += 1
                threading.Thread(
                    target=self._work, name=f"idmint-{self.name}-{self._started}", daemon=True
                ).start()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "threads": self._started,
                "busy": self._started - self._idle,
                "queued": len(self._ready),
                "waiting": len(self._later),
                "ran": self.ran,
                "retried": self.retried,
            }

    def _take(self) -> RefillJob | None:
        """The most urgent job, waiting for one; None when this thread has idled long enough.
        Called with `_cond` held."""
        idle_since = time.monotonic()
        while True:
            now = time.monotonic()
            while self._later and self._later[0][0] <= now:
                _, order, job = heapq.heappop(self._later)
                heapq.heappush(self._ready, (_due(job), order, job))
            if self._ready:
                return heapq.heappop(self._ready)[2]
            if self._later:  # never idle out while a job waits to run again
                wait = self._later[0][0] - now
            else:
                wait = idle_since + IDLE_SECONDS - now
                if wait <= 0:
                    return None
            self._idle += 1
            try:
                self._cond.wait(wait)
            finally:
                self._idle -= 1

    def _work(self) -> None:
        while True:
            with self._cond:
                job = self._take()
                if job is None:
                    self._started -= 1
                    return
                self.ran += 1
            try:
                again = job.run_refill()
            except Exception:  # a job must not take the thread with it
                pool_log.exception("a refill job failed")
                again = None
            if again is not None:
                with self._cond:
                    self.retried += 1
                self.submit(job, max(again, 0.001))


def _due(job: RefillJob) -> float:
    """The job's due time; now if it cannot tell (a bug there must not stop the pool)."""
    try:
        return job.refill_due()
    except Exception:
        pool_log.exception("a refill job could not tell when it is due")
        return time.monotonic()


def check_threads(threads: int) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise InvalidArgument(f"refill threads must be from 1 to {MAX_THREADS}, not {threads!r}")
    return threads


_shared: RefillPool | None = None
_shared_lock = threading.Lock()


def _fresh_lock() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_fresh_lock)


def shared_pool() -> RefillPool:
    """The process's pool, made on first use with IDMINT_REFILL_THREADS threads (default
    DEFAULT_THREADS)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            raw = os.environ.get("IDMINT_REFILL_THREADS", "").strip()
            try:
                threads = int(raw) if raw else DEFAULT_THREADS
            except ValueError:
                raise InvalidArgument(
                    f"IDMINT_REFILL_THREADS must be a number, not {raw!r}"
                ) from None
            _shared = RefillPool(threads)
        return _shared


def set_shared_threads(threads: int) -> RefillPool:
    """Size the process's pool (the server's --refill-threads): a smaller size takes effect as
    threads beyond it idle out."""
    pool = shared_pool()
    pool.threads = check_threads(threads)
    return pool


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
                # Good news: INFO. The failure was a warning; an operator's alert should not
                # match the recovery too (issue 31 row 15).
                log.info("key %r: the store answers again", self.key)
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


def allocate_any(
    store: RangeStore, name: str, count: int | None = None, *, stripe: int | None = None
) -> Allocation:
    """`store.allocate`, except that with no `stripe` a striped key hands out a range while
    any of its stripes has ids left: when the stripe the store chose is exhausted, the others
    that still have some (as the key's row says) are tried in random order. Only then does it
    raise Exhausted for the whole key (no `stripe`). With a `stripe`, that stripe or nothing.
    """
    try:
        return store.allocate(name, count, stripe=stripe)
    except Exhausted as exc:
        if stripe is not None or exc.stripe is None or (exc.stripes or 1) < 2:
            raise
        spent = exc
    key = store.get_key(name)
    left = [s for s, start in enumerate(key.next_ids) if s != spent.stripe and start <= key.last_id]
    _jitter.shuffle(left)
    for other in left:
        try:
            return store.allocate(name, count, stripe=other)
        except Exhausted as exc:
            if exc.stripe is None:
                raise
    raise Exhausted(name, key.last_id) from spent
