"""Key administration and an operator's datacenter commands for datacenter keys (see
datacenter.py): make, list and change keys in the global cell; show each datacenter's state;
retire a datacenter (its unused ids go back to the key), reopen it, or reset it onto another
store. None of this is on the path that hands out ids.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .._errors import InvalidArgument, KeyExists
from ..ids import DEFAULT_FIRST_ID, Key, Range
from ..stores.base import StoreIdentity
from .datacenter_cells import (
    PREFIX,
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


class DatacenterAdmin(DatacenterCellStore):
    """The administration part of DatacenterRanges: keys, status, retire, reopen, reset."""

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
            top = replace(
                top, free=merge_free(top.free, back), returned={**top.returned, self.dc: seq}
            )
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
