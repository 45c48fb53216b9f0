"""Worker-id leases on the SQL engines: one row per (namespace, worker id).

Expiry is judged by the database's clock (`Dialect.now_ms`), the one clock every holder shares.
A row is never deleted: its `horizon_ms` (the highest timestamp any holder of that id may
issue) only moves up and is the next holder's floor.

Acquire locks only the row it takes, and only for one statement: it reads the namespace's rows
without a lock, then takes one free row with a compare-and-set UPDATE (it matches only while
the row is exactly as read) or inserts a new one, retrying when another process got there
first. A process paused in the middle of an acquire holds no lock, so other holders' renewals
never wait behind it.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import replace
from typing import Any

from ..._errors import LeaseLost, StoreUnavailable, WorkerInUse
from ..base import Lease, WorkerInfo, check_claim, forgotten
from ..leasing import HOLDER_NAME_MAX, choose_worker, holder_name
from .connection import SqlConnection
from .schema import RESERVED_TABLE, Dialect

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

# Each lost round means another process took a worker id or inserted a row meanwhile: this
# bounds only pathological contention.
ACQUIRE_ATTEMPTS = 100


class SqlLeaseStore(SqlConnection):
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

    def _lease(self, lease: Lease, **changes: Any) -> Lease:
        """`lease` with `changes` and the identity of the store as this connection sees it."""
        identity = self._identity
        return replace(
            lease,
            store_id=identity.id if identity else None,
            store_created_ms=identity.created_ms if identity else None,
            **changes,
        )

    def acquire(
        self,
        namespace: str,
        *,
        workers: int,
        ttl: float,
        horizon_ms: int,
        now_ms: int | None = None,
        worker_id: int | None = None,
    ) -> Lease:
        owner, host, ttl_ms = uuid.uuid4().hex, holder_name(), int(ttl * 1000)
        claim = None if worker_id is None else check_claim(worker_id, workers)

        def attempt(cur: Any) -> Lease | None:
            """One round: a lease, or None when another process changed a row first."""
            cur.execute(self._scan, (namespace,))
            rows = {int(r[0]): r for r in cur.fetchall()}
            if rows:
                now = int(next(iter(rows.values()))[5])
            else:  # a new namespace: read the database's clock on its own
                cur.execute(self._now)
                now = int(cur.fetchone()[0])

            def free(row: Any) -> bool:  # never used, released, or its holder's lease expired
                return row is None or row[1] == "" or int(row[3]) <= now

            def floor(worker_id: int) -> int:
                row = rows.get(worker_id)
                return 0 if row is None else int(row[4])

            if claim is None:
                cur.execute(self._reserved, (namespace,))
                reserved = {int(r[0]) for r in cur.fetchall()}
                candidates = (w for w in range(workers) if w not in reserved and free(rows.get(w)))
                chosen = choose_worker(namespace, workers, candidates, floor, now_ms)
            else:
                chosen = claim
                row = rows.get(chosen)
                if row is not None and not free(row):
                    raise WorkerInUse(namespace, chosen, str(row[2]), (int(row[3]) - now) / 1000)
                # Reserved first: a leasing process that read before this skips it next round.
                with contextlib.suppress(*self._dialect.duplicate):
                    cur.execute(self._reserve, (namespace, chosen))
            lease = Lease(namespace, chosen, owner, floor(chosen), 0, ttl, store_ms=now)
            lease = self._lease(lease, horizon_ms=max(lease.floor_ms, horizon_ms))
            lease = replace(lease, static=claim is not None)
            row = rows.get(chosen)
            if row is None:
                try:
                    cur.execute(
                        self._insert,
                        (namespace, chosen, owner, host, ttl_ms, lease.horizon_ms),
                    )
                except self._dialect.duplicate:
                    return None
                return lease
            _, was_owner, _, was_expires, was_horizon, _ = row
            new = (owner, host, ttl_ms, lease.horizon_ms)
            cur.execute(self._take, (*new, namespace, chosen, was_owner, was_expires, was_horizon))
            return lease if cur.rowcount == 1 else None

        for _ in range(ACQUIRE_ATTEMPTS):
            # No transaction: each statement commits on its own, so no lock outlives one.
            got = self._run(attempt, transaction=False)
            if got is not None:
                return got
        raise StoreUnavailable(
            f"store {self.display_url}: {ACQUIRE_ATTEMPTS} concurrent writers in a row took "
            f"worker ids of namespace {namespace!r} first"
        )

    def renew(self, lease: Lease, horizon_ms: int) -> Lease:
        key = (lease.namespace, lease.worker_id)

        def body(cur: Any) -> Lease:
            ttl_ms = int(lease.ttl * 1000)
            cur.execute(self._renew, (ttl_ms, horizon_ms, *key, lease.owner, lease.horizon_ms))
            if cur.rowcount != 1:
                cur.execute(self._holder, key)
                row = cur.fetchone()
                if row is not None and row[0] == lease.owner:
                    raise forgotten(lease, int(row[1]))
                raise LeaseLost(
                    f"worker {lease.worker_id} of namespace {lease.namespace!r} has another owner"
                )
            cur.execute(self._horizon, key)
            horizon, now = (int(v) for v in cur.fetchone())
            return self._lease(lease, horizon_ms=horizon, store_ms=now)

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
