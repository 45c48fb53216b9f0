"""A server with many keys: threads, memory per key, a cold key's first id, metrics.

    python bench/keys.py --json                 (100,000 keys; about 3 minutes)
    python bench/keys.py --json --keys 20000

One `idmint serve` worker on SQLite, run twice: on an empty store (the baseline) and on a store
with `--keys` keys. Figures:
  keys                 keys in the store
  threads              threads of the worker after every key served an id (baseline: empty)
  refill_threads       the refill pool's size (the server's --refill-threads)
  rss_mb               the worker's RSS after every key served an id
  idle_key_bytes       RSS growth per key, every key known but not used since start (the
                       server read their rows; --warm-keys of them took a range)
  used_key_bytes       RSS growth per key after every key served one id (each holds a generator
                       and a range)
  first_id_ms_p99      GET /api/segment/get/{key} for keys nobody used since start
  floor_ms_p99         one range taken straight from the same store by this process (what a
                       cold key's first id waits for at least); first_id_ratio is their ratio
  metrics_ms, stats_ms GET /metrics and /v1/stats (bytes too); livez_ms_max: /livez answered
                       while those scrapes ran; livez_ms_max_no_scrape: over 10 s without
Targets: threads <= 16, idle_key_bytes <= 2048.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import idmint

from report import progress


def make_store(path: Path, keys: int) -> str:
    url = f"sqlite:///{path}"
    minter = idmint.connect(url)
    minter.init()
    for i in range(keys):
        minter.add_key(f"k{i}", step=1000)
        if i % 1000 == 999 or i == keys - 1:
            progress("adding keys", i + 1, keys)
    minter.close()
    return url


def worker_pid(server_pid: int) -> int:
    """granian's worker: the child of the server process that holds the app."""
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(server_pid)], capture_output=True, text=True
    ).stdout.split()
    return int(out[0]) if out else server_pid


