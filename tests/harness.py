"""The fault harness: nemeses, a recorder of every operation, and checkers.

Nemeses:
- `Partition` cuts links between loopback addresses with iptables rules (DROP on OUTPUT, which
  loopback packets cross too), each tagged so that `heal_all()` finds what a killed run left;
- `Worker.kill9()`, `pause()`/`resume()` for client processes; the test servers' own `kill()`,
  `pause()`, `start()` for store nodes;
- `Clock` steps a process's wall clock through a libfaketime control file.

The recorder is the workers' output: every operation with its start and end on the machine's
monotonic clock (one clock for every process here, and libfaketime leaves it alone), its id or
its error, and every range a worker drew. The checkers return what they found, so a negative
control can show they do find it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import tempfile
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from idmint import Range

TAG = "idmint-test-partition"
SOAK_SECONDS = float(os.environ.get("IDMINT_SOAK_SECONDS", "15" if os.environ.get("CI") else "60"))
"""How long a soak runs: short in CI, as long as you like behind the variable."""

# -- network ---------------------------------------------------------------------------------


def _iptables(*args: str) -> None:
    subprocess.run(["iptables", "-w", "5", *args], check=True, capture_output=True, timeout=10)


class Partition:
    """A set of cut links; `heal()` removes exactly the rules this partition added.

    On loopback the kernel gives a connection to 127.0.0.N the source address 127.0.0.1,
    whoever makes it, so clients cannot be told apart by address: a service to be cut from some
    clients only listens on an address of theirs as well (`cut_address`). Cassandra 2.1 does not
    bind its outgoing connections to its own address either, so a node runs in a cgroup of its
    own, which iptables can match (`isolate_node`)."""

    def __init__(self) -> None:
        self._added: list[list[str]] = []

    def _drop(self, *match: str, target: Sequence[str] = ("DROP",)) -> None:
        rule = ["OUTPUT", "-p", "tcp", *match, "-m", "comment", "--comment", TAG, "-j", *target]
        _iptables("-I", *rule)
        self._added.append(rule)

    def cut_address(self, address: str, port: int) -> None:
        """Every packet to address:port, and every packet from it."""
        self._drop("-d", address, "--dport", str(port))
        self._drop("-s", address, "--sport", str(port))

    def isolate_node(self, cgroup: str, address: str, port: int) -> None:
        """A server node cut from its peers on `port`: what its processes send to others'
        `port`, told apart by their cgroup, and what others send to address:port. The node
        still reaches itself (Cassandra sends its own Paxos messages through its port)."""
        self._drop("-m", "cgroup", "--path", cgroup, "!", "-d", address, "--dport", str(port))
        self._drop("-m", "cgroup", "!", "--path", cgroup, "-d", address, "--dport", str(port))

    def isolate_member(
        self,
        cgroup: str,
        address: str,
        ports: Sequence[int],
        peer_ports: Sequence[int],
        mark: int,
    ) -> None:
        """A cluster member cut from its peers both ways, its clients left alone. It listens
        for its peers on address:`ports`: every packet to or from those. It reaches its peers'
        `peer_ports` from 127.0.0.1 like anyone: what its processes (their cgroup) send there
        marks the connection (conntrack, with `mark`: a value of this member's alone), and
        every packet of a marked connection is dropped, so the peers' answers too (they cannot
        be told apart from any other packet to 127.0.0.1: only the connection can). A
        connection it made is marked by its first packet after the cut (at worst one segment
        of a peer's gets through); only the member that made a connection marks it."""
        own = ",".join(map(str, ports))
        theirs = ",".join(map(str, peer_ports))
        self._drop("-m", "connmark", "--mark", f"{mark:#x}")
        # inserted after the drop, so matched before it: a packet marks, then is dropped
        self._drop(
            "-m", "cgroup", "--path", cgroup, "-m", "multiport", "--dports", theirs,
            target=("CONNMARK", "--set-mark", f"{mark:#x}"),
        )  # fmt: skip
        self._drop("-d", address, "-m", "multiport", "--dports", own)
        self._drop("-s", address, "-m", "multiport", "--sports", own)

    def cut_from_cgroup(self, cgroup: str, address: str, port: int) -> None:
        """What the processes of `cgroup` send to address:port: one node's link to another
        (cut both ways for a split between two nodes)."""
        self._drop("-m", "cgroup", "--path", cgroup, "-d", address, "--dport", str(port))

    def heal(self) -> None:
        while self._added:
            rule = self._added.pop()
            with contextlib.suppress(subprocess.CalledProcessError):
                _iptables("-D", *rule)

    def __enter__(self) -> Partition:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.heal()


def heal_all() -> None:
    """Remove every rule a test left behind (a run killed mid-partition)."""
    out = subprocess.run(
        ["iptables", "-w", "5", "-S", "OUTPUT"], capture_output=True, text=True, timeout=10
    ).stdout
    for line in out.splitlines():
        if TAG in line and line.startswith("-A "):
            # -S quotes the comment; the rule is the same without the quotes. Gone meanwhile
            # (another run healed it) is healed too.
            with contextlib.suppress(subprocess.CalledProcessError):
                _iptables("-D", *line.replace('"', "").split()[1:])


class Node(Protocol):
    """A store node a nemesis kills (SIGKILL) and starts again, or pauses (SIGSTOP) and
    resumes: the test servers."""

    def kill(self) -> None: ...
    def start(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...


# -- clocks ----------------------------------------------------------------------------------


def libfaketime() -> str:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    assert found, "libfaketime is not installed: .ci/install installs Debian's faketime"
    return found[0]


class Clock:
    """A wall clock the test steps, through a control file holding the offset ("+3600.000s"):
    processes started with `env()` read it on every call through libfaketime (their monotonic
    clock stays real: deadlines, and the recorder); a process may also read the file itself."""

    def __init__(self, control: Path) -> None:
        self.control = control
        self.offset = 0.0
        control.write_text("+0s\n")

    def env(self) -> dict[str, str]:
        return {
            "LD_PRELOAD": libfaketime(),
            "FAKETIME_TIMESTAMP_FILE": str(self.control),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    def step(self, seconds: float) -> None:
        self.offset += seconds
        self.control.write_text(f"{self.offset:+.3f}s\n")


# -- the recorder ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One call: who made it, when it started and ended (monotonic seconds), and its id or the
    name of the error it raised."""

    process: str
    start: float
    end: float
    value: int | None = None
    error: str | None = None


@dataclass
class History:
    ops: list[Op]
    ranges: dict[str, list[Range]]  # per process, in the order drawn

    @property
    def ok(self) -> list[Op]:
        return [op for op in self.ops if op.error is None]

    def errors(self, during: tuple[float, float] | None = None) -> list[Op]:
        return [
            op
            for op in self.ops
            if op.error is not None
            and (during is None or (op.end >= during[0] and op.start <= during[1]))
        ]

    def values(self) -> list[int]:
        return [op.value for op in self.ops if op.value is not None]


def _without(r: Range, cut: Range) -> list[Range]:
    """What is left of r once the ids of `cut` are taken out (a give-back may span two of a
    process's ranges: its current one and the next)."""
    if cut.stop <= r.start or r.stop <= cut.start:
        return [r]
    left = [Range(r.start, cut.start)] if r.start < cut.start else []
    return left + ([Range(cut.stop, r.stop)] if cut.stop < r.stop else [])


def parse(process: str, text: str) -> tuple[list[Op], list[Range]]:
    """A worker's output: `O start end id`, `E start end Error`, `R start stop` (a range drawn),
    `G start stop` (the unused tail of a range, given back); a line cut short by a kill -9 is
    ignored."""
    ops: list[Op] = []
    ranges: list[Range] = []
    for line in text.splitlines():
        fields = line.split()
        try:
            if fields[:1] == ["O"] and len(fields) == 4:
                ops.append(Op(process, float(fields[1]), float(fields[2]), value=int(fields[3])))
            elif fields[:1] == ["E"] and len(fields) == 4:
                ops.append(Op(process, float(fields[1]), float(fields[2]), error=fields[3]))
            elif fields[:1] == ["R"] and len(fields) == 3:
                ranges.append(Range(int(fields[1]), int(fields[2])))
            elif fields[:1] == ["G"] and len(fields) == 3:
                back = Range(int(fields[1]), int(fields[2]))
                ranges = [part for r in ranges for part in _without(r, back)]
        except ValueError:
            continue
    return ops, ranges


class Worker:
    """A recorded client process: argv run with this interpreter, its output in a file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        directory: Path | None = None,
    ) -> None:
        self.name, self.argv, self.env = name, list(argv), env or {}
        fd, path = tempfile.mkstemp(prefix=f"idmint-{name}-", suffix=".out", dir=directory)
        os.close(fd)
        self.out = Path(path)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with self.out.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *self.argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
            )

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def kill9(self) -> None:
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM: the worker finishes its call, prints its counts and exits; SIGKILL after
        `timeout`. A datacenter worker's own bounds add up to about 15 s at worst (a call
        waiting for a range, 3 s; the refill it joins, 3 s; its give-back's compare-and-set
        loop, 5 s plus a store timeout; the driver's shutdown), hence twice that."""
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
                raise AssertionError(
                    f"worker {self.name} did not stop within {timeout:g}s"
                ) from None

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def count(self) -> int:
        return sum(line.startswith("O ") for line in self.text().splitlines())


def history(workers: Iterable[Worker]) -> History:
    ops: list[Op] = []
    ranges: dict[str, list[Range]] = {}
    for w in workers:
        got, drawn = parse(w.name, w.text())
        ops.extend(got)
        ranges[w.name] = drawn
    return History(ops, ranges)


# -- checkers --------------------------------------------------------------------------------


def duplicates(values: Iterable[int]) -> list[int]:
    seen: set[int] = set()
    repeated: set[int] = set()
    for v in values:
        (repeated if v in seen else seen).add(v)
    return sorted(repeated)


def outside(values: Iterable[int], first: int, last: int) -> list[int]:
    return [v for v in values if not first <= v <= last]


def overlaps(ranges: Iterable[tuple[str, Range]]) -> list[tuple[str, Range, str, Range]]:
    """Pairs of ranges that share an id, whoever drew them (the same range drawn twice
    counts)."""
    ordered = sorted(((r.start, r.stop, who) for who, r in ranges if len(r)))
    found = []
    reach_stop, reach_who = -1, ""
    for start, stop, who in ordered:
        if start < reach_stop:
            found.append((reach_who, Range(0, reach_stop), who, Range(start, stop)))
        if stop > reach_stop:
            reach_stop, reach_who = stop, who
    return found


def strays(hist: History) -> list[Op]:
    """Ids a process returned that lie in no range it drew."""
    bounds = {who: sorted((r.start, r.stop) for r in drawn) for who, drawn in hist.ranges.items()}
    found = []
    for op in hist.ops:
        if op.value is None:
            continue
        spans = bounds.get(op.process, [])
        i = bisect_left(spans, (op.value + 1,)) - 1
        if i < 0 or not spans[i][0] <= op.value < spans[i][1]:
            found.append(op)
    return found


def real_time_violations(ops: Iterable[Op]) -> list[tuple[Op, Op]]:
    """Pairs (a, b) where a ended before b began and yet b's id is not above a's: O(n log n),
    by sweeping calls in order of start while keeping the highest id of those already ended."""
    done = sorted((op for op in ops if op.value is not None), key=lambda op: op.end)
    found = []
    best: Op | None = None
    i = 0
    for op in sorted(done, key=lambda op: op.start):
        while i < len(done) and done[i].end < op.start:
            if best is None or (done[i].value or 0) > (best.value or 0):
                best = done[i]
            i += 1
        if best is not None and best.value is not None and (op.value or 0) <= best.value:
            found.append((best, op))
    return found
