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
- `protocol`: the native protocol version, 3 (default: Cassandra 2.1 speaks no later one), 4, 5.

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
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from ..._errors import (
    DriverMissing,
    InvalidArgument,
    LeaseLost,
    StoreUnavailable,
    WorkerInUse,
)
from ..._fork import ForkAware, orphan
from ...ids import is_digits
from .._urls import ENCODE_HINT, misplaced_at, scrub
from ..base import Lease, StoreIdentity, WorkerInfo, check_claim, forgotten
from ..engine import Engine
from ..leasing import choose_worker, holder_name
from ..over_cas.ranges import CasRangeStore

T = TypeVar("T")

DEFAULT_PORT = 9042
DEFAULT_KEYSPACE = "idmint"
SERIALS = ("SERIAL", "LOCAL_SERIAL")
CONSISTENCIES = (
    "ONE",
    "TWO",
    "THREE",
    "QUORUM",
    "ALL",
    "LOCAL_QUORUM",
    "EACH_QUORUM",
    "LOCAL_ONE",
)
PROTOCOLS = (3, 4, 5)
SCHEMA_TIMEOUT = 10.0  # seconds for DDL and schema agreement: done once per keyspace
ATTEMPTS = 100  # rounds of acquire or renew lost to other writers in a row
SCAN_CHUNK = 100  # worker ids read in one request (IN on the partition key)
_UUID_EPOCH = 0x01B21DD213814000  # 1582-10-15 in the 100 ns units of a version-1 UUID
_KEYSPACE = re.compile(r"[a-z][a-z0-9_]{0,47}")
_DC = re.compile(r"[A-Za-z0-9_.-]+")
_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+")
_MISSING_SCHEMA = re.compile(r"unconfigured (columnfamily|table)|keyspace .*does not exist", re.I)
# From the OS, not a seeded generator: a forked child would repeat its parent's sequence, and two
# processes writing the same "new" version of a cell would each take the other's for its own.
_random = random.SystemRandom()


# -- the URL -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What a cassandra:// URL says."""

    hosts: tuple[str, ...]
    port: int
    keyspace: str
    serial: str
    consistency: str
    dc: str | None
    replication: dict[str, str]
    protocol: int
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    def replication_cql(self) -> str:
        return "{" + ", ".join(f"'{k}': '{v}'" for k, v in self.replication.items()) + "}"


def parse_url(url: str, display: str) -> Settings:
    """The settings of a cassandra:// URL; InvalidArgument naming what is wrong."""

    def bad(reason: str) -> InvalidArgument:
        # urlsplit's reasons quote what it made of the URL: maybe pieces of a password
        return InvalidArgument(f"bad store URL {display!r}: {scrub(reason, url)}")

    if misplaced_at(url):
        raise bad(ENCODE_HINT)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise bad(str(exc)) from None
    if parts.fragment:
        raise bad("a cassandra:// URL has no #fragment")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        # urlsplit leaves them percent-encoded, as the URL must write "/ ? # @ :" in them
        username, password = unquote(user), unquote(secret) if colon else None
    if not hostlist:
        raise bad("it names no host (cassandra://host1,host2:port/keyspace)")
    hosts, ports = _hosts_and_ports(hostlist, bad)
    if len(ports) > 1:
        raise bad("every host must have the same port (the driver takes one)")
    port = ports.pop() if ports else DEFAULT_PORT
    keyspace = parts.path.strip("/") or DEFAULT_KEYSPACE
    if not _KEYSPACE.fullmatch(keyspace):
        raise bad(
            f"keyspace {keyspace!r}: lowercase letters, digits and _, starting with a letter, "
            "at most 48"
        )
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    known = {"serial", "consistency", "dc", "replication", "protocol"}
    unknown = set(query) - known
    if unknown:
        raise bad(f"unknown parameter {sorted(unknown)[0]!r} (known: {', '.join(sorted(known))})")
    serial = query.get("serial", "SERIAL").upper()
    if serial not in SERIALS:
        raise bad(f"serial must be SERIAL or LOCAL_SERIAL, not {query['serial']!r}")
    default = "LOCAL_QUORUM" if serial == "LOCAL_SERIAL" else "QUORUM"
    consistency = query.get("consistency", default).upper()
    if consistency not in CONSISTENCIES:
        raise bad(
            f"consistency must be one of {', '.join(CONSISTENCIES)}, not {query['consistency']!r}"
        )
    dc = query.get("dc")
    if dc is not None and not _DC.fullmatch(dc):
        raise bad(f"dc {dc!r} is not a datacenter name")
    protocol = query.get("protocol", "3")
    if protocol not in {str(p) for p in PROTOCOLS}:
        raise bad(f"protocol must be 3, 4 or 5, not {protocol!r}")
    return Settings(
        hosts=tuple(hosts),
        port=port,
        keyspace=keyspace,
        serial=serial,
        consistency=consistency,
        dc=dc,
        replication=_replication(query.get("replication", "1"), bad),
        protocol=int(protocol),
        username=username,
        password=password,
    )


