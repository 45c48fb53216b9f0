"""PostgreSQL failover and failback the way HA managers do them, on loopback (issue 30).

By hand, as Patroni does it in synchronous mode (not strict): the new primary is promoted
with no synchronous standby named (`promote`), so its commits do not wait; the old one is
rewound onto the new primary's timeline with pg_rewind and started as its standby (`rewind`),
and once it streams it is named in synchronous_standby_names (`synchronous`). While the new
primary is alone, idmint's replica requirement (the store has waited for one) refuses its
writes: the outage of a switch ends when the old primary is back as its standby.

pg_rewind needs hint bits WAL-logged on the server it rewinds (or data checksums, which
initdb leaves off before PostgreSQL 18): `ha_pair` sets wal_log_hints in each data directory
(postgresql.auto.conf), not on the command line, because pg_rewind first runs the crash
recovery of a server killed -9 in single-user mode, which reads only the data directory's
settings, and the control file it checks then records what that run had.

And Patroni itself (`patroni_cluster`): two members, each a Patroni process running its own
PostgreSQL, on one etcd.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import psycopg

from replicated import PostgresStandby, postgres_pair
from server_etcd import EtcdServer
from servers import (
    LOOPBACK,
    PostgresServer,
    ServerStartError,
    free_port,
    install_dirs,
    running,
    wait_until,
)

#: The application_name every standby connects with, whichever server it is: the name the
#: primary's synchronous_standby_names gives (postgres_pair's standby has it too).
STANDBY = "standby"


def execute(server: PostgresServer, *statements: str) -> list[tuple[Any, ...]]:
    """Run statements on `server` (autocommit, as the superuser); the last one's rows."""
    rows: list[tuple[Any, ...]] = []
    with psycopg.connect(server.url(), autocommit=True, connect_timeout=5) as conn:
        for statement in statements:
            cur = conn.execute(statement)
            rows = cur.fetchall() if cur.description else []
    return rows


def wait_for_replay(primary: PostgresServer, standby: PostgresServer, timeout: float = 20) -> None:
    """Until `standby` has replayed everything `primary` had written when this was called (an
    asynchronous standby may trail by seconds on a loaded machine: a test that cuts it off
    must know what it has)."""
    [(written,)] = execute(primary, "SELECT pg_current_wal_lsn()::text")

    def replayed() -> bool:
        [(done,)] = execute(standby, f"SELECT pg_last_wal_replay_lsn() >= '{written}'::pg_lsn")
        return bool(done)

    wait_until(replayed, timeout, "the standby to replay what the primary had written")


def configure(server: PostgresServer, **settings: str) -> None:
    """ALTER SYSTEM SET each setting, then reload: what an HA manager does to a running
    server (settings that need a restart wait for the next one)."""
    execute(
        server,
        *(f"ALTER SYSTEM SET {name} = '{value}'" for name, value in settings.items()),
        "SELECT pg_reload_conf()",
    )


@contextlib.contextmanager
def ha_pair(
    *, synchronous: bool = True, link: str | None = None
) -> Iterator[tuple[PostgresServer, PostgresStandby]]:
    """postgres_pair (`link` as there), fit for pg_rewind (wal_log_hints on, restarted once),
    with the primary's synchronous_standby_names in its data directory, where `configure`
    can change it (a setting given on the command line would override it). Either server
    becomes the other's standby: the settings a standby must have at least the primary's
    value of (max_wal_senders) are left at PostgreSQL's defaults on both."""
    with postgres_pair(synchronous=False, link=link) as (primary, standby):
        primary.extra_settings.pop("max_wal_senders")
        configure(
            primary, wal_log_hints="on", synchronous_standby_names=STANDBY if synchronous else ""
        )
        configure(standby, wal_log_hints="on")
        primary.restart()
        standby.restart()  # at once, not after wal_retrieve_retry_interval (5 s)
        wait_until(lambda: streams(primary), 30, "the standby to stream")
        yield primary, standby


def streams(primary: PostgresServer, sync_state: str | None = None) -> bool:
    """Whether the standby streams from `primary` (and is in `sync_state`, if given)."""
    rows = execute(
        primary,
        "SELECT sync_state FROM pg_stat_replication "
        f"WHERE application_name = '{STANDBY}' AND state = 'streaming'",
    )
    return any(sync_state in (None, row[0]) for row in rows)


