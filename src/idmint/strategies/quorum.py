"""Quorum keys: ids strictly increasing in real time across every caller, from a majority of N
independent nodes (antirez's algorithm), with group commit.

Each node keeps a counter per key that only moves up, changed by one atomic step:

    claim(start, end): if counter < start then counter = end, answer yes; else answer no and
                       the counter

A round claims [start, end] on every node at once and wins when a majority says yes. Why that
is enough, for any start:

- Unique. Two winning rounds share a node (two majorities meet). Whichever reached it first
  left its counter at its end; the second applied there only because the counter was below
  its start. So the second range lies wholly above the first.
- Strictly increasing in real time. If round A won before round B began, a majority holds at
  least A's end; B's majority meets it at a node that let B apply, so B's start is above A's
  end.

Neither argument uses how `start` was chosen, so no round reads first: `start` is one above the
highest counter this process has seen, and a refusal carries the node's counter, which the next
try starts above. A round is one round trip (one fsync on each node), not antirez's two, and a
stale guess costs one refused round. The proof needs every acknowledged claim to survive a
crash of its node: a node that comes back with a lower counter can let a later round take ids
again. Hence the refusal of nodes that do not fsync before answering (`durability()`).

On Redis nodes a round's claim is placed (quorum_counter._mux_round):

    place(start, end, limit): as claim, but where the counter is at or past start (and below
                              limit), counter += end - start + 1: the range just above it;
                              answer yes and the counter

and the round wins on a range that a majority placed in the same spot. Both arguments hold
with "the range a node gave the round" for [start, end]: a node gives each claim ids above
every one it gave before, so two winning ranges, given by a node the two majorities share,
are apart, and a round that began after another won gets ids above it there. A stale start
costs nothing, and callers whose claims reach the nodes in the same order all win at once.

Contention: callers who claim the same start at once may split the nodes so that nobody has
a majority (placed claims: nodes that took them in different orders put them apart); every one
of them retries above what it saw, after a random wait that doubles each time (up to
`longest_wait`; after placed claims that every node took, only apart, a short one of up to
three rounds' time, which takes callers out of step), until `deadline`,
then QuorumUnavailable. Group commit (QuorumGenerator) avoids it within a process: callers
that arrive while a round runs wait for the next one, which claims all their ids at once and
hands them out in arrival order. Each of them began before that round did, so every id is
above each id handed out before its caller asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .._errors import Closed, IdmintError, QuorumUnavailable
from .._fork import ForkAware
from ..ids import Range, check_count
from ..stores.base import QuorumNode
from .quorum_counter import QuorumCounter
from .quorum_nodes import QuorumNodeSet, QuorumOptions, QuorumStats

log = logging.getLogger("idmint.quorum")


@dataclass
class _Request:
    count: int
    done: threading.Event = field(default_factory=threading.Event)
    ids: Range | None = None
    error: IdmintError | None = None
    abandoned: bool = False
    #: The monotonic time by which it is answered, ids or QuorumUnavailable: its arrival plus
    #: the deadline, whatever rounds ran before its own.
    until: float = 0.0
    #: Called on the flusher's thread once answered (take_async wakes its event loop).
    on_done: Callable[[], None] | None = None

    def answer(self, ids: Range | None = None, error: IdmintError | None = None) -> None:
        self.ids, self.error = ids, error
        self.done.set()
        if self.on_done is not None:
            self.on_done()

    def result(self) -> Range:
        if self.error is not None:
            raise self.error
        assert self.ids is not None
        return self.ids


class QuorumGenerator(ForkAware):
    """Ids of one quorum key for every thread of a process, with group commit: while a round
    runs, new requests queue; the next round claims all of them at once. Thread-safe.

        ticket = minter.quorum("ticket", ["redis://a", "redis://b", "redis://c"])
        ticket.next_id()        # above every ticket id handed out before this call began
        ticket.next_ids(100)    # a Range of 100 consecutive ids, likewise
    """

    def __init__(self, counter: QuorumCounter) -> None:
        self.counter = counter
        self.key = counter.key
        self._cond = threading.Condition()
        self._queue: deque[_Request] = deque()
        self._scheduled = False  # on the node set's list of keys with work, or being served
        self._running = False  # a batch of it is in a round now
        self._closed = False
        self.ids = self.requests = self.failures = self.largest_batch = 0
        self.last_error: str | None = None
        self._watch_fork()

    def _after_fork(self) -> None:
        # The parent's round threads and waiting callers are not in this process.
        self._cond = threading.Condition()
        self._queue = deque()
        self._scheduled = self._running = False

    def next_id(self) -> int:
        return self.take(1).start

    def next_ids(self, count: int) -> Range:
        return self.take(count)

    def take(self, count: int = 1, *, until: float | None = None) -> Range:
        """`count` consecutive ids (see the class doc); QuorumUnavailable past the deadline
        (or at the monotonic time `until`, if sooner: a caller's own bound)."""
        request = self._enqueue(count, until=until, run_here=True)
        # The round that serves it may start only when the one running now ends.
        if not request.done.wait(self._wait_bound):
            self._abandon(request)
        return request.result()

    async def take_async(self, count: int = 1, *, until: float | None = None) -> Range:
        """`take` for an event loop: waits without holding a thread."""
        loop = asyncio.get_running_loop()
        answered = loop.create_future()

        def settle() -> None:
            if not answered.done():
                answered.set_result(None)

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(settle)

        request = self._enqueue(count, wake, until=until)
        # A timer that settles the future, not wait_for(shield(...)): their tasks and futures
        # cost a server more CPU per request than the rest of the wait.
        timer = loop.call_later(self._wait_bound, settle)
        try:
            await answered
        finally:
            timer.cancel()
        if not request.done.is_set():
            self._abandon(request)
        return request.result()

    @property
    def _wait_bound(self) -> float:
        # every round ends by the earliest deadline of the requests it serves (see _flush)
        return self.counter.options.deadline + 1

    def _enqueue(
        self,
        count: int,
        on_done: Callable[[], None] | None = None,
        *,
        until: float | None = None,
        run_here: bool = False,
    ) -> _Request:
        """Queue a request for `count` ids. With `run_here` (a thread that may block) and no
        round running or queued, the caller runs the round itself: a lone caller's round then
        costs no hand-off to a round thread and back (two thread wake-ups, about a third of a
        client's CPU per id). Callers that come meanwhile queue behind it as usual."""
        check_count(count, maximum=self.counter.options.max_batch)
        self._check_fork()
        own = time.monotonic() + self.counter.options.deadline
        request = _Request(count, on_done=on_done, until=own if until is None else min(own, until))
        with self._cond:
            if self._closed:
                raise Closed(f"quorum key {self.key!r} is closed")
            self._queue.append(request)
            schedule, self._scheduled = not self._scheduled, True
        if schedule and run_here:
            self.flush_once()  # its batch starts with this request: the queue was empty
        elif schedule:
            self.counter.nodes.schedule(self)
        return request

    def _abandon(self, request: _Request) -> None:
        """The caller stops waiting: ids a round hands it later are burnt, never reused."""
        with self._cond:
            if request.done.is_set():
                return
            request.abandoned = True
            if request in self._queue:
                self._queue.remove(request)
        raise QuorumUnavailable(f"quorum key {self.key!r}: no round served this request")

    def flush_once(self) -> None:
        """Serve the waiting requests (up to max_batch ids) with one take, on a round thread
        of the node set; then back on its list if more came meanwhile."""
        with self._cond:
            if self._closed or not self._queue:
                self._scheduled = False
                return
            batch = [self._queue.popleft()]
            total = batch[0].count
            limit = self.counter.options.max_batch
            while self._queue and total + self._queue[0].count <= limit:
                batch.append(self._queue.popleft())
                total += batch[-1].count
            self._running = True
        try:
            self._serve(batch, total)
        finally:
            with self._cond:
                self._running = False
                more = bool(self._queue) and not self._closed
                self._scheduled = more
                self._cond.notify_all()
        if more:
            self.counter.nodes.schedule(self)  # behind the keys already waiting: fair turns

    def _serve(self, batch: list[_Request], total: int) -> None:
        try:
            # A request that waited behind a round is answered by its own deadline, not a
            # whole deadline after that round ended.
            got = self.counter.take(total, until=min(r.until for r in batch))
        except BaseException as exc:
            # A caller running its own round (see _enqueue) may be interrupted in it
            # (KeyboardInterrupt): the other callers of its batch are answered all the same.
            if isinstance(exc, IdmintError):
                error: IdmintError = exc
            else:  # a bug, a driver error not mapped, or the interrupt
                if isinstance(exc, Exception):
                    log.exception("quorum key %r: round failed", self.key)
                error = QuorumUnavailable(f"quorum key {self.key!r}: {exc or type(exc).__name__}")
            self.failures += len(batch)
            self.last_error = str(error)
            for request in batch:
                request.answer(error=error)
            if not isinstance(exc, Exception):
                raise
            return
        self.largest_batch = max(self.largest_batch, len(batch))
        next_start = got.start
        with self._cond:  # against a caller abandoning its request meanwhile
            for request in batch:  # in arrival order: the earliest gets the lowest ids
                ids = Range(next_start, next_start + request.count)
                next_start += request.count
                if request.abandoned:
                    self.counter.burnt += request.count
                    continue
                self.ids += request.count
                self.requests += 1
                request.answer(ids)

    def stats(self) -> QuorumStats:
        counter = self.counter
        return QuorumStats(
            key=self.key,
            nodes=counter.health(),
            majority=counter.majority,
            ids=self.ids,
            rounds=counter.rounds,
            retries=counter.retries,
            burnt=counter.burnt,
            requests=self.requests,
            largest_batch=self.largest_batch,
            failures=self.failures,
            last_error=self.last_error,
            closed=self._closed,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float = 1.0) -> None:
        """Stop taking requests, answer the waiting ones with Closed, close the nodes (if the
        key's own); waits at most `timeout` for a round in flight."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for request in self._queue:
                request.answer(error=Closed(f"quorum key {self.key!r} is closed"))
            self._queue.clear()
            self._cond.wait_for(lambda: not self._running, timeout)
        self.counter.close()


def checked_quorum(
    name: str, nodes: list[QuorumNode] | QuorumNodeSet, options: QuorumOptions | None
) -> QuorumGenerator:
    """Quorum key `name` on `nodes`, its nodes checked (those that answer now)."""
    counter = QuorumCounter(name, nodes, options)
    generator = QuorumGenerator(counter)
    try:
        counter.check()
    except BaseException:
        generator.close()
        raise
    return generator
