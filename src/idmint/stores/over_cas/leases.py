"""Worker-id leases over any compare-and-set store (a `CasStore`) and the store's clock: what a
new engine gets for nothing once it has cells (docs/design.md, "How to add an engine"). The
engines idmint ships keep their own lease stores, which do it in fewer round trips with what
each does better (a TTL, one statement, a Lua script) and whose layouts deployed stores hold.

One cell per worker id of a namespace, `worker/{namespace}/{id}`, holding its holder, when
the lease expires by the store's clock, its horizon and whether it is reserved for a static
holder. Every change is one swap of that cell against the version read, so two acquirers of
one id cannot both win, and a renewal that lost the id finds another owner there. Expiry is
judged by `now_ms`, the store's clock: it must be one clock for every process (the engine's
server clock, or the host's own for an engine that lives on one host), never each caller's.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from urllib.parse import quote

from ..._errors import LeaseLost, StoreUnavailable, WorkerInUse
from ..._fork import private_random
from ..base import CasStore, Lease, StoreIdentity, WorkerInfo, check_claim, forgotten
from ..leasing import choose_worker, holder_name
from .loop import Backoff, cas_update

ATTEMPTS = 100  # acquire's rounds lost to other acquirers in a row before StoreUnavailable
#: Renewals, releases and reservations change one cell only its holder writes: a lost swap
#: means someone else took it (read again, and see) or an acquirer raced a reservation.
ONE_CELL = Backoff()
_jitter = private_random()


@dataclass(frozen=True)
class Slot:
    """A worker id's cell. `owner` is "" when nobody holds it."""

    owner: str = ""
    host: str = ""
    expires_ms: int = 0
    horizon_ms: int = 0
    static: bool = False

    def held_at(self, now_ms: int) -> bool:
        return bool(self.owner) and self.expires_ms > now_ms


