"""Client-side deadlines for driver calls that have none of their own.

A server that stops answering with its socket open (SIGSTOPped, or frozen by a hypervisor)
still has a kernel that acknowledges every packet: TCP keepalives and `tcp_user_timeout` never
fire, and a timeout the server enforces (PostgreSQL's `statement_timeout`) never runs. What
ends such a call is the client giving up: `WATCHDOG.arm(seconds, action)` runs `action` (which
shuts the call's socket down, so the blocked read returns at once) unless `disarm` came first.

One daemon thread per process serves every armed deadline; it starts on first use, and again
in a forked child.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable


class Watchdog:
    """Runs an action when its deadline passes, unless it was disarmed first."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # A forked child has no watchdog thread, and the parent's lock may have been held.
        self._cond = threading.Condition(threading.Lock())
        self._due: dict[int, tuple[float, Callable[[], None]]] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, action: Callable[[], None]) -> int:
        """Run `action` (quick, non-blocking) `seconds` from now; a token for `disarm`."""
        with self._cond:
            token = next(self._tokens)
            self._due[token] = (time.monotonic() + seconds, action)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, args=(self._cond, self._due), name="idmint-deadlines"
                )
                self._thread.daemon = True
                self._thread.start()
            self._cond.notify()
            return token

    def disarm(self, token: int) -> bool:
        """Cancel a deadline: True if its action had not run (and now never will). An action
        that is running finishes first, so nothing it touches is reused under it."""
        with self._cond:
            return self._due.pop(token, None) is not None

    @staticmethod
    def _loop(cond: threading.Condition, due: dict[int, tuple[float, Callable[[], None]]]) -> None:
        with cond:
            while True:
                now = time.monotonic()
                for token in [t for t, (at, _) in due.items() if at <= now]:
                    _, action = due.pop(token)
                    try:
                        action()  # under the lock: see disarm
                    except Exception:
                        logging.getLogger(__name__).debug("deadline action failed", exc_info=True)
                cond.wait(min((at for at, _ in due.values()), default=now + 3600) - now)


WATCHDOG = Watchdog()
