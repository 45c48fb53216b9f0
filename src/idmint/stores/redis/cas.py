"""Compare-and-set cells on Redis: `{prefix}:c:{key}` and the index `{prefix}:cells`; and what
the engine's other modules share of them (leases.py, quorum.py: quorum nodes over the cells'
connections): the driver's exception classes, the reading of a server's persistence settings,
and the identity and swap scripts."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar, cast

from ..._errors import InvalidArgument, StoreUnavailable
from .._once import Once
from ..base import StoreIdentity
from ..replication import FAILOVER_GAP, ReplicationState, redis_state
from .acl import describe
from .failover import RedisFailover, guarded

if TYPE_CHECKING:
    import redis as redis_py

T = TypeVar("T")


@dataclass(frozen=True)
class RedisErrors:
    """redis-py's exception classes (the driver is imported only when a redis:// URL is opened)."""

    any: type[Exception]  # RedisError: every failure of the store
    broken: type[Exception]  # ConnectionError: the connection broke, or could not be made
    timeout: type[Exception]  # TimeoutError: no answer within the socket timeout


def weak_persistence(config: dict[str, str]) -> str | None:
    """What in a Redis server's CONFIG GET answer can lose a write it already confirmed (a
    crash then forgets a swap that answered True, and the ranges after it are handed out
    again); None when it fsyncs every write before answering."""
    if "appendonly" not in config:  # not an answer about persistence (a proxy?): no opinion
        return None
    problems = []
    if config.get("appendonly") != "yes":
        problems.append(f"appendonly {config.get('appendonly', '?')}")
    elif config.get("appendfsync") != "always":
        problems.append(f"appendfsync {config.get('appendfsync', '?')}")
    if config.get("appendonly") == "yes" and config.get("no-appendfsync-on-rewrite") == "yes":
        problems.append("no-appendfsync-on-rewrite yes")
    return ", ".join(problems) or None


# Every script that answers reads the server's clock (TIME) last, after its writes: scripts
# replicated as scripts (Redis before 7) may not write after a non-deterministic command.

# Makes {prefix}:meta, the store's identity, if it is missing (a new or wiped Redis): ARGV[1]
# is a fresh UUID, the creation time is Redis's TIME. Returns {id, created_ms}. TIME comes
# before a write here: replicate the script's effects, not its text (the default from Redis 5).
META_SCRIPT = """
if redis.replicate_commands then redis.replicate_commands() end
local meta = KEYS[1]
if redis.call('EXISTS', meta) == 0 then
    local now = redis.call('TIME')
    local ms = now[1] .. string.format('%03d', math.floor(tonumber(now[2]) / 1000))
    redis.call('HSET', meta, 'id', ARGV[1], 'created_ms', ms)
end
return redis.call('HMGET', meta, 'id', 'created_ms')
"""

# A cell's compare-and-set (the lease store's failover fence moves cells with it too).
# KEYS: the cell. ARGV: the version as read, the new value. The new version, or 0 when the
# cell is gone or has another version. Versions are compared as the strings HINCRBY wrote.
SWAP_SCRIPT = """
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'value', ARGV[2])
return redis.call('HINCRBY', KEYS[1], 'version', 1)
"""

# Compare-and-set cells: {prefix}:c:{key}, a hash of `value` and `version` (a per-cell counter,
# from 1), and {prefix}:cells, a sorted set of every cell's key (all scores 0, so ZRANGEBYLEX
# orders them by their bytes), added in the script that makes the cell: a scan never misses a
# cell that exists, and needs no KEYS (which walks the whole database).

