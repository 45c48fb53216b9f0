"""Datacenter keys (Farfetch's design) on two datacenters, through a partition.

    python bench/datacenter.py --json                    # etcd and Cassandra, both
    python bench/datacenter.py --json --engine etcd --seconds 20 --partition 30
    python bench/datacenter.py --json --smoke --engine etcd   # every phase 0.5 s (CI)

Starts the fault tests' set-ups (tests/datacenters.py: a global etcd and one per datacenter;
a three-node Cassandra with n1 + n2 in dc1 and n3 in dc2) and a 32-bit key at the default
reservation sizing. --clients processes per datacenter take ids in batches of --batch: once
each has served its first id, --warm-up seconds, --seconds of steady state flat out, then,
paced at --partition-rate ids a second per process, dc2 cut off from the global level for
--partition seconds and --tail seconds after the heal. --smoke makes every phase 0.5 s (the
checks stay on; the figures mean little): a run that shows the bench still works. (Flat out,
a process here takes millions of ids a second: the default minimum reservation of 10 million
would last seconds. Paced, the partition is shorter than the runway, as the design asks.)
Needs root (iptables).

Each process keeps the ids it got as runs of consecutive ids, so every id is checked: the
runs of all processes must not overlap. One JSON object per engine:

  ids_per_s                   ids all processes got a second, steady state
  baseline_ids_per_s          the same processes on a plain segment key of the datacenter's
                              store (no datacenter level): the floor this is measured against
  ratio                       ids_per_s / baseline_ids_per_s
  local_alloc_p99_ms          a process's range allocation from its datacenter, 99th percentile
  global_cas_per_million_ids  compare-and-sets on the global cell per million ids handed out
  partition_seconds           how long dc2 was cut off
  partition_errors            calls that failed meanwhile, in either datacenter
  duplicates                  ids handed out twice (runs that overlap)
  ids_checked                 ids handed out in the measured run, every one checked
  global_cas, global_conflicts, grants
                              the processes' counts: swaps tried on the global cell, those
                              lost to another writer, and reservations applied
  runway_hours_at_rate        what dc2 had left at the end, over its paced rate
  smoke, seconds_total        whether --smoke ran, and the run's seconds, set-up included
  failed                      the checks that failed (exit status 1): duplicates, partition
                              errors, a process that took no id in the steady phase
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from idmint import IdmintError, ReservationSizing, SegmentGenerator, SegmentOptions
from idmint.ids import Allocation
from idmint.stores import open_engine
from idmint.stores.base import RangeStore
from idmint.strategies.datacenter import DatacenterRanges

LAST_ID = 2**31 - 1
SMOKE = {"seconds": 0.5, "partition": 0.5, "tail": 0.5, "warm_up": 0.0}


class Timed:
    """A range store whose allocations are timed."""

    def __init__(self, inner: RangeStore) -> None:
        self._inner = inner
        self.ms: list[float] = []

    def allocate(self, *args: Any, **kwargs: Any) -> Allocation:
        started = time.perf_counter()
        got = self._inner.allocate(*args, **kwargs)
        self.ms.append((time.perf_counter() - started) * 1000)
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _store(global_url: str, dc_store: str | None, dc: str | None) -> RangeStore:
    """The datacenter level as datacenter `dc` sees it; without dc, a plain segment store on
    the datacenter's own store (the baseline)."""
    if dc is None:
        return open_engine(dc_store or global_url, timeout=5).ranges()
    engine = open_engine(global_url, timeout=2)
    local = engine.local_cas(dc) if dc_store is None else open_engine(dc_store, timeout=2).cas()
    return DatacenterRanges(engine.cas(), local, dc)


