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

from dataclasses import replace

from .._errors import (
    DatacenterRetired,
    InvalidArgument,
    LostReservations,
    RunwaySpent,
    StoreUnavailable,
)
from ..ids import Allocation, Range
from .datacenter_admin import DatacenterAdmin
from .datacenter_cells import (
    DEFAULT_MIN_RESERVATION,
    DEFAULT_PRELOAD_AT,
    DEFAULT_RUNWAY,
    DEFAULT_WINDOW,
    MAX_FREE_RANGES,
    PREFIX,
    RESERVE_ROUNDS,
    DatacenterStatus,
    GlobalRow,
    Grant,
    LocalRow,
    ReservationSizing,
    check_dc_name,
    global_cell,
    local_cell,
)
from .datacenter_grants import DatacenterGrants
from .datacenter_store import DatacenterCounts, GlobalLevel

# This module is the strategy's public face: other modules import these names from here. Its
# parts: datacenter_cells.py (the cells and their arithmetic, no I/O), datacenter_store.py (the
# state and the calls that read and swap cells), datacenter_grants.py (reservations, and their
# background preload) and datacenter_admin.py (keys, status, retire, reopen, reset). What
# processes call to take ids is below, beside the design it implements.
__all__ = [
    "DEFAULT_MIN_RESERVATION",
    "DEFAULT_PRELOAD_AT",
    "DEFAULT_RUNWAY",
    "DEFAULT_WINDOW",
    "MAX_FREE_RANGES",
    "PREFIX",
    "RESERVE_ROUNDS",
    "DatacenterCounts",
    "DatacenterRanges",
    "DatacenterStatus",
    "GlobalLevel",
    "GlobalRow",
    "Grant",
    "LocalRow",
    "ReservationSizing",
    "check_dc_name",
    "global_cell",
    "local_cell",
]


class DatacenterRanges(DatacenterAdmin, DatacenterGrants):
    """A RangeStore whose keys are datacenter keys (see the module doc), for processes in
    datacenter `dc`: `allocate` takes ranges from the datacenter's reservation.

    `global_cas` and `local_cas` may be one store (a test, or one database for both levels:
    then nothing survives a partition). Without `dc` and `local_cas`, only what the global
    level does works (keys, sizing, status): the rest raises InvalidArgument. `close()` stops
    the background grants and closes both stores."""

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

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop background grants and close both stores."""
        self._stopping.set()
        self.global_cas.close()
        if self._local_cas is not None and self._local_cas is not self.global_cas:
            self._local_cas.close()
