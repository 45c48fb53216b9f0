"""The nodes of quorum keys (see quorum.py): one NodeSlot per node, with its thread, health
and checks, and the QuorumNodeSet that the keys of one node list share, with the threads that
run their rounds. What is true of a node for every key lives here (unsafe, named twice, a new
identity); what one key saw on a node (its counter there) lives with the key, in
quorum_counter.py.

This module knows the keys only through the two small protocols below, so that the keys'
modules can import it and not the other way round.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from .._errors import InvalidArgument
from .._fork import ForkAware
from ..stores.base import MultiplexedQuorumNode, QuorumNode
from .quorum_options import NodeHealth, check_nodes

log = logging.getLogger("idmint.quorum")


class ClaimOwner(Protocol):
    """The key a multiplexed node's outstanding claim was sent for (a QuorumCounter): any key
    of the set may read the answer, and notes it for its owner."""

    def _answered(self, slot: NodeSlot, applied: bool, counter: int) -> None: ...

    def _refused(self, slot: NodeSlot) -> str | None: ...


class RoundJob(Protocol):
    """A key whose waiting requests a round thread serves (a QuorumGenerator)."""

    @property
    def key(self) -> str: ...

    def flush_once(self) -> None: ...


Answer = tuple["NodeSlot", "tuple[bool, int] | Exception"]


class NodeSlot:
    """One node of a node set, shared by the set's keys, with a thread of its own so that a
    hung node holds up only its calls. Calls and answers travel on SimpleQueues: a round is
    five hand-offs each way, and the futures of concurrent.futures cost more CPU than the
    claims themselves."""

    #: Calls one node may have running or queued: more means it hangs, and rounds go on
    #: without it rather than queue behind it.
    MAX_PENDING = 2

    def __init__(self, node: QuorumNode, index: int) -> None:
        self.node = node
        self.index = index  # its place in the set: keys keep what they saw on it there
        self.health = NodeHealth(node.display_url)  # the node's own (its counter: see _KeyNode)
        self.checked = False  # durability and identity looked at since the last failure
        self.checked_at = 0.0  # when (monotonic)
        self.identity: str | None = None  # the node's identity when first checked
        #: Why every key of the set must refuse it at once (unsafe, a duplicate): raised again
        #: to each key opened on the set, as it was to the first.
        self.misconfigured: InvalidArgument | None = None
        #: Failed calls so far: a key reads its counter on the node again once this moved (a
        #: reconnect may reach a node that lost data meanwhile).
        self.epoch = 0
        self.forget_threads()

    def check_due(self, every: float) -> bool:
        return not self.checked or time.monotonic() - self.checked_at >= every

    def failed(self, error: BaseException) -> None:
        self.checked = False  # a reconnect may follow: check the node again first
        self.epoch += 1
        self.health.failed(error)

    def forget_threads(self) -> None:
        """Start afresh (also after a fork: the parent's thread and calls are not ours)."""
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], tuple[bool, int]], queue.SimpleQueue[Answer]] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending = 0
        self.health.in_flight = False
        #: Multiplexed nodes: the key and start of the claim whose answer has not been read
        #: yet (any key's round may read it: they share the connection), and when it was sent.
        self.outstanding: tuple[ClaimOwner, int] | None = None
        self.sent_at = 0.0

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def submit(
        self, call: Callable[[], tuple[bool, int]], answers: queue.SimpleQueue[Answer]
    ) -> bool:
        """Run `call` on the node's thread, its answer (or exception) put on `answers`; False
        if the node has too many calls pending."""
        with self._lock:
            if self._pending >= self.MAX_PENDING:
                return False
            self._pending += 1
            self.health.in_flight = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="idmint-quorum-node", daemon=True
                )
                self._thread.start()
        self._jobs.put((call, answers))
        return True

    def _serve(self) -> None:
        jobs = self._jobs
        while (job := jobs.get()) is not None:
            call, answers = job
            answer: tuple[bool, int] | Exception
            try:
                answer = call()
            except Exception as exc:
                answer = exc
            with self._lock:
                self._pending -= 1
                self.health.in_flight = self._pending > 0
            answers.put((self, answer))

    def shutdown(self) -> None:
        self._jobs.put(None)


