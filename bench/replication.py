"""What replication safety costs: range allocations on a replicated primary, with every write
waiting for the replica versus the same primary with no waiting, in one run.

    python bench/replication.py --json                    (about a minute)
    python bench/replication.py --json --engines redis --allocations 5000

Per engine, a primary and a replica on loopback, with the engines' own replication
(tests/replicated.py): Redis with a replica (`appendfsync always`), PostgreSQL with a
synchronous standby (`postgresql`) and with an asynchronous one (`postgresql-async`), MariaDB
with a semi-synchronous replica. Two clients on the primary:

  safe   the default URL: Redis WAITs for the replica after each write, a PostgreSQL commit
         waits for the synchronous standby, or idmint waits after it until the asynchronous
         standby has flushed it (its flush position read until it is far enough), a MariaDB
         commit for the replica's acknowledgement and idmint confirms it (one status read)
  none   the same primary without waiting (?unsafe_replication=1; with the synchronous
         standby, PostgreSQL's session sets synchronous_commit=local; MariaDB's semi-sync is
         switched off for its blocks)

Each allocation takes one range (`ranges.allocate`, one store write); the two alternate in
blocks so that drift hits both. Figures per engine:

  safe_per_s, none_per_s   allocations per second
  ratio                    safe_per_s / none_per_s (the price of waiting for the replica)
  safe_p99_ms, none_p99_ms the 99th percentile of one allocation
  next_id_ns_safe, _none   one next_id() from a buffered range (best of 5, taking turns): the
                           hot path, the same in both
  hot_ratio                next_id_ns_safe / next_id_ns_none (target: within noise of 1)

and on PostgreSQL what idmint's own reads cost, each on one connection to the primary (best of
5 rounds of 1,000): replication_read_ms, the replication read every write makes first
(POSTGRES_QUERY); flush_read_ms, one reading of the standbys' flush positions (what the wait
for an asynchronous standby repeats); round_trip_ms, `SELECT 1`, for scale.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import idmint

from report import apply_smoke, progress, smoke_option

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 100  # allocations per block; the modes alternate block by block
HOT_CALLS = 300_000


@contextlib.contextmanager
def primary_urls(engine: str) -> Iterator[tuple[str, str, Callable[[bool], None]]]:
    """(safe URL, no-wait URL, switch(waiting)) on a replicated primary of `engine`; switch is
    called before each block, for engines whose waiting is a server setting."""
    from replicated import mariadb_pair, postgres_pair, redis_pair, sql

    def nothing(waiting: bool) -> None:
        pass

    if engine == "redis":
        with redis_pair() as (redis, _):
            url = redis.store_url("bench")
            yield url, url + "&unsafe_replication=1", nothing
    elif engine in ("postgresql", "postgresql-async"):
        synchronous = engine == "postgresql"
        with postgres_pair(synchronous=synchronous) as (postgres, _):
            url = postgres.url()
            local = "&options=-c%20synchronous_commit%3Dlocal" if synchronous else ""
            yield url, url + "?unsafe_replication=1" + local, nothing
    elif engine == "mysql":
        with mariadb_pair(semi_sync=True) as (mariadb, _):
            url = mariadb.create_database("bench")

            def switch(waiting: bool) -> None:
                value = "ON" if waiting else "OFF"
                sql(mariadb, f"SET GLOBAL rpl_semi_sync_master_enabled = {value}")

            yield url, url + "?unsafe_replication=1", switch
    else:
        raise SystemExit(f"unknown engine {engine!r} (redis, postgresql, postgresql-async, mysql)")


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def next_id_ns(clients: dict[str, Any], key: str, rounds: int = 5) -> dict[str, float]:
    """ns per next_id() from a buffered range (the step covers every call), per client: the
    best of `rounds`, the clients taking turns, so that warm-up and drift hit both."""
    gens = {mode: minter.segment(key) for mode, minter in clients.items()}
    for gen in gens.values():
        gen.next_id()  # the first range loaded
    best = {mode: float("inf") for mode in gens}
    for _ in range(rounds):
        for mode, gen in gens.items():
            started = time.perf_counter_ns()
            for _ in range(HOT_CALLS):
                gen.next_id()
            best[mode] = min(best[mode], (time.perf_counter_ns() - started) / HOT_CALLS)
    return best


def postgres_reads_ms(url: str, calls: int = 1000, rounds: int = 5) -> dict[str, float]:
    """ms per statement of idmint's own replication reads on PostgreSQL (see the module doc),
    the best of `rounds`, the statements taking turns."""
    import psycopg

    from idmint.stores.replication import POSTGRES_FLUSH_QUERY, POSTGRES_QUERY

    statements = {
        "replication_read_ms": (POSTGRES_QUERY, None),
        "flush_read_ms": (POSTGRES_FLUSH_QUERY, (None,)),
        "round_trip_ms": ("SELECT 1", None),
    }
    best = {name: float("inf") for name in statements}
    with psycopg.connect(url, autocommit=True) as conn, conn.cursor() as cur:
        for _ in range(rounds):
            for name, (query, params) in statements.items():
                started = time.perf_counter()
                for _ in range(calls):
                    cur.execute(query, params)
                    cur.fetchall()
                best[name] = min(best[name], (time.perf_counter() - started) / calls)
    return {name: round(seconds * 1000, 4) for name, seconds in best.items()}


def measure_engine(engine: str, allocations: int) -> dict[str, Any]:
    with primary_urls(engine) as (safe_url, none_url, switch):
        with idmint.connect(safe_url, timeout=5) as setup:
            setup.add_key("k", step=10)
            setup.add_key("hot", step=HOT_CALLS * 6)
        times: dict[str, list[float]] = {"safe": [], "none": []}
        with (
            idmint.connect(safe_url, timeout=5) as safe,
            idmint.connect(none_url, timeout=5) as none,
        ):
            clients = {"safe": safe, "none": none}
            for minter in clients.values():
                minter.ranges.allocate("k")  # connected, checked
            blocks = max(1, allocations // BLOCK)
            for block in range(blocks):
                for mode, minter in clients.items():
                    switch(mode == "safe")
                    spent = times[mode]
                    for _ in range(BLOCK):
                        t0 = time.perf_counter()
                        minter.ranges.allocate("k")
                        spent.append(time.perf_counter() - t0)
                progress(engine, block + 1, blocks)
            switch(True)
            hot = next_id_ns(clients, "hot")
        reads = postgres_reads_ms(safe_url) if engine.startswith("postgresql") else {}
    rate = {mode: len(t) / sum(t) for mode, t in times.items()}
    return {
        "allocations": len(times["safe"]),
        "safe_per_s": round(rate["safe"]),
        "none_per_s": round(rate["none"]),
        "ratio": round(rate["safe"] / rate["none"], 3),
        "safe_p99_ms": round(percentile(times["safe"], 0.99) * 1000, 3),
        "none_p99_ms": round(percentile(times["none"], 0.99) * 1000, 3),
        "next_id_ns_safe": round(hot["safe"], 1),
        "next_id_ns_none": round(hot["none"], 1),
        "hot_ratio": round(hot["safe"] / hot["none"], 3),
        **reads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--engines", default="redis,postgresql,postgresql-async,mysql")
    parser.add_argument("--allocations", type=int, default=2000, help="per engine and mode")
    smoke_option(parser)
    args = parser.parse_args()
    apply_smoke(args, engines="redis,postgresql-async", allocations=BLOCK)
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "bench"))
    from report import emit

    result = {
        engine: measure_engine(engine, args.allocations) for engine in args.engines.split(",")
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
