"""What a store's replication can lose, read from the engine itself (issue 20).

A replicated store (Redis with replicas, PostgreSQL with standbys, MySQL/MariaDB with replicas)
fails over to a replica; one lacking the primary's last acknowledged writes moves a key's
counter back, and the same ranges are handed out again. So each engine reports here, when
opened and while it runs, its role (primary, replica, or no replication at all); the primary's
*lineage*, an id that changes when another server becomes the primary (Redis `master_replid`,
PostgreSQL's system identifier and timeline, MySQL's `server_uuid`; a `StoreIdentity` does
not: it is data, and replicas copy it); how many replicas are connected, and how many each
write waits for before it is acknowledged (PostgreSQL standbys: synchronous ones in the
commit, the others in idmint's wait for their flush; MySQL semi-synchronous replicas; Redis
WAIT, which idmint sends itself). `risk` says in one line why an acknowledged write may be
missing from a promoted replica, or is None when none can be (no replicas, or every write
waits for them).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from .._errors import InvalidArgument
from ..ids import is_digits
from ._urls import take_parameter

# The roles, kept with the contracts (a strategy reads them there); re-exported here.
from .base import PRIMARY as PRIMARY
from .base import REPLICA as REPLICA
from .base import STANDALONE as STANDALONE

#: The store URL parameter that accepts replicas a write does not wait for (=1).
UNSAFE_REPLICATION = "unsafe_replication"
#: The store URL parameter that sets the fence's gap (ids; 0 fences nothing but leases).
FAILOVER_GAP_PARAMETER = "failover_gap"
#: The store URL parameter that lets writes go on with fewer replicas than the store has
#: waited for (=1): a promoted primary then serves alone, and a failback is covered by the
#: gap alone (docs/stores.md, "Running on a replicated store").
FEWER_REPLICAS = "fewer_replicas"
#: Ids every key (each stripe) skips when a failover is detected: more than the ranges a
#: promoted replica can lack (with writes that wait for the replicas, none; else the
#: allocations of the replication lag). See docs/stores.md.
FAILOVER_GAP = 1_000_000


@dataclass(frozen=True)
class ReplicationSettings:
    """What a store URL says about its replication (see the parameters above)."""

    unsafe: bool = False  # replicas a write does not wait for are accepted
    gap: int = FAILOVER_GAP  # ids every key skips at a fence
    fewer: bool = False  # writes go on with fewer replicas than the store has waited for


def take_replication_parameters(url: str, display_url: str) -> tuple[str, ReplicationSettings]:
    """A SQL store URL without idmint's replication parameters (its driver refuses ones it
    does not know), and what they say."""
    flags = {}
    for name in (UNSAFE_REPLICATION, FEWER_REPLICAS):
        url, value = take_parameter(url, name)
        if value not in (None, "0", "1"):
            raise InvalidArgument(f"bad store URL {display_url!r}: {name} must be 1 or 0")
        flags[name] = value == "1"
    url, gap = take_parameter(url, FAILOVER_GAP_PARAMETER)
    settings = ReplicationSettings(
        flags[UNSAFE_REPLICATION], failover_gap(gap, display_url), flags[FEWER_REPLICAS]
    )
    return url, settings


def failover_gap(value: str | None, display_url: str) -> int:
    """The fence's gap from the URL parameter's value (None: the default)."""
    if value is None:
        return FAILOVER_GAP
    if not is_digits(value) or len(value) > 18:
        raise InvalidArgument(
            f"bad store URL {display_url!r}: {FAILOVER_GAP_PARAMETER} must be a whole number "
            f"of ids (0 or more), not {value!r}"
        )
    return int(value)


@dataclass(frozen=True)
class Failover:
    """A failover this process detected and fenced."""

    store: str  # the store's URL, without secrets
    recorded: str  # the lineage the store had recorded
    lineage: str  # the new primary's
    at: float  # unix seconds


_failovers: list[Failover] = []
_failovers_lock = threading.Lock()


def note_failover(store: str, recorded: str, lineage: str) -> None:
    """Count a fenced failover (for /v1/stats, /metrics and the dashboard)."""
    with _failovers_lock:
        _failovers.append(Failover(store, recorded, lineage, time.time()))


def failovers() -> list[Failover]:
    """Every failover this process fenced, oldest first."""
    with _failovers_lock:
        return list(_failovers)


@dataclass(frozen=True)
class ReplicationState:
    role: str  # PRIMARY (replicas attached), REPLICA (read-only), STANDALONE (none)
    lineage: str | None  # changes when another server becomes the primary
    replicas: int  # connected now
    waits_for: int  # replicas each acknowledged write has reached
    detail: str  # the engine's own words: settings and figures an operator can check
    #: Writes are set to wait for the replicas but do not now (MySQL's semi-synchronous
    #: replication fell back to asynchronous after a timeout): a passing state, not a setting.
    degraded: bool = False
    #: The most replicas the store's writes have waited for (its requirement, kept in the
    #: store: only an operator lowers it, see `idmint replicas`); None where not read.
    required: int | None = None
    #: Of `waits_for`, the replicas the commit does not wait for and idmint does, after it:
    #: PostgreSQL's asynchronous standbys, until they have flushed the write (a write they do
    #: not have within the bound is StoreUnavailable, as a commit they did not confirm).
    waited_after_commit: int = 0

    @property
    def risk(self) -> str | None:
        """Why a failover can lose an acknowledged write, or None."""
        if self.role == REPLICA:
            return "it is a replica: it takes no writes"
        if self.replicas > self.waits_for:
            return (
                f"{self.replicas} replica(s) connected and writes wait for {self.waits_for}: "
                "a failover to one that lags loses acknowledged writes"
            )
        return self.shortfall

    @property
    def shortfall(self) -> str | None:
        """Why writes are refused for want of replicas (fewer than the store has waited
        for), or None."""
        if self.required is not None and self.waits_for < self.required:
            return (
                f"writes wait for {self.waits_for} replica(s) and the store has waited for "
                f"{self.required}: a failback to an older copy, or the loss of this one, "
                "could repeat ids"
            )
        return None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "risk": self.risk}

    def describe(self) -> str:
        """One line for `idmint init`, logs and messages."""
        words = f"{self.role}, {self.replicas} replica(s), writes wait for {self.waits_for}"
        if self.required is not None:
            words += f", the store requires {self.required}"
        return f"{words} ({self.detail})" if self.detail else words


def redis_state(parsed: dict[str, Any], *, waits: bool) -> ReplicationState:
    """A Redis server's replication from its INFO replication fields, as redis-py parses them.
    `waits`: whether idmint sends WAIT for every connected replica after each write (then they
    are waited for)."""
    # redis-py parses each slaveN line into a dict: back to Redis's own `ip=...,state=...`.
    info = {
        name: ",".join(f"{k}={v}" for k, v in value.items())
        if isinstance(value, dict)
        else str(value)
        for name, value in parsed.items()
    }
    role = info.get("role", "master")
    lineage = info.get("master_replid")
    if role != "master":
        link = info.get("master_link_status", "?")
        detail = f"replica of {info.get('master_host', '?')}:{info.get('master_port', '?')}"
        return ReplicationState(REPLICA, lineage, 0, 0, f"{detail}, link {link}")
    offsets = [
        value
        for name, value in info.items()
        if name.startswith("slave") and is_digits(name[5:]) and "offset" in value
    ]
    # Only replicas online count (see the guard in redis/failover.py): one in its first sync
    # acknowledges nothing yet, and no failover manager promotes it.
    replicas = sum("state=online" in value for value in offsets)
    detail = f"master_repl_offset {info.get('master_repl_offset', '?')}"
    if offsets:
        detail += "; " + "; ".join(offsets)
    return ReplicationState(
        PRIMARY if replicas else STANDALONE,
        lineage,
        replicas,
        replicas if waits else 0,
        detail,
    )


#: The standbys a failover can promote, as the primary sees them (issue 30): physical ones (a
#: logical walsender is connected to a database) that report a replay position (pg_receivewal,
#: streaming WAL for backups as Barman runs it, never does), streaming. Not a pg_basebackup in
#: progress ('backup'), and not a standby in 'catchup' (just attached, or back after a break):
#: it is behind by more than any commit made now, PostgreSQL picks no synchronous standby
#: among those, and waiting for it would hold every write until it caught up. It counts from
#: its first streaming report on; one the store's requirement counts already (it streamed
#: before) is missed meanwhile, as a standby gone is. Walsenders of one application_name from
#: one address are one standby, the newest: a standby that reconnected while its old link was
#: cut (an HA manager repointing it) is listed twice until wal_sender_timeout ends the old
#: walsender, and counting both raised the store's requirement to a standby that does not
#: exist, which refused every write for good once the old one went (issue 32). Two standbys
#: on one host need application_names of their own (synchronous_standby_names needs them too).
_POSTGRES_STANDBYS = """
WITH walsenders AS (
    SELECT r.* FROM pg_stat_replication r JOIN pg_stat_activity a ON a.pid = r.pid
     WHERE a.datname IS NULL AND r.state = 'streaming' AND r.replay_lsn IS NOT NULL
), standbys AS (
    SELECT DISTINCT ON (application_name, client_addr) * FROM walsenders
     ORDER BY application_name, client_addr, backend_start DESC
)"""

#: One round trip: role, timeline, the commit settings and the standbys (above). sync_state
#: says which a commit waits for.
POSTGRES_QUERY = (
    _POSTGRES_STANDBYS
    + """
