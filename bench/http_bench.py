"""The server under wrk, against a bare granian RSGI app measured in the same run.

    python bench/http.py --json      (http.py runs this file)

Figures (wrk over keep-alive, 64 connections, one wrk thread: one core for wrk, one for the server):
  single_rps        GET /api/segment/get/{key}: one id per request
  floor_rps         a bare granian RSGI app answering a counter, same wrk and granian settings
                    (one worker, HTTP/1.1, uvloop)
  ratio             single_rps / floor_rps
  single_p99_ms     99th percentile latency of the single-id route
  batch_ids_per_s   GET /v1/keys/{key}/ids?count=1000, requests/s x 1000
  client_ids_per_s  Client.segment().next_id() in one thread, ranges from the server
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

import idmint

BENCH = Path(__file__).resolve().parent
UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise SystemExit(f"{url} did not come up")


@contextlib.contextmanager
def running(
    args: list[str], url: str, cwd: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A server process for the length of the block, stopped however the block ends."""
    proc = subprocess.Popen(
        args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_up(url, proc)
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wrk(url: str, seconds: int, connections: int) -> dict[str, float]:
    """Requests/s and p99 latency (ms) from one wrk run."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    value, unit = re.search(r"\s99%\s+([\d.]+)(us|ms|s)", out).groups()  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise SystemExit(f"wrk saw {errors.group(1)} error responses from {url}")
    return {"rps": rps, "p99_ms": float(value) * UNITS[unit]}


def client_rate(url: str, n: int) -> float:
    with idmint.Client(url) as client:
        gen = client.segment("bench")
        gen.next_ids(10_000)  # the first ranges, the step growing
        next_id = gen.next_id
        started = time.perf_counter()
        for _ in range(n):
            next_id()
        return n / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seconds", type=int, default=8, help="length of each wrk run")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="best of N for server and floor")
    parser.add_argument("--client-ids", type=int, default=3_000_000)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install wrk")

    result: dict[str, Any] = {
        "bench": "http",
        "python": sys.version.split()[0],
        "connections": args.connections,
        "seconds": args.seconds,
    }
    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{Path(tmp) / 'bench.db'}"
        with idmint.connect(store) as minter:
            minter.add_key("bench", step=1000)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        floor_port = free_port()
        floor_args = [
            "--interface",
            "rsgi",
            "--host",
            "127.0.0.1",
            "--port",
            str(floor_port),
            "--workers",
            "1",
            "--http",
            "1",
            "--no-log",
            "floor_app:app",
        ]
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                running(
                    [
                        sys.executable,
                        "-m",
                        "idmint",
                        "--store",
                        store,
                        "serve",
                        "--port",
                        str(port),
                        "--http",
                        "1",
                    ],
                    url + "/livez",
                )
            )
            stack.enter_context(
                running(
                    [sys.executable, "-m", "granian", *floor_args],
                    f"http://127.0.0.1:{floor_port}/",
                    BENCH / "floor",
                )
            )
            single_url = url + "/api/segment/get/bench"
            wrk(single_url, 2, args.connections)  # warm up: first ranges, step growth
            single: dict[str, float] = {"rps": 0.0, "p99_ms": 0.0}
            floor_run: dict[str, float] = {"rps": 0.0}
            for _ in range(args.rounds):  # interleaved, so both see the same machine
                run = wrk(single_url, args.seconds, args.connections)
                if run["rps"] > single["rps"]:
                    single = run
                floor_run = max(
                    floor_run,
                    wrk(f"http://127.0.0.1:{floor_port}/", args.seconds, args.connections),
                    key=lambda r: r["rps"],
                )
            batch = wrk(url + "/v1/keys/bench/ids?count=1000", args.seconds, args.connections)
            result |= {
                "single_rps": round(single["rps"]),
                "floor_rps": round(floor_run["rps"]),
                "ratio": round(single["rps"] / floor_run["rps"], 3),
                "single_p99_ms": single["p99_ms"],
                "floor_p99_ms": floor_run["p99_ms"],
                "batch_rps": round(batch["rps"]),
                "batch_ids_per_s": round(batch["rps"] * 1000),
                "batch_p99_ms": batch["p99_ms"],
                "client_ids_per_s": round(client_rate(url, args.client_ids)),
            }
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in result.items():
            print(f"{name:20} {value}")


if __name__ == "__main__":
    main()
