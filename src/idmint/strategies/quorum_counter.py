"""The rounds of one quorum key on its nodes: QuorumCounter (see quorum.py for why a round
is safe, and for how contention is handled). It chooses each round's start, claims it on
every usable node (a thread per node, or one poll over multiplexed nodes' sockets), and
checks the key's counter on each node, refusing a node that lost claims it acknowledged.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from .._errors import Closed, Exhausted, InvalidArgument, QuorumUnavailable, StoreUnavailable
from .._fork import ForkAware, private_random
from .._poll import readable
from ..ids import Range, check_count, check_key_name
from ..stores.base import MultiplexedQuorumNode, QuorumNode
from .quorum_nodes import Answer, NodeHealth, NodeSlot, QuorumNodeSet, QuorumOptions

log = logging.getLogger("idmint.quorum")

_jitter = private_random()

#: How many times its size a lost round's retry may skip ahead, at most (see take).
MAX_SPREAD = 64

#: Seconds a multiplexed node's answer may be late before its connection is dropped (the
#: claim may still apply: its ids are burnt, never handed out).
OVERDUE = 2.0
#: The least time a round waits for its first nodes before asking the rest (_hedge_after).
HEDGE_FLOOR = 0.002
#: The longest wait after a round placed apart, in usual rounds' time (see _apart_pause).
APART_PAUSE = 3


@dataclass
class _KeyNode:
    """What one key saw on one node of its set."""

    counter: int = 0  # the highest counter the node answered for the key
    refused: str | None = None  # why the node no longer votes on this key (its counter went back)
    checked_epoch: int = -1  # the node's epoch when the key last read its counter there
    checked_at: float = 0.0
    read: int | None = None  # the counter the key's last check read there

    def check_due(self, slot: NodeSlot, every: float) -> bool:
        return self.checked_epoch != slot.epoch or time.monotonic() - self.checked_at >= every


@dataclass
class _Outcome:
    applied: int = 0  # nodes that took the claim (placed: the most that placed it in one spot)
    refused: int = 0  # nodes that answered no
    errors: list[str] = field(default_factory=list)
    end: int = 0  # the end of the range those nodes took


@dataclass
class _Votes:
    """Where the nodes of a placed round put its range (by the range's end), and which of
    them were asked again, exactly, for another place (once each: see _mux_round)."""

    at: dict[NodeSlot, int] = field(default_factory=dict)
    asked_again: set[NodeSlot] = field(default_factory=set)

    def placed(self, slot: NodeSlot, end: int) -> tuple[int, int]:
        """Note that `slot`'s node put the range at `end`; the most nodes at one place, and
        that place (the highest of those with as many)."""
        self.at[slot] = end
        ends = list(self.at.values())
        return max((ends.count(e), e) for e in ends)

    def target(self, majority: int, others: int) -> int | None:
        """The place to gather a majority on: of those that can still have one (its nodes,
        those that put the range lower and were not asked again, and `others` nodes still to
        answer or be asked), the one with the most nodes, then the highest; None if none can
        (or none was chosen yet)."""
        ends = list(self.at.values())
        can = [
            (ends.count(e), e)
            for e in set(ends)
            if ends.count(e) + len(self._lower(e)) + others >= majority
        ]
        return max(can)[1] if can else None

    def lower(self, end: int) -> list[NodeSlot]:
        """The nodes that put the range below `end` and were not asked again: now they are."""
        slots = self._lower(end)
        self.asked_again.update(slots)
        return slots

    def _lower(self, end: int) -> list[NodeSlot]:
        return [s for s, e in self.at.items() if e < end and s not in self.asked_again]


class QuorumCounter(ForkAware):
    """Rounds of one quorum key on its nodes (see quorum.py). `take` runs one request at
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
            if nodes.replicated_nodes != self.options.replicated_nodes:
                raise InvalidArgument("a key's replicated_nodes option must be its node set's")
            self.nodes, self._owns_nodes = nodes, False
        else:
            opts = self.options
            self.nodes = QuorumNodeSet(
                nodes,
                unsafe=opts.unsafe,
                recheck=opts.recheck,
                replicated_nodes=opts.replicated_nodes,
            )
            self._owns_nodes = True
        self.majority = self.nodes.majority
        self._slots = self.nodes.slots
        self._mine = [_KeyNode() for _ in self._slots]
        self._lock = threading.Lock()  # one request at a time
        self._guess = self.options.start  # the next start worth trying
        self._spread = 1.0  # how widely a round's start is spread above it (see take)
        self._round_time = 0.0  # seconds a won round takes, averaged (see _hedge_after)
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

    def _refused(self, slot: NodeSlot) -> str | None:
        """Why the slot's node takes no part in this key's rounds, if it does not."""
        return slot.health.refused or self._mine[slot.index].refused

    # -- node checks -------------------------------------------------------------------------

    def check(self, timeout: float | None = None) -> None:
        """Look at every node that answers within `timeout` (default: the deadline): raise
        InvalidArgument for one that may lose an acknowledged claim (unless options.unsafe),
        one that is replicated (unless options.replicated_nodes) or a replica, or one that is
        another node again under a second URL. On a set new to this process it reads the key's
        counter on each, and the key's first round starts where a majority of them is below
        it. Nodes that do not answer are checked before their first claim."""
        self._check_fork()
        if (bad := self.nodes.misconfigured()) is not None:
            raise bad
        answers: queue.SimpleQueue[Answer] = queue.SimpleQueue()
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
        try:
            for _ in range(sent):
                try:
                    _, answer = answers.get(timeout=max(0, until - time.monotonic()))
                except queue.Empty:
                    return
                if isinstance(answer, InvalidArgument):
                    raise answer
        finally:
            self._start_above_reads()

    def _start_above_reads(self) -> None:
        """Start the key's first round where a majority of the counters its check read is
        below it (the lowest start that can win; any start is safe, see quorum.py): at
        options.start every node that took claims refuses it, and on main the next round then
        began above that refused round's end, spending a batch of a bounded key."""
        reads = sorted(m.read for m in self._mine if m.read is not None)
        if len(reads) >= self.majority:
            with self._lock:
                self._guess = max(self._guess, reads[self.majority - 1] + 1)

    def _check_key(self, slot: NodeSlot) -> None:
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
        mine.read = counter
        mine.checked_epoch, mine.checked_at = epoch, time.monotonic()

    def _refuse_key(self, slot: NodeSlot, why: str, message: str) -> InvalidArgument:
        self._mine[slot.index].refused = why
        self._lost += 1
        log.error("%s", message)
        return InvalidArgument(message)

    def _checked_call(self, slot: NodeSlot, claim: tuple[int, int] | None) -> tuple[bool, int]:
        """On the node's thread: check the node and the key's counter there if due, then
        claim (or only check)."""
        try:
            asked = slot.check_due(self.nodes.recheck)
            if asked:
                self.nodes.check_node(slot)
            if self._mine[slot.index].check_due(slot, self.options.recheck):
                self._check_key(slot)
                asked = True
            if claim is None:
                if asked:  # it answered: up (a node no round needs is seen up again)
                    slot.health.answered()
                return False, 0
            applied, counter = slot.node.claim(self.key, *claim)
        except Exception as exc:
            slot.failed(exc)
            raise
        self._answered(slot, applied, counter)
        return applied, counter

    def _answered(self, slot: NodeSlot, applied: bool, counter: int) -> None:
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
        answers: queue.SimpleQueue[Answer] = queue.SimpleQueue()
        waiting: set[NodeSlot] = set()
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
                outcome.end = end
            else:
                outcome.refused += 1
        return outcome

    # -- multiplexed rounds ------------------------------------------------------------------

    def _mux_round(self, start: int, end: int, until: float) -> _Outcome:
        """`_round` on MultiplexedQuorumNodes, with placed claims (see quorum.py): each node
        puts the range at `start` or just above its counter, and the round wins where a
        majority put it in one place. Callers whose claims reach the nodes in one order all
        win at once; a stale start costs nothing.

        The claim goes to a majority of the nodes (the first usable ones, in the order given)
        and the answers are read as they come. When those cannot make a majority (one failed,
        or they placed it apart), the round gathers one on a place they chose (`_Votes`):
        exact claims there to the nodes that placed it lower, whose counters are below it, and
        to the rest of the nodes, whose counters trail the first nodes'. The rest are sent a
        claim too when a node has not answered within `_hedge_after`. A round needs a
        majority, not every node: claims to the rest cost each a write and an fsync, and the
        client a send and a read, for nothing while all is well (issue 31). A node is sent a
        claim only once its previous answer (maybe another key's) is read; connecting and
        checking a node run on its own thread, never holding up a round."""
        outcome = _Outcome()
        votes = _Votes()
        live: dict[int, NodeSlot] = {}
        reserve = list(self._slots)
        sent_at = time.monotonic()
        count = end - start + 1
        placed = (start, end, self.options.max - count + 1)  # anywhere within the key's bound
        self._mux_send(self.majority, reserve, placed, outcome, live)
        while outcome.applied < self.majority:
            target = votes.target(self.majority, len(live) + len(reserve))
            claim = placed if target is None else (target - count + 1, target, target - count + 1)
            if outcome.applied + len(live) < self.majority:  # those out cannot win it
                if target is not None:
                    again = votes.lower(target)
                    self._mux_send(len(again), again, claim, outcome, live)
                elif votes.at:
                    break  # no place can have a majority now
                self._mux_send(len(reserve), reserve, claim, outcome, live)
            elif reserve and time.monotonic() - sent_at >= self._hedge_after:  # one is slow
                self._mux_send(len(reserve), reserve, claim, outcome, live)
            if not live:
                break
            left = until - time.monotonic()
            if left <= 0:
                outcome.errors += [f"{s.node.display_url}: no answer" for s in live.values()]
                break
            if reserve:
                left = min(left, max(0.0, sent_at + self._hedge_after - time.monotonic()))
            for fd in readable(live, left):
                slot = live.pop(fd)
                answer = _mux_receive(slot)
                if isinstance(answer, Exception):
                    outcome.errors.append(f"{slot.node.display_url}: {answer}")
                elif answer[0]:
                    outcome.applied, outcome.end = votes.placed(slot, answer[1])
                else:
                    outcome.refused += 1
        if outcome.applied >= self.majority:  # how long a round takes here, for the hedge
            self._round_time += (time.monotonic() - sent_at - self._round_time) / 8
        for slot in reserve:  # not asked: kept connected and checked, ready for a hedge
            self._unusable(slot)
        return outcome

    def _unusable(self, slot: NodeSlot) -> str | None:
        """Why the slot's node cannot be sent a claim now (None: it can), having its thread
        connect it, or check it again when due (it votes meanwhile): a node no round needs
        is watched too, its health current every `recheck` seconds."""
        if (refused := self._refused(slot)) is not None:
            return f"refused ({refused})"
        if not (slot.checked and cast(MultiplexedQuorumNode, slot.node).mux_connected()):
            self._prepare(slot)
            return slot.health.last_error or "connecting"
        if slot.check_due(self.nodes.recheck) or self._mine[slot.index].check_due(
            slot, self.options.recheck
        ):
            self._prepare(slot, recheck=True)
        return None

    @property
    def _hedge_after(self) -> float:
        """Seconds a round waits for its first nodes before asking the rest as well: a few
        times a usual round, so a slow node costs little, and not less than HEDGE_FLOOR."""
        return max(HEDGE_FLOOR, 4 * self._round_time)

    def _mux_send(
        self,
        want: int,
        slots: list[NodeSlot],
        claim: tuple[int, int, int],
        outcome: _Outcome,
        live: dict[int, NodeSlot],
    ) -> None:
        """Send the claim (start, end, limit: see MultiplexedQuorumNode.send_claim) to the
        usable nodes among `slots`, in order, until `want` are sent (`live`, by descriptor);
        each is taken off `slots`, and why a node was not usable goes in the outcome's
        errors."""
        sent = 0
        while slots and sent < want:
            slot = slots.pop(0)
            node = cast(MultiplexedQuorumNode, slot.node)
            url = node.display_url
            if (why := self._unusable(slot)) is not None:
                outcome.errors.append(f"{url}: {why}")
                continue
            if slot.outstanding is not None and not self._drain(slot):
                outcome.errors.append(f"{url}: an earlier claim is still unanswered")
                continue
            try:
                node.send_claim(self.key, *claim)
            except Exception as exc:
                _mux_failed(slot, exc)
                outcome.errors.append(f"{url}: {exc}")
                continue
            slot.outstanding, slot.sent_at = (self, claim[0]), time.monotonic()
            slot.health.in_flight = True
            live[node.fileno()] = slot
            sent += 1

    def _drain(self, slot: NodeSlot) -> bool:
        """Read the late answer to the slot's outstanding claim if it has come (True: the node
        can take another). One overdue past OVERDUE seconds drops the connection."""
        node = cast(MultiplexedQuorumNode, slot.node)
        if readable([node.fileno()], 0):
            return not isinstance(_mux_receive(slot), Exception)
        if time.monotonic() - slot.sent_at > OVERDUE:
            _mux_failed(slot, StoreUnavailable(f"no answer within {OVERDUE:g} s"))
        return False

    def _prepare(self, slot: NodeSlot, *, recheck: bool = False) -> None:
        """Check and connect the node on its own thread (once at a time); with `recheck`,
        only check it again (its claim connection stays in use meanwhile)."""
        if not slot.busy:
            call = self._checked_call if recheck else self._connect
            slot.submit(functools.partial(call, slot, None), queue.SimpleQueue())

    def _connect(self, slot: NodeSlot, _: None = None) -> tuple[bool, int]:
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
                start = self._next_start(count)
                end = start + count - 1
                if self.before_claim is not None:
                    self.before_claim(start, end)
                outcome = self._take_turn(start, end, give_up)
                if outcome.applied >= self.majority:
                    self._guess = outcome.end + 1
                    self._spread = max(1.0, self._spread * 0.95)
                    self.rounds += 1
                    return Range(outcome.end - count + 1, outcome.end + 1)
                self._lost_round(outcome, count)
                # Then a random wait, doubling with each loss: fewer callers race at once. But
                # a round every node refused only had a stale start, which their answers just
                # corrected; a caller that waited after each of those would be stale again each
                # time, and could starve behind busy ones until its deadline. So once a request
                # has waited longer than a round may, such a round goes again at once. A round
                # that every node answered and placed, only apart, waits at most a few rounds'
                # time (_apart_pause). A round that nodes failed waits: it may be short of a
                # majority, and going again at once would only spend ids on the rest.
                stale = outcome.refused and not outcome.applied
                if self.nodes.multiplexed and outcome.applied and not outcome.errors:
                    pause = self._apart_pause()
                elif stale and time.monotonic() - began > options.round_wait:
                    pause = 0.0
                else:
                    pause = _jitter.uniform(0, wait_cap)
                    wait_cap = min(wait_cap * 2, options.longest_wait)
                if pause:
                    time.sleep(max(0, min(give_up - time.monotonic(), pause)))
                if time.monotonic() >= give_up:
                    raise self._no_majority(outcome)

    def _apart_pause(self) -> float:
        """Seconds to wait after a round the nodes placed apart: random, up to APART_PAUSE
        times a usual round. Such rounds are lost by callers in step with each other: a node
        answers the claims that came during one fsync together, so their callers wake and
        send again together, and the nodes read their claims in different orders again.
        Eight clients on one key kept in that state for seconds at a time (0.65 to 0.9x of one
        client); spread over a few rounds' time, they fall out of step. The doubling wait of
        other lost rounds held them back instead (issue 31), and going again at once kept them
        in step."""
        return _jitter.uniform(0, APART_PAUSE * self._round_time)

    def _next_start(self, count: int) -> int:
        """The start of the next round of `count` ids. Called with `_lock` held."""
        options = self.options
        counters = sorted(m.counter for m in self._mine)
        start = max(self._guess, counters[-1] + 1, options.start)
        if start + count - 1 > options.max:
            # The guess is past the bound, but it may only reflect claims a minority
            # took (lost rounds, skips ahead): a round wins wherever a majority is
            # below its start, so the key is spent only when the majority-th lowest
            # counter is. Any start is safe (see quorum.py): go lower.
            start = max(counters[self.majority - 1] + 1, options.start)
            if start + count - 1 > options.max:
                raise Exhausted(self.key, options.max)
        if self._spread > 1:  # callers have been contending: see _lost_round
            room = (options.max - (start + count - 1)) // count  # skips within the bound
            start += count * _jitter.randrange(max(1, min(int(self._spread), room + 1)))
        return start

    def _lost_round(self, outcome: _Outcome, count: int) -> None:
        """Count a round of `count` ids that won no majority, and move the next round's start
        on. Called with `_lock` held."""
        self.retries += 1
        if outcome.applied:
            self.burnt += count
        if outcome.applied or outcome.refused:
            # Other callers got there first. If some nodes took this round and others
            # refused it, callers split the nodes: retrying at once, one above the highest
            # counter seen, they would all claim the same start again and split them
            # again. So each round skips a random number of ids ahead, from a spread that
            # doubles with each split and shrinks slowly with each win: claims at different
            # starts mostly all apply (a node takes every claim above its counter). The
            # skipped ids are never handed out: numbers are spent, not time. A round every
            # node refused was only stale (their answers say where the key is now), no
            # split: widening on those too had eight clients hand out one id in ten of the
            # numbers they spent (issue 31).
            # Placed claims (multiplexed nodes) need no spread: each node puts a claim above
            # the others it took; rounds lose there only when the nodes took them in
            # different orders.
            if outcome.applied and not self.nodes.multiplexed:
                self._spread = min(self._spread * 2, MAX_SPREAD)
            # The next round starts above every counter seen; above this round's end only if
            # a node took it. A round every node refused claimed nothing: skipping its ids
            # spent them for nothing, N ids of a bounded key at each fresh start below N.
            highest = max(m.counter for m in self._mine)
            self._guess = max(self._guess, highest + 1, outcome.end + 1 if outcome.applied else 0)

    def _no_majority(self, outcome: _Outcome) -> QuorumUnavailable:
        """The error of a request whose deadline passed; `outcome` is its last round's."""
        return QuorumUnavailable(
            f"quorum key {self.key!r}: no majority ({self.majority} of "
            f"{len(self._slots)} nodes) within {self.options.deadline:g} s; last round: "
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
        answers: queue.SimpleQueue[Answer] = queue.SimpleQueue()
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

    def _read_health(self, slot: NodeSlot) -> tuple[bool, int]:
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


def _mux_receive(slot: NodeSlot) -> tuple[bool, int] | Exception:
    """The answer to the slot's outstanding claim, noted for the key that sent it (any key of
    the set may read it): whether it applied and the counter after it (an applied claim's
    range ends there), or the error."""
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
    return applied, counter


def _mux_failed(slot: NodeSlot, error: Exception) -> None:
    cast(MultiplexedQuorumNode, slot.node).mux_reset()
    slot.failed(error)  # the next connection checks the node again
    slot.outstanding = None
    slot.health.in_flight = False
