"""The contracts stores meet: CasStore (compare-and-set cells), RangeStore (segments),
LeaseStore (snowflake worker ids) and QuorumNode (one node of a quorum key).

A strategy never imports a store module: it is handed an object with these methods. Every
method is thread-safe. Every method either completes atomically and durably or raises; a range
is returned only after the store has committed it, so a range whose commit outcome is unknown
is never served.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .._errors import InvalidArgument, LeaseLost
from ..ids import Allocation, Key, Range


@runtime_checkable
class CasStore(Protocol):
    """Text cells with a version, changed only by compare-and-set: the one primitive the
    generic strategies (ranges over CAS, datacenter ranges) need from an engine.

    Every answer is linearizable and, when it reports a change, durable: `create` or `swap`
    returns True only after the engine committed the write as durably as it commits anything
    (see docs/stores.md for the settings each engine needs). An outcome the engine could not
    confirm (a timeout) raises StoreUnavailable: the caller reads again before trusting it.
    """

    display_url: str

    def init(self) -> None:
        """Create the schema (tables, keyspace) if it is missing; also done on first use."""

    def read(self, key: str) -> tuple[str, int] | None:
        """The cell's (value, version), or None if there is no such cell."""

    def create(self, key: str, value: str) -> bool:
        """Make the cell with `value` if there is none: False if it exists."""

    def swap(self, key: str, version: int, value: str) -> bool:
        """Set the cell to `value` if its version is still `version`: False if it changed
        (or is gone). A successful swap gives the cell a new version."""

    def scan(self, prefix: str) -> list[tuple[str, str]]:
        """Every (key, value) whose key starts with `prefix`, sorted by key."""

    def identity(self) -> StoreIdentity | None:
        """The store's identity (see StoreIdentity)."""

    def close(self) -> None:
        """Release connections."""


@runtime_checkable
class QuorumNode(Protocol):
    """One of the independent nodes of quorum keys: per key a counter that only moves up, 0
    until first written (see strategies/quorum.py).

    `claim` is atomic and, when it reports True, durable: the node answers only after its
    write is on disk (`durability()` says why it might not be).
    """

    display_url: str

    def read(self, key: str) -> int:
        """The key's counter (0 if the node never saw the key)."""

    def claim(self, key: str, start: int, end: int) -> tuple[bool, int]:
        """If the counter is below `start`, set it to `end` (>= start) and answer (True, end);
        else leave it and answer (False, counter)."""

    def durability(self) -> str | None:
        """Why an acknowledged claim might not survive a crash of the node (settings that do
        not fsync before answering), or None when it does. Asks the node."""

    def identity(self) -> StoreIdentity | None:
        """The node's identity: two URLs with one identity are one node, not two."""

    def close(self) -> None:
        """Release connections."""


#: A server's replication role (stores/replication.py reads it): a primary with replicas
#: attached, a read-only replica, or no replication at all.
PRIMARY, REPLICA, STANDALONE = "primary", "replica", "standalone"


class ReplicationView(Protocol):
    """What a strategy reads of a server's replication (stores/replication.py's
    ReplicationState has it): its role, the replicas connected, the engine's own words, and
    why a failover could lose an acknowledged write (None when it cannot)."""

    @property
    def role(self) -> str: ...

    @property
    def replicas(self) -> int: ...

    @property
    def detail(self) -> str: ...

    @property
    def risk(self) -> str | None: ...


@runtime_checkable
class ReplicatedNode(Protocol):
    """A quorum node whose engine can say how it is replicated: Redis and the SQL engines.
    The others are not asked: an etcd or ZooKeeper cluster acknowledges a write only once a
    majority of its members has it, and memory:// is refused anyway."""

    def replication(self) -> ReplicationView | None:
        """The server's replication now; None for an engine that has none (SQLite)."""