SELECT pg_is_in_recovery(),
       CASE WHEN pg_is_in_recovery() THEN NULL
            ELSE substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) END,
       current_setting('synchronous_commit'),
       current_setting('synchronous_standby_names'),
       (SELECT count(*) FROM standbys),
       (SELECT count(*) FROM standbys WHERE sync_state = 'sync'),
       (SELECT count(*) FROM standbys WHERE sync_state = 'quorum'),
       (SELECT string_agg(coalesce(application_name, '?') || ' ' || coalesce(state, '?') || ' '
                          || coalesce(sync_state, '?')
                          || coalesce(' replay_lag ' || replay_lag::text, ''), '; ')
          FROM pg_stat_replication)
"""
)

#: After a write: the WAL position it must reach (the parameter, or when it is NULL the
#: server's WAL write position, read on the connection that committed: past its commit, which
#: wrote its WAL unless synchronous_commit is off, a setting the durability check reports),
#: and the standbys (above) that have not flushed that far, in one line, or NULL.
POSTGRES_FLUSH_QUERY = (
    _POSTGRES_STANDBYS
    + """, target AS (SELECT coalesce(%s::pg_lsn, pg_current_wal_lsn()) AS lsn)
SELECT t.lsn::text,
       string_agg(quote_literal(coalesce(s.application_name, '?')) || ' at '
                  || coalesce(host(s.client_addr), 'a local socket') || ' (flushed to '
                  || coalesce(s.flush_lsn::text, 'nothing') || ')', ', ')
           FILTER (WHERE s.pid IS NOT NULL)
  FROM target t LEFT JOIN standbys s ON s.flush_lsn IS NULL OR s.flush_lsn < t.lsn
 GROUP BY t.lsn
