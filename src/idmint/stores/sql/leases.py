"""Worker-id leases on the SQL engines (the protocol is lease_protocol.py's; this module is its
statements): one row per (namespace, worker id), never deleted, whose `horizon_ms` only moves
up and is the next holder's floor. Expiry is judged by the database's clock (`Dialect.now_ms`),
the one clock every holder shares.

Acquire locks only the row it takes, for one statement: it reads the namespace's rows without a
lock, then takes one free row with a compare-and-set UPDATE (it matches only while the row is
exactly as read) or inserts a new one, retrying when another process got there first. A
process paused in the middle of an acquire holds no lock: renewals never wait behind it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..._errors import LeaseLost
from ..base import Lease, WorkerInfo
from ..lease_protocol import LOST, FencedLeases, Found, Request, Taken
from ..leasing import HOLDER_NAME_MAX
from .connection import RESERVED_TABLE, Dialect, SqlConnection

WORKERS_TABLE = "idmint_workers"
CREATE_WORKERS_TABLE = f"""
CREATE TABLE IF NOT EXISTS {WORKERS_TABLE} (
    namespace  VARCHAR(128) NOT NULL,
    worker_id  INTEGER      NOT NULL,
    owner      VARCHAR(64)  NOT NULL DEFAULT '',
    host       VARCHAR({HOLDER_NAME_MAX}) NOT NULL DEFAULT '',
    expires_ms BIGINT       NOT NULL DEFAULT 0,
    horizon_ms BIGINT       NOT NULL DEFAULT 0,
    PRIMARY KEY (namespace, worker_id)
)
"""


@dataclass
class _Table:
    """The namespace's rows by worker id (worker_id, owner, host, expires_ms, horizon_ms, now),
    the database's clock when they were read, and the reserved ids (read when choosing)."""

    rows: dict[int, Any]
    now: int
    reserved_ids: set[int]

    def held(self, worker_id: int) -> bool:
        row = self.rows.get(worker_id)  # free: never used, released, or its lease expired
        return not (row is None or row[1] == "" or int(row[3]) <= self.now)

    def reserved(self, worker_id: int) -> bool:
        return worker_id in self.reserved_ids

    def floor_ms(self, worker_id: int) -> int:
        row = self.rows.get(worker_id)
        return 0 if row is None else int(row[4])

    def holder(self, worker_id: int) -> tuple[str, float | None]:
        row = self.rows[worker_id]
        return str(row[2]), (int(row[3]) - self.now) / 1000


class _Unrenewed(LeaseLost):
    """A renewal's UPDATE matched no row: rolled back, with what was found instead."""

    def __init__(self, found: Found) -> None:
        super().__init__("not renewed")
        self.found = found


class _Acquisition:
    """One acquire's statements. No transaction: each statement commits on its own, so no lock
    outlives one."""

    def __init__(self, store: SqlLeaseStore, request: Request) -> None:
        self._store, self._request = store, request

    def read(self) -> _Table:
        store, namespace = self._store, self._request.namespace

        def body(cur: Any) -> _Table:
            cur.execute(store._scan, (namespace,))
            rows = {int(r[0]): r for r in cur.fetchall()}
            if rows:
                now = int(next(iter(rows.values()))[5])
            else:  # a new namespace: read the database's clock on its own
                cur.execute(store._now)
                now = int(cur.fetchone()[0])
            reserved: set[int] = set()
            if self._request.claim is None:
                cur.execute(store._reserved, (namespace,))
                reserved = {int(r[0]) for r in cur.fetchall()}
            return _Table(rows, now, reserved)

        return store._run(body, transaction=False)

    def take(self, table: _Table, worker_id: int, horizon_ms: int) -> Taken | None:
        store, request = self._store, self._request
        key = (request.namespace, worker_id)
        floor = table.floor_ms(worker_id)
        horizon = max(floor, horizon_ms)
        new = (request.owner, request.host, int(request.ttl * 1000), horizon)

        def body(cur: Any) -> Taken | None:
            if request.claim is not None:
                # Reserved first: a leasing process that read before this skips it next round.
                with contextlib.suppress(*store._dialect.duplicate):
                    cur.execute(store._reserve, key)
            taken = Taken(floor, horizon, store_ms=table.now, identity=store._identity)
            row = table.rows.get(worker_id)
            if row is None:
                try:
                    cur.execute(store._insert, (*key, *new))
                except store._dialect.duplicate:
                    return None
                return taken
            _, was_owner, _, was_expires, was_horizon, _ = row
            cur.execute(store._take, (*new, *key, was_owner, was_expires, was_horizon))
            return taken if cur.rowcount == 1 else None

        return store._run(body, transaction=False, write=True)