def _hosts_and_ports(
    hostlist: str, bad: Callable[[str], InvalidArgument]
) -> tuple[list[str], set[int]]:
    hosts: list[str] = []
    ports: set[int] = set()
    for item in hostlist.split(","):
        host, port = item, ""
        if item.startswith("["):  # [IPv6]:port
            end = item.find("]")
            host, port = item[: end + 1], item[end + 2 :] if item[end + 1 : end + 2] else ""
        elif ":" in item:
            host, _, port = item.rpartition(":")
        if not _HOST.fullmatch(host):
            raise bad(f"{item!r} is not host[:port] (cassandra://host1,host2:port/keyspace)")
        if port or item.endswith(":"):
            if not is_digits(port) or not 0 < int(port) < 65536:
                raise bad(f"port {port!r} is not a number from 1 to 65535")
            ports.add(int(port))
        hosts.append(host.strip("[]"))
    return hosts, ports


def _replication(text: str, bad: Callable[[str], InvalidArgument]) -> dict[str, str]:
    """`3` -> SimpleStrategy with 3 replicas; `dc1:3,dc2:1` -> NetworkTopologyStrategy."""
    if is_digits(text) and int(text) > 0:
        return {"class": "SimpleStrategy", "replication_factor": str(int(text))}
    replication = {"class": "NetworkTopologyStrategy"}
    for item in text.split(","):
        dc, colon, count = item.partition(":")
        if not (colon and _DC.fullmatch(dc) and is_digits(count) and int(count) > 0):
            raise bad(
                f"replication {text!r}: a replica count (3), or datacenters with theirs "
                "(dc1:3,dc2:3)"
            )
        replication[dc] = str(int(count))
    return replication


# -- the driver ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Driver:
    """The parts of the DataStax driver used here (imported only when a store is opened)."""

    cluster: Any  # cassandra.cluster
    policies: Any  # cassandra.policies
    query: Any  # cassandra.query
    consistency: Any  # cassandra.ConsistencyLevel
    auth: Any  # cassandra.auth.PlainTextAuthProvider
    invalid_request: type[Exception]
    write_timeout: type[Exception]
    read_timeout: type[Exception]
    timed_out: type[Exception]  # the driver's own deadline: OperationTimedOut
    no_host: type[Exception]  # NoHostAvailable: every node the request could go to failed
    cas_write_type: int
    errors: tuple[type[BaseException], ...]  # every failure of the store, not of the caller


