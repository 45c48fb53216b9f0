"""How a datacenter takes reservations from the global level (see datacenter.py): a grant in
the global cell, then its application to the datacenter's cell, each a compare-and-set; and
the background preload that does it before the datacenter runs dry, as a job on the refill
pool, retried while the global level is out of reach.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from .._errors import (
    DatacenterRetired,
    Exhausted,
    IdmintError,
    InvalidArgument,
    KeyNotFound,
    LostReservations,
)
from .datacenter_cells import (
    RESERVE_ROUNDS,
    GlobalRow,
    Grant,
    LocalRow,
    carve,
    global_cell,
    local_cell,
)
from .datacenter_store import DatacenterCellStore

log = logging.getLogger("idmint.datacenter")


class DatacenterGrants(DatacenterCellStore):
    """The reservations part of DatacenterRanges: `reserve`, and the background preload that
    `allocate` starts once `preload_at` of a reservation is handed out."""

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
            start, stop, free, next_ = carve(top, top.sizing.size(rate))
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


class _Preload:
    """A background grant of one key, as a refill pool job, with its back-off."""

    __slots__ = ("delay", "name", "ranges")

    def __init__(self, ranges: DatacenterGrants, name: str) -> None:
        self.ranges, self.name, self.delay = ranges, name, 0.1

    def refill_due(self) -> float:
        return self.ranges._preload_due(self.name)

    def run_refill(self) -> float | None:
        again = self.ranges._preload(self.name, self.delay)
        if again is not None:
            self.delay = min(self.delay * 2, 30.0)
        return again