class SqlLeaseStore(SqlConnection, FencedLeases):
    """A LeaseStore on the idmint_workers table."""

    def __init__(self, dialect: Dialect, display_url: str) -> None:
        super().__init__(dialect, display_url)
        p, now, g = dialect.param, dialect.now_ms, dialect.greatest
        t = WORKERS_TABLE
        where = f"namespace = {p} AND worker_id = {p}"
        self._scan = (
            f"SELECT worker_id, owner, host, expires_ms, horizon_ms, {now} FROM {t} "
            f"WHERE namespace = {p}"
        )
        self._reserved = f"SELECT worker_id FROM {RESERVED_TABLE} WHERE namespace = {p}"
        self._reserve = f"INSERT INTO {RESERVED_TABLE} (namespace, worker_id) VALUES ({p}, {p})"
        self._unreserve = f"DELETE FROM {RESERVED_TABLE} WHERE {where}"
        # Matches only while the row is as it was read: nobody took it or moved it meanwhile.
        self._take = (
            f"UPDATE {t} SET owner = {p}, host = {p}, expires_ms = {now} + {p}, horizon_ms = {p} "
            f"WHERE {where} AND owner = {p} AND expires_ms = {p} AND horizon_ms = {p}"
        )
        self._insert = (
            f"INSERT INTO {t} (namespace, worker_id, owner, host, expires_ms, horizon_ms) "
            f"VALUES ({p}, {p}, {p}, {p}, {now} + {p}, {p})"
        )
        self._renew = (
            f"UPDATE {t} SET expires_ms = {now} + {p}, horizon_ms = {g}(horizon_ms, {p}) "
            f"WHERE {where} AND owner = {p} AND horizon_ms >= {p}"
        )
        self._holder = f"SELECT owner, horizon_ms FROM {t} WHERE {where}"
        self._horizon = f"SELECT horizon_ms, {now} FROM {t} WHERE {where}"
        self._now = f"SELECT {now}"
        self._release = f"UPDATE {t} SET owner = '', expires_ms = 0 WHERE {where} AND owner = {p}"
        self._release_down = (
            f"UPDATE {t} SET owner = '', expires_ms = 0, horizon_ms = {p} "
            f"WHERE {where} AND owner = {p}"
        )
        self._list = (
            f"SELECT worker_id, owner, host, expires_ms - {now}, horizon_ms FROM {t} "
            f"WHERE namespace = {p} ORDER BY worker_id"
        )

    @contextlib.contextmanager
    def _acquiring(self, request: Request) -> Iterator[_Acquisition]:
        yield _Acquisition(self, request)

    def _refresh(self, lease: Lease, horizon_ms: int, expected_ms: int) -> Lease | Found:
        key = (lease.namespace, lease.worker_id)

        def body(cur: Any) -> Lease:
            ttl_ms = int(lease.ttl * 1000)
            cur.execute(self._renew, (ttl_ms, horizon_ms, *key, lease.owner, lease.horizon_ms))
            if cur.rowcount != 1:
                cur.execute(self._holder, key)
                row = cur.fetchone()
                ours = row is not None and row[0] == lease.owner
                raise _Unrenewed(Found(True, int(row[1])) if ours else LOST)
            cur.execute(self._horizon, key)
            horizon, now = (int(v) for v in cur.fetchone())
            identity = self._identity
            return replace(
                lease,
                horizon_ms=horizon,
                store_ms=now,
                store_id=identity.id if identity else None,
                store_created_ms=identity.created_ms if identity else None,
            )

        try:
            return self._run(body)
        except _Unrenewed as exc:
            return exc.found

    def _free(self, lease: Lease, horizon_ms: int | None) -> None:
        key = (lease.namespace, lease.worker_id, lease.owner)
        if horizon_ms is None:
            self._run(lambda cur: cur.execute(self._release, key))
        else:
            self._run(lambda cur: cur.execute(self._release_down, (horizon_ms, *key)))

    def _rows(self, namespace: str) -> list[WorkerInfo]:
        def body(cur: Any) -> list[WorkerInfo]:
            cur.execute(self._reserved, (namespace,))
            reserved = {int(r[0]) for r in cur.fetchall()}
            cur.execute(self._list, (namespace,))
            return [
                WorkerInfo(
                    namespace,
                    int(wid),
                    str(owner),
                    str(host),
                    int(left) / 1000 if owner else None,
                    int(horizon),
                    static=int(wid) in reserved,
                )
                for wid, owner, host, left, horizon in cur.fetchall()
            ]

        return self._run(body, transaction=False)

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        def body(cur: Any) -> bool:
            cur.execute(self._unreserve, (namespace, worker_id))
            return bool(cur.rowcount == 1)

        return self._run(body)
