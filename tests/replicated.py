"""Replicated stores on loopback, with the engines' own replication: a PostgreSQL primary and a
streaming standby (pg_basebackup -R), a Redis primary and a replica.

The standby and the replica are servers of their own (own data directory, port and process),
so a test can cut the replication link (iptables on the port), kill -9 the primary and promote
the standby, as an operator or Patroni/Sentinel would.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections.abc import Iterator

import psycopg
import pymysql
import redis

from idmint.stores.replication import redis_state

from certs import Certs
from server_redis import RedisServer
from servers import LOOPBACK, MariaDBServer, PostgresServer, wait_until


class PostgresStandby(PostgresServer):
    """A streaming standby of `primary`, made by pg_basebackup -R (so it starts in recovery,
    following the primary). `promote()` makes it a primary on a new timeline."""

    kind = "PostgreSQL standby"

    def __init__(self, primary: PostgresServer, host: str = LOOPBACK, **kwargs: object) -> None:
        self.primary = primary
        self.primary_host = host  # the address it follows the primary through
        super().__init__(**kwargs)  # type: ignore[arg-type]

    def _initialize(self) -> None:
        self._run_logged(
            [
                str(self.bindir / "pg_basebackup"),
                "-D",
                str(self.data_dir),
                "-d",
                # application_name lands in primary_conninfo: the name the primary's
                # synchronous_standby_names and pg_stat_replication know it by
                f"host={self.primary_host} port={self.primary.port} user=postgres "
                "application_name=standby",
                "-R",  # standby.signal and primary_conninfo: it follows the primary
                "-X",
                "stream",
                "--no-sync",
            ],
            "pg_basebackup",
        )

    def promote(self) -> None:
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=5) as conn:
            conn.execute("SELECT pg_promote(true, 30)")

    def detach(self) -> None:
        """Cut the replication link the engine's own way: the standby forgets its primary
        (primary_conninfo, reloaded), so nothing the primary writes from now on reaches it.
        Unlike SIGSTOP, which leaves what was sent in its socket to replay on resume."""
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=5) as conn:
            conn.execute("ALTER SYSTEM SET primary_conninfo = ''")
            conn.execute("SELECT pg_reload_conf()")
        wait_until(lambda: not _streaming(self.primary), 30, "the standby to let go")

    def in_recovery(self) -> bool:
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])


@contextlib.contextmanager
def postgres_pair(
    *, synchronous: bool, link: str | None = None
) -> Iterator[tuple[PostgresServer, PostgresStandby]]:
    """A primary and its streaming standby, running; with `synchronous`, every commit waits
    for the standby (synchronous_standby_names names it). `link`: a loopback address the
    primary also listens on, which the standby follows it through (see redis_pair)."""
    settings = {"wal_level": "replica", "max_wal_senders": "5"}
    if link:
        settings["listen_addresses"] = f"{LOOPBACK},{link}"
    if synchronous:
        settings["synchronous_standby_names"] = "standby"
    primary = PostgresServer(extra_settings=settings)
    standby: PostgresStandby | None = None
    try:
        primary.start()
        standby = PostgresStandby(
            primary, host=link or LOOPBACK, extra_settings={"hot_standby": "on"}
        )
        standby.start()
        wait_until(lambda: _streaming(primary), 30, "the standby to stream")
        yield primary, standby
    finally:
        if standby is not None:
            standby.close()
        primary.close()


def _streaming(primary: PostgresServer) -> bool:
    """Whether a standby streams and has reported its replay: only then does idmint count it
    (stores/replication.py), and a test that reads the state at once saw 0 standbys."""
    with psycopg.connect(primary.url(), autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_replication "
            "WHERE state = 'streaming' AND replay_lsn IS NOT NULL"
        ).fetchone()
    return bool(row and row[0])


def _online_replicas(client: redis.Redis) -> int:
    return redis_state(client.info("replication"), waits=True).replicas


@contextlib.contextmanager
def redis_pair(
    *, link: str | None = None, certs: Certs | None = None
) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A Redis primary (appendfsync always) and a replica of it, the link up. `link`: a
    loopback address the primary also listens on, which the replica follows it through (so
    that harness.Partition.cut_address cuts the replication and nothing else). `certs`: both
    take TLS clients on their TLS ports too, and the replica follows the primary over TLS
    (the primary would too, once a failover made it a replica)."""
    tls = certs is not None
    primary = RedisServer(also=(link,) if link else (), certs=certs, tls_replication=tls)
    replica: RedisServer | None = None
    try:
        primary.start()
        port = primary.tls_port if primary.tls_port is not None else primary.port
        replica = RedisServer(
            replica_of=(link or primary.host, port), certs=certs, tls_replication=tls
        )
        replica.start()
        client, source = replica.client(), primary.client()
        # Both ends: the replica's link is up a moment before the primary lists it online,
        # and the replication guard counts only replicas the primary lists online.
        wait_until(
            lambda: (
                client.info("replication").get("master_link_status") == "up"
                and _online_replicas(source) == 1
            ),
            30,
            "the replica to sync",
        )
        client.close()
        source.close()
        yield primary, replica
    finally:
        if replica is not None:
            replica.close()
        primary.close()


