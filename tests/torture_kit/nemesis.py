"""The nemesis of a torture run: faults drawn at random from one seed, overlapping, each
undone after a random while, logged with when it began and ended.

The menu (what a set-up offers decides which are drawn):

  kill-client    kill -9 of a client process, started again (a new process) after a while
  pause-client   SIGSTOP of a client, SIGCONT after a while
  clock          a client's wall clock stepped (libfaketime), and back after a while
  kill-server    kill -9 of an `idmint serve` process, started again on its port
  pause-server   SIGSTOP of a server's processes
  kill-node      kill -9 of a store node, started again (its data kept)
  pause-node     SIGSTOP of a store node: a hung store, its sockets open
  partition      a store node cut off from clients (iptables on its address), healed later
  split          store nodes cut off from each other (a member from its peers, a datacenter
                 from the other): one of the set-up's `splits`, healed later
  drop-replies   a forwarder between clients and a store throws its replies away and cuts
                 the connection: writes applied whose clients never learn it (ambiguous)
  failover       the set-up's failover and failback (a replicated store's HA recipe)
  power-cut      every client and server and `power_cut_nodes` store nodes killed -9 at
                 once, then all started again: processes that remember nothing
  restore        a backup of the store taken, then after a while every client and server
                 stopped, the backup restored, and every key raised above the highest id
                 handed out (`idmint keys raise`, as docs/production.md says), and all started

The choices (which fault, which target, how long, the pause before the next) come from one
random.Random(seed) in one thread, so a seed replays the same schedule; how the system under
test answers may differ from run to run (timing), and the checker judges each run.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import idmint

from .checker import Fault
from .setups import Setup
from harness import Clock, Partition

#: Faults that run alone: nothing else is undone or started while one runs.
EXCLUSIVE = {"failover", "power-cut", "restore"}
#: Seconds a fault lasts, at most (drawn uniformly from a tenth of it).
LONGEST = {"clock": 3.0, "kill-node": 2.0, "pause-node": 3.0, "partition": 4.0, "split": 4.0}
DEFAULT_LONGEST = 2.5
#: Wall-clock steps (s) the clock fault draws from: snowflake's 5 ms tolerance, small steps
#: back it must wait out or refuse, and forward jumps.
CLOCK_STEPS = (-2.0, -0.4, -0.003, 0.003, 1.0, 3.0)


class Restartable(Protocol):
    name: str

    def kill9(self) -> None: ...
    def start(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...


@dataclass
class Targets:
    """What the nemesis may hit: clients (by name), servers, the set-up's nodes, clocks."""

    clients: Mapping[str, Restartable]
    servers: Mapping[str, Restartable]
    clocks: dict[str, Clock]
    #: clients that talk through each server (hit when it is)
    server_clients: dict[str, list[str]] = field(default_factory=dict)
    #: the highest id handed out so far, per segment key (what an operator reads before
    #: `keys raise`: the logs, the metrics, the clients' own records)
    highest: Callable[[], dict[str, int]] = dict


