"""Compare-and-set cells on Cassandra (`CassandraCasStore`), what both capabilities share
(`Capability`), and the store's identity."""

from __future__ import annotations

import threading
import uuid

from ..._errors import StoreUnavailable
from ..base import StoreIdentity
from .connection import Connection, Unsure, system_random


def _token() -> int:
    """A cell's new version: random, so that a write that timed out can be told apart from
    every other writer's by reading it back, and a version never comes back (no ABA)."""
    return system_random.getrandbits(62) + 1


class Capability:
    """What both capabilities share: the engine's one connection, and a close that leaves it to
    the others (and is safe to repeat)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.display_url = conn.display_url
        self._closed = False
        self._close_lock = threading.Lock()
        conn.join()

    def _open(self) -> Connection:
        if self._closed:
            raise StoreUnavailable(f"store {self.display_url} is closed")
        return self._conn

    def init(self) -> None:
        self._open().init()
        self.identity()

    def identity(self) -> StoreIdentity | None:
        return store_identity(self._open(), create=True)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._conn.leave()


def store_identity(conn: Connection, *, create: bool) -> StoreIdentity | None:
    """The store's identity, made if it is missing and `create`: a UUID and the coordinator's
    clock when it was made.

    Not a Paxos read: every acquire reads it, and Paxos reads of one partition contend with each
    other. A row written once by a lightweight transaction is seen by a quorum read once it is
    committed; one still in progress is completed by the `IF NOT EXISTS` that finds it."""
    read = f"SELECT id, created_ms FROM {conn.meta} WHERE name = ?"
    rows = conn.run(read, ("store",))
    if rows:
        return StoreIdentity(str(rows[0]["id"]), int(rows[0]["created_ms"]))
    if not create:
        return None
    made_id, made_ms = uuid.uuid4().hex, conn.clock_ms()
    make = f"INSERT INTO {conn.meta} (name, id, created_ms) VALUES (?, ?, ?) IF NOT EXISTS"
    try:
        applied, row = conn.lwt([(make, ("store", made_id, made_ms))])
    except Unsure:  # ours or another's: the read says which
        return store_identity(conn, create=False) or store_identity(conn, create=True)
    if applied:
        return StoreIdentity(made_id, made_ms)
    return StoreIdentity(str(row["id"]), int(row["created_ms"]))


class CassandraCasStore(Capability):
    """A CasStore on the `idmint_cells` table: every read a Paxos read, every write a
    lightweight transaction."""

    @property
    def datacenter_local(self) -> bool:
        """Whether its compare-and-sets are decided in one datacenter only (LOCAL_SERIAL): two
        datacenters can then both win one swap (see DatacenterRanges)."""
        return self._conn.settings.serial == "LOCAL_SERIAL"

    def read(self, key: str) -> tuple[str, int] | None:
        conn = self._open()
        rows = conn.serial_read(f"SELECT value, version FROM {conn.cells} WHERE name = ?", (key,))
        return (str(rows[0]["value"]), int(rows[0]["version"])) if rows else None

    def create(self, key: str, value: str) -> bool:
        conn = self._open()
        token = _token()
        make = f"INSERT INTO {conn.cells} (name, value, version) VALUES (?, ?, ?) IF NOT EXISTS"
        try:
            return conn.lwt([(make, (key, value, token))])[0]
        except Unsure:
            got = self.read(key)  # a Paxos read: it completes a write still in progress
            if got is None:
                raise
            return got[1] == token

    def swap(self, key: str, version: int, value: str) -> bool:
        conn = self._open()
        token = _token()
        update = f"UPDATE {conn.cells} SET value = ?, version = ? WHERE name = ? IF version = ?"
        try:
            return conn.lwt([(update, (value, token, key, version))])[0]
        except Unsure:
            got = self.read(key)
            return got is not None and got[1] == token

    def scan(self, prefix: str) -> list[tuple[str, str]]:
        """Every cell whose name starts with `prefix`: the whole table is read (at the URL's
        consistency, not a Paxos read) and filtered here. For listing keys, not a hot path."""
        conn = self._open()
        rows = conn.run(f"SELECT name, value FROM {conn.cells}", ())
        return sorted(
            (str(r["name"]), str(r["value"])) for r in rows if str(r["name"]).startswith(prefix)
        )
