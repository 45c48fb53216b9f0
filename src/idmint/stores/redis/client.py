"""What the Redis engine's modules share (__init__.py: leases, cells and the engine;
quorum.py: quorum nodes over the cells' connections): the driver's exception classes, the
reading of a server's persistence settings, and what a quorum node uses of the cells. Both
import this module; it imports neither, so imports point one way (tests/test_layers.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..base import StoreIdentity

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


class RedisCells(Protocol):
    """What a quorum node shares of the engine's compare-and-set cells (RedisCasStore in
    redis.py): their client and connection pool, key prefix, error mapping and identity."""

    display_url: str
    _client: Any
    _prefix: str
    _errors: RedisErrors

    def _call(self, op: Callable[[], T], *, idempotent: bool) -> T: ...

    def identity(self) -> StoreIdentity | None: ...

    def close(self) -> None: ...


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

# A cell's compare-and-set (cas.py; the lease store's failover fence moves cells with it too).
# KEYS: the cell. ARGV: the version as read, the new value. The new version, or 0 when the
# cell is gone or has another version. Versions are compared as the strings HINCRBY wrote.
SWAP_SCRIPT = """
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'value', ARGV[2])
return redis.call('HINCRBY', KEYS[1], 'version', 1)
"""