class QuorumNodeSet(ForkAware):
    """The nodes of quorum keys, shared by every key served from them: one connection and one
    thread per node, and at most ROUND_THREADS threads running the keys' rounds, however many
    keys there are (a key costs its own counters and queue, nothing per node). The keys'
    rounds take turns on the nodes (`round_lock`): a round lasts at most round_wait, and a
    multiplexed node has one claim outstanding at a time.

    Checks that hold for every key run here (a node that may lose acknowledged claims, a node
    named twice, a node with a new identity); each key checks its own counter on each node.
    Made by Minter.quorum (one set per node list, shared by its keys) or by a QuorumCounter
    given node objects (its own set, closed with it)."""

    #: Threads that run the rounds of the set's keys (each a QuorumGenerator's batch). A key
    #: whose round was lost waits at random before its next one; the other threads go on
    #: serving the other keys meanwhile.
    ROUND_THREADS = 4
    #: Seconds an idle round thread waits for work before it ends.
    IDLE = 10.0

    def __init__(
        self, nodes: Sequence[QuorumNode], *, unsafe: bool = False, recheck: float = 10.0
    ) -> None:
        check_nodes([n.display_url for n in nodes])
        self.unsafe, self.recheck = unsafe, recheck
        self.majority = len(nodes) // 2 + 1
        self.slots = [NodeSlot(n, i) for i, n in enumerate(nodes)]
        # Nodes that take claims apart from their answers run a round on the caller's thread
        # (poll over their sockets): a third of the CPU of a thread per node.
        self.multiplexed = all(isinstance(n, MultiplexedQuorumNode) for n in nodes)
        self._identities: dict[str, str] = {}  # node identity -> url, to spot one node twice
        self.lost_nodes = 0  # nodes refused while in use: unsafe, a new identity
        self.closed = False
        self._fresh_threads()
        self._watch_fork()

    def _fresh_threads(self) -> None:
        self.round_lock = threading.Lock()
        self._work = threading.Condition()
        self._ready: deque[RoundJob] = deque()
        self._threads = self._idle = 0

    def _after_fork(self) -> None:
        self._fresh_threads()
        for slot in self.slots:
            slot.forget_threads()

    def fork_check(self) -> None:
        """Drop the parent's threads and calls if this is a forked child."""
        self._check_fork()

    # -- node checks -------------------------------------------------------------------------

    def check_node(self, slot: NodeSlot) -> None:
        """Refuse `slot`'s node for every key (raises InvalidArgument) if it is unsafe, a
        duplicate of another, or has a new identity since this process first checked it (a
        restart with an empty data directory: it lost the claims it acknowledged). A node
        that cannot be asked raises StoreUnavailable. On the node's thread."""
        node = slot.node
        why = node.durability()
        if why is not None and not self.unsafe:
            slot.misconfigured = self._refuse(
                slot,
                why,
                f"quorum node {node.display_url} is unsafe: {why}. A node that loses a claim "
                "it acknowledged lets ids repeat after its crash; make it fsync every write "
                "(docs/quorum.md), or accept the risk with --unsafe-nodes (IDMINT_UNSAFE_NODES, "
                "QuorumOptions(unsafe=True))",
            )
            raise slot.misconfigured
        if why is not None and not slot.checked_at:
            log.warning(
                "quorum node %s may lose claims (%s): running unsafe", node.display_url, why
            )
        identity = node.identity()
        if identity is not None:
            if slot.identity is not None and identity.id != slot.identity:
                raise self._refuse(
                    slot,
                    "a new store identity: it lost its data",
                    f"quorum node {node.display_url} has a new store identity ({identity.id}, "
                    f"was {slot.identity}): it lost its data, and with it the claims it "
                    "acknowledged, so it no longer votes on any key in this process. Before "
                    "using it again, raise its counters above every id handed out",
                )
            slot.identity = identity.id
            other = self._identities.setdefault(identity.id, node.display_url)
            if other != node.display_url:
                slot.misconfigured = self._refuse(
                    slot,
                    f"the same node as {other}",
                    f"quorum nodes {other} and {node.display_url} are one node (one store "
                    "identity): a majority counted on them is not a majority",
                )
                raise slot.misconfigured
        slot.checked, slot.checked_at = True, time.monotonic()

    def _refuse(self, slot: NodeSlot, why: str, message: str) -> InvalidArgument:
        """Leave the slot's node out of every round from now on, loudly."""
        slot.health.refused = why
        self.lost_nodes += 1
        log.error("%s", message)
        return InvalidArgument(message)

    def misconfigured(self) -> InvalidArgument | None:
        """Why a node of the set is refused for every key (unsafe, a duplicate), if one is."""
        return next((s.misconfigured for s in self.slots if s.misconfigured), None)

    # -- round threads -----------------------------------------------------------------------

    def schedule(self, generator: RoundJob) -> None:
        """Run `generator`'s next batch on a round thread (one started if none is idle)."""
        self.fork_check()
        with self._work:
            self._ready.append(generator)
            if self._idle < len(self._ready) and self._threads < self.ROUND_THREADS:
                self._threads += 1
                threading.Thread(target=self._run, name="idmint-quorum-rounds", daemon=True).start()
            self._work.notify()

    def _run(self) -> None:
        while True:
            with self._work:
                idle_until = time.monotonic() + self.IDLE
                while not self._ready:
                    left = idle_until - time.monotonic()
                    if left <= 0 or self.closed:
                        self._threads -= 1
                        return
                    self._idle += 1
                    self._work.wait(left)
                    self._idle -= 1
                generator = self._ready.popleft()
            try:
                generator.flush_once()
            except Exception:  # a bug: never lose the thread, never leave callers waiting
                log.exception("quorum key %r: batch failed", generator.key)

    def close(self) -> None:
        """Stop the round threads and close the nodes (every key of the set stops too)."""
        with self._work:
            self.closed = True
            self._work.notify_all()
        for slot in self.slots:
            slot.shutdown()
            try:
                slot.node.close()
            except Exception as exc:  # closing is best effort
                log.debug("closing quorum node %s: %s", slot.node.display_url, exc)
