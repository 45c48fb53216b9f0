"""Redis behind replicas: every write reaches them before it counts, and a failover is fenced
before anything is written on the new primary (issue 20).

Every writing script of a store (cells, leases) runs behind GUARD, which reads, in the same
atomic step as the write, the server's replication (INFO replication: `master_replid`,
`connected_slaves`) and the lineage the prefix recorded, `{prefix}:lineage`, a hash of:

- `replid`: the replication id of the primary the prefix last wrote on. Redis makes a new one
  when a replica is promoted, and also when a server restarts;
- `replicas`: the most replicas any write under that replid was made with. A write is
  answered only once that many replicas confirmed it (WAIT), so a fresh process, or one that
  saw the replica drop off, never writes past a replica that lags; a write they did not
  confirm in time is StoreUnavailable (applied here, maybe not there: never served).

The guard answers:

- the same replid: the write goes ahead; the reply carries how many replicas to wait for;
- another replid, and no write under the old one was ever made with a replica: a restart of
  a server without replicas (its own fsynced append-only file holds every write). The new
  replid is recorded and the write goes ahead;
- another replid after writes made with replicas: a failover (or a restart of a replicated
  primary: the two look alike, and fencing a restart only costs a gap). Nothing is written;
  the process that sees it fences the prefix (`RedisFailover.fence`), under a lock key, with
  scripts that bypass the guard: every counter kept in a cell (segment keys and their
  stripes, datacenter keys: stores/fences.py) moves up the gap, the store's life starts again
  (its identity's created_ms: snowflake holders wait a ttl past it, as on a store that lost
  its data), and only then is the new replid recorded, which lets writes through again. A
  fence cut short is redone whole by the next process (keys then skip two gaps: never fewer).

Since every served write waited for the replicas, a promoted replica lacks none of them: the
fence is the second line, for what waits cannot cover (`?unsafe_replication=1`, which skips
the waits; a replica removed from the count by hand; a failover chosen by an operator to a
replica that was not connected).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar, cast

from ..._errors import StoreUnavailable
from .. import fences
from .._once import Once
from ..replication import note_failover

log = logging.getLogger(__name__)
_warned = Once()  # stores whose unsafe replication was logged

T = TypeVar("T")

#: How long a fencing process holds the fence lock (ms): a process killed while fencing
#: blocks the prefix's writes at most this long, then the next one fences again.
FENCE_LOCK_MS = 30_000

# The guard and the wrapped script's body, run as one script: KEYS[#KEYS] is the lineage
# hash. Answers {need, the body's answer} or {'failover', recorded replid, current replid}.
# INFO comes before the writes: replicate the script's effects (the default from Redis 5).
_GUARD = """
if redis.replicate_commands then redis.replicate_commands() end
local lineage = KEYS[#KEYS]
local info = redis.call('INFO', 'replication')
local replid = string.match(info, 'master_replid:(%%x+)') or ''
local connected = tonumber(string.match(info, 'connected_slaves:(%%d+)') or '0')
local recorded = redis.call('HMGET', lineage, 'replid', 'replicas')
local replicas = tonumber(recorded[2] or '0')
if recorded[1] and recorded[1] ~= replid then
    if replicas > 0 then return {'failover', recorded[1], replid} end
    replicas = 0
end
local need = math.max(connected, replicas)
if recorded[1] ~= replid or need > replicas then
    redis.call('HSET', lineage, 'replid', replid, 'replicas', need)
end
local function body()
%s
end
return {need, body()}
"""

# KEYS: the lineage hash. ARGV: the recorded replid the fence started from. Records the
# current replid (and the replicas connected now) if nobody did since; the fences so far.
_RECORD = """
if redis.replicate_commands then redis.replicate_commands() end
local info = redis.call('INFO', 'replication')
local replid = string.match(info, 'master_replid:(%x+)') or ''
local connected = string.match(info, 'connected_slaves:(%d+)') or '0'
if redis.call('HGET', KEYS[1], 'replid') == ARGV[1] then
    redis.call('HSET', KEYS[1], 'replid', replid, 'replicas', connected)
    return redis.call('HINCRBY', KEYS[1], 'fences', 1)
end
return tonumber(redis.call('HGET', KEYS[1], 'fences') or '0')
"""

# KEYS: the store's identity (meta hash). Its life starts again now (TIME): see _new_life.
_NEW_LIFE = """
if redis.replicate_commands then redis.replicate_commands() end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local now = redis.call('TIME')
local ms = now[1] .. string.format('%03d', math.floor(tonumber(now[2]) / 1000))
redis.call('HSET', KEYS[1], 'created_ms', ms)
return 1
"""

# KEYS: the fence lock. ARGV: this fencer's token. Deletes the lock only if it is still ours.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def guarded(body: str) -> str:
    """A writing script's text behind the guard (see the module doc): its KEYS gain the
    lineage hash as their last, and it answers {need, what the body answers}."""
    return _GUARD % body


class RedisFailover:
    """The guard's other half for one prefix on one Redis: waits for the replicas each
    guarded write names, and fences a failover (see the module doc)."""

    def __init__(
        self,
        client: Any,
        prefix: str,
        display_url: str,
        call: Callable[[Callable[[], Any]], Any],
        swap: Any,
        *,
        timeout: float,
        unsafe: bool,
        gap: int,
    ) -> None:
        self.display_url = display_url
        self.lineage_key = f"{prefix}:lineage"
        self._client = client
        self._prefix = prefix
        self._call = call  # the store's call: driver errors as StoreUnavailable
        self._swap = swap  # the store's unguarded cell swap (a registered script)
        self._timeout = timeout
        self.unsafe = unsafe
        self._gap = gap
        self._record = client.register_script(_RECORD)
        self._new_life = client.register_script(_NEW_LIFE)
        self._unlock = client.register_script(_UNLOCK)
        #: Replicas the last write waited for: the next write's WAIT goes in its round trip.
        self._expected = 0

    def write(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run a guarded script and wait for the replicas it names; fence a failover it
        reports, then run it once more. Returns what the script's body answered."""
        keys = [*keys, self.lineage_key]
        for _ in (1, 2):
            answer, acks = self._send(script, keys, args)
            if answer[0] == "failover":
                self.fence(str(answer[1]), str(answer[2]))
                continue
            need = int(answer[0])
            if self.unsafe:
                if need:
                    self._warn_unsafe(need)
                return answer[1] if len(answer) > 1 else None
            if need > self._expected or (need and acks is None):
                wait = partial(self._client.execute_command, "WAIT", need, self._wait_ms)
                acks = self._call(wait)
            self._expected = need
            if need and int(acks) < need:
                raise StoreUnavailable(
                    f"store {self.display_url}: a write reached {acks} of {need} replica(s) "
                    f"within {self._wait_ms} ms; not used (a failover could undo it). If a "
                    f"replica was removed for good: HSET {self.lineage_key} replicas "
                    "<the replicas left> (docs/stores.md)"
                )
            return answer[1] if len(answer) > 1 else None
        raise StoreUnavailable(f"store {self.display_url}: its primary kept changing")

    def _warn_unsafe(self, replicas: int) -> None:
        if not _warned.first(self.display_url):
            return
        log.warning(
            "store %s: %d replica(s) and writes do not wait for them (unsafe_replication): a "
            "failover to one that lags loses acknowledged ranges; the fence moves keys %d ids "
            "past them, which holds only while fewer ids are handed out in the replication lag",
            self.display_url,
            replicas,
            self._gap,
        )

    @property
    def _wait_ms(self) -> int:
        return max(1, int(self._timeout * 500))  # half the store timeout: the socket's is whole

    def _send(self, script: Any, keys: list[str], args: list[Any]) -> tuple[list[Any], Any]:
        """The script's answer, and the replicas that confirmed it when a WAIT for as many as
        the last write needed went in the same round trip (else None)."""
        expected = 0 if self.unsafe else self._expected
        if not expected:
            return cast(list[Any], self._call(lambda: script(keys=keys, args=args))), None

        def write_and_wait() -> list[Any]:
            pipe: Any = self._client.pipeline(transaction=False)
            script(keys=keys, args=args, client=pipe)
            pipe.execute_command("WAIT", expected, self._wait_ms)
            return list(pipe.execute())

        answer, acks = self._call(write_and_wait)
        return cast(list[Any], answer), acks

    def fence(self, recorded: str, current: str) -> None:
        """Move every counter past what the old primary may have handed out and start the
        store's life again, then record the new primary (see the module doc).
        StoreUnavailable while another process is fencing."""
        lock, token = f"{self._prefix}:fencing", uuid.uuid4().hex
        got = self._call(lambda: self._client.set(lock, token, nx=True, px=FENCE_LOCK_MS))
        if not got:
            raise StoreUnavailable(
                f"store {self.display_url}: another process is fencing a failover; try again"
            )
        try:
            keys = self._fence_cells()
            # The store's life starts again: snowflake holders wait a ttl past it (the old
            # primary may have renewed leases the new one never saw, or made new ones).
            self._call(partial(self._new_life, keys=[f"{self._prefix}:meta"], args=[]))
            fences = self._call(lambda: self._record(keys=[self.lineage_key], args=[recorded]))
        finally:
            self._call(lambda: self._unlock(keys=[lock], args=[token]))
        log.error(
            "store %s: FAILOVER: the primary's replication id is %s, the store recorded %s: "
            "another server became the primary (or a replicated primary restarted), and may "
            "lack the last ranges and leases. Fenced: %d key cell(s) moved up %d ids; snowflake "
            "holders wait a lease ttl before their first id (fence %s of this store)",
            self.display_url,
            current,
            recorded,
            keys,
            self._gap,
            fences,
        )
        note_failover(self.display_url, recorded, current)

    def _fence_cells(self) -> int:
        """Every cell holding a counter (stores/fences.py: segment and datacenter keys) moved
        up the gap; how many."""
        if not self._gap:
            return 0
        moved = 0
        for prefix in fences.prefixes():
            low, high = "[" + prefix, "(" + prefix + "\xff"
            index = f"{self._prefix}:cells"
            names = self._call(partial(self._client.zrangebylex, index, low, high))
            for name in names:
                moved += self._fence_cell(name)
        return moved

    def _fence_cell(self, name: str) -> int:
        cell = f"{self._prefix}:c:{name}"
        for _ in range(10):  # only another fencer (past the lock's time) swaps meanwhile
            value, version = self._call(partial(self._client.hmget, cell, "value", "version"))
            if value is None or version is None:
                return 0
            up = fences.fenced(name, value, self._gap)
            if up is None or up == value:
                return 0
            if self._call(partial(self._swap, keys=[cell], args=[version, up])):
                return 1
        raise StoreUnavailable(f"store {self.display_url}: could not fence {name!r}")