@runtime_checkable
class MultiplexedQuorumNode(QuorumNode, Protocol):
    """A QuorumNode whose claims can be sent and answered apart, over one connection, so that
    a round on many nodes runs on one thread: send to each, then read whichever answers
    (poll on `fileno()`). The caller keeps at most one claim outstanding per node and reads
    its answer before sending another."""

    def mux_connected(self) -> bool:
        """Whether the claim connection is open (no I/O): sending needs it."""

    def mux_connect(self) -> None:
        """Open the claim connection (blocking, bounded by the store timeout)."""

    def send_claim(self, key: str, start: int, end: int, limit: int | None = None) -> None:
        """Send a claim on the open connection; its answer comes through `receive_claim`.
        With `limit` (>= start) it is placed: if the counter is below `start` it is set to
        `end`, as `claim` does; else, if the counter is below `limit`, it moves up by the
        claim's size (the range placed just above it) and the answer is (True, the new
        counter); else (False, counter). Without, it is `claim`'s exact claim."""

    def fileno(self) -> int:
        """The claim connection's socket, readable once an answer arrives."""

    def receive_claim(self) -> tuple[bool, int, int]:
        """The oldest outstanding claim's answer: (applied, counter, the claim's start)."""

    def mux_reset(self) -> None:
        """Drop the claim connection (after an error, or an answer that never came)."""


@runtime_checkable
class RangeStore(Protocol):
    """Keys with a counter each (or one per stripe); `allocate` atomically takes a range."""

    #: The store's URL with any password removed: safe to print and log.
    display_url: str

    def init(self) -> None:
        """Create the schema if it is missing. Safe to call any number of times, concurrently."""

    def add_key(
        self,
        name: str,
        *,
        step: int,
        first_id: int,
        last_id: int,
        description: str = "",
        stripes: int = 1,
    ) -> Key:
        """Create a key whose first range starts at `first_id`, with `stripes` counters (stripe
        k starts at first_id + k). Raises KeyExists."""

    def get_key(self, name: str) -> Key:
        """The key's row (stripe 0's, with every stripe's next id). Raises KeyNotFound."""

    def identity(self) -> StoreIdentity | None:
        """The store's identity (see StoreIdentity); None for stores without one."""

    def list_keys(self) -> list[Key]:
        """Every key, sorted by name, as get_key shows it."""

    def allocate(
        self, name: str, count: int | None = None, *, stripe: int | None = None
    ) -> Allocation:
        """Take `count` ids (default: the key's step) from the counter of the key's stripe
        `stripe`, atomically: a range of stride `stripes`. With no stripe the store chooses
        (the allocation's key row says which, and how many the key has).

        A bounded key near its end yields a shorter range; a stripe with none left raises
        Exhausted (with its `stripe` set when the key has several). Raises KeyNotFound,
        InvalidArgument (no such stripe), StoreUnavailable.
        """

    def give_back(self, name: str, unused: Range) -> bool:
        """Return an unused tail: if its stripe's counter still stands at `unused.stop`
        (nobody has allocated since), move it back to `unused.start`. True if it moved.

        Never moves the counter below the key's floor (`first_id`), so a raise that happened
        while the range was held still stands.
        """

    def raise_floor(self, name: str, to: int) -> Key:
        """Make every future range of every stripe start at or above `to`; the floor only
        moves up."""

    def set_max_batch(self, name: str, max_batch: int) -> Key:
        """Set the most ids one request may take over HTTP (0: the default rule)."""

    def close(self) -> None:
        """Release connections. The store may not be used afterwards."""


@dataclass(frozen=True)
class Lease:
    """A worker id held in a namespace, fenced by time.

    The holder may issue ids with timestamps in (floor_ms, horizon_ms]: `floor_ms` is the highest
    timestamp any earlier holder of this worker id was allowed to issue, `horizon_ms` the highest
    this holder may issue, as the store has durably recorded it. Both are Unix milliseconds.

    `store_ms` is the store's own clock while it answered (Unix milliseconds, read in steps of
    `store_ms_step`: 1 for a database clock, 1000 for an HTTP Date header), so the holder can
    measure how far its clock is from the store's; None when the store has no clock of its own
    (memory, static) or did not read it on this call.
    """

    namespace: str
    worker_id: int
    owner: str
    floor_ms: int
    horizon_ms: int
    ttl: float
    store_ms: int | None = None
    store_ms_step: int = 1
    #: The store's identity (StoreIdentity.id) when it answered; None for stores without one.
    store_id: str | None = None
    #: When that identity was made (the store's clock, Unix ms); None where it cannot have
    #: lost data under a live holder (memory, static).
    store_created_ms: int | None = None
    #: A static claim on this worker id (acquire(worker_id=...)), not a lease the store chose.
    static: bool = False


#: The HTTP header in which an idmint server names its store's identity (StoreIdentity.id).
STORE_HEADER = "idmint-store"


