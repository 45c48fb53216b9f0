"""The checker of a torture run: reads every client's record (tests/torture/client.py) and
says what broke.

Safety (any of these fails the run):
- an id handed out twice, within a key (snowflake ids: across the namespace);
- an id outside its key's bounds;
- a process whose calls went down where the docs promise they go up (one generator, one
  thread: plain, bounded and quorum keys, and snowflake);
- quorum keys: an id not above every id of the key returned before its call began (strictly
  increasing in real time, across every caller);
- snowflake: a worker id's ids not in time order across its holders (a call that ended
  before another began, on the same worker id, has lower ids). Holders whose wall clock the
  nemesis moved ahead are left out: judged by their own clock, the leases of others look
  expired to them (SQLite has no clock but the caller's), and they take a worker id from a
  live holder, above its horizon; both hand out unique ids, in another order than real time.

Availability is measured, not judged here: for each fault, the longest time a client not hit
by the fault itself went without an id (outages()).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from idmint.layout import TWITTER

#: Examples of each problem kept for the report.
EXAMPLES = 3


@dataclass(frozen=True)
class Call:
    process: str  # the client's name and incarnation ("lib-seg-0#2")
    key: str
    t0: float
    t1: float
    runs: tuple[tuple[int, int, int], ...] = ()  # (start, stop, stride)
    error: str | None = None

    @property
    def client(self) -> str:
        """The client's name, without the incarnation."""
        return self.process.split("#")[0]

    @property
    def low(self) -> int:
        return min(start for start, _, _ in self.runs)

    @property
    def high(self) -> int:
        return max(start + (stop - 1 - start) // step * step for start, stop, step in self.runs)

    def ids(self) -> Iterable[int]:
        for start, stop, stride in self.runs:
            yield from range(start, stop, stride)

    @property
    def count(self) -> int:
        return sum(len(range(*run)) for run in self.runs)


def parse(process: str, key: str, text: str) -> list[Call]:
    """A client's record as calls; a line cut short by a kill -9 is dropped (the ids on it
    were never seen by anyone)."""
    calls: list[Call] = []
    pending: list[tuple[int, int, int]] = []
    span: tuple[float, float] | None = None

    def flush() -> None:
        nonlocal pending, span
        if span is not None and pending:
            calls.append(Call(process, key, span[0], span[1], tuple(pending)))
        pending, span = [], None

    for line in text.split("\n")[:-1]:  # the last piece has no newline yet: maybe cut
        fields = line.split()
        try:
            if fields[0] == "R" and len(fields) == 6:
                at = (float(fields[1]), float(fields[2]))
                if at != span:
                    flush()
                    span = at
                pending.append((int(fields[3]), int(fields[4]), int(fields[5])))
            elif fields[0] == "E" and len(fields) == 4:
                flush()
                at = (float(fields[1]), float(fields[2]))
                calls.append(Call(process, key, *at, error=fields[3]))
        except (ValueError, IndexError):
            continue
    flush()
    return calls


@dataclass
class Verdict:
    ids: int = 0
    repeated: int = 0
    ids_by_key: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check(
    calls: list[Call],
    bounds: dict[str, tuple[int, int]],
    kinds: dict[str, str],
    increasing: set[str],
    clock_ahead: Collection[str] = (),
) -> Verdict:
    """Every safety property above. `bounds`: key -> (first, last); `kinds`: key -> kind;
    `increasing`: the processes (names without incarnation) whose calls must go up;
    `clock_ahead`: those whose wall clock was stepped ahead."""
    verdict = Verdict()
    for key, taken in sorted(_by_key(calls).items()):
        verdict.ids_by_key[key] = sum(c.count for c in taken)
        verdict.ids += verdict.ids_by_key[key]
        repeated, examples = _repeats(taken)
        if repeated:
            verdict.repeated += repeated
            verdict.problems.append(f"key {key}: {repeated} ids handed out twice, e.g. {examples}")
        first, last = bounds[key]
        out = [c for c in taken if c.low < first or c.high > last]
        if out:
            verdict.problems.append(
                f"key {key}: {len(out)} calls outside [{first}, {last}], e.g. "
                + ", ".join(f"{c.process} {c.low}..{c.high}" for c in out[:EXAMPLES])
            )
        down = _went_down([c for c in taken if c.client in increasing])
        if down:
            verdict.problems.append(f"key {key}: ids went down within a process, e.g. {down}")
        if kinds[key] == "quorum":
            late = _real_time_violations(taken)
            if late:
                verdict.problems.append(
                    f"quorum key {key}: {len(late)} calls not above an id returned before they "
                    f"began, e.g. {late[:EXAMPLES]}"
                )
        if kinds[key] == "snowflake":
            late = _snowflake_order([c for c in taken if c.client not in clock_ahead])
            if late:
                verdict.problems.append(
                    f"snowflake {key}: a worker id's ids out of time order, e.g. {late[:EXAMPLES]}"
                )
    return verdict


def repeated_ids(calls: list[Call]) -> int:
    """Ids handed out twice within a key, over every key."""
    return sum(_repeats(taken)[0] for taken in _by_key(calls).values())


def _by_key(calls: list[Call]) -> dict[str, list[Call]]:
    """The calls that handed out ids, by key."""
    by_key: dict[str, list[Call]] = defaultdict(list)
    for call in calls:
        if call.error is None:
            by_key[call.key].append(call)
    return by_key


def _repeats(calls: list[Call]) -> tuple[int, list[str]]:
    """Ids in more than one call's runs (or twice in one): a sweep over sorted intervals, with
    strided runs (a striped key's) broken into single ids."""
    spans: list[tuple[int, int, str]] = []
    for call in calls:
        for start, stop, stride in call.runs:
            if stride == 1:
                spans.append((start, stop, call.process))
            else:
                spans += [(i, i + 1, call.process) for i in range(start, stop, stride)]
    spans.sort()
    repeated, examples = 0, list[str]()
    reach, reach_who = -1, ""
    for start, stop, who in spans:
        if start < reach:
            repeated += min(stop, reach) - start
            if len(examples) < EXAMPLES:
                examples.append(f"{start}..{min(stop, reach) - 1} by {reach_who} and {who}")
        if stop > reach:
            reach, reach_who = stop, who
    return repeated, examples


def _went_down(calls: list[Call]) -> list[str]:
    found = []
    by_process: dict[str, list[Call]] = defaultdict(list)
    for call in calls:
        by_process[call.process].append(call)
    for process, taken in by_process.items():
        taken.sort(key=lambda c: c.t0)
        for a, b in itertools.pairwise(taken):
            if b.low <= a.high:
                found.append(f"{process}: {a.high} then {b.low}")
                break
    return found[:EXAMPLES]


def _real_time_violations(calls: list[Call]) -> list[str]:
    """Calls b with a call a that ended before b began and an id not below all of b's:
    O(n log n), sweeping calls by start while keeping the highest id of those ended."""
    ended = sorted(calls, key=lambda c: c.t1)
    found = []
    best: Call | None = None
    i = 0
    for call in sorted(calls, key=lambda c: c.t0):
        while i < len(ended) and ended[i].t1 < call.t0:
            if best is None or ended[i].high > best.high:
                best = ended[i]
            i += 1
        if best is not None and call.low <= best.high:
            found.append(f"{best.process} had {best.high}, then {call.process} got {call.low}")
    return found


def _snowflake_order(calls: list[Call]) -> list[str]:
    """Per worker id (from the ids: the twitter layout), real-time order as for quorum keys."""
    by_worker: dict[int, list[Call]] = defaultdict(list)
    for call in calls:
        # One call's ids come from one lease: its first and last id name the worker.
        workers = {TWITTER.decode(call.low).worker, TWITTER.decode(call.high).worker}
        for worker in workers:
            by_worker[worker].append(call)
    found = []
    for worker, taken in sorted(by_worker.items()):
        found += [f"worker {worker}: {v}" for v in _real_time_violations(taken)]
    return found


# -- availability --------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str
    start: float
    end: float
    #: clients the fault itself stopped (their own outage is not the store's)
    hits: tuple[str, ...] = ()
    step: float = 0.0  # a clock fault's step (s)


def longest_gap(calls: list[Call], fault: Fault, grace: float, left_out: set[str]) -> float:
    """The longest time, within the fault and `grace` seconds after it, that a client went
    without a call that handed out ids, counted only where it was asking (a gap from its last
    success before the fault to its first after). `left_out`: clients not to count (those
    this fault or another one at the time hit themselves, and slow ones)."""
    worst = 0.0
    by_client: dict[str, list[Call]] = defaultdict(list)
    for call in calls:
        by_client[call.client].append(call)
    for client, taken in by_client.items():
        if client in left_out:
            continue
        ends = sorted(c.t1 for c in taken if c.error is None)
        tried = [c for c in taken if fault.start <= c.t0 <= fault.end + grace]
        if not tried:
            continue
        before = [t for t in ends if t <= fault.start]
        previous = before[-1] if before else fault.start
        for t in ends:
            if t <= fault.start:
                continue
            worst = max(worst, min(t, fault.end + grace) - max(previous, fault.start))
            if t > fault.end + grace:
                break
            previous = t
        else:
            worst = max(worst, min(taken[-1].t1, fault.end + grace) - max(previous, fault.start))
    return worst
