"""Worker-id leases on Cassandra, by the protocol of lease_protocol.py, on the `idmint_leases`
and `idmint_worker_ids` tables (see the package's doc for their layout).

A take is one conditional batch on the id's partition: `lease` (with a TTL) set only while it is
null and the horizon is as read (and, for a lease the store chose, the id is not reserved),
with the owner, host, horizon and reservation. A renewal is one conditional batch too: the lease
extended and the horizon raised only while `owner` is ours and the horizon is as expected.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..._errors import InvalidArgument
from ..base import Lease, WorkerInfo
from ..lease_protocol import FencedLeases, Found, Request, Taken
from .connection import Capability, Connection, Unsure, back_off, store_identity, uuid_ms

SCAN_CHUNK = 100  # worker ids read in one request (IN on the partition key)

Row = dict[str, Any]


def _kept_s(ttl: float) -> int:
    """The TTL, in whole seconds, that keeps a lease for at least `ttl` seconds: Cassandra
    expires a cell at a whole second of its clock, counted from the second it was written, so a
    TTL of n lives for more than n - 1 seconds only."""
    if not ttl > 0:
        raise InvalidArgument(f"ttl must be above 0 seconds, not {ttl!r}")
    return math.ceil(ttl) + 1


def _expires_in(row: Row) -> float | None:
    """Seconds the row's lease lives at least (None when there is none); see `_kept_s`."""
    left = row.get("lease_ttl")
    if row.get("lease") is None or left is None:
        return None
    return float(max(int(left) - 1, 0))


@dataclass
class _Table:
    """The worker ids the namespace has used, and their rows."""

    used: set[int]
    rows: dict[int, Row]

    def held(self, worker_id: int) -> bool:
        row = self.rows.get(worker_id)
        return not (row is None or row.get("lease") is None)

    def reserved(self, worker_id: int) -> bool:
        return bool((self.rows.get(worker_id) or {}).get("reserved"))

    def floor_ms(self, worker_id: int) -> int:
        """A worker id's stored horizon (0 for a row never written)."""
        return int((self.rows.get(worker_id) or {}).get("horizon") or 0)

    def holder(self, worker_id: int) -> tuple[str, float | None]:
        row = self.rows[worker_id]
        return str(row["host"]), _expires_in(row)


class _Acquisition:
    """One acquire: the identity it reports, its rounds (for the back-off), and whether the
    coordinator left its last take's outcome unknown."""

    def __init__(self, store: CassandraLeaseStore, request: Request) -> None:
        self._store, self._request = store, request
        self._kept = _kept_s(request.ttl)
        self._conn = store._open()
        self._identity = store_identity(self._conn, create=True)
        self._round = 0

    def read(self) -> _Table:
        return _Table(*self._store._read(self._request.namespace))

    def take(self, table: _Table, worker_id: int, horizon_ms: int) -> Taken | None:
        store, request, conn = self._store, self._request, self._conn
        row = table.rows.get(worker_id)
        floor = 0 if row is None else int(row["horizon"])
        taking = Taken(floor, max(floor, horizon_ms), identity=self._identity)
        reserve = request.claim is not None
        key = (request.namespace, worker_id)
        if row is None:
            if worker_id not in table.used:
                # Listed first, so that a row never exists unlisted (`holders` and this
                # read find worker ids by the list); a listed id without a row is new.
                try:
                    conn.lwt([(store._use, key)])
                except Unsure:  # the next round's read of the list tells
                    self._lost()
                    return None
            statements = [
                (store._new, (*key, request.owner, request.host, taking.horizon_ms, reserve)),
                (store._new_lease, (self._kept, request.owner, *key)),
            ]
        else:
            take = store._take_checked if reserve else store._take_leased
            statements = [
                (take, (self._kept, request.owner, *key, floor)),
                (store._take_rest, (request.owner, request.host, taking.horizon_ms, reserve, *key)),
            ]
        try:
            applied, unsure = conn.lwt(statements)[0], False
        except Unsure:
            applied, unsure = False, True
        if not applied:
            self._lost()
            if not unsure:
                return None
            held = conn.serial_read(store._holder, key)
            if not (held and held[0]["lease"] == request.owner):
                return None
            # it was applied after all
        return replace(taking, store_ms=conn.clock_ms())

    def _lost(self) -> None:
        """Wait after a lost round, longer with each."""
        back_off(self._round)
        self._round += 1