@dataclass(frozen=True)
class StoreIdentity:
    """Who a store is: a UUID written with its schema (or under its prefix) the first time it
    is used, and when. A store that lost its data (wiped, or a new one behind the same address)
    gets a new identity, which is how holders and clients notice.

    `created_ms` is when the store's current life began: when it was made, or when a failover
    was last fenced (stores.replication). Either way the store may not know every lease of
    its earlier life, so a snowflake holder waits a ttl past it (LeaseKeeper)."""

    id: str
    created_ms: int | None

    def as_dict(self) -> dict[str, object]:
        return {"id": self.id, "created_ms": self.created_ms}


@dataclass(frozen=True)
class WorkerInfo:
    """One worker id of a namespace as the store sees it, for `idmint workers list`."""

    namespace: str
    worker_id: int
    owner: str
    host: str
    expires_in: float | None  # seconds; None or negative when free or expired
    horizon_ms: int
    static: bool = False  # reserved for a static holder: never leased to anyone else


@runtime_checkable
class LeaseStore(Protocol):
    """Worker-id leases with a per-worker time horizon that only moves up and outlives leases.

    Expiry is judged by one clock, the store's (or the store's own TTL), never the clients'.
    """

    display_url: str

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
        """Take a worker id in [0, workers) that no live lease holds and that is not reserved
        for a static holder: the lowest whose stored horizon is at most `now_ms` (the caller's
        clock: ids it can issue under at once), else the lowest. The returned lease's floor is
        the stored horizon of that id; its horizon is max(floor, horizon_ms), recorded before
        returning; its ttl is `ttl`, or shorter where the store caps it (ZooKeeper's session
        timeout). Sets `store_ms` where the store has a clock, and the store's identity. Raises
        WorkersExhausted.

        With `worker_id`, a static claim: reserve that id for static holders (from then on it
        is never leased to anyone else) and take it, or raise WorkerInUse while a live lease
        holds it.

        Preferring usable ids matters after a clock jumped forward: the ids its holders used
        carry horizons in the future, and a holder with a correct clock would wait for them."""

    def renew(self, lease: Lease, horizon_ms: int) -> Lease:
        """Extend the lease by its ttl and raise its horizon to `horizon_ms` (never lower it).
        Sets `store_ms` where the store has a clock, and the store's identity as it is now.
        Raises LeaseLost when another owner holds the id now, or when the stored horizon is
        below `lease.horizon_ms` (the store forgot what it recorded: restored from an older
        copy), in the same atomic step that would have raised it."""

    def release(self, lease: Lease, issued_ms: int | None = None) -> None:
        """Free the worker id at once. With `issued_ms` (the holder's last issued timestamp,
        after it stopped issuing) the horizon comes down to max(lease.floor_ms, issued_ms), so
        the next holder need not wait out a horizon nobody used. Never raises LeaseLost."""

    def holders(self, namespace: str) -> list[WorkerInfo]:
        """Every worker id the namespace has used, lowest first."""

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        """Give a static worker id back to the leases (`idmint workers unreserve`): False if it
        was not reserved. Its horizon stays, so the next holder still starts above it."""

    def identity(self) -> StoreIdentity | None:
        """The store's identity, made on first use; None for stores without one."""

    def close(self) -> None:
        """Release connections (not the leases)."""


class HorizonForgotten(LeaseLost):
    """A renewal found a lower horizon than the store gave the holder."""


def forgotten(lease: Lease, stored_horizon_ms: int) -> LeaseLost:
    """The error of a renewal that found `lease`'s worker id with a lower horizon than the
    store gave the holder: the store lost data, and someone may have taken the id below it."""
    return HorizonForgotten(
        f"the lease store forgot worker {lease.worker_id}'s horizon ({stored_horizon_ms} < "
        f"{lease.horizon_ms}): it lost data; taking a new lease"
    )


def check_claim(worker_id: int, workers: int) -> int:
    """`worker_id` if a static claim on it can fit the layout's `workers` ids."""
    if isinstance(worker_id, bool) or not isinstance(worker_id, int) or not worker_id >= 0:
        raise InvalidArgument(f"worker id must be an integer >= 0, not {worker_id!r}")
    if worker_id >= workers:
        raise InvalidArgument(
            f"worker id {worker_id} does not fit: the layout has {workers} worker ids"
        )
    return worker_id
