"""The server under wrk, against a bare granian RSGI app measured in the same run.

    python bench/http.py --json      (http.py runs this file)

Figures (wrk over keep-alive, 64 connections, one wrk thread: one core for wrk, one for the server;
with taskset and two CPUs or more, wrk is pinned to the first and the servers to the last):
  single_rps        GET /api/segment/get/{key}: one id per request
  floor_rps         a bare granian RSGI app answering a counter, same wrk and granian settings
                    (one worker, HTTP/1.1, uvloop)
  ratio             single_rps / floor_rps
  single_p99_ms     99th percentile latency of the single-id route
  tinyid_rps        GET /tinyid/id/nextIdSimple?bizType={key}: one id per request (tinyid's
                    client token as token=, with --client-token)
  tinyid_json_rps   GET /tinyid/id/nextId?bizType={key}: the same as tinyid's JSON
  cosid_rps         GET /ids/{key}: CosId proxy's one id
  *_ratio           each of those / single_rps, all on the same key, taken in the same rounds
  *_round_ratio     the median over the rounds of each round's rate / single's in that round
  *_cpu_us          CPU the server's processes (or the floor's) used per request, least of the
                    rounds: on a busy machine it moves less than the rates
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
import statistics
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
    """A server process for the length of the block, stopped however the block ends, and
    by a watchdog if this process is killed first (the server has a session of its own, so
    killing the bench's process group left it running for good)."""
    tests = str(BENCH.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from servers import _Watchdog

    proc = subprocess.Popen(
        [*SERVER_CPU, *args],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    watchdog = None
    try:
        watchdog = _Watchdog(proc.pid, None)
        wait_up(url, proc)
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if watchdog is not None:
            watchdog.disarm()


def cpus() -> tuple[list[str], list[str]]:
    """The taskset prefixes for the load generator and for the servers: one CPU each, so the
    two never take turns on one core (nothing, without taskset or a second CPU)."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2 or shutil.which("taskset") is None:
        return [], []
    return ["taskset", "-c", str(mine[0])], ["taskset", "-c", str(mine[-1])]


LOAD_CPU, SERVER_CPU = cpus()


def group_cpu(pgid: int) -> float:
    """CPU seconds the processes of a process group (a server and its workers) used so far."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:  # pgrp; then utime and stime, in clock ticks
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def wrk(
    url: str, seconds: int, connections: int, headers: tuple[str, ...] = (), server: int = 0
) -> dict[str, float]:
    """Requests/s and p99 latency (ms) from one wrk run; with the `server`'s process group,
    also the CPU it used per request (us), which a busy machine changes less than the rate."""
    args = [f"-H{header}" for header in headers]
    cpu = group_cpu(server) if server else 0.0
    out = subprocess.run(
        [*LOAD_CPU, "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", *args, url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    value, unit = re.search(r"\s99%\s+([\d.]+)(us|ms|s)", out).groups()  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise SystemExit(f"wrk saw {errors.group(1)} error responses from {url}")
    run = {"rps": rps, "p99_ms": float(value) * UNITS[unit]}
    if server:
        requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
        run["cpu_us"] = (group_cpu(server) - cpu) * 1e6 / requests
    return run


def client_rate(url: str, n: int, token: str | None) -> float:
    with idmint.Client(url, token=token) as client:
        gen = client.segment("bench")
        gen.next_ids(10_000)  # the first ranges, the step growing
        next_id = gen.next_id
        started = time.perf_counter()
        for _ in range(n):
            next_id()
        return n / (time.perf_counter() - started)


def main() -> None:
    # report.py, from this folder: appended, so that the standard library's http stays first
    # (bench/http.py, which runs this file, took the folder off the path for that).
    sys.path.append(str(BENCH))
    from report import apply_smoke, smoke_option

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seconds", type=int, default=8, help="length of each wrk run")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="best of N for server and floor")
    parser.add_argument("--client-ids", type=int, default=3_000_000)
    parser.add_argument(
        "--client-token",
        default="",
        help="serve with this client token: wrk sends it as each route's clients do",
    )
    smoke_option(parser)
    args = parser.parse_args()
    apply_smoke(args, seconds=1, rounds=1, client_ids=10_000, connections=8)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install wrk")

    result: dict[str, Any] = {
        "bench": "http",
        "python": sys.version.split()[0],
        "connections": args.connections,
        "seconds": args.seconds,
        # wrk's CPU and the servers', as taskset names them ("" when not pinned)
        "pinned": f"wrk {LOAD_CPU[-1]}, servers {SERVER_CPU[-1]}" if LOAD_CPU else "",
        "client_token": bool(args.client_token),
    }
    token = args.client_token
    bearer = (f"Authorization: Bearer {token}",) if token else ()
    # Each route as its own clients send the token: Leaf's and CosId's (and idmint's) a
    # bearer header, tinyid's a query parameter.
    tinyid_token = f"&token={token}" if token else ""
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
            served = stack.enter_context(
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
                        *(["--client-token", token] if token else []),
                    ],
                    url + "/livez",
                )
            )
            floor = stack.enter_context(
                running(
                    [sys.executable, "-m", "granian", *floor_args],
                    f"http://127.0.0.1:{floor_port}/",
                    BENCH / "floor",
                )
            )
            # One key for all: the routes differ in their wire formats only.
            routes = {
                "single": (url + "/api/segment/get/bench", bearer, served.pid),
                "tinyid": (
                    url + f"/tinyid/id/nextIdSimple?bizType=bench{tinyid_token}",
                    (),
                    served.pid,
                ),
                "tinyid_json": (
                    url + f"/tinyid/id/nextId?bizType=bench{tinyid_token}",
                    (),
                    served.pid,
                ),
                "cosid": (url + "/ids/bench", bearer, served.pid),
                "floor": (f"http://127.0.0.1:{floor_port}/", (), floor.pid),
            }
            wrk(routes["single"][0], min(2, args.seconds), args.connections, bearer)  # warm up
            best = {name: {"rps": 0.0, "p99_ms": 0.0} for name in routes}
            cpu_us = dict.fromkeys(routes, float("inf"))
            rates: dict[str, list[float]] = {name: [] for name in routes}
            for _ in range(args.rounds):  # interleaved, so all see the same machine
                for name, (target, headers, pgid) in routes.items():
                    run = wrk(target, args.seconds, args.connections, headers, pgid)
                    best[name] = max(best[name], run, key=lambda r: r["rps"])
                    cpu_us[name] = min(cpu_us[name], run["cpu_us"])
                    rates[name].append(run["rps"])
            single, floor_run = best["single"], best["floor"]
            batch = wrk(
                url + "/v1/keys/bench/ids?count=1000", args.seconds, args.connections, bearer
            )
            result |= {
                "single_rps": round(single["rps"]),
                "floor_rps": round(floor_run["rps"]),
                "ratio": round(single["rps"] / floor_run["rps"], 3),
                "single_p99_ms": single["p99_ms"],
                "floor_p99_ms": floor_run["p99_ms"],
                "single_cpu_us": round(cpu_us["single"], 2),
                "floor_cpu_us": round(cpu_us["floor"], 2),
            }
            for name in ("tinyid", "tinyid_json", "cosid"):
                result |= {
                    f"{name}_rps": round(best[name]["rps"]),
                    f"{name}_ratio": round(best[name]["rps"] / single["rps"], 3),
                    # Each round's against the Leaf route's of the same round: load that comes
                    # and goes between rounds cancels out.
                    f"{name}_round_ratio": round(
                        statistics.median(
                            mine / leaf
                            for mine, leaf in zip(rates[name], rates["single"], strict=True)
                        ),
                        3,
                    ),
                    f"{name}_p99_ms": best[name]["p99_ms"],
                    f"{name}_cpu_us": round(cpu_us[name], 2),
                }
            result |= {
                "batch_rps": round(batch["rps"]),
                "batch_ids_per_s": round(batch["rps"] * 1000),
                "batch_p99_ms": batch["p99_ms"],
                "client_ids_per_s": round(client_rate(url, args.client_ids, token or None)),
            }
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in result.items():
            print(f"{name:20} {value}")


if __name__ == "__main__":
    main()