@contextlib.contextmanager
def mariadb_pair(
    *, semi_sync: bool, link: str | None = None, symmetric: bool = False
) -> Iterator[tuple[MariaDBServer, MariaDBServer]]:
    """A MariaDB primary and a replica of it (server ids 1 and 2), the link up; with
    `semi_sync`, semi-synchronous replication on both (a commit waits up to 1 s for the
    replica's acknowledgement, then falls back to asynchronous). The replica is fit to be
    promoted, as failover managers (MaxScale, Orchestrator, replication-manager) require: it
    follows by GTID and writes a binary log of its own, with what it applies.

    `link`: a loopback address both servers also listen on, which a replica follows its
    primary through (see redis_pair). `symmetric`: both servers set up alike, so that either
    can be the primary and the other its replica, over and over (failover and failback): each
    logs what it applies (log_slave_updates is not dynamic), has semi-sync's primary and
    replica sides on, and a replica reconnects within a second (MASTER_CONNECT_RETRY) and
    notices a dead link within 5 s (slave_net_timeout) instead of a minute."""
    waits = ["--rpl-semi-sync-master-enabled=ON", "--rpl-semi-sync-master-timeout=1000"]
    acks = ["--rpl-semi-sync-slave-enabled=ON"]
    binlog = ["--log-bin=binlog", "--binlog-format=ROW"]
    applied = ["--log-slave-updates", "--relay-log=relay"]
    either = [*binlog, *applied, "--slave-net-timeout=5"]
    if semi_sync:
        either += [*waits, *acks]
    # After the default bind address: it wins.
    listen = [f"--bind-address={LOOPBACK},{link}"] if link else []
    primary = MariaDBServer(
        extra_options=["--server-id=1", *listen, *either]
        if symmetric
        else ["--server-id=1", *listen, *binlog, *(waits if semi_sync else [])]
    )
    replica = MariaDBServer(
        extra_options=["--server-id=2", *listen, *either]
        if symmetric
        else ["--server-id=2", *listen, *binlog, *applied, *(acks if semi_sync else [])]
    )
    try:
        # In parallel: each start is mostly mariadb-install-db, a second or two.
        starting = threading.Thread(target=replica.start, daemon=True)
        starting.start()
        primary.start()
        starting.join()
        replica.start()  # a no-op once it runs; a start that failed there is tried again
        retry = ", MASTER_CONNECT_RETRY=1" if symmetric else ""
        # Both fresh: the replica's empty gtid_slave_pos is the primary's first GTID.
        sql(
            replica,
            f"CHANGE MASTER TO MASTER_HOST='{link or LOOPBACK}', MASTER_PORT={primary.port}, "
            f"MASTER_USER='root', MASTER_PASSWORD='', MASTER_USE_GTID=slave_pos{retry}",
            "START SLAVE",
        )
        wait_until(lambda: binlog_dumps(primary) == 1, 30, "the replica to connect")
        yield primary, replica
    finally:
        replica.close()
        primary.close()


def _connect(server: MariaDBServer) -> pymysql.Connection[pymysql.cursors.Cursor]:
    return pymysql.connect(
        host=LOOPBACK, port=server.port, user="root", password="", autocommit=True
    )


def sql(server: MariaDBServer, *statements: str) -> list[tuple[object, ...]]:
    """Run statements on a MariaDB server as root; the last one's rows."""
    conn = _connect(server)
    try:
        rows: list[tuple[object, ...]] = []
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
                rows = list(cur.fetchall())
        return rows
    finally:
        conn.close()


