"""Datacenter ranges (Farfetch's design): ids that keep coming while a datacenter is cut off.

Two levels of compare-and-set cells, each on a CasStore of its own:

- the **global** store (Cassandra at SERIAL, or a global etcd cluster, or one database) keeps
  one cell per key, `dc/NAME`: the key's bounds and settings, `next` (the lowest integer no
  datacenter was ever given), ranges given back by retired datacenters, and each datacenter's
  latest *grant* (a numbered reservation);
- each datacenter's **local** store (Cassandra at LOCAL_SERIAL, or the datacenter's own etcd
  cluster or database) keeps one cell per key and datacenter, `dc/NAME@DC`: the reservation it
  is serving, the one it preloaded, and `next` (the seed's last_integer + 1), which processes
  move with small compare-and-sets when they take a range.

A datacenter moves a reservation from the global level to its own in two compare-and-sets: the
grant (global: `next` moves up and the grant is recorded under the datacenter's name with the
number after the last one its cell applied), then the application (local: the cell takes the
grant if it has applied exactly the grant before it). A crash between the two leaves the grant
recorded; whoever comes next applies it, once. The seed does both in one conditional batch in
one Cassandra partition; two steps let the two levels live on different engines, and keep each
cell written by one level only: the global cell only by SERIAL rounds, a datacenter's cell only
from its own datacenter. That is why LOCAL_SERIAL is enough for the local cells: no other
datacenter ever writes them.

Processes take ranges from their datacenter's cell (a SegmentGenerator over this store, with
its own background preload), so a process talks only to its local store. Both levels preload:
once `preload_at` (50%) of a datacenter's reservation is handed out, the next process to take a
range starts a background grant. A reservation is sized by time: enough for `runway` seconds at
the rate the datacenter handed out ids over the last window (two windows at most), between the
key's minimum and maximum reservation, never past the key's maximum.

A datacenter name means one local store: the global cell binds the name to its store's identity
before the datacenter's cell is first made (and checks it with every grant), so a second store
under that name (a typo in --dc-store, a region that copied IDMINT_DC) is refused before it
serves anything; `reset` moves a datacenter to another store on purpose.

When the global store is out of reach, a datacenter serves from its reservation and preloaded
range, retrying the grant in the background; when both are spent, allocations raise
RunwaySpent until the global store answers again.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from .._errors import (
    DatacenterRetired,
    Exhausted,
    IdmintError,
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    LostReservations,
    RunwaySpent,
    StoreUnavailable,
)
from .._fork import ForkAware
from ..ids import DEFAULT_FIRST_ID, Allocation, Key, Range
from ..stores import fences
from ..stores.base import CasStore, StoreIdentity
from ..stores.over_cas.loop import Backoff, cas_update
from .refills import RefillPool, shared_pool

log = logging.getLogger("idmint.datacenter")

T = TypeVar("T")

PREFIX = "dc/"
DEFAULT_RUNWAY = 24 * 3600.0
DEFAULT_WINDOW = 3600.0
DEFAULT_PRELOAD_AT = 0.5
#: The largest minimum reservation the defaults choose (a 32-bit key: 1/64 of its ids is more).
DEFAULT_MIN_RESERVATION = 10_000_000
#: Ranges given back by retired datacenters the global cell keeps (merged when adjacent).
MAX_FREE_RANGES = 64
#: Reservations one allocation may take in a row before it gives up (others emptied each).
RESERVE_ROUNDS = 10
_DC_NAME_RULE = "1 to 64 characters from A-Z a-z 0-9 . _ -"


def check_dc_name(dc: str) -> str:
    """`dc` if it is a valid datacenter name, else InvalidArgument."""
    if (
        not isinstance(dc, str)
        or not 1 <= len(dc) <= 64
        or not all(c.isascii() and (c.isalnum() or c in "._-") for c in dc)
    ):
        raise InvalidArgument(f"bad datacenter name {dc!r}: a datacenter name is {_DC_NAME_RULE}")
    return dc


def global_cell(name: str) -> str:
    return f"{PREFIX}{name}"


def local_cell(name: str, dc: str) -> str:
    return f"{PREFIX}{name}@{dc}"


def _fenced(cell: str, value: str, gap: int) -> str:
    """A cell moved up `gap` ids for a failover's fence (stores/fences.py): a global cell's
    `next` (never past one above the key's last id), a datacenter's `next` within the
    reservation it serves (never past its end: the datacenter then serves its preloaded
    range or asks the global level for more). Never down; every other field as written."""
    row = json.loads(value)
    top = int(row["next"])
    end = int(row["stop"]) if "@" in cell else int(row["last_id"]) + 1
    row["next"] = max(top, min(top + gap, end))
    return json.dumps(row, separators=(",", ":"), sort_keys=True)


fences.register(PREFIX, _fenced)


# -- the cells -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReservationSizing:
    """How a key's reservations are sized (kept in its global cell, so every datacenter sizes
    alike): enough for `runway` seconds at the datacenter's rate over the last `window`
    seconds, between `min_reservation` and `max_reservation` ids; preloaded once `preload_at`
    of the reservation is handed out."""

    runway: float = DEFAULT_RUNWAY
    min_reservation: int = 0  # 0: from the key's size (see for_key)
    max_reservation: int = 0
    preload_at: float = DEFAULT_PRELOAD_AT
    window: float = DEFAULT_WINDOW

    def check(self) -> ReservationSizing:
        for what, value in (("runway", self.runway), ("window", self.window)):
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                raise InvalidArgument(f"{what} must be a number of seconds above 0, not {value!r}")
        for what, ids in (("min", self.min_reservation), ("max", self.max_reservation)):
            if isinstance(ids, bool) or not isinstance(ids, int) or ids < 0:
                raise InvalidArgument(
                    f"{what} reservation must be a whole number of ids (0: the default), "
                    f"not {ids!r}"
                )
        if self.max_reservation and self.min_reservation > self.max_reservation:
            raise InvalidArgument(
                f"min reservation {self.min_reservation} is above max {self.max_reservation}"
            )
        if not isinstance(self.preload_at, int | float) or not 0 < self.preload_at <= 1:
            raise InvalidArgument(
                f"preload_at must be above 0 and at most 1, not {self.preload_at!r}"
            )
        return self

    def for_key(self, first_id: int, last_id: int) -> ReservationSizing:
        """These settings with the defaults of a key of [first_id, last_id] filled in: the
        minimum is 1/64 of its ids (at most 10 million), the maximum 1/8 of them."""
        space = last_id - first_id + 1
        low = self.min_reservation or max(1, min(DEFAULT_MIN_RESERVATION, space // 64))
        high = self.max_reservation or max(low, space // 8)
        return replace(self, min_reservation=low, max_reservation=max(low, high))

    def size(self, rate: float | None) -> int:
        """Ids to reserve at `rate` ids/s (None: not known yet)."""
        wanted = self.min_reservation if rate is None else math.ceil(rate * self.runway)
        return max(self.min_reservation, min(wanted, self.max_reservation))


@dataclass(frozen=True)
class Grant:
    """A reservation the global level gave a datacenter: [start, stop), number `seq`."""

    seq: int
    start: int
    stop: int
    at_ms: int
    rate: float | None = None  # the datacenter's rate when it asked (ids/s), for status

    @property
    def range(self) -> Range:
        return Range(self.start, self.stop)


@dataclass(frozen=True)
class GlobalRow:
    """A datacenter key's global cell."""

    uid: str  # new with every creation of the key: a datacenter refuses grants of another
    first_id: int
    last_id: int
    next: int  # no datacenter was ever given an integer at or above this
    step: int
    sizing: ReservationSizing
    created_ms: int
    description: str = ""
    max_batch: int = 0
    free: tuple[tuple[int, int], ...] = ()  # given back by retired datacenters, lowest first
    grants: dict[str, Grant] = field(default_factory=dict)  # each datacenter's latest
    returned: dict[str, int] = field(default_factory=dict)  # highest grant seq given back
    # Each datacenter's own store, bound at its first use: {"id": identity, "url": shown}.
    stores: dict[str, dict[str, str]] = field(default_factory=dict)

    def encode(self) -> str:
        row = asdict(self)
        row["grants"] = {dc: asdict(g) for dc, g in self.grants.items()}
        return json.dumps(row, separators=(",", ":"), sort_keys=True)

    @classmethod
    def decode(cls, value: str) -> GlobalRow:
        row = json.loads(value)
        row["sizing"] = ReservationSizing(**row["sizing"])
        row["free"] = tuple((a, b) for a, b in row.get("free", ()))
        row["grants"] = {dc: Grant(**g) for dc, g in row.get("grants", {}).items()}
        return cls(**row)

    @property
    def left(self) -> int:
        """Ids no datacenter holds yet: above `next`, and given back."""
        return max(0, self.last_id + 1 - self.next) + sum(b - a for a, b in self.free)

    def key(self, name: str, *, next_id: int | None = None) -> Key:
        return Key(
            name,
            max_id=self.next if next_id is None else next_id,
            step=self.step,
            first_id=self.first_id,
            last_id=self.last_id,
            description=self.description,
            updated_at=datetime.fromtimestamp(self.created_ms / 1000, UTC),
            max_batch=self.max_batch,
        )


