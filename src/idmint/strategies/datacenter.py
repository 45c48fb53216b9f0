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
once `preload_at` (50%) of a datacenter's reservation is handed out, the process whose range
crossed that mark starts a background grant (and, should that one never come, the process that
crosses halfway from there to the end): one process per reservation, as two would race each
other on the global cell. A reservation is sized by time: enough for `runway` seconds at
the rate the datacenter handed out ids over the last window (two windows at most), between the
key's minimum and maximum reservation, never past the key's maximum.

A datacenter name means one local store: the global cell binds the name to its store's identity
with the datacenter's first grant (and checks it with every grant), so a second store under
that name (a typo in --dc-store, a region that copied IDMINT_DC) is refused before it serves
anything; `reset` moves a datacenter to another store on purpose.

When the global store is out of reach, a datacenter serves from its reservation and preloaded
range, retrying the grant in the background; when both are spent, allocations raise
RunwaySpent until the global store answers again.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .._errors import (
    DatacenterRetired,
    InvalidArgument,
    KeyExists,
    LostReservations,
    RunwaySpent,
    StoreUnavailable,
)
from ..ids import DEFAULT_FIRST_ID, Allocation, Key, Range
from ..stores.base import StoreIdentity
from .datacenter_cells import (
    PREFIX,
    RESERVE_ROUNDS,
    DatacenterStatus,
    GlobalRow,
    LocalRow,
    ReservationSizing,
    global_cell,
    local_cell,
    merge_free,
    status_of,
)
from .datacenter_store import DatacenterCellStore


class DatacenterRanges(DatacenterCellStore):
    """A RangeStore whose keys are datacenter keys (see the module doc), for processes in
    datacenter `dc`: `allocate` takes ranges from the datacenter's reservation.

    `global_cas` and `local_cas` may be one store (a test, or one database for both levels:
    then nothing survives a partition). Without `dc` and `local_cas`, only what the global
    level does works (keys, sizing, status): the rest raises InvalidArgument."""

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
            got = self._update(name, "take from", take, on_global=False)
            if got is not None:
                taken, row = got
                self._seen[name] = row
                if row.preload_due(taken.start):
                    self._preload_in_background(name)
                return Allocation(taken, row.key(name), epoch=row.serving)
            try:
                self.reserve(name, dry=True)
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

        def back() -> tuple[int | None, str | None, bool]:
            got = self._read_local(name)
            if got is None:
                return None, None, False
            row, version = self._scoped(name, got)
            if row.retired or row.next != unused.stop or not row.start <= unused.start:
                return version, None, False
            row = replace(row, next=unused.start, issued=row.issued - len(unused))
            return version, row.encode(), True

        return self._update(name, "give back to", back, on_global=False)

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

        return self._update(name, f"change {name}", attempt, on_global=True)

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
                shown.append(status_of(name, row, now))
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
        return None if got is None else status_of(name, got[0], self._clock_ms())

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
        return [status_of(name, row, now) for name, row in sorted(seen.items())]

    def retire(self, name: str) -> list[Range]:
        """Stop this datacenter taking ids of the key and give its unused ids back to the key
        (the rest of its reservation, its preloaded range, a grant it never applied), for
        other datacenters to reserve. Safe to repeat after a crash: each range goes back once.
        Returns the ranges given back. Processes keep serving the ranges they hold (stop them
        first to give back more)."""

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

        self._update(name, "retire", close_cell, on_global=False)

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
            # never will be): all of it goes back. A failover's fence of the cell moves
            # `applied` past every grant its lost primary may have applied and served
            # (datacenter_cells._fenced): none of those goes back.
            if grant is not None and grant.seq > max(done, row.applied):
                back.append((grant.start, grant.stop))
            seq = max(done, row.applied, grant.seq if grant else 0)
            if seq == done:
                return version, None, []  # given back already
            top = replace(
                top, free=merge_free(top.free, back), returned={**top.returned, self.dc: seq}
            )
            return version, top.encode(), [Range(a, b) for a, b in back]

        return self._update(
            name,
            f"give ids of {name} back from {self.dc}",
            give,
            on_global=True,
        )

    def reopen(self, name: str) -> None:
        """Let a retired datacenter take ids again, from a new reservation."""

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

        self._update(name, "reopen", attempt, on_global=False)

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

        top = self._update(name, f"reset {name} for {self.dc}", skip, on_global=True)

        def fresh() -> tuple[int | None, str | None, None]:
            # The datacenter's processes may have made the cell and applied a later grant
            # since the global step above (they retry every second): such a cell agrees with
            # the global cell and stays. A cell is never written with a lower `applied` than
            # it has: that would make a grant it applied apply again, from its start.
            got = self._read_local(name)
            applied = top.returned[self.dc]
            mine = self._local_store()["id"]
            if got is not None and got[0].uid == top.uid:
                # A cell another store wrote last is written anew, stamped with this one: its
                # processes are refused from their next read on (see _scoped).
                if got[0].applied >= applied and not got[0].retired and got[0].scope in ("", mine):
                    return got[1], None, None
                applied = max(applied, got[0].applied)
            row = LocalRow.new(self.dc, top, applied, self._clock_ms(), mine)
            return (None if got is None else got[1]), row.encode(), None

        self._update(name, "reset", fresh, on_global=False)

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop background grants and close both stores."""
        self._stopping.set()
        self.global_cas.close()
        if self._local_cas is not None and self._local_cas is not self.global_cas:
            self._local_cas.close()
