"""One bounded pool of threads that loads ranges in the background for every generator.

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
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from typing import Protocol

from .._errors import InvalidArgument
from .._fork import ForkAware

log = logging.getLogger("idmint.refills")

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
                log.exception("a refill job failed")
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
        log.exception("a refill job could not tell when it is due")
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
