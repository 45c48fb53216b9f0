"""One torture run: a set-up, its clients and servers, the nemesis for `seconds`, then the
checker over every record, and a summary (the JSON of bench/torture.py) with a picture.

    summary = torture("redis-replica", seed=7, seconds=30)

A run fails (summary["verdict"] == "fail") when the checker finds a safety problem, when a
client did not serve again within RECOVERY seconds once the faults were over, or when the
nemesis could not do or undo a fault. Outages are measured against the set-up's bounds and
reported (summary["outages"]), with those over their bound counted in `over_bound`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from .checker import Call, check, longest_gap, parse, repeated_ids
from .nemesis import Nemesis, Targets, pause_group
from .setups import SETUPS, Setup
from harness import Clock, heal_all
from http_server import ServerProcess

CLIENT = str(Path(__file__).with_name("client.py"))
#: Seconds every client has to hand out its first ids, and to serve again after the faults.
STARTUP, RECOVERY = 90.0, 60.0
#: Seconds a negative control's clients have, once its faults are over, to hand out again what
#: the unsafe setting lost: on a loaded machine a failover late in a short run ends with it.
CONTROL_TAIL = 15.0
#: Seconds after a fault ends that its outage is still counted.
GRACE = 5.0
#: The largest batch a scaled client asks for (idmint serve's MAX_IDS per call).
MAX_BATCH = 100_000


class Client:
    """A client process (tests/torture/client.py), restartable: each start is an incarnation
    with a record file of its own."""

    def __init__(self, name: str, spec: dict[str, Any], workdir: Path, clock: Clock | None):
        self.name, self.spec, self.workdir, self.clock = name, spec, workdir, clock
        self.incarnation = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def _path(self, n: int) -> Path:
        return self.workdir / f"{self.name}.{n}.out"

    def start(self) -> None:
        self.incarnation += 1
        env = {**os.environ, **(self.clock.env() if self.clock else {})}
        with self._path(self.incarnation).open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, CLIENT, json.dumps(self.spec)],
                stdout=out,
                stderr=(self.workdir / f"{self.name}.err").open("ab"),
                env=env,
            )

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def kill9(self) -> None:
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM: it ends its call, gives back what it holds and exits; else kill -9."""
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()

    def calls(self) -> list[Call]:
        key = self.spec["key"]
        return [
            call
            for n in range(1, self.incarnation + 1)
            for call in parse(f"{self.name}#{n}", key, self._path(n).read_text(errors="replace"))
        ]

    def served(self) -> int:
        """Calls that handed out ids, in this incarnation's record so far."""
        data = self._path(self.incarnation).read_bytes()
        return data.count(b"\nR ") + data.startswith(b"R ")


class Server:
    """An `idmint serve` process as the nemesis sees it: kill -9 and start on the same port,
    SIGSTOP and SIGCONT of its process group."""

    def __init__(self, name: str, process: ServerProcess) -> None:
        self.name, self.process = name, process

    def kill9(self) -> None:
        self.process.kill()

    def start(self) -> None:
        self.process.start(timeout=60)

    def pause(self) -> None:
        if self.process.proc is not None:
            pause_group(self.process.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process.proc is not None:
            pause_group(self.process.proc.pid, signal.SIGCONT)


def torture(
    setup_name: str,
    seed: int,
    seconds: float,
    *,
    unsafe: bool = False,
    workdir: Path | None = None,
    batch_scale: int = 1,
) -> dict[str, Any]:
    """Run the set-up under the seed's faults for `seconds`; the summary (see the module).
    `batch_scale` multiplies every client's batch: long runs reach millions of ids while
    the calls (and the checker's work per call) stay as many."""
    rng = random.Random(seed)
    heal_all()
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="torture-")))
        setup = stack.enter_context(SETUPS[setup_name](workdir, unsafe))
        servers, clients = _start(setup, workdir, stack, batch_scale)
        targets = Targets(
            {c.name: c for c in clients},
            servers,
            {c.name: c.clock for c in clients if c.clock is not None},
            {
                name: [c.name for c in clients if c.spec.get("server_name") == name]
                for name in servers
            },
            lambda: _highest(clients, setup),
        )
        problems = _wait_serving(clients, STARTUP, "to hand out its first ids")
        began = time.monotonic()
        nemesis = Nemesis(rng, setup, targets, unsafe)
        if not problems:
            nemesis.run(began + seconds)
            problems += [f"the nemesis failed: {e}" for e in nemesis.errors]
            if unsafe:  # its clients may stop for good (CounterWentBack): no wait for each
                _wait_for_repeats(clients, CONTROL_TAIL)
            else:
                problems += _wait_serving(clients, RECOVERY, "to serve again after the faults")
        ended = time.monotonic()
        for client in clients:
            client.stop()
        calls = [call for client in clients for call in client.calls()]
    return _summary(setup, seed, seconds, unsafe, calls, nemesis, problems, began, ended)


