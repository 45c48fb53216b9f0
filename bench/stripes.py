"""Broadcast's experiment on every compare-and-set engine: clients taking ids in batches from
one key, plain and with stripes.

    python bench/stripes.py --json --store etcd://127.0.0.1:2379/bench
    python bench/stripes.py --json --test-servers       # starts the test suite's servers

Each client is a process with its own connection and a segment generator whose step is fixed
at the batch (100): every 100 ids is one allocation, a read and a compare-and-set of the key's
counter (or of its stripe's). All clients start at once and run for --seconds. One JSON
object per engine (and per path on SQL engines, where the keys table takes a range in one
statement under a row lock instead of compare-and-set):

  plain_ids_per_s          ids all clients got from a key with one counter
  striped_ids_per_s        the same from a key with --stripes counters
  ratio                    striped / plain (Broadcast measured 3.3 on one Cassandra node)
  *_conflicts_per_s        compare-and-set attempts another client won
  generator_ids_per_s      one generator's next_id() in one thread, steady state (refills
                           run in the background, so this should not depend on the engine)
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from idmint import SegmentGenerator, SegmentOptions
from idmint.stores import open_engine
from idmint.stores.base import RangeStore
from idmint.stores.over_cas.ranges import CasRangeStore

SQL = ("sqlite", "postgresql", "mysql")


def _ranges(url: str, path: str) -> tuple[Any, RangeStore]:
    engine = open_engine(url)
    return engine, (engine.ranges() if path == "statement" else CasRangeStore(engine.cas()))


def client(url: str, path: str, key: str, batch: int, ready: Any, seconds: float, out: Any) -> None:
    """One client: ids drawn for `seconds` once every client is ready, and its conflicts."""
    engine, store = _ranges(url, path)
    options = SegmentOptions(max_step=batch, wait=30.0)
    gen = SegmentGenerator(store, key, options)
    try:
        gen.next_id()  # connected, the key's stripes known: the clock starts fairly
        conflicts_before = gen.stats().conflicts
        ready.wait()  # all start together, however long each took to start
        ids = 0
        stop_at = time.time() + seconds
        while time.time() < stop_at:
            ids += len(gen.next_ids(batch))
        out.put((ids, gen.stats().conflicts - conflicts_before))
    finally:
        gen.close()
        engine.close()


def measure(url: str, path: str, stripes: int, args: argparse.Namespace) -> tuple[float, float]:
    """(ids/s, conflicts/s) of --clients clients on a new key with `stripes` stripes."""
    key = f"bench-{uuid.uuid4().hex[:8]}"
    engine, store = _ranges(url, path)
    try:
        store.add_key(key, step=args.batch, first_id=1, last_id=2**62, stripes=stripes)
    finally:
        engine.close()
    spawn = multiprocessing.get_context("spawn")
    out = spawn.Queue()
    ready = spawn.Barrier(args.clients, timeout=args.warm_up)
    procs = [
        spawn.Process(target=client, args=(url, path, key, args.batch, ready, args.seconds, out))
        for _ in range(args.clients)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=args.warm_up + args.seconds + 60) for _ in procs]
    for proc in procs:
        proc.join(10)
    ids = sum(r[0] for r in results)
    conflicts = sum(r[1] for r in results)
    return ids / args.seconds, conflicts / args.seconds


def generator_rate(url: str, path: str, seconds: float) -> float:
    """next_id() calls per second of one generator on a key of its own, steady state."""
    engine, store = _ranges(url, path)
    key = f"gen-{uuid.uuid4().hex[:8]}"
    store.add_key(key, step=1000, first_id=1, last_id=2**62)
    gen = SegmentGenerator(store, key)
    try:
        gen.next_ids(1000)  # past the first range: the dynamic step has started growing
        next_id = gen.next_id
        count = 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            for _ in range(10_000):
                next_id()
            count += 10_000
        return count / (time.perf_counter() - started)
    finally:
        gen.close()
        engine.close()


def run(url: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    kind = open_engine(url).kind
    plain, plain_conflicts = measure(url, path, 1, args)
    striped, striped_conflicts = measure(url, path, args.stripes, args)
    generator = generator_rate(url, path, args.seconds)
    return {
        "bench": "stripes",
        "engine": kind if path == "cas" else f"{kind} (statement)",
        "clients": args.clients,
        "batch": args.batch,
        "stripes": args.stripes,
        "seconds": args.seconds,
        "plain_ids_per_s": round(plain),
        "striped_ids_per_s": round(striped),
        "ratio": round(striped / plain, 2) if plain else None,
        "plain_conflicts_per_s": round(plain_conflicts, 1),
        "striped_conflicts_per_s": round(striped_conflicts, 1),
        "generator_ids_per_s": round(generator),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print JSON objects, one a line")
    parser.add_argument("--store", action="append", default=[], help="a store URL (repeat)")
    parser.add_argument(
        "--test-servers", action="store_true", help="start the test suite's servers, and SQLite"
    )
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--stripes", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--warm-up", type=float, default=60.0, help="seconds the clients may take to start"
    )
    # Here: spawned clients re-import this module without bench/ on the path.
    from report import apply_smoke, emit, smoke_option

    smoke_option(parser)
    args = parser.parse_args()
    apply_smoke(args, clients=2, seconds=0.3)

    with contextlib.ExitStack() as stack:
        urls = list(args.store)
        if args.smoke and not urls:  # SQLite, both paths
            urls.append(
                f"sqlite:///{Path(stack.enter_context(tempfile.TemporaryDirectory()))}/b.db"
            )
        if args.test_servers:
            # Here, not at the top: the spawned clients re-import this module without it.
            from bench_servers import started_servers

            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            urls.append(f"sqlite:///{Path(tmp) / 'bench.db'}")
            urls += stack.enter_context(started_servers("bench_stripes"))
        if not urls:
            parser.error("give --store URL or --test-servers")
        for url in urls:
            paths = ("cas", "statement") if open_engine(url).kind in SQL else ("cas",)
            for path in paths:
                result = run(url, path, args)
                emit(result, args.json)


if __name__ == "__main__":
    main()
