"""A process paused inside a lease acquire (SIGSTOP, a GC pause, a VM migration) must not hold
locks that other holders' renewals wait for: on main it held SELECT ... FOR UPDATE on every
worker row of the namespace, and every other holder lost its lease.

The pause is made inside the real store's acquire, on a real server: its connection stops
after a chosen statement until the test lets it go."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from idmint.stores import open_lease_store
from idmint.stores.sql.leases import SqlLeaseStore

from conftest import fresh_store_url

NOW = 1_800_000_000_000


class Gate:
    """Stops the connection after a statement that contains `marker`, once armed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.armed = False
        self.reached = threading.Event()
        self.opened = threading.Event()


class PausingCursor:
    def __init__(self, cursor: Any, gate: Gate) -> None:
        self._cursor, self._gate = cursor, gate

    def execute(self, statement: str, params: Any = ()) -> Any:
        result = (
            self._cursor.execute(statement, params) if params else self._cursor.execute(statement)
        )
        if self._gate.armed and self._gate.marker in statement:
            self._gate.armed = False
            self._gate.reached.set()
            self._gate.opened.wait(30)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)


class PausingConnection:
    def __init__(self, conn: Any, gate: Gate) -> None:
        self._conn, self._gate = conn, gate

    def cursor(self) -> PausingCursor:
        return PausingCursor(self._conn.cursor(), self._gate)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@pytest.mark.parametrize("kind", ["sqlite", "postgres", "mariadb"])
@pytest.mark.parametrize(
    "after", ["SELECT worker_id, owner", "UPDATE idmint_workers SET owner", "INSERT INTO idmint_w"]
)
def test_a_paused_acquire_never_blocks_renewals(
    kind: str, after: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = fresh_store_url(kind, request, tmp_path)
    holder = open_lease_store(url)
    assert isinstance(holder, SqlLeaseStore)
    held = [holder.acquire("p", workers=4, ttl=30, horizon_ms=NOW) for _ in range(2)]
    holder.release(held[1])  # a free row: the paused acquire takes it (UPDATE)
    if after.startswith("INSERT"):
        holder.acquire("p", workers=4, ttl=30, horizon_ms=NOW)  # the next is a new row
    gate = Gate(after)
    connect = holder._dialect.connect
    pausing = SqlLeaseStore(
        dataclasses.replace(holder._dialect, connect=lambda: PausingConnection(connect(), gate)),
        holder.display_url,
    )
    pausing.holders("p")  # connected before the gate is armed
    gate.armed = True
    acquirer = threading.Thread(
        target=pausing.acquire, args=("p",), kwargs={"workers": 4, "ttl": 30, "horizon_ms": NOW}
    )
    acquirer.start()
    try:
        assert gate.reached.wait(10), "the acquire never ran that statement"
        renewed: list[Any] = []
        started = time.monotonic()
        renewal = threading.Thread(target=lambda: renewed.append(holder.renew(held[0], NOW + 1)))
        renewal.start()
        renewal.join(5)
        assert renewed, (
            f"a renewal waited {time.monotonic() - started:.1f} s behind a paused acquire"
        )
        assert renewed[0].horizon_ms == NOW + 1
    finally:
        gate.opened.set()
        acquirer.join(30)
        pausing.close()
        holder.close()