def replica_status(server: MariaDBServer) -> dict[str, object]:
    """SHOW SLAVE STATUS as {column: value}; {} for a server that replicates from nobody."""
    conn = _connect(server)
    try:
        with conn.cursor(pymysql.cursors.DictCursor) as cur:
            cur.execute("SHOW SLAVE STATUS")
            return dict(cur.fetchone() or {})
    finally:
        conn.close()


def promote(replica: MariaDBServer, *, apply_relay_log: bool = True, timeout: float = 30) -> None:
    """Make a MariaDB replica the primary (its primary is dead) as failover managers do
    (MaxScale, Orchestrator, replication-manager): stop receiving, wait until the SQL thread
    has applied everything the IO thread received (its relay log), then forget the primary and
    take writes. Semi-synchronous replication acknowledges a commit once the replica has
    received it, not applied it: the relay log holds acknowledged commits.

    apply_relay_log=False is the old way, the negative control: STOP SLAVE; RESET SLAVE ALL at
    once throws away the relay log, and with it the acknowledged commits the SQL thread had
    not applied yet."""
    if apply_relay_log:
        sql(replica, "STOP SLAVE IO_THREAD")
        wait_applied(replica, str(replica_status(replica).get("Gtid_IO_Pos", "")), timeout)
    sql(replica, "STOP SLAVE", "RESET SLAVE ALL", "SET GLOBAL read_only = OFF")


def wait_applied(replica: MariaDBServer, position: str, timeout: float = 30) -> None:
    """Wait until `replica` has applied every transaction up to GTID `position` (a primary's
    @@gtid_binlog_pos, or what the replica received: Gtid_IO_Pos); TimeoutError after
    `timeout` s (MASTER_GTID_WAIT's own bound: it answers 0 when applied, -1 when it ran out)."""
    if sql(replica, f"SELECT MASTER_GTID_WAIT('{position}', {timeout})") != [(0,)]:
        raise TimeoutError(f"the replica did not apply up to {position} in {timeout:g}s")


def binlog_dumps(primary: MariaDBServer) -> int:
    """The replicas connected to `primary` (the threads sending them its binary log)."""
    rows = sql(
        primary,
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%'",
    )
    return int(str(rows[0][0]))


class Forwarder:
    """A TCP forwarder on loopback standing in for a virtual IP: clients connect to `port`,
    each connection goes to `target` (a port on loopback) as it is when the connection is
    made. Setting `target` moves the address, as a failover manager would: every open
    connection is cut (clients see a broken connection and connect again).

    While `drop_replies` is set, what the server answers is thrown away and the connection
    cut: the request reached the server (a write was applied), its client never learns it
    (an ambiguous outcome)."""

    def __init__(self, target: int, host: str = LOOPBACK) -> None:
        self._target = target
        self.host = host  # where `target` listens (a cluster member on an address of its own)
        self.drop_replies = False
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = int(self._listener.getsockname()[1])
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="forwarder", daemon=True).start()

    @property
    def target(self) -> int:
        return self._target

    @target.setter
    def target(self, port: int) -> None:
        self._target = port
        self._cut()

    def __enter__(self) -> Forwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        # close() alone does not wake a thread blocked in accept() (Linux): shutdown does.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._cut()

    def _cut(self) -> None:
        with self._lock:
            sockets, self._open = self._open, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection((self.host, self._target), timeout=5)
            except OSError:
                client.close()  # nothing listens there (the primary is down): refused
                continue
            with self._lock:
                self._open += [client, server]
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        """Copy bytes both ways until either side closes (or the forwarder cuts them); a
        reply that comes while `drop_replies` is set ends the connection unseen."""
        other = {a: b, b: a}
        with selectors.DefaultSelector() as selector:
            for sock in (a, b):
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ)
            try:
                while True:
                    for key, _ in selector.select(timeout=1):
                        source = key.fileobj
                        assert isinstance(source, socket.socket)
                        data = source.recv(65536)
                        if not data or (source is b and self.drop_replies):
                            return
                        other[source].setblocking(True)
                        other[source].sendall(data)
                        other[source].setblocking(False)
            except OSError:
                return
            finally:
                for sock in (a, b):
                    with contextlib.suppress(OSError):
                        sock.close()
