"""Worker-id leases on the SQL engines: one row per (namespace, worker id).

Expiry is judged by the database's clock (`Dialect.now_ms`), the one clock every holder shares.
A row is never deleted: its `horizon_ms` (the highest timestamp any holder of that id may
issue) only moves up and is the next holder's floor.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import replace
from typing import Any

from .._errors import LeaseLost, WorkersExhausted
from ._sql import Dialect, SqlConnection
from .base import Lease, WorkerInfo, pick_worker

WORKERS_TABLE = "idmint_workers"
CREATE_WORKERS_TABLE = f"""
CREATE TABLE IF NOT EXISTS {WORKERS_TABLE} (
    namespace  VARCHAR(128) NOT NULL,
    worker_id  INTEGER      NOT NULL,
    owner      VARCHAR(64)  NOT NULL DEFAULT '',
    host       VARCHAR(255) NOT NULL DEFAULT '',
    expires_ms BIGINT       NOT NULL DEFAULT 0,
    horizon_ms BIGINT       NOT NULL DEFAULT 0,
    PRIMARY KEY (namespace, worker_id)
)
"""

ACQUIRE_ATTEMPTS = 5  # two processes inserting the same new worker id: one retries


def holder_name() -> str:
    """Who holds a lease, for `idmint workers list`: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"[:255]


class SqlLeaseStore(SqlConnection):
    """A LeaseStore on the idmint_workers table."""

    def __init__(self, dialect: Dialect, display_url: str) -> None:
        super().__init__(dialect, display_url)
        p, now, g = dialect.param, dialect.now_ms, dialect.greatest
        t = WORKERS_TABLE
        where = f"namespace = {p} AND worker_id = {p}"
        self._scan = (
            f"SELECT worker_id, owner, expires_ms, horizon_ms, {now} FROM {t} "
            f"WHERE namespace = {p}" + dialect.for_update
        )
        self._take = (
            f"UPDATE {t} SET owner = {p}, host = {p}, expires_ms = {now} + {p}, horizon_ms = {p} "
            f"WHERE {where}"
        )
        self._insert = (
            f"INSERT INTO {t} (namespace, worker_id, owner, host, expires_ms, horizon_ms) "
            f"VALUES ({p}, {p}, {p}, {p}, {now} + {p}, {p})"
        )
        self._renew = (
            f"UPDATE {t} SET expires_ms = {now} + {p}, horizon_ms = {g}(horizon_ms, {p}) "
            f"WHERE {where} AND owner = {p}"
        )
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

    def acquire(
        self,
        namespace: str,
        *,
        workers: int,
        ttl: float,
        horizon_ms: int,
        now_ms: int | None = None,
    ) -> Lease:
        owner, host, ttl_ms = uuid.uuid4().hex, holder_name(), int(ttl * 1000)

        def body(cur: Any) -> Lease:
            cur.execute(self._scan, (namespace,))
            rows = {int(r[0]): r for r in cur.fetchall()}
            if rows:
                now = int(next(iter(rows.values()))[4])
            else:  # a new namespace: read the database's clock on its own
                cur.execute(self._now)
                now = int(cur.fetchone()[0])

            def floor(worker_id: int) -> int:
                row = rows.get(worker_id)
                return 0 if row is None else int(row[3])

            free = (
                w
                for w in range(workers)
                # never used, released, or its holder's lease expired
                if (row := rows.get(w)) is None or row[1] == "" or int(row[2]) <= now
            )
            worker_id = pick_worker(free, floor, now_ms)
            if worker_id is None:
                raise WorkersExhausted(namespace, workers)
            if worker_id not in rows:
                cur.execute(self._insert, (namespace, worker_id, owner, host, ttl_ms, horizon_ms))
                return Lease(namespace, worker_id, owner, 0, horizon_ms, ttl, store_ms=now)
            floor_ms = floor(worker_id)
            horizon = max(floor_ms, horizon_ms)
            cur.execute(self._take, (owner, host, ttl_ms, horizon, namespace, worker_id))
            return Lease(namespace, worker_id, owner, floor_ms, horizon, ttl, store_ms=now)

        for attempt in range(ACQUIRE_ATTEMPTS):
            try:
                return self._run(body)
            except self._dialect.duplicate:
                if attempt == ACQUIRE_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def renew(self, lease: Lease, horizon_ms: int) -> Lease:
        key = (lease.namespace, lease.worker_id)

        def body(cur: Any) -> Lease:
            cur.execute(self._renew, (int(lease.ttl * 1000), horizon_ms, *key, lease.owner))
            if cur.rowcount != 1:
                raise LeaseLost(
                    f"worker {lease.worker_id} of namespace {lease.namespace!r} has another owner"
                )
            cur.execute(self._horizon, key)
            horizon, now = (int(v) for v in cur.fetchone())
            return replace(lease, horizon_ms=horizon, store_ms=now)

        return self._run(body)

    def release(self, lease: Lease, issued_ms: int | None = None) -> None:
        key = (lease.namespace, lease.worker_id, lease.owner)
        if issued_ms is None:
            self._run(lambda cur: cur.execute(self._release, key))
        else:
            down = max(lease.floor_ms, issued_ms)
            self._run(lambda cur: cur.execute(self._release_down, (down, *key)))

    def holders(self, namespace: str) -> list[WorkerInfo]:
        def body(cur: Any) -> list[WorkerInfo]:
            cur.execute(self._list, (namespace,))
            return [
                WorkerInfo(
                    namespace,
                    int(wid),
                    str(owner),
                    str(host),
                    int(left) / 1000 if owner else None,
                    int(horizon),
                )
                for wid, owner, host, left, horizon in cur.fetchall()
            ]

        return self._run(body, transaction=False)
