"""The fenced worker-lease protocol (`LeaseStore`, stores/base.py), written once for the engines
that run it in Python: SQL, etcd, ZooKeeper, Cassandra, memory and over_cas. Redis runs the same
rules in one Lua script (redis/), which tests/test_leasing.py checks against `choose_worker`.

Decided here, for every engine: acquire (read the namespace's `Table`, choose an id or honour
a static claim, take it; after a lost race read again, at most ATTEMPTS rounds), renew (what a
refresh that renewed nothing means: LeaseLost, HorizonForgotten, or a retry from the horizon
found) and release (the horizon down to max(floor, issued_ms), only while the lease holds the
id; never LeaseLost). Each engine supplies `FencedLeases`' underscored methods: its table, its
one atomic take (`Acquisition.take`: the same keys, rows or nodes, values and conditions in one
write, whatever version of idmint shares the store), its refresh, its free, its rows.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from .._errors import LeaseLost, StoreUnavailable, WorkerInUse
from .base import Lease, StoreIdentity, WorkerInfo, check_claim, forgotten
from .leasing import choose_worker, holder_name

# Rounds of an acquire (or renewal) lost in a row: each means another writer won, so this bounds
# only pathological contention.
ATTEMPTS = 100


@dataclass(frozen=True)
class Request:
    """One acquire: the namespace, the new lease's owner (a fresh UUID) and holder name, the
    ttl asked for, and the static claim (None: the store chooses)."""

    namespace: str
    owner: str
    host: str
    ttl: float
    claim: int | None


@dataclass(frozen=True)
class Taken:
    """What an engine's take recorded: the floor it read and the horizon it wrote, the store's
    clock and identity when it answered, and the ttl where the store granted a shorter one."""

    floor_ms: int
    horizon_ms: int
    store_ms: int | None = None
    store_ms_step: int = 1
    identity: StoreIdentity | None = None
    ttl: float | None = None


@dataclass(frozen=True)
class Found:
    """A refresh that renewed nothing: whether the lease's owner still holds the id, and the
    stored horizon it found (meaningful when it does)."""

    ours: bool
    horizon_ms: int = 0


#: A refresh that found the id no longer held by the lease.
LOST = Found(False)


class Table(Protocol):
    """One read of a namespace's worker ids, as an engine found them."""

    def held(self, worker_id: int) -> bool:
        """Whether a live lease holds the id."""

    def reserved(self, worker_id: int) -> bool:
        """Whether the id is reserved for static holders (asked only when choosing)."""

    def floor_ms(self, worker_id: int) -> int:
        """The id's stored horizon, 0 if it has none."""

    def holder(self, worker_id: int) -> tuple[str, float | None]:
        """The holder's name and seconds its lease has left (None: unknown), for WorkerInUse."""


T = TypeVar("T", bound=Table)


class Acquisition(Protocol[T]):
    """An engine's side of one acquire (`FencedLeases._acquiring`); what it prepared (an etcd
    lease, a ZooKeeper session) is let go when the acquire ends without a lease."""

    def read(self) -> T:
        """The namespace's table, now (or as the last lost take returned it)."""

    def take(self, table: T, worker_id: int, horizon_ms: int) -> Taken | None:
        """Take `worker_id` for the request in the engine's one atomic write, only if it is
        still as `table` shows it, with the horizon max(its floor, horizon_ms); None when
        another writer changed it first."""


