"""Bounded thread pools for the store work requests wait for, one per kind of route.

A store that hangs with its socket open (a paused server, a dead link without a reset) keeps a
thread in a driver call that nothing can interrupt. Sharing one executor, the probes' threads
stuck there used to leave none for the id routes. So each kind of work has its own pool, every
wait for it has a deadline (answered with a 503), and a pool whose slots are all taken refuses
more work at once (a 503 too) rather than queue it without bound behind the stuck threads.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_RETRY = (("retry-after", "1"),)


class PoolTimeout(Exception):
    """The work did not finish within its deadline, or the pool had no slot for it. The app
    answers 503 with the reason (`str(exc)`) and a Retry-After."""

    headers = _RETRY


class Pool:
    """`threads` daemon threads and at most `slots` jobs queued or running.

    Daemon threads, not a ThreadPoolExecutor: a worker process joins an executor's threads on
    exit, and one stuck in a driver call would hold the process past its shutdown timeout.
    """

    def __init__(self, name: str, threads: int, slots: int) -> None:
        self.name = name
        self.threads = threads
        self.slots = slots
        self.in_use = 0  # jobs queued or running, stuck ones included
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._started = 0
        self._busy = 0
        self._closed = False

    async def run(self, deadline: float, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on one of the pool's threads, waited for at most `deadline` seconds.
        Raises PoolTimeout when the deadline passes (the call goes on, and its result is
        dropped) or when every slot is taken."""
        if self._closed:
            raise PoolTimeout("the server is shutting down")
        with self._lock:
            if self.in_use >= self.slots:
                raise PoolTimeout(
                    f"{self.slots} requests already wait for the store ({self.name} routes); "
                    "try again shortly"
                )
            self.in_use += 1
        future: Future[T] = Future()
        future.add_done_callback(self._release)  # done, failed or cancelled
        self._submit(future, fn, args)
        waited = asyncio.wrap_future(future)
        done, _ = await asyncio.wait({waited}, timeout=deadline)
        if not done:
            waited.cancel()  # a job still queued is dropped; a running one cannot be stopped
            raise PoolTimeout(f"the store did not answer within {deadline:g} s")
        return waited.result()

    def _release(self, _: Future[Any]) -> None:
        with self._lock:
            self.in_use -= 1

    def _submit(self, future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        with self._lock:
            # One more thread while every started one is busy, up to the pool's size.
            if self._busy >= self._started and self._started < self.threads:
                self._started += 1
                threading.Thread(
                    target=self._work, name=f"idmint-{self.name}-{self._started}", daemon=True
                ).start()
            self._busy += 1
        self._jobs.put((future, fn, args))

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if fn is _stop:
                return
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn(*args)
                    except BaseException as exc:
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                with self._lock:
                    self._busy -= 1

    def close(self) -> None:
        """Refuse new work and let idle threads end; stuck ones are daemons and die with the
        process."""
        self._closed = True
        with self._lock:
            started = self._started
        for _ in range(started):
            self._jobs.put((Future(), _stop, ()))


def _stop() -> None:
    """The job that ends a pool thread."""
