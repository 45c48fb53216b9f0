"""Snowflake worker processes (tests/flake_worker.py) for the multi-process tests: start them,
read what they printed, check their turns."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

WORKER = str(Path(__file__).with_name("flake_worker.py"))


def start(
    url: str,
    namespace: str,
    ttl: float,
    hold: float = 2.0,
    *,
    exact: bool = False,
    extra: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    # Output to a file, not a pipe: a pipe nobody reads fills up and stalls the worker.
    fd, name = tempfile.mkstemp(prefix="idmint-flake-", suffix=".out")
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, WORKER, url, namespace, str(ttl), "--hold", str(hold)]
            + (["--exact"] if exact else [])
            + list(extra),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    OUTPUTS[proc.pid] = Path(name)
    return proc


OUTPUTS: dict[int, Path] = {}


def wait_for_ids(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Until the process has issued ids (a new store makes its first holder wait a ttl)."""
    wait_for_line(proc, "I", "the process issued no ids", timeout)


def wait_for_lease(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Until the process holds a lease (it may still wait before its first id)."""
    wait_for_line(proc, "L", "the process took no lease", timeout)


def wait_for_line(proc: subprocess.Popen[bytes], kind: str, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while f"\n{kind} ".encode() not in b"\n" + OUTPUTS[proc.pid].read_bytes():
        assert proc.poll() is None, OUTPUTS[proc.pid].read_text()[-2000:]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def read(
    proc: subprocess.Popen[bytes], ended_at: float
) -> tuple[list[int], list[tuple[int, float, float]], list[str]]:
    """Ids, (worker, from, to) hold intervals and error names of a finished process."""
    proc.wait(timeout=60)
    path = OUTPUTS.pop(proc.pid)
    out = path.read_bytes()
    path.unlink()
    if proc.returncode not in (-signal.SIGKILL, -signal.SIGTERM):
        raise AssertionError(f"worker exited {proc.returncode}: {out.decode()[-3000:]}")
    ids: list[int] = []
    holds: list[tuple[int, float, float]] = []
    errors: list[str] = []
    held: tuple[int, float] | None = None
    for line in out.decode().split("\n")[:-1]:  # the last piece may be cut by kill -9
        kind, _, rest = line.partition(" ")
        if kind == "I":
            ids += [int(x) for x in rest.split()]
        elif kind == "L":
            wid, at = rest.split()
            held = (int(wid), float(at))
        elif kind == "R" and held is not None:
            holds.append((held[0], held[1], float(rest.split()[1])))
            held = None
        elif kind == "E":
            errors.append(rest)
    if held is not None:
        holds.append((held[0], held[1], ended_at))  # held until it was killed
    return ids, holds, errors


def assert_no_two_holders(holds: list[tuple[int, int, float, float]]) -> None:
    by_worker: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
    for proc, wid, begin, end in holds:
        by_worker[wid].append((begin, end, proc))
    for wid, spans in by_worker.items():
        spans.sort()
        for (_, e1, p1), (b2, _, p2) in itertools.pairwise(spans):
            assert p1 == p2 or e1 <= b2, (
                f"worker {wid} held by process {p1} until {e1:.3f} and by {p2} from {b2:.3f}"
            )


def kill_left(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL what a failed test left running (its output files go too)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        path = OUTPUTS.pop(proc.pid, None)
        if path is not None:
            path.unlink(missing_ok=True)
