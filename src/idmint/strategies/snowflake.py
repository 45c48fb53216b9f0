"""Snowflake ids: time | worker | sequence, with a fenced worker lease and a guarded clock.

Safety rests on the lease store, never on clocks agreeing (docs/guarantees.md):

- The worker id is leased (`LeaseStore`). The lease carries a *horizon*: the highest timestamp
  its holder may issue, recorded in the store before the holder uses it. The holder never
  issues a tick past its horizon; the next holder of that worker id issues only ticks above it
  (waiting while its own clock is behind). Two holders of one worker id therefore never share
  a tick, even if the first is paused past its lease and wakes up.
- A holder whose renewals fail stops at a local monotonic deadline (ttl minus a margin) with
  LeaseLost, and takes a lease again when the store answers.
- The clock: a step back of at most `max_backstep_ms` is waited out; more raises
  ClockMovedBackwards until the clock is past the last tick issued. A full tick waits for the
  next one.

Hot path: each tick's ids are one `range` iterator, drawn with `next()` (atomic under the GIL)
while the wall clock is inside that tick. Only a new tick takes the lock.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from .._errors import (
    ClockMovedBackwards,
    Closed,
    IdmintError,
    InvalidArgument,
    LeaseLost,
    StoreUnavailable,
)
from .._fork import ForkAware
from ..ids import check_count, check_key_name, is_digits
from ..layout import Decoded, Layout, layout_named
from ..stores.base import CasStore, Lease, LeaseStore
from .clock_offset import WARN_MS, ClockOffset

log = logging.getLogger("idmint.snowflake")

MAX_BATCH = 1_000_000
DEFAULT_TTL = 10.0  # seconds
#: A cell per namespace: the longest lease ttl (ms) any holder has used there (see record_ttl).
TTL_CELL_PREFIX = "lease-ttl/"
_random = random.Random()


def record_ttl(cells: CasStore, namespace: str, ttl: float) -> float:
    """The longest lease ttl any holder of `namespace` has used, after recording `ttl` in the
    store's cell for it (it only grows). A store in its first ttl (made, or fenced after a
    failover) may lack leases of its earlier life whose holders issue until their horizons:
    a newcomer waits out the longest ttl any of them uses, which this record keeps (written
    before each acquire, so a holder's ttl is in the store before its lease is), not only its
    own (issue 30)."""
    key, ms = TTL_CELL_PREFIX + namespace, int(ttl * 1000)
    for _ in range(10):  # each round lost means another holder recorded meanwhile
        found = cells.read(key)
        if found is None:
            if cells.create(key, str(ms)):
                return ttl
            continue
        value, version = found
        recorded = int(value) if is_digits(value) else 0
        if recorded >= ms:
            return recorded / 1000
        if cells.swap(key, version, str(ms)):
            return ttl
    raise StoreUnavailable(
        f"store {cells.display_url}: the longest lease ttl of namespace {namespace!r} kept "
        "changing under ten reads"
    )


@dataclass(frozen=True)
class SnowflakeOptions:
    """namespace: the worker ids' namespace in the lease store (one per id space).
    ttl: seconds a lease lives without renewal; renewed every ttl/3.
    max_backstep_ms: a clock step back up to this is waited out; more raises.
    random_start: start each tick's sequence at a random number below 100 (Leaf's option), so
        `id % n` sharding stays even when only a few ids are issued per tick.
    max_floor_wait: seconds a new holder waits for its clock to pass the previous holder's
        horizon before it gives up with ClockMovedBackwards (never less than ttl: a store in
        its first ttl makes every holder wait until it is one ttl old, see LeaseKeeper).
    """

    namespace: str = "default"
    ttl: float = DEFAULT_TTL
    max_backstep_ms: float = 5.0
    random_start: bool = False
    max_floor_wait: float = 30.0

    def __post_init__(self) -> None:
        check_key_name(self.namespace)
        if not 1.0 <= self.ttl <= 3600:
            raise InvalidArgument(f"ttl must be from 1 to 3600 seconds, not {self.ttl!r}")
        if self.max_backstep_ms < 0 or self.max_floor_wait < 0:
            raise InvalidArgument("max_backstep_ms and max_floor_wait must be at least 0")


class LeaseKeeper(ForkAware):
    """Holds a worker lease: renews it on a background thread and answers, without I/O,
    whether it may issue a given timestamp now.

    With `worker_id`, the lease is a static claim on that one worker id (the store records it
    and never leases it to anyone else); otherwise the store picks a free id."""

    def __init__(
        self,
        store: LeaseStore,
        workers: int,
        options: SnowflakeOptions,
        wall_ms: Callable[[], int],
        *,
        worker_id: int | None = None,
        ttl_cells: CasStore | None = None,
    ) -> None:
        """`ttl_cells`: the lease store's cells, where the longest ttl of the namespace's
        holders is kept (record_ttl); None: a store in its first ttl is waited out for
        max(ttl, DEFAULT_TTL) only."""
        self.store, self.workers, self.options = store, workers, options
        self.static_worker_id = worker_id
        self._wall_ms = wall_ms
        self.ttl_cells = ttl_cells
        #: The ttl a store in its first ttl is waited out for, as of the last acquire.
        self.quarantine_ttl = max(options.ttl, DEFAULT_TTL)
        self._fresh_state()
        self._watch_fork()

    def _fresh_state(self) -> None:
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        self._deadline = 0.0  # monotonic: no new tick after this without a renewal
        self._stop = threading.Event()
        self._wake = threading.Event()  # renew or acquire now, not at the next interval
        self._error: IdmintError | None = None
        self._started = False
        self.worker_id: int | None = None  # of the last lease held, for stats
        self.store_id: str | None = None  # the store identity the last lease came from
        self.renewals = 0
        self.reacquired = 0
        self.clock = ClockOffset()
        self._clock_warned = False
        self._thread = threading.Thread(target=self._run, name="idmint-lease", daemon=True)

    def _after_fork(self) -> None:
        # The lease is the parent's: the child never renews nor releases it, and takes its
        # own worker id when it first issues (ensure()).
        self._fresh_state()

    @property
    def margin(self) -> float:
        # Local monotonic time and the store's clock may run at slightly different rates.
        return max(0.5, self.options.ttl * 0.1)

    def start(self) -> Lease:
        """Take the first lease (raising what the store raised) and start renewing it."""
        lease = self._acquire()
        self._started = True
        self._thread.start()
        return lease

    def ensure(self) -> Lease:
        """The valid lease; in a forked child, first a lease of its own. Raises LeaseLost."""
        if self._check_fork() or not self._started:
            self.start()
        return self.lease()

    def _acquire(self) -> Lease:
        longest = max(self.options.ttl, DEFAULT_TTL)
        if self.ttl_cells is not None:
            longest = max(longest, record_ttl(self.ttl_cells, self.options.namespace, longest))
        sent = time.monotonic()
        sent_ms = self._wall_ms()
        lease = self.store.acquire(
            self.options.namespace,
            workers=self.workers,
            ttl=self.options.ttl,
            horizon_ms=sent_ms + int(self.options.ttl * 1000),
            now_ms=sent_ms,  # prefer a worker id usable at once over the lowest one
            worker_id=self.static_worker_id,
        )
        self._measure(sent_ms, lease)
        if lease.store_created_ms is not None:
            # A store that is younger than a ttl may have lost its data (wiped, a failover
            # fenced, or a new server behind the same address) while holders of its old life
            # still issue under horizons it no longer knows: at most one of their ttls ahead
            # of when it was made. Holders may use another ttl than ours: count on at least
            # the default one, and on the longest the store recorded.
            self.quarantine_ttl = longest
            quarantine = lease.store_created_ms + int(longest * 1000)
            if quarantine > lease.floor_ms:
                lease = replace(lease, floor_ms=quarantine)
        with self._lock:
            self._lease, self._deadline, self._error = lease, sent + lease.ttl - self.margin, None
            self.worker_id, self.store_id = lease.worker_id, lease.store_id
        return lease

    def extend(self) -> Lease:
        """Renew now, moving the horizon to now + ttl. A lease past its local deadline is
        renewed too if the store still has it as ours (a paused process that nobody replaced
        carries on). Raises LeaseLost (and drops the lease) or StoreUnavailable."""
        with self._lock:
            lease = self._lease
        if lease is None:
            raise LeaseLost(f"no worker lease in namespace {self.options.namespace!r}")
        sent = time.monotonic()
        sent_ms = self._wall_ms()
        try:
            renewed = self.store.renew(lease, sent_ms + int(self.options.ttl * 1000))
            self._check_continuity(lease, renewed)
        except LeaseLost as exc:
            with self._lock:
                if self._lease is lease:
                    self._lease, self._error = None, exc
            self._wake.set()  # take a new lease at once
            raise
        self._measure(sent_ms, renewed)
        with self._lock:
            if self._lease is lease:
                self._lease, self._deadline = renewed, sent + renewed.ttl - self.margin
                self._error = None
                self.renewals += 1
        return renewed

    @staticmethod
    def _check_continuity(lease: Lease, renewed: Lease) -> None:
        """The store must still be the one the lease came from: else it lost its data, and a
        newcomer may take our worker id without our horizon. (A store that forgot a horizon
        but kept its identity says so itself: renew raises LeaseLost.)"""
        if renewed.store_id != lease.store_id:
            raise LeaseLost(
                f"the lease store's identity changed ({lease.store_id} -> {renewed.store_id}): "
                "it lost its data; taking a new lease"
            )

    def _measure(self, sent_ms: int, answer: Lease) -> None:
        """Take the store's clock reading of a round trip that began at sent_ms."""
        if answer.store_ms is None:
            return
        offset = self.clock.add(
            sent_ms=sent_ms,
            received_ms=self._wall_ms(),
            store_ms=answer.store_ms,
            step_ms=answer.store_ms_step,
        )
        far = offset.surely_beyond(WARN_MS)
        if far and not self._clock_warned:
            log.warning(
                "this host's clock is %+.0f ms (±%.0f) off the lease store's: the time part of "
                "its ids is off by as much",
                -offset.ms,
                offset.error_ms,
            )
        elif self._clock_warned and not far:
            log.info("this host's clock is within %.0f ms of the lease store's again", WARN_MS)
        self._clock_warned = far

    def lease(self) -> Lease:
        """The lease, if it is still valid by the local deadline; else LeaseLost."""
        with self._lock:
            lease, deadline, error = self._lease, self._deadline, self._error
        if lease is None or time.monotonic() >= deadline:
            reason = f": {error}" if error else ""
            raise LeaseLost(
                f"no valid worker lease in namespace {self.options.namespace!r}{reason}"
            )
        return lease

    def deadline_in(self) -> float:
        with self._lock:
            return self._deadline - time.monotonic()

    def _run(self) -> None:
        # A store may grant a shorter ttl than asked (ZooKeeper caps its sessions): renew by
        # the lease's own, every ttl/3 or a little sooner. The jitter keeps many holders from
        # renewing in step, and samples the store's clock at many phases of its resolution
        # (etcd's Date header counts whole seconds), which tightens the offset estimate.
        while True:
            ttl = (self._lease or self.options).ttl
            self._wake.wait(ttl / 3 * _random.uniform(0.8, 1))
            self._wake.clear()
            if self._stop.is_set():
                return
            self._tend()

    def _tend(self) -> None:
        """One renewal, or one attempt to take a lease when there is none."""
        try:
            if self._lease is not None:
                self.extend()
                return
        except LeaseLost as exc:
            # Another process holds our worker id now, or the store lost it: never renew it
            # again; a new lease is taken just below.
            log.warning("worker lease lost: %s", exc)
        except IdmintError as exc:
            # Keep the lease: the store may still have it as ours when it answers again, even
            # past our deadline (until then lease() refuses new ticks).
            log.warning(
                "cannot renew the worker lease (deadline in %.1f s): %s", self.deadline_in(), exc
            )
            with self._lock:
                self._error = exc
            return
        try:
            lease = self._acquire()
        except IdmintError as exc:
            with self._lock:
                self._error = exc
            log.warning("cannot take a worker lease: %s", exc)
            return
        self.reacquired += 1
        log.warning("worker lease taken again: worker %d", lease.worker_id)

    def close(self, issued_ms: int | None) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(5)
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self.store.release(lease, issued_ms)
            except IdmintError as exc:
                log.warning(
                    "could not release worker %d (it expires in %.0f s): %s",
                    lease.worker_id,
                    lease.ttl,
                    exc,
                )


