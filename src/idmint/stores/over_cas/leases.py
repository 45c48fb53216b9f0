"""Worker-id leases over any compare-and-set store (a `CasStore`) and the store's clock: what a
new engine gets for nothing once it has cells (docs/design.md, "How to add an engine"). The
engines idmint ships keep their own lease stores, which do it in fewer round trips with what
each does better (a TTL, one statement, a Lua script) and whose layouts deployed stores hold.

One cell per worker id of a namespace, `worker/{namespace}/{id}`, holding its `Slot`. Every
change is one swap of that cell against the version read, so two acquirers of one id cannot
both win, and a renewal that lost the id finds another owner there. Expiry is judged by
`now_ms`, the store's clock: one clock for every process (the engine's server clock, or the
host's own for an engine that lives on one host), never each caller's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from urllib.parse import quote

from ..base import CasStore, Lease, StoreIdentity, WorkerInfo
from ..lease_protocol import LOST, FencedLeases, Found, Request, Taken
from .loop import Backoff, cas_update

#: Releases and reservations change one cell only its holder writes: a lost swap means an
#: acquirer raced a reservation, or another holder took the id (read again, and see).
ONE_CELL = Backoff()


@dataclass(frozen=True)
class Slot:
    """A worker id's cell: its holder ("" when none), when the lease expires by the store's
    clock, its horizon, and whether it is reserved for a static holder."""

    owner: str = ""
    host: str = ""
    expires_ms: int = 0
    horizon_ms: int = 0
    static: bool = False

    def held_at(self, now_ms: int) -> bool:
        return bool(self.owner) and self.expires_ms > now_ms


@dataclass(frozen=True)
class _Table:
    """A namespace's cells as one scan found them, and the store's clock then."""

    slots: dict[int, Slot]
    now_ms: int

    def _slot(self, worker_id: int) -> Slot:
        return self.slots.get(worker_id, Slot())

    def held(self, worker_id: int) -> bool:
        return self._slot(worker_id).held_at(self.now_ms)

    def reserved(self, worker_id: int) -> bool:
        return self._slot(worker_id).static

    def floor_ms(self, worker_id: int) -> int:
        return self._slot(worker_id).horizon_ms

    def holder(self, worker_id: int) -> tuple[str, float | None]:
        slot = self._slot(worker_id)
        return slot.host, (slot.expires_ms - self.now_ms) / 1000


class _Acquisition:
    """One acquire: scan the namespace's cells, take one by a create or a swap."""

    def __init__(self, store: CasLeaseStore, request: Request) -> None:
        self._store, self._request = store, request
        self._identity = store.identity()

    def read(self) -> _Table:
        return _Table(self._store._read(self._request.namespace), self._store._now_ms())

    def take(self, table: _Table, worker_id: int, horizon_ms: int) -> Taken | None:
        request, store = self._request, self._store
        scanned = table.slots.get(worker_id)
        slot, version = Slot(), None
        if scanned is not None:
            # A scan gives no versions: read the chosen cell's, and take it only while it is
            # still what the choice was made on (else another writer came first).
            found = store._one(store._key(request.namespace, worker_id))
            if found is None or found[0] != scanned:
                return None
            slot, version = found
        taken = Slot(
            owner=request.owner,
            host=request.host,
            expires_ms=table.now_ms + round(request.ttl * 1000),
            horizon_ms=max(slot.horizon_ms, horizon_ms),
            static=slot.static or request.claim is not None,
        )
        if not store._write(request.namespace, worker_id, version, taken):
            return None  # another writer changed the cell since the read
        return Taken(
            slot.horizon_ms, taken.horizon_ms, table.now_ms, store._clock_step, self._identity
        )