def client(
    global_url: str,
    dc_store: str | None,
    dc: str | None,
    key: str,
    batch: int,
    seconds: float,
    paced: float,
    clock: tuple[Any, Any, Any],
    out: Any,
) -> None:
    """One process: ids in batches from `start` until the parent says stop, counted in the
    steady phase [start, start + seconds) and failures from the cut until a second after the
    heal; its ids as runs of consecutive ids. From `lead` before the planned cut, at most
    `paced` ids a second. The parent sets the times (wall clock) in `marks`: the start once
    every process has served its first id (connected: the clock starts fairly), the cut and
    the heal once they are in place (iptables may wait for its lock), the stop after them."""
    ready, go, marks = clock  # marks: start, cut, heal, stop
    store = _store(global_url, dc_store, dc)
    timed = Timed(store)
    gen = SegmentGenerator(timed, key, SegmentOptions(max_step=10_000, wait=2.0))
    runs: list[list[int]] = []
    steady = errors = partition_errors = paced_ids = 0
    try:
        runs.append([first := gen.next_id(), first + 1])
        ready.put(dc)
        go.wait(300)
        start = marks[0]
        cut = start + seconds
        lead = min(1.0, seconds / 2)  # paced already when the cut comes
        due = cut - lead
        time.sleep(max(0.0, start - time.time()))
        while (now := time.time()) < marks[3]:
            try:
                got = gen.next_ids(batch)
            except IdmintError:
                errors += 1
                partition_errors += marks[1] <= now < marks[2] + 1.0
                time.sleep(0.01)
                continue
            if now < cut:
                steady += len(got)
            if now >= cut - lead and paced:
                paced_ids += len(got)
                due += len(got) / paced
                time.sleep(max(0.0, due - time.time()))
            for i in got:
                if runs and runs[-1][1] == i:
                    runs[-1][1] = i + 1
                else:
                    runs.append([i, i + 1])
        seen = store.seen() if isinstance(store, DatacenterRanges) else []
        counts = asdict(store.counts) if isinstance(store, DatacenterRanges) else {}
        out.put(
            {
                "dc": dc,
                "steady": steady,
                "errors": errors,
                "partition_errors": partition_errors,
                "runs": runs,
                "alloc_ms": timed.ms,
                "counts": counts,
                "left": seen[0].left if seen else None,
                "paced_rate": paced_ids / max(1e-9, marks[3] - (cut - lead)),
            }
        )
    finally:
        gen.close()
        store.close()