def _import_driver() -> _Driver:
    try:
        import cassandra
        import cassandra.auth
        import cassandra.cluster
        import cassandra.connection
        import cassandra.policies
        import cassandra.protocol
        import cassandra.query
    except ImportError:
        raise DriverMissing(
            "cassandra:// stores need the DataStax driver: pip install 'idmint[cassandra]'"
        ) from None
    except Exception as exc:  # DependencyException: no event loop it can use (libev, asyncore)
        why = " ".join(str(exc).split())[:300]
        raise DriverMissing(f"the DataStax driver for cassandra:// cannot load: {why}") from None
    return _Driver(
        cluster=cassandra.cluster,
        policies=cassandra.policies,
        query=cassandra.query,
        consistency=cassandra.ConsistencyLevel,
        auth=cassandra.auth.PlainTextAuthProvider,
        invalid_request=cassandra.InvalidRequest,
        write_timeout=cassandra.WriteTimeout,
        read_timeout=cassandra.ReadTimeout,
        timed_out=cassandra.OperationTimedOut,
        no_host=cassandra.cluster.NoHostAvailable,
        cas_write_type=cassandra.WriteType.CAS,
        errors=(
            cassandra.DriverException,  # timeouts, Unavailable, refused requests
            cassandra.cluster.NoHostAvailable,
            cassandra.connection.ConnectionException,
            cassandra.protocol.ErrorMessage,  # what the server answered with an error
            OSError,
        ),
    )


class _Unsure(StoreUnavailable):
    """A write the coordinator reported as timed out (WriteTimeout): it may have been applied,
    or may be yet. The node answered, so a Paxos read can tell."""


class _Contended(StoreUnavailable):
    """A Paxos read the coordinator reported as timed out (ReadTimeout): it lost its rounds to
    other writers of the partition for cas_contention_timeout. Nothing was written, and the node
    answered: asking again is safe, and is what contention calls for."""


