"""The LeaseStore contract, run against every lease store on real servers."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from idmint import LeaseLost, WorkerInUse, WorkersExhausted
from idmint.stores import open_lease_store
from idmint.stores.base import Lease, LeaseStore
from idmint.stores.lease_protocol import FencedLeases, Request, Taken
from idmint.stores.memory import MemoryLeaseStore, _Slot

from checks import run_threads
from conftest import LEASE_STORES, LOCKED_STORES, fresh_store_url

NOW = 1_800_000_000_000  # a Unix millisecond: the horizons below are plain numbers


@pytest.fixture(params=(*LEASE_STORES, *LOCKED_STORES))
def lease_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Every lease store, and every server engine again locked down (TLS, least privilege)."""
    return fresh_store_url(request.param, request, tmp_path)


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


# -- two holders of one worker id: the checker, racing acquirers, and its negative control ------


def double_holders(leases: list[Lease]) -> dict[int, list[str]]:
    """The worker ids handed to more than one of `leases` (all taken while every one of them
    was live), with the owners that got each: the worst bug a lease store can have."""
    owners: dict[int, list[str]] = {}
    for lease in leases:
        owners.setdefault(lease.worker_id, []).append(lease.owner)
    return {w: o for w, o in owners.items() if len(o) > 1}


class _Gated:
    """An acquisition whose first read waits, after reading, for every racing acquire to have
    read too: they all chose from one table, and race to take the same worker id."""

    def __init__(self, inner: Any, barrier: threading.Barrier) -> None:
        self._inner, self._barrier, self._first = inner, barrier, True

    def read(self) -> Any:
        table = self._inner.read()
        if self._first:
            self._first = False
            with contextlib.suppress(threading.BrokenBarrierError):
                self._barrier.wait(30)
        return table

    def take(self, table: Any, worker_id: int, horizon_ms: int) -> Taken | None:
        taken: Taken | None = self._inner.take(table, worker_id, horizon_ms)
        return taken


def racing(store: FencedLeases, parties: int) -> None:
    """Make `store`'s acquires race in waves of `parties`: each reads the namespace, waits
    until all have, then takes."""
    barrier = threading.Barrier(parties)
    acquiring = store._acquiring

    @contextlib.contextmanager
    def gated(request: Request) -> Iterator[_Gated]:
        with acquiring(request) as acquisition:
            yield _Gated(acquisition, barrier)

    store._acquiring = gated  # type: ignore[method-assign]


def grab_at_once(store: LeaseStore, threads: int, each: int, ns: str) -> list[Lease]:
    """`each` leases per thread, taken by `threads` threads at once."""
    got: list[Lease] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def grab() -> None:
        try:
            for _ in range(each):
                lease = take(store, ns=ns, workers=64)
                with lock:
                    got.append(lease)
        except BaseException as exc:
            errors.append(exc)
            raise

    run_threads(grab, threads)
    assert not errors, errors
    return got


class _Snapshot:
    """The unsafe store's table: its slots copied when read."""

    def __init__(self, store: MemoryLeaseStore, namespace: str) -> None:
        with store._lock:
            self._slots = {w: replace(s) for (ns, w), s in store._slots.items() if ns == namespace}
        self._now = store._clock()

    def held(self, worker_id: int) -> bool:
        slot = self._slots.get(worker_id)
        return slot is not None and bool(slot.owner) and slot.expires > self._now

    def reserved(self, worker_id: int) -> bool:
        return False

    def floor_ms(self, worker_id: int) -> int:
        slot = self._slots.get(worker_id)
        return 0 if slot is None else slot.horizon_ms

    def holder(self, worker_id: int) -> tuple[str, float | None]:
        return "", None


class _BlindTake:
    """A take that writes the lease without checking the id is still free: the broken
    primitive the negative control runs the protocol on."""

    def __init__(self, store: MemoryLeaseStore, request: Request) -> None:
        self._store, self._request = store, request

    def read(self) -> _Snapshot:
        return _Snapshot(self._store, self._request.namespace)

    def take(self, table: _Snapshot, worker_id: int, horizon_ms: int) -> Taken:
        store, request = self._store, self._request
        with store._lock:
            slot = store._slots.setdefault((request.namespace, worker_id), _Slot())
            floor = slot.horizon_ms
            slot.owner, slot.expires = request.owner, store._clock() + request.ttl
            slot.horizon_ms = max(floor, horizon_ms)
        return Taken(floor, slot.horizon_ms)


class _UnsafeLeases(MemoryLeaseStore):
    """The protocol over a blind take, and no lock held across an acquire."""

    @contextlib.contextmanager
    def _acquiring(self, request: Request) -> Iterator[_BlindTake]:  # type: ignore[override]
        yield _BlindTake(self, request)


def test_the_checker_catches_a_take_that_does_not_check_the_lease_is_free() -> None:
    # Negative control: the same protocol, the same racing acquirers, over a take that does
    # not check: several of them are handed worker id 0, and the checker says so.
    unsafe = _UnsafeLeases()
    racing(unsafe, 4)
    leases = grab_at_once(unsafe, 4, 1, "unsafe")
    assert double_holders(leases) == {0: [lease.owner for lease in leases]}
    # The safe memory store under the same threads (its lock serialises each acquire whole).
    leases = grab_at_once(MemoryLeaseStore(), 4, 3, "safe")
    assert double_holders(leases) == {}


def test_racing_acquirers_never_share_a_worker_id(store: LeaseStore) -> None:
    threads, each = 6, 3
    if isinstance(store, FencedLeases) and not isinstance(store, MemoryLeaseStore):
        racing(store, threads)  # every wave reads one table and races for one id
    leases = grab_at_once(store, threads, each, "racing")
    assert double_holders(leases) == {}
    assert sorted(lease.worker_id for lease in leases) == list(range(threads * each))
    for lease in leases:  # the store agrees each is the one holder of its id
        assert store.renew(lease, lease.horizon_ms).worker_id == lease.worker_id
