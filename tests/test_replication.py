"""Replicated stores (issue 20): idmint reads each engine's replication, on real replication
set up with the engines' own tools on loopback (tests/replicated.py)."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import psycopg
import pytest

import idmint
from idmint import StoreUnavailable
from idmint.ids import is_digits
from idmint.stores import open_engine
from idmint.stores.redis.cas import RedisCasStore
from idmint.stores.replication import PRIMARY, STANDALONE
from idmint.strategies.snowflake import LeaseKeeper, SnowflakeOptions

from harness import Partition, Worker, duplicates
from http_server import ServerProcess
from replicated import (
    Forwarder,
    PostgresStandby,
    mariadb_pair,
    postgres_pair,
    promote,
    redis_pair,
    sql,
)
from servers import wait_until


def _replication(url: str) -> Any:
    engine = open_engine(url, timeout=5)
    try:
        return engine.ranges().replication()  # type: ignore[attr-defined]
    finally:
        engine.close()


def test_postgres_replication_is_read_on_the_primary_and_the_standby() -> None:
    """An asynchronous standby is waited for (issue 30: it was refused; on main before that
    nothing warned, and a failover repeated 179,995 ids): idmint waits for its flush after
    each write, so the state has no risk and writes are served. With unsafe_replication=1
    it is a risk the primary reports. A standby is refused as a store (it takes no writes:
    on main the first write failed with psycopg's ReadOnlySqlTransaction); a promoted
    standby is a primary on a new timeline."""
    with postgres_pair(synchronous=False) as (primary, standby):
        state = _replication(primary.url())
        waits = (state.replicas, state.waits_for, state.waited_after_commit, state.risk)
        assert waits == (1, 1, 1, None), state
        with idmint.connect(primary.url(), timeout=5) as minter:
            minter.add_key("k", step=10)  # served: idmint waits for the standby's flush
        on_primary = _replication(primary.url() + "?unsafe_replication=1")
        assert on_primary.role == PRIMARY and on_primary.replicas == 1
        assert on_primary.waits_for == 0 and "wait for 0" in on_primary.risk
        assert on_primary.lineage == "timeline 1"
        with pytest.raises(StoreUnavailable, match=r"is a replica \(in recovery.*takes no writes"):
            _replication(standby.url())
        standby.promote()
        promoted = _replication(standby.url())
        assert promoted.role == STANDALONE and promoted.lineage == "timeline 2", promoted
        # Alone, below the requirement its writes with the standby set: refused, not at risk.
        assert promoted.required == 1 and promoted.risk == promoted.shortfall is not None


def test_a_synchronous_standby_is_waited_for_and_a_cancelled_wait_is_not_served() -> None:
    """A commit waits for the synchronous standby. With the standby cut off, cancelling the
    waiting session (pg_cancel_backend: what a timeout or an operator does) makes PostgreSQL
    answer the commit as done, with only a WARNING that it committed locally and may not be
    on the standby. Before this change that range was served; now it is StoreUnavailable."""
    with postgres_pair(synchronous=True) as (primary, standby):
        state = _replication(primary.url())
        assert (state.role, state.replicas, state.waits_for, state.risk) == (PRIMARY, 1, 1, None)
        assert "synchronous_standby_names='standby'" in state.detail
        with idmint.connect(primary.url(), timeout=5) as minter:
            minter.add_key("k", step=10)
            minter.ranges.allocate("k")
            standby.detach()
            wait_until(lambda: not _standbys(primary), 30, "the standby to leave")

            def cancel_the_wait() -> bool:
                with psycopg.connect(primary.url(), autocommit=True) as conn:
                    rows = conn.execute(
                        "SELECT pg_cancel_backend(pid) FROM pg_stat_activity "
                        "WHERE wait_event = 'SyncRep'"
                    ).fetchall()
                return bool(rows)

            canceller = threading.Thread(
                target=wait_until, args=(cancel_the_wait, 10, "a commit waiting for the standby")
            )
            canceller.start()
            with pytest.raises(StoreUnavailable, match="committed on the primary only"):
                minter.ranges.allocate("k")
            canceller.join()


def _standbys(primary: Any) -> int:
    with psycopg.connect(primary.url(), autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_replication").fetchone()
    return int(row[0]) if row else 0


def _least_recently_used_first(pool: Any) -> None:
    """Make a redis-py connection pool hand out its least recently released connection: the
    order in which a write and a WAIT checked out separately land on different ones."""
    get = pool.get_connection

    def oldest_first(*args: Any, **kwargs: Any) -> Any:
        with pool._lock:
            if len(pool._available_connections) > 1:  # get_connection pops the last one
                pool._available_connections.append(pool._available_connections.pop(0))
        return get(*args, **kwargs)

    pool.get_connection = oldest_first


def test_redis_writes_wait_for_the_replica_and_one_it_did_not_confirm_is_not_used() -> None:
    """On main a range write was acknowledged once the primary had it: a failover to a
    replica that lacked it handed the range out again. Now each write waits (WAIT) for every
    replica the primary has had; with the replica frozen (its link open, silent), the write
    is reported unavailable and its range never used: the next one starts above it. The
    client's pool hands out its least recently used connection here (redis-py's gives the
    most recent): a WAIT sent on another connection than the write's answers at once (that
    connection's own writes are all on the replica), as it did on main, and the test fails."""
    with redis_pair() as (primary, replica):
        url = primary.store_url("wait")
        engine = open_engine(url, timeout=2)
        try:
            state = engine.cas().replication()  # type: ignore[attr-defined]
            assert (state.role, state.replicas, state.waits_for, state.risk) == (
                PRIMARY,
                1,
                1,
                None,
            )
        finally:
            engine.close()
        with idmint.connect(url, timeout=2) as minter:
            minter.add_key("k", step=10)
            assert minter.engine is not None
            cells = cast(RedisCasStore, minter.engine.cas())
            _least_recently_used_first(cells._client.connection_pool)
            with ThreadPoolExecutor(4) as threads:  # a few pooled connections, each wrote
                list(threads.map(lambda _: minter.ranges.allocate("k"), range(16)))
            first = minter.ranges.allocate("k").range
            replica.pause()
            try:
                with pytest.raises(StoreUnavailable, match=r"reached 0 of 1 replica"):
                    minter.ranges.allocate("k")
            finally:
                replica.resume()
            after = minter.ranges.allocate("k").range
            assert after.start >= first.stop + 10, (first, after)  # the unconfirmed one: skipped


