"""A server with many quorum keys on one node set: threads, descriptors and memory per key.

    python bench/quorum_keys.py --json              (3,000 keys; about a minute)
    python bench/quorum_keys.py --json --keys 500
    python bench/quorum_keys.py --json --smoke      (30 keys, checks on: CI)

Starts three Redis nodes (`appendfsync always`, tests/server_redis.py) and one `idmint serve
--quorum` worker on SQLite, adds --keys quorum keys, and asks each for one id over HTTP. The
worker is measured twice, from /proc: after one key served an id (the baseline: the node
connections and threads exist) and after every key did. Figures:

  threads, fds, rss_mb          the worker after every key served an id
  baseline_threads, _fds, _rss_mb   the same after one key did
  threads_per_key, fds_per_key  growth per key past the first (0 when the keys share the
                                node set's connections and threads)
  key_bytes                     RSS growth per key past the first
  ids, repeated                 ids handed out (one per key, q0 twice) and how many a key
                                handed out twice
  a_quorum_request_ms           one more request after all of that (the issue's symptom: it
                                failed once past descriptor 1023)
  smoke, seconds_total          whether --smoke ran, and the run's seconds, set-up included
  failed                        the checks that failed (empty: all passed; else the exit code
                                is 1): ids (every key served one), repeated, threads (at most
                                the node set's round threads more than the baseline), fds (at
                                most 8 more: reconnects, not keys); without --smoke also
                                key_bytes
Targets: threads_per_key == 0, fds_per_key == 0, key_bytes <= 32768 (the worker's RSS: the
library's own objects are about 4 KB a key, tracemalloc; the rest is the server's). --smoke
serves 30 keys: its figures per key mean little, its checks hold.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

import idmint

ROOT = Path(__file__).resolve().parents[1]


def usage(pid: int) -> dict[str, float]:
    """Threads, open descriptors and RSS (MB) of process `pid` and its children's worker."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
    return {
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "rss_mb": round(rss_kb / 1024, 1),
    }


def worker_pid(server_pid: int) -> int:
    """The process that serves requests: the granian worker under `idmint serve`, if any."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    return int(children[-1]) if children else server_pid


@contextlib.contextmanager
def nodes() -> Iterator[list[str]]:
    from server_redis import RedisServer
    from servers import running

    with running([RedisServer(host=f"127.0.0.{21 + i}") for i in range(3)]) as servers:
        yield [s.store_url("keys") for s in servers]


#: Threads a node set may start after the baseline (its round threads), and descriptors
#: (a reconnect or a check's connection): a fixed allowance, not one per key.
MORE_THREADS, MORE_FDS = 4, 8


def checks(result: dict[str, Any], smoke: bool) -> list[str]:
    """The checks that failed."""
    failed = []
    if result["ids"] != result["keys"] + 1:  # every key once, and q0 again
        failed.append("ids")
    if result["repeated"]:
        failed.append("repeated")
    if result["threads"] - result["baseline_threads"] > MORE_THREADS:
        failed.append("threads")
    # A smoke run's 30 keys cannot tell a few sockets a busy machine's slow answers left open
    # from one a key: it fails at one for every other key.
    if result["fds"] - result["baseline_fds"] > max(MORE_FDS, result["keys"] // 2 if smoke else 0):
        failed.append("fds")
    if not smoke and result["key_bytes"] > 32768:  # a few keys' RSS is noise
        failed.append("key_bytes")
    return failed


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from http_bench import free_port, running
    from report import progress

    began = time.monotonic()
    settle = 0.1 if args.smoke else 0.5  # seconds for connections and checks to finish

    result: dict[str, Any] = {"keys": args.keys}
    with tempfile.TemporaryDirectory() as tmp, nodes() as urls:
        store = f"sqlite:///{tmp}/s.db"
        with idmint.connect(store) as minter:
            minter.init()
            for i in range(args.keys):
                minter.add_quorum_key(f"q{i}")
                if i % 500 == 499 or i == args.keys - 1:
                    progress("adding keys", i + 1, args.keys)
        port = free_port()
        serve = [sys.executable, "-m", "idmint", "--store", store, "serve", "--port", str(port)]
        serve += ["--quorum", ",".join(urls)]
        base = f"http://127.0.0.1:{port}"
        with running(serve, f"{base}/livez") as proc, httpx.Client(base_url=base) as http:
            seen: list[tuple[str, int]] = []

            def one(key: str) -> float:
                t0 = time.perf_counter()
                got = http.get(f"/v1/quorum/{key}/ids", timeout=30)
                got.raise_for_status()
                seen.append((key, got.json()["start"]))
                return (time.perf_counter() - t0) * 1000

            one("q0")
            pid = worker_pid(proc.pid)
            time.sleep(settle)  # connections made, checks done
            baseline = usage(pid)
            for i in range(1, args.keys):
                one(f"q{i}")
                if i % 500 == 499 or i == args.keys - 1:
                    progress("one id a key", i + 1, args.keys)
            time.sleep(settle)
            after = usage(pid)
            result["a_quorum_request_ms"] = round(one("q0"), 2)
        grown = max(1, args.keys - 1)
        result.update(after)
        result.update({f"baseline_{k}": v for k, v in baseline.items()})
        result["threads_per_key"] = round((after["threads"] - baseline["threads"]) / grown, 3)
        result["fds_per_key"] = round((after["fds"] - baseline["fds"]) / grown, 3)
        result["key_bytes"] = round((after["rss_mb"] - baseline["rss_mb"]) * 2**20 / grown)
        result["ids"] = len(seen)
        result["repeated"] = len(seen) - len(set(seen))  # per key: each has its own ids
    result["smoke"] = args.smoke
    result["seconds_total"] = round(time.monotonic() - began, 1)
    result["failed"] = checks(result, args.smoke)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keys", type=int, default=3000)
    # bench/ is put on the path here: importing httpx above took the script's directory off it.
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "bench"))
    from report import apply_smoke, emit, smoke_option

    smoke_option(parser)
    args = parser.parse_args()
    apply_smoke(args, keys=30)
    result = measure(args)
    emit(result, args.json)
    sys.exit(1 if result["failed"] else 0)


if __name__ == "__main__":
    main()
