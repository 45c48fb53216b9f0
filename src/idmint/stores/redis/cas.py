"""Compare-and-set cells on Redis: `{prefix}:c:{key}` and the index `{prefix}:cells`."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

from ..._errors import (
    InvalidArgument,
    StoreUnavailable,
)
from .._once import Once
from ..base import StoreIdentity
from ..replication import (
    FAILOVER_GAP,
    ReplicationState,
    redis_state,
)
from .client import RedisErrors
from .failover import RedisFailover, guarded

if TYPE_CHECKING:
    import redis as redis_py

from .client import META_SCRIPT, SWAP_SCRIPT, weak_persistence

T = TypeVar("T")

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

    Each call is one command or one Lua script, atomic on the server. A cell's change is as
    durable as the server's persistence makes it: with `appendonly yes` and `appendfsync
    always`, Redis writes and fsyncs its append-only file before it answers; with anything
    weaker a crash can forget a swap that answered True, and ids repeat. So before its first
    write the store asks CONFIG GET, and refuses to write (InvalidArgument, naming the settings)
    on weaker persistence unless the URL accepts it (`?unsafe=1`: then a warning, once per
    process); a server that refuses CONFIG GET (ACLs, a managed Redis) is taken on trust.
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
        reason = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, self._errors.timeout):
            reason += f" (no answer within {self._timeout:g} s)"
        return StoreUnavailable(f"store {self.display_url} unavailable: {reason}")

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
        return redis_state({k: str(v) for k, v in info.items()}, waits=not self.failover.unsafe)

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
