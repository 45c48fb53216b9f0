"""The torture set-up "mariadb-semisync" (issue 32): a MariaDB primary and replica with
semi-synchronous replication both ways, clients reaching the primary through a forwarder (a
load balancer, or a virtual IP that a failover manager moves), and a switch done as failover
managers (MaxScale, replication-manager) do it: the primary killed -9, the replica promoted
once it has applied its relay log, the forwarder moved, and the old primary rejoined as the
new one's semi-synchronous replica, so that the next switch goes back (a failback).

The rejoin: an old primary that holds nothing the new one lacks (its @@gtid_binlog_pos is
where the new one forked from it) follows it by GTID from there. One killed with transactions
in its binary log that never reached the replica (errant GTIDs: commits no replica
acknowledged, which idmint never served) has diverged: MariaDB refuses it as a replica from
that position (ER_GTID_POSITION_NOT_FOUND_IN_BINLOG2), and leaving the transactions in place
would keep rows the new primary never had. It is cloned again from the new primary (a
consistent mariadb-dump of the store's database, its binary log emptied and started at the
dump's GTID position), as replication-manager's full state transfer does.

setups.py imports this module to register the set-up: its helpers are imported from there at
run time.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from harness import Partition
from replicated import Forwarder, binlog_dumps, mariadb_pair, promote, replica_status, sql
from servers import LOOPBACK, MariaDBServer, wait_until

if TYPE_CHECKING:
    from .setups import Setup

#: The address each server also listens on, which its replica follows it through: a split
#: cuts it (and nothing else). 127.0.0.61 and .62 are the Redis and PostgreSQL set-ups'.
LINK = "127.0.0.63"
#: The store's database: what a re-clone copies.
DATABASE = "torture"
#: Seconds a switch waits for each step (a replica to catch up, a server to rejoin).
STEP_TIMEOUT = 30.0


def _gtid_binlog_pos(server: MariaDBServer) -> str:
    return str(sql(server, "SELECT @@gtid_binlog_pos")[0][0])


def _semi_sync_replicas(primary: MariaDBServer) -> int:
    rows = sql(primary, "SHOW GLOBAL STATUS LIKE 'Rpl_semi_sync_master_clients'")
    return int(str(rows[0][1])) if rows else 0


def _following(primary: MariaDBServer, semi_sync: bool) -> bool:
    """Whether the replica is connected to `primary` (and acknowledges with semi-sync)."""
    return binlog_dumps(primary) == 1 and (not semi_sync or _semi_sync_replicas(primary) == 1)


class _Pair:
    """The two servers, the current primary first, and the moves between them."""

    def __init__(
        self,
        a: MariaDBServer,
        b: MariaDBServer,
        forwarder: Forwarder,
        unsafe: bool,
    ) -> None:
        self.servers = [a, b]
        self.forwarder, self.unsafe = forwarder, unsafe

    def cut_link(self) -> Partition:
        """The replica cut from the primary's replication (both ways): semi-sync times out,
        falls back, and idmint refuses to write until the replica acknowledges again."""
        cut = Partition()
        cut.cut_address(LINK, self.servers[0].port)
        return cut

    def switch(self) -> str:
        """A failover from the primary to its replica, and the old primary back as the new
        one's replica (so the next switch is a failback)."""
        old, new = self.servers
        self._caught_up(old, new)
        if self.unsafe:
            # The negative control: the replica falls behind first, its link cut the engine's
            # own way. (An iptables cut lets through, once healed, what the killed primary's
            # kernel still holds in its socket; healed after the promotion instead, the
            # promotion's STOP SLAVE waits for the dead link to time out.)
            sql(new, "STOP SLAVE IO_THREAD")
            time.sleep(2.0)
        old.kill()
        promote(new)  # its relay log applied first: it holds every acknowledged commit
        fork = _gtid_binlog_pos(new)  # before anything is written on it
        self.forwarder.target = new.port  # clients now reach the new primary
        self.servers.reverse()
        how = self._rejoin(old, new, fork)
        return f"port {old.port} -> {new.port} ({how})"

    def _caught_up(self, primary: MariaDBServer, replica: MariaDBServer) -> None:
        """Until the replica is connected with semi-sync and has applied all the primary has
        written so far. A switch is one failure, the primary's, of a healthy pair: a replica
        restarted by the nemesis a moment ago fetches again what its relay log held, and a
        primary that died before that would be a second failure, which semi-sync does not
        promise to survive."""
        wait_until(
            lambda: _following(primary, not self.unsafe),
            STEP_TIMEOUT,
            f"the replica on port {replica.port} to acknowledge again",
        )
        position = _gtid_binlog_pos(primary)
        rows = sql(replica, f"SELECT MASTER_GTID_WAIT('{position}', {STEP_TIMEOUT})")
        if rows != [(0,)]:
            raise TimeoutError(f"the replica did not apply up to {position} before the switch")

    def _rejoin(self, old: MariaDBServer, new: MariaDBServer, fork: str) -> str:
        """`old` (killed) started again and made `new`'s semi-synchronous replica, from where
        `new` forked from it if it has nothing more, else cloned again. How, in words."""
        old.start()  # crash recovery: its binary log and InnoDB agree again
        mine = _gtid_binlog_pos(old)
        if mine == fork:
            position, how = mine, f"rejoined by GTID at {fork or 'the start'}"
        else:
            position = self._reclone(old, new)
            how = f"re-cloned: it had {mine}, the new primary forked at {fork}"
        sql(
            old,
            "SET GLOBAL read_only = ON",  # as failover managers do: a replica takes no writes
            "STOP SLAVE",
            "RESET SLAVE ALL",
            f"SET GLOBAL gtid_slave_pos = '{position}'",
            f"CHANGE MASTER TO MASTER_HOST='{LINK}', MASTER_PORT={new.port}, "
            "MASTER_USER='root', MASTER_PASSWORD='', MASTER_USE_GTID=slave_pos, "
            "MASTER_CONNECT_RETRY=1",
            "START SLAVE",
        )
        wait_until(
            lambda: _following(new, not self.unsafe),
            STEP_TIMEOUT,
            f"port {old.port} to follow port {new.port}",
        )
        status = replica_status(old)
        if status.get("Using_Gtid") != "Slave_Pos" or status.get("Last_IO_Errno") not in (0, None):
            raise RuntimeError(f"port {old.port} rejoined wrongly: {status}")
        return how

    def _reclone(self, old: MariaDBServer, new: MariaDBServer) -> str:
        """`old`'s copy of the store replaced by a consistent dump of `new`'s, its binary log
        emptied and started at the dump's GTID position (so that it can serve a replica from
        there once promoted); that position."""
        dump = _run(
            "mariadb-dump",
            f"--port={new.port}",
            "--single-transaction",  # one snapshot, no lock: writes go on meanwhile
            "--gtid",
            "--master-data=2",  # the snapshot's GTID position, as a comment
            "--databases",
            DATABASE,
        )
        found = re.search(r"gtid_slave_pos\s*=\s*'([^']*)'", dump)
        if found is None:
            raise RuntimeError("mariadb-dump wrote no GTID position")
        # Not logged: the copy is not this server's history, its binary log is reset below.
        sql(old, "SET SESSION sql_log_bin = 0", f"DROP DATABASE IF EXISTS {DATABASE}")
        _run(
            "mariadb",
            f"--port={old.port}",
            "--init-command=SET SESSION sql_log_bin = 0",
            stdin=dump,
        )
        position = found.group(1)
        sql(old, "RESET MASTER", f"SET GLOBAL gtid_binlog_state = '{position}'")
        return position