def _start(
    setup: Setup, workdir: Path, stack: contextlib.ExitStack, batch_scale: int = 1
) -> tuple[dict[str, Server], list[Client]]:
    servers: dict[str, Server] = {}
    if any(spec["via"] in ("http", "client") for _, spec in setup.clients):
        for n in range(setup.servers):
            process = ServerProcess(setup.store, args=setup.serve_args)
            process.start(timeout=60)
            stack.callback(process.stop)
            servers[f"serve-{n}"] = Server(f"serve-{n}", process)
    clients = []
    for n, (name, spec) in enumerate(setup.clients):
        spec = {"url": setup.store, **spec}
        # capped at what one HTTP call may ask for (the server's MAX_IDS)
        spec["batch"] = min(spec["batch"] * batch_scale, max(spec["batch"], MAX_BATCH))
        if spec["via"] in ("http", "client"):
            server = list(servers.values())[n % len(servers)]
            spec |= {"server": server.process.url, "server_name": server.name}
        # Clock faults for the clients whose ids read the wall clock. (libfaketime also makes
        # time.sleep fail with EINVAL once the clock is stepped back: a harness artefact that
        # the others' back-off loops would trip over.)
        reads_clock = spec["via"] == "lib" and spec["kind"] == "snowflake"
        clock = Clock(workdir / f"{name}.clock") if reads_clock else None
        client = Client(name, spec, workdir, clock)
        stack.callback(client.kill9)
        clients.append(client)
    return servers, clients


def _highest(clients: list[Client], setup: Setup) -> dict[str, int]:
    """The highest id of each segment key handed out so far, from every record."""
    top: dict[str, int] = {}
    for client in clients:
        key = client.spec["key"]
        if setup.keys[key].kind == "segment":
            for call in client.calls():
                if call.error is None:
                    top[key] = max(top.get(key, 0), call.high)
    return top


def _wait_serving(clients: list[Client], timeout: float, what: str) -> list[str]:
    """Until every client has handed out ids since now (its current incarnation)."""
    before = {c.name: c.served() for c in clients}
    deadline = time.monotonic() + timeout
    waiting = list(clients)
    while waiting and time.monotonic() < deadline:
        time.sleep(0.2)
        waiting = [c for c in waiting if c.served() <= before[c.name] and c.proc is not None]
    return [f"client {c.name} did not manage {what} in {timeout:g} s" for c in waiting]


def _wait_for_repeats(clients: list[Client], timeout: float) -> None:
    """Until the records show an id handed out twice, or `timeout` seconds; the checker
    reports either way."""
    deadline = time.monotonic() + timeout
    while not repeated_ids([call for c in clients for call in c.calls()]):
        if time.monotonic() >= deadline:
            return
        time.sleep(0.5)


def _summary(
    setup: Setup,
    seed: int,
    seconds: float,
    unsafe: bool,
    calls: list[Call],
    nemesis: Nemesis,
    problems: list[str],
    began: float,
    ended: float,
) -> dict[str, Any]:
    keys = setup.keys
    increasing = {
        name
        for name, spec in setup.clients
        if spec["via"] == "lib" and keys[spec["key"]].increasing
    }
    verdict = check(
        calls,
        {k: (spec.first, spec.last) for k, spec in keys.items()},
        {k: spec.kind for k, spec in keys.items()},
        increasing,
        nemesis.clock_ahead(),
    )
    outages = []
    # The CLI starts a process a call (a second or more): its pace is no outage.
    slow = {name for name, spec in setup.clients if spec["via"] == "cli"}
    for fault in nemesis.log:
        overlapping = [
            f for f in nemesis.log if f.start <= fault.end + GRACE and f.end >= fault.start
        ]
        hit = {client for f in overlapping for client in f.hits}
        gap = longest_gap(calls, fault, GRACE, slow | hit)
        bound = setup.bounds.get(fault.kind)
        outages.append(
            {
                "kind": fault.kind,
                "target": fault.target,
                "start": round(fault.start - began, 3),
                "end": round(fault.end - began, 3),
                "longest_gap": round(gap, 3),
                "bound": bound,
                "ok": bound is None or gap <= bound,
            }
        )
    all_problems = problems + verdict.problems
    return {
        "setup": setup.name,
        "seed": seed,
        "seconds": seconds,
        "unsafe": unsafe,
        "unsafe_what": setup.unsafe_what,
        "verdict": "fail" if all_problems else "ok",
        "problems": all_problems,
        "ids": verdict.ids,
        "ids_by_key": verdict.ids_by_key,
        "repeated": verdict.repeated,
        "calls": sum(1 for c in calls if c.error is None),
        "errors": sum(1 for c in calls if c.error is not None),
        "faults": nemesis.counts(),
        "over_bound": sum(not o["ok"] for o in outages),
        "outages": outages,
        "timeline": _timeline(calls, nemesis, began, ended, setup),
    }


def _timeline(
    calls: list[Call], nemesis: Nemesis, began: float, ended: float, setup: Setup
) -> dict[str, Any]:
    """Ids a second per client over time (every incarnation in one series), errors, faults."""
    bucket = max(0.25, (ended - began) / 400)
    counts: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    errors: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for call in calls:
        client = call.process.split("#")[0]
        if call.error is None:
            counts[client][int((call.t1 - began) // bucket)] += call.count
        else:
            errors[client].append((round(call.t1 - began, 3), call.error))
    strategy = {name: spec["kind"] for name, spec in setup.clients}
    last = int((ended - began) // bucket)
    processes = {
        name: {
            "strategy": strategy.get(name, ""),
            "rate": [
                [round(b * bucket, 3), round(counts[name].get(b, 0) / bucket, 1)]
                for b in range(0, last + 1)
            ],
            "errors": errors.get(name, []),
        }
        for name in sorted(set(counts) | set(errors))
    }
    faults = [
        {
            "kind": f.kind,
            "target": f.target,
            "start": round(f.start - began, 3),
            "end": round(f.end - began, 3),
        }
        for f in nemesis.log
    ]
    return {"bucket": bucket, "processes": processes, "faults": faults}
