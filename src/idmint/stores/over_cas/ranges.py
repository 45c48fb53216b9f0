"""Segment keys on any CasStore: the range store of every engine that is not SQL (and of SQL
ones too, over their cells: `CasRangeStore(engine.cas())`).

Each key is one cell, `key/NAME`, holding stripe 0's counter and the key's settings as JSON; a
striped key keeps stripe k's counter in its own cell, `key/NAME#k`, so stripes never contend
(Broadcast's lock striping). An allocation swaps its stripe's cell to the counter moved past
the range, backing off and reading again when another process swapped first (over_cas/loop.py).
A stripe's cell is made with the key; if that was cut short (a crash between the cells), the
first allocation on the stripe makes it from the key's cell, so there is one way to make it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TypeVar

from ..._errors import KeyExists, KeyNotFound
from ..._fork import private_random
from ...ids import (
    Allocation,
    Key,
    Range,
    align_up,
    check_stripe,
    next_range,
    raised_floor,
    stripe_row,
)
from .. import fences
from ..base import CasStore, StoreIdentity
from .loop import Backoff as Backoff  # its public path, kept
from .loop import cas_update

T = TypeVar("T")

KEY_PREFIX = "key/"
_jitter = private_random()


def cell_name(name: str, stripe: int = 0) -> str:
    """The cell of a key's stripe: stripe 0's is the key's own."""
    return f"{KEY_PREFIX}{name}" if stripe == 0 else f"{KEY_PREFIX}{name}#{stripe}"


def _fenced(cell: str, value: str, gap: int) -> str:
    """A key cell's value (`cell` is under KEY_PREFIX) moved up `gap` ids of its stripe for
    a failover's fence: past every range a promoted replica may lack. Never past one above
    the key's last id (a bounded key may end spent), never down. Every other field is kept as
    written."""
    row = json.loads(value)
    top = int(row["max_id"])
    moved = min(top + gap * int(row.get("stripes") or 1), int(row["last_id"]) + 1)
    row["max_id"] = max(top, moved)
    return json.dumps(row, separators=(",", ":"))


fences.register(KEY_PREFIX, _fenced)


@dataclass
class CasCounts:
    """What the compare-and-set loops did, for stats and /metrics."""

    conflicts: int = 0  # swaps (or creates) another writer won
    retries: int = 0  # operations that needed more than one attempt


def _encode(key: Key, origin: int | None = None) -> str:
    row: dict[str, object] = {
        "max_id": key.max_id,
        "first_id": key.first_id,
        "last_id": key.last_id,
        "step": key.step,
        "stripes": key.stripes,
        "updated_ms": int(key.updated_at.timestamp() * 1000) if key.updated_at else None,
    }
    if key.stripe:
        row["stripe"] = key.stripe
    else:
        row.update(description=key.description, max_batch=key.max_batch, origin=origin)
    return json.dumps(row, separators=(",", ":"))


def _decode(name: str, value: str) -> tuple[Key, int]:
    """The Key a cell holds, and the key's first id at creation (stripe 0's cell; else 0)."""
    row = json.loads(value)
    updated = row.get("updated_ms")
    key = Key(
        name=name,
        max_id=int(row["max_id"]),
        step=int(row["step"]),
        first_id=int(row["first_id"]),
        last_id=int(row["last_id"]),
        description=str(row.get("description") or ""),
        updated_at=datetime.fromtimestamp(updated / 1000, UTC) if updated else None,
        max_batch=int(row.get("max_batch") or 0),
        stripes=int(row.get("stripes") or 1),
        stripe=int(row.get("stripe") or 0),
    )
    return key, int(row.get("origin") or 0)


def _now() -> datetime:
    return datetime.now(UTC)