def proc_figures(pid: int) -> tuple[int, int]:
    """(RSS bytes, threads) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["Threads"])


class Http:
    """Requests over one kept-alive connection, timed."""

    def __init__(self, port: int) -> None:
        # Imported here: bench/http.py (imported as `http`) takes this folder off the path,
        # and http_bench must be imported first.
        import http.client

        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def get(self, path: str, *, check: bool = True) -> tuple[float, bytes]:
        started = time.perf_counter()
        self.conn.request("GET", path)
        response = self.conn.getresponse()
        body = response.read()
        if check and response.status != 200:
            raise SystemExit(f"GET {path}: {response.status} {body[:200]!r}")
        return (time.perf_counter() - started) * 1000, body


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


def touch_all(port: int, names: list[str], threads: int) -> None:
    """One id of every key, from `threads` connections."""
    done = [0]
    lock = threading.Lock()

    def work(part: list[str]) -> None:
        client = Http(port)
        for name in part:
            client.get(f"/api/segment/get/{name}")
            with lock:
                done[0] += 1
                if done[0] % 2000 == 0 or done[0] == len(names):
                    progress("one id a key", done[0], len(names))

    workers = [threading.Thread(target=work, args=(names[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def scrape(port: int, path: str | None, rounds: int) -> tuple[float, int, float]:
    """(best ms, bytes, slowest /livez ms while the scrapes ran); no path: /livez alone for
    `rounds` seconds (what the server's own background work costs it)."""
    livez: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        client = Http(port)
        while not stop.is_set():
            livez.append(client.get("/livez")[0])
            time.sleep(0.005)

    prober = threading.Thread(target=probe)
    prober.start()
    client = Http(port)
    times, size = [0.0], 0
    for _ in range(rounds):
        if path is None:
            time.sleep(1.0)
            continue
        ms, body = client.get(path)
        times.append(ms)
        size = len(body)
    times = times[1:] or times
    stop.set()
    prober.join()
    return min(times), size, max(livez or [0.0])


def serve_args(url: str, port: int, refill_threads: int) -> list[str]:
    return [
        sys.executable, "-m", "idmint", "--store", url, "serve", "--port", str(port),
        "--refill-threads", str(refill_threads),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--cold", type=int, default=1000, help="cold keys timed one by one")
    parser.add_argument("--refill-threads", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8, help="connections touching keys")
    # In this order: http_bench imports httpx, which imports `http`, which is bench/http.py
    # here, and that takes this folder off the import path.
    from report import apply_smoke, emit, smoke_option  # noqa: I001
    from http_bench import free_port, running

    smoke_option(parser)
    args = parser.parse_args()
    apply_smoke(args, keys=300, cold=20, clients=2)
    settle = 0.2 if args.smoke else 1.0  # seconds for a server's threads to start, refills to end

    result: dict[str, Any] = {"bench": "keys", "python": sys.version.split()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        empty = make_store(Path(tmp) / "empty.db", 0)
        port = free_port()
        with running(
            serve_args(empty, port, args.refill_threads), f"http://127.0.0.1:{port}/livez"
        ) as proc:
            time.sleep(settle)
            rss_empty, threads_empty = proc_figures(worker_pid(proc.pid))
        url = make_store(Path(tmp) / "keys.db", args.keys)
        names = [f"k{i}" for i in range(args.keys)]
        minter = idmint.connect(url)
        floor = []
        for name in random.sample(names, min(args.cold, args.keys)):
            started = time.perf_counter()
            minter.take(name, 1)
            floor.append((time.perf_counter() - started) * 1000)
        minter.close()
        port = free_port()
        with running(
            serve_args(url, port, args.refill_threads), f"http://127.0.0.1:{port}/livez"
        ) as proc:
            pid = worker_pid(proc.pid)
            client = Http(port)
            while b"ready" not in client.get("/readyz", check=False)[1]:
                time.sleep(0.1)
            if not args.smoke:
                time.sleep(6.0)  # the rows refresh (every 5 s) has read every key
            rss_idle, _ = proc_figures(pid)
            warm = 1000  # --warm-keys' default: the first keys took a range at start
            cold = random.sample(names[warm:] or names, min(args.cold, len(names[warm:]) or 1))
            first = [client.get(f"/api/segment/get/{name}")[0] for name in cold]
            touch_all(port, names, args.clients)
            time.sleep(2 * settle)  # refills started by the last ids finish
            rss_used, threads = proc_figures(pid)
            metrics_ms, metrics_bytes, livez_metrics = scrape(port, "/metrics", 3)
            stats_ms, stats_bytes, livez_stats = scrape(port, "/v1/stats", 3)
            _, _, livez_idle = scrape(port, None, 1 if args.smoke else 10)
    result.update(
        keys=args.keys,
        threads=threads,
        threads_empty=threads_empty,
        refill_threads=args.refill_threads,
        rss_mb=round(rss_used / 2**20, 1),
        rss_empty_mb=round(rss_empty / 2**20, 1),
        idle_key_bytes=round((rss_idle - rss_empty) / max(args.keys, 1)),
        used_key_bytes=round((rss_used - rss_empty) / max(args.keys, 1)),
        first_id_ms_p99=round(p99(first), 2),
        first_id_ms_p50=round(statistics.median(first), 2),
        floor_ms_p99=round(p99(floor), 2),
        first_id_ratio=round(p99(first) / p99(floor), 2),
        metrics_ms=round(metrics_ms, 1),
        metrics_bytes=metrics_bytes,
        stats_ms=round(stats_ms, 1),
        stats_bytes=stats_bytes,
        livez_ms_max=round(max(livez_metrics, livez_stats), 1),
        livez_ms_max_no_scrape=round(livez_idle, 1),
    )
    result["threads_ok"] = threads <= 16
    result["idle_key_bytes_ok"] = result["idle_key_bytes"] <= 2048
    emit(result, args.json)


if __name__ == "__main__":
    main()
