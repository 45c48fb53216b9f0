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

import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import parse_qsl, unquote, urlsplit

from ..._errors import (
    DriverMissing,
    InvalidArgument,
    LeaseLost,
    StoreUnavailable,
    WorkerInUse,
    WorkersExhausted,
)
from ...ids import is_digits
from .._once import Once
from .._urls import ENCODE_HINT, misplaced_at, scrub
from ..base import Lease, StoreIdentity, WorkerInfo, check_claim, forgotten
from ..engine import Engine
from ..leasing import holder_name
from ..over_cas.ranges import CasRangeStore
from ..replication import (
    FAILOVER_GAP,
    FAILOVER_GAP_PARAMETER,
    UNSAFE_REPLICATION,
    ReplicationState,
    failover_gap,
    redis_state,
)
from .client import RedisErrors
from .client import weak_persistence as weak_persistence  # its public path, kept
from .failover import RedisFailover, guarded
from .quorum import RedisQuorumNode

if TYPE_CHECKING:
    import redis as redis_py

DEFAULT_PREFIX = "idmint"
DEFAULT_PORT = 6379

T = TypeVar("T")

# Every script that answers reads the server's clock (TIME) last, after its writes: scripts
# replicated as scripts (Redis before 7) may not write after a non-deterministic command.

# Makes {prefix}:meta, the store's identity, if it is missing (a new or wiped Redis): ARGV[1]
# is a fresh UUID, the creation time is Redis's TIME. Returns {id, created_ms}. TIME comes
# before a write here: replicate the script's effects, not its text (the default from Redis 5).
_META = """
if redis.replicate_commands then redis.replicate_commands() end
local meta = KEYS[1]
if redis.call('EXISTS', meta) == 0 then
    local now = redis.call('TIME')
    local ms = now[1] .. string.format('%03d', math.floor(tonumber(now[2]) / 1000))
    redis.call('HSET', meta, 'id', ARGV[1], 'created_ms', ms)
end
return redis.call('HMGET', meta, 'id', 'created_ms')
"""

# ARGV: prefix, namespace, workers, owner, host, ttl_ms, horizon_ms, now_ms ("" for none),
# the claimed worker id ("" to let the store choose). Without a claim, takes the lowest free
# id not reserved for a static holder whose horizon is at most now_ms, else the lowest such
# id; a claim reserves its id (the hash's `static` field) and takes it. Returns {worker id,
# floor, horizon, TIME's seconds, TIME's microseconds, the meta id and created_ms (as they
# are after the write: a failover's fence starts the store's life again)}; false when every id is
# leased; {-1, host, pttl} when the claimed id is held. Horizons stay strings: Lua numbers are
# doubles that redis.call would format with %.14g, so a number is only ever compared, never
# stored.
_ACQUIRE = """
local base = ARGV[1] .. ':'
local ns = ARGV[2] .. ':'
local wanted = ARGV[7]
local now_ms = tonumber(ARGV[8])
local chosen, first
if ARGV[9] ~= '' then
    chosen = ARGV[9]
    local lease = base .. 'w:' .. ns .. chosen
    if redis.call('EXISTS', lease) == 1 then
        local host = redis.call('HGET', base .. 'h:' .. ns .. chosen, 'host') or ''
        return {-1, host, redis.call('PTTL', lease)}
    end
else
    for id = 0, tonumber(ARGV[3]) - 1 do
        local hkey = base .. 'h:' .. ns .. id
        if redis.call('EXISTS', base .. 'w:' .. ns .. id) == 0
                and redis.call('HGET', hkey, 'static') ~= '1' then
            first = first or id
            if now_ms == nil then break end
            local floor = redis.call('HGET', hkey, 'horizon') or '0'
            if tonumber(floor) <= now_ms then
                chosen = id
                break
            end
        end
    end
    chosen = chosen or first
    if chosen == nil then return false end
end
local lease = base .. 'w:' .. ns .. chosen
local hkey = base .. 'h:' .. ns .. chosen
local floor = redis.call('HGET', hkey, 'horizon') or '0'
local horizon = wanted
if tonumber(floor) > tonumber(wanted) then horizon = floor end
redis.call('SET', lease, ARGV[4], 'PX', ARGV[6])
redis.call('HSET', hkey, 'horizon', horizon, 'host', ARGV[5], 'owner', ARGV[4])
if ARGV[9] ~= '' then redis.call('HSET', hkey, 'static', '1') end
local meta = redis.call('HMGET', base .. 'meta', 'id', 'created_ms')
local now = redis.call('TIME')
return {chosen, floor, horizon, now[1], now[2], meta[1] or '', meta[2] or ''}
"""

