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

Contention: callers who claim the same start at once may split the nodes so that nobody has
a majority; every one of them retries above what it saw, after a random wait that doubles
each time (up to `longest_wait`), until `deadline`, then QuorumUnavailable. Group commit
(QuorumGenerator) avoids it within a process: callers that arrive while a round runs wait for
the next one, which claims all their ids at once and hands them out in arrival order. Each of
them began before that round did, so every id is above each id handed out before its caller
asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from .._errors import (
    Closed,
    Exhausted,
    IdmintError,
    InvalidArgument,
    QuorumUnavailable,
    StoreUnavailable,
)
from .._fork import ForkAware, private_random
from .._poll import readable
from ..ids import ID_MAX, Range, check_count, check_key_name
from ..stores.base import MultiplexedQuorumNode, QuorumNode

log = logging.getLogger("idmint.quorum")

_jitter = private_random()

#: How many times its size a lost round's retry may skip ahead, at most (see take).
MAX_SPREAD = 64

#: Seconds a multiplexed node's answer may be late before its connection is dropped (the
#: claim may still apply: its ids are burnt, never handed out).
OVERDUE = 2.0

# A node list is URLs joined by commas; a comma inside a URL (etcd://h1:2379,h2:2379/x) is
# not followed by a scheme, so a list splits only where the next URL begins.
_NEXT_URL = re.compile(r",\s*(?=[A-Za-z][A-Za-z0-9+.-]*://)")


def split_nodes(text: str) -> list[str]:
    """The node URLs of "redis://a,redis://b,redis://c" (the form of --quorum and
    IDMINT_QUORUM)."""
    nodes = [part.strip() for part in _NEXT_URL.split(text.strip())]
    if not all(nodes) or "://" not in nodes[0]:
        raise InvalidArgument(
            f"bad node list {text!r}: give store URLs joined by commas, "
            "e.g. redis://a:6379,redis://b:6379,redis://c:6379"
        )
    return check_nodes(nodes)


def check_nodes(urls: Sequence[str]) -> list[str]:
    """`urls` as a list if they can be a quorum key's nodes: an odd number, 3 or more, each
    once."""
    if len(urls) < 3 or len(urls) % 2 == 0:
        raise InvalidArgument(
            f"a quorum key needs an odd number of nodes, 3 or more, not {len(urls)}: with an "
            "even number, one node more can fail for the same cost"
        )
    if len(set(urls)) < len(urls):
        raise InvalidArgument(f"a node is named twice: {', '.join(urls)}")
    return list(urls)


@dataclass(frozen=True)
class QuorumOptions:
    """How a quorum key's rounds run. The defaults suit nodes in one region."""

    #: Seconds a request may take, retries included, before QuorumUnavailable.
    deadline: float = 5.0
    #: The random wait after a lost round is drawn from [0, w], w doubling from first_wait
    #: up to longest_wait (seconds).
    first_wait: float = 0.001
    longest_wait: float = 0.1
    #: Seconds a round waits for a majority of answers. Past it the round counts as lost
    #: (late answers still raise the nodes' counters) and the next one goes without the nodes
    #: that have not answered: a node cut off or frozen holds up a round this long, not until
    #: its connection times out.
    round_wait: float = 0.25
    #: The lowest and highest ids the key hands out (start: above legacy ids).
    start: int = 1
    max: int = ID_MAX
    #: Run on nodes that may lose an acknowledged write (no fsync before the answer): ids can
    #: then repeat after a node's crash. For tests and trials only.
    unsafe: bool = False
    #: Ids one group-commit round claims at most; more waiting requests go in the next one.
    max_batch: int = 1_000_000
    #: Seconds between re-checks of each node while it is used (its durability settings, its
    #: identity, the key's counter on it), besides the re-check after every failed call: a node
    #: made unsafe (CONFIG SET) or restarted empty is left out of rounds within this time.
    recheck: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.deadline <= 3600:
            raise InvalidArgument(f"deadline must be in (0, 3600] seconds, not {self.deadline}")
        if not 0 < self.round_wait <= 60:
            raise InvalidArgument(f"round_wait must be in (0, 60] seconds, not {self.round_wait}")
        if not 0 < self.recheck <= 3600:
            raise InvalidArgument(f"recheck must be in (0, 3600] seconds, not {self.recheck}")
        if not 0 < self.first_wait <= self.longest_wait <= 60:
            raise InvalidArgument("waits must satisfy 0 < first_wait <= longest_wait <= 60")
        check_count(self.start, what="start")
        check_count(self.max, what="max")
        if self.max < self.start:
            raise InvalidArgument(f"max {self.max} is below start {self.start}")
        check_count(self.max_batch, what="max_batch")