"""
)

_WAITING_COMMITS = ("on", "remote_apply", "remote_write")


def postgres_state(row: tuple[Any, ...], *, waits: bool) -> ReplicationState:
    """A PostgreSQL server's replication from POSTGRES_QUERY's row. `waits`: whether idmint
    waits after each write for the standbys its commit does not wait for (not with
    unsafe_replication): then every standby is waited for."""
    in_recovery, timeline, commit, names, standbys, _, _, listed = row
    if in_recovery:
        return ReplicationState(REPLICA, None, 0, 0, "in recovery (a standby)")
    # A commit waits until as many standbys as the setting requires have it (it blocks while
    # fewer are connected and caught up), whichever they are now: those it requires. Others
    # idmint waits for itself (see sql/postgres.py, await_standbys).
    commit_waits = _required(str(names)) if commit in _WAITING_COMMITS and names else 0
    after = max(0, int(standbys) - commit_waits) if waits else 0
    detail = f"timeline {int(timeline, 16)}, synchronous_commit={commit}"
    detail += f", synchronous_standby_names={names!r}" if names else ""
    detail += f", idmint waits for {after} standby(s) to flush each write" if after else ""
    detail += f"; {listed}" if listed else ""
    return ReplicationState(
        PRIMARY if standbys else STANDALONE,
        f"timeline {int(timeline, 16)}",
        int(standbys),
        commit_waits + after,
        detail,
        waited_after_commit=after,
    )


def _required(names: str) -> int:
    """How many standbys synchronous_standby_names makes a commit wait for: N of
    `ANY N (...)`, `FIRST N (...)` or `N (...)`; 1 for a plain list (FIRST 1)."""
    words = names.replace("(", " (").split()
    if len(words) >= 2 and words[0].upper() in ("ANY", "FIRST") and is_digits(words[1]):
        return int(words[1])
    if words and is_digits(words[0]):
        return int(words[0])
    return 1


def mysql_state(
    row: tuple[Any, ...], replica_threads: list[str], semi_sync: dict[str, str]
) -> ReplicationState:
    """A MySQL or MariaDB server's replication from MYSQL_QUERY's row (read_only, server_id,
    server_uuid or None on MariaDB, replicas connected), the values of its replication
    threads' *_Running columns (SHOW REPLICA STATUS: empty when it replicates from nobody),
    and its semi-synchronous replication status and settings (see semi_sync_fields)."""
    read_only, server_id, server_uuid, replicas = row
    running = [value for value in replica_threads if value.lower() == "yes"]
    if running or str(read_only) in ("1", "ON"):
        why = "replicating (SHOW REPLICA STATUS)" if running else "read_only"
        return ReplicationState(REPLICA, None, 0, 0, why)
    lineage = f"server_uuid {server_uuid}" if server_uuid else f"server_id {server_id}"
    enabled = semi_sync.get("enabled") == "ON"
    active = semi_sync.get("status") == "ON"
    # MariaDB's semi-sync waits for one replica; MySQL's for wait_for_replica_count.
    waits = int(semi_sync.get("wait_for_count") or 1) if active else 0
    if not enabled:
        detail = "semi-synchronous replication off"
    elif active:
        detail = f"semi-synchronous replication on (timeout {semi_sync.get('timeout', '?')} ms)"
    else:
        detail = "semi-synchronous replication enabled but fallen back to asynchronous"
    return ReplicationState(
        PRIMARY if int(replicas) else STANDALONE,
        lineage,
        int(replicas),
        min(waits, int(replicas)),
        f"{lineage}, {detail}, no_tx {semi_sync.get('no_tx', '?')}",
        degraded=enabled and not active,
    )


def semi_sync_fields(rows: list[tuple[str, str]]) -> dict[str, str]:
    """SHOW GLOBAL STATUS/VARIABLES LIKE 'rpl_semi_sync_%' rows, in both spellings (MySQL
    8.0.26+ says source and replica, MariaDB and older MySQL master and slave): the primary's
    enabled, timeout, wait_for_count (settings), status and no_tx (status)."""
    fields = {}
    for name, value in rows:
        lowered = str(name).lower().replace("_source_", "_master_")
        lowered = lowered.replace("wait_for_replica_count", "wait_for_slave_count")
        for suffix, field_ in (
            ("master_enabled", "enabled"),
            ("master_timeout", "timeout"),
            ("master_wait_for_slave_count", "wait_for_count"),
            ("master_status", "status"),
            ("master_no_tx", "no_tx"),
        ):
            if lowered == f"rpl_semi_sync_{suffix}":
                fields[field_] = str(value).upper()
    return fields
