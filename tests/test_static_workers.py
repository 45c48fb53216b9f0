"""Static worker ids next to leased ones on one store, a second static holder of the same id,
and a static holder paused past its ttl: no id repeats, the second holder is refused, the
paused one carries on by itself after SIGCONT."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checks import assert_unique
from conftest import SHARED_LEASE_STORES, fresh_store_url
from flake_procs import (
    assert_no_two_holders,
    kill_left,
    read,
    start,
    wait_for_ids,
    wait_for_lease,
)


def idmint_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "idmint", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("kind", SHARED_LEASE_STORES)
def test_static_and_leased_workers_share_a_store(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = fresh_store_url(kind, request, tmp_path)
    ttl = 1.0
    static = ["--worker-id", "0", "--state", str(tmp_path / "a.json")]
    holder = start(url, "mixed", ttl, hold=600, exact=True, extra=static)
    leased: list[subprocess.Popen[bytes]] = []
    try:
        wait_for_lease(holder)
        # Four leased processes on the eight worker ids of the test layout, which take the
        # lowest free ids: none may get 0. Started now, they wait out the new store's first
        # ttl with the static holder.
        leased += [start(url, "mixed", ttl, hold=1.0) for _ in range(4)]

        # The same static id from another process with its own state file: refused, no ids.
        second = idmint_cli(
            "snowflake", "--store", url, "--namespace", "mixed", "--worker-id", "0",
            "--state", str(tmp_path / "b.json"), "-n", "5",
        )  # fmt: skip
        assert second.returncode == 1 and second.stdout == "", second
        assert "worker id 0 of namespace 'mixed' is held by" in second.stderr
        assert second.stderr.count("\n") == 1, second.stderr

        wait_for_ids(holder)
        time.sleep(1)  # the leased processes take turns

        # Paused past its ttl, the static holder resumes by itself: nobody else may take its id.
        holder.send_signal(signal.SIGSTOP)
        time.sleep(ttl + 0.75)
        holder.send_signal(signal.SIGCONT)
        resumed_at = time.time()
        time.sleep(ttl + 1.0)

        ids: list[int] = []
        holds: list[tuple[int, int, float, float]] = []
        for n, proc in enumerate([holder, *leased]):
            proc.send_signal(signal.SIGTERM)
            got, spans, _ = read(proc, time.time())
            ids += got
            holds += [(n, *span) for span in spans]
            if n == 0:
                static_ids = got
        assert {wid for n, wid, _, _ in holds if n > 0} and all(
            wid != 0 for n, wid, _, _ in holds if n > 0
        ), "a leased process took the static worker id"
        assert_no_two_holders(holds)
        assert_unique(ids)
        # It issued after SIGCONT (ids carry their time: the test layout's epoch is 1.7e12 ms).
        assert max(static_ids) >> 15 > int(resumed_at * 1000) - 1_700_000_000_000
    finally:
        kill_left([holder, *leased])

    listed = idmint_cli("workers", "list", "--store", url, "--namespace", "mixed")
    assert listed.returncode == 0 and listed.stdout.splitlines()[1].split()[:2] == [
        "0",
        "static",
    ]
    freed = idmint_cli("workers", "unreserve", "0", "--store", url, "--namespace", "mixed")
    assert freed.returncode == 0 and "can be leased again" in freed.stdout
