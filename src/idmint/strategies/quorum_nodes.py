"""What a quorum key is given and the nodes it runs on (see quorum.py): node lists as text and
their checks, QuorumOptions, the figures keys report (NodeHealth, QuorumStats); one NodeSlot per
node, with its thread, health and checks, and the QuorumNodeSet that the keys of one node list
share, with the threads that run their rounds. What is true of a node for every key lives here
(unsafe, replicated, named twice, a new identity); what one key saw on a node (its counter
there) lives with the key, in quorum_counter.py.

This module knows the keys only through the two small protocols below, so that the keys'
modules can import it and not the other way round.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .._errors import InvalidArgument
from .._fork import ForkAware
from ..ids import ID_MAX, check_count
from ..stores.base import REPLICA, MultiplexedQuorumNode, QuorumNode, ReplicatedNode

log = logging.getLogger("idmint.quorum")

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
    #: Run on nodes that have replicas their claims do not wait for (a failover to one that
    #: lags loses claims the node acknowledged: ids can then repeat). Apart from `unsafe`:
    #: a node may fsync every write and still fail over. A replica is refused even so.
    replicated_nodes: bool = False
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
    refused: str | None = None  # why it is never used (unsafe, replicated, a duplicate...)

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
        self.checked = False  # settings and identity looked at since the last failure
        self.checked_at = 0.0  # when (monotonic)
        self.identity: str | None = None  # the node's identity when first checked
        self.warned_replicated = False  # replicated_nodes: its replicas logged once
        #: Why every key of the set must refuse it at once (unsafe, replicated, a duplicate):
        #: raised again to each key opened on the set, as it was to the first.
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
    multiplexed node has one claim outstanding at a time. Made by Minter.quorum (one set per
    node list, shared by its keys) or by a QuorumCounter given node objects (its own set,
    closed with it); the checks that hold for every key run here (see the module doc)."""

    #: Threads that run the rounds of the set's keys (each a QuorumGenerator's batch). A key
    #: whose round was lost waits at random before its next one; the other threads go on
    #: serving the other keys meanwhile.
    ROUND_THREADS = 4
    #: Seconds an idle round thread waits for work before it ends.
    IDLE = 10.0

    def __init__(
        self,
        nodes: Sequence[QuorumNode],
        *,
        unsafe: bool = False,
        recheck: float = 10.0,
        replicated_nodes: bool = False,
    ) -> None:
        check_nodes([n.display_url for n in nodes])
        self.unsafe, self.recheck = unsafe, recheck
        self.replicated_nodes = replicated_nodes
        self.majority = len(nodes) // 2 + 1
        self.slots = [NodeSlot(n, i) for i, n in enumerate(nodes)]
        # Nodes that take claims apart from their answers run a round on the caller's thread
        # (poll over their sockets): a third of the CPU of a thread per node.
        self.multiplexed = all(isinstance(n, MultiplexedQuorumNode) for n in nodes)
        self._identities: dict[str, str] = {}  # node identity -> url, to spot one node twice
        self.lost_nodes = 0  # nodes refused while in use: unsafe, replicated, a new identity
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
        """Refuse `slot`'s node for every key (raises InvalidArgument) if it is unsafe,
        replicated (see _check_replication), a duplicate of another, or has a new identity
        since this process first checked it (a restart with an empty data directory: it lost
        the claims it acknowledged). A node that cannot be asked raises StoreUnavailable. On
        the node's thread."""
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
        self._check_replication(slot)
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

    def _check_replication(self, slot: NodeSlot) -> None:
        """Refuse `slot`'s node if a failover can take back claims it acknowledged: a primary
        with replicas its claims do not wait for (one promoted may lack the last claims, and
        a later round takes those ids again), unless replicated_nodes, then warned once; and
        always a replica, which takes no claims of its own (its primary's next sync overwrites
        anything written there). Asked at every check, so a node that gains a replica while
        in use is refused too."""
        node = slot.node
        state = node.replication() if isinstance(node, ReplicatedNode) else None
        if state is None or state.risk is None:
            return
        url = node.display_url
        if state.role == REPLICA:
            slot.misconfigured = self._refuse(
                slot,
                "a replica",
                f"quorum node {url} is a replica ({state.detail}): it takes no claims of its "
                "own (its primary's next sync overwrites them); give independent servers "
                "without replicas as nodes (docs/quorum.md)",
            )
            raise slot.misconfigured
        if not self.replicated_nodes:
            slot.misconfigured = self._refuse(
                slot,
                f"replicated: {state.risk}",
                f"quorum node {url} is replicated: {state.risk} ({state.detail}), and ids "
                "repeat once the node's claims are lost; give independent servers without "
                "replicas as nodes (docs/quorum.md), or accept the risk with --replicated-nodes "
                "(IDMINT_REPLICATED_NODES, QuorumOptions(replicated_nodes=True))",
            )
            raise slot.misconfigured
        if not slot.warned_replicated:
            slot.warned_replicated = True
            log.warning(
                "quorum node %s is replicated (%s): running with replicated nodes, ids may "
                "repeat after its failover",
                url,
                state.risk,
            )

    def _refuse(self, slot: NodeSlot, why: str, message: str) -> InvalidArgument:
        """Leave the slot's node out of every round from now on, loudly."""
        slot.health.refused = why
        self.lost_nodes += 1
        log.error("%s", message)
        return InvalidArgument(message)

    def misconfigured(self) -> InvalidArgument | None:
        """Why a node of the set is refused for every key (unsafe, replicated, a duplicate),
        if one is."""
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
