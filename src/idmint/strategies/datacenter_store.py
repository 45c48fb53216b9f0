"""The base of DatacenterRanges (datacenter.py): the stores of both levels, this process's state
and counts, reading and swapping cells, the binding of a datacenter's name to its store, and
reservations: a grant in the global cell, then its application to the datacenter's cell (each a
compare-and-set), taken at once or preloaded in the background on the refill pool before the
datacenter runs dry, retried while the global level is out of reach.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TypeVar

from .._errors import (
    DatacenterRetired,
    Exhausted,
    IdmintError,
    InvalidArgument,
    KeyNotFound,
    LostReservations,
    StoreUnavailable,
)
from .._fork import ForkAware
from ..stores.base import CasStore
from ..stores.over_cas.loop import Backoff, cas_update
from .datacenter_cells import (
    RESERVE_ROUNDS,
    GlobalRow,
    Grant,
    LocalRow,
    carve,
    check_dc_name,
    global_cell,
    local_cell,
)
from .refills import RefillPool, shared_pool

log = logging.getLogger("idmint.datacenter")

T = TypeVar("T")


@dataclass(frozen=True)
class GlobalLevel:
    """Whether this process's last call to the global store answered (probes report it beside
    readiness: a datacenter cut off from it serves on its reservation)."""

    reachable: bool | None  # None: not asked yet
    since: float | None  # time.time() when it last changed
    error: str | None  # why the last call failed

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class DatacenterCounts:
    """What the datacenter level did in this process, for stats and /metrics."""

    global_cas: int = 0  # swaps tried on global cells (won or lost)
    global_conflicts: int = 0
    local_conflicts: int = 0
    grants: int = 0  # reservations this process took from the global level
    preload_failures: int = 0  # background grants that failed (the global store out of reach)
    runway_spent: int = 0  # allocations refused with RunwaySpent


def _now_ms() -> int:
    return int(time.time() * 1000)


class DatacenterCellStore(ForkAware):
    """See the module doc. `allocate` starts the background preload once `preload_at` of a
    reservation is handed out."""

    def __init__(
        self,
        global_cas: CasStore,
        local_cas: CasStore | None = None,
        dc: str | None = None,
        *,
        backoff: Backoff | None = None,
        clock_ms: Callable[[], int] = _now_ms,
        pool: RefillPool | None = None,
    ) -> None:
        if (dc is None) != (local_cas is None):
            raise InvalidArgument("a datacenter needs both its name and its store")
        self._dc = None if dc is None else check_dc_name(dc)
        self.global_cas = global_cas
        self._local_cas = local_cas
        self.display_url = global_cas.display_url
        if local_cas is not None and local_cas is not global_cas:
            self.display_url += f" (datacenter {dc}: {local_cas.display_url})"
        self.backoff = backoff or Backoff()
        self.counts = DatacenterCounts()
        self._clock_ms = clock_ms
        self._pool = pool or shared_pool()
        self._lock = threading.Lock()
        self._preloading: set[str] = set()
        self._spent_until: dict[str, float] = {}  # key -> monotonic time: global space gone
        self._seen: dict[str, LocalRow] = {}  # key -> its cell as this process last wrote it
        self._local_id: dict[str, str] | None = None  # the local store, as bindings name it
        self._bare_id: str | None = None  # its identity alone, as bindings before scopes did
        self.global_level = GlobalLevel(None, None, None)
        self._stopping = threading.Event()
        self._watch_fork()

    @property
    def serves(self) -> str | None:
        """The datacenter this store serves, None for the global level alone."""
        return self._dc

    @property
    def dc(self) -> str:
        """The datacenter this store serves."""
        if self._dc is None:
            raise InvalidArgument(
                "which datacenter? Datacenter keys hand out ids through a datacenter: give "
                "its name (--dc, IDMINT_DC, dc=)"
            )
        return self._dc

    @property
    def local_cas(self) -> CasStore:
        """The datacenter's store."""
        if self._local_cas is None:
            self.dc  # noqa: B018 - raises InvalidArgument: no datacenter was given
        assert self._local_cas is not None
        return self._local_cas

    def _after_fork(self) -> None:
        # The parent's background grants are the parent's; the child starts its own.
        self._lock = threading.Lock()
        self._preloading = set()
        self._stopping = threading.Event()
        self._seen = {}  # the child has served nothing yet

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.counts, name, getattr(self.counts, name) + delta)

    # -- cells -------------------------------------------------------------------------------

    def _global_call(self, call: Callable[[], T]) -> T:
        """A call to the global store, its outcome kept in `global_level`."""
        try:
            got = call()
        except StoreUnavailable as exc:
            self._global_answered(" ".join(str(exc).split()))
            raise
        self._global_answered(None)
        return got

    def _global_answered(self, error: str | None) -> None:
        was = self.global_level
        since = was.since if was.reachable is (error is None) else time.time()
        self.global_level = GlobalLevel(error is None, since, error)

    def _read_global(self, name: str) -> tuple[GlobalRow, int]:
        got = self._global_call(lambda: self.global_cas.read(global_cell(name)))
        if got is None:
            raise KeyNotFound(name)
        return GlobalRow.decode(got[0]), got[1]

    def _read_local(self, name: str) -> tuple[LocalRow, int] | None:
        got = self.local_cas.read(local_cell(name, self.dc))
        return None if got is None else (LocalRow.decode(got[0]), got[1])

    def _update(
        self,
        name: str,
        what: str,
        attempt: Callable[[], tuple[int | None, str | None, T]],
        *,
        on_global: bool,
    ) -> T:
        """Compare-and-set loop on the key's global cell, or on this datacenter's cell of it
        (named after `what` in messages): `attempt` reads what it needs and returns (the
        version to swap against, or None to create the cell; the new value, or None to write
        nothing; the result): cas_update, with this level's counts."""
        if on_global:
            cas, cell = self.global_cas, global_cell(name)
        else:
            cas, cell = self.local_cas, local_cell(name, self.dc)
            what = f"{what} {cell}"

        def counted() -> tuple[int | None, str | None, T]:
            got = attempt()
            if on_global and got[1] is not None:
                self._count(global_cas=1)
            return got

        conflicts = "global_conflicts" if on_global else "local_conflicts"
        return cas_update(
            cas,
            cell,
            counted,
            self.backoff,
            f"{what} ({cas.display_url})",
            lambda: self._count(**{conflicts: 1}),
        )[0]

    def _local_store(self) -> dict[str, str]:
        """This datacenter's store as the global cell binds it: its identity (its URL for a
        store without one) and its URL for messages."""
        if self._local_id is None:
            identity = self.local_cas.identity()
            url = self.local_cas.display_url
            self._bare_id = identity.id if identity is not None else url
            # One Cassandra keyspace decided at SERIAL, or at LOCAL_SERIAL in one datacenter or
            # another, is as many stores: each Paxos group decides the cell apart from the
            # others (seed 1 of bench/torture.py --setup cassandra-2dc --unsafe repeated ids so).
            scope = getattr(self.local_cas, "decided_in", None)
            shown = self._bare_id if scope is None else f"{self._bare_id} ({scope})"
            self._local_id = {"id": shown, "url": url}
        return self._local_id

    def _scoped(self, name: str, got: tuple[LocalRow, int]) -> tuple[LocalRow, int]:
        """The datacenter's cell as read (and its version), stamped with this process's store
        for its next write; InvalidArgument if another store wrote it last. The binding in the
        global cell is checked only with a grant: a process on another store (or another Paxos
        group of the keyspace) would serve the cell's reservation beside the datacenter's own
        until its next grant (the torture harness's cassandra-2dc control, issue 32)."""
        row, version = got
        mine = self._local_store()["id"]
        if row.scope == mine:
            return got
        if row.scope:
            raise InvalidArgument(
                f"datacenter {self.dc!r} of key {name!r}: its cell in "
                f"{self.local_cas.display_url} was last written through store {row.scope}, not "
                f"this process's {mine}: two stores under one datacenter name would serve the "
                f"same reservations. {self._two_stores_hint(name)}"
            )
        return replace(row, scope=mine), version  # a cell from before scopes: ours from now

    def _check_bound(self, name: str, top: GlobalRow) -> bool:
        """Whether the global cell binds this datacenter to a store yet; InvalidArgument if it
        binds it to another store than this process's."""
        bound = top.stores.get(self.dc)
        if bound is None:
            return False
        mine = self._local_store()
        if bound["id"] == self._bare_id != mine["id"]:
            return False  # bound before bindings named the scope: this grant binds it anew
        if bound["id"] != mine["id"]:
            raise InvalidArgument(
                f"datacenter {self.dc!r} of key {name!r} keeps its cell in {bound['url']} "
                f"(store {bound['id']}), not in {mine['url']} (store {mine['id']}): two stores "
                "under one datacenter name would serve the same reservations (or its store lost "
                f"its data, and with it its identity). {self._two_stores_hint(name)}"
            )
        return True

    def _two_stores_hint(self, name: str) -> str:
        """What to do when a datacenter's cell or binding names another store than this
        process's (the end of both refusals)."""
        return (
            "Check --dc and --dc-store (IDMINT_DC, IDMINT_DC_STORE); to move the datacenter to "
            "this store on purpose, once no process serves from the other: "
            f"`idmint dc reset {name} --dc {self.dc} --dc-store URL`"
        )

    def _local_row(self, name: str) -> tuple[LocalRow, int]:
        """The datacenter's cell of `name` and its version, made on first use (before the
        datacenter's first grant: a grant is only ever made for a cell that exists).

        So a cell missing after the global cell showed its datacenter a grant (not given
        back) was lost: starting afresh could repeat the ids it handed out. The cell is read
        again after the global one: another process may have made it and taken the grant
        between the first read and the global one.

        The cell is made before the global cell binds the datacenter to this store: the first
        grant binds it, in the same compare-and-set (_grant), so first use costs no global
        write of its own. A cell holds nothing to serve until a grant is applied to it, and
        every grant checks the binding: a cell made in a second store under this name (both
        made before either was bound) serves no id."""
        for _ in range(RESERVE_ROUNDS):
            got = self._read_local(name)
            if got is not None:
                return self._scoped(name, got)
            top, _ = self._read_global(name)
            got = self._read_local(name)
            if got is not None:
                return self._scoped(name, got)
            self._check_bound(name, top)  # another store under this name: say so first
            grant = top.grants.get(self.dc)
            done = top.returned.get(self.dc, 0)
            if grant is not None and grant.seq > done:
                raise LostReservations(
                    f"datacenter {self.dc!r} has no cell for key {name!r} in "
                    f"{self.local_cas.display_url}, but the global store gave it {grant.seq} "
                    "reservations: its store lost data (or is not the one it used), and ids "
                    "it handed out may repeat. Once no process serves the old reservations, "
                    f"abandon them with `idmint dc reset {name} --dc {self.dc}`"
                )
            row = LocalRow.new(self.dc, top, done, self._clock_ms(), self._local_store()["id"])
            self.local_cas.create(local_cell(name, self.dc), row.encode())
        raise StoreUnavailable(  # made (by us or another) and still not there to read
            f"datacenter {self.dc!r}: its cell of key {name!r} in {self.local_cas.display_url} "
            f"was made {RESERVE_ROUNDS} times and never read back"
        )

    # -- reservations ------------------------------------------------------------------------

    def reserve(self, name: str, *, dry: bool = False) -> bool:
        """Give this datacenter its next reservation unless it has one preloaded (with `dry`,
        unless it has anything to serve): a grant from the global cell, then applied to the
        datacenter's cell. False if none was needed. Raises Exhausted when the key has no ids
        left to reserve, StoreUnavailable when a store does not answer."""
        self._check_fork()
        for _ in range(RESERVE_ROUNDS):
            row, _ = self._local_row(name)
            if row.retired:
                raise DatacenterRetired(name, self.dc)
            # `dry`: a process that found the cell spent. Another process of the datacenter
            # may have applied a grant since: it serves that, and the next grant is the
            # preload's, at preload_at (granted here, it would be a second global write).
            if row.preloaded is not None or (dry and row.next < row.stop):
                return False
            got = self._grant(name, row)
            if got is not None and self._apply(name, *got):
                return True
        raise LostReservations(
            f"datacenter {self.dc!r} could not apply a grant of key {name!r} in "
            f"{RESERVE_ROUNDS} rounds: its cell says it applied grant {row.applied}, the "
            "global cell says it was given a later one. Its store lost data (restored from an "
            "older copy?), and ids it handed out may repeat. Once no process serves the old "
            f"reservations, abandon them with `idmint dc reset {name} --dc {self.dc}`"
        )

    def _grant(self, name: str, row: LocalRow) -> tuple[Grant, GlobalRow] | None:
        """The grant numbered row.applied + 1 (with the global row it is in): the one already
        recorded (a crash or another process got there first), or a new one taken from the
        global cell. None when the global cell shows a later grant (the datacenter's cell we
        read is old: another process applied since) or has it given back."""
        want = row.applied + 1
        now = self._clock_ms()

        def grant() -> tuple[int | None, str | None, tuple[Grant, GlobalRow] | None]:
            top, version = self._read_global(name)
            if top.uid != row.uid:
                raise LostReservations(
                    f"key {name!r} was made again in the global store "
                    f"({self.global_cas.display_url}) after datacenter {self.dc!r} took "
                    "reservations of it: the new key's reservations could repeat the old one's "
                    f"ids. Abandon the old one with `idmint dc reset {name} --dc {self.dc}`"
                )
            bound = self._check_bound(name, top)
            last = top.grants.get(self.dc)
            if top.returned.get(self.dc, 0) >= want or (last is not None and last.seq > want):
                return version, None, None
            if last is not None and last.seq == want:
                return version, None, (last, top)
            rate = row.rate(now)
            start, stop, free, next_ = carve(top, top.sizing.size(rate))
            if start is None:
                with self._lock:
                    self._spent_until[name] = time.monotonic() + 1.0
                raise Exhausted(name, top.last_id)
            new = Grant(want, start, stop, now, rate)
            top = replace(top, next=next_, free=free, grants={**top.grants, self.dc: new})
            if not bound:  # the datacenter's first grant (or its cell predates bindings)
                top = replace(top, stores={**top.stores, self.dc: self._local_store()})
            return version, top.encode(), (new, top)

        return self._update(
            name,
            f"reserve ids of {name} for {self.dc}",
            grant,
            on_global=True,
        )

    def _apply(self, name: str, grant: Grant, top: GlobalRow) -> bool:
        """Put `grant` in the datacenter's cell if the cell has applied the grant before it:
        as the reservation when the current one is spent, else as the preloaded one. The
        cell takes the key's settings from `top` too."""

        def apply() -> tuple[int | None, str | None, bool]:
            row, version = self._local_row(name)
            if row.applied != grant.seq - 1 or row.retired:
                return version, None, False
            if row.next >= row.stop and row.preloaded is None:
                row = replace(
                    row, start=grant.start, stop=grant.stop, next=grant.start, serving=grant.seq
                )
            else:
                row = replace(row, preloaded=(grant.start, grant.stop))
            row = replace(row, applied=grant.seq, updated_ms=self._clock_ms()).settled(top)
            written.append(row)
            return version, row.encode(), True

        written: list[LocalRow] = []
        applied = self._update(name, "apply a grant to", apply, on_global=False)
        if applied:
            self._seen[name] = written[-1]
            self._count(grants=1)
            log.info(
                "key %r: datacenter %s reserved [%d, %d) (grant %d)",
                name,
                self.dc,
                grant.start,
                grant.stop,
                grant.seq,
            )
        return applied

    def _preload_in_background(self, name: str) -> None:
        """Queue a background grant for `name` on the refill pool unless one is under way in
        this process (or the key's global space was found spent a moment ago). It retries while
        the global store is out of reach, until the grant is in or this store closes."""
        with self._lock:
            if name in self._preloading or self._stopping.is_set():
                return
            if self._spent_until.get(name, 0.0) > time.monotonic():
                return
            self._preloading.add(name)
        self._pool.submit(_Preload(self, name))

    def _preload_due(self, name: str) -> float:
        """When the datacenter's reservation of `name` runs dry at its rate, as this process
        last saw it (now if it cannot tell). Takes no lock (see RefillJob)."""
        now = time.monotonic()
        row = self._seen.get(name)
        rate = row.rate(self._clock_ms()) if row is not None else None
        return now + row.left / rate if row is not None and rate else now

    def _preload(self, name: str, delay: float) -> float | None:
        """One try of a background grant: None when done, else seconds until the next try."""
        again: float | None = None
        try:
            if not self._stopping.is_set():
                self.reserve(name)
        except (Exhausted, KeyNotFound, InvalidArgument, LostReservations) as exc:
            # Asking again will not help; the process that runs dry says why.
            log.error("key %r: datacenter %s cannot preload: %s", name, self.dc, exc)
        except IdmintError as exc:  # StoreUnavailable: cut off, or a store is down
            self._count(preload_failures=1)
            log.warning(
                "key %r: datacenter %s cannot preload its next reservation, retrying in %.1f s: %s",
                name,
                self.dc,
                delay,
                exc,
            )
            again = delay
        except Exception:  # an unmapped driver error: report it, keep trying
            self._count(preload_failures=1)
            log.exception("key %r: datacenter %s: preload failed", name, self.dc)
            again = delay
        if again is None or self._stopping.is_set():
            with self._lock:
                self._preloading.discard(name)
            return None
        return again


class _Preload:
    """A background grant of one key, as a refill pool job, with its back-off."""

    __slots__ = ("delay", "name", "ranges")

    def __init__(self, ranges: DatacenterCellStore, name: str) -> None:
        self.ranges, self.name, self.delay = ranges, name, 0.1

    def refill_due(self) -> float:
        return self.ranges._preload_due(self.name)

    def run_refill(self) -> float | None:
        again = self.ranges._preload(self.name, self.delay)
        if again is not None:
            self.delay = min(self.delay * 2, 30.0)
        return again