@dataclass(frozen=True)
class LocalRow:
    """A datacenter's cell of a key: what it reserved and what it handed out."""

    dc: str
    uid: str  # the global row's uid the grants came from
    # The key's settings as of the last grant: a datacenter cut off from the global level
    # still knows how to serve.
    step: int = 1
    first_id: int = 0
    last_id: int = 0
    max_batch: int = 0
    preload_at: float = DEFAULT_PRELOAD_AT
    window: float = DEFAULT_WINDOW
    applied: int = 0  # the seq of the last grant this cell took
    serving: int = 0  # the seq of the grant being served (the one before `applied`, or it)
    start: int = 0  # the reservation being served: [start, stop); next in [start, stop]
    stop: int = 0
    next: int = 0
    preloaded: tuple[int, int] | None = None
    issued: int = 0  # ids handed to processes, all time
    window_ms: int = 0  # the current rate window: when it began, and `issued` then
    window_issued: int = 0
    prev_ids: int = 0  # the previous window: ids handed out, and its length
    prev_s: float = 0.0
    retired: bool = False
    returning: tuple[tuple[int, int], ...] = ()  # ids a retirement gives back to the key
    updated_ms: int = 0

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def decode(cls, value: str) -> LocalRow:
        row = json.loads(value)
        if row.get("preloaded") is not None:
            row["preloaded"] = tuple(row["preloaded"])
        row["returning"] = tuple((a, b) for a, b in row.get("returning", ()))
        return cls(**row)

    @property
    def left(self) -> int:
        """Ids the datacenter can still hand out without the global level."""
        preloaded = self.preloaded[1] - self.preloaded[0] if self.preloaded else 0
        return self.stop - self.next + preloaded

    @property
    def used(self) -> float:
        """How much of the current reservation is handed out (1.0 when there is none)."""
        size = self.stop - self.start
        return (self.next - self.start) / size if size else 1.0

    @classmethod
    def new(cls, dc: str, top: GlobalRow, applied: int, now_ms: int) -> LocalRow:
        return cls(dc, top.uid, applied=applied, serving=applied, updated_ms=now_ms).settled(top)

    def settled(self, top: GlobalRow) -> LocalRow:
        """The row with the key's settings as the global cell has them now."""
        return replace(
            self,
            step=top.step,
            first_id=top.first_id,
            last_id=top.last_id,
            max_batch=top.max_batch,
            preload_at=top.sizing.preload_at,
            window=top.sizing.window,
        )

    def key(self, name: str) -> Key:
        """The key as processes of this datacenter see it."""
        return Key(
            name,
            max_id=self.next,
            step=self.step,
            first_id=self.first_id,
            last_id=self.last_id,
            max_batch=self.max_batch,
        )

    def rate(self, now_ms: int) -> float | None:
        """Ids/s handed out over the last one or two windows; None until a tenth of a window
        has passed (too little to size a reservation by)."""
        elapsed = max(0.0, (now_ms - self.window_ms) / 1000) + self.prev_s
        if not self.window_ms or elapsed < self.window / 10:
            return None
        return (self.issued - self.window_issued + self.prev_ids) / elapsed

    def handed_out(self, count: int, now_ms: int) -> LocalRow:
        """The row after `count` more ids went to a process (its rate window rolled on)."""
        row = replace(self, issued=self.issued + count, updated_ms=now_ms)
        if not row.window_ms:
            return replace(row, window_ms=now_ms, window_issued=self.issued)
        elapsed = (now_ms - row.window_ms) / 1000
        if elapsed >= self.window:
            return replace(
                row,
                prev_ids=self.issued - self.window_issued,
                prev_s=elapsed,
                window_ms=now_ms,
                window_issued=self.issued,
            )
        return row