class SnowflakeGenerator(ForkAware):
    """Time-sorted 63-bit (or fewer) ids from a leased worker id. Thread-safe.

    flakes = SnowflakeGenerator(lease_store, "twitter")
    flakes.next_id()            # 1861905812123455488
    flakes.decode(1861905812123455488).time
    flakes.close()              # releases the worker id

    `worker_id=N` claims that worker id statically instead (see LeaseKeeper). In a forked
    child the generator takes a lease of its own before it issues anything.
    """

    def __init__(
        self,
        store: LeaseStore,
        layout: str | Layout = "twitter",
        options: SnowflakeOptions | None = None,
        *,
        worker_id: int | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        ttl_cells: CasStore | None = None,
    ) -> None:
        self.layout = layout_named(layout)
        self.options = options or SnowflakeOptions()
        self._clock_ns = clock_ns
        self._tick_ns = self.layout.tick_ms * 1_000_000
        self._epoch_ns = self.layout.epoch_ms * 1_000_000
        now_ms = clock_ns() // 1_000_000
        if now_ms > self.layout.end_ms:
            raise InvalidArgument(
                f"layout {self.layout.name!r} ran out of time on {self.layout.end:%Y-%m-%d}"
            )
        if now_ms < self.layout.epoch_ms:
            raise InvalidArgument(f"the clock is before layout {self.layout.name!r}'s epoch")
        self._closed = False
        self._told_floor = 0  # the lease floor whose wait was last explained in the log
        self._last_tick = -1
        self._fresh_state()
        self._keeper = LeaseKeeper(
            store,
            self.layout.workers,
            self.options,
            self._wall_ms,
            worker_id=worker_id,
            ttl_cells=ttl_cells,
        )
        lease = self._keeper.start()
        self._watch_fork()
        years = self.layout.runway_years(now_ms)
        log.info(
            "snowflake %s: worker %d, %.1f years of time bits left",
            self.layout.name,
            lease.worker_id,
            years,
        )

    def _fresh_state(self) -> None:
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._issued_ms: int | None = None
        self._rollbacks = 0
        self._cur: tuple[int, int, Iterator[int]] = (0, 0, iter(()))  # start_ns, end_ns, ids
        self.instance = uuid.uuid4().hex[:8]

    def _after_fork(self) -> None:
        # The tick being served belongs to the parent's worker id: drop it. The keeper takes
        # the child's own lease at the next tick. _last_tick stays: ticks only move forward.
        self._fresh_state()

    @property
    def worker_id(self) -> int | None:
        """The worker id of the current (or last) lease; None in a forked child that has not
        issued yet (the parent's is not its own)."""
        return self._keeper.worker_id

    def _wall_ms(self) -> int:
        return self._clock_ns() // 1_000_000

    # -- the hot path ------------------------------------------------------------------------

    def next_id(self) -> int:
        """The next id. Raises LeaseLost, ClockMovedBackwards, StoreUnavailable or Closed."""
        start, end, ids = self._cur
        if start <= self._clock_ns() < end:
            i = next(ids, None)
            if i is not None:
                return i
        return self._next_slow()

    def next_ids(self, count: int) -> list[int]:
        """`count` ids (1 to 1,000,000), increasing; waits for new ticks as it must."""
        check_count(count, maximum=MAX_BATCH)
        out: list[int] = []
        while len(out) < count:
            start, end, ids = self._cur
            if start <= self._clock_ns() < end:
                out += itertools.islice(ids, count - len(out))
                if len(out) == count:
                    break
            out.append(self._next_slow())
        return out

    def _next_slow(self) -> int:
        self._check_fork()
        with self._lock:
            while True:
                if self._closed or self._closing.is_set():
                    raise Closed("the snowflake generator is closed")
                start, end, ids = self._cur
                now = self._clock_ns()
                if start <= now < end:
                    i = next(ids, None)
                    if i is not None:
                        return i
                    self._sleep_ns(end - now)  # the tick is full: wait for the next one
                    continue
                self._begin_tick(now)

    def _begin_tick(self, now_ns: int) -> None:
        """Make the current tick's ids available, after every check that guards them."""
        tick = (now_ns - self._epoch_ns) // self._tick_ns
        if tick <= self._last_tick:
            behind_ms = ((self._last_tick + 1) * self._tick_ns + self._epoch_ns - now_ns) / 1e6
            if (
                tick < self._last_tick
                and behind_ms > self.options.max_backstep_ms + self.layout.tick_ms
            ):
                self._rollbacks += 1
                raise ClockMovedBackwards(behind_ms)
            self._sleep_ns(int(behind_ms * 1e6))  # a small step back, or the same tick again
            return
        if tick > self.layout.max_ticks:
            raise InvalidArgument(f"layout {self.layout.name!r} ran out of time bits")
        lease = self._keeper.ensure()
        first_ms = self.layout.tick_start_ms(tick)
        last_ms = first_ms + self.layout.tick_ms - 1
        if first_ms <= lease.floor_ms:
            # A previous holder of this worker id may have issued up to floor_ms.
            wait_ms = lease.floor_ms + 1 - first_ms
            if wait_ms > max(self.options.max_floor_wait, self.options.ttl, DEFAULT_TTL) * 1000:
                raise ClockMovedBackwards(wait_ms)
            if wait_ms >= 1000 and self._told_floor != lease.floor_ms:
                self._told_floor = lease.floor_ms
                self._explain_wait(lease, wait_ms)
            self._sleep_ns(wait_ms * 1_000_000)
            return
        if last_ms > lease.horizon_ms:
            # Past what the store has recorded (a clock jump forward, or a late renewal):
            # move the horizon before issuing.
            try:
                lease = self._keeper.extend()
            except StoreUnavailable as exc:
                raise StoreUnavailable(f"cannot extend the worker lease's horizon: {exc}") from exc
            if last_ms > lease.horizon_ms:
                raise LeaseLost("the store did not record a horizon past the current time")
        size = self.layout.sequences
        first_seq = _random.randrange(min(100, size)) if self.options.random_start else 0
        if self.layout.worker_low:
            step = 1 << self.layout.worker_bits
            base = self.layout.compose(tick, lease.worker_id, 0)
            ids = iter(range(base + first_seq * step, base + size * step, step))
        else:
            base = self.layout.base(tick, lease.worker_id)
            ids = iter(range(base + first_seq, base + size))
        tick_start = self._epoch_ns + tick * self._tick_ns
        self._last_tick = tick
        self._issued_ms = last_ms
        self._cur = (tick_start, tick_start + self._tick_ns, ids)

    def _explain_wait(self, lease: Lease, wait_ms: int) -> None:
        """Say why the first ids wait (a second or more of silence looks like a hang)."""
        made = lease.store_created_ms
        if made is not None and lease.floor_ms == made + int(self._keeper.quarantine_ttl * 1000):
            why = (
                f"the lease store {self._keeper.store.display_url} was made "
                f"{max(0, time.time() * 1000 - made) / 1000:.1f} s ago (or fenced), and a store "
                "younger than the longest lease ttl its holders use "
                f"({self._keeper.quarantine_ttl:g} s) may have lost the leases of its earlier "
                "life, whose holders may still issue ids until then"
            )
        else:
            why = f"a previous holder of worker id {lease.worker_id} may have issued ids until then"
        log.warning("snowflake: waiting %.1f s before the first id: %s", wait_ms / 1000, why)

    def _sleep_ns(self, ns: int) -> None:
        # Event.wait, not time.sleep: under libfaketime with a faked monotonic clock,
        # time.sleep can misbehave; a bounded wait on an event does not. close() sets it, so
        # a long wait (a previous holder's horizon) never holds up shutdown.
        self._closing.wait(max(ns, 50_000) / 1e9)

    # -- the rest ----------------------------------------------------------------------------

    def decode(self, id_: int) -> Decoded:
        return self.layout.decode(id_)

    def stats(self) -> dict[str, object]:
        try:
            lease: Lease | None = self._keeper.lease()
        except LeaseLost:
            lease = None
        offset = self._keeper.clock.current()
        return {
            "layout": self.layout.name,
            "worker_id": self.worker_id if lease is None else lease.worker_id,
            "lease_deadline_s": self._keeper.deadline_in(),
            "horizon_ms": lease.horizon_ms if lease else None,
            # the store's clock minus ours; None when the store has no clock (memory, static)
            "clock_offset_ms": round(offset.ms, 1) if offset else None,
            "clock_offset_error_ms": round(offset.error_ms, 1) if offset else None,
            "rollbacks": self._rollbacks,
            "renewals": self._keeper.renewals,
            "runway_years": self.layout.runway_years(self._wall_ms()),
        }

    def close(self) -> None:
        """Stop issuing and release the worker id (its horizon comes down to the last tick
        issued, so the next holder need not wait)."""
        self._closing.set()  # wakes a caller waiting for a tick, which holds the lock
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cur = (0, 0, iter(()))
            issued = self._issued_ms
        self._keeper.close(issued)

    def __enter__(self) -> SnowflakeGenerator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
