"""The public entry point: a store URL in, key administration and generators out."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any, cast

from ._errors import Closed, InvalidArgument, KeyExists, NameTaken
from ._fork import ForkAware
from .aio import AsyncSegment
from .ids import (
    DEFAULT_FIRST_ID,
    DEFAULT_STEP,
    ID_MAX,
    Key,
    Range,
    check_count,
    check_key_bounds,
    check_key_name,
    check_max_batch,
)
from .keyspace import DATACENTER, SEGMENT, KeySpace, KindCheckedRanges, QuorumKey
from .layout import Layout
from .stores import DEFAULT_TIMEOUT, open_engine
from .stores.base import LeaseStore, RangeStore, StoreIdentity
from .stores.engine import Engine
from .stores.replication import ReplicationState
from .stores.static import StateFileLeases, StaticLeaseStore
from .strategies.datacenter import DatacenterRanges
from .strategies.datacenter_cells import ReservationSizing, check_dc_name
from .strategies.quorum import QuorumGenerator, checked_quorum
from .strategies.quorum_nodes import QuorumNodeSet, QuorumOptions, check_nodes
from .strategies.refills import SegmentOptions, allocate_any
from .strategies.segment import SegmentGenerator
from .strategies.snowflake import SnowflakeGenerator, SnowflakeOptions

log = logging.getLogger("idmint")

#: Seconds Minter.close() waits for generators to give their ranges back.
CLOSE_TIMEOUT = 10.0


class Minter(ForkAware):
    """Keys and id generators on one store. Thread-safe; close it (or use `with`) when done.

    with idmint.connect("postgresql://app@db/app") as minter:
        minter.add_key("order", step=1000, start=100_000_000)
        orders = minter.segment("order")
        orders.next_id()
    """

    def __init__(
        self,
        store: RangeStore,
        *,
        segment_options: SegmentOptions | None = None,
        lease_store: LeaseStore | None = None,
        engine: Engine | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        keyspace: KeySpace | None = None,
    ) -> None:
        self.store = store
        self.lease_store = lease_store
        #: The engine the stores came from (connect() sets it): closed with the minter.
        self.engine = engine
        #: The store's one namespace of key names (connect() sets it): see keyspace.py.
        self.keyspace = keyspace
        #: The store as generators and key admin use it: it claims the names of keys it makes
        #: and says what a name is when it is no key of this kind.
        self.ranges = self._kind_checked(
            store, DATACENTER if isinstance(store, DatacenterRanges) else SEGMENT
        )
        self.segment_options = segment_options or SegmentOptions()
        self._segments: dict[str, SegmentGenerator] = {}
        # Datacenter keys served through datacenters other than the store's own (datacenter())
        self._datacenters: dict[tuple[str, str | None], DatacenterRanges] = {}
        self._dc_generators: dict[tuple[str, str, str | None], SegmentGenerator] = {}
        #: Seconds a store call may take, for stores the minter opens itself (a dc_store).
        self.timeout = timeout
        self._snowflakes: list[SnowflakeGenerator] = []
        self._quorums: dict[tuple[str, tuple[str, ...]], QuorumGenerator] = {}
        #: The node sets of those keys, one per node list (and unsafe, replicated_nodes,
        #: recheck), shared by its keys: one connection and thread per node however many keys
        #: there are.
        self._node_sets: dict[tuple[tuple[str, ...], bool, bool, float], QuorumNodeSet] = {}
        self._quorum_lock = threading.Lock()
        self._lock = threading.Lock()
        self._closed = False
        self._watch_fork()

    def _kind_checked(self, store: RangeStore, kind: str) -> RangeStore:
        return store if self.keyspace is None else KindCheckedRanges(store, self.keyspace, kind)

    def _after_fork(self) -> None:
        # Generators and stores reset themselves; only the locks may be the parent's.
        self._lock = threading.Lock()
        self._quorum_lock = threading.Lock()

    @property
    def url(self) -> str:
        """The store's URL, without its password."""
        return self.store.display_url

    def init(self) -> None:
        """Create the store's schema if it is missing (it is also created on first use)."""
        self.store.init()

    def identity(self) -> StoreIdentity | None:
        """The store's identity (made on first use): servers show it, clients compare it."""
        identity = self.store.identity()
        if identity is None and self.lease_store is not None:
            identity = self.lease_store.identity()
        return identity

    def replication(self) -> ReplicationState | None:
        """The store's replication as it is now (stores/replication.py): None for a store
        without replication (SQLite, the memory store) or one that does not say (etcd,
        ZooKeeper and Cassandra replicate by consensus: a failover loses nothing)."""
        read = self._engine_method("replication")
        return None if read is None else cast(ReplicationState | None, read())

    def set_required_replicas(self, replicas: int) -> int:
        """Set how many replicas every write waits for (the store keeps the most it has
        waited for and refuses to write with fewer: `idmint replicas --set`). Lowering it
        fences the store as a failover does. Returns the requirement it replaced.

        >>> minter.set_required_replicas(0)  # the old primary is gone for good
        1
        """
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise InvalidArgument(f"replicas must be a whole number, 0 or more, not {replicas!r}")
        change = self._engine_method("set_required")
        if change is None:
            raise InvalidArgument(
                f"store {self.url} has no replica requirement (only Redis, PostgreSQL and "
                "MySQL/MariaDB stores replicate that way)"
            )
        return int(change(replicas))

    def _engine_method(self, name: str) -> Any:
        """The engine's method `name`, found through the wrappers (kind checks, CAS ranges)
        around the store, or None."""
        seen: list[object] = [self.store, self.lease_store]
        for _ in range(8):
            if not seen:
                break
            store = seen.pop(0)
            method = getattr(store, name, None)
            if callable(method):
                return method
            seen += [getattr(store, inner, None) for inner in ("store", "cas")]
            seen = [s for s in seen if s is not None]
        return None

    def add_key(
        self,
        name: str,
        *,
        step: int | None = None,
        start: int = DEFAULT_FIRST_ID,
        max: int | None = None,  # the CLI's --max: same name
        description: str = "",
        max_batch: int = 0,
        stripes: int | None = None,
        exist_ok: bool = False,
    ) -> Key:
        """Create a key whose ids run from `start` to `max` (2**31 - 1 for a 32-bit key),
        taken from the store `step` at a time (the dynamic step grows from there).

        `stripes=n` gives the key n independent counters: stripe k hands out start + k,
        start + k + n, ... so n processes take ranges without contending (Broadcast's
        stripes). `max` defaults to the highest a key with that many stripes may have.
        `max_batch`: see set_max_batch (0, the default rule, until it is set). `step` and
        `stripes` default to DEFAULT_STEP and 1. Raises KeyExists; with `exist_ok`, only
        when the key there differs from what was asked (step, stripes and max only when
        given; NameTaken, a key of another kind, always), and returns the key there."""
        asked_step, asked_max, asked_stripes = step, max, stripes
        step = DEFAULT_STEP if step is None else step
        stripes = 1 if stripes is None else stripes
        if max is None:  # the highest: a stripe's counter must still fit in a BIGINT
            max = ID_MAX + 1 - (stripes if isinstance(stripes, int) and stripes > 0 else 1)
        check_key_name(name)
        check_key_bounds(step, start, max, stripes)
        check_max_batch(max_batch)
        if len(description) > 256:
            raise InvalidArgument("description must be at most 256 characters")
        try:
            key = self.ranges.add_key(
                name,
                step=step,
                first_id=start,
                last_id=max,
                description=description,
                stripes=stripes,
            )
        except KeyExists as exc:
            if not exist_ok or isinstance(exc, NameTaken):
                raise
            key = self.key(name)
            differs = key.differences(
                step=asked_step, start=start, last_id=asked_max, stripes=asked_stripes
            )
            if differs:
                raise KeyExists(
                    name, f"key {name!r} exists with other settings: {'; '.join(differs)}"
                ) from None
            return key
        return self.set_max_batch(name, max_batch) if max_batch else key

    def set_max_batch(self, name: str, max_batch: int) -> Key:
        """Cap the ids one request may take over HTTP from key `name` (a range, a batch) at
        `max_batch`; 0 restores the default, the key's step x 100 (at most 10,000,000). It is
        kept in the key's row, so every server on the store applies the same cap."""
        return self.ranges.set_max_batch(check_key_name(name), check_max_batch(max_batch))

    def key(self, name: str) -> Key:
        """The key's row in the store. Raises KeyNotFound."""
        return self.ranges.get_key(check_key_name(name))

    def keys(self) -> list[Key]:
        """Every key in the store, sorted by name."""
        return self.store.list_keys()

    def raise_floor(self, name: str, to: int) -> Key:
        """Make every range taken from now on start at or above `to` (for keys that must stay
        above imported legacy ids). Only moves up; ranges already held are served out first."""
        return self.ranges.raise_floor(check_key_name(name), to)

    def retire_key(self, name: str) -> Key:
        """Retire key `name` for good: every range taken from now on is refused (Exhausted),
        and its numbers are never handed out again (its floor moves past its maximum, and a
        floor only moves up). Generators holding ranges serve them out first."""
        key = self.key(name)
        return self.raise_floor(name, key.last_id + 1)

    def take(self, name: str, count: int, *, stripe: int | None = None) -> Range:
        """Take `count` ids as one range straight from the store (fewer at a bounded key's end,
        or a stripe's), from stripe `stripe` of a striped key, or one the store chooses (any
        stripe with ids left: see allocate_any); the range's stride is the key's stripes.
        No buffering: for one-off batches and for handing ranges to clients."""
        check_count(count)
        return allocate_any(self.ranges, check_key_name(name), count, stripe=stripe).range

    def segment(self, name: str, options: SegmentOptions | None = None) -> SegmentGenerator:
        """The segment generator of a key: one per key and minter, made on first call (the
        options apply then). An unknown key raises KeyNotFound on the first `next_id()`."""
        check_key_name(name)
        with self._lock:
            if self._closed:
                raise Closed("the minter is closed")
            gen = self._segments.get(name)
            if gen is None or gen.closed:
                gen = SegmentGenerator(self.ranges, name, options or self.segment_options)
                self._segments[name] = gen
            return gen

    def async_segment(self, name: str, options: SegmentOptions | None = None) -> AsyncSegment:
        """The key's segment generator for asyncio code (aio.py): `await
        minter.async_segment("order").next_id()` waits for the store, when nothing is buffered,
        without blocking the event loop. The same generator as segment(name)."""
        return AsyncSegment(self.segment(name, options))

    def snowflake(
        self,
        layout: str | Layout = "twitter",
        options: SnowflakeOptions | None = None,
        *,
        worker_id: int | None = None,
        state: str | None = None,
    ) -> SnowflakeGenerator:
        """A snowflake generator with a worker id leased from the store. Close it to release
        the worker id.

        `worker_id=N` claims that worker id statically: the store reserves it (it never leases
        it to anyone else from then on) and refuses a second holder with WorkerInUse. With
        `state=PATH` too, a local state file also keeps this worker's horizon (it outlives a
        store that loses its data); a minter without a lease store fences a static worker id
        by the state file alone, which cannot see other hosts."""
        store: LeaseStore
        if worker_id is None:
            if state:
                raise InvalidArgument("a state file is for a static worker id (worker_id=N)")
            if self.lease_store is None:
                raise InvalidArgument(f"store {self.url} keeps no worker leases")
            store = self.lease_store
        elif state:
            local = StaticLeaseStore(worker_id, state)
            store = local if self.lease_store is None else StateFileLeases(self.lease_store, local)
        elif self.lease_store is None:
            raise InvalidArgument(
                f"store {self.url} keeps no worker leases: a static worker id needs a state "
                "file (state=PATH)"
            )
        else:
            store = self.lease_store
        with self._lock:
            if self._closed:
                raise Closed("the minter is closed")
        # The store's cells keep the longest lease ttl of the namespace's holders, which a
        # newcomer waits out after a fence (strategies/snowflake.py: record_ttl). A state
        # file alone has no store to record in.
        engine = self.engine if self.lease_store is not None else None
        cells = engine.cas() if engine is not None and engine.has("cas") else None
        gen = SnowflakeGenerator(store, layout, options, worker_id=worker_id, ttl_cells=cells)
        with self._lock:
            self._snowflakes.append(gen)
        return gen

    # -- datacenter keys (Farfetch's design: strategies/datacenter.py) ------------------------

    def _global_level(self) -> DatacenterRanges:
        """The datacenter keys' global level: this minter's store when it serves a
        datacenter, else one made on the engine's cells."""
        if isinstance(self.store, DatacenterRanges):
            return self.store
        return self.datacenters()

    def datacenters(
        self, dc: str | None = None, *, dc_store: str | None = None
    ) -> DatacenterRanges:
        """Datacenter keys on this minter's store (the global level) served through datacenter
        `dc`, whose own store is `dc_store` (on Cassandra, by default: the same cluster at
        LOCAL_SERIAL in `dc`). Without `dc`, the global level alone: keys, sizing, status.
        One per datacenter and minter, closed with it."""
        if dc is not None:
            check_dc_name(dc)
        with self._lock:
            if self._closed:
                raise Closed("the minter is closed")
            made = self._datacenters.get((dc or "", dc_store))
            if made is None:
                made = open_datacenter(self.engine, dc, dc_store, self.timeout)
                self._datacenters[(dc or "", dc_store)] = made
            return made

    def datacenter(
        self,
        name: str,
        dc: str,
        *,
        dc_store: str | None = None,
        options: SegmentOptions | None = None,
    ) -> SegmentGenerator:
        """The generator of datacenter key `name` for processes in datacenter `dc`: ranges from
        the datacenter's reservation, which it refills from the global level in the
        background. Keeps serving while the global level is out of reach, until the
        reservation and the preloaded range are spent (then RunwaySpent)."""
        check_key_name(name)
        store = self._kind_checked(self.datacenters(dc, dc_store=dc_store), DATACENTER)
        with self._lock:
            gen = self._dc_generators.get((name, dc, dc_store))
            if gen is None or gen.closed:
                gen = SegmentGenerator(store, name, options or self.segment_options)
                self._dc_generators[(name, dc, dc_store)] = gen
            return gen

    def add_datacenter_key(
        self,
        name: str,
        *,
        step: int = DEFAULT_STEP,
        start: int = DEFAULT_FIRST_ID,
        max: int = ID_MAX,
        description: str = "",
        sizing: ReservationSizing | None = None,
    ) -> Key:
        """Create a datacenter key: ids from `start` to `max` (2**31 - 1 for a 32-bit key),
        handed to datacenters in reservations sized by `sizing` (by default enough for 24 hours
        at each datacenter's rate, preloaded at 50%), and to processes `step` at a time."""
        check_key_name(name)
        check_key_bounds(step, start, max)
        if len(description) > 256:
            raise InvalidArgument("description must be at most 256 characters")
        if self.keyspace is not None:
            self.keyspace.claim(name, DATACENTER)
        return self._global_level().add_key(
            name, step=step, first_id=start, last_id=max, description=description, sizing=sizing
        )

    # -- quorum keys (antirez's algorithm: strategies/quorum.py) ------------------------------

    def _keys_of_every_kind(self) -> KeySpace:
        if self.keyspace is None:
            raise InvalidArgument(
                "quorum keys are made and found in a store: use a minter made by idmint.connect()"
            )
        return self.keyspace

    def add_quorum_key(
        self,
        name: str,
        *,
        start: int = DEFAULT_FIRST_ID,
        max: int = ID_MAX,
        description: str = "",
        exist_ok: bool = False,
    ) -> QuorumKey:
        """Make quorum key `name`, whose ids run from `start` to `max`, in this store (its counters
        live on the nodes it is served from: see quorum()). Raises KeyExists (with `exist_ok`,
        only when it exists with other bounds), NameTaken if the name is a key of another kind."""
        check_key_name(name)
        check_key_bounds(1, start, max)
        if len(description) > 256:
            raise InvalidArgument("description must be at most 256 characters")
        return self._keys_of_every_kind().add_quorum_key(
            name, start=start, max=max, description=description, exist_ok=exist_ok
        )

    def quorum_key(self, name: str) -> QuorumKey:
        """Quorum key `name` as its admin made it. Raises KeyNotFound (WrongKind when the name
        is a key of another kind)."""
        return self._keys_of_every_kind().quorum_key(check_key_name(name))

    def quorum_keys(self) -> list[QuorumKey]:
        """Every quorum key of this store, sorted by name."""
        return self._keys_of_every_kind().quorum_keys()

    def quorum(
        self, name: str, nodes: list[str], options: QuorumOptions | None = None
    ) -> QuorumGenerator:
        """Quorum key `name` (made with add_quorum_key in this minter's store, which keeps its
        bounds) served from `nodes` (store URLs of independent servers, an odd number, 3 or
        more, where its counters live): each id above every id of the key handed out before
        the call began, by any caller. Checks the nodes that answer now (InvalidArgument for
        one that does not fsync each write, see QuorumOptions.unsafe; or that is replicated,
        see QuorumOptions.replicated_nodes). One per key and node
        list, closed with the minter; the keys of one node list share its connections and
        threads. Raises KeyNotFound (WrongKind) for a name that is no quorum key."""
        with self._quorum_lock:  # one generator per key and nodes, even when asked at once
            with self._lock:
                if self._closed:
                    raise Closed("the minter is closed")
                made = self._quorums.get((name, tuple(nodes)))
                if made is not None and not made.closed:
                    return made
            key = self.quorum_key(name)
            bounded = replace(options or QuorumOptions(), start=key.start, max=key.max)
            node_set = self._node_set(nodes, bounded)
            try:
                made = checked_quorum(name, node_set, bounded)
            except InvalidArgument:
                # A set no key could use (a node unsafe, replicated, or named twice) is not
                # kept: the next call looks at the nodes afresh, once the operator has fixed
                # them.
                if not any(q.counter.nodes is node_set for q in self.quorums()):
                    with self._lock:
                        self._node_sets = {
                            k: v for k, v in self._node_sets.items() if v is not node_set
                        }
                    node_set.close()
                raise
            with self._lock:
                self._quorums[(name, tuple(nodes))] = made
            return made

    def _node_set(self, nodes: list[str], options: QuorumOptions) -> QuorumNodeSet:
        """The shared node set of `nodes` (opened on first use; the caller holds _quorum_lock)."""
        if isinstance(nodes, str):
            raise InvalidArgument("nodes is a list of store URLs, not one string")
        index = (tuple(nodes), options.unsafe, options.replicated_nodes, options.recheck)
        with self._lock:
            made = self._node_sets.get(index)
        if made is None or made.closed:
            made = _open_node_set(nodes, options, timeout=self.timeout)
            with self._lock:
                self._node_sets[index] = made
        return made

    def quorums(self) -> list[QuorumGenerator]:
        """The quorum keys opened so far, for metrics."""
        with self._lock:
            return list(self._quorums.values())

    def generators(self) -> list[SegmentGenerator]:
        """The generators made so far, for metrics."""
        with self._lock:
            return list(self._segments.values())

    def close(self, timeout: float = CLOSE_TIMEOUT) -> list[tuple[str, Range]]:
        """Close every generator (giving unused tails back), then the store, within `timeout`
        seconds whatever the store does. Returns the (key, range) pairs that did not go back:
        those ids are skipped, never reused. Generators still waiting for the store when the
        time is up are left to finish on their own, and the log says so."""
        with self._lock:
            self._closed = True
            generators, self._segments = list(self._segments.values()), {}
            generators += self._dc_generators.values()
            self._dc_generators = {}
            datacenters, self._datacenters = list(self._datacenters.values()), {}
            flakes, self._snowflakes = self._snowflakes, []
            quorums, self._quorums = list(self._quorums.values()), {}
            node_sets, self._node_sets = list(self._node_sets.values()), {}
        kept: list[tuple[str, Range]] = []

        def finish() -> None:
            for gen in generators:
                kept.extend((gen.key, r) for r in gen.close())
            for flake in flakes:
                flake.close()
            for quorum in quorums:
                quorum.close()
            for node_set in node_sets:
                node_set.close()

        # On a thread: a hung store (socket open, no answer) must not hang the caller, and a
        # thread stuck in a driver call cannot be interrupted, only left behind.
        closer = threading.Thread(target=finish, name="idmint-close", daemon=True)
        closer.start()
        closer.join(timeout)
        if closer.is_alive():
            log.warning(
                "store %s did not answer within %g s while closing: %d generators were still "
                "giving back their unused ids (they go back if the store answers later and "
                "nobody allocated after them; else they are skipped, never reused)",
                self.url,
                timeout,
                len(generators) + len(flakes),
            )
        elif kept:
            log.info(
                "closed; not given back (skipped, never reused): %s",
                ", ".join(f"{key} [{r.start}, {r.stop})" for key, r in kept[:10]),
            )
        self.store.close()
        for made in datacenters:
            made.close()
        if self.lease_store is not None:
            self.lease_store.close()
        if self.engine is not None:
            self.engine.close()
        return list(kept)

    def __enter__(self) -> Minter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_datacenter(
    engine: Engine | None, dc: str | None, dc_store: str | None, timeout: float
) -> DatacenterRanges:
    """The datacenter keys of `engine` (their global level) served through datacenter `dc`,
    whose own store is `dc_store`, or the engine's own cluster where it spans datacenters
    (Cassandra). Without `dc`, the global level alone."""
    if engine is None:
        raise InvalidArgument("datacenter keys need a minter made by idmint.connect()")
    global_cas = engine.cas()
    if getattr(global_cas, "datacenter_local", False):
        raise InvalidArgument(
            f"{engine.display_url}: the global level of datacenter keys needs serial=SERIAL; "
            "at LOCAL_SERIAL two datacenters can both take the same reservation"
        )
    if dc is None:
        if dc_store is not None:
            raise InvalidArgument("a datacenter's store (dc_store) needs its name (dc)")
        return DatacenterRanges(global_cas)
    if dc_store is None:
        return DatacenterRanges(global_cas, engine.local_cas(dc), dc)
    local = open_engine(dc_store, timeout=timeout).cas()
    if getattr(local, "datacenter_local", False) and getattr(local, "datacenter", None) != dc:
        # LOCAL_SERIAL in another datacenter (or in whichever one the driver reaches): its
        # rounds would run in a Paxos group apart from this datacenter's own.
        named = getattr(local, "datacenter", None)
        where = f"datacenter {named!r}" if named else "whichever datacenter it reaches (no ?dc=)"
        local.close()
        raise InvalidArgument(
            f"datacenter {dc!r}: its store {local.display_url} decides at LOCAL_SERIAL in "
            f"{where}, not in {dc!r}: give ?dc={dc}"
        )
    return DatacenterRanges(global_cas, local, dc)


