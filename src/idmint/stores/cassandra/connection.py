"""The DataStax driver's Cluster and Session for one cassandra:// URL (`Connection`), shared by
its engine's capabilities: connecting, the schema, prepared statements, lightweight transactions,
Paxos reads, and driver errors mapped to StoreUnavailable (`Unsure`: a write whose outcome is
unknown; `Contended`: a Paxos read that lost its rounds); what both capabilities share of it
(`Capability`), and the store's identity."""

from __future__ import annotations

import contextlib
import random
import re
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from ..._errors import DriverMissing, InvalidArgument, StoreUnavailable
from ..._fork import ForkAware, orphan
from .._urls import scrub
from ..base import StoreIdentity
from ..tls import handshake_failure
from .settings import Settings

T = TypeVar("T")

SCHEMA_TIMEOUT = 10.0  # seconds for DDL and schema agreement: done once per keyspace
_UUID_EPOCH = 0x01B21DD213814000  # 1582-10-15 in the 100 ns units of a version-1 UUID
_MISSING_SCHEMA = re.compile(r"unconfigured (columnfamily|table)|keyspace .*does not exist", re.I)
# From the OS, not a seeded generator: a forked child would repeat its parent's sequence, and two
# processes writing the same "new" version of a cell would each take the other's for its own.
system_random = random.SystemRandom()


@dataclass(frozen=True)
class Driver:
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
    auth_failed: type[Exception]  # AuthenticationFailed: the user or password refused
    unauthorized: type[Exception]  # Unauthorized: the user lacks a permission
    cas_write_type: int
    errors: tuple[type[BaseException], ...]  # every failure of the store, not of the caller


def import_driver() -> Driver:
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
    return Driver(
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
        auth_failed=cassandra.AuthenticationFailed,
        unauthorized=cassandra.Unauthorized,
        cas_write_type=cassandra.WriteType.CAS,
        errors=(
            cassandra.DriverException,  # timeouts, Unavailable, refused requests
            cassandra.cluster.NoHostAvailable,
            cassandra.connection.ConnectionException,
            cassandra.protocol.ErrorMessage,  # what the server answered with an error
            OSError,
        ),
    )


class Unsure(StoreUnavailable):
    """A write the coordinator reported as timed out (WriteTimeout): it may have been applied,
    or may be yet. The node answered, so a Paxos read can tell."""


class Contended(StoreUnavailable):
    """A Paxos read the coordinator reported as timed out (ReadTimeout): it lost its rounds to
    other writers of the partition for cas_contention_timeout. Nothing was written, and the node
    answered: asking again is safe, and is what contention calls for."""


