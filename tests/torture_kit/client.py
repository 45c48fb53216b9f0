"""One client process of a torture run: takes ids of one key, one way, until stopped, and
records every call.

    python tests/torture/client.py SPEC_JSON

SPEC (a JSON object): `via` lib | http | client | cli; `kind` segment | take (a range
straight from the store each call) | snowflake | datacenter | quorum; `url` the store; `key`;
`batch`; for http, client: `server` (an `idmint serve` base URL); datacenter: `dc`,
`dc_store`; quorum: `nodes`, `unsafe`; snowflake: `worker_id` (a static id; default leased),
`state` (its state file).

Each call is one line, flushed at once, so that a kill -9 loses at most the line being
written (and never records an id that was not handed out):

    R t0 t1 start stop stride     ids range(start, stop, stride), from one call
    E t0 t1 ErrorName             a call that failed

t0 and t1 are the call's start and end on the monotonic clock, which every process of the
machine shares (libfaketime leaves it alone: the clock-step fault moves the wall clock only).
A call's ids may take several R lines (a snowflake batch is not one run); a call that handed
out ids and then failed is not possible: each way hands out all of a call's ids or none.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, SupportsIndex

if "FAKETIME_TIMESTAMP_FILE" in os.environ:
    # libfaketime makes time.sleep fail with EINVAL once the wall clock is stepped back
    # (Python's absolute clock_nanosleep), which killed kazoo's connection thread (its retry
    # sleeps so) and left the ZooKeeper session dead for good: a harness artefact, not a
    # clock a real host has. Before anything imports time.sleep by name.
    def _sleep(seconds: float | SupportsIndex) -> None:
        select.select([], [], [], max(float(seconds), 0.0))

    time.sleep = _sleep

import httpx

import idmint
from idmint import IdmintError, QuorumOptions, SegmentOptions

#: Seconds a call waits for a range before it fails (the harness measures outages with it).
WAIT = 2.0
PAUSE = 0.002


def runs(ids: Iterable[int]) -> list[tuple[int, int, int]]:
    """(start, stop, 1) runs of consecutive ids, in the order given."""
    found: list[tuple[int, int, int]] = []
    for i in ids:
        if found and found[-1][1] == i:
            start, _, _ = found[-1]
            found[-1] = (start, i + 1, 1)
        else:
            found.append((i, i + 1, 1))
    return found


def _taker(spec: dict[str, Any]) -> tuple[Callable[[], list[tuple[int, int, int]]], Any]:
    """The call this client repeats (returning its ids as runs), and what to close after."""
    via, kind, key, batch = spec["via"], spec["kind"], spec["key"], spec["batch"]
    if via == "lib":
        minter = idmint.connect(
            spec["url"],
            segment_options=SegmentOptions(wait=WAIT),
            dc=spec.get("dc"),
            dc_store=spec.get("dc_store"),
        )
        if kind == "segment":
            gen = minter.segment(key)
            return lambda: runs(gen.next_ids(batch)), minter
        if kind == "take":  # straight from the store: every call is a store write
            return lambda: [_range(minter.take(key, batch))], minter
        if kind == "datacenter":
            dc_gen = minter.datacenter(key, spec["dc"], dc_store=spec.get("dc_store"))
            return lambda: runs(dc_gen.next_ids(batch)), minter
        if kind == "quorum":
            unsafe = QuorumOptions(unsafe=spec.get("unsafe", False))  # the negative control
            quorum = minter.quorum(key, spec["nodes"], unsafe)
            return lambda: [_range(quorum.take(batch))], minter
        if kind == "snowflake":
            flake = minter.snowflake(
                "twitter", worker_id=spec.get("worker_id"), state=spec.get("state")
            )
            return lambda: runs(flake.next_ids(batch)), minter
    if via == "client":
        client = idmint.Client(spec["server"], timeout=WAIT)
        if kind in ("segment", "datacenter"):  # a server with --dc: the same routes
            remote = client.segment(key)
            return lambda: runs(remote.next_ids(batch)), client
    if via == "http":
        http = httpx.Client(base_url=spec["server"], timeout=WAIT)
        path = {
            "segment": f"/v1/keys/{key}/ids",
            "datacenter": f"/v1/keys/{key}/ids",  # a server with --dc serves them there
            "quorum": f"/v1/quorum/{key}/ids",
            "snowflake": "/v1/snowflake/ids",
        }[kind]

        def over_http() -> list[tuple[int, int, int]]:
            answer = http.get(path, params={"count": batch})
            if answer.status_code != 200:
                raise HttpStatus(answer.status_code)
            body = answer.json()
            if "ids" in body:
                return runs(body["ids"])
            return [(body["start"], body["stop"], 1)]

        return over_http, http
    if via == "cli":
        command = [sys.executable, "-m", "idmint", "--store", spec["url"], "next", key]

        def over_cli() -> list[tuple[int, int, int]]:
            try:
                done = subprocess.run(
                    [*command, "-n", str(batch)], capture_output=True, text=True, timeout=30
                )
            except subprocess.TimeoutExpired:  # a failed call (its ids, if any, burnt), not
                raise CliFailed(["timed out"]) from None  # the end of this client
            if done.returncode != 0:
                raise CliFailed(done.stderr.strip().splitlines()[-1:] or [""])
            return runs(int(line) for line in done.stdout.split())

        return over_cli, None
    raise SystemExit(f"no {kind} keys by {via}")


def _range(ids: Any) -> tuple[int, int, int]:
    return ids.start, ids.stop, ids.stride


class HttpStatus(Exception):
    """An answer other than 200 (its status is the error's name in the record)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.name = f"HTTP{status}"


class CliFailed(Exception):
    name = "CliFailed"


def _nap(seconds: float) -> None:
    """time.sleep, but one libfaketime lets through: with the wall clock stepped back, its
    clock_nanosleep fails with EINVAL (select's timeout is relative, and works)."""
    select.select([], [], [], seconds)


def _error_name(exc: BaseException) -> str:
    return getattr(exc, "name", None) or type(exc).__name__


def main() -> None:
    spec = json.loads(sys.argv[1])
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    out = sys.stdout
    while True:  # a store down at start: the first call fails (recorded) until it answers
        t0 = time.monotonic()
        try:
            take, closing = _taker(spec)
            break
        except (IdmintError, OSError) as exc:
            out.write(f"E {t0:.6f} {time.monotonic():.6f} {_error_name(exc)}\n")
            out.flush()
            _nap(0.2)
            if stopping:
                return
    # Seconds between calls: a client flat out makes 100,000 calls a second, which the
    # checker would read for minutes; paced, a run's ids still run into the millions.
    pause = spec.get("pause", PAUSE)
    try:
        while not stopping:
            t0 = time.monotonic()
            try:
                got = take()
            except (IdmintError, httpx.HTTPError, HttpStatus, CliFailed, OSError) as exc:
                out.write(f"E {t0:.6f} {time.monotonic():.6f} {_error_name(exc)}\n")
                out.flush()
                _nap(0.05)
                continue
            t1 = time.monotonic()
            out.write("".join(f"R {t0:.6f} {t1:.6f} {a} {b} {s}\n" for a, b, s in got))
            out.flush()
            if pause:
                _nap(pause)
    finally:
        if closing is not None:
            closing.close()


if __name__ == "__main__":
    main()