@dataclass
class NodeHealth:
    """What the last calls to one node showed (a snapshot in QuorumStats)."""

    url: str
    up: bool | None = None  # None: not asked yet
    counter: int = 0  # the highest counter it answered with (for the key of the snapshot)
    last_error: str | None = None
    last_ok_at: float | None = None  # time.time() of its last answer
    in_flight: bool = False  # a call still runs (a slow or hung node: left out of rounds)
    refused: str | None = None  # why it is never used (unsafe, or a duplicate of another)

    def answered(self, counter: int = 0) -> None:
        self.up, self.last_ok_at, self.last_error = True, time.time(), None
        self.counter = max(self.counter, counter)

    def failed(self, error: BaseException) -> None:
        self.up = False
        self.last_error = " ".join(str(error).split())[:300]


@dataclass(frozen=True)
class QuorumStats:
    key: str
    nodes: list[NodeHealth]
    majority: int
    ids: int  # handed out
    rounds: int  # rounds won
    retries: int  # rounds lost and tried again
    burnt: int  # ids claimed on some node by a lost round: never handed out
    requests: int  # callers served (group commit: many per round)
    largest_batch: int
    failures: int  # requests that ended in an error
    last_error: str | None
    closed: bool


_Answer = tuple["_Slot", "tuple[bool, int] | Exception"]