class CassandraLeaseStore(Capability, FencedLeases):
    """A LeaseStore on the `idmint_leases` table (see the module doc)."""

    def __init__(self, conn: Connection) -> None:
        super().__init__(conn)
        t = conn.leases
        key = "WHERE namespace = ? AND worker_id = ?"
        self._used = f"SELECT worker_id FROM {conn.worker_ids} WHERE namespace = ?"
        self._use = (
            f"INSERT INTO {conn.worker_ids} (namespace, worker_id) VALUES (?, ?) IF NOT EXISTS"
        )
        self._scan = (
            f"SELECT worker_id, owner, host, horizon, reserved, lease, TTL(lease) AS lease_ttl "
            f"FROM {t} WHERE namespace = ? AND worker_id IN ?"
        )
        self._holder = f"SELECT lease FROM {t} {key}"
        # A free row (no live lease) still as it was read; for a lease, not reserved either.
        self._take_checked = (
            f"UPDATE {t} USING TTL ? SET lease = ? {key} IF lease = null AND horizon = ?"
        )
        self._take_leased = f"{self._take_checked} AND reserved = false"
        self._take_rest = f"UPDATE {t} SET owner = ?, host = ?, horizon = ?, reserved = ? {key}"
        self._new = (
            f"INSERT INTO {t} (namespace, worker_id, owner, host, horizon, reserved) "
            "VALUES (?, ?, ?, ?, ?, ?) IF NOT EXISTS"
        )
        self._new_lease = f"UPDATE {t} USING TTL ? SET lease = ? {key}"
        self._renew = f"UPDATE {t} USING TTL ? SET lease = ? {key} IF owner = ? AND horizon = ?"
        self._renew_horizon = f"UPDATE {t} SET horizon = ? {key}"
        self._release = f"UPDATE {t} SET lease = null, owner = '' {key} IF owner = ?"
        self._release_down = (
            f"UPDATE {t} SET lease = null, owner = '', horizon = ? {key} IF owner = ?"
        )
        self._unreserve = f"UPDATE {t} SET reserved = false {key} IF reserved = true"
        self._meta_now = f"SELECT id, now() FROM {conn.meta} WHERE name = ?"

    def _read(self, namespace: str) -> tuple[set[int], dict[int, Row]]:
        """The worker ids the namespace has used, and their rows.

        Read at the URL's consistency, not by Paxos (whose reads of one partition contend with
        each other, and the rows are partitions of their own): a row just changed may show as it
        was, and an id just listed may be missing, which the conditional writes that take a
        row or list an id find out."""
        conn = self._open()
        used = {int(r["worker_id"]) for r in conn.run(self._used, (namespace,))}
        rows: dict[int, Row] = {}
        ordered = sorted(used)
        for start in range(0, len(ordered), SCAN_CHUNK):
            for row in conn.run(self._scan, (namespace, ordered[start : start + SCAN_CHUNK])):
                rows[int(row["worker_id"])] = row
        return used, rows

    @contextlib.contextmanager
    def _acquiring(self, request: Request) -> Iterator[_Acquisition]:
        yield _Acquisition(self, request)

    def _refresh(self, lease: Lease, horizon_ms: int, expected_ms: int) -> Lease | Found:
        conn = self._open()
        key = (lease.namespace, lease.worker_id)
        horizon = max(expected_ms, horizon_ms)
        applied, row = conn.lwt(
            [
                (self._renew, (_kept_s(lease.ttl), lease.owner, *key, lease.owner, expected_ms)),
                (self._renew_horizon, (horizon, *key)),
            ]
        )
        if not applied:
            return Found(row.get("owner") == lease.owner, int(row.get("horizon") or 0))
        rows = conn.run(self._meta_now, ("store",))
        store_id = str(rows[0]["id"]) if rows else None
        store_ms = uuid_ms(rows[0]["now()"]) if rows else conn.clock_ms()
        return replace(lease, horizon_ms=horizon, store_ms=store_ms, store_id=store_id)

    def _free(self, lease: Lease, horizon_ms: int | None) -> None:
        conn = self._open()
        key = (lease.namespace, lease.worker_id)
        if horizon_ms is None:
            conn.lwt([(self._release, (*key, lease.owner))])
        else:
            conn.lwt([(self._release_down, (horizon_ms, *key, lease.owner))])

    def _rows(self, namespace: str) -> list[WorkerInfo]:
        return [
            WorkerInfo(
                namespace,
                worker_id,
                str(row.get("owner") or ""),
                str(row.get("host") or ""),
                _expires_in(row),
                int(row.get("horizon") or 0),
                static=bool(row.get("reserved")),
            )
            for worker_id, row in sorted(self._read(namespace)[1].items())
        ]

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        return self._open().lwt([(self._unreserve, (namespace, worker_id))])[0]