# KEYS: lease, horizon hash, meta. ARGV: owner, ttl_ms, horizon_ms, the horizon the holder
# was given last. Returns {horizon, TIME's seconds, TIME's microseconds, the meta id}; false
# when another owner took the id; {-1, stored horizon} when the stored horizon is below the
# holder's (the store lost data). A lease that expired but that nobody took since (the hash
# still names us) is taken back: no one else can have issued ids under it in between.
_RENEW = """
local current = redis.call('GET', KEYS[1])
local lapsed = current == false and redis.call('HGET', KEYS[2], 'owner') == ARGV[1]
if current ~= ARGV[1] and not lapsed then return false end
local horizon = redis.call('HGET', KEYS[2], 'horizon') or '0'
if tonumber(horizon) < tonumber(ARGV[4]) then return {-1, horizon} end
if lapsed then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if tonumber(ARGV[3]) > tonumber(horizon) then
    horizon = ARGV[3]
    redis.call('HSET', KEYS[2], 'horizon', horizon)
end
local meta = redis.call('HGET', KEYS[3], 'id') or ''
local now = redis.call('TIME')
return {horizon, now[1], now[2], meta}
"""

# KEYS: lease, horizon hash. ARGV: owner, the lowered horizon or "". Acts only while the hash
# still names us (nobody took the id since); clearing its owner stops a later renew of the
# released lease from taking the id back.
_RELEASE = """
local ours = redis.call('HGET', KEYS[2], 'owner') == ARGV[1]
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1])
    ours = true
end
if ours then
    redis.call('HSET', KEYS[2], 'owner', '')
    if ARGV[2] ~= '' then redis.call('HSET', KEYS[2], 'horizon', ARGV[2]) end
end
return 0
"""


