"""Worker-id leases on Redis (the keys, and why each operation is one Lua script: the engine's
doc in __init__.py). The worker-choice rule's Lua copy is checked against
`leasing.choose_worker` by tests/test_leasing.py."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ..._errors import LeaseLost, StoreUnavailable, WorkerInUse, WorkersExhausted
from ...ids import is_digits
from ..base import Lease, StoreIdentity, WorkerInfo, check_claim, forgotten
from ..leasing import holder_name
from ..replication import FAILOVER_GAP
from .acl import describe
from .cas import META_SCRIPT, SWAP_SCRIPT
from .failover import RedisFailover, guarded

if TYPE_CHECKING:
    import redis as redis_py

T = TypeVar("T")

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
        fewer_replicas: bool = False,
    ) -> None:
        self.display_url = display_url
        self._client = client
        self._prefix = prefix
        self._errors = errors  # redis-py's exceptions, imported lazily with the driver
        self._meta = client.register_script(META_SCRIPT)
        self._acquire = client.register_script(guarded(_ACQUIRE))
        self._renew = client.register_script(guarded(_RENEW))
        self._release = client.register_script(guarded(_RELEASE))
        self._failover = RedisFailover(
            client,
            prefix,
            display_url,
            self._call,
            client.register_script(SWAP_SCRIPT),
            timeout=timeout,
            unsafe=unsafe_replication,
            gap=gap,
            fewer=fewer_replicas,
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
            raise StoreUnavailable(describe(exc, self.display_url)) from exc

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


def _unix_ms(seconds: int, micros: int) -> int:
    """Unix milliseconds from the two halves of Redis's TIME."""
    return seconds * 1000 + micros // 1000


def _ms(ttl: float) -> int:
    return max(1, round(ttl * 1000))
