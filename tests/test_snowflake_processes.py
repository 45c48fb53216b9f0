"""Sixteen processes taking turns on eight worker ids, some killed with -9, on every lease
store; and a holder paused past its lease. No two live processes hold one worker id at once,
and no id repeats."""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

from checks import assert_unique

WORKER = str(Path(__file__).with_name("flake_worker.py"))
SOAK_SECONDS = float(os.environ.get("IDMINT_SOAK_SECONDS", "60"))


def start(
    url: str, namespace: str, ttl: float, hold: float = 2.0, *, exact: bool = False
) -> subprocess.Popen[bytes]:
    # Output to a file, not a pipe: a pipe nobody reads fills up and stalls the worker.
    fd, name = tempfile.mkstemp(prefix="idmint-flake-", suffix=".out")
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, WORKER, url, namespace, str(ttl), "--hold", str(hold)]
            + (["--exact"] if exact else []),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    OUTPUTS[proc.pid] = Path(name)
    return proc


OUTPUTS: dict[int, Path] = {}


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


@pytest.mark.slow
def test_sixteen_processes_take_turns(shared_lease_store_url: str) -> None:
    lease_store_url = shared_lease_store_url
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    ttl = 4.0
    procs = {n: start(lease_store_url, "soak", ttl) for n in range(16)}
    next_n = 16
    ids: list[int] = []
    holds: list[tuple[int, int, float, float]] = []
    kills = 0
    deadline = time.monotonic() + SOAK_SECONDS
    try:
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(1.0, 4.0))
            n = rng.choice(sorted(procs))
            proc = procs.pop(n)
            proc.send_signal(signal.SIGKILL)
            got, spans, _ = read(proc, time.time())
            ids += got
            holds += [(n, *span) for span in spans]
            kills += 1
            procs[next_n] = start(lease_store_url, "soak", ttl)
            next_n += 1
    finally:
        for n, proc in procs.items():
            proc.send_signal(signal.SIGTERM)
            got, spans, _ = read(proc, time.time())
            ids += got
            holds += [(n, *span) for span in spans]
    # Eight worker ids, sixteen processes: leases changed hands, some after a kill -9.
    assert kills >= 3 and len(holds) > 8 and len(ids) > 10_000
    assert_no_two_holders(holds)
    assert_unique(ids)


@pytest.mark.parametrize("kind", ["sqlite", "postgres", "redis"])
def test_a_paused_holder_issues_nothing_under_its_old_lease(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from conftest import fresh_store_url

    url = fresh_store_url(kind, request, tmp_path)
    ttl = 2.0
    first = start(url, "pause", ttl, hold=60, exact=True)  # holds its lease throughout
    time.sleep(1.5)  # it holds worker 0 and issues
    first.send_signal(signal.SIGSTOP)
    stopped_at = time.time()
    time.sleep(ttl + 1.0)  # its lease expires
    others = [start(url, "pause", ttl, hold=60) for _ in range(8)]  # take every worker id
    time.sleep(2.0)
    first.send_signal(signal.SIGCONT)
    time.sleep(2.0)
    first.send_signal(signal.SIGKILL)
    ids_first, holds_first, errors = read(first, stopped_at)
    all_ids = list(ids_first)
    all_holds = [(0, *span) for span in holds_first]
    for n, proc in enumerate(others, 1):
        proc.send_signal(signal.SIGTERM)
        got, spans, _ = read(proc, time.time())
        all_ids += got
        all_holds += [(n, *span) for span in spans]
    assert "LeaseLost" in errors, "the paused holder did not notice it lost its lease"
    assert any(wid == holds_first[0][0] for n, wid, *_ in all_holds if n)  # someone took it
    assert_unique(all_ids)