class _Connection(ForkAware):
    """The driver's Cluster and Session for one URL, shared by the engine's capabilities.

    Connected on first use (the schema is made then if it is missing), made again after a fork
    or after every capability closed it; thread-safe (the driver's Session is)."""

    def __init__(
        self, settings: Settings, url: str, display: str, timeout: float, driver: _Driver
    ) -> None:
        self.settings = settings
        self.display_url = display
        self.timeout = timeout
        self._url = url
        self._driver = driver
        ks = settings.keyspace
        self.cells, self.leases, self.worker_ids, self.meta = (
            f"{ks}.idmint_cells",
            f"{ks}.idmint_leases",
            f"{ks}.idmint_worker_ids",
            f"{ks}.idmint_meta",
        )
        levels = driver.consistency
        self.serial = getattr(levels, settings.serial)
        self.consistency = getattr(levels, settings.consistency)
        self.one = levels.ONE
        self._lock = threading.Lock()
        self._cluster: Any = None
        self._session: Any = None
        self._prepared: dict[tuple[str, int, int | None], Any] = {}
        self._users = 0
        self._failed_connects = 0
        self._connect_error: StoreUnavailable | None = None
        self._watch_fork()

    def _after_fork(self) -> None:
        # The driver's threads did not survive the fork, and its sockets are the parent's:
        # leave them to the parent (and keep the child's exit from shutting them down).
        cluster = self._cluster
        if cluster is not None:
            with contextlib.suppress(Exception):
                self._driver.cluster._discard_cluster_shutdown(cluster)
        orphan(cluster)
        orphan(self._session)
        self._cluster = self._session = None
        self._prepared = {}
        self._lock = threading.Lock()

    # -- users ------------------------------------------------------------------------------------

    def join(self) -> None:
        with self._lock:
            self._users += 1

    def leave(self) -> None:
        """One capability closed: the last one shuts the driver down."""
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            cluster, self._cluster, self._session = self._cluster, None, None
            self._prepared = {}
        if cluster is not None:
            self._shut_down(cluster)

    def _shut_down(self, cluster: Any) -> None:
        """Cluster.shutdown joins the driver's threads, which may wait on a hung node
        (connecting, say): waited for at most the timeout, the rest goes on in the background."""
        closer = threading.Thread(target=cluster.shutdown, name="idmint-cassandra-close")
        closer.daemon = True
        closer.start()
        closer.join(self.timeout)

    # -- connecting -------------------------------------------------------------------------------

    def _connected(self) -> Any:
        self._check_fork()
        seen = self._failed_connects
        with self._lock:
            if self._session is None:
                if self._failed_connects != seen and self._connect_error is not None:
                    # The attempt this thread waited for failed: so does this call, at once,
                    # rather than each waiting thread taking its own timeout in turn.
                    raise type(self._connect_error)(str(self._connect_error))
                try:
                    self._connect()
                except self._driver.errors as exc:
                    self._failed_connects += 1
                    self._connect_error = self.error(exc)
                    raise
            return self._session

    def _connect(self) -> None:
        """Connect and make the schema if it is missing. Hold self._lock."""
        d, s = self._driver, self.settings
        policies = d.policies
        profile = d.cluster.ExecutionProfile(
            # Coordinators in the datacenter only: LOCAL_SERIAL is decided in the coordinator's
            # datacenter, and another one's Paxos group would let two datacenters both win.
            load_balancing_policy=policies.TokenAwarePolicy(
                policies.DCAwareRoundRobinPolicy(local_dc=s.dc or "", used_hosts_per_remote_dc=0)
            ),
            # Errors come to us as they are: the driver's default policy retries some requests
            # on another host, and, pinned to one host, wraps Unavailable in NoHostAvailable.
            retry_policy=policies.FallthroughRetryPolicy(),
            consistency_level=self.consistency,
            serial_consistency_level=self.serial,
            request_timeout=self.timeout,
            row_factory=d.query.dict_factory,
        )
        auth = None
        if s.username is not None:
            auth = d.auth(username=s.username, password=s.password or "")
        cluster = d.cluster.Cluster(
            contact_points=list(s.hosts),
            port=s.port,
            protocol_version=s.protocol,
            auth_provider=auth,
            execution_profiles={d.cluster.EXEC_PROFILE_DEFAULT: profile},
            connect_timeout=self.timeout,
            control_connection_timeout=self.timeout,
            max_schema_agreement_wait=SCHEMA_TIMEOUT,
            # A node that comes back is found within 2 s, not the default's minutes.
            reconnection_policy=policies.ExponentialReconnectionPolicy(0.2, 2.0, None),
            # Preparing waits for one node, not for each in turn (a hung one would hold every
            # first call up); a node that has not seen a statement asks for it once.
            prepare_on_all_hosts=False,
        )
        try:
            try:
                session = cluster.connect()
            except self._driver.errors:
                # No node to connect to in `dc` fails here; the control connection has
                # learnt every node's datacenter by then: say which ones there are.
                self._check_datacenter(cluster)
                raise
            # What PREPARE waits for: 10 s otherwise, and with execution profiles the driver
            # refuses to set it through its property.
            session._default_timeout = self.timeout
            self._check_datacenter(cluster)
            self._make_schema(cluster, session, force=False)
        except BaseException:
            self._shut_down(cluster)
            raise
        self._cluster, self._session = cluster, session

    def _check_datacenter(self, cluster: Any) -> None:
        """Refuse a `dc` none of the cluster's nodes is in: no request may go to another
        datacenter's coordinators in its place (the driver knows each node's datacenter)."""
        dc = self.settings.dc
        if dc is None:
            return
        seen: dict[str, list[str]] = {}
        for host in cluster.metadata.all_hosts():
            seen.setdefault(str(host.datacenter), []).append(str(host.address))
        # A node whose datacenter the driver has not learnt yet (no control connection: the
        # contact points are down or starting) could be in `dc`: that is a store not answering,
        # which the caller reports, never a wrong datacenter.
        if dc not in seen and "None" not in seen:
            known = "; ".join(f"{name}: {', '.join(sorted(a))}" for name, a in sorted(seen.items()))
            raise InvalidArgument(
                f"store {self.display_url}: no node of the cluster is in datacenter {dc!r} "
                f"(its nodes: {known}); name one of its datacenters"
            )

    def _make_schema(self, cluster: Any, session: Any, *, force: bool) -> None:
        """CREATE ... IF NOT EXISTS the keyspace and tables, unless the driver's view of the
        schema has them all; each waits for the nodes to agree on the schema."""
        s = self.settings
        keyspace = cluster.metadata.keyspaces.get(s.keyspace)
        tables = ("idmint_cells", "idmint_leases", "idmint_worker_ids", "idmint_meta")
        if not force and keyspace is not None and all(t in keyspace.tables for t in tables):
            return
        statements = [
            f"CREATE KEYSPACE IF NOT EXISTS {s.keyspace} WITH replication = " + s.replication_cql(),
            f"CREATE TABLE IF NOT EXISTS {self.cells} "
            "(name text PRIMARY KEY, value text, version bigint)",
            f"CREATE TABLE IF NOT EXISTS {self.leases} (namespace text, worker_id int, "
            "owner text, host text, horizon bigint, reserved boolean, lease text, "
            "PRIMARY KEY ((namespace, worker_id)))",
            f"CREATE TABLE IF NOT EXISTS {self.worker_ids} "
            "(namespace text, worker_id int, PRIMARY KEY (namespace, worker_id))",
            f"CREATE TABLE IF NOT EXISTS {self.meta} "
            "(name text PRIMARY KEY, id text, created_ms bigint)",
        ]
        for statement in statements:
            answer = session.execute(statement, timeout=max(self.timeout, SCHEMA_TIMEOUT))
            if not answer.response_future.is_schema_agreed:
                raise StoreUnavailable(
                    f"store {self.display_url} unavailable: the nodes did not agree on the "
                    f"schema within {SCHEMA_TIMEOUT:g} s (a node down, or partitioned?)"
                )

    def init(self) -> None:
        self.call(lambda session: None)

    # -- statements -------------------------------------------------------------------------------

    def _prepare(self, session: Any, cql: str, consistency: int, serial: int | None) -> Any:
        key = (cql, consistency, serial)
        prepared = self._prepared.get(key)
        if prepared is None:
            prepared = session.prepare(cql)
            prepared.consistency_level = consistency
            if serial is not None:
                prepared.serial_consistency_level = serial
            self._prepared[key] = prepared  # two threads may both prepare: either will do
        return prepared

    def call(self, body: Callable[[Any], T]) -> T:
        """`body(session)`, driver errors mapped to StoreUnavailable; a keyspace or table
        dropped behind our back is made again (a new identity with it) and the body rerun."""
        for attempt in (1, 2):
            session = None
            try:
                session = self._connected()
                return body(session)
            except self._driver.invalid_request as exc:
                if attempt == 1 and _MISSING_SCHEMA.search(str(exc)):
                    self._schema_lost()
                    continue
                self.fail(exc)
            except self._driver.errors as exc:
                if session is not None and isinstance(exc, self._driver.no_host):
                    self._drop(session)
                self.fail(exc)
        raise AssertionError("unreachable")

    def _drop(self, session: Any) -> None:
        """Forget a session that has no node left to ask: the next call connects afresh, and so
        finds a node the moment it is back (the driver would look again only on its
        reconnection schedule). While every node is down a connection is refused at once."""
        with self._lock:
            if self._session is not session:
                return  # another thread dropped it already
            cluster, self._cluster, self._session = self._cluster, None, None
            self._prepared = {}
        closer = threading.Thread(target=cluster.shutdown, name="idmint-cassandra-close")
        closer.daemon = True
        closer.start()

    def _schema_lost(self) -> None:
        try:
            with self._lock:
                self._prepared = {}
                if self._session is not None:
                    self._make_schema(self._cluster, self._session, force=True)
        except self._driver.errors as exc:
            self.fail(exc)

    def run(
        self,
        cql: str,
        params: Iterable[Any],
        *,
        consistency: int | None = None,
        serial: int | None = None,
        timeout: float | None = None,
    ) -> list[dict[str, Any]]:
        """Rows of one prepared statement (all pages)."""
        level = self.consistency if consistency is None else consistency
        wait = self.timeout if timeout is None else timeout

        def body(session: Any) -> list[dict[str, Any]]:
            prepared = self._prepare(session, cql, level, serial)
            return list(session.execute(prepared, tuple(params), timeout=wait))

        return self.call(body)

    def serial_read(self, cql: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
        """Rows of a Paxos read. One the coordinator answers as timed out (contended) is asked
        again after a random pause, for at most the store's timeout in all: under many writers
        of one partition a Paxos read can lose every round it tries, while the writes go on."""
        deadline = time.monotonic() + self.timeout
        attempt = 0
        while True:
            left = deadline - time.monotonic()
            try:
                return self.run(cql, params, consistency=self.serial, timeout=max(left, 0.05))
            except _Contended:
                attempt += 1
                if deadline - time.monotonic() < 0.1:
                    raise
                _back_off(attempt)

    def lwt(self, statements: list[tuple[str, tuple[Any, ...]]]) -> tuple[bool, dict[str, Any]]:
        """A conditional statement (or batch of them, one partition): whether it was applied,
        and the current values of the columns its conditions name when it was not."""

        def body(session: Any) -> tuple[bool, dict[str, Any]]:
            if len(statements) == 1:
                cql, params = statements[0]
                prepared = self._prepare(session, cql, self.consistency, self.serial)
                answer = session.execute(prepared, params, timeout=self.timeout)
            else:
                batch = self._driver.query.BatchStatement(
                    consistency_level=self.consistency, serial_consistency_level=self.serial
                )
                for cql, params in statements:
                    batch.add(self._prepare(session, cql, self.consistency, self.serial), params)
                answer = session.execute(batch, timeout=self.timeout)
            row: dict[str, Any] = answer.one() or {}
            return bool(row.get("[applied]")), row

        return self.call(body)

    def clock_ms(self) -> int:
        """The coordinator's clock (Unix ms), from `now()`: a version-1 UUID of its time (there
        is no function for the time itself on every version: unixTimestampOf is gone in 5.0)."""
        rows = self.run("SELECT now() FROM system.local", (), consistency=self.one)
        return _uuid_ms(rows[0]["now()"])

    # -- errors -----------------------------------------------------------------------------------

    def fail(self, exc: BaseException) -> NoReturn:
        raise self.error(exc) from None

    def error(self, exc: BaseException) -> StoreUnavailable:
        """The StoreUnavailable (or _Unsure, for a write the coordinator reported as timed out)
        a driver error means."""
        name = type(exc).__name__
        text = " ".join(str(exc).split())[:400]
        unsure = contended = False
        if isinstance(exc, self._driver.read_timeout):
            contended = getattr(exc, "consistency", None) == self.serial
            if contended:
                text = f"a Paxos read lost every round to other writers ({text})"
        elif isinstance(exc, self._driver.write_timeout):
            unsure = True
            if getattr(exc, "write_type", None) == self._driver.cas_write_type:
                text = f"a compare-and-set timed out in its Paxos round, outcome unknown ({text})"
            else:
                text = f"a write timed out; it may have been applied ({text})"
        elif isinstance(exc, self._driver.timed_out):
            # A write may have been applied too, but a node that did not answer would not
            # answer the read that tells: the caller reads again later (within one timeout).
            text = f"no answer within {self.timeout:g} s"
        kind = _Unsure if unsure else _Contended if contended else StoreUnavailable
        return kind(f"store {self.display_url} unavailable: {name}: {scrub(text, self._url)}")


def _uuid_ms(value: uuid.UUID) -> int:
    return (value.time - _UUID_EPOCH) // 10_000


# -- compare-and-set cells -----------------------------------------------------------------------


def _token() -> int:
    """A cell's new version: random, so that a write that timed out can be told apart from
    every other writer's by reading it back, and a version never comes back (no ABA)."""
    return _random.getrandbits(62) + 1


class _Capability:
    """What both capabilities share: the engine's one connection, and a close that leaves it to
    the others (and is safe to repeat)."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.display_url = conn.display_url
        self._closed = False
        self._close_lock = threading.Lock()
        conn.join()

    def _open(self) -> _Connection:
        if self._closed:
            raise StoreUnavailable(f"store {self.display_url} is closed")
        return self._conn

    def init(self) -> None:
        self._open().init()
        self.identity()

    def identity(self) -> StoreIdentity | None:
        return _identity(self._open(), create=True)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._conn.leave()


def _identity(conn: _Connection, *, create: bool) -> StoreIdentity | None:
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
    except _Unsure:  # ours or another's: the read says which
        return _identity(conn, create=False) or _identity(conn, create=True)
    if applied:
        return StoreIdentity(made_id, made_ms)
    return StoreIdentity(str(row["id"]), int(row["created_ms"]))


class CassandraCasStore(_Capability):
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
        except _Unsure:
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
        except _Unsure:
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


# -- worker-id leases ----------------------------------------------------------------------------


def _kept_s(ttl: float) -> int:
    """The TTL, in whole seconds, that keeps a lease for at least `ttl` seconds: Cassandra
    expires a cell at a whole second of its clock, counted from the second it was written, so a
    TTL of n lives for more than n - 1 seconds only."""
    if not ttl > 0:
        raise InvalidArgument(f"ttl must be above 0 seconds, not {ttl!r}")
    return math.ceil(ttl) + 1


def _expires_in(row: dict[str, Any]) -> float | None:
    """Seconds the row's lease lives at least (None when there is none); see `_kept_s`."""
    left = row.get("lease_ttl")
    if row.get("lease") is None or left is None:
        return None
    return float(max(int(left) - 1, 0))


def _stored(rows: dict[int, dict[str, Any]], worker_id: int) -> int:
    """A worker id's stored horizon (0 for a row never written)."""
    return int((rows.get(worker_id) or {}).get("horizon") or 0)


def _is_free(row: dict[str, Any] | None) -> bool:
    return row is None or row.get("lease") is None


@dataclass
class _Attempt:
    """The worker id an acquire tries to take, the floor it read and the horizon it writes."""

    worker_id: int
    floor: int
    horizon: int


class CassandraLeaseStore(_Capability):
    """A LeaseStore on the `idmint_leases` table (see the module doc)."""

    def __init__(self, conn: _Connection) -> None:
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

    def _rows(self, namespace: str) -> tuple[set[int], dict[int, dict[str, Any]]]:
        """The worker ids the namespace has used, and their rows.

        Read at the URL's consistency, not by Paxos (whose reads of one partition contend with
        each other, and the rows are partitions of their own): a row just changed may show as it
        was, and an id just listed may be missing, which the conditional writes that take a
        row or list an id find out."""
        conn = self._open()
        used = {int(r["worker_id"]) for r in conn.run(self._used, (namespace,))}
        rows: dict[int, dict[str, Any]] = {}
        ordered = sorted(used)
        for start in range(0, len(ordered), SCAN_CHUNK):
            for row in conn.run(self._scan, (namespace, ordered[start : start + SCAN_CHUNK])):
                rows[int(row["worker_id"])] = row
        return used, rows

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
        claim = None if worker_id is None else check_claim(worker_id, workers)
        kept = _kept_s(ttl)
        conn = self._open()
        owner, host = uuid.uuid4().hex, holder_name()
        identity = _identity(conn, create=True)
        unsure: _Attempt | None = None
        for attempt in range(ATTEMPTS):
            if unsure is not None:
                held = conn.serial_read(self._holder, (namespace, unsure.worker_id))
                if held and held[0]["lease"] == owner:  # it was applied after all
                    return self._lease(namespace, unsure, owner, ttl, identity, claim)
                unsure = None
            used, rows = self._rows(namespace)
            if claim is None:
                candidates = (
                    w
                    for w in range(workers)
                    if _is_free(rows.get(w)) and not (rows.get(w) or {}).get("reserved")
                )
                chosen = choose_worker(
                    namespace, workers, candidates, functools.partial(_stored, rows), now_ms
                )
            else:
                chosen = claim
                row = rows.get(chosen)
                if not _is_free(row):
                    assert row is not None
                    raise WorkerInUse(namespace, chosen, str(row["host"]), _expires_in(row))
            row = rows.get(chosen)
            floor = 0 if row is None else int(row["horizon"])
            taking = _Attempt(chosen, floor, max(floor, horizon_ms))
            reserve = claim is not None
            key = (namespace, chosen)
            if row is None:
                if chosen not in used:
                    # Listed first, so that a row never exists unlisted (`holders` and this
                    # read find worker ids by the list); a listed id without a row is new.
                    try:
                        conn.lwt([(self._use, key)])
                    except _Unsure:  # the next round's read of the list tells
                        _back_off(attempt)
                        continue
                statements = [
                    (self._new, (*key, owner, host, taking.horizon, reserve)),
                    (self._new_lease, (kept, owner, *key)),
                ]
            else:
                take = self._take_checked if reserve else self._take_leased
                statements = [
                    (take, (kept, owner, *key, floor)),
                    (self._take_rest, (owner, host, taking.horizon, reserve, *key)),
                ]
            try:
                applied, _ = conn.lwt(statements)
            except _Unsure:
                unsure, applied = taking, False
            if applied:
                return self._lease(namespace, taking, owner, ttl, identity, claim)
            _back_off(attempt)
        raise StoreUnavailable(
            f"store {self.display_url}: {ATTEMPTS} concurrent writers in a row took worker ids "
            f"of namespace {namespace!r} first"
        )

    def _lease(
        self,
        namespace: str,
        taken: _Attempt,
        owner: str,
        ttl: float,
        identity: StoreIdentity | None,
        claim: int | None,
    ) -> Lease:
        return Lease(
            namespace,
            taken.worker_id,
            owner,
            taken.floor,
            taken.horizon,
            ttl,
            store_ms=self._open().clock_ms(),
            store_id=identity.id if identity else None,
            store_created_ms=identity.created_ms if identity else None,
            static=claim is not None,
        )

    def renew(self, lease: Lease, horizon_ms: int) -> Lease:
        conn = self._open()
        key = (lease.namespace, lease.worker_id)
        kept = _kept_s(lease.ttl)
        expected = lease.horizon_ms
        for _ in range(ATTEMPTS):
            horizon = max(expected, horizon_ms)
            applied, row = conn.lwt(
                [
                    (self._renew, (kept, lease.owner, *key, lease.owner, expected)),
                    (self._renew_horizon, (horizon, *key)),
                ]
            )
            if applied:
                break
            if row.get("owner") != lease.owner:
                raise LeaseLost(
                    f"worker {lease.worker_id} of namespace {lease.namespace!r} has another "
                    "owner, or none"
                )
            stored = int(row.get("horizon") or 0)
            if stored < lease.horizon_ms:
                raise forgotten(lease, stored)
            # Above what we knew: an earlier renewal of ours whose answer we never got. Ours
            # alone move a held id's horizon, so this is still ours to raise.
            expected = stored
        else:
            raise StoreUnavailable(
                f"store {self.display_url}: {ATTEMPTS} renewals in a row found the horizon moved"
            )
        rows = conn.run(self._meta_now, ("store",))
        store_id = str(rows[0]["id"]) if rows else None
        store_ms = _uuid_ms(rows[0]["now()"]) if rows else conn.clock_ms()
        return replace(lease, horizon_ms=horizon, store_ms=store_ms, store_id=store_id)

    def release(self, lease: Lease, issued_ms: int | None = None) -> None:
        conn = self._open()
        key = (lease.namespace, lease.worker_id)
        if issued_ms is None:
            conn.lwt([(self._release, (*key, lease.owner))])
        else:
            down = max(lease.floor_ms, issued_ms)
            conn.lwt([(self._release_down, (down, *key, lease.owner))])

    def holders(self, namespace: str) -> list[WorkerInfo]:
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
            for worker_id, row in sorted(self._rows(namespace)[1].items())
        ]

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        return self._open().lwt([(self._unreserve, (namespace, worker_id))])[0]


def _back_off(attempt: int) -> None:
    """A random wait after a lost round, longer with each: writers that collided spread out
    rather than collide again (every round on a namespace is one Paxos instance)."""
    time.sleep(_random.uniform(0, 0.002 * min(attempt + 1, 25)))


# -- the engine ----------------------------------------------------------------------------------


def open_cassandra_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The cassandra engine of a URL: cas, ranges (over cas) and leases, on one driver Session
    (the URL is checked here, no I/O)."""
    settings = parse_url(url, display)
    driver = _import_driver()
    conn = _Connection(settings, url, display, timeout, driver)

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
        return CassandraCasStore(_Connection(local, url, shown, timeout, driver))

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


__all__ = [
    "CassandraCasStore",
    "CassandraLeaseStore",
    "Settings",
    "open_cassandra_engine",
    "parse_url",
]