# KEYS: the cell, the index. ARGV: the key, the value. 1 if made, 0 if the cell exists.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'value', ARGV[2], 'version', '1')
redis.call('ZADD', KEYS[2], 0, ARGV[1])
return 1
"""

# KEYS: the index. ARGV: ZRANGEBYLEX's min and max, the cells' key prefix. {key, value, ...}
# of the matching cells, read in one atomic step: a snapshot. The cell names are built here
# from the index (as the lease scripts build theirs): fine on one Redis, not on Redis Cluster.
_SCAN = """
local found = {}
for _, key in ipairs(redis.call('ZRANGEBYLEX', KEYS[1], ARGV[1], ARGV[2])) do
    local value = redis.call('HGET', ARGV[3] .. key, 'value')
    if value then
        found[#found + 1] = key
        found[#found + 1] = value
    end
end
return found
"""

_log = logging.getLogger(__name__)

_warned = Once()  # the stores whose weak persistence was logged


class RedisCasStore:
    """A CasStore on one Redis server (or a primary), under the URL's key prefix.

    Each call is one command or one Lua script, atomic on the server. Only with `appendonly yes`
    and `appendfsync always` does Redis fsync a change before it answers; with anything weaker
    a crash can forget a swap that answered True, and ids repeat. So before its first write the
    store asks CONFIG GET, and refuses to write (InvalidArgument, naming the settings) on weaker
    persistence unless the URL accepts it (`?unsafe=1`: then a warning, once per process); a
    server that refuses CONFIG GET (ACLs, a managed Redis) is taken on trust.
    """

    def __init__(
        self,
        client: redis_py.Redis,
        prefix: str,
        display_url: str,
        errors: RedisErrors,
        *,
        timeout: float,
        unsafe: bool = False,
        unsafe_replication: bool = False,
        gap: int = FAILOVER_GAP,
        fewer_replicas: bool = False,
    ) -> None:
        self.display_url = display_url
        self._client = client
        self._unsafe = unsafe
        self._prefix = prefix
        self._errors = errors
        self._timeout = timeout
        self._index = f"{prefix}:cells"
        self._meta = client.register_script(META_SCRIPT)
        self._create = client.register_script(guarded(_CREATE))
        self._swap = client.register_script(guarded(SWAP_SCRIPT))
        self._scan = client.register_script(_SCAN)
        self._checked = False  # the server's persistence settings were looked at
        self.failover = RedisFailover(
            client,
            prefix,
            display_url,
            lambda op: self._call(op, idempotent=False),
            client.register_script(SWAP_SCRIPT),  # the fence's: past the guard
            timeout=timeout,
            unsafe=unsafe_replication,
            gap=gap,
            fewer=fewer_replicas,
        )

    def _cell(self, key: str) -> str:
        return f"{self._prefix}:c:{key}"

    def _call(self, op: Callable[[], T], *, idempotent: bool) -> T:
        """`op`, its failures as StoreUnavailable. A call that only reads is tried again once
        on a broken connection (a pooled one the server dropped); a write is not, because its
        outcome is unknown: re-sent after it applied, a swap would find its own version and
        answer False, and a create would answer "exists", for changes that happened."""
        errors = self._errors
        for attempt in (1, 2):
            try:
                return op()
            except errors.broken as exc:
                if attempt == 1 and idempotent:
                    continue
                raise self._unavailable(exc) from exc
            except errors.any as exc:
                raise self._unavailable(exc) from exc
        raise AssertionError("unreachable")

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        timeout = self._timeout if isinstance(exc, self._errors.timeout) else None
        return StoreUnavailable(describe(exc, self.display_url, timeout))

    def _check_persistence(self) -> None:
        """Before the first write: refuse a server whose persistence can lose a confirmed
        write, or warn once if the URL accepts it (see the class)."""
        if self._checked:
            return
        try:
            config = cast(dict[str, str], self._client.config_get("*append*"))
        except self._errors.any:  # refused (NOPERM, renamed), or down: the call will tell
            self._checked = True
            return
        weak = weak_persistence(config)
        if weak is not None and not self._unsafe:
            # Not marked checked: once the server is set right, the next write goes through.
            raise InvalidArgument(
                f"store {self.display_url}: Redis runs with {weak}, so a crash can lose a "
                "range it already confirmed and ids would repeat; set appendonly yes and "
                "appendfsync always (docs/stores.md), or accept the risk with ?unsafe=1 in "
                "the store URL"
            )
        self._checked = True  # one look per store, never a cost per call
        if weak is None or not _warned.first(self.display_url):
            return
        _log.warning(
            "store %s: Redis runs with %s, so a crash can lose a compare-and-set it already "
            "confirmed and ids would repeat; set appendonly yes and appendfsync always "
            "(docs/stores.md)",
            self.display_url,
            weak,
        )

    def init(self) -> None:
        """Nothing to create (cells are made by `create`): makes the store's identity, and
        looks at the persistence settings."""
        self.identity()
        self._check_persistence()

    def identity(self) -> StoreIdentity | None:
        """The identity under this prefix, the lease store's: made on first use."""
        meta = f"{self._prefix}:meta"
        # Idempotent: a re-run finds the identity its first run made.
        got = self._call(lambda: self._meta(keys=[meta], args=[uuid.uuid4().hex]), idempotent=True)
        store_id, created_ms = cast(list[str], got)
        return StoreIdentity(store_id, int(created_ms))

    def read(self, key: str) -> tuple[str, int] | None:
        cell = self._cell(key)
        value, version = self._call(
            lambda: self._client.hmget(cell, ["value", "version"]), idempotent=True
        )
        return None if value is None or version is None else (str(value), int(version))

    def replication(self) -> ReplicationState:
        """The server's replication as it is now (INFO replication); unless the URL says
        unsafe_replication, every replica the prefix has had is waited for after each write."""
        info = self._call(lambda: self._client.info("replication"), idempotent=True)
        lineage = self.failover.lineage_key
        required = self._call(lambda: self._client.hget(lineage, "replicas"), idempotent=True)
        state = redis_state(info, waits=not self.failover.unsafe)
        return replace(state, required=int(required or 0))

    def set_required(self, replicas: int) -> int:
        """Set the replicas every write waits for (see RedisFailover.set_required)."""
        return self.failover.set_required(replicas)

    def create(self, key: str, value: str) -> bool:
        self._check_persistence()
        keys = [self._cell(key), self._index]
        return bool(self.failover.write(self._create, keys, [key, value]))

    def swap(self, key: str, version: int, value: str) -> bool:
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            return False  # versions start at 1: nothing has this one
        self._check_persistence()
        return bool(self.failover.write(self._swap, [self._cell(key)], [str(version), value]))

    def scan(self, prefix: str) -> list[tuple[str, str]]:
        # Index entries compare by bytes; no UTF-8 text holds the byte 0xFF, so [prefix up to
        # (prefix + 0xFF covers every key that starts with prefix and nothing else.
        low: bytes | str = b"[" + prefix.encode() if prefix else "-"
        high: bytes | str = b"(" + prefix.encode() + b"\xff" if prefix else "+"
        args = [low, high, f"{self._prefix}:c:"]
        found = cast(
            list[str],
            self._call(lambda: self._scan(keys=[self._index], args=args), idempotent=True),
        )
        return sorted(zip(found[::2], found[1::2], strict=True))

    def close(self) -> None:
        """Close the connections; safe to repeat (a later call would connect again)."""
        self._client.close()
