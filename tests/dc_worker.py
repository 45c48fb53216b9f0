"""A process of one datacenter taking ids one by one, recorded for the fault harness.

    python tests/dc_worker.py GLOBAL_URL KEY --dc DC [--dc-store URL] [--rate N] [--step N]
                              [--clock FILE]

Prints, flushing every 20 ms (a kill -9 loses at most the lines of the last 20 ms, never
reports an id it did not get):

    R start stop        a range its generator drew from the datacenter
    G start stop        the unused tail of a range, given back on close
    O t0 t1 id          a call that returned id (t0, t1: monotonic seconds)
    E t0 t1 Error       a call that raised Error (then it waits 50 ms and goes on)
    C {...}             on SIGTERM, the datacenter level's counts, then it exits

--rate paces the calls (ids a second per process; 0: as fast as it can). --clock names a
harness.Clock control file: the datacenter level's wall clock is off by the seconds it holds
(libfaketime would step the whole process, but breaks time.sleep: clock_nanosleep fails with
EINVAL under it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from idmint import IdmintError, Range, SegmentGenerator, SegmentOptions
from idmint.ids import Allocation
from idmint.stores import open_engine
from idmint.strategies.datacenter import DatacenterRanges


class Log:
    """Lines written in batches; the generator's refill thread adds lines too."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def add(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
        sys.stdout.write("".join(line + "\n" for line in lines))
        sys.stdout.flush()


#: The errors said in full so far (a `#` line each, which the parser skips): an E line names
#: only the class, and a worker stalled on one error said nothing of why.
_said: set[str] = set()


def record(log: Log, call: Callable[[], int]) -> bool:
    """One call, logged as an O line (its id) or an E line (its error); False if it raised."""
    t0 = time.monotonic()
    try:
        value = call()
    except IdmintError as exc:
        log.add(f"E {t0:.6f} {time.monotonic():.6f} {type(exc).__name__}")
        said = f"# {type(exc).__name__}: {exc}".replace("\n", " ")
        if said not in _said and len(_said) < 20:
            _said.add(said)
            log.add(said)
        return False
    log.add(f"O {t0:.6f} {time.monotonic():.6f} {value}")
    return True


class Recorded:
    """The datacenter level with every range it hands this process logged."""

    def __init__(self, inner: DatacenterRanges, log: Log) -> None:
        self._inner, self._log = inner, log

    def allocate(self, *args: Any, **kwargs: Any) -> Allocation:
        got = self._inner.allocate(*args, **kwargs)
        self._log.add(f"R {got.range.start} {got.range.stop}")
        return got

    def give_back(self, name: str, unused: Range) -> bool:
        back = self._inner.give_back(name, unused)
        if back:
            self._log.add(f"G {unused.start} {unused.stop}")
        return back

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def stepped_clock(control: str | None) -> Callable[[], int]:
    def now_ms() -> int:
        offset = 0.0
        if control is not None:
            with contextlib.suppress(OSError, ValueError):
                offset = float(Path(control).read_text().strip().rstrip("s"))
        return int((time.time() + offset) * 1000)

    return now_ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("key")
    parser.add_argument("--dc", required=True)
    parser.add_argument("--dc-store")
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--step", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--clock")
    # The negative control: the global cell at LOCAL_SERIAL (Cassandra), which connect()
    # refuses; the harness must catch the repeats it leads to.
    parser.add_argument("--unsafe-local-serial-global", action="store_true")
    args = parser.parse_args()

    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    log = Log()
    engine = open_engine(args.url, timeout=args.timeout)
    local = (
        engine.local_cas(args.dc)
        if args.dc_store is None
        else open_engine(args.dc_store, timeout=args.timeout).cas()
    )
    top = engine.local_cas(args.dc) if args.unsafe_local_serial_global else engine.cas()
    dcs = DatacenterRanges(top, local, args.dc, clock_ms=stepped_clock(args.clock))
    options = SegmentOptions(max_step=args.step, wait=args.timeout * 3)
    gen = SegmentGenerator(Recorded(dcs, log), args.key, options)
    pace = 1.0 / args.rate if args.rate else 0.0
    due = flushed = time.monotonic()
    while not stopping.is_set():
        if not record(log, gen.next_id):
            stopping.wait(0.05)
        now = time.monotonic()
        if now - flushed >= 0.02:
            log.flush()
            flushed = now
        if pace:
            due = max(due + pace, now - 1.0)  # no burst after a long stall
            if due > now:
                stopping.wait(due - now)
    gen.close()
    log.add("C " + json.dumps(dataclasses.asdict(dcs.counts)))
    log.flush()
    dcs.close()


if __name__ == "__main__":
    main()