def promote(server: PostgresServer) -> None:
    """Make a standby the primary (a new timeline), with no synchronous standby: with one
    named and none connected, commits would wait until one attached (Patroni's strict mode);
    here they do not wait, and idmint's replica requirement refuses its writes instead."""
    execute(server, "SELECT pg_promote(true, 30)")
    configure(server, synchronous_standby_names="")


def rewind(server: PostgresServer, primary: PostgresServer) -> None:
    """Make a former primary (killed -9, or stopped) a standby of `primary`, to be started:
    pg_rewind undoes what it wrote past the point where `primary`'s timeline branched off (it
    says "no rewind required" when nothing was) and, with -R, points it at `primary`."""
    server.kill()  # a no-op when it is down: pg_rewind needs it down
    # pg_rewind reads the source's timeline from its control file, which a promotion updates
    # only at its checkpoint (seconds later): before that it would see the old timeline and
    # answer "no rewind required". Patroni checkpoints after a promotion too.
    execute(primary, "CHECKPOINT")
    source = f"host={LOOPBACK} port={primary.port} user=postgres application_name={STANDBY}"
    # A private method of the test servers: it runs the command as the data directory's
    # owner and appends its output to the server's log.
    server._run_logged(
        [
            *(str(server.bindir / "pg_rewind"), "-D", str(server.data_dir)),
            *("--source-server", source, "--write-recovery-conf", "--no-sync"),
        ],
        "pg_rewind",
    )
    # A setting on the command line would override the one `configure` keeps.
    server.extra_settings.pop("synchronous_standby_names", None)


def synchronous(primary: PostgresServer) -> None:
    """Make `primary`'s commits wait for its standby, once it streams (Patroni names a
    standby in synchronous_standby_names only then, too)."""
    configure(primary, synchronous_standby_names=STANDBY)
    wait_until(lambda: streams(primary, "sync"), 10, "the standby to be synchronous")


@dataclass(frozen=True)
class Switch:
    """When (monotonic s) a switch's steps were done."""

    began: float  # the primary killed -9, or told to stop
    promoted: float  # the new primary takes writes (alone)
    rewound: float  # the old primary rewound: it starts as the new one's standby
    attached: float  # ... it streams, and is the new primary's synchronous standby


def switch(
    old: PostgresServer,
    new: PostgresServer,
    *,
    crash: bool,
    before_promote: Callable[[], None] | None = None,
) -> Switch:
    """A failover (`crash`: the primary killed -9) or a switchover (stopped cleanly) from
    `old` to its standby `new`, and `old` back as `new`'s synchronous standby (if `new` has
    one named: `synchronous`). `before_promote` runs once `old` is down."""
    began = time.monotonic()
    if crash:
        old.kill()
    else:
        old.stop()
    if before_promote is not None:
        before_promote()
    promote(new)
    promoted = time.monotonic()
    rewind(old, new)
    rewound = time.monotonic()
    old.start()
    wait_until(lambda: streams(new), 30, "the rewound server to stream")
    synchronous(new)
    return Switch(began, promoted, rewound, time.monotonic())


# -- Patroni -----------------------------------------------------------------------------------

#: Patroni's shortest timings (its minimums: loop_wait + 2 retry_timeout <= ttl): a leader
#: that dies keeps its key in etcd for up to `ttl` s, and the replica takes over after that.
PATRONI_TIMINGS = {"ttl": 20, "loop_wait": 1, "retry_timeout": 3}


def _patroni_command() -> list[str]:
    """Patroni from its own virtualenv (.ci/install-patroni), which the postgres OS user can
    run: the tests run PostgreSQL, and Patroni with it, as that user when run as root, and
    ./.venv may sit below a home only root can enter."""
    for home in install_dirs("patroni"):
        if (home / "bin" / "python").is_file():
            return [str(home / "bin" / "python"), "-m", "patroni"]
    raise ServerStartError(
        "no Patroni virtualenv in "
        + ", ".join(map(str, install_dirs("patroni")))
        + ": run .ci/install-patroni (or .ci/install)"
    )


