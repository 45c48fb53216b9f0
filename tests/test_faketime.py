"""The wall clock stepped under a running generator with libfaketime, and a restart after a
step back: no id repeats, errors are typed, service resumes by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checks import assert_unique
from harness import libfaketime

WORKER = str(Path(__file__).with_name("faketime_worker.py"))


class Clocked:
    """A worker process whose wall clock the test sets through a libfaketime control file."""

    def __init__(self, url: str, control: Path) -> None:
        self.control = control
        self.out = Path(tempfile.mkstemp(prefix="idmint-faketime-", suffix=".out")[1])
        env = {
            **os.environ,
            "LD_PRELOAD": libfaketime(),
            "FAKETIME_TIMESTAMP_FILE": str(control),
            "FAKETIME_NO_CACHE": "1",  # read the control file on every call
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # the lease deadline runs on real time
        }
        with self.out.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, WORKER, url], stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def lines(self) -> list[str]:
        return self.out.read_text().split("\n")[:-1]

    def ids(self) -> list[int]:
        return [int(x) for line in self.lines() if line.startswith("I ") for x in line.split()[1:]]

    def errors(self) -> list[str]:
        return [line[2:] for line in self.lines() if line.startswith("E ")]

    def issued_since(self, count: int) -> int:
        return len(self.ids()) - count

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def set_offset(control: Path, offset: str) -> None:
    tmp = control.with_suffix(".tmp")
    tmp.write_text(offset + "\n")
    tmp.replace(control)


def wait_for_ids(worker: Clocked, after: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(worker.ids()) <= after:
        assert worker.proc.poll() is None, "\n".join(worker.lines()[-20:])
        assert time.monotonic() < deadline, f"no ids for {timeout} s: {worker.errors()[-5:]}"
        time.sleep(0.1)


def test_clock_steps_under_a_running_generator(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'clock.db'}"
    control = tmp_path / "faketime"
    set_offset(control, "+0")
    worker = Clocked(url, control)
    try:
        wait_for_ids(worker, 0, 20)
        # Cumulative offsets: -3 ms (waited out), -1 s, -30 s (typed errors until the clock
        # catches up, which the test does by stepping forward again), +1 h (a jump forward).
        for offset, settle in (
            ("-0.003", 0.5),
            ("-1", 0.5),
            ("+0", 1.0),
            ("-30", 0.5),
            ("+0", 1.0),
            ("+3600", 1.0),
        ):
            before = len(worker.ids())
            set_offset(control, offset)
            time.sleep(settle)
            if offset in ("-1", "-30"):
                assert "ClockMovedBackwards" in worker.errors()
            else:
                wait_for_ids(worker, before, 15)
        assert set(worker.errors()) <= {"ClockMovedBackwards"}, worker.errors()
    finally:
        worker.stop()
    ids = worker.ids()
    assert len(ids) > 1000
    assert_unique(ids)


def test_restart_after_a_step_back_waits_for_the_old_horizon(tmp_path: Path) -> None:
    from idmint.layout import TWITTER

    url = f"sqlite:///{tmp_path / 'restart.db'}"
    control = tmp_path / "faketime"
    set_offset(control, "+0")
    first = Clocked(url, control)
    try:
        wait_for_ids(first, 0, 20)
        time.sleep(0.5)
    finally:
        first.stop()  # kill -9: its horizon (about now + ttl) stays in the store
    time.sleep(6.0)  # its lease (ttl 3 s) expires, even by a store clock 2 s behind
    set_offset(control, "-2")  # and the machine comes back with its clock 2 s behind
    again = Clocked(url, control)
    try:
        wait_for_ids(again, 0, 30)
    finally:
        again.stop()
    old, new = first.ids(), again.ids()
    assert {TWITTER.decode(i).worker for i in old + new} == {0}  # the same worker id
    assert min(new) > max(old)  # above the old horizon, despite the clock
    assert set(again.errors()) <= {"ClockMovedBackwards"}
    assert_unique(old + new)