class CasLeaseStore:
    """A LeaseStore (stores/base.py) on the cells of `cas`, expiry by `now_ms` (Unix ms, read
    in steps of `clock_step` ms). Thread-safe when `cas` is."""

    def __init__(self, cas: CasStore, now_ms: Callable[[], int], *, clock_step: int = 1) -> None:
        self.display_url = cas.display_url
        self._cas = cas
        self._now_ms = now_ms
        self._clock_step = clock_step

    # -- cells -----------------------------------------------------------------------------

    @staticmethod
    def _prefix(namespace: str) -> str:
        return f"worker/{quote(namespace, safe='')}/"

    def _read(self, namespace: str) -> dict[int, tuple[Slot, int]]:
        """The namespace's slots and their versions, by worker id."""
        prefix = self._prefix(namespace)
        slots = {}
        for key, _ in self._cas.scan(prefix):
            read = self._cas.read(key)  # scan gives no versions: read each one that exists
            if read is not None:
                slots[int(key[len(prefix) :])] = (Slot(**json.loads(read[0])), read[1])
        return slots

    def _key(self, namespace: str, worker_id: int) -> str:
        return f"{self._prefix(namespace)}{worker_id}"

    def _one(self, namespace: str, worker_id: int) -> tuple[Slot, int] | None:
        read = self._cas.read(self._key(namespace, worker_id))
        return None if read is None else (Slot(**json.loads(read[0])), read[1])

    def _write(self, namespace: str, worker_id: int, version: int | None, slot: Slot) -> bool:
        """Create the cell (version None) or swap it: False when another writer came first."""
        key, value = self._key(namespace, worker_id), _dump(slot)
        if version is None:
            return self._cas.create(key, value)
        return self._cas.swap(key, version, value)

    # -- LeaseStore ------------------------------------------------------------------------

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
        claim = None if worker_id is None else check_claim(worker_id, workers)
        identity = self._cas.identity()
        for attempt in range(ATTEMPTS):
            slots, now = self._read(namespace), self._now_ms()
            chosen = self._choose(namespace, workers, slots, now, now_ms, claim)
            slot, version = slots.get(chosen, (Slot(), None))
            taken = Slot(
                owner=uuid.uuid4().hex,
                host=holder_name(),
                expires_ms=now + round(ttl * 1000),
                horizon_ms=max(slot.horizon_ms, horizon_ms),
                static=slot.static or claim is not None,
            )
            if self._write(namespace, chosen, version, taken):
                return Lease(
                    namespace,
                    chosen,
                    taken.owner,
                    slot.horizon_ms,
                    taken.horizon_ms,
                    ttl,
                    store_ms=now,
                    store_ms_step=self._clock_step,
                    store_id=_id(identity),
                    store_created_ms=identity.created_ms if identity else None,
                    static=claim is not None,
                )
            # Lost to another acquirer: a random pause, so the two do not collide again.
            time.sleep(_jitter.uniform(0.0, min(0.004 * (attempt + 1), 0.05)))
        raise StoreUnavailable(
            f"store {self.display_url}: {ATTEMPTS} concurrent acquirers in a row took the "
            "worker ids this one chose"
        )

    def _choose(
        self,
        namespace: str,
        workers: int,
        slots: dict[int, tuple[Slot, int]],
        now: int,
        caller_ms: int | None,
        claim: int | None,
    ) -> int:
        """The worker id to take: the static claim (WorkerInUse while held), or by the rule."""
        if claim is not None:
            held = slots.get(claim, (Slot(), 0))[0]
            if held.held_at(now):
                raise WorkerInUse(namespace, claim, held.host, (held.expires_ms - now) / 1000)
            return claim

        def free(w: int) -> bool:
            slot = slots.get(w, (Slot(), 0))[0]
            return not slot.static and not slot.held_at(now)

        def floor(w: int) -> int:
            return slots.get(w, (Slot(), 0))[0].horizon_ms

        return choose_worker(
            namespace, workers, (w for w in range(workers) if free(w)), floor, caller_ms
        )

    def renew(self, lease: Lease, horizon_ms: int) -> Lease:
        now = 0

        def attempt() -> tuple[int, str, Slot]:
            nonlocal now
            found = self._one(lease.namespace, lease.worker_id)
            if found is None or found[0].owner != lease.owner:
                raise LeaseLost(f"worker {lease.worker_id} of {lease.namespace!r} has a new owner")
            slot, version = found
            if slot.horizon_ms < lease.horizon_ms:
                raise forgotten(lease, slot.horizon_ms)
            now = self._now_ms()
            renewed = replace(
                slot,
                expires_ms=now + round(lease.ttl * 1000),
                horizon_ms=max(slot.horizon_ms, horizon_ms),
            )
            return version, _dump(renewed), renewed

        renewed, _ = cas_update(
            self._cas, self._key(lease.namespace, lease.worker_id), attempt, ONE_CELL, "renew"
        )
        return replace(
            lease,
            horizon_ms=renewed.horizon_ms,
            store_ms=now,
            store_ms_step=self._clock_step,
            store_id=_id(self._cas.identity()),
        )

    def release(self, lease: Lease, issued_ms: int | None = None) -> None:
        def attempt() -> tuple[int | None, str | None, None]:
            found = self._one(lease.namespace, lease.worker_id)
            if found is None or found[0].owner != lease.owner:
                return None, None, None  # lost already: nothing of ours to free
            slot, version = found
            freed = replace(slot, owner="", expires_ms=0)
            if issued_ms is not None:  # nobody else writes the horizon while we hold the id
                freed = replace(freed, horizon_ms=max(lease.floor_ms, issued_ms))
            return version, _dump(freed), None

        cas_update(
            self._cas, self._key(lease.namespace, lease.worker_id), attempt, ONE_CELL, "release"
        )

    def holders(self, namespace: str) -> list[WorkerInfo]:
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
            for worker_id, (slot, _) in sorted(self._read(namespace).items())
        ]

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        def attempt() -> tuple[int | None, str | None, bool]:
            found = self._one(namespace, worker_id)
            if found is None or not found[0].static:
                return None, None, False
            return found[1], _dump(replace(found[0], static=False)), True

        done, _ = cas_update(
            self._cas, self._key(namespace, worker_id), attempt, ONE_CELL, "unreserve"
        )
        return done

    def identity(self) -> StoreIdentity | None:
        return self._cas.identity()

    def close(self) -> None:
        pass  # the cells are the engine's, which closes them


def _dump(slot: Slot) -> str:
    return json.dumps(asdict(slot), separators=(",", ":"))


def _id(identity: StoreIdentity | None) -> str | None:
    return identity.id if identity is not None else None
