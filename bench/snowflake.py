"""Snowflake throughput against the layout's physical limit, and lease acquire latency.

    python bench/snowflake.py --json
    python bench/snowflake.py --json --store postgresql://... --store redis://...
    python bench/snowflake.py --json --test-servers   # starts the test suite's servers

Figures:
  ids_per_s         next_id() in one thread, twitter layout, only real ids counted
  cap_ids_per_s     4,096,000: a 12-bit sequence per millisecond is the layout's limit
  ratio             ids_per_s / cap_ids_per_s
  batch_ids_per_s   next_ids(4096) in one thread
  acquire_ms        median acquire + release of a worker lease, per store given
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_servers import started_servers

from idmint.layout import TWITTER
from idmint.stores import open_lease_store
from idmint.strategies.snowflake import SnowflakeGenerator

from report import apply_smoke, smoke_option


def rate_next_id(gen: SnowflakeGenerator, seconds: float) -> float:
    next_id = gen.next_id
    count = 0
    started = time.perf_counter()
    stop = started + seconds
    while time.perf_counter() < stop:
        for _ in range(10_000):
            next_id()
        count += 10_000
    return count / (time.perf_counter() - started)


def rate_batch(gen: SnowflakeGenerator, seconds: float) -> float:
    count = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        count += len(gen.next_ids(4096))
    return count / (time.perf_counter() - started)


def acquire_ms(url: str, rounds: int) -> float:
    store = open_lease_store(url)
    samples = []
    try:
        for _ in range(rounds):
            started = time.perf_counter()
            now_ms = int(time.time() * 1000)
            # as a generator asks: preferring a worker id usable at once
            lease = store.acquire(
                "bench", workers=1024, ttl=10, horizon_ms=now_ms + 10_000, now_ms=now_ms
            )
            samples.append((time.perf_counter() - started) * 1000)
            store.release(lease, 0)
    finally:
        store.close()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3, help="best of N")
    parser.add_argument("--store", action="append", default=[], help="also time acquire here")
    parser.add_argument(
        "--test-servers",
        action="store_true",
        help="also time acquire on the test suite's servers, started for the run",
    )
    smoke_option(parser)
    args = parser.parse_args()
    apply_smoke(args, seconds=0.1, rounds=1)
    with contextlib.ExitStack() as stack:
        if args.test_servers:
            args.store += stack.enter_context(started_servers("bench_snowflake"))
        result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in result.items():
            print(f"{name:22} {value}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        sqlite = f"sqlite:///{Path(tmp) / 'bench.db'}"
        # A new store makes its first holder wait out the longest lease ttl (10 s): the smoke
        # run takes its lease from memory instead, which the hot path never touches.
        gen_store = "memory://bench" if args.smoke else sqlite
        gen = SnowflakeGenerator(open_lease_store(gen_store), TWITTER)
        try:
            gen.next_ids(10)
            ours = max(rate_next_id(gen, args.seconds) for _ in range(args.rounds))
            batch = max(rate_batch(gen, args.seconds) for _ in range(args.rounds))
        finally:
            gen.close()
        cap = TWITTER.capacity_per_s
        result: dict[str, Any] = {
            "bench": "snowflake",
            "python": sys.version.split()[0],
            "ids_per_s": round(ours),
            "cap_ids_per_s": round(cap),
            "ratio": round(ours / cap, 3),
            "batch_ids_per_s": round(batch),
            "batch_ratio": round(batch / cap, 3),
        }
        for url in [sqlite, *args.store]:
            scheme = url.split("://", 1)[0]
            result[f"acquire_ms_{scheme}"] = round(acquire_ms(url, 50), 3)
    return result


if __name__ == "__main__":
    main()
