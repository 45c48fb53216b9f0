"""Quorum keys (antirez's algorithm) on five Redis nodes, side by side with pottery's NextID.

    python bench/quorum.py --json
    python bench/quorum.py --json --seconds 20 --batch 1000
    python bench/quorum.py --json --smoke      # every phase 0.3 s, checks on (CI)

Starts five Redis servers from /usr/bin/redis-server with `appendonly yes` and `appendfsync
always` (tests/server_redis.py), each on a loopback address of its own, and measures, each for
--seconds:

  fsync_floor_ops_per_s   one client's INCR on one such node: the fsync-bound floor
  pottery_ids_per_s       PyPI pottery's NextID on the five nodes, one client
  pottery8_ids_per_s      the same from 8 threads sharing one NextID (and its errors)
  single_ids_per_s        ours, one client, one id per round
  ratio_vs_pottery        single_ids_per_s / pottery_ids_per_s
  clients8_ids_per_s      ours, --clients (8) client processes, each its own generator: direct,
                          no server (clients: how many)
  clients8_vs_single      clients8_ids_per_s / single_ids_per_s (contention's cost: >= 1.0)
  clients8_seconds_vs_single  [slowest, fastest] whole second of that phase, as ids / the single
                          phase's ids per second: eight clients' rounds switch, within a run,
                          between a state where most rounds win at once and one where most
                          need a second step or lose (docs/benchmarks.md)
  clients8_density        the ids they got / the numbers from their lowest id to their highest:
                          what contention's skips ahead spent (1.0: none; below 0.5 fails)
  own_keys8_vs_single     the same processes, each on a key of its own (no contention): what the
                          machine and the nodes allow, the ceiling clients8_vs_single is held
                          under by one key's rounds winning one at a time
  group_ids_per_s         8 caller processes through `idmint serve --quorum` (group commit),
                          each request --batch ids (a range) of quorum key "group",
                          which the bench makes in the server's store first
  violations              repeated ids and real-time order violations the harness's checks
                          found in every phase of ours (each call recorded: start, end, ids)
  smoke, seconds_total    whether --smoke ran, and the run's seconds, set-up included
  failed                  the checks that failed (empty: all passed; else the exit code is 1):
                          violations, errors in a phase of ours, a phase of ours with no ids,
                          clients8_density below 0.5

A phase whose processes die or hang stops the bench at once, with their error. --smoke makes
every phase 0.3 s, with 2 clients and 2 callers: its figures mean nothing, its checks hold.

Needs the dev extra (pottery) and redis-server.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from queue import Empty
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
Call = tuple[float, float, int, int]  # start, end (monotonic), first id, last id


def _timed(
    seconds: float, call: Callable[[], tuple[int, int]], start: Any = None
) -> tuple[list[Call], int]:
    """Call `call` for `seconds`: its recorded calls and its errors. With `start` (a phase's
    barrier), once every process of the phase is ready: a process still importing and
    connecting took CPU from those already timed (the first second of eight clients ran at
    about half the rate of the others)."""
    if start is not None:
        start.wait(SLACK)
    calls: list[Call] = []
    errors = 0
    until = time.monotonic() + seconds
    while (t0 := time.monotonic()) < until:
        try:
            first, last = call()
        except Exception:
            errors += 1
            continue
        calls.append((t0, time.monotonic(), first, last))
    return calls, errors


def violations(calls: list[Call]) -> int:
    """Ids handed out twice, plus pairs where a call that began after another ended got ids
    not above all of the other's: the harness's checks, on ranges. O(n log n)."""
    spans = sorted((c[2], c[3]) for c in calls)
    repeats = sum(1 for a, b in itertools.pairwise(spans) if b[0] <= a[1])
    ended = sorted(calls, key=lambda c: c[1])
    late = 0
    highest, i = 0, 0
    for call in sorted(calls, key=lambda c: c[0]):
        while i < len(ended) and ended[i][1] < call[0]:
            highest = max(highest, ended[i][3])
            i += 1
        late += call[2] <= highest
    return repeats + late


def density(calls: list[Call]) -> float:
    """Ids handed out / the numbers from the lowest to the highest (1.0 when no id was
    skipped; 0.0 for no calls)."""
    if not calls:
        return 0.0
    span = max(c[3] for c in calls) - min(c[2] for c in calls) + 1
    return sum(c[3] - c[2] + 1 for c in calls) / span


def seconds_range(calls: list[Call], seconds: float) -> tuple[int, int]:
    """The fewest and the most ids that calls ending in one whole second of the phase got
    (seconds counted from its first call's start; (0, 0) for a phase under a second)."""
    if not calls or seconds < 1:
        return 0, 0
    began = min(c[0] for c in calls)
    per_second = [0] * int(seconds)
    for call in calls:
        second = int(call[1] - began)
        if second < len(per_second):
            per_second[second] += call[3] - call[2] + 1
    return min(per_second), max(per_second)


def _generator_client(urls: list[str], own_key: bool, seconds: float, start: Any, out: Any) -> None:
    """One direct client's calls: on the phase's shared key, or on a key of its own."""
    import os

    from idmint import open_quorum

    gen = open_quorum(f"own{os.getpid()}" if own_key else "clients8", urls)
    gen.next_id()  # connected, checked
    out.put(_timed(seconds, lambda: (i := gen.next_id(), i), start))
    gen.close()


def _http_caller(port: int, path: str, batch: int, seconds: float, start: Any, out: Any) -> None:
    # A kept-alive socket and a request made once: the callers share two cores with the
    # server and the nodes, so what they spend per request is taken from the server. A
    # caller's CPU per request: httpx about 1 ms (71,000 ids/s), http.client about 300 µs,
    # this about 110 µs (issue 31, on a busy machine).
    import json
    import socket

    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = f"GET {path}?count={batch} HTTP/1.1\r\nHost: bench\r\n\r\n".encode()
    pending = b""

    def call() -> tuple[int, int]:
        nonlocal pending
        sock.sendall(request)
        data = pending
        while (head_end := data.find(b"\r\n\r\n")) < 0:
            data += _received(sock)
        head = data[:head_end].lower()
        length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        body_end = head_end + 4 + length
        while len(data) < body_end:
            data += _received(sock)
        body, pending = json.loads(data[head_end + 4 : body_end]), data[body_end:]
        if not head.startswith(b"http/1.1 200"):
            raise RuntimeError(body)
        return body["start"], body["stop"] - 1

    call()
    out.put(_timed(seconds, call, start))
    sock.close()


def _received(sock: Any) -> bytes:
    chunk: bytes = sock.recv(65536)
    if not chunk:
        raise ConnectionError("the server closed the connection")
    return chunk


def _child(target: Callable[..., None], args: tuple[Any, ...], start: Any, out: Any) -> None:
    """`target(*args, start, out)`; if it raises, its error is put instead, for the parent to
    stop at once (its traceback is printed here too)."""
    try:
        target(*args, start, out)
    except BaseException as exc:
        out.put(f"{target.__name__}: {type(exc).__name__}: {exc}")
        raise


#: Seconds a phase's processes may take beyond its --seconds: to start (spawn, imports,
#: connecting, the first call) and to hand in their calls.
SLACK = 60.0


def _processes(target: Callable[..., None], args: tuple[Any, ...], count: int) -> list[Any]:
    """Run `target(*args, barrier, queue)` in `count` processes at once (`args` end with the
    phase's seconds; each times its calls once all have passed the barrier); what each put.
    Fails at once, with the first error, when one dies: waiting for the results of callers
    that died on their first request had hung the bench for 300 s."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    start = context.Barrier(count)
    procs = [
        context.Process(target=_child, args=(target, args, start, queue)) for _ in range(count)
    ]
    for p in procs:
        p.start()
    results: list[Any] = []
    give_up = time.monotonic() + args[-1] + SLACK
    try:
        while len(results) < count:
            try:
                got = queue.get(timeout=0.5)
            except Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                late = time.monotonic() > give_up
                if not (dead or late):
                    continue
                try:  # a process that failed put its error on its way out
                    got = queue.get(timeout=2)
                except Empty:  # killed by a signal, or hung
                    raise SystemExit(
                        f"bench: {target.__name__}: "
                        + (f"died (exit codes {dead})" if dead else "hung")
                        + f"; {len(results)} of {count} processes handed in their calls"
                    ) from None
            if isinstance(got, str):
                raise SystemExit(f"bench: a phase's process failed: {got}")
            results.append(got)
    finally:
        for p in procs:
            p.join(5 if len(results) == count else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return results


@contextlib.contextmanager
def redis_nodes(count: int) -> Iterator[list[Any]]:
    from server_redis import RedisServer
    from servers import running

    with running([RedisServer(host=f"127.0.0.{21 + i}") for i in range(count)]) as servers:
        yield list(servers)


def group_commit(urls: list[str], args: argparse.Namespace, result: dict[str, Any]) -> list[Call]:
    """The group-commit phase: --callers processes asking quorum key "group" for --batch ids
    a request through one `idmint serve --quorum`; its figures go in `result`."""
    import idmint

    from http_bench import free_port, running

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{tmp}/s.db"
        with idmint.connect(store) as admin:  # a server serves only quorum keys an admin made
            admin.add_quorum_key("group")
        serve = [sys.executable, "-m", "idmint", "--store", store]
        serve += ["serve", "--port", str(port), "--quorum", ",".join(urls)]
        with running(serve, f"http://127.0.0.1:{port}/livez"):
            path = "/v1/quorum/group/ids"
            seconds = args.seconds
            callers = _processes(_http_caller, (port, path, args.batch, seconds), args.callers)
    group = [c for calls, _ in callers for c in calls]
    result["group_ids_per_s"] = round(sum(c[3] - c[2] + 1 for c in group) / seconds)
    result["group_requests_per_s"] = round(len(group) / seconds)
    result["group_batch"] = args.batch
    result["group_callers"] = args.callers
    result["group_errors"] = sum(e for _, e in callers)
    return group


def checks(result: dict[str, Any]) -> list[str]:
    """The checks that failed: what must hold however short or busy the run."""
    failed = [] if result["violations"] == 0 else ["violations"]
    if result["clients8_density"] < 0.5:
        failed.append("clients8_density")
    for phase in ("single", "clients8", "group"):
        if result[f"{phase}_errors"]:
            failed.append(f"{phase}_errors")
        if not result[f"{phase}_ids_per_s"]:
            failed.append(f"{phase}_ids_per_s")
    return failed


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import redis
    from pottery import NextID

    from idmint import open_quorum

    began = time.monotonic()
    seconds = args.seconds
    result: dict[str, Any] = {"nodes": args.nodes, "seconds": seconds}
    with redis_nodes(args.nodes) as servers:
        urls = [s.store_url("bench") for s in servers]
        clients = [redis.Redis(host=s.host, port=s.port) for s in servers]

        floor, _ = _timed(seconds, lambda: (int(clients[0].incr("floor")), 0))
        result["fsync_floor_ops_per_s"] = round(len(floor) / seconds)

        pottery = NextID(key="pottery", masters=set(clients))
        got, errors = _timed(seconds, lambda: (next(pottery), 0))
        result["pottery_ids_per_s"] = round(len(got) / seconds)
        result["pottery_errors"] = errors

        counts = [0, 0]
        lock = threading.Lock()

        def pottery_thread() -> None:
            got, errors = _timed(seconds, lambda: (next(pottery), 0))
            with lock:
                counts[0] += len(got)
                counts[1] += errors

        threads = [threading.Thread(target=pottery_thread) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        result["pottery8_ids_per_s"] = round(counts[0] / seconds)
        result["pottery8_errors"] = counts[1]

        ours = open_quorum("single", urls)
        ours.next_id()
        single, errors = _timed(seconds, lambda: (i := ours.next_id(), i))
        ours.close()
        result["single_ids_per_s"] = round(len(single) / seconds)
        result["single_errors"] = errors
        result["ratio_vs_pottery"] = round(len(single) / max(1, len(got)), 2)

        eight = _processes(_generator_client, (urls, False, seconds), args.clients)
        result["clients"] = args.clients
        calls8 = [c for calls, _ in eight for c in calls]
        result["clients8_ids_per_s"] = round(len(calls8) / seconds)
        result["clients8_errors"] = sum(e for _, e in eight)
        result["clients8_vs_single"] = round(len(calls8) / max(1, len(single)), 2)
        result["clients8_density"] = round(density(calls8), 3)
        per_second = len(single) / seconds
        result["clients8_seconds_vs_single"] = [
            round(n / max(1.0, per_second), 2) for n in seconds_range(calls8, seconds)
        ]
        own = _processes(_generator_client, (urls, True, seconds), args.clients)
        own_ids = sum(len(calls) for calls, _ in own)
        result["own_keys8_vs_single"] = round(own_ids / max(1, len(single)), 2)

        group = group_commit(urls, args, result)
        result["violations"] = violations(single) + violations(calls8) + violations(group)
        for c in clients:
            c.close()
    result["smoke"] = args.smoke
    result["seconds_total"] = round(time.monotonic() - began, 1)
    result["failed"] = checks(result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--batch", type=int, default=100, help="ids per group-commit request")
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8, help="direct client processes")
    from report import apply_smoke, emit, smoke_option  # here: spawned callers re-import this

    smoke_option(parser)
    args = parser.parse_args()
    # Fewer processes too: starting them (spawn, imports) is most of a short run's time.
    apply_smoke(args, seconds=0.3, clients=2, callers=2)
    sys.path.insert(0, str(ROOT / "tests"))
    result = measure(args)
    emit(result, args.json)
    sys.exit(1 if result["failed"] else 0)


if __name__ == "__main__":
    main()
