"""Worker-id leases and compare-and-set cells (hence segment keys, see over_cas/ranges.py) on Redis:
`redis://[[user]:password@]host[:port][/db][?prefix=STR]`.

Leases: per (namespace, worker id) two keys, both under the URL's prefix (default "idmint"):

    {prefix}:w:{namespace}:{id}   the live lease: the owner string, with a server-side TTL (PX),
                                  so expiry is judged by Redis's clock and nobody else's
    {prefix}:h:{namespace}:{id}   a hash with no TTL: `horizon` (outlives leases; only moves
                                  up, except that `release(issued_ms=)` may bring it down to
                                  what was really issued), `host` of the last holder, and
                                  `owner`, the last holder's owner string ("" once released)

Every multi-step operation is one Lua script, so it is atomic on the server. The scripts
build key names from their arguments (acquire does not know beforehand which id it will
take), which is fine on a single Redis or a replicated one, but not on Redis Cluster.

Cells: `{prefix}:c:{key}` and the index `{prefix}:cells` (see RedisCasStore). The store's
identity, `{prefix}:meta`, is one for both.

Durability is the server's: with `appendonly yes` and `appendfsync always` a recorded horizon
and a swapped cell survive a crash; with weaker settings a crash can lose the last horizon
raise (caught at the next renewal) or the last swaps (ids handed out again: see docs/stores.md).
"""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlsplit

from ..._errors import DriverMissing, InvalidArgument
from ...ids import is_digits
from .._urls import ENCODE_HINT, misplaced_at, scrub
from ..engine import Engine
from ..over_cas.ranges import CasRangeStore
from ..replication import FAILOVER_GAP_PARAMETER, UNSAFE_REPLICATION, failover_gap
from .cas import RedisCasStore, RedisErrors
from .cas import weak_persistence as weak_persistence  # its public path, kept
from .leases import RedisLeaseStore
from .quorum import RedisQuorumNode

DEFAULT_PREFIX = "idmint"
DEFAULT_PORT = 6379


def _parse(url: str, display: str) -> dict[str, Any]:
    """Connection arguments and the key prefix from a redis:// or rediss:// URL."""

    def bad(reason: str) -> InvalidArgument:
        # urlsplit's reasons quote what it made of the URL: maybe pieces of a password
        return InvalidArgument(f"bad store URL {display!r}: {scrub(reason, url)}")

    if misplaced_at(url):
        raise bad(ENCODE_HINT)
    try:
        parts = urlsplit(url)
        port = parts.port or DEFAULT_PORT
    except ValueError as exc:
        raise bad(str(exc)) from None
    if not parts.hostname:
        raise bad("it names no host")
    db = parts.path.strip("/") or "0"
    if not is_digits(db):
        raise bad(f"the database must be a number, not {db!r}")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    known = ("prefix", "unsafe", UNSAFE_REPLICATION, FAILOVER_GAP_PARAMETER)
    unknown = set(query) - set(known)
    if unknown:
        raise bad(f"unknown parameter {sorted(unknown)[0]!r} (only {', '.join(known)})")
    flags = {}
    for flag in ("unsafe", UNSAFE_REPLICATION):
        value = query.get(flag, "0").lower()
        if value not in ("0", "1", "true", "false", "yes", "no"):
            raise bad(f"{flag} must be 1 or 0, not {value!r}")
        flags[flag] = value in ("1", "true", "yes")
    prefix = query.get("prefix", DEFAULT_PREFIX)
    if not prefix:
        raise bad("the prefix is empty")
    return {
        "host": parts.hostname,
        "port": port,
        "db": int(db),
        # urlsplit leaves them percent-encoded, as the URL must write "/ ? # @ :" in them
        "username": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password is not None else None,
        "ssl": parts.scheme.lower() == "rediss",
        "prefix": prefix,
        "unsafe": flags["unsafe"],
        UNSAFE_REPLICATION: flags[UNSAFE_REPLICATION],
        "gap": failover_gap(query.get(FAILOVER_GAP_PARAMETER), display),
    }


def _driver() -> Any:
    """The redis module, or DriverMissing naming the extra to install."""
    try:
        import redis
    except ImportError:
        raise DriverMissing(
            "redis:// stores need the redis driver: pip install 'idmint[redis]'"
        ) from None
    return redis


def _client(redis: Any, args: dict[str, Any], timeout: float, *, retries: int) -> Any:
    """A redis.Redis (its own connection pool) on the parsed URL's server; no I/O."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(
        **args,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        decode_responses=True,
        # Retries are immediate and only on a broken connection, never on a timeout:
        # `timeout` bounds each operation.
        retry=Retry(NoBackoff(), retries, supported_errors=(redis.exceptions.ConnectionError,)),
    )


def open_redis_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The redis engine of a URL: segment keys (over CAS), worker leases and compare-and-set
    cells. The URL is checked and the driver imported here; no I/O until the first call."""
    args = _parse(url, display)
    redis = _driver()
    prefix = args.pop("prefix")
    unsafe = bool(args.pop("unsafe"))
    # Replicas each write does not wait for, and the fence's gap (see failover.py).
    replication = {"unsafe_replication": args.pop(UNSAFE_REPLICATION), "gap": args.pop("gap")}
    # Connection errors and timeouts above all, but also a server that refuses to write
    # (READONLY replica, OOM, MISCONF): all are the store failing, not the caller.
    errors = RedisErrors(
        any=redis.exceptions.RedisError,
        broken=redis.exceptions.ConnectionError,
        timeout=redis.exceptions.TimeoutError,
    )

    def leases(_: Engine) -> RedisLeaseStore:
        # One immediate retry on a broken connection (a pooled one the server dropped, say).
        client = _client(redis, args, timeout, retries=1)
        return RedisLeaseStore(
            client, prefix, display, (errors.any,), timeout=timeout, **replication
        )

    def cas(_: Engine) -> RedisCasStore:
        # No retry inside the driver: a swap re-sent after its reply was lost would find its
        # own write and answer False for a swap that happened (see RedisCasStore._call).
        client = _client(redis, args, timeout, retries=0)
        return RedisCasStore(
            client, prefix, display, errors, timeout=timeout, unsafe=unsafe, **replication
        )

    return Engine(
        "redis",
        display,
        {
            "ranges": lambda engine: CasRangeStore(engine.cas()),
            "leases": leases,
            "cas": cas,
            "quorum": lambda engine: RedisQuorumNode(cast(RedisCasStore, engine.cas())),
        },
    )