@dataclass(frozen=True)
class DatacenterStatus:
    """One datacenter's state of a key, for `idmint dc status` and /metrics."""

    key: str
    dc: str
    reserved: tuple[int, int] | None  # the reservation being served [start, stop)
    next_id: int | None
    preloaded: tuple[int, int] | None
    left: int | None  # ids it can hand out without the global level (None: not known here)
    rate: float | None  # ids/s over the last window
    runway_s: float | None  # left / rate
    grants: int  # reservations taken so far
    retired: bool
    seen_from: str  # "local" (its own cell) or "global" (its latest grant only)

    def as_dict(self) -> dict[str, object]:
        shown = asdict(self)
        for name in ("reserved", "preloaded"):
            value = shown[name]
            shown[name] = None if value is None else {"start": value[0], "stop": value[1]}
        return shown


def _local_status(name: str, row: LocalRow, now_ms: int) -> DatacenterStatus:
    rate = row.rate(now_ms)
    reserved = (row.start, row.stop) if row.stop > row.start else None
    return DatacenterStatus(
        key=name,
        dc=row.dc,
        reserved=reserved,
        next_id=row.next if reserved else None,
        preloaded=row.preloaded,
        left=row.left,
        rate=rate,
        runway_s=row.left / rate if rate else None,
        grants=row.applied,
        retired=row.retired,
        seen_from="local",
    )


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


