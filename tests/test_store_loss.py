"""A lease store that loses its data under running holders: etcd's data directory wiped and the
member restarted, Redis flushed. A newcomer then finds worker 0 with no history while the old
holder still issues under its horizon. The store's new identity makes the newcomer wait out
the old holders (a new store quarantines its worker ids for a ttl) and the old holder stop and
take a new lease. No id may repeat. And a store that forgets a horizon, but keeps its identity,
is caught at the next renewal."""

from __future__ import annotations

import shutil
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import redis

import idmint
from idmint import CounterWentBack, LeaseLost, SegmentOptions, StoreUnavailable
from idmint.stores import open_lease_store
from idmint.strategies.snowflake import SnowflakeGenerator, SnowflakeOptions

from checks import assert_unique
from flake_procs import OUTPUTS, kill_left, read, start, wait_for_ids
from server_etcd import EtcdServer


def wipe_etcd(server: EtcdServer) -> None:
    server.kill()
    shutil.rmtree(server.base_dir / "data")
    server.start()


def flush_redis(server: Any) -> None:
    redis.Redis(port=server.port).flushall()


@pytest.mark.parametrize("kind", ["etcd", "redis"])
def test_a_wiped_store_under_a_running_holder(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if kind == "etcd":
        server: Any = EtcdServer()
        server.start()
        url, wipe = server.store_url("loss"), wipe_etcd
    else:
        server = request.getfixturevalue("redis_server")
        url, wipe = server.store_url(f"loss{time.time_ns()}"), flush_redis
    ttl = 10.0
    procs: list[Any] = []
    try:
        old = start(url, "loss", ttl, hold=600, exact=True)
        procs.append(old)
        wait_for_ids(old)
        # Frozen just while the store is wiped and a newcomer takes worker 0, so that it wakes
        # up inside its lease, issuing under a horizon the store has forgotten.
        old.send_signal(signal.SIGSTOP)
        wipe(server)
        new = start(url, "loss", ttl, hold=600, exact=True)
        procs.append(new)
        wait_for_lease(new)
        old.send_signal(signal.SIGCONT)
        wait_for_ids(new, timeout=30)  # after its quarantine
        time.sleep(2.0)
        ids_old, holds_old, _ = read_after(old)
        ids_new, holds_new, _ = read_after(new)
    finally:
        kill_left(procs)
        if kind == "etcd":
            server.close()
    assert holds_new[0][0] == holds_old[0][0] == 0  # the dangerous case did happen
    assert len(ids_old) > 1000 and len(ids_new) > 1000
    assert_unique(ids_old + ids_new)
    # The old holder noticed and took another worker id from the new store.
    assert [wid for wid, _, _ in holds_old] == [0, 1] or len(holds_old) == 1


def wait_for_lease(proc: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while b"L " not in OUTPUTS[proc.pid].read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, "no lease taken"
        time.sleep(0.05)


def read_after(proc: Any) -> tuple[list[int], list[tuple[int, float, float]], list[str]]:
    proc.send_signal(signal.SIGTERM)
    return read(proc, time.time())


def test_a_forgotten_horizon_is_lease_lost(redis_server: Any) -> None:
    url = redis_server.store_url("forgot")
    store = open_lease_store(url)
    gen = SnowflakeGenerator(store, options=SnowflakeOptions(namespace="f", ttl=2))
    lease = gen._keeper.lease()
    # A restore from an older snapshot: same store, but the horizon is back in the past.
    redis.Redis(port=redis_server.port).hset("forgot:h:f:0", "horizon", "1")
    with pytest.raises(LeaseLost, match="forgot worker 0's horizon"):
        gen._keeper.extend()
    with pytest.raises(LeaseLost):
        gen._keeper.lease()  # and the generator stops issuing under it
    assert lease.worker_id == 0
    gen.close()
    store.close()


def test_a_counter_restored_to_the_past_stops_the_segment_generator(tmp_path: Path) -> None:
    # A database restored from yesterday's backup: the key's counter is back below ids that
    # were handed out. The generator must not serve the range it now gets.
    url = f"sqlite:///{tmp_path / 'restored.db'}"
    with idmint.connect(url) as minter:
        minter.add_key("order", step=100)
        gen = minter.segment("order", SegmentOptions(preload_at=1.0))
        served = gen.next_ids(100)  # the whole first range
        with sqlite3.connect(tmp_path / "restored.db") as db:  # the restore
            db.execute("UPDATE idmint_keys SET max_id = 1 WHERE name = 'order'")
        with pytest.raises(CounterWentBack, match="went back: it handed out 1, below 101"):
            served += gen.next_ids(10)
        with pytest.raises(StoreUnavailable, match="went back"):
            gen.next_id()  # for good: a later range from the same store is no better
        assert_unique(served)