class PatroniNode(PostgresServer):
    """One Patroni member on loopback, running its own PostgreSQL: `url()` is that server's,
    `rest` Patroni's REST API. A test server like the others: `kill()` is kill -9 of Patroni
    and of its PostgreSQL (every process working in the data directory), `start()` starts
    Patroni again and returns once its PostgreSQL takes connections (a primary or a standby,
    as Patroni decides), `close()` stops it and removes its directory.

    The cluster settings (`dcs`) are those of the first member to start: synchronous_mode
    (not strict, Patroni's default there: a leader left without a synchronous standby takes
    writes alone, which idmint's replica requirement refuses), pg_rewind for a former leader
    coming back. `link`: an address PostgreSQL also listens on and standbys follow it through
    (see postgres_pair)."""

    kind = "Patroni member"
    _stop_signal = signal.SIGTERM  # Patroni stops its PostgreSQL, then itself

    def __init__(
        self, name: str, etcd: EtcdServer, dcs: dict[str, object], link: str | None = None
    ) -> None:
        self.name, self.etcd, self.dcs, self.link = name, etcd, dcs, link
        self.rest_port = free_port()
        self.rest = f"http://{LOOPBACK}:{self.rest_port}"
        super().__init__(startup_timeout=60.0)

    def _initialize(self) -> None:
        """Nothing: Patroni runs initdb on the first member, pg_basebackup on the others."""

    def _server_command(self) -> list[str]:
        # Written at every start: a start that lost its port to another process retries on
        # another one (_Server.start).
        config = self.base_dir / "patroni.yml"
        config.write_text(json.dumps(self._config(), indent=1))  # JSON is YAML
        if self._os_user is not None:
            os.chown(config, self._os_user.pw_uid, self._os_user.pw_gid)
        return [*_patroni_command(), str(config)]

    def _config(self) -> dict[str, object]:
        address = self.link or LOOPBACK
        dcs: dict[str, object] = {"postgresql": {"use_pg_rewind": True}, **PATRONI_TIMINGS}
        dcs.update(self.dcs)
        return {
            "scope": "idmint",
            "name": self.name,
            "restapi": {
                "listen": f"{LOOPBACK}:{self.rest_port}",
                "connect_address": f"{LOOPBACK}:{self.rest_port}",
            },
            "etcd3": {"hosts": [f"{LOOPBACK}:{self.etcd.port}"], "protocol": "http"},
            "bootstrap": {
                "dcs": dcs,
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
            },
            "postgresql": {
                "listen": ",".join(dict.fromkeys([LOOPBACK, address])) + f":{self.port}",
                "connect_address": f"{address}:{self.port}",
                "data_dir": str(self.data_dir),
                "bin_dir": str(self.bindir),
                "pgpass": str(self.base_dir / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres"},
                    "replication": {"username": "postgres"},
                    "rewind": {"username": "postgres"},
                },
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.0/8 trust",
                    "host replication all 127.0.0.0/8 trust",
                ],
                "parameters": {
                    "unix_socket_directories": str(self.socket_dir),
                    "fsync": "off",
                },
            },
        }

    def expire_leader_key(self) -> None:
        """Delete the cluster's leader key in etcd, as its ttl running out would (20 s, Patroni's
        least) once the leader is dead: the standby takes over within a loop_wait. The tests
        kill the leader and do this, which takes 20 s less than waiting."""
        key = base64.b64encode(b"/service/idmint/leader").decode()
        url = f"http://{LOOPBACK}:{self.etcd.port}/v3/kv/deleterange"
        httpx.post(url, json={"key": key}, timeout=5).raise_for_status()

    def answers(self, path: str) -> bool:
        """Whether Patroni's REST API answers 200 to GET `path` (/primary: the leader, /sync:
        the synchronous standby, /replica: a standby)."""
        try:
            return httpx.get(self.rest + path, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False


@contextlib.contextmanager
def patroni_cluster(
    dcs: dict[str, object], *, link: str | None = None
) -> Iterator[tuple[PatroniNode, PatroniNode]]:
    """Two Patroni members on one etcd, the first the leader and the second its standby
    (its synchronous standby with synchronous_mode in `dcs`), running."""
    etcd = EtcdServer()
    try:
        etcd.start()
        nodes = (PatroniNode("node0", etcd, dcs, link), PatroniNode("node1", etcd, dcs, link))
        with running(nodes):
            try:
                wait_until(lambda: nodes[0].answers("/primary"), 30, "node0 to lead")
                role = "/sync" if dcs.get("synchronous_mode") else "/replica"
                wait_until(lambda: nodes[1].answers(role), 30, f"node1 to answer {role}")
                yield nodes
            finally:
                for node in nodes:  # faster than Patroni's clean shutdown (seconds each)
                    node.kill()
    finally:
        etcd.close()
