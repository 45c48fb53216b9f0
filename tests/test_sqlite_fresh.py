"""Many processes touching a brand-new SQLite file at the same instant.

`PRAGMA journal_mode=WAL` on a new file can return SQLITE_BUSY at once, without calling the
busy handler. Before it was retried, two processes starting together failed with "database is
locked" about one time in five, and in this test one round in five failed (40 rounds: all
passing by chance has odds of about 1 in 4000).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Each process imports everything first, then runs one command per line it reads: the round's
# fresh store URL. The parent writes that line to every process at once, so they all connect
# to the new file within a fraction of a millisecond, far closer together than 16 processes
# on two cores could be if each had to start Python first.
DRIVER = """
import contextlib, io, json, sys
from idmint.cli import main
command = sys.argv[1:]
print("ready", flush=True)
for line in sys.stdin:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--store", line.strip(), *command])
    print(json.dumps([code, err.getvalue().strip()]), flush=True)
"""

# Every command a user may run first on a new store, including the ones that only read.
# (`snowflake` itself would wait out a new store's 10 s quarantine; `workers list` opens the
# same lease store connection.)
COMMANDS = [
    ["keys", "add", "k", "--exist-ok"],
    ["next", "k"],
    ["keys", "list"],
    ["init"],
    ["workers", "list"],
    ["keys", "show", "k"],
]
PROCESSES = 16
ROUNDS = 40


def test_sixteen_processes_on_a_fresh_file_never_fail(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DRIVER, *COMMANDS[i % len(COMMANDS)]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    failures: list[str] = []
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        for round_ in range(ROUNDS):
            url = f"sqlite:///{tmp_path / f'fresh{round_}.db'}\n"
            for proc in procs:  # the barrier: every process is blocked reading this line
                assert proc.stdin is not None
                proc.stdin.write(url)
                proc.stdin.flush()
            for i, proc in enumerate(procs):
                assert proc.stdout is not None
                code, err = json.loads(proc.stdout.readline())
                command = COMMANDS[i % len(COMMANDS)]
                # The only acceptable failures: a key another process has not added yet, and
                # a store a command that only reads finds not yet made (it creates none).
                if code != 0 and not (code == 2 and ("not found" in err or "no store at" in err)):
                    failures.append(f"round {round_}, {' '.join(command)}: exit {code}: {err}")
    finally:
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in procs:
            proc.wait(timeout=30)
    assert not failures, "\n".join(failures)
