"""Worker-id leases in a dict: for strategy tests. Same contract as the real lease stores, by
the same protocol (lease_protocol.py): an acquire holds the one lock throughout, so its take
never loses a race."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from ..base import Lease, StoreIdentity, WorkerInfo
from ..lease_protocol import LOST, FencedLeases, Found, Request, Taken
from .cas import named_identity


@dataclass
class _Slot:
    owner: str = ""
    expires: float = 0.0
    horizon_ms: int = 0
    host: str = ""


class _Acquisition:
    """One acquire, under the store's lock: the table is the dict itself."""

    def __init__(self, store: MemoryLeaseStore, request: Request) -> None:
        self._store, self._request = store, request
        self._now = store._clock()

    def _slot(self, worker_id: int) -> _Slot:
        return self._store._slots.setdefault((self._request.namespace, worker_id), _Slot())

    def read(self) -> _Acquisition:
        return self

    def held(self, worker_id: int) -> bool:
        slot = self._slot(worker_id)
        return bool(slot.owner) and slot.expires > self._now

    def reserved(self, worker_id: int) -> bool:
        return (self._request.namespace, worker_id) in self._store._reserved

    def floor_ms(self, worker_id: int) -> int:
        return self._slot(worker_id).horizon_ms

    def holder(self, worker_id: int) -> tuple[str, float | None]:
        slot = self._slot(worker_id)
        return slot.host, slot.expires - self._now

    def take(self, table: _Acquisition, worker_id: int, horizon_ms: int) -> Taken:
        request = self._request
        if request.claim is not None:
            self._store._reserved.add((request.namespace, worker_id))
        taken = self._slot(worker_id)
        floor = taken.horizon_ms
        taken.owner, taken.expires = request.owner, self._now + request.ttl
        taken.horizon_ms = max(floor, horizon_ms)
        taken.host = "memory"
        # The identity's id only: no creation time (see MemoryLeaseStore).
        identity = StoreIdentity(self._store._identity.id, None)
        return Taken(floor, taken.horizon_ms, identity=identity)


class MemoryLeaseStore(FencedLeases):
    """Leases judged by one clock (`clock`, monotonic seconds by default), under one lock."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, *, identity: StoreIdentity | None = None
    ) -> None:
        self.display_url = "memory://"
        self._clock = clock
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._reserved: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        # No creation time: a store in this process's memory cannot lose its data under a
        # holder that lives on.
        self._identity = identity or StoreIdentity(uuid.uuid4().hex, None)

    @contextmanager
    def _acquiring(self, request: Request) -> Iterator[_Acquisition]:
        with self._lock:
            yield _Acquisition(self, request)

    def _refresh(self, lease: Lease, horizon_ms: int, expected_ms: int) -> Lease | Found:
        with self._lock:
            slot = self._slots.get((lease.namespace, lease.worker_id))
            if slot is None or slot.owner != lease.owner:
                return LOST
            if slot.horizon_ms < lease.horizon_ms:
                return Found(True, slot.horizon_ms)
            slot.expires = self._clock() + lease.ttl
            slot.horizon_ms = max(slot.horizon_ms, horizon_ms)
            return replace(lease, horizon_ms=slot.horizon_ms, store_id=self._identity.id)

    def _free(self, lease: Lease, horizon_ms: int | None) -> None:
        with self._lock:
            slot = self._slots.get((lease.namespace, lease.worker_id))
            if slot is not None and slot.owner == lease.owner:
                slot.owner, slot.expires = "", 0.0
                if horizon_ms is not None:
                    slot.horizon_ms = horizon_ms

    def _rows(self, namespace: str) -> list[WorkerInfo]:
        with self._lock:
            now = self._clock()
            return [
                WorkerInfo(
                    ns,
                    wid,
                    s.owner,
                    s.host,
                    (s.expires - now) if s.owner else None,
                    s.horizon_ms,
                    static=(ns, wid) in self._reserved,
                )
                for (ns, wid), s in sorted(self._slots.items())
                if ns == namespace
            ]

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        with self._lock:
            if (namespace, worker_id) not in self._reserved:
                return False
            self._reserved.discard((namespace, worker_id))
            return True

    def identity(self) -> StoreIdentity | None:
        return self._identity

    def close(self) -> None:
        pass


_named: dict[str, MemoryLeaseStore] = {}
_named_lock = threading.Lock()


def open_memory_leases(url: str, identity: StoreIdentity | None = None) -> MemoryLeaseStore:
    """`memory://NAME` stores are shared within a process by name; `memory://` is new each time
    (with `identity`, the one its engine's cells have)."""
    name = url[len("memory://") :]
    if not name:
        return MemoryLeaseStore(identity=identity)
    with _named_lock:
        store = _named.get(name)
        if store is None:
            store = _named[name] = MemoryLeaseStore(identity=named_identity(name))
        return store
