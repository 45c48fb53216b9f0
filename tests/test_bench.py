"""No benchmark rots (issue 31): every script in bench/ runs in its smoke mode (`--smoke`: each
phase a fraction of a second, its own checks on), and its JSON is read and checked. A change
that breaks a benchmark fails here, not months later when someone wants its figures.

The scripts run at the same time, each a process of its own started when the first of these
tests asks (their figures mean nothing in a smoke run, and most of their time is waiting for
servers and processes to start, which overlaps)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
#: What is not a benchmark: shared code, and the file bench/http.py runs.
NOT_BENCHMARKS = {"bench_servers.py", "report.py", "http_bench.py"}
TIMEOUT = 150.0  # seconds for every script together (each takes 2 to 15 s when run alone)

Check = Callable[[list[dict[str, Any]]], None]


def _segment(out: list[dict[str, Any]]) -> None:
    (result,) = out
    assert result["ids_per_s"] > 0 and result["floor_ids_per_s"] > 0
    assert result["density_after_close"] == 1.0  # every tail given back on close


def _snowflake(out: list[dict[str, Any]]) -> None:
    (result,) = out
    assert result["ids_per_s"] > 0 and result["batch_ids_per_s"] > 0
    assert result["acquire_ms_sqlite"] > 0


def _stripes(out: list[dict[str, Any]]) -> None:
    assert [r["engine"] for r in out] == ["sqlite", "sqlite (statement)"]
    for result in out:
        assert result["plain_ids_per_s"] > 0 and result["striped_ids_per_s"] > 0


def _keys(out: list[dict[str, Any]]) -> None:
    (result,) = out
    assert result["keys"] == 300 and result["threads_ok"], result
    assert result["first_id_ms_p99"] > 0 and result["metrics_bytes"] > 0


def _http(out: list[dict[str, Any]]) -> None:
    (result,) = out  # wrk's error responses make the script exit non-zero
    for route in ("single", "floor", "tinyid", "tinyid_json", "cosid", "batch"):
        assert result[f"{route}_rps"] > 0, route
    assert result["client_ids_per_s"] > 0


def _replication(out: list[dict[str, Any]]) -> None:
    (result,) = out
    assert set(result) == {"redis", "postgresql-async"}
    for engine in result.values():
        assert engine["allocations"] == 100 and engine["safe_per_s"] > 0
    assert result["postgresql-async"]["flush_read_ms"] > 0


def _datacenter(out: list[dict[str, Any]]) -> None:
    (result,) = out  # etcd: Cassandra's three nodes take 30 s to start
    assert result["smoke"] and result["engine"] == "etcd"
    assert result["failed"] == [] and result["duplicates"] == 0, result
    assert result["ids_checked"] > 0 and result["grants"] >= 2  # one per datacenter


def _quorum(out: list[dict[str, Any]]) -> None:
    (result,) = out
    assert result["smoke"] and result["failed"] == [] and result["violations"] == 0, result
    for phase in ("single", "clients8", "group"):
        assert result[f"{phase}_ids_per_s"] > 0 and result[f"{phase}_errors"] == 0, phase
    assert result["own_keys8_vs_single"] > 0
    assert result["clients8_seconds_vs_single"] == [0, 0]  # a 0.3 s phase has no whole second


def _quorum_keys(out: list[dict[str, Any]]) -> None:
    (result,) = out
    assert result["smoke"] and result["failed"] == [], result
    assert result["keys"] == 30 and result["ids"] == 31 and result["repeated"] == 0


def _torture(out: list[dict[str, Any]]) -> None:
    (result,) = out  # a few seconds of faults on SQLite
    assert result["setup"] == "sqlite" and result["verdict"] == "ok", result["problems"]
    assert result["ids"] > 0 and result["repeated"] == 0 and sum(result["faults"].values())


#: Script -> (extra arguments, check of its JSON objects).
SMOKES: dict[str, tuple[list[str], Check]] = {
    "segment.py": ([], _segment),
    "snowflake.py": ([], _snowflake),
    "stripes.py": ([], _stripes),
    "keys.py": ([], _keys),
    "http.py": ([], _http),
    "replication.py": ([], _replication),
    "datacenter.py": (["--engine", "etcd"], _datacenter),
    "quorum.py": ([], _quorum),
    "quorum_keys.py": ([], _quorum_keys),
    "torture.py": ([], _torture),
}


def test_every_benchmark_has_a_smoke_run() -> None:
    scripts = {path.name for path in BENCH.glob("*.py")} - NOT_BENCHMARKS
    assert scripts == set(SMOKES)


class Run:
    """One script running, its output in files: a pipe nobody reads yet could fill and stall it."""

    def __init__(self, script: str, args: list[str]) -> None:
        self.script = script
        # Closed in close(), which the fixture calls however the tests end.
        self.out = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.err = tempfile.TemporaryFile("w+")  # noqa: SIM115
        # A session of its own: close() kills the script with every process it started (a
        # script killed alone left its servers and clients running, orphaned, for good).
        self.proc = subprocess.Popen(
            [sys.executable, str(BENCH / script), "--smoke", "--json", *args],
            stdout=self.out,
            stderr=self.err,
            text=True,
            start_new_session=True,
        )

    def result(self, deadline: float) -> list[dict[str, Any]]:
        """Its JSON objects, once it ended well; a test failure saying why otherwise."""
        try:
            self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"bench/{self.script} --smoke ran over {TIMEOUT:g} s: {self._tail()}")
        if self.proc.returncode != 0:
            code = self.proc.returncode
            pytest.fail(f"bench/{self.script} --smoke exited {code}: {self._tail()}")
        self.out.seek(0)
        lines = [line for line in self.out.read().splitlines() if line.startswith("{")]
        assert lines, f"bench/{self.script} --smoke printed no JSON"
        return [json.loads(line) for line in lines]

    def _tail(self) -> str:
        self.err.seek(0)
        self.out.seek(0)
        return self.err.read()[-2000:] + "\n" + self.out.read()[-2000:]

    def close(self) -> None:
        """The script, if it still runs, killed with whatever it started (its clients). Only
        while it runs: once it is reaped, its group id may be another's."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.out.close()
        self.err.close()


@pytest.fixture(scope="module")
def runs() -> Iterator[tuple[dict[str, Run], float]]:
    """Every script started at once, and the monotonic deadline for them all."""
    deadline = time.monotonic() + TIMEOUT
    started = {script: Run(script, args) for script, (args, _) in SMOKES.items()}
    try:
        yield started, deadline
    finally:
        for run in started.values():
            run.close()


@pytest.mark.parametrize("script", sorted(SMOKES))
def test_a_benchmark_runs_and_its_checks_pass(
    script: str, runs: tuple[dict[str, Run], float]
) -> None:
    started, deadline = runs
    SMOKES[script][1](started[script].result(deadline))
