"""The cells of datacenter keys (see datacenter.py): what the global level and each
datacenter's level keep, encoded as JSON in compare-and-set cells, and the arithmetic of
reservations on them. No I/O: the store (datacenter_store.py, datacenter.py) reads and
swaps these cells; everything here is pure, so it can be tested and reasoned about alone.

A failover's fence (stores/fences.py) must know how to move these cells' counters, so the
format registers its fence here, next to the format itself: importing the strategy imports
this module, and with it the registration.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime

from .._errors import InvalidArgument
from ..ids import Key, Range
from ..stores import fences

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
    """A cell after a failover's fence (stores/fences.py), which runs on a promoted replica
    before anything is written there: the lost primary may have written this cell after the
    replica's copy, and what it wrote is gone. The fence holds (as for every key) while fewer
    than `gap` ids were handed out to processes in the replication lag. Nothing moves down.

    A datacenter's cell (``dc/NAME@DC``) gives up everything it holds, and grants are taken
    afresh. The lost primary may have served the rest of the reservation, the preloaded range,
    and grants it applied after the replica's copy; the global cell (another store, or fenced
    apart) still shows the latest as recorded, and the cell would apply it again from its start
    (grant n applies to a cell that applied n - 1). So: `next` moves to the reservation's end,
    the preloaded range and the ranges a retirement would give back are dropped (given back
    already, perhaps, and reserved by another datacenter since), and `applied` moves up
    gap + 2 grants. A datacenter takes a grant only when it holds no preloaded range, so of
    the grants after the replica's `applied` all but the last two were handed out whole in the
    lag, each at least one id: fewer than gap + 2 grants. Every grant recorded for the
    datacenter is then at or below `applied`, none applies again (nor goes back on a retire),
    and the next reservation is a new one from the global level. Skipped grant numbers are
    never used.

    A global cell (``dc/NAME``) moves `next` up gap + 2 whole maximum reservations per
    datacenter it knows (at least one), never past one above the key's last id (a bounded
    key may end spent: Exhausted, never a wrap), and drops the ranges retired datacenters
    gave back. The lost primary may have granted a datacenter the reservation it serves and a
    preloaded one, each up to the maximum, whatever it handed out; any grant before those was
    handed out whole in the lag (within the gap). Given-back ranges may have been granted too
    (they go first). Not covered: a datacenter's first grant, or a larger maximum set, in the
    lag itself.

    Gap 0 (no fence: the stores do not call it then) leaves the cell as it is."""
    if gap <= 0:
        return value
    row = json.loads(value)
    if "@" in cell:
        row["next"] = max(int(row["next"]), int(row["stop"]))
        row["preloaded"] = None
        row["returning"] = []
        row["applied"] = int(row["applied"]) + gap + 2
    else:
        top = int(row["next"])
        largest = (
            ReservationSizing(**row["sizing"])
            .for_key(int(row["first_id"]), int(row["last_id"]))
            .max_reservation
        )
        dcs = len(set(row.get("grants", {})) | set(row.get("stores", {})))
        moved = top + gap + 2 * largest * max(1, dcs)
        row["next"] = max(top, min(moved, int(row["last_id"]) + 1))
        row["free"] = []
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
    applied: int = 0  # the seq of the last grant this cell took (a fence skips seqs: _fenced)
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
    #: The store of the process that last wrote the cell, as the global cell's binding names
    #: it (an identity, and where its compare-and-sets are decided). A process whose store is
    #: another refuses the cell at its first read: one keyspace decided by two Paxos groups
    #: serves the same reservation twice. "" in a cell written before it was kept.
    scope: str = ""

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

    def preload_due(self, taken_from: int) -> bool:
        """Whether the take that moved `next` from `taken_from` to where it is starts the
        preload: the one that crossed `preload_at` of the reservation, or (should that
        process's preload never come: it stopped, or cannot reach the global level) the one
        that crossed halfway from there to the end. Takes are compare-and-sets on this cell,
        so one process crosses each mark: the datacenter's other processes would only race it
        on the global cell, each lost swap a round there too."""
        size = self.stop - self.start
        if self.preloaded is not None or size <= 0:
            return False
        before, after = taken_from - self.start, self.next - self.start
        marks = (self.preload_at, (1 + self.preload_at) / 2)
        return any(before < mark * size <= after for mark in marks)

    @classmethod
    def new(cls, dc: str, top: GlobalRow, applied: int, now_ms: int, scope: str) -> LocalRow:
        """A datacenter's first cell (or one `dc reset` writes anew), written by the store
        `scope` names (see `scope`)."""
        row = cls(dc, top.uid, applied=applied, serving=applied, updated_ms=now_ms, scope=scope)
        return row.settled(top)

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
    grants: int  # the number of its latest grant (a failover's fence skips numbers)
    retired: bool
    seen_from: str  # "local" (its own cell) or "global" (its latest grant only)

    def as_dict(self) -> dict[str, object]:
        shown = asdict(self)
        for name in ("reserved", "preloaded"):
            value = shown[name]
            shown[name] = None if value is None else {"start": value[0], "stop": value[1]}
        return shown


def status_of(name: str, row: LocalRow, now_ms: int) -> DatacenterStatus:
    """A datacenter's state of key `name` as its own cell `row` shows it at `now_ms`."""
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


def carve(top: GlobalRow, size: int) -> tuple[int | None, int, tuple[tuple[int, int], ...], int]:
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


def merge_free(
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