class FencedLeases(abc.ABC):
    """A LeaseStore's acquire, renew, release and holders over an engine's primitives (the
    abstract methods). Subclasses add `unreserve`, `identity` and `close`."""

    display_url: str
    #: Acquire rounds, and renewal rounds, lost in a row before StoreUnavailable.
    acquire_attempts: ClassVar[int] = ATTEMPTS
    #: Floors `choose_worker` reads at most (0: all), for engines where each is a round trip.
    preference_looks: ClassVar[int] = 0

    # -- the engine's primitives ----------------------------------------------------------------

    @abc.abstractmethod
    def _acquiring(self, request: Request) -> AbstractContextManager[Acquisition[Any]]:
        """The engine's side of one acquire, ended (and what it prepared let go unless a take
        succeeded) when the acquire ends."""

    @abc.abstractmethod
    def _refresh(self, lease: Lease, horizon_ms: int, expected_ms: int) -> Lease | Found:
        """Extend the lease by its ttl and raise its stored horizon to at least horizon_ms,
        in one atomic step that checks the lease still holds the id (and, where the engine
        compares it, that the stored horizon is `expected_ms`): the renewed lease, or what
        was found instead."""

    def _dropped(self, lease: Lease) -> None:
        """A renewal found the lease lost: forget what the engine keeps for it (ZooKeeper: its
        session)."""
        return None

    @abc.abstractmethod
    def _free(self, lease: Lease, horizon_ms: int | None) -> None:
        """Free the id if the lease still holds it, in one step setting its horizon to
        `horizon_ms` when given."""

    @abc.abstractmethod
    def _rows(self, namespace: str) -> Iterable[WorkerInfo]:
        """Every worker id the namespace has used."""

    # -- LeaseStore -----------------------------------------------------------------------------

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
        request = Request(namespace, uuid.uuid4().hex, holder_name(), ttl, claim)
        with self._acquiring(request) as acquisition:
            for _ in range(self.acquire_attempts):
                table = acquisition.read()
                chosen = self._choose(request, table, workers, now_ms)
                taken = acquisition.take(table, chosen, horizon_ms)
                if taken is not None:
                    return self._lease(request, chosen, taken)
        raise StoreUnavailable(
            f"store {self.display_url}: {self.acquire_attempts} concurrent writers in a row "
            f"took worker ids of namespace {namespace!r} first"
        )

    def _choose(self, request: Request, table: Table, workers: int, now_ms: int | None) -> int:
        namespace, claim = request.namespace, request.claim
        if claim is None:
            free = (w for w in range(workers) if not table.reserved(w) and not table.held(w))
            looks = self.preference_looks
            return choose_worker(namespace, workers, free, table.floor_ms, now_ms, looks=looks)
        if table.held(claim):
            raise WorkerInUse(namespace, claim, *table.holder(claim))
        return claim

    @staticmethod
    def _lease(request: Request, worker_id: int, taken: Taken) -> Lease:
        identity = taken.identity
        return Lease(
            request.namespace,
            worker_id,
            request.owner,
            taken.floor_ms,
            taken.horizon_ms,
            request.ttl if taken.ttl is None else taken.ttl,
            store_ms=taken.store_ms,
            store_ms_step=taken.store_ms_step,
            store_id=identity.id if identity else None,
            store_created_ms=identity.created_ms if identity else None,
            static=request.claim is not None,
        )

    def renew(self, lease: Lease, horizon_ms: int) -> Lease:
        expected = lease.horizon_ms
        for _ in range(self.acquire_attempts):
            found = self._refresh(lease, horizon_ms, expected)
            if isinstance(found, Lease):
                return found
            if not found.ours:
                self._dropped(lease)
                raise LeaseLost(
                    f"worker {lease.worker_id} of namespace {lease.namespace!r} is no longer "
                    "held: its lease lapsed or another owner holds it now"
                )
            if found.horizon_ms < lease.horizon_ms:
                self._dropped(lease)
                raise forgotten(lease, found.horizon_ms)
            # Above what we knew: an earlier renewal of ours whose answer we never got (only
            # the holder moves a held id's horizon), so still ours to raise.
            expected = found.horizon_ms
        raise StoreUnavailable(
            f"store {self.display_url}: {self.acquire_attempts} renewals in a row found the "
            "horizon moved"
        )

    def release(self, lease: Lease, issued_ms: int | None = None) -> None:
        self._free(lease, None if issued_ms is None else max(lease.floor_ms, issued_ms))

    def holders(self, namespace: str) -> list[WorkerInfo]:
        return sorted(self._rows(namespace), key=lambda row: row.worker_id)