class CasLeaseStore(FencedLeases):
    """A LeaseStore (stores/base.py) on the cells of `cas`, expiry by `now_ms` (Unix ms, read
    in steps of `clock_step` ms): the protocol of lease_protocol.py over one cell per worker
    id. Thread-safe when `cas` is."""

    def __init__(self, cas: CasStore, now_ms: Callable[[], int], *, clock_step: int = 1) -> None:
        self.display_url = cas.display_url
        self._cas = cas
        self._now_ms = now_ms
        self._clock_step = clock_step

    # -- cells -----------------------------------------------------------------------------

    def _key(self, namespace: str, worker_id: int) -> str:
        return f"worker/{quote(namespace, safe='')}/{worker_id}"

    def _read(self, namespace: str) -> dict[int, Slot]:
        """The namespace's slots by worker id: one scan."""
        prefix = self._key(namespace, 0)[:-1]
        return {
            int(key[len(prefix) :]): Slot(**json.loads(value))
            for key, value in self._cas.scan(prefix)
        }

    def _one(self, key: str) -> tuple[Slot, int] | None:
        read = self._cas.read(key)
        return None if read is None else (Slot(**json.loads(read[0])), read[1])

    def _write(self, namespace: str, worker_id: int, version: int | None, slot: Slot) -> bool:
        """Create the cell (version None) or swap it: False when another writer came first."""
        key, value = self._key(namespace, worker_id), _dump(slot)
        if version is None:
            return self._cas.create(key, value)
        return self._cas.swap(key, version, value)

    # -- the protocol's primitives -----------------------------------------------------------

    @contextmanager
    def _acquiring(self, request: Request) -> Iterator[_Acquisition]:
        yield _Acquisition(self, request)

    def _refresh(self, lease: Lease, horizon_ms: int, expected_ms: int) -> Lease | Found:
        found = self._one(self._key(lease.namespace, lease.worker_id))
        if found is None or found[0].owner != lease.owner:
            return LOST
        slot, version = found
        if slot.horizon_ms < lease.horizon_ms:
            return Found(True, slot.horizon_ms)  # the store forgot: HorizonForgotten
        now = self._now_ms()
        renewed = replace(
            slot,
            expires_ms=now + round(lease.ttl * 1000),
            horizon_ms=max(slot.horizon_ms, horizon_ms),
        )
        if not self._write(lease.namespace, lease.worker_id, version, renewed):
            return Found(True, slot.horizon_ms)  # changed since the read: read again
        identity = self._cas.identity()
        return replace(
            lease,
            horizon_ms=renewed.horizon_ms,
            store_ms=now,
            store_ms_step=self._clock_step,
            store_id=identity.id if identity is not None else None,
        )

    def _free(self, lease: Lease, horizon_ms: int | None) -> None:
        key = self._key(lease.namespace, lease.worker_id)

        def attempt() -> tuple[int | None, str | None, None]:
            found = self._one(key)
            if found is None or found[0].owner != lease.owner:
                return None, None, None  # lost already: nothing of ours to free
            freed = replace(found[0], owner="", expires_ms=0)
            if horizon_ms is not None:
                freed = replace(freed, horizon_ms=horizon_ms)
            return found[1], _dump(freed), None

        cas_update(self._cas, key, attempt, ONE_CELL, "release")

    def _rows(self, namespace: str) -> list[WorkerInfo]:
        now = self._now_ms()
        return [
            WorkerInfo(
                namespace,
                worker_id,
                slot.owner,
                slot.host,
                (slot.expires_ms - now) / 1000 if slot.owner else None,
                slot.horizon_ms,
                static=slot.static,
            )
            for worker_id, slot in self._read(namespace).items()
        ]

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        key = self._key(namespace, worker_id)

        def attempt() -> tuple[int | None, str | None, bool]:
            found = self._one(key)
            if found is None or not found[0].static:
                return None, None, False
            return found[1], _dump(replace(found[0], static=False)), True

        return cas_update(self._cas, key, attempt, ONE_CELL, "unreserve")[0]

    def identity(self) -> StoreIdentity | None:
        return self._cas.identity()

    def close(self) -> None:
        pass  # the cells are the engine's, which closes them


def _dump(slot: Slot) -> str:
    return json.dumps(asdict(slot), separators=(",", ":"))