class CasRangeStore:
    """A RangeStore over a CasStore (see the module doc)."""

    def __init__(self, cas: CasStore, *, backoff: Backoff | None = None) -> None:
        self.display_url = cas.display_url
        self.cas = cas
        self.backoff = backoff or Backoff()
        self.counts = CasCounts()
        self._counts_lock = threading.Lock()

    # -- cells -------------------------------------------------------------------------------

    def _read_key(self, name: str) -> tuple[Key, int, int]:
        """(stripe 0's row, the key's origin, the cell's version). Raises KeyNotFound."""
        got = self.cas.read(cell_name(name))
        if got is None:
            raise KeyNotFound(name)
        key, origin = _decode(name, got[0])
        return key, origin, got[1]

    def _read_stripe(self, name: str, stripe: int) -> tuple[Key, int, int]:
        """(row, origin, version) of a stripe's cell, making the cell if the key's creation
        did not. The origin is the key's (kept in stripe 0's cell) for stripe 0, else 0."""
        if stripe == 0:
            return self._read_key(name)
        while True:
            got = self.cas.read(cell_name(name, stripe))
            if got is not None:
                return _decode(name, got[0])[0], 0, got[1]
            key, origin, _ = self._read_key(name)
            check_stripe(stripe, key.stripes)
            self.cas.create(cell_name(name, stripe), _encode(_first_row(key, origin, stripe)))

    def _change(
        self,
        name: str,
        stripe: int,
        what: str,
        change: Callable[[Key], tuple[Key | None, T]],
        read: tuple[Key, int, int] | None = None,
    ) -> tuple[T, int]:
        """Read a stripe's row (or start from `read`, one the caller just made), `change` it
        and swap the new row in; when another writer swapped first, back off and redo.
        `change` returns (new row or None to leave the row as it is, result). Returns the
        result and how many swaps were lost."""
        first = read

        def attempt() -> tuple[int | None, str | None, T]:
            nonlocal first
            row, origin, version = first or self._read_stripe(name, stripe)
            first = None
            new_row, result = change(row)
            if new_row is None:
                return version, None, result
            return version, _encode(replace(new_row, updated_at=_now()), origin), result

        def conflict() -> None:
            with self._counts_lock:
                self.counts.conflicts += 1

        result, lost = cas_update(
            self.cas,
            cell_name(name, stripe),
            attempt,
            self.backoff,
            f"{what} on key {name!r} ({self.display_url})",
            conflict,
        )
        if lost:
            with self._counts_lock:
                self.counts.retries += 1
        return result, lost

    # -- the RangeStore protocol -------------------------------------------------------------

    def init(self) -> None:
        self.cas.init()

    def identity(self) -> StoreIdentity | None:
        return self.cas.identity()

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
        key = Key(name, first_id, step, first_id, last_id, description, _now(), stripes=stripes)
        if not self.cas.create(cell_name(name), _encode(key, first_id)):
            raise KeyExists(name)
        for stripe in range(1, stripes):  # a cell that is already there was made from the key
            self.cas.create(cell_name(name, stripe), _encode(_first_row(key, first_id, stripe)))
        return self.get_key(name)

    def get_key(self, name: str) -> Key:
        key, _, _ = self._read_key(name)
        if key.stripes == 1:
            return key
        rows = [key] + [self._read_stripe(name, s)[0] for s in range(1, key.stripes)]
        return with_stripes(key, rows)

    def list_keys(self) -> list[Key]:
        keys: dict[str, Key] = {}
        origins: dict[str, int] = {}
        stripes: dict[str, dict[int, Key]] = {}
        for cell, value in self.cas.scan(KEY_PREFIX):
            name, _, _ = cell[len(KEY_PREFIX) :].partition("#")
            row, origin = _decode(name, value)
            if row.stripe:
                stripes.setdefault(name, {})[row.stripe] = row
            else:
                keys[name], origins[name] = row, origin
        shown = []
        for name in sorted(keys):
            key = keys[name]
            if key.stripes > 1:
                have = stripes.get(name, {})
                rows = [key] + [
                    have.get(s) or _first_row(key, origins[name], s) for s in range(1, key.stripes)
                ]
                key = with_stripes(key, rows)
            shown.append(key)
        return shown

    def allocate(
        self, name: str, count: int | None = None, *, stripe: int | None = None
    ) -> Allocation:
        read = None
        if stripe is None:  # the store's choice: at random, so that callers spread out
            read = self._read_key(name)
            stripes = read[0].stripes
            stripe = _jitter.randrange(stripes) if stripes > 1 else 0
            if stripe:
                read = None  # another stripe's cell: read that one

        def take(row: Key) -> tuple[Key, tuple[Range, Key]]:
            taken = next_range(row, count)
            after = replace(row, max_id=taken.stop)
            return after, (taken, after)

        (taken, row), lost = self._change(name, stripe, "allocate", take, read)
        return Allocation(taken, row, conflicts=lost)

    def give_back(self, name: str, unused: Range) -> bool:
        if not unused:
            return False
        try:
            key, origin, _ = self._read_key(name)
        except KeyNotFound:
            return False
        if unused.stride != key.stripes:
            return False
        stripe = (unused.start - origin) % key.stripes

        def back(row: Key) -> tuple[Key | None, bool]:
            if row.max_id != unused.stop or unused.start < row.first_id:
                return None, False
            return replace(row, max_id=unused.start), True

        return self._change(name, stripe, "give back", back)[0]

    def raise_floor(self, name: str, to: int) -> Key:
        key, _, _ = self._read_key(name)
        raised_floor(key, to)  # InvalidArgument before anything moves

        def up(row: Key) -> tuple[Key | None, None]:
            first_id, max_id = raised_floor(row, to)
            if (first_id, max_id) == (row.first_id, row.max_id):
                return None, None
            return replace(row, first_id=first_id, max_id=max_id), None

        # Stripe 0 first: a stripe cell made later starts from its floor.
        for stripe in range(key.stripes):
            self._change(name, stripe, "raise", up)
        return self.get_key(name)

    def set_max_batch(self, name: str, max_batch: int) -> Key:
        def cap(row: Key) -> tuple[Key, None]:
            return replace(row, max_batch=max_batch), None

        self._change(name, 0, "set max batch", cap)
        return self.get_key(name)

    def close(self) -> None:
        self.cas.close()


def _first_row(key: Key, origin: int, stripe: int) -> Key:
    """A stripe's starting row: its first id, at or above the key's floor."""
    row = stripe_row(replace(key, first_id=origin), stripe)
    floor = align_up(max(row.first_id, key.first_id), row.first_id, key.stripes)
    return replace(row, first_id=floor, max_id=floor, updated_at=_now())


def with_stripes(key: Key, rows: list[Key]) -> Key:
    """Stripe 0's row showing where every stripe's next range starts (`rows`: every stripe's,
    stripe 0's first)."""
    return replace(key, stripe_next=tuple(max(r.max_id, r.first_id) for r in rows))