def _run(program: str, *args: str, stdin: str | None = None) -> str:
    """A MariaDB client program run as root over TCP on loopback; its output, or
    RuntimeError with what it said."""
    command = [program, f"--host={LOOPBACK}", "--user=root", "--protocol=TCP", *args]
    done = subprocess.run(
        command, input=stdin, capture_output=True, text=True, timeout=STEP_TIMEOUT
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


@contextlib.contextmanager
def mariadb_semisync(workdir: Path, unsafe: bool) -> Iterator[Setup]:
    """MariaDB with semi-synchronous replication both ways (tests/replicated.py,
    mariadb_pair(symmetric=True)), clients on the primary through a forwarder; the switch:
    kill -9, promotion with the relay log applied, the forwarder moved, the old primary
    rejoined (see the module). Negative control: asynchronous replication accepted with
    `unsafe_replication=1&failover_gap=0` (as postgres-sync's), the replica's IO thread stopped
    2 s before the kill, so the promoted replica lacks the last ranges. (With semi-sync on, a
    commit waits its timeout, a second, before it falls back, and on a busy machine the last
    2 s held as few as 3 commits.)"""
    from .setups import SEGMENT_KEYS, STORE_BOUNDS, Node, Setup, _make_keys, _segment_clients

    with (
        mariadb_pair(semi_sync=not unsafe, link=LINK, symmetric=True) as (a, b),
        Forwarder(a.port) as forwarder,
    ):
        a.create_database(DATABASE)
        params = "?unsafe_replication=1&failover_gap=0" if unsafe else ""
        # The plain URL docs/stores.md gives: semi-sync is read from the server itself.
        store = f"mysql://root@{LOOPBACK}:{forwarder.port}/{DATABASE}{params}"
        keys = dict(SEGMENT_KEYS)
        _make_keys(store, keys)
        pair = _Pair(a, b, forwarder, unsafe)
        setup = Setup(
            "mariadb-semisync",
            store,
            keys,
            _segment_clients(),
            {"mariadb-1": Node("mariadb-1", a), "mariadb-2": Node("mariadb-2", b)},
            pair.switch,
            bounds=dict(STORE_BOUNDS),
            proxies={"to-primary": forwarder},
            splits={"replication-link": pair.cut_link},
        )
        if unsafe:
            setup.unsafe_what = "asynchronous replica, unsafe_replication=1&failover_gap=0, stopped"
            setup.unsafe_fault = "failover"
        yield setup
