"""The LeaseStore contract, run against every lease store on real servers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from idmint import LeaseLost, WorkerInUse, WorkersExhausted
from idmint.stores import open_lease_store
from idmint.stores.base import Lease, LeaseStore

from checks import run_threads

NOW = 1_800_000_000_000  # a Unix millisecond: the horizons below are plain numbers


@pytest.fixture
def store(lease_store_url: str) -> Iterator[LeaseStore]:
    s = open_lease_store(lease_store_url)
    yield s
    s.close()


def take(
    store: LeaseStore, ns: str = "ns", workers: int = 4, ttl: float = 30.0, horizon: int = NOW
) -> Lease:
    return store.acquire(ns, workers=workers, ttl=ttl, horizon_ms=horizon)


def test_meets_the_protocol(store: LeaseStore) -> None:
    assert isinstance(store, LeaseStore)


def test_lowest_free_worker_id_first(store: LeaseStore) -> None:
    leases = [take(store) for _ in range(3)]
    assert [lease.worker_id for lease in leases] == [0, 1, 2]
    assert len({lease.owner for lease in leases}) == 3
    first = leases[0]
    # ZooKeeper grants at most its maxSessionTimeout (20 s on the test server)
    ttl = 20.0 if store.display_url.startswith("zk") else 30.0
    assert (first.floor_ms, first.horizon_ms, first.ttl) == (0, NOW, ttl)
    store.release(leases[1])
    assert take(store).worker_id == 1


def test_a_new_holder_starts_above_the_old_horizon(store: LeaseStore) -> None:
    old = take(store, horizon=NOW)
    old = store.renew(old, NOW + 5000)
    assert old.horizon_ms == NOW + 5000
    store.release(old)
    new = take(store, horizon=NOW + 1000)  # its clock is behind the old holder's horizon
    assert new.worker_id == old.worker_id
    assert new.floor_ms == NOW + 5000
    assert new.horizon_ms == NOW + 5000  # never below the floor


def test_renew_never_lowers_the_horizon(store: LeaseStore) -> None:
    lease = store.renew(take(store, horizon=NOW), NOW + 9000)
    assert store.renew(lease, NOW + 100).horizon_ms == NOW + 9000


def test_all_taken_names_the_namespace(store: LeaseStore) -> None:
    for _ in range(2):
        take(store, ns="tight", workers=2)
    with pytest.raises(WorkersExhausted, match="'tight'"):
        take(store, ns="tight", workers=2)
    assert take(store, ns="other", workers=2).worker_id == 0  # namespaces are separate


def test_an_expired_lease_is_taken_over_and_the_old_holder_fenced(store: LeaseStore) -> None:
    old = take(store, ns="exp", workers=1, ttl=1.0, horizon=NOW + 700)
    with pytest.raises(WorkersExhausted):
        take(store, ns="exp", workers=1, ttl=1.0)
    deadline = time.monotonic() + 15
    while True:  # stores judge expiry by their own clock, some with a coarse grain
        try:
            new = take(store, ns="exp", workers=1, ttl=30.0, horizon=NOW)
            break
        except WorkersExhausted:
            assert time.monotonic() < deadline, "the lease never expired"
            time.sleep(0.2)
    assert new.worker_id == old.worker_id and new.floor_ms == NOW + 700
    with pytest.raises(LeaseLost):
        store.renew(old, NOW + 99_000)
    store.release(old)  # a stale release changes nothing
    with pytest.raises(WorkersExhausted):
        take(store, ns="exp", workers=1)
    assert store.renew(new, NOW + 1).horizon_ms == NOW + 700


def test_renewal_keeps_a_lease_alive(store: LeaseStore) -> None:
    lease = take(store, ns="live", workers=1, ttl=1.0)
    for _ in range(6):
        time.sleep(0.3)
        lease = store.renew(lease, NOW)
    with pytest.raises(WorkersExhausted):
        take(store, ns="live", workers=1, ttl=1.0)


def test_holders(store: LeaseStore) -> None:
    a, b = take(store, ns="h"), take(store, ns="h", horizon=NOW + 5)
    store.release(a)
    rows = {row.worker_id: row for row in store.holders("h")}
    assert rows[1].owner == b.owner and rows[1].horizon_ms == NOW + 5
    assert rows[1].expires_in is not None and 0 < rows[1].expires_in <= 30.5
    assert rows[0].expires_in is None or rows[0].expires_in <= 0
    assert store.holders("nobody") == []


def test_concurrent_acquires_get_distinct_ids(store: LeaseStore) -> None:
    got: list[int] = []
    lock = threading.Lock()

    def grab() -> None:
        for _ in range(3):
            lease = take(store, ns="race", workers=64)
            with lock:
                got.append(lease.worker_id)

    run_threads(grab, 6)
    assert sorted(got) == list(range(18))


def test_release_with_the_last_issued_timestamp_lowers_the_horizon(store: LeaseStore) -> None:
    first = store.renew(take(store, ns="down", workers=1, horizon=NOW), NOW + 30_000)
    store.release(first, issued_ms=NOW + 12)  # it issued nothing past NOW + 12
    second = take(store, ns="down", workers=1, horizon=NOW + 20)
    assert (second.floor_ms, second.horizon_ms) == (NOW + 12, NOW + 20)
    store.release(second, issued_ms=0)  # issued nothing: the floor stands
    assert take(store, ns="down", workers=1, horizon=0).floor_ms == NOW + 12


def test_answers_carry_the_store_clock(store: LeaseStore) -> None:
    def wall_ms() -> int:
        return time.time_ns() // 1_000_000

    sent = wall_ms()
    lease = take(store)
    acquired = wall_ms()
    renewed = store.renew(lease, NOW + 1)  # a horizon that moves, so every store writes
    received = wall_ms()
    if store.display_url.startswith("memory"):
        assert (lease.store_ms, renewed.store_ms) == (None, None)  # no clock of its own
        return
    # The servers run on this machine: their clocks read this one's, within the round trip
    # and the store's resolution (whole seconds from etcd's Date header).
    for answer, start, end in ((lease, sent, acquired), (renewed, acquired, received)):
        assert answer.store_ms is not None
        assert start - answer.store_ms_step <= answer.store_ms <= end + 1


def test_acquire_prefers_an_id_usable_now(store: LeaseStore) -> None:
    # Worker 0 was last held by a host whose clock had jumped an hour ahead.
    jumped = take(store, horizon=NOW + 3_600_000)
    store.release(jumped)
    usable = store.acquire("ns", workers=4, ttl=30.0, horizon_ms=NOW + 10_000, now_ms=NOW)
    assert (usable.worker_id, usable.floor_ms) == (1, 0)
    # With no usable id left, the lowest free one, floor and all.
    for expected in (2, 3):  # the others jump too
        lease = store.acquire("ns", workers=4, ttl=30.0, horizon_ms=NOW + 3_600_000, now_ms=NOW)
        assert lease.worker_id == expected
        store.release(lease)
    again = store.acquire("ns", workers=4, ttl=30.0, horizon_ms=NOW + 10_000, now_ms=NOW)
    assert (again.worker_id, again.floor_ms) == (0, NOW + 3_600_000)
    # Without now_ms, plainly the lowest free id.
    store.release(again)
    assert take(store).worker_id == 0


def test_a_renewal_that_finds_its_horizon_forgotten_is_lease_lost(store: LeaseStore) -> None:
    # The holder was given NOW + 9000; the store now says NOW (restored from an older copy).
    lease = take(store, horizon=NOW)
    remembered = replace(lease, horizon_ms=NOW + 9000)
    with pytest.raises(LeaseLost, match="forgot worker 0's horizon"):
        store.renew(remembered, NOW + 10_000)


def test_static_claims(store: LeaseStore) -> None:
    claimed = store.acquire("st", workers=4, ttl=30, horizon_ms=NOW, worker_id=2)
    assert (claimed.worker_id, claimed.static) == (2, True)
    with pytest.raises(WorkerInUse, match="worker id 2 of namespace 'st' is held by"):
        store.acquire("st", workers=4, ttl=30, horizon_ms=NOW, worker_id=2)
    with pytest.raises(ValueError, match="does not fit"):
        store.acquire("st", workers=4, ttl=30, horizon_ms=NOW, worker_id=4)
    store.release(claimed, issued_ms=NOW + 5)
    # Released, it stays reserved: leases skip it even when it is the last free id.
    assert sorted(take(store, ns="st").worker_id for _ in range(3)) == [0, 1, 3]
    with pytest.raises(WorkersExhausted):
        take(store, ns="st")
    again = store.acquire("st", workers=4, ttl=30, horizon_ms=NOW, worker_id=2)
    assert again.floor_ms == NOW + 5  # fenced above what the last static holder issued
    rows = {row.worker_id: row for row in store.holders("st")}
    assert rows[2].static and not rows[0].static
    store.release(again)
    assert store.unreserve("st", 2) and not store.unreserve("st", 2)
    assert take(store, ns="st").worker_id == 2


def test_an_identity_on_every_answer(store: LeaseStore) -> None:
    identity = store.identity()
    assert identity is not None and len(identity.id) >= 32
    lease = take(store)
    assert lease.store_id == identity.id == store.renew(lease, NOW + 1).store_id
    assert store.identity() == identity  # made once
    if store.display_url.startswith("memory"):
        assert identity.created_ms is None  # cannot lose its data under a live holder
    else:
        assert identity.created_ms is not None
        assert abs(identity.created_ms - time.time() * 1000) < 60_000
        assert lease.store_created_ms == identity.created_ms