def _run_clients(
    dcs: Any, key: str, args: argparse.Namespace, *, baseline: bool
) -> tuple[list[dict[str, Any]], float]:
    """Start --clients processes per datacenter and, unless baseline, cut dc2 off in the
    middle; their reports, and how long the cut lasted."""
    from datacenters import DCS

    spawn = multiprocessing.get_context("spawn")
    out, ready, go = spawn.Queue(), spawn.Queue(), spawn.Event()
    # start, cut, heal, stop (see client); no lock: read every batch, a double is written whole
    marks = spawn.Array("d", [math.inf] * 4, lock=False)
    procs = [
        spawn.Process(
            target=client,
            args=(
                dcs.global_url(dc),
                dcs.dc_store(dc),
                None if baseline else dc,
                key,
                args.batch,
                args.seconds,
                args.partition_rate,
                (ready, go, marks),
                out,
            ),
        )
        for dc in DCS
        for _ in range(args.clients)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:  # each connected and served its first id (its first grant)
        ready.get(timeout=120)
    marks[0] = start = time.time() + args.warm_up
    go.set()
    time.sleep(max(0.0, start + args.seconds - time.time()))
    cut_for = 0.0
    if not baseline:
        marks[1] = time.time()  # errors count from here: the rules go in one by one
        with dcs.cut_off_dc2():
            began = time.time()
            time.sleep(args.partition)
        marks[2] = time.time()
        cut_for = marks[2] - began
        time.sleep(args.tail)
    marks[3] = time.time()
    reports = [out.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(30)
    return reports, cut_for


def _overlapping_ids(runs: list[tuple[int, int]]) -> int:
    """Ids in more than one run."""
    twice = 0
    reach = -1
    for start, stop in sorted(runs):
        if start < reach:
            twice += min(stop, reach) - start
        reach = max(reach, stop)
    return twice


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def run(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    from datacenters import TOPOLOGIES, running

    began = time.monotonic()
    with running(TOPOLOGIES[kind]) as dcs:
        key = f"bench{uuid.uuid4().hex[:8]}"
        admin = DatacenterRanges(open_engine(dcs.global_url("dc1"), timeout=10).cas())
        admin.add_key(key, step=1000, last_id=LAST_ID, sizing=ReservationSizing())
        plain_key = f"plain{uuid.uuid4().hex[:8]}"
        for dc in ("dc1", "dc2"):
            plain = _store(dcs.global_url(dc), dcs.dc_store(dc), None)
            with contextlib.suppress(IdmintError):  # one store for both (Cassandra)
                plain.add_key(plain_key, step=1000, first_id=1, last_id=2**62)
            plain.close()
        base, _ = _run_clients(dcs, plain_key, args, baseline=True)
        reports, cut_for = _run_clients(dcs, key, args, baseline=False)
        admin.close()
    ids_per_s = sum(r["steady"] for r in reports) / args.seconds
    baseline = sum(r["steady"] for r in base) / args.seconds
    handed = sum(b - a for r in reports for a, b in r["runs"])
    counts = {n: sum(r["counts"][n] for r in reports) for n in ("global_cas", "global_conflicts")}
    global_cas = counts["global_cas"]
    duplicates = _overlapping_ids([tuple(run) for r in reports for run in r["runs"]])
    partition_errors = sum(r["partition_errors"] for r in reports)
    failed = [
        what
        for what, bad in (
            ("duplicates", duplicates),
            ("partition_errors", partition_errors),
            ("a process took no id in the steady phase", not all(r["steady"] for r in reports)),
        )
        if bad
    ]
    dc2 = [r for r in reports if r["dc"] == "dc2"]
    dc2_rate = sum(r["paced_rate"] for r in dc2)
    left = min((r["left"] for r in dc2 if r["left"] is not None), default=None)
    return {
        "bench": "datacenter",
        "engine": kind,
        "dcs": 2,
        "clients_per_dc": args.clients,
        "batch": args.batch,
        "seconds": args.seconds,
        "partition_rate_per_process": args.partition_rate,
        "ids_per_s": round(ids_per_s),
        "baseline_ids_per_s": round(baseline),
        "ratio": round(ids_per_s / baseline, 2) if baseline else None,
        "local_alloc_p99_ms": round(_p99([ms for r in reports for ms in r["alloc_ms"]]) or 0, 2),
        "global_cas_per_million_ids": round(global_cas / handed * 1e6, 3) if handed else None,
        "partition_seconds": round(cut_for, 1),
        "partition_errors": partition_errors,
        "errors": sum(r["errors"] for r in reports),
        "duplicates": duplicates,
        "ids_checked": handed,
        **counts,
        "grants": sum(r["counts"]["grants"] for r in reports),
        "runway_hours_at_rate": (
            round(left / dc2_rate / 3600, 3) if left is not None and dc2_rate else None
        ),
        "smoke": args.smoke,
        "seconds_total": round(time.monotonic() - began, 1),
        "failed": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print JSON objects, one a line")
    parser.add_argument("--engine", choices=("etcd", "cassandra"), action="append")
    parser.add_argument("--clients", type=int, default=2, help="processes per datacenter")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=10.0, help="steady state measured")
    parser.add_argument("--partition", type=float, default=10.0, help="seconds dc2 is cut off")
    parser.add_argument(
        "--partition-rate",
        type=float,
        default=100_000,
        help="ids a second per process around the cut (0: flat out)",
    )
    parser.add_argument(
        "--warm-up", type=float, default=1.0, help="seconds after every process served an id"
    )
    parser.add_argument("--tail", type=float, default=3.0, help="seconds measured after the heal")
    parser.add_argument(
        "--smoke", action="store_true", help="every phase 0.5 s, checks on: does the bench work?"
    )
    args = parser.parse_args()
    if args.smoke:
        for name, seconds in SMOKE.items():
            setattr(args, name, seconds)
    from report import emit  # here: spawned clients re-import this module without bench/

    # The test suite's set-ups; here, not at the top: spawned clients re-import this module.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    failed = False
    for kind in args.engine or ["etcd", "cassandra"]:
        result = run(kind, args)
        emit(result, args.json)
        failed = failed or bool(result["failed"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
