"""A lock callers can wait on that costs a plain lock while nobody waits.

A threading.Condition costs about 1.4 KB; a server may hold 100,000 generators, nearly all
idle. WaitableLock makes the Condition only while a thread waits, and drops it after.
"""

from __future__ import annotations

import threading


class WaitableLock:
    """`with lock:` as a Lock; `wait(timeout)` and `notify_all()` as a Condition over it (call
    both with the lock held)."""

    __slots__ = ("_cond", "_lock", "_waiting")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond: threading.Condition | None = None
        self._waiting = 0

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Release the lock until notified or `timeout` passes; False on the timeout."""
        if self._cond is None:
            self._cond = threading.Condition(self._lock)
        cond = self._cond
        self._waiting += 1
        try:
            return cond.wait(timeout)
        finally:
            self._waiting -= 1
            if not self._waiting:
                self._cond = None  # nobody waits on it: a later waiter makes a fresh one

    def notify_all(self) -> None:
        if self._cond is not None:
            self._cond.notify_all()
