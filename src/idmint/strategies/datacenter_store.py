"""The state of a datacenter store and its calls to the two levels' cells (see
datacenter.py): the stores, the counts and the global level's reachability, reading and
swapping a cell with this level's counts, and the binding of a datacenter's name to its store.

DatacenterRanges is built on this in three parts, one job each: this module (how the cells
are read and written), datacenter_grants.py (how a datacenter takes reservations from the
global level, at once or in the background) and datacenter_admin.py (keys, and what an
operator does to a datacenter: status, retire, reopen, reset). What processes call on the
path that hands out ids (allocate, give_back) stays in datacenter.py, beside the design it
implements.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TypeVar

from .._errors import InvalidArgument, KeyNotFound, LostReservations, StoreUnavailable
from .._fork import ForkAware
from ..stores.base import CasStore
from ..stores.over_cas.loop import Backoff, cas_update
from .datacenter_cells import (
    RESERVE_ROUNDS,
    GlobalRow,
    LocalRow,
    check_dc_name,
    global_cell,
    local_cell,
)
from .refills import RefillPool, shared_pool

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


# -- the store's state and cells ---------------------------------------------------------------


class DatacenterCellStore(ForkAware):
    """The base of DatacenterRanges (see its doc): the stores of both levels, this process's
    state and counts, and the calls that read and swap the cells."""

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
        cas: CasStore,
        cell: str,
        what: str,
        attempt: Callable[[], tuple[int | None, str | None, T]],
        *,
        on_global: bool,
    ) -> T:
        """Compare-and-set loop: `attempt` reads what it needs and returns (the version to
        swap against, or None to create the cell; the new value, or None to write nothing;
        the result): cas_update, with this level's counts."""

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
            self._local_id = {"id": identity.id if identity is not None else url, "url": url}
        return self._local_id

    def _check_bound(self, name: str, top: GlobalRow) -> bool:
        """Whether the global cell binds this datacenter to a store yet; InvalidArgument if it
        binds it to another store than this process's."""
        bound = top.stores.get(self.dc)
        if bound is None:
            return False
        mine = self._local_store()
        if bound["id"] != mine["id"]:
            raise InvalidArgument(
                f"datacenter {self.dc!r} of key {name!r} keeps its cell in {bound['url']} "
                f"(store {bound['id']}), not in {mine['url']} (store {mine['id']}): two stores "
                "under one datacenter name would serve the same reservations (or its store lost "
                "its data, and with it its identity). Check --dc and "
                "--dc-store (IDMINT_DC, IDMINT_DC_STORE); to move the datacenter to this store "
                f"on purpose, once no process serves from the other: `idmint dc reset {name} "
                f"--dc {self.dc} --dc-store URL`"
            )
        return True

    def _bind(self, name: str) -> GlobalRow:
        """Bind this datacenter's name to its store in the global cell, unless it is bound to
        it already (InvalidArgument if bound to another). Returns the global cell."""

        def attempt() -> tuple[int | None, str | None, GlobalRow]:
            top, version = self._read_global(name)
            if self._check_bound(name, top):
                return version, None, top
            top = replace(top, stores={**top.stores, self.dc: self._local_store()})
            return version, top.encode(), top

        return self._update(
            self.global_cas, global_cell(name), f"bind {self.dc} of {name}", attempt, on_global=True
        )

    def _local_row(self, name: str) -> tuple[LocalRow, int]:
        """The datacenter's cell of `name` and its version, made on first use (before the
        datacenter's first grant: a grant is only ever made for a cell that exists).

        So a cell missing after the global cell showed its datacenter a grant (not given
        back) was lost: starting afresh could repeat the ids it handed out. The cell is read
        again after the global one: another process may have made it and taken the grant
        between the first read and the global one."""
        for _ in range(RESERVE_ROUNDS):
            got = self._read_local(name)
            if got is not None:
                return got
            top, _ = self._read_global(name)
            got = self._read_local(name)
            if got is not None:
                return got
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
            top = self._bind(name)  # before the cell exists: nothing served from another store
            row = LocalRow.new(self.dc, top, done, self._clock_ms())
            self.local_cas.create(local_cell(name, self.dc), row.encode())
        raise StoreUnavailable(  # made (by us or another) and still not there to read
            f"datacenter {self.dc!r}: its cell of key {name!r} in {self.local_cas.display_url} "
            f"was made {RESERVE_ROUNDS} times and never read back"
        )