def test_a_postgres_failover_is_fenced_before_a_range_is_served(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The worst case the opt-in allows: an asynchronous standby cut off while the primary
    hands out a range, the primary killed -9, the standby promoted without that range. On
    main the promoted standby handed the range out again (179,995 ids twice in the held-out
    run). Now the first connection to the new primary sees another lineage (timeline 2) and
    moves every key past the lost ranges before anything is served. (The negative control,
    the gap at 0, is in test_a_failover_under_load_repeats_no_id.) A multi-host URL with
    target_session_attrs=read-write follows the primary by itself."""
    with postgres_pair(synchronous=False) as (primary, standby):
        hosts = f"127.0.0.1:{primary.port},127.0.0.1:{standby.port}"
        url = (
            f"postgresql://postgres@{hosts}/postgres"
            "?target_session_attrs=read-write&unsafe_replication=1"
        )
        global_url = f"sqlite:///{tmp_path}/global.db"  # a datacenter key kept here too
        with idmint.connect(global_url) as minter:
            minter.add_datacenter_key("d", step=10)
        with idmint.connect(url, timeout=3) as minter:
            minter.add_key("k", step=10)
            before = minter.ranges.allocate("k").range
        with idmint.connect(global_url, dc="eu", dc_store=url) as minter:
            dc_before = minter.take("d", 10)
        wait_until(lambda: _replayed(standby), 30, "the standby to replay the first range")
        standby.detach()  # the link cut: what follows never reaches it
        with idmint.connect(url, timeout=3) as minter:
            lost = minter.ranges.allocate("k").range
        with idmint.connect(global_url, dc="eu", dc_store=url) as minter:
            dc_lost = minter.take("d", 10)
        _lease(url)
        primary.kill()
        killed_ms = time.time() * 1000
        standby.promote()
        wait_until(lambda: not standby.in_recovery(), 30, "the promotion")
        with caplog.at_level(logging.ERROR), idmint.connect(url, timeout=3) as minter:
            after = minter.ranges.allocate("k").range
        with idmint.connect(global_url, dc="eu", dc_store=url) as minter:
            dc_after = minter.take("d", 10)
        newcomer = _lease(url)
    assert before.stop <= lost.start < lost.stop <= after.start, (before, lost, after)
    assert dc_before.stop <= dc_lost.start < dc_lost.stop <= dc_after.start
    assert "FAILOVER" in caplog.text and "timeline 2" in caplog.text
    assert newcomer.store_created_ms >= killed_ms  # a new life: the holder waits a ttl


def _replayed(standby: PostgresStandby) -> bool:
    with psycopg.connect(standby.url(), autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT count(*) FROM idmint_keys WHERE max_id > first_id").fetchone()
    return bool(row and row[0])


def _lease(url: str) -> Any:
    """A snowflake worker lease taken on `url`'s store (worker ids 0 and 1, ttl 10 s)."""
    engine = open_engine(url, timeout=2)
    try:
        now = int(time.time() * 1000)
        return engine.leases().acquire("ns", workers=2, ttl=10, horizon_ms=now, now_ms=now)
    finally:
        engine.close()


def test_after_a_fence_a_newcomer_waits_out_the_longest_ttl_any_holder_uses() -> None:
    """Issue 30 item 9. A holder with a 60 s ttl leases a worker id; the primary dies and the
    replica, promoted, is fenced (the operator lowers its requirement): the store's life starts
    again. A newcomer with a 1 s ttl must not issue below any horizon of the old life, so its
    floor is the fence plus the longest ttl the namespace's holders recorded, past the
    holder's horizon. The negative control, a newcomer that does not read the record (as on
    main), waits out max(its ttl, the 10 s default) only: below the holder's horizon."""

    def wall_ms() -> int:
        return time.time_ns() // 1_000_000

    def keeper(engine: Any, ttl: float, record: bool) -> LeaseKeeper:
        cells = engine.cas() if record else None
        made = LeaseKeeper(engine.leases(), 4, SnowflakeOptions(ttl=ttl), wall_ms, ttl_cells=cells)
        made.start()
        return made

    with redis_pair() as (primary, replica):
        engine = open_engine(primary.store_url("ttl"), timeout=2)
        holder = keeper(engine, 60, record=True)
        horizon = holder.lease().horizon_ms
        assert primary.client().wait(1, 5000) == 1
        primary.kill()
        replica.client().replicaof("NO", "ONE")
        moved_url = replica.store_url("ttl")
        with idmint.connect(moved_url, timeout=2) as minter:
            minter.set_required_replicas(0)  # alone for good: this fences
        moved = open_engine(moved_url, timeout=2)
        try:
            floors = {}
            for record in (True, False):
                newcomer = keeper(moved, 1, record)
                floors[record] = newcomer.lease().floor_ms
                newcomer.close(None)
        finally:
            moved.close()
            holder.close(None)  # its store is gone: the release fails quietly
            engine.close()
    assert floors[True] >= horizon > floors[False], (floors, horizon)


def test_a_redis_failover_is_fenced_before_a_range_or_a_lease_is_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With writes that do not wait for the replica (the opt-in), the replica cut off and
    promoted, the primary hands out a range and a worker lease the replica never gets, and is
    killed -9. On main the promoted replica handed the range out again. Now the first write on
    it meets another replication id after writes made with a replica: it moves every key past
    the lost ranges and starts the store's life again (a new snowflake holder waits a ttl)
    before anything is written. (The negative control, the gap at 0, is in
    test_a_failover_under_load_repeats_no_id.)"""
    with redis_pair() as (primary, replica):
        url = primary.store_url("fo") + "&unsafe_replication=1"
        with idmint.connect(url, timeout=2) as minter:
            minter.add_key("k", step=10)
            before = minter.ranges.allocate("k").range
        assert primary.client().wait(1, 5000) == 1  # the replica has the first range
        replica.client().replicaof("NO", "ONE")  # the cut: promoted, it takes no more
        wait_until(
            lambda: primary.client().info("replication")["connected_slaves"] == 0,
            10,
            "the replica to leave",
        )
        with idmint.connect(url, timeout=2) as minter:
            lost = minter.ranges.allocate("k").range
        _lease(url)
        primary.kill()
        killed_ms = time.time() * 1000
        moved = replica.store_url("fo") + "&unsafe_replication=1"
        with caplog.at_level(logging.ERROR), idmint.connect(moved, timeout=2) as minter:
            after = minter.ranges.allocate("k").range
        newcomer = _lease(moved)
    assert before.stop <= lost.start < lost.stop <= after.start, (before, lost, after)
    assert "FAILOVER" in caplog.text
    assert newcomer.store_created_ms >= killed_ms  # a new life: the holder waits a ttl


def test_replication_and_failovers_show_in_init_stats_readyz_and_metrics() -> None:
    """What an operator sees of a Redis primary with a replica: `idmint init`, then a server
    on it, whose /v1/stats, /readyz and /metrics say the role, the replicas and the replicas
    each write waits for; after a failover (the replica promoted, the server's store URL
    moved with a forwarder standing in for a virtual IP) the fence is counted in all three,
    and the promoted primary, alone below the store's requirement, refuses writes (503, not
    ready) until the old primary is back as its replica."""
    with redis_pair() as (primary, replica), Forwarder(primary.port) as vip:
        url = f"redis://127.0.0.1:{vip.port}/0?prefix=ops"
        init = subprocess.run(
            [sys.executable, "-m", "idmint", "init", "--store", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert init.returncode == 0, init.stderr
        assert "replication: primary, 1 replica(s), writes wait for 1" in init.stdout
        server = ServerProcess(url).start()
        try:
            made = httpx.post(server.url + "/v1/keys", json={"name": "k", "step": 10})
            assert made.status_code == 201
            assert httpx.get(server.url + "/v1/keys/k/ids").status_code == 200
            stats = httpx.get(server.url + "/v1/stats").json()["replication"]
            assert stats["state"]["role"] == PRIMARY and stats["state"]["waits_for"] == 1
            assert stats["failovers"] == 0
            ready = httpx.get(server.url + "/readyz").text
            assert "store primary, 1 replica(s), writes wait for 1" in ready
            metrics = httpx.get(server.url + "/metrics").text
            assert "idmint_store_replicas 1.0" in metrics
            assert "idmint_store_replicas_waited 1.0" in metrics

            replica.client().replicaof("NO", "ONE")
            primary.kill()
            vip.target = replica.port  # the virtual IP moves to the promoted replica

            def fenced() -> bool:  # ids go on coming (a refill or two may fail first)
                httpx.get(server.url + "/v1/keys/k/ids", params={"count": 100})
                return bool(httpx.get(server.url + "/v1/stats").json()["replication"]["failovers"])

            wait_until(fenced, 20, "a refill on the promoted replica to fence it")
            assert "idmint_store_failovers_total 1.0" in httpx.get(server.url + "/metrics").text

            # Alone, below the store's requirement: once the buffer is spent the id route
            # answers 503 with the reason (issue 30: it was 400), the server stays up and not
            # ready, and every view says writes wait for 0 of the 1 required.
            def ids_status() -> int:
                return httpx.get(server.url + "/v1/keys/k/ids", params={"count": 100}).status_code

            wait_until(lambda: ids_status() == 503, 20, "the buffered ids to run out")
            refused = httpx.get(server.url + "/v1/keys/k/ids")
            assert refused.status_code == 503 and "has waited for 1" in refused.text
            probe = httpx.get(server.url + "/readyz")
            assert probe.status_code == 503 and "has waited for 1" in probe.text, probe.text

            def views_say_required() -> bool:
                state = httpx.get(server.url + "/v1/stats").json()["replication"]["state"]
                return (state["waits_for"], state["required"]) == (0, 1)

            wait_until(views_say_required, 15, "a key refresh to read the replication again")
            metrics = httpx.get(server.url + "/metrics").text
            assert "idmint_store_replicas_required 1.0" in metrics
            assert "idmint_store_replicas_waited 0.0" in metrics

            # The old primary back as the promoted one's replica (as Sentinel does): ids again.
            primary.start()
            primary.client().replicaof(replica.host, replica.port)
            wait_until(lambda: ids_status() == 200, 30, "writes to resume with the replica back")
            assert httpx.get(server.url + "/readyz").status_code == 200
        finally:
            server.stop()


def test_a_mariadb_failover_is_fenced_and_an_unacknowledged_commit_is_not_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """MariaDB with semi-synchronous replication, the replica's link cut (its IO thread
    stopped). MariaDB answers a commit the replica did not acknowledge within the timeout
    anyway, falling back to asynchronous replication (Leaf's known hole): by default such a
    range is reported unavailable and never served. With the opt-in it is served; the primary
    is killed -9 and the replica promoted: the first connection to it sees another server id,
    moves every key up the gap and starts the store's life again; with the gap at 0 (the
    negative control) the lost range repeats and the check catches it. A replica is refused
    as a store while it replicates."""
    for gap, repeats in ((0, True), (None, False)):
        with mariadb_pair(semi_sync=True) as (primary, replica):
            url = primary.create_database("ids")
            moved_url = replica.url("ids")
            unsafe = "?unsafe_replication=1" + ("" if gap is None else f"&failover_gap={gap}")
            with idmint.connect(url, timeout=3) as minter:
                state = minter.replication()
                assert state is not None
                assert (state.role, state.replicas, state.waits_for) == (PRIMARY, 1, 1)
                minter.add_key("k", step=10)
                before = minter.ranges.allocate("k").range
            with pytest.raises(StoreUnavailable, match="is a replica"):
                _replication(moved_url)
            sql(replica, "STOP SLAVE IO_THREAD")  # the link cut
            with (
                idmint.connect(url, timeout=3) as minter,
                pytest.raises(
                    StoreUnavailable,
                    match=r"fallen back to asynchronous|writes wait for 0 .* has waited for 1",
                ),
            ):
                minter.ranges.allocate("k")
            with idmint.connect(url + unsafe, timeout=3) as minter:
                lost = minter.ranges.allocate("k").range
            _lease(url + unsafe)
            primary.kill()
            killed_ms = time.time() * 1000
            promote(replica)
            with caplog.at_level(logging.ERROR), idmint.connect(moved_url + unsafe) as minter:
                after = minter.ranges.allocate("k").range
            newcomer = _lease(moved_url + unsafe)
        assert before.stop <= lost.start
        assert (after.start < lost.stop) == repeats, (gap, before, lost, after)
        assert "FAILOVER" in caplog.text and "server_id 2" in caplog.text
        assert newcomer.store_created_ms >= killed_ms
        caplog.clear()


SEGMENT_WORKER = str(Path(__file__).with_name("worker.py"))
FLAKE_WORKER = str(Path(__file__).with_name("flake_worker.py"))


@dataclass
class Rig:
    """A replicated store under test: the URL clients use (through the virtual IP), and how
    to age the store, cut the replication link and fail over."""

    url: str
    age: Callable[[], None]  # make the store a minute old (snowflake holders need not wait)
    cut: Callable[[], None]  # the replication link cut: the replica gets no more
    #: The primary killed -9, the replica promoted, the IP moved, the replica requirement
    #: lowered (two servers: none is left); what the operator's command logged.
    fail_over: Callable[[], str]


def lower_requirement(url: str) -> str:
    """What an operator does once the old primary of a two-server set-up is gone for good:
    the promoted one, alone, refuses to write until told to go on without a replica."""
    lowered = subprocess.run(
        [sys.executable, "-m", "idmint", "replicas", "--set", "0", "--yes", "--store", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert lowered.returncode == 0, lowered.stderr
    assert "replica requirement: 1 -> 0" in lowered.stdout or "0 -> 0" in lowered.stdout
    return lowered.stderr


def _ids(worker: Worker) -> int:
    return sum(1 for line in worker.text().splitlines() if is_digits(line))


@contextlib.contextmanager
def redis_rig(unsafe: bool) -> Iterator[Rig]:
    link = "127.0.0.41"  # the replica follows the primary on this address only: cut apart
    params = "&unsafe_replication=1&failover_gap=0" if unsafe else ""
    with (
        redis_pair(link=link) as (primary, replica),
        Forwarder(primary.port) as vip,
        Partition() as partition,
    ):

        def age() -> None:
            primary.client().hset("load:meta", "created_ms", int(time.time() * 1000) - 60_000)

        def fail_over() -> str:
            primary.kill()
            replica.client().replicaof("NO", "ONE")
            vip.target = replica.port
            return lower_requirement(f"redis://127.0.0.1:{vip.port}/0?prefix=load{params}")

        yield Rig(
            f"redis://127.0.0.1:{vip.port}/0?prefix=load{params}",
            age,
            lambda: partition.cut_address(link, primary.port),
            fail_over,
        )


@contextlib.contextmanager
def postgres_rig(unsafe: bool) -> Iterator[Rig]:
    """The default: a synchronous standby. The negative control: an asynchronous one, and
    the URL accepting it with no gap."""
    link = "127.0.0.42"
    params = "&unsafe_replication=1&failover_gap=0" if unsafe else ""
    with (
        postgres_pair(synchronous=not unsafe, link=link) as (primary, standby),
        Forwarder(primary.port) as vip,
        Partition() as partition,
    ):

        def age() -> None:
            with psycopg.connect(primary.url(), autocommit=True) as conn:
                conn.execute(
                    "UPDATE idmint_meta SET created_ms = created_ms - 60000 WHERE name = 'store'"
                )

        def fail_over() -> str:
            primary.kill()
            standby.promote()
            vip.target = standby.port
            wait_until(lambda: not standby.in_recovery(), 30, "the promotion")
            return lower_requirement(
                f"postgresql://postgres@127.0.0.1:{vip.port}/postgres?connect_timeout=2{params}"
            )

        yield Rig(
            f"postgresql://postgres@127.0.0.1:{vip.port}/postgres?connect_timeout=2{params}",
            age,
            lambda: partition.cut_address(link, primary.port),
            fail_over,
        )


@pytest.mark.parametrize(
    ("rig", "unsafe"),
    [(redis_rig, False), (redis_rig, True), (postgres_rig, False), (postgres_rig, True)],
    ids=["redis-default", "redis-unsafe-gap-0", "postgres-default", "postgres-unsafe-gap-0"],
)
def test_a_failover_under_load_repeats_no_id(
    rig: Callable[[bool], contextlib.AbstractContextManager[Rig]], unsafe: bool, tmp_path: Path
) -> None:
    """The held-out shape: client processes (segment and snowflake) through a forwarder
    standing in for a virtual IP, the replication link cut (iptables) while they run, the
    primary killed -9 a second later, the replica promoted and the address moved to it. In
    the default configuration no id repeats: what the primary took after the cut never
    reached a client (the write waited for the replica in vain), and the promoted replica is
    fenced before its first write. The negative control (an unwaited replica accepted,
    failover_gap=0) repeats segment ids, and the checker reports them. The failover is
    detected and logged in both."""
    with rig(unsafe) as store:
        with idmint.connect(store.url) as minter:
            minter.add_key("k", step=10)
            minter.identity()
        store.age()
        segment_args = [SEGMENT_WORKER, store.url, "k", "0", "--small-steps"]
        flake_args = [FLAKE_WORKER, store.url, "ns", "2", "--hold", "1"]
        workers = [Worker(f"seg{n}", segment_args, directory=tmp_path) for n in range(4)]
        workers += [Worker(f"flake{n}", flake_args, directory=tmp_path) for n in range(2)]
        try:
            wait_until(lambda: all(w.text().strip() for w in workers), 20, "every worker's ids")
            time.sleep(0.5)
            store.cut()
            time.sleep(1.0)
            operator_log = store.fail_over()
            moved = {w.name: _ids(w) for w in workers}
            # Processes that start after the failover remember nothing of the old primary's
            # ranges (one that does stops when its key goes back: CounterWentBack).
            workers += [Worker(f"late{n}", segment_args, directory=tmp_path) for n in range(2)]
            later = workers[:4] if not unsafe else workers[-2:]
            wait_until(
                lambda: all(_ids(w) > moved.get(w.name, 0) for w in later),
                30,
                "every segment worker's ids from the promoted replica",
            )
            time.sleep(0.5)
        finally:
            for w in workers:
                w.stop()
    segment_workers = workers[:4] + workers[6:]
    segment = [
        int(line) for w in segment_workers for line in w.text().splitlines() if is_digits(line)
    ]
    flakes = [
        int(i)
        for w in workers[4:6]
        for line in w.text().splitlines()
        if line.startswith("I ")
        for i in line.split()[1:]
    ]
    assert segment and flakes
    repeated = duplicates(segment)
    assert bool(repeated) == unsafe, repeated[:10]
    assert not duplicates(flakes)
    assert any("FAILOVER" in text for text in [operator_log, *(w.text() for w in workers)])


def test_a_datacenter_keys_cells_are_fenced_too(tmp_path: Path) -> None:
    """A datacenter whose own store is a replicated Redis (writes not waited for: the
    opt-in), its replica cut off and promoted while the datacenter hands out ids the replica
    never gets, the primary killed -9. The fence moves the datacenter's cell (and any global
    cell there) up the gap like a segment key's: the ids are not handed out again. With the
    gap at 0 (the negative control) they are, and the check catches it."""
    for gap, repeats in ((0, True), (None, False)):
        with redis_pair() as (primary, replica):
            global_url = f"sqlite:///{tmp_path}/global-{gap}.db"
            params = "&unsafe_replication=1" + ("" if gap is None else f"&failover_gap={gap}")
            with idmint.connect(global_url) as minter:
                minter.add_datacenter_key("k", step=10)
            local = primary.store_url("dc") + params
            with idmint.connect(global_url, dc="eu", dc_store=local) as minter:
                before = minter.take("k", 10)
            assert primary.client().wait(1, 5000) == 1  # the replica has it
            replica.client().replicaof("NO", "ONE")  # the cut: promoted, it takes no more
            wait_until(
                lambda: primary.client().info("replication")["connected_slaves"] == 0,
                10,
                "the replica to leave",
            )
            with idmint.connect(global_url, dc="eu", dc_store=local) as minter:
                lost = minter.take("k", 10)
            primary.kill()
            moved = replica.store_url("dc") + params
            with idmint.connect(global_url, dc="eu", dc_store=moved) as minter:
                after = minter.take("k", 10)
        assert before.stop <= lost.start
        assert (after.start < lost.stop) == repeats, (gap, before, lost, after)