def open_quorum(
    name: str,
    nodes: list[str],
    options: QuorumOptions | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
) -> QuorumGenerator:
    """Quorum key `name` on the store URLs `nodes` (see Minter.quorum), each call to a node
    bounded by `timeout` seconds, with the bounds `options` gives: the building block under
    Minter.quorum, for callers that keep their quorum keys' names and bounds themselves (no
    store checks that the name is a quorum key). The caller closes it."""
    check_key_name(name)
    if isinstance(nodes, str):
        raise InvalidArgument("nodes is a list of store URLs, not one string")
    opened = [open_engine(url, timeout=timeout).quorum() for url in nodes]
    return checked_quorum(name, opened, options)


def _open_node_set(nodes: list[str], options: QuorumOptions, *, timeout: float) -> QuorumNodeSet:
    check_nodes(nodes)  # before opening anything
    opened = [open_engine(url, timeout=timeout).quorum() for url in nodes]
    return QuorumNodeSet(
        opened,
        unsafe=options.unsafe,
        recheck=options.recheck,
        replicated_nodes=options.replicated_nodes,
    )


def connect(
    url: str | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    segment_options: SegmentOptions | None = None,
    dc: str | None = None,
    dc_store: str | None = None,
) -> Minter:
    """Open a Minter on a store URL: sqlite:///path, postgresql://..., mysql://...,
    redis://..., etcd://..., zk://..., cassandra://..., memory://.

    The default is $IDMINT_STORE, then sqlite:///./idmint.db. Connecting is lazy: an
    unreachable store is reported by the first call that needs it.

    With `dc`, the minter serves datacenter keys instead of segment keys, as datacenter `dc`
    (the URL is the global level; `dc_store` the datacenter's own store, by default the same
    Cassandra cluster at LOCAL_SERIAL): `segment(name)`, `take()` and the keys' methods work
    on datacenter keys, and ids keep coming while the global level is out of reach.
    """
    engine = open_engine(url, timeout=timeout)
    store: RangeStore = engine.ranges()
    if dc is not None or dc_store is not None:
        store = open_datacenter(engine, dc, dc_store, timeout)
    return Minter(
        store,
        segment_options=segment_options,
        lease_store=engine.leases(),
        engine=engine,
        timeout=timeout,
        keyspace=KeySpace(engine.cas(), engine.ranges()),
    )