# -- the store -------------------------------------------------------------------------------


class DatacenterRanges(ForkAware):
    """A RangeStore whose keys are datacenter keys (see the module doc), for processes in
    datacenter `dc`: `allocate` takes ranges from the datacenter's reservation.

    `global_cas` and `local_cas` may be one store (a test, or one database for both levels:
    then nothing survives a partition). Without `dc` and `local_cas`, only what the global
    level does works (keys, sizing, status): the rest raises InvalidArgument. `close()` stops
    the background grants and closes both stores."""

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

    # -- processes take ranges ----------------------------------------------------------------

    def allocate(
        self, name: str, count: int | None = None, *, stripe: int | None = None
    ) -> Allocation:
        """Take up to `count` ids (default: the key's step) from this datacenter's reservation,
        with a local compare-and-set: shorter at the end of a reservation. When the
        reservation and the preloaded range are spent, a grant is taken at once; if the global
        store cannot give one, RunwaySpent. Talks to the global store only then (and on a
        datacenter's first allocation)."""
        self._check_fork()
        if stripe not in (None, 0):
            raise InvalidArgument("datacenter keys have no stripes: each datacenter is one")
        cell = local_cell(name, self.dc)

        def take() -> tuple[int | None, str | None, tuple[Range, LocalRow] | None]:
            row, version = self._local_row(name)
            if row.retired:
                raise DatacenterRetired(name, self.dc)
            if row.next >= row.stop and row.preloaded is not None:
                start, stop = row.preloaded
                row = replace(
                    row, start=start, stop=stop, next=start, preloaded=None, serving=row.applied
                )
            if row.next >= row.stop:
                return version, None, None  # nothing to serve: a grant first
            size = row.step if count is None else count
            taken = Range(row.next, min(row.next + size, row.stop))
            row = replace(row, next=taken.stop).handed_out(len(taken), self._clock_ms())
            return version, row.encode(), (taken, row)

        for _ in range(RESERVE_ROUNDS):
            got = self._update(self.local_cas, cell, f"take from {cell}", take, on_global=False)
            if got is not None:
                taken, row = got
                self._seen[name] = row
                if row.preloaded is None and row.used >= row.preload_at:
                    self._preload_in_background(name)
                return Allocation(taken, row.key(name), epoch=row.serving)
            try:
                self.reserve(name)
            except LostReservations:
                raise
            except StoreUnavailable as exc:
                self._count(runway_spent=1)
                raise RunwaySpent(name, self.dc, str(exc)) from exc
        raise StoreUnavailable(  # each round reserved, and others took it all first
            f"datacenter {self.dc!r}: {RESERVE_ROUNDS} reservations of key {name!r} in a row "
            "were handed out to other processes before this one took a range"
        )

    def give_back(self, name: str, unused: Range) -> bool:
        """A process's unused tail goes back to the datacenter's reservation if nobody took a
        range after it."""
        if not unused or unused.stride != 1:
            return False
        cell = local_cell(name, self.dc)

        def back() -> tuple[int | None, str | None, bool]:
            got = self._read_local(name)
            if got is None:
                return None, None, False
            row, version = got
            if row.retired or row.next != unused.stop or not row.start <= unused.start:
                return version, None, False
            row = replace(row, next=unused.start, issued=row.issued - len(unused))
            return version, row.encode(), True

        return self._update(self.local_cas, cell, f"give back to {cell}", back, on_global=False)

    # -- the datacenter takes reservations ----------------------------------------------------

    def reserve(self, name: str) -> bool:
        """Give this datacenter its next reservation unless it has one preloaded: a grant from
        the global cell, then applied to the datacenter's cell. False if one was preloaded
        already. Raises Exhausted when the key has no ids left to reserve, StoreUnavailable
        when a store does not answer."""
        self._check_fork()
        for _ in range(RESERVE_ROUNDS):
            row, _ = self._local_row(name)
            if row.retired:
                raise DatacenterRetired(name, self.dc)
            if row.preloaded is not None:
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
            start, stop, free, next_ = _carve(top, top.sizing.size(rate))
            if start is None:
                with self._lock:
                    self._spent_until[name] = time.monotonic() + 1.0
                raise Exhausted(name, top.last_id)
            new = Grant(want, start, stop, now, rate)
            top = replace(top, next=next_, free=free, grants={**top.grants, self.dc: new})
            if not bound:  # a cell made before bindings existed: bound by its next grant
                top = replace(top, stores={**top.stores, self.dc: self._local_store()})
            return version, top.encode(), (new, top)

        return self._update(
            self.global_cas,
            global_cell(name),
            f"reserve ids of {name} for {self.dc}",
            grant,
            on_global=True,
        )

    def _apply(self, name: str, grant: Grant, top: GlobalRow) -> bool:
        """Put `grant` in the datacenter's cell if the cell has applied the grant before it:
        as the reservation when the current one is spent, else as the preloaded one. The
        cell takes the key's settings from `top` too."""
        cell = local_cell(name, self.dc)

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
        applied = self._update(
            self.local_cas, cell, f"apply a grant to {cell}", apply, on_global=False
        )
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

    # -- keys --------------------------------------------------------------------------------

    def init(self) -> None:
        self.global_cas.init()
        self.local_cas.init()

    def identity(self) -> StoreIdentity | None:
        return self.global_cas.identity()

    def add_key(
        self,
        name: str,
        *,
        step: int,
        first_id: int = DEFAULT_FIRST_ID,
        last_id: int,
        description: str = "",
        stripes: int = 1,
        sizing: ReservationSizing | None = None,
    ) -> Key:
        if stripes != 1:
            raise InvalidArgument("datacenter keys have no stripes: each datacenter is one")
        sizing = (sizing or ReservationSizing()).check().for_key(first_id, last_id)
        top = GlobalRow(
            uuid.uuid4().hex,
            first_id,
            last_id,
            first_id,
            step,
            sizing,
            self._clock_ms(),
            description,
        )
        if not self.global_cas.create(global_cell(name), top.encode()):
            raise KeyExists(name)
        return top.key(name)

    def get_key(self, name: str) -> Key:
        """The key as the global level sees it: `next_id` is the lowest id no datacenter was
        given."""
        return self._read_global(name)[0].key(name)

    def list_keys(self) -> list[Key]:
        keys = []
        for cell, value in self._global_call(lambda: self.global_cas.scan(PREFIX)):
            name = cell[len(PREFIX) :]
            if "@" not in name:
                keys.append(GlobalRow.decode(value).key(name))
        return sorted(keys, key=lambda k: k.name)

    def raise_floor(self, name: str, to: int) -> Key:
        raise InvalidArgument(
            "datacenter keys cannot be raised: each datacenter serves the reservations it "
            "holds; make the key with its first id above the legacy ids (--start)"
        )

    def settings(self, name: str) -> ReservationSizing:
        """How the key's reservations are sized."""
        return self._read_global(name)[0].sizing

    def set_max_batch(self, name: str, max_batch: int) -> Key:
        return self._set(name, lambda top: replace(top, max_batch=max_batch)).key(name)

    def set_sizing(self, name: str, **changes: Any) -> ReservationSizing:
        """Change how the key's reservations are sized (ReservationSizing's fields; a
        reservation bound of 0 is the default again), from each datacenter's next one on.
        Returns the sizing as stored."""

        def change(top: GlobalRow) -> GlobalRow:
            sizing = replace(top.sizing, **changes).check()
            return replace(top, sizing=sizing.for_key(top.first_id, top.last_id))

        return self._set(name, change).sizing

    def _set(self, name: str, change: Callable[[GlobalRow], GlobalRow]) -> GlobalRow:
        """Change the key's global cell (a compare-and-set loop); returns the new one."""

        def attempt() -> tuple[int | None, str | None, GlobalRow]:
            top, version = self._read_global(name)
            new = change(top)
            return version, new.encode(), new

        return self._update(
            self.global_cas, global_cell(name), f"change {name}", attempt, on_global=True
        )

    # -- datacenters -------------------------------------------------------------------------

    def status(self, name: str) -> list[DatacenterStatus]:
        """Every datacenter of the key: this one from its own cell, the others from their
        cells where the global store holds them too (Cassandra: one cluster), else from what
        the global cell knows of them (their latest grant)."""
        top, _ = self._read_global(name)
        cells: dict[str, LocalRow] = {}
        for _, value in self.global_cas.scan(local_cell(name, "")):
            found = LocalRow.decode(value)
            cells[found.dc] = found
        if self._dc is not None:
            got = self._read_local(name)
            if got is not None:
                cells[self.dc] = got[0]
        now = self._clock_ms()
        shown = []
        for dc in sorted(set(top.grants) | set(cells)):
            row = cells.get(dc)
            grant = top.grants.get(dc)
            if row is not None:
                shown.append(_local_status(name, row, now))
            elif grant is not None:
                shown.append(
                    DatacenterStatus(
                        key=name,
                        dc=dc,
                        reserved=(grant.start, grant.stop),
                        next_id=None,
                        preloaded=None,
                        left=None,
                        rate=grant.rate,
                        runway_s=None,
                        grants=grant.seq,
                        retired=top.returned.get(dc, 0) >= grant.seq,
                        seen_from="global",
                    )
                )
        return shown

    def check_local(self) -> None:
        """Read one cell of the datacenter's own store (StoreUnavailable if it does not
        answer): what readiness needs of a datacenter, which serves without the global level."""
        self.local_cas.read(local_cell("", self.dc))

    def local_status(self, name: str) -> DatacenterStatus | None:
        """This datacenter's state of key `name` from its own cell alone (it answers while the
        global level is out of reach); None if the datacenter never served the key."""
        got = self._read_local(name)
        return None if got is None else _local_status(name, got[0], self._clock_ms())

    def refresh_seen(self) -> None:
        """Read again, from the datacenter's own store, the cell of each key this process
        served, so seen() shows what other processes did since (a retirement, say)."""
        for name in list(self._seen):
            got = self._read_local(name)
            if got is not None:
                self._seen[name] = got[0]

    def seen(self) -> list[DatacenterStatus]:
        """This datacenter's state of each key this process served, as the process last wrote
        its cell (no I/O: for /metrics, and it answers while the global level is cut off)."""
        now = self._clock_ms()
        seen = self._seen.copy()  # one step under the GIL: allocations may add keys meanwhile
        return [_local_status(name, row, now) for name, row in sorted(seen.items())]

    def retire(self, name: str) -> list[Range]:
        """Stop this datacenter taking ids of the key and give its unused ids back to the key
        (the rest of its reservation, its preloaded range, a grant it never applied), for
        other datacenters to reserve. Safe to repeat after a crash: each range goes back once.
        Returns the ranges given back. Processes keep serving the ranges they hold (stop them
        first to give back more)."""
        cell = local_cell(name, self.dc)

        def close_cell() -> tuple[int | None, str | None, LocalRow]:
            row, version = self._local_row(name)
            if row.retired:
                return version, None, row
            unused = [r for r in ((row.next, row.stop), row.preloaded) if r and r[1] > r[0]]
            row = replace(
                row,
                retired=True,
                next=row.stop,
                preloaded=None,
                returning=tuple(unused),
                updated_ms=self._clock_ms(),
            )
            return version, row.encode(), row

        self._update(self.local_cas, cell, f"retire {cell}", close_cell, on_global=False)

        def give() -> tuple[int | None, str | None, list[Range]]:
            top, version = self._read_global(name)
            # The cell as it is now, read after the global one, never the row written above:
            # if this retire stalled while another finished it and the datacenter reopened and
            # applied a later grant, the cell is no longer retired and this retire is done
            # (a stale row would give the later grant back while it is served). A later grant
            # is only applied after a reopen, which only follows a finished give-back, which
            # changed the global cell's version: so the swap below fails if one came between.
            now = self._read_local(name)
            if now is None or not now[0].retired:
                return version, None, []
            row = now[0]
            done = top.returned.get(self.dc, 0)
            grant = top.grants.get(self.dc)
            back = list(row.returning) if done < row.applied else []
            # A grant above `applied` was made but never applied (the cell is retired, so it
            # never will be): all of it goes back.
            if grant is not None and grant.seq > max(done, row.applied):
                back.append((grant.start, grant.stop))
            seq = max(done, row.applied, grant.seq if grant else 0)
            if seq == done:
                return version, None, []  # given back already
            top = replace(top, free=_merge(top.free, back), returned={**top.returned, self.dc: seq})
            return version, top.encode(), [Range(a, b) for a, b in back]

        return self._update(
            self.global_cas,
            global_cell(name),
            f"give ids of {name} back from {self.dc}",
            give,
            on_global=True,
        )

    def reopen(self, name: str) -> None:
        """Let a retired datacenter take ids again, from a new reservation."""
        cell = local_cell(name, self.dc)

        def attempt() -> tuple[int | None, str | None, None]:
            row, version = self._local_row(name)
            if not row.retired:
                return version, None, None
            done = self._read_global(name)[0].returned.get(self.dc, 0)
            if done < row.applied:
                raise InvalidArgument(
                    f"datacenter {self.dc!r} has not finished giving key {name!r} back: run "
                    f"`idmint dc retire {name} --dc {self.dc}` again first"
                )
            row = replace(
                row,
                retired=False,
                returning=(),
                applied=done,
                serving=done,
                start=0,
                stop=0,
                next=0,
                updated_ms=self._clock_ms(),
            )
            return version, row.encode(), None

        self._update(self.local_cas, cell, f"reopen {cell}", attempt, on_global=False)

    def reset(self, name: str) -> None:
        """Abandon what this datacenter's cell held (its store lost it, or the key was made
        again): the grants the global cell gave it are skipped, never reused, and the
        datacenter starts from a new reservation. Only once no process serves the old ones."""

        def skip() -> tuple[int | None, str | None, GlobalRow]:
            top, version = self._read_global(name)
            grant = top.grants.get(self.dc)
            seq = max(grant.seq if grant else 0, top.returned.get(self.dc, 0))
            stores = {**top.stores, self.dc: self._local_store()}  # this store from now on
            top = replace(top, returned={**top.returned, self.dc: seq}, stores=stores)
            return version, top.encode(), top

        top = self._update(
            self.global_cas, global_cell(name), f"reset {name} for {self.dc}", skip, on_global=True
        )
        cell = local_cell(name, self.dc)

        def fresh() -> tuple[int | None, str | None, None]:
            # The datacenter's processes may have made the cell and applied a later grant
            # since the global step above (they retry every second): such a cell agrees with
            # the global cell and stays. A cell is never written with a lower `applied` than
            # it has: that would make a grant it applied apply again, from its start.
            got = self._read_local(name)
            applied = top.returned[self.dc]
            if got is not None and got[0].uid == top.uid:
                if got[0].applied >= applied and not got[0].retired:
                    return got[1], None, None
                applied = max(applied, got[0].applied)
            row = LocalRow.new(self.dc, top, applied, self._clock_ms())
            return (None if got is None else got[1]), row.encode(), None

        self._update(self.local_cas, cell, f"reset {cell}", fresh, on_global=False)

    def close(self) -> None:
        """Stop background grants and close both stores."""
        self._stopping.set()
        self.global_cas.close()
        if self._local_cas is not None and self._local_cas is not self.global_cas:
            self._local_cas.close()