class _Slot:
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
            tuple[Callable[[], tuple[bool, int]], queue.SimpleQueue[_Answer]] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending = 0
        self.health.in_flight = False
        #: Multiplexed nodes: the key and start of the claim whose answer has not been read
        #: yet (any key's round may read it: they share the connection), and when it was sent.
        self.outstanding: tuple[QuorumCounter, int] | None = None
        self.sent_at = 0.0

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def submit(
        self, call: Callable[[], tuple[bool, int]], answers: queue.SimpleQueue[_Answer]
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
        self.slots = [_Slot(n, i) for i, n in enumerate(nodes)]
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
        self._ready: deque[QuorumGenerator] = deque()
        self._threads = self._idle = 0

    def _after_fork(self) -> None:
        self._fresh_threads()
        for slot in self.slots:
            slot.forget_threads()

    def fork_check(self) -> None:
        """Drop the parent's threads and calls if this is a forked child."""
        self._check_fork()

    # -- node checks -------------------------------------------------------------------------

    def check_node(self, slot: _Slot) -> None:
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

    def _refuse(self, slot: _Slot, why: str, message: str) -> InvalidArgument:
        """Leave the slot's node out of every round from now on, loudly."""
        slot.health.refused = why
        self.lost_nodes += 1
        log.error("%s", message)
        return InvalidArgument(message)

    def misconfigured(self) -> InvalidArgument | None:
        """Why a node of the set is refused for every key (unsafe, a duplicate), if one is."""
        return next((s.misconfigured for s in self.slots if s.misconfigured), None)

    # -- round threads -----------------------------------------------------------------------

    def schedule(self, generator: QuorumGenerator) -> None:
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


@dataclass
class _KeyNode:
    """What one key saw on one node of its set."""

    counter: int = 0  # the highest counter the node answered for the key
    refused: str | None = None  # why the node no longer votes on this key (its counter went back)
    checked_epoch: int = -1  # the node's epoch when the key last read its counter there
    checked_at: float = 0.0

    def check_due(self, slot: _Slot, every: float) -> bool:
        return self.checked_epoch != slot.epoch or time.monotonic() - self.checked_at >= every


@dataclass
class _Outcome:
    applied: int = 0  # nodes that took the claim
    refused: int = 0  # nodes that answered no
    errors: list[str] = field(default_factory=list)


class QuorumCounter(ForkAware):
    """Rounds of one quorum key on its nodes (see the module doc). `take` runs one request at
    a time: callers in one process share a QuorumGenerator, which batches them. `nodes` is a
    QuorumNodeSet shared with other keys, or the node objects of a set of its own."""

    def __init__(
        self,
        key: str,
        nodes: Sequence[QuorumNode] | QuorumNodeSet,
        options: QuorumOptions | None = None,
    ) -> None:
        check_key_name(key)
        self.key = key
        self.options = options or QuorumOptions()
        if isinstance(nodes, QuorumNodeSet):
            if nodes.unsafe != self.options.unsafe:
                raise InvalidArgument("a key's unsafe option must be its node set's")
            self.nodes, self._owns_nodes = nodes, False
        else:
            opts = self.options
            self.nodes = QuorumNodeSet(nodes, unsafe=opts.unsafe, recheck=opts.recheck)
            self._owns_nodes = True
        self.majority = self.nodes.majority
        self._slots = self.nodes.slots
        self._mine = [_KeyNode() for _ in self._slots]
        self._lock = threading.Lock()  # one request at a time
        self._guess = self.options.start  # the next start worth trying
        self._spread = 1.0  # how widely a round's start is spread above it (see take)
        self.rounds = self.retries = self.burnt = 0
        self._lost = 0  # nodes this key refused: their counter of it went back
        #: Called between choosing a round's start and sending its claims (tests pause here).
        self.before_claim: Callable[[int, int], None] | None = None
        self._watch_fork()

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self.nodes.fork_check()

    @property
    def lost_nodes(self) -> int:
        """Nodes refused while in use for this key: unsafe, data lost (see _check_key)."""
        return self._lost + self.nodes.lost_nodes

    def _refused(self, slot: _Slot) -> str | None:
        """Why the slot's node takes no part in this key's rounds, if it does not."""
        return slot.health.refused or self._mine[slot.index].refused

    # -- node checks -------------------------------------------------------------------------

    def check(self, timeout: float | None = None) -> None:
        """Look at every node that answers within `timeout` (default: the deadline): raise
        InvalidArgument for one that may lose an acknowledged claim (unless options.unsafe)
        or that is another node again under a second URL. Nodes that do not answer are
        checked before their first claim."""
        self._check_fork()
        if (bad := self.nodes.misconfigured()) is not None:
            raise bad
        answers: queue.SimpleQueue[_Answer] = queue.SimpleQueue()
        sent = sum(
            slot.submit(
                functools.partial(self._connect, slot)
                if self.nodes.multiplexed
                else functools.partial(self._checked_call, slot, None),
                answers,
            )
            for slot in self._slots
            if not slot.checked
        )
        until = time.monotonic() + (timeout or self.options.deadline)
        for _ in range(sent):
            try:
                _, answer = answers.get(timeout=max(0, until - time.monotonic()))
            except queue.Empty:
                return
            if isinstance(answer, InvalidArgument):
                raise answer

    def _check_key(self, slot: _Slot) -> None:
        """Refuse `slot`'s node for this key (raises InvalidArgument) if the key's counter on
        it is below one it answered before (a restore from an older copy): it lost claims it
        acknowledged. Run before the key's first claim there, after each failed call to the
        node (so on every reconnect) and every options.recheck seconds."""
        mine = self._mine[slot.index]
        epoch = slot.epoch
        # What the node answered before the read: a round on another thread may raise it
        # while the read is under way, and a counter only moves up.
        answered = mine.counter
        counter = slot.node.read(self.key)
        if counter < answered:
            raise self._refuse_key(
                slot,
                f"its counter went back from {answered} to {counter}",
                f"quorum node {slot.node.display_url}: the counter of key {self.key!r} went "
                f"back from {answered} to {counter}: it lost acknowledged claims (restored "
                "from an older copy?), so it no longer votes on this key in this process. "
                "Before using it again, raise its counter above every id handed out",
            )
        mine.checked_epoch, mine.checked_at = epoch, time.monotonic()

    def _refuse_key(self, slot: _Slot, why: str, message: str) -> InvalidArgument:
        self._mine[slot.index].refused = why
        self._lost += 1
        log.error("%s", message)
        return InvalidArgument(message)

    def _checked_call(self, slot: _Slot, claim: tuple[int, int] | None) -> tuple[bool, int]:
        """On the node's thread: check the node and the key's counter there if due, then
        claim (or only check)."""
        try:
            if slot.check_due(self.nodes.recheck):
                self.nodes.check_node(slot)
            if self._mine[slot.index].check_due(slot, self.options.recheck):
                self._check_key(slot)
            if claim is None:
                return False, 0
            applied, counter = slot.node.claim(self.key, *claim)
        except Exception as exc:
            slot.failed(exc)
            raise
        self._answered(slot, applied, counter)
        return applied, counter

    def _answered(self, slot: _Slot, applied: bool, counter: int) -> None:
        """Note a claim's answer. A refusal carries the node's counter, which only moves up:
        below one the node answered before, the node lost claims it acknowledged."""
        mine = self._mine[slot.index]
        if not applied and counter < mine.counter:
            mine.checked_epoch = -1
            self._refuse_key(
                slot,
                f"its counter went back from {mine.counter} to {counter}",
                f"quorum node {slot.node.display_url}: the counter of key {self.key!r} "
                f"went back from {mine.counter} to {counter}: it lost acknowledged "
                "claims, so it no longer votes on this key in this process",
            )
            return
        mine.counter = max(mine.counter, counter)
        slot.health.answered()

    # -- rounds ------------------------------------------------------------------------------

    def _round(self, start: int, end: int, until: float) -> _Outcome:
        """Claim [start, end] on every usable node; won once a majority applied it. Waits
        for answers until the monotonic time `until`."""
        outcome = _Outcome()
        answers: queue.SimpleQueue[_Answer] = queue.SimpleQueue()
        waiting: set[_Slot] = set()
        for slot in self._slots:
            url = slot.node.display_url
            if (refused := self._refused(slot)) is not None:
                outcome.errors.append(f"{url}: refused ({refused})")
            elif slot.submit(functools.partial(self._checked_call, slot, (start, end)), answers):
                waiting.add(slot)
            else:
                outcome.errors.append(f"{url}: earlier calls still unanswered")
        while outcome.applied < self.majority <= outcome.applied + len(waiting):
            try:
                slot, answer = answers.get(timeout=max(0, until - time.monotonic()))
            except queue.Empty:
                outcome.errors += [f"{s.node.display_url}: no answer" for s in waiting]
                break
            waiting.discard(slot)
            if isinstance(answer, Exception):
                outcome.errors.append(f"{slot.node.display_url}: {answer}")
            elif (refused := self._refused(slot)) is not None:
                outcome.errors.append(f"{slot.node.display_url}: refused ({refused})")
            elif answer[0]:
                outcome.applied += 1
            else:
                outcome.refused += 1
        return outcome

    # -- multiplexed rounds ------------------------------------------------------------------

    def _mux_round(self, start: int, end: int, until: float) -> _Outcome:
        """`_round` on MultiplexedQuorumNodes: send the claim to each node, then read the
        answers as they come. A node is sent a claim only once its previous answer (maybe
        another key's) is read; connecting and checking a node run on its own thread, never
        holding up a round."""
        outcome = _Outcome()
        live: dict[int, _Slot] = {}
        for slot in self._slots:
            node = cast(MultiplexedQuorumNode, slot.node)
            url = node.display_url
            if (refused := self._refused(slot)) is not None:
                outcome.errors.append(f"{url}: refused ({refused})")
                continue
            if not (slot.checked and node.mux_connected()):
                self._prepare(slot)
                outcome.errors.append(f"{url}: {slot.health.last_error or 'connecting'}")
                continue
            if slot.check_due(self.nodes.recheck) or self._mine[slot.index].check_due(
                slot, self.options.recheck
            ):
                self._prepare(slot, recheck=True)  # on its thread; the node votes meanwhile
            if slot.outstanding is not None and not self._drain(slot):
                outcome.errors.append(f"{url}: an earlier claim is still unanswered")
                continue
            try:
                node.send_claim(self.key, start, end)
            except Exception as exc:
                _mux_failed(slot, exc)
                outcome.errors.append(f"{url}: {exc}")
                continue
            slot.outstanding, slot.sent_at = (self, start), time.monotonic()
            slot.health.in_flight = True
            live[node.fileno()] = slot
        while outcome.applied < self.majority <= outcome.applied + len(live):
            left = until - time.monotonic()
            if left <= 0:
                outcome.errors += [f"{s.node.display_url}: no answer" for s in live.values()]
                break
            ready = readable(live, left)
            for fd in ready:
                slot = live.pop(fd)
                answer = _mux_receive(slot)
                if isinstance(answer, Exception):
                    outcome.errors.append(f"{slot.node.display_url}: {answer}")
                elif answer:
                    outcome.applied += 1
                else:
                    outcome.refused += 1
        return outcome

    def _drain(self, slot: _Slot) -> bool:
        """Read the late answer to the slot's outstanding claim if it has come (True: the node
        can take another). One overdue past OVERDUE seconds drops the connection."""
        node = cast(MultiplexedQuorumNode, slot.node)
        if readable([node.fileno()], 0):
            return not isinstance(_mux_receive(slot), Exception)
        if time.monotonic() - slot.sent_at > OVERDUE:
            _mux_failed(slot, StoreUnavailable(f"no answer within {OVERDUE:g} s"))
        return False

    def _prepare(self, slot: _Slot, *, recheck: bool = False) -> None:
        """Check and connect the node on its own thread (once at a time); with `recheck`,
        only check it again (its claim connection stays in use meanwhile)."""
        if not slot.busy:
            call = self._checked_call if recheck else self._connect
            slot.submit(functools.partial(call, slot, None), queue.SimpleQueue())

    def _connect(self, slot: _Slot, _: None = None) -> tuple[bool, int]:
        """On the node's thread: check it (if due) and open its claim connection (unless
        open: another key's round may be using it)."""
        self._checked_call(slot, None)
        node = cast(MultiplexedQuorumNode, slot.node)
        try:
            if not node.mux_connected():
                node.mux_connect()
        except Exception as exc:
            slot.failed(exc)
            raise
        return False, 0

    def take(self, count: int = 1, *, until: float | None = None) -> Range:
        """`count` consecutive ids, each above every id of this key handed out (by any caller,
        through any node set sharing a majority) before this call began. QuorumUnavailable
        after options.deadline seconds, or at the monotonic time `until` if that is sooner."""
        check_count(count)
        self._check_fork()
        options = self.options
        began = time.monotonic()
        give_up = (
            began + options.deadline if until is None else min(until, began + options.deadline)
        )
        wait_cap = options.first_wait
        with self._lock:
            while True:
                counters = sorted(m.counter for m in self._mine)
                seen = counters[-1]
                start = max(self._guess, seen + 1, options.start)
                if start + count - 1 > options.max:
                    # The guess is past the bound, but it may only reflect claims a minority
                    # took (lost rounds, skips ahead): a round wins wherever a majority is
                    # below its start, so the key is spent only when the majority-th lowest
                    # counter is. Any start is safe (see the module doc): go lower.
                    start = max(counters[self.majority - 1] + 1, options.start)
                    if start + count - 1 > options.max:
                        raise Exhausted(self.key, options.max)
                if self._spread > 1:  # callers have been contending: see below
                    room = (options.max - (start + count - 1)) // count  # skips within the bound
                    start += count * _jitter.randrange(max(1, min(int(self._spread), room + 1)))
                end = start + count - 1
                if self.before_claim is not None:
                    self.before_claim(start, end)
                outcome = self._take_turn(start, end, give_up)
                if outcome.applied >= self.majority:
                    self._guess = end + 1
                    self._spread = max(1.0, self._spread * 0.95)
                    self.rounds += 1
                    return Range(start, end + 1)
                self.retries += 1
                if outcome.applied:
                    self.burnt += count
                if outcome.applied or outcome.refused:
                    # Other callers got there first. Retrying at once, one above the highest
                    # counter seen, they would all claim the same start again and split the
                    # nodes again. So each round skips a random number of ids ahead, from a
                    # spread that doubles with each loss and shrinks slowly with each win:
                    # claims at different starts mostly all apply (a node takes every claim
                    # above its counter), where claims at one start split the nodes. The
                    # skipped ids are never handed out: numbers are spent, not time.
                    if seen:  # a fresh counter's first refusal only tells it where the key is
                        self._spread = min(self._spread * 2, MAX_SPREAD)
                    self._guess = max(end + 1, max(m.counter for m in self._mine) + 1)
                # Then a random wait, doubling with each loss: fewer callers race at once. But
                # a round every node refused only had a stale start, which their answers just
                # corrected; a caller that waited after each of those would be stale again each
                # time, and could starve behind busy ones until its deadline. So once a request
                # has waited longer than a round may, such a round goes again at once.
                stale = outcome.refused and not outcome.applied
                if not (stale and time.monotonic() - began > options.round_wait):
                    pause = _jitter.uniform(0, wait_cap)
                    wait_cap = min(wait_cap * 2, options.longest_wait)
                    time.sleep(max(0, min(give_up - time.monotonic(), pause)))
                if time.monotonic() >= give_up:
                    raise QuorumUnavailable(
                        f"quorum key {self.key!r}: no majority ({self.majority} of "
                        f"{len(self._slots)} nodes) within {options.deadline:g} s; last round: "
                        f"{outcome.applied} applied, {outcome.refused} refused"
                        + (f", {'; '.join(outcome.errors[:5])}" if outcome.errors else "")
                    )

    def _take_turn(self, start: int, end: int, give_up: float) -> _Outcome:
        """One round of [start, end], in turn with the other keys of the node set (each round
        lasts at most round_wait), ending by the monotonic time `give_up`."""
        if self.closed:
            raise Closed(f"quorum key {self.key!r} is closed")
        if not self.nodes.round_lock.acquire(timeout=max(0, give_up - time.monotonic())):
            return _Outcome(errors=["other keys' rounds held the nodes until the deadline"])
        try:
            wait_until = min(give_up, time.monotonic() + self.options.round_wait)
            round_ = self._mux_round if self.nodes.multiplexed else self._round
            return round_(start, end, max(wait_until, time.monotonic() + 0.001))
        finally:
            self.nodes.round_lock.release()

    @property
    def closed(self) -> bool:
        return self.nodes.closed

    def answering(self, timeout: float) -> int:
        """How many usable nodes answer a read of the key within `timeout` seconds, each on
        its own thread (a hung node holds up nothing): for readiness, which must ask the nodes
        itself, since a server out of rotation gets no requests that would."""
        self._check_fork()
        answers: queue.SimpleQueue[_Answer] = queue.SimpleQueue()
        sent = sum(
            slot.submit(functools.partial(self._read_health, slot), answers)
            for slot in self._slots
            if self._refused(slot) is None
        )
        until, answered = time.monotonic() + timeout, 0
        for _ in range(sent):
            try:
                _, answer = answers.get(timeout=max(0, until - time.monotonic()))
            except queue.Empty:
                break
            answered += not isinstance(answer, Exception)
        return answered

    def _read_health(self, slot: _Slot) -> tuple[bool, int]:
        try:
            counter = slot.node.read(self.key)
        except Exception as exc:
            slot.health.failed(exc)
            raise
        slot.health.up, slot.health.last_error = True, None
        return False, counter

    def health(self) -> list[NodeHealth]:
        """Each node as this key sees it: the node's state, the key's counter on it, and why
        it does not vote (on any key, or on this one)."""
        return [
            replace(s.health, counter=m.counter, refused=self._refused(s))
            for s, m in zip(self._slots, self._mine, strict=True)
        ]

    def close(self) -> None:
        """Close the nodes if the set is this key's own; a shared set is its owner's."""
        if self._owns_nodes:
            self.nodes.close()


def _mux_receive(slot: _Slot) -> bool | Exception:
    """The answer to the slot's outstanding claim, noted for the key that sent it (any key of
    the set may read it): whether it applied, or the error."""
    node = cast(MultiplexedQuorumNode, slot.node)
    try:
        applied, counter, echoed = node.receive_claim()
    except Exception as exc:
        _mux_failed(slot, exc)
        return exc
    assert slot.outstanding is not None
    (key, expected), slot.outstanding = slot.outstanding, None
    slot.health.in_flight = False
    if echoed != expected:  # one claim outstanding per node: an answer is never another's
        error = StoreUnavailable(f"answered the claim from {echoed}, not from {expected}")
        _mux_failed(slot, error)
        return error
    key._answered(slot, applied, counter)
    if (refused := key._refused(slot)) is not None:
        return InvalidArgument(f"refused ({refused})")
    return applied


def _mux_failed(slot: _Slot, error: Exception) -> None:
    cast(MultiplexedQuorumNode, slot.node).mux_reset()
    slot.failed(error)  # the next connection checks the node again
    slot.outstanding = None
    slot.health.in_flight = False


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
        request = self._enqueue(count, until=until)
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
        try:
            await asyncio.wait_for(asyncio.shield(answered), self._wait_bound)
        except TimeoutError:
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
    ) -> _Request:
        check_count(count, maximum=self.counter.options.max_batch)
        self._check_fork()
        own = time.monotonic() + self.counter.options.deadline
        request = _Request(count, on_done=on_done, until=own if until is None else min(own, until))
        with self._cond:
            if self._closed:
                raise Closed(f"quorum key {self.key!r} is closed")
            self._queue.append(request)
            schedule, self._scheduled = not self._scheduled, True
        if schedule:
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
        except Exception as exc:
            if not isinstance(exc, IdmintError):  # a bug, or a driver error not mapped
                log.exception("quorum key %r: round failed", self.key)
                exc = QuorumUnavailable(f"quorum key {self.key!r}: {exc}")
            self.failures += len(batch)
            self.last_error = str(exc)
            for request in batch:
                request.answer(error=exc)
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