class Connection(ForkAware):
    """The driver's Cluster and Session for one URL, shared by the engine's capabilities.

    Connected on first use (the schema is made then if it is missing), made again after a fork
    or after every capability closed it; thread-safe (the driver's Session is)."""

    def __init__(
        self,
        settings: Settings,
        url: str,
        display: str,
        timeout: float,
        driver: Driver,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.settings = settings
        self._ssl_context = ssl_context  # made from settings.tls when the URL was opened
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
        # The store's identity is one for the whole cluster, whatever this URL's serial: made
        # by a Paxos round across every datacenter (see store_identity).
        self.global_serial, self.global_consistency = levels.SERIAL, levels.QUORUM
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

    def _shut_down(self, cluster: Any, *, wait: bool = True) -> None:
        """Cluster.shutdown joins the driver's threads, which may wait on a hung node (connecting,
        say): waited for at most the timeout if `wait`, the rest goes on in the background."""
        closer = threading.Thread(target=cluster.shutdown, name="idmint-cassandra-close")
        closer.daemon = True
        closer.start()
        closer.join(self.timeout if wait else 0)

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
            # Verifies each node's certificate and its name: the driver gives the address it
            # connects to as the name (check_hostname is on), so certificates name the nodes'
            # addresses (or the rpc_address names they are known by).
            ssl_context=self._ssl_context,
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
        if force:  # a table or the keyspace was dropped: what is there now, not what was
            cluster.refresh_schema_metadata()
        keyspace = cluster.metadata.keyspaces.get(s.keyspace)
        tables = ("idmint_cells", "idmint_leases", "idmint_worker_ids", "idmint_meta")
        if not force and keyspace is not None and all(t in keyspace.tables for t in tables):
            return
        statements = [
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
        if keyspace is None:
            # Only when the driver does not know the keyspace: a user that may not create
            # keyspaces (docs/stores.md, Locked down: an administrator made it) is refused even
            # an IF NOT EXISTS of one that exists.
            make = f"CREATE KEYSPACE IF NOT EXISTS {s.keyspace} WITH replication = "
            statements.insert(0, make + s.replication_cql())
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
        self._shut_down(cluster, wait=False)

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
            except Contended:
                attempt += 1
                if deadline - time.monotonic() < 0.1:
                    raise
                back_off(attempt)

    def lwt(
        self, statements: list[tuple[str, tuple[Any, ...]]], *, everywhere: bool = False
    ) -> tuple[bool, dict[str, Any]]:
        """A conditional statement (or batch of them, one partition): whether it was applied,
        and the current values of the columns its conditions name when it was not. With
        `everywhere`, decided at SERIAL (and QUORUM) whatever the URL's serial."""
        consistency, serial = (
            (self.global_consistency, self.global_serial)
            if everywhere
            else (self.consistency, self.serial)
        )

        def body(session: Any) -> tuple[bool, dict[str, Any]]:
            if len(statements) == 1:
                cql, params = statements[0]
                prepared = self._prepare(session, cql, consistency, serial)
                answer = session.execute(prepared, params, timeout=self.timeout)
            else:
                batch = self._driver.query.BatchStatement(
                    consistency_level=consistency, serial_consistency_level=serial
                )
                for cql, params in statements:
                    batch.add(self._prepare(session, cql, consistency, serial), params)
                answer = session.execute(batch, timeout=self.timeout)
            row: dict[str, Any] = answer.one() or {}
            return bool(row.get("[applied]")), row

        return self.call(body)

    def clock_ms(self) -> int:
        """The coordinator's clock (Unix ms), from `now()`: a version-1 UUID of its time (there
        is no function for the time itself on every version: unixTimestampOf is gone in 5.0)."""
        rows = self.run("SELECT now() FROM system.local", (), consistency=self.one)
        return uuid_ms(rows[0]["now()"])

    # -- errors -----------------------------------------------------------------------------------

    def fail(self, exc: BaseException) -> NoReturn:
        raise self.error(exc) from None

    def error(self, exc: BaseException) -> StoreUnavailable:
        """The StoreUnavailable (or Unsure, for a write the coordinator reported as timed out)
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
        elif (refused := self._refusal(exc)) is not None:
            return StoreUnavailable(f"store {self.display_url} unavailable: {refused}")
        elif isinstance(exc, self._driver.timed_out):
            # A write may have been applied too, but a node that did not answer would not
            # answer the read that tells: the caller reads again later (within one timeout).
            text = f"no answer within {self.timeout:g} s"
        kind = Unsure if unsure else Contended if contended else StoreUnavailable
        return kind(f"store {self.display_url} unavailable: {name}: {scrub(text, self._url)}")

    def _refusal(self, exc: BaseException) -> str | None:
        """What a TLS, authentication or permission failure means, in a line (None: `exc`
        is none of them). NoHostAvailable carries each node's error: the first one that is
        such a failure speaks for them."""
        found = [exc]
        errors = getattr(exc, "errors", None) if isinstance(exc, self._driver.no_host) else None
        # Each node's error by address, except when a session's first pools all failed: then
        # the driver gives the addresses alone (a list), which say nothing of why.
        if isinstance(errors, dict):
            found += list(errors.values())
        for each in found:
            tls = handshake_failure(each)
            if tls is not None:
                return tls
            message = _server_message(each)
            ssl_error = re.search(r"\[SSL: ([A-Z_]+)\]", message)
            if ssl_error:  # the driver keeps only the text of a handshake the node cut short
                why = ssl_error.group(1).replace("_", " ").lower()
                return (
                    f"TLS: the handshake failed ({why}: a node that requires a client "
                    "certificate closes it on a client without one, ?cert=&key=)"
                )
            if isinstance(each, self._driver.auth_failed):
                if "requires authentication" in message:
                    return (
                        "the cluster requires a user and password (PasswordAuthenticator): "
                        "give them in the URL (cassandra://user:password@host/keyspace)"
                    )
                return f"the cluster refused the URL's user and password ({message})"
            if isinstance(each, self._driver.unauthorized):
                return (
                    f"the URL's user lacks a permission ({message}); grant it what "
                    "docs/stores.md gives (Cassandra: locked down)"
                )
        return None


def _server_message(exc: BaseException) -> str:
    """The server's own words in a driver error (its `message="..."`), else the error's."""
    text = " ".join(str(exc).split())
    found = re.search(r'message="([^"]*)"', text)
    return (found.group(1) if found else text)[:300]


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
    committed; one still in progress is completed by the `IF NOT EXISTS` that finds it.

    It is made at SERIAL even through a LOCAL_SERIAL URL: two datacenters' LOCAL_SERIAL rounds
    are apart, so processes of dc1 and dc2 starting on a fresh keyspace each made an identity
    of their own, and the later write won; a process that had kept the other one refused its
    datacenter's cell for good, "last written through store ..." (CI, twice, in
    tests/test_datacenter_faults.py's first Cassandra test)."""
    read = f"SELECT id, created_ms FROM {conn.meta} WHERE name = ?"
    rows = conn.run(read, ("store",))
    if rows:
        return StoreIdentity(str(rows[0]["id"]), int(rows[0]["created_ms"]))
    if not create:
        return None
    made_id, made_ms = uuid.uuid4().hex, conn.clock_ms()
    make = f"INSERT INTO {conn.meta} (name, id, created_ms) VALUES (?, ?, ?) IF NOT EXISTS"
    try:
        applied, row = conn.lwt([(make, ("store", made_id, made_ms))], everywhere=True)
    except Unsure:  # ours or another's: the read says which; none yet: a later call makes it
        found = store_identity(conn, create=False)
        if found is None:
            raise  # once: trying again here looped for as long as the round timed out
        return found
    if applied:
        return StoreIdentity(made_id, made_ms)
    return StoreIdentity(str(row["id"]), int(row["created_ms"]))


def uuid_ms(value: uuid.UUID) -> int:
    return (value.time - _UUID_EPOCH) // 10_000


def back_off(attempt: int) -> None:
    """A random wait after a lost round, longer with each: writers that collided spread out
    rather than collide again (every round on a namespace is one Paxos instance)."""
    time.sleep(system_random.uniform(0, 0.002 * min(attempt + 1, 25)))