class _Preload:
    """A background grant of one key, as a refill pool job, with its back-off."""

    __slots__ = ("delay", "name", "ranges")

    def __init__(self, ranges: DatacenterRanges, name: str) -> None:
        self.ranges, self.name, self.delay = ranges, name, 0.1

    def refill_due(self) -> float:
        return self.ranges._preload_due(self.name)

    def run_refill(self) -> float | None:
        again = self.ranges._preload(self.name, self.delay)
        if again is not None:
            self.delay = min(self.delay * 2, 30.0)
        return again


def _carve(top: GlobalRow, size: int) -> tuple[int | None, int, tuple[tuple[int, int], ...], int]:
    """(start, stop, free ranges left, next) of a reservation of up to `size` ids: from the
    ranges retired datacenters gave back first (lowest first), else above `next`, never past
    the key's maximum. start None: nothing left."""
    if top.free:
        (a, b), rest = top.free[0], top.free[1:]
        stop = min(b, a + size)
        return a, stop, (((stop, b),) if stop < b else ()) + rest, top.next
    if top.next > top.last_id:
        return None, 0, (), top.next
    stop = min(top.last_id + 1, top.next + size)
    return top.next, stop, (), stop


def _merge(
    free: tuple[tuple[int, int], ...], more: list[tuple[int, int]]
) -> tuple[tuple[int, int], ...]:
    """Free ranges with `more` added, sorted and merged where they touch."""
    merged: list[list[int]] = []
    for a, b in sorted([*free, *(r for r in more if r[1] > r[0])]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    if len(merged) > MAX_FREE_RANGES:
        raise InvalidArgument(
            f"the key keeps at most {MAX_FREE_RANGES} ranges given back; this would make "
            f"{len(merged)}"
        )
    return tuple((a, b) for a, b in merged)
