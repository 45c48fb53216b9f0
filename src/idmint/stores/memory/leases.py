"""Worker-id leases in a dict: for strategy tests. Same contract as the real lease stores."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..._errors import LeaseLost, WorkerInUse
from ..base import Lease, StoreIdentity, WorkerInfo, check_claim, forgotten
from ..leasing import choose_worker
from .cas import named_identity


@dataclass
class _Slot:
    owner: str = ""
    expires: float = 0.0
    horizon_ms: int = 0
    host: str = ""


class MemoryLeaseStore:
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

    def acquire(
        self,
        namespace: str,
        *,
        workers: int,
        ttl: float,
        horizon_ms: int,
        now_ms: int | None = None,
        worker_id: int | None = None,
    ) -> Lease:
        with self._lock:
            now = self._clock()

            def slot(worker_id: int) -> _Slot:
                return self._slots.setdefault((namespace, worker_id), _Slot())

            def free(worker_id: int) -> bool:
                return not slot(worker_id).owner or slot(worker_id).expires <= now

            if worker_id is None:
                candidates = (
                    w for w in range(workers) if (namespace, w) not in self._reserved and free(w)
                )
                worker_id = choose_worker(
                    namespace, workers, candidates, lambda w: slot(w).horizon_ms, now_ms
                )
                static = False
            else:
                check_claim(worker_id, workers)
                if not free(worker_id):
                    held = slot(worker_id)
                    raise WorkerInUse(namespace, worker_id, held.host, held.expires - now)
                self._reserved.add((namespace, worker_id))
                static = True
            taken = slot(worker_id)
            floor = taken.horizon_ms
            taken.owner, taken.expires = uuid.uuid4().hex, now + ttl
            taken.horizon_ms = max(floor, horizon_ms)
            taken.host = "memory"
            return Lease(
                namespace,
                worker_id,
                taken.owner,
                floor,
                taken.horizon_ms,
                ttl,
                store_id=self._identity.id,
                static=static,
            )

    def renew(self, lease: Lease, horizon_ms: int) -> Lease:
        with self._lock:
            slot = self._slots.get((lease.namespace, lease.worker_id))
            if slot is None or slot.owner != lease.owner:
                raise LeaseLost(f"worker {lease.worker_id} of {lease.namespace!r} has a new owner")
            if slot.horizon_ms < lease.horizon_ms:
                raise forgotten(lease, slot.horizon_ms)
            slot.expires = self._clock() + lease.ttl
            slot.horizon_ms = max(slot.horizon_ms, horizon_ms)
            return replace(lease, horizon_ms=slot.horizon_ms, store_id=self._identity.id)

    def release(self, lease: Lease, issued_ms: int | None = None) -> None:
        with self._lock:
            slot = self._slots.get((lease.namespace, lease.worker_id))
            if slot is not None and slot.owner == lease.owner:
                slot.owner, slot.expires = "", 0.0
                if issued_ms is not None:
                    slot.horizon_ms = max(lease.floor_ms, issued_ms)

    def holders(self, namespace: str) -> list[WorkerInfo]:
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
