"""Compare-and-set cells and worker-id leases on Apache Cassandra, with lightweight transactions
(Paxos): `cassandra://host1,host2:9042/keyspace?dc=dc1&serial=SERIAL`.

URL: hosts (contact points, one port for all, default 9042), the keyspace (default `idmint`),
optionally `user:password@`, and the parameters

- `serial`: SERIAL (default: one Paxos round across every datacenter) or LOCAL_SERIAL (the local
  datacenter only: faster and alive through a partition, but two datacenters can both win);
- `consistency`: the commit of every write and the reads that are not Paxos reads (a listing of
  cells, the identity on a renewal): QUORUM by default, LOCAL_QUORUM with LOCAL_SERIAL;
- `dc`: the local datacenter, where requests go (token-aware within it); default: the contact
  points' datacenter;
- `replication`: for the keyspace idmint makes if it is missing: `3` (SimpleStrategy, 3 replicas)
  or `dc1:3,dc2:3` (NetworkTopologyStrategy); default SimpleStrategy with one replica;
- `protocol`: the native protocol version, 3 (default: Cassandra 2.1 speaks no later one), 4, 5;
- `ca`, `cert`, `key`, `tls`: TLS to every node (stores/tls.py): the CA that signed the nodes'
  certificates, a client certificate and its key (for `require_client_auth`), or `tls=1` for
  the system's CAs. Each node's certificate and name (its address) are verified.

Locked down (docs/stores.md): the user (PasswordAuthenticator) needs SELECT and MODIFY on the
keyspace once an administrator made it and its tables (`idmint init` as an admin); CREATE on
it too to let idmint make its tables. A refused password, a missing permission or a failed
handshake is a StoreUnavailable that says which, in one line.

Tables, in the keyspace, made on first use and by `init()`:

    idmint_cells  (name text PRIMARY KEY, value text, version bigint)
    idmint_leases (namespace text, worker_id int, owner text, host text, horizon bigint,
                   reserved boolean, lease text, PRIMARY KEY ((namespace, worker_id)))
    idmint_worker_ids (namespace text, worker_id int, PRIMARY KEY (namespace, worker_id))
    idmint_meta   (name text PRIMARY KEY, id text, created_ms bigint)

Every write is a lightweight transaction, never a plain write: Cassandra's Paxos is linearizable
only among writes that all go through it. A cell's version is a random 62-bit token, new on every
write, so after a timed-out write one Paxos read tells whether it was ours.

Each worker id of a namespace is a partition of its own, so holders renewing different ids never
contend (every lightweight transaction on one partition is one Paxos instance); the ids a
namespace has used are listed in one partition of `idmint_worker_ids`, written once per id. A
lease is two columns: `owner` (no TTL: who took the id last) and `lease` (the owner again, written
with a TTL, so Cassandra's clock judges expiry: an id is free while `lease` is null). The horizon
has no TTL and only moves up; it is changed only in the Paxos round that checks the owner.

The store's clock that a lease reports is `now()` on the coordinator that answered a read.

Modules: settings.py (the URL), connection.py (the driver), leases.py (worker ids); this one
has the cells and opens the engine.
"""

from __future__ import annotations

from dataclasses import replace

from ..._errors import InvalidArgument
from ..engine import Engine
from ..over_cas.ranges import CasRangeStore
from .connection import Capability, Connection, Unsure, import_driver, system_random
from .leases import CassandraLeaseStore
from .settings import parse_url as parse_url  # also its public path


def _token() -> int:
    """A cell's new version: random, so that a write that timed out can be told apart from
    every other writer's by reading it back, and a version never comes back (no ABA)."""
    return system_random.getrandbits(62) + 1


class CassandraCasStore(Capability):
    """A CasStore on the `idmint_cells` table: every read a Paxos read, every write a
    lightweight transaction."""

    @property
    def datacenter_local(self) -> bool:
        """Whether its compare-and-sets are decided in one datacenter only (LOCAL_SERIAL): two
        datacenters can then both win one swap (see DatacenterRanges)."""
        return self._conn.settings.serial == "LOCAL_SERIAL"

    @property
    def decided_in(self) -> str:
        """Where its compare-and-sets are decided: one keyspace's rows decided by two Paxos
        groups (SERIAL, or LOCAL_SERIAL in two datacenters) are two stores, whatever their
        identity says (see DatacenterCellStore's binding)."""
        settings = self._conn.settings
        return "SERIAL" if settings.serial == "SERIAL" else f"LOCAL_SERIAL in {settings.dc}"

    @property
    def datacenter(self) -> str | None:
        """The datacenter its URL names (?dc=): where its coordinators are."""
        return self._conn.settings.dc

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


def open_cassandra_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The cassandra engine of a URL: cas, ranges (over cas) and leases, on one driver Session
    (the URL is checked here, no I/O)."""
    settings = parse_url(url, display)
    driver = import_driver()
    # Made here: a CA or certificate that cannot be read is an InvalidArgument at once.
    context = settings.tls.context(display) if settings.tls is not None else None
    conn = Connection(settings, url, display, timeout, driver, context)

    def local_cas(dc: str) -> CassandraCasStore:
        # The same cluster at LOCAL_SERIAL, through the datacenter's own coordinators: cells
        # that only that datacenter writes (see strategies/datacenter.py). A URL that names
        # another datacenter is a process pointed at the wrong one: its LOCAL_SERIAL rounds
        # would run in that datacenter's Paxos group, apart from its own datacenter's.
        if settings.dc is not None and settings.dc != dc:
            raise InvalidArgument(
                f"store {display} names datacenter {settings.dc!r} (?dc=) and this process "
                f"serves datacenter {dc!r} (--dc, IDMINT_DC, dc=): its compare-and-sets must run "
                f"on {dc!r}'s own nodes; give a URL with ?dc={dc} (or no ?dc=)"
            )
        local = replace(settings, serial="LOCAL_SERIAL", consistency="LOCAL_QUORUM", dc=dc)
        shown = f"{display} (LOCAL_SERIAL in {local.dc})"
        return CassandraCasStore(Connection(local, url, shown, timeout, driver, context))

    return Engine(
        "cassandra",
        display,
        {
            "cas": lambda _: CassandraCasStore(conn),
            "ranges": lambda engine: CasRangeStore(engine.cas()),
            "leases": lambda _: CassandraLeaseStore(conn),
        },
        local_cas=local_cas,
    )