def _glob_escape(text: str) -> str:
    """`text` as a literal inside a SCAN MATCH pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class RedisLeaseStore:
    """A LeaseStore on one Redis server (or a primary), under one key prefix."""

    def __init__(
        self,
        client: redis_py.Redis,
        prefix: str,
        display_url: str,
        errors: tuple[type[Exception], ...],
        *,
        timeout: float,
        unsafe_replication: bool = False,
        gap: int = FAILOVER_GAP,
    ) -> None:
        self.display_url = display_url
        self._client = client
        self._prefix = prefix
        self._errors = errors  # redis-py's exceptions, imported lazily with the driver
        self._meta = client.register_script(_META)
        self._acquire = client.register_script(guarded(_ACQUIRE))
        self._renew = client.register_script(guarded(_RENEW))
        self._release = client.register_script(guarded(_RELEASE))
        self._failover = RedisFailover(
            client,
            prefix,
            display_url,
            self._call,
            client.register_script(_SWAP),
            timeout=timeout,
            unsafe=unsafe_replication,
            gap=gap,
        )

    def identity(self) -> StoreIdentity | None:
        """The identity under this prefix, made on first use."""
        meta = f"{self._prefix}:meta"
        got = self._call(lambda: self._meta(keys=[meta], args=[uuid.uuid4().hex]))
        store_id, created_ms = cast(list[str], got)
        return StoreIdentity(store_id, int(created_ms))

    def _keys(self, namespace: str, worker_id: int) -> list[str]:
        return [
            f"{self._prefix}:w:{namespace}:{worker_id}",
            f"{self._prefix}:h:{namespace}:{worker_id}",
        ]

    def _call(self, op: Callable[[], T]) -> T:
        try:
            return op()
        except self._errors as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise StoreUnavailable(f"store {self.display_url} unavailable: {reason}") from exc

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
        if worker_id is not None:
            check_claim(worker_id, workers)
        made = self.identity()  # made before the lease, on a new store
        assert made is not None
        owner = uuid.uuid4().hex
        args: list[str | int] = [
            self._prefix,
            namespace,
            workers,
            owner,
            holder_name(),
            _ms(ttl),
            horizon_ms,
            "" if now_ms is None else now_ms,
            "" if worker_id is None else worker_id,
        ]
        got = self._failover.write(self._acquire, [], args)
        if not got:
            raise WorkersExhausted(namespace, workers)
        answer = cast(list[Any], got)
        if int(answer[0]) < 0:
            assert worker_id is not None
            pttl = int(answer[2])
            raise WorkerInUse(
                namespace, worker_id, str(answer[1]), pttl / 1000 if pttl >= 0 else None
            )
        chosen, floor, horizon, seconds, micros = (int(v) for v in answer[:5])
        if answer[5] != made.id:  # wiped between the two calls: ask again
            raise StoreUnavailable(f"store {self.display_url} lost its data during an acquire")
        identity = StoreIdentity(made.id, int(answer[6]))  # its created_ms after the write
        return Lease(
            namespace,
            chosen,
            owner,
            floor,
            horizon,
            ttl,
            store_ms=_unix_ms(seconds, micros),
            store_id=identity.id,
            store_created_ms=identity.created_ms,
            static=worker_id is not None,
        )

    def renew(self, lease: Lease, horizon_ms: int) -> Lease:
        keys = [*self._keys(lease.namespace, lease.worker_id), f"{self._prefix}:meta"]
        args: list[str | int] = [lease.owner, _ms(lease.ttl), horizon_ms, lease.horizon_ms]
        got = self._failover.write(self._renew, keys, args)
        if got is None:
            raise LeaseLost(
                f"worker {lease.worker_id} of namespace {lease.namespace!r} has another owner"
            )
        answer = cast(list[Any], got)
        if int(answer[0]) < 0:
            raise forgotten(lease, int(answer[1]))
        horizon, seconds, micros = (int(v) for v in answer[:3])
        return replace(
            lease,
            horizon_ms=horizon,
            store_ms=_unix_ms(seconds, micros),
            store_id=str(answer[3]) or None,
        )

    def release(self, lease: Lease, issued_ms: int | None = None) -> None:
        keys = self._keys(lease.namespace, lease.worker_id)
        down = "" if issued_ms is None else str(max(lease.floor_ms, issued_ms))
        self._failover.write(self._release, keys, [lease.owner, down])

    def holders(self, namespace: str) -> list[WorkerInfo]:
        head = f"{self._prefix}:h:{namespace}:"

        def body() -> list[WorkerInfo]:
            ids = sorted(
                int(rest)
                for key in self._client.scan_iter(match=_glob_escape(head) + "*", count=1000)
                # the pattern also matches longer namespaces that start with this one
                if is_digits(rest := cast(str, key)[len(head) :])
            )
            pipe = self._client.pipeline(transaction=True)  # one consistent snapshot
            for worker_id in ids:
                lease, hkey = self._keys(namespace, worker_id)
                pipe.get(lease)
                pipe.pttl(lease)
                pipe.hmget(hkey, ["horizon", "host", "static"])
            replies = pipe.execute()
            rows = []
            for i, worker_id in enumerate(ids):
                owner, pttl, (horizon, host, static) = replies[3 * i : 3 * i + 3]
                live = owner is not None and int(pttl) >= 0
                rows.append(
                    WorkerInfo(
                        namespace,
                        worker_id,
                        str(owner) if live else "",
                        str(host or ""),
                        int(pttl) / 1000 if live else None,
                        int(horizon or 0),
                        static=static == "1",
                    )
                )
            return rows

        return self._call(body)

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        hkey = self._keys(namespace, worker_id)[1]
        return bool(self._call(lambda: self._client.hdel(hkey, "static")))

    def close(self) -> None:
        self._client.close()


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

# KEYS: the cell. ARGV: the version as read, the new value. The new version, or 0 when the
# cell is gone or has another version. Versions are compared as the strings HINCRBY wrote.
_SWAP = """
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'value', ARGV[2])
return redis.call('HINCRBY', KEYS[1], 'version', 1)
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
        self._meta = client.register_script(_META)
        self._create = client.register_script(guarded(_CREATE))
        self._swap = client.register_script(guarded(_SWAP))
        self._scan = client.register_script(_SCAN)
        self._checked = False  # the server's persistence settings were looked at
        self.failover = RedisFailover(
            client,
            prefix,
            display_url,
            lambda op: self._call(op, idempotent=False),
            client.register_script(_SWAP),  # the fence's: past the guard
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


def _unix_ms(seconds: int, micros: int) -> int:
    """Unix milliseconds from the two halves of Redis's TIME."""
    return seconds * 1000 + micros // 1000


def _ms(ttl: float) -> int:
    return max(1, round(ttl * 1000))


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