class Nemesis:
    def __init__(self, rng: random.Random, setup: Setup, targets: Targets, unsafe: bool) -> None:
        self.rng, self.setup, self.targets, self.unsafe = rng, setup, targets, unsafe
        self.log: list[Fault] = []
        self.errors: list[str] = []
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.menu = self._menu()

    def _menu(self) -> list[str]:
        t, setup = self.targets, self.setup
        menu = ["kill-client", "pause-client"]
        menu += ["clock"] * bool(t.clocks)
        menu += ["kill-server", "pause-server"] * bool(t.servers)
        menu += ["kill-node", "pause-node"] * bool(setup.nodes)
        menu += ["partition"] * any(n.address for n in setup.nodes.values())
        menu += ["split"] * bool(setup.splits)
        menu += ["drop-replies"] * bool(setup.proxies)
        menu += ["failover"] * (setup.switch is not None)
        menu += ["power-cut"] * bool(setup.power_cut_nodes)
        menu += ["restore"] * (setup.backup is not None)
        return menu

    # -- the schedule ------------------------------------------------------------------------

    def run(self, until: float) -> None:
        """Faults until the monotonic time `until`; every one undone before returning. In a
        negative control the set-up's dangerous fault comes first and then every third time."""
        rng = self.rng
        n = 0
        while time.monotonic() < until:
            n += 1
            if self.unsafe and self.setup.unsafe_fault and n % 3 == 1:
                kind = self.setup.unsafe_fault
            else:
                kind = rng.choice(self.menu)
            hold = rng.uniform(0.1, 1.0) * LONGEST.get(kind, DEFAULT_LONGEST)
            pick = rng.random()  # the target, drawn now: the schedule stays the seed's
            step = rng.choice(CLOCK_STEPS)
            if kind in EXCLUSIVE:
                self._join()
                self._fault(kind, pick, hold, step)
            else:
                thread = threading.Thread(
                    target=self._fault, args=(kind, pick, hold, step), daemon=True
                )
                thread.start()
                self._threads.append(thread)
            time.sleep(rng.uniform(0.2, 1.5))
        self._join()

    def _join(self) -> None:
        for thread in self._threads:
            thread.join(120)
        self._threads = [t for t in self._threads if t.is_alive()]

    # -- faults ------------------------------------------------------------------------------

    def _choose(self, names: list[str], pick: float) -> str | None:
        """The `pick`-th of `names` not hit by another fault now (taken: none is free)."""
        with self._lock:
            free = sorted(set(names) - self._busy)
            if not free:
                return None
            name = free[int(pick * len(free)) % len(free)]
            self._busy.add(name)
            return name

    def _fault(self, kind: str, pick: float, hold: float, step: float) -> None:
        try:
            self._run_fault(kind, pick, hold, step)
        except Exception as exc:  # a nemesis that cannot undo a fault: the run is void
            self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")

    def _run_fault(self, kind: str, pick: float, hold: float, step: float) -> None:
        t = self.targets
        undo: Callable[[], None]
        hits: tuple[str, ...] = ()
        stepped = 0.0
        if kind in ("kill-client", "pause-client", "clock"):
            names = list(t.clocks) if kind == "clock" else list(t.clients)
            name = self._choose(names, pick)
            if name is None:
                return
            hits = (name,)
            target = name
            if kind == "clock":
                clock = t.clocks[name]
                clock.step(step)
                target = f"{name} {step:+g} s"
                stepped = step

                def undo() -> None:
                    clock.step(-step)
            else:
                undo = _hold(t.clients[name], kind)
        elif kind in ("kill-server", "pause-server"):
            name = self._choose(list(t.servers), pick)
            if name is None:
                return
            hits, target = tuple(t.server_clients.get(name, ())), name
            undo = _hold(t.servers[name], kind)
        elif kind in ("kill-node", "pause-node", "partition"):
            nodes = self.setup.nodes
            names = [n for n, node in nodes.items() if kind != "partition" or node.address]
            name = self._choose(names, pick)
            if name is None:
                return
            node, target = nodes[name], name
            if kind == "partition":
                assert node.address is not None
                cut = Partition()
                cut.cut_address(*node.address)
                undo = cut.heal
            else:
                undo = _hold(_NodeTarget(node.server), kind)
        elif kind == "split":
            name = self._choose([f"split {n}" for n in self.setup.splits], pick)
            if name is None:
                return
            target = name.removeprefix("split ")
            undo = self.setup.splits[target]().heal
        elif kind == "drop-replies":
            name = self._choose(list(self.setup.proxies), pick)
            if name is None:
                return
            proxy, target = self.setup.proxies[name], name
            proxy.drop_replies = True

            def undo() -> None:
                proxy.drop_replies = False
        elif kind == "failover":
            assert self.setup.switch is not None
            start = time.monotonic()
            target = self.setup.switch()
            self._record(kind, target, start, time.monotonic(), ())
            return
        elif kind == "restore":
            self._restore(hold)
            return
        else:  # power-cut
            self._power_cut(pick)
            return
        start = time.monotonic()
        try:
            time.sleep(hold)
        finally:
            undo()
            with self._lock:
                self._busy.discard(name)
        self._record(kind, target, start, time.monotonic(), hits, stepped)

    def _power_cut(self, pick: float) -> None:
        t, setup = self.targets, self.setup
        start = time.monotonic()
        everyone = [*t.clients.values(), *t.servers.values()]
        for proc in everyone:
            proc.kill9()
        names = sorted(setup.nodes)
        first = int(pick * len(names))
        cut = [names[(first + i) % len(names)] for i in range(setup.power_cut_nodes)]
        for name in cut:
            setup.nodes[name].server.kill()
        for name in cut:
            setup.nodes[name].server.start()
        for proc in [*t.servers.values(), *t.clients.values()]:
            proc.start()
        hits = tuple(t.clients)
        self._record("power-cut", "nodes " + ",".join(cut), start, time.monotonic(), hits)

    def _restore(self, hold: float) -> None:
        t, setup = self.targets, self.setup
        assert setup.backup is not None
        start = time.monotonic()
        restore = setup.backup()
        time.sleep(hold)  # the store moves on past its backup
        everyone = [*t.clients.values(), *t.servers.values()]
        for proc in everyone:
            proc.kill9()
        restore()
        with idmint.connect(setup.store) as minter:
            for key, top in t.highest().items():
                minter.raise_floor(key, top + 1)
        for proc in [*t.servers.values(), *t.clients.values()]:
            proc.start()
        self._record("restore", "the store", start, time.monotonic(), tuple(t.clients))

    def _record(
        self,
        kind: str,
        target: str,
        start: float,
        end: float,
        hits: tuple[str, ...],
        step: float = 0.0,
    ) -> None:
        with self._lock:
            self.log.append(Fault(kind, target, start, end, hits, step))

    def clock_ahead(self) -> set[str]:
        """Clients whose wall clock was stepped ahead by more than snowflake's tolerance."""
        return {f.hits[0] for f in self.log if f.kind == "clock" and f.step > 0.005}

    def counts(self) -> dict[str, int]:
        counted: dict[str, int] = {}
        for fault in self.log:
            counted[fault.kind] = counted.get(fault.kind, 0) + 1
        return dict(sorted(counted.items()))


class _NodeTarget:
    """A store node as Restartable: kill() (-9) and start() for a kill, pause() and resume()."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.name = ""

    def kill9(self) -> None:
        self.server.kill()

    def start(self) -> None:
        self.server.start()

    def pause(self) -> None:
        self.server.pause()

    def resume(self) -> None:
        self.server.resume()


def _hold(target: Restartable, kind: str) -> Callable[[], None]:
    """Do the kill (then start on undo) or the pause (then resume on undo) of `kind`."""
    if kind.startswith("kill"):
        target.kill9()
        return target.start
    target.pause()
    return target.resume


def pause_group(pid: int, sig: signal.Signals) -> None:
    """SIGSTOP or SIGCONT of a process group (a server and its workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
