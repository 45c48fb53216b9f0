"""PostgreSQL with an asynchronous standby (issue 30): every write waits, bounded, until each
standby that can be promoted has flushed it (sql/postgres.py, await_standbys). On main such a
primary refused every write unless the URL accepted the risk (`?unsafe_replication=1`), and
with it a failover to a standby that lagged handed ids out again. Real replication on
loopback (tests/replicated.py)."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

import idmint
from idmint import StoreUnavailable

from harness import Partition, duplicates
from postgres_ha import configure, execute
from replicated import PostgresStandby, postgres_pair
from servers import LOOPBACK, PostgresServer, wait_until

TIMEOUT = 2.0  # the store timeout: a write waits half of it for the standby


def _replicas(minter: idmint.Minter) -> int:
    state = minter.replication()
    assert state is not None
    return state.replicas


def _flushed_max_id(standby: psycopg.Connection[Any]) -> int:
    """The key's counter in what the standby has flushed now: its WAL position is read first,
    then its replay is let reach that position (replay trails the flush), then the row."""
    row = standby.execute("SELECT pg_last_wal_receive_lsn()::text").fetchone()
    assert row is not None
    flushed = row[0]

    def replayed() -> bool:
        done = standby.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (flushed,))
        return bool(done.fetchone() == (True,))

    wait_until(replayed, 10, "the standby to replay what it had flushed")
    counter = standby.execute("SELECT max_id FROM idmint_keys WHERE name = 'k'").fetchone()
    return int(str(counter[0])) if counter else 0


def test_a_standby_attached_under_load_has_every_range_when_it_is_returned() -> None:
    """The rebuild after a failover: a standby made (pg_basebackup) and attached to a primary
    that runs alone while a client takes ranges. No allocation fails (the standby counts once
    it streams: its catch-up holds up no write), and from then on every range is on the
    standby, flushed, when the call returns."""
    # pg_basebackup starts with a spread checkpoint, which pauses 100 ms a page while it is on
    # schedule: with the pages the ranges dirty, 8 s; at 0 nothing is on schedule.
    primary = PostgresServer(
        extra_settings={"wal_level": "replica", "checkpoint_completion_target": "0"}
    )
    with contextlib.ExitStack() as stack:
        stack.callback(primary.close)
        primary.start()
        minter = stack.enter_context(idmint.connect(primary.url(), timeout=TIMEOUT))
        minter.add_key("k", step=10)
        taken: list[int] = []  # each range's stop
        failed: list[Exception] = []
        done = threading.Event()

        def take() -> None:
            while not done.is_set():
                try:
                    taken.append(minter.ranges.allocate("k").range.stop)
                except Exception as exc:  # each one is reported below
                    failed.append(exc)

        taker = threading.Thread(target=take)
        taker.start()
        try:
            standby = PostgresStandby(primary, extra_settings={"hot_standby": "on"})
            stack.callback(standby.close)
            standby.start()
            wait_until(lambda: _replicas(minter) == 1, 30, "the standby to count")
            counted = len(taken)
            time.sleep(0.5)
        finally:
            done.set()
            taker.join()
        assert not failed, failed[:3]
        assert len(taken) > counted + 10, (counted, len(taken))
        state = minter.replication()
        assert state is not None
        assert (state.waits_for, state.required, state.risk) == (1, 1, None), state
        with psycopg.connect(standby.url(), autocommit=True) as on_standby:
            for _ in range(100):
                stop = minter.ranges.allocate("k").range.stop
                assert _flushed_max_id(on_standby) >= stop


def test_a_frozen_standby_fails_writes_within_the_bound_and_none_is_used() -> None:
    """The standby frozen (SIGSTOP: its link open, silent), a write waits half the store
    timeout for it and fails with StoreUnavailable naming the store and the standby: the
    range it took is never used, the next starts above it. Resumed, it serves again."""
    with (
        postgres_pair(synchronous=False) as (primary, standby),
        idmint.connect(primary.url(), timeout=TIMEOUT) as minter,
    ):
        minter.add_key("k", step=10)
        before = minter.ranges.allocate("k").range
        standby.pause()
        try:
            for _ in range(2):
                started = time.monotonic()
                with pytest.raises(StoreUnavailable) as refused:
                    minter.ranges.allocate("k")
                assert time.monotonic() - started < TIMEOUT
                why = str(refused.value)
                assert why.startswith(f"store {primary.url()}: standby 'standby' at 127.0.0.1")
                assert "did not flush the write" in why and "within 1 s" in why, why
                assert "\n" not in why and "unsafe" not in why
        finally:
            standby.resume()
        after = minter.ranges.allocate("k").range
    assert after.start >= before.stop + 2 * 10, (before, after)  # the two taken: skipped


@pytest.mark.parametrize("unsafe", [True, False], ids=["unsafe-gap-0", "default"])
def test_a_failover_after_the_link_is_cut_repeats_no_id(unsafe: bool) -> None:
    """The link to the standby cut (iptables), ranges taken, the primary killed -9, the
    standby promoted. By default the ranges taken after the cut are never returned (the
    standby does not flush them), and nothing repeats. The negative control, the wait off
    (`unsafe_replication=1`) and no gap, hands the lost ranges out again on the promoted
    standby, and the check sees it."""
    link = "127.0.0.45"
    params = "?unsafe_replication=1&failover_gap=0" if unsafe else ""
    handed: list[int] = []
    with (
        postgres_pair(synchronous=False, link=link) as (primary, standby),
        Partition() as partition,
    ):
        with idmint.connect(primary.url() + params, timeout=TIMEOUT) as minter:
            minter.add_key("k", step=10)
            for _ in range(3):
                handed += minter.ranges.allocate("k").range
            with psycopg.connect(standby.url(), autocommit=True) as on_standby:
                wait_until(
                    lambda: _flushed_max_id(on_standby) >= handed[-1] + 1,
                    10,
                    "the standby to have the first ranges",
                )
            partition.cut_address(link, primary.port)
            for _ in range(3):
                if unsafe:
                    handed += minter.ranges.allocate("k").range
                    continue
                with pytest.raises(StoreUnavailable, match="did not flush the write"):
                    minter.ranges.allocate("k")
        primary.kill()
        standby.promote()
        wait_until(lambda: not standby.in_recovery(), 30, "the promotion")
        with idmint.connect(standby.url() + params, timeout=TIMEOUT) as minter:
            if not unsafe:  # alone: the operator says the old primary is gone for good
                assert minter.set_required_replicas(0) == 1
            for _ in range(3):
                handed += minter.ranges.allocate("k").range
    assert len(handed) == (90 if unsafe else 60)
    assert bool(duplicates(handed)) == unsafe, duplicates(handed)[:10]


def test_a_synchronous_standby_and_pg_receivewal_count_one_standby(tmp_path: Path) -> None:
    """A synchronous standby and pg_receivewal streaming the WAL for backups (as Barman runs
    it): pg_receivewal is no standby a failover can promote, and it flushes only at the end
    of a WAL file. Before a89f53b it was counted, and every new connection failed (2 connected,
    writes wait for 1); counted now, every write would wait for its flush in vain."""
    with postgres_pair(synchronous=True) as (primary, _):
        receiver = subprocess.Popen(
            [
                str(primary.bindir / "pg_receivewal"),
                "--directory",
                str(tmp_path),
                "--dbname",
                f"host={LOOPBACK} port={primary.port} user=postgres "
                "application_name=barman_receive_wal",
                "--no-loop",
                "--no-password",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:

            def streaming() -> bool:
                with psycopg.connect(primary.url(), autocommit=True) as conn:
                    rows = conn.execute(
                        "SELECT application_name FROM pg_stat_replication WHERE state = 'streaming'"
                    ).fetchall()
                return sorted(str(row[0]) for row in rows) == ["barman_receive_wal", "standby"]

            wait_until(streaming, 30, "pg_receivewal and the standby to stream")
            with idmint.connect(primary.url(), timeout=TIMEOUT) as minter:
                minter.add_key("k", step=10)
                ranges = [minter.ranges.allocate("k").range for _ in range(5)]
                state = minter.replication()
            assert len({r.start for r in ranges}) == 5
            assert state is not None
            assert (state.replicas, state.waits_for, state.risk) == (1, 1, None), state
            assert state.waited_after_commit == 0  # the commit waits: nothing to read after
            assert receiver.poll() is None
        finally:
            receiver.terminate()
            _, errors = receiver.communicate(timeout=10)
        assert b"error" not in errors.lower(), errors


def test_a_standby_listed_twice_is_one_standby() -> None:
    """The standby follows the primary through a link address; the link is cut (no packet,
    no FIN either way) and the standby pointed at the primary's own address, as an HA manager
    repoints it (primary_conninfo, reloaded): it streams there at once, and the primary lists
    two walsenders for it, the old one streaming but silent until wal_sender_timeout (3 s
    here) ends it. Writes are served once it streams again, and after the old walsender is
    gone; the store's requirement stays at one standby (two, and every write was refused for
    good once the old walsender went: the Redis guard's bug of issue 32, here on PostgreSQL)."""
    link = "127.0.0.46"  # no other test's
    with (
        postgres_pair(synchronous=False, link=link) as (primary, standby),
        Partition() as partition,
        idmint.connect(primary.url(), timeout=TIMEOUT) as minter,
    ):
        configure(primary, wal_sender_timeout="3s")
        minter.add_key("k", step=10)
        wait_until(lambda: _replicas(minter) == 1, 30, "the standby to count")
        handed = list(minter.ranges.allocate("k").range)  # the requirement: one standby
        conninfo = execute(standby, "SHOW primary_conninfo")[0][0]
        partition.cut_address(link, primary.port)
        configure(standby, primary_conninfo=conninfo.replace(link, LOOPBACK).replace("'", "''"))
        wait_until(lambda: _walsenders(primary) == 2, 10, "the standby listed twice")
        listed = time.monotonic()
        refused: list[str] = []

        def served() -> bool:
            try:
                handed.extend(minter.ranges.allocate("k").range)
            except StoreUnavailable as exc:
                refused.append(str(exc))
                return False
            return True

        wait_until(served, 10, "a range while the standby is listed twice")
        wait_until(lambda: _walsenders(primary) == 1, 30, "the old walsender gone")
        gone = time.monotonic()
        try:
            wait_until(served, 10, "a range after the old walsender went")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: {refused[-1]}") from None
        state = minter.replication()
    assert state is not None and state.required == 1, state
    assert time.monotonic() - gone < 10 and gone - listed < 30
    assert not duplicates(handed)


def _walsenders(primary: PostgresServer) -> int:
    rows = execute(primary, "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'")
    return int(rows[0][0])
