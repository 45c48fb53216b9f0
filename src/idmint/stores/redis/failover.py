"""Redis behind replicas: every write reaches them before it counts, and a failover is fenced
before anything is written on the new primary (issue 20).

Every writing script of a store (cells, leases) runs behind GUARD, which reads, in the same
atomic step as the write, the server's replication (INFO replication: `master_replid`,
`connected_slaves`) and the lineage the prefix recorded, `{prefix}:lineage`, a hash of:

- `replid`: the replication id of the primary the prefix last wrote on. Redis makes a new one
  when a replica is promoted, and also when a server restarts;
- `replicas`: the most replicas that confirmed one write under that replid (WAIT's answer).
  A write is answered only once that many replicas confirmed it, so a fresh process, or one
  that saw the replica drop off, never writes past a replica that lags; a write they did not
  confirm in time is StoreUnavailable (applied here, maybe not there: never served). It
  counts confirmations, not the replicas INFO lists online: a replica that reconnected
  through another address is listed twice until the primary drops its old link (up to
  repl-timeout when that link is cut), and a requirement raised to such a list waits for a
  replica that does not exist, for good (torture seed 1939120558). The guard itself raises it
  from none to one, in the write, as soon as a replica is online: the first replica is
  waited for from then on, even while it loads its first copy.

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

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from ..._errors import StoreUnavailable
from .. import fences
from .._once import Once
from ..replication import note_failover

log = logging.getLogger(__name__)
_warned = Once()  # stores whose unsafe replication was logged

T = TypeVar("T")

#: A replica online past the requirement is given this long (ms) to confirm a write, at
#: most once per CONFIRM_EVERY seconds per process (RedisFailover._ask_the_others).
CONFIRM_MS = 100
CONFIRM_EVERY = 1.0

#: How long a fencing process holds the fence lock (ms): a process killed while fencing
#: blocks the prefix's writes at most this long, then the next one fences again.
FENCE_LOCK_MS = 30_000

# The guard and the wrapped script's body, run as one script: KEYS[#KEYS] is the lineage
# hash, ARGV[#ARGV - 1] '1' when writes may go on with fewer replicas than the prefix has
# waited for, ARGV[#ARGV] the request's token. Answers the token, then {need, replicas
# online, the body's answer}, {'failover', recorded replid, current replid} or {'fewer',
# replicas online, replicas required}; `need` is the requirement (what the write must be
# confirmed by), or the replicas online when fewer are accepted. The token: an answer is
# never taken for another request's (RedisFailover._send). Only replicas online count: one
# still in its first sync acknowledges nothing yet, and no failover manager promotes it. One
# online but still loading the copy it was sent (the primary lists it online once the copy
# is sent) counts: a write made meanwhile reaches it only after its load, so writes wait for
# it (and fail while it loads) rather than go on without it. A replica answers READONLY at once.
# INFO comes before the writes: replicate the script's effects (the default from Redis 5). An
# ACL that refuses INFO refuses every write, saying so (NOPERM): nothing else shows a failover.
_GUARD = """
if redis.replicate_commands then redis.replicate_commands() end
local lineage = KEYS[#KEYS]
local info = redis.pcall('INFO', 'replication')
if type(info) == 'table' and info.err then
    return redis.error_reply('NOPERM the replication guard may not run INFO (idmint reads ' ..
        'INFO replication before each write to see a failover): ' .. info.err)
end
if string.find(info, 'role:slave', 1, true) then
    return redis.error_reply('READONLY this server is a replica: idmint writes on the primary ' ..
        'only (give its address, or a redis+sentinel:// URL)')
end
local replid = string.match(info, 'master_replid:(%%x+)') or ''
local online = 0
for _ in string.gmatch(info, 'slave%%d+:[^\\r\\n]*state=online') do online = online + 1 end
local recorded = redis.call('HMGET', lineage, 'replid', 'replicas')
local replicas = tonumber(recorded[2] or '0')
if recorded[1] and recorded[1] ~= replid then
    if replicas > 0 then return {ARGV[#ARGV], 'failover', recorded[1], replid} end
end
if online < replicas and ARGV[#ARGV - 1] ~= '1' then
    return {ARGV[#ARGV], 'fewer', online, replicas}
end
local required = replicas
if online > 0 and replicas == 0 then required = 1 end
if recorded[1] ~= replid or required ~= replicas then
    redis.call('HSET', lineage, 'replid', replid, 'replicas', required)
end
local function body()
%s
end
return {ARGV[#ARGV], math.min(required, online), online, body()}
"""

# KEYS: the lineage hash. ARGV: the recorded replid the fence started from. Records the
# current replid if nobody did since, keeping the requirement (a fence never lowers it: a
# promoted primary alone must not serve, nor an old primary restarted alone); the fences so
# far, or -1 when another process had recorded it (and fenced) already. ARGV[1] '': the
# requirement was lowered, which fences whatever replid was recorded.
_RECORD = """
if redis.replicate_commands then redis.replicate_commands() end
local info = redis.call('INFO', 'replication')
local replid = string.match(info, 'master_replid:(%x+)') or ''
if ARGV[1] == '' or redis.call('HGET', KEYS[1], 'replid') == ARGV[1] then
    redis.call('HSET', KEYS[1], 'replid', replid)
    return redis.call('HINCRBY', KEYS[1], 'fences', 1)
end
return -1
"""

# KEYS: the lineage hash. ARGV: how many replicas confirmed a write made on this server.
# Raises the requirement to that, if the lineage is still this server's (its replid
# recorded); answers 1 when it did. Not behind the guard: it writes only the lineage.
_CONFIRMED = """
if redis.replicate_commands then redis.replicate_commands() end
local info = redis.call('INFO', 'replication')
if string.find(info, 'role:slave', 1, true) then return 0 end
local replid = string.match(info, 'master_replid:(%x+)') or ''
if redis.call('HGET', KEYS[1], 'replid') ~= replid then return 0 end
if tonumber(redis.call('HGET', KEYS[1], 'replicas') or '0') >= tonumber(ARGV[1]) then
    return 0
end
redis.call('HSET', KEYS[1], 'replicas', ARGV[1])
return 1
"""

# KEYS: the lineage hash. ARGV: the requirement. Sets it; answers the one it replaced.
_SET_REQUIRED = """
if redis.replicate_commands then redis.replicate_commands() end
local old = tonumber(redis.call('HGET', KEYS[1], 'replicas') or '0')
redis.call('HSET', KEYS[1], 'replicas', ARGV[1])
return old
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


def no_script_error() -> type[Exception]:
    """redis-py's NoScriptError (EVALSHA of a script the server has not cached: a new or
    restarted server), imported when first needed: the driver is optional."""
    from redis.exceptions import NoScriptError

    return NoScriptError


def _out_of_step(reply: Any) -> Exception:
    from redis.exceptions import ConnectionError as BrokenConnection

    return BrokenConnection(f"a reply out of step on the connection ({str(reply)[:60]!r})")


def _answer(reply: Any, token: str) -> list[Any]:
    """A guarded script's answer without its token; a broken connection if it carries
    another request's token, or is not a script's answer at all."""
    if not isinstance(reply, list) or not reply or reply[0] != token:
        raise _out_of_step(reply)
    return reply[1:]


def _count(reply: Any) -> int:
    """WAIT's answer; a broken connection if the reply is not a count."""
    if not isinstance(reply, int):
        raise _out_of_step(reply)
    return reply


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
        fewer: bool = False,
    ) -> None:
        self.display_url = display_url
        self.lineage_key = f"{prefix}:lineage"
        self._client = client
        self._prefix = prefix
        self._call = call  # the store's call: driver errors as StoreUnavailable
        self._swap = swap  # the store's unguarded cell swap (a registered script)
        self._timeout = timeout
        self.unsafe = unsafe
        #: Writes go on with fewer replicas than the prefix has waited for (the URL's
        #: fewer_replicas; unsafe_replication implies it: its writes wait for none).
        self.fewer = fewer or unsafe
        self._gap = gap
        self._record = client.register_script(_RECORD)
        self._new_life = client.register_script(_NEW_LIFE)
        self._unlock = client.register_script(_UNLOCK)
        self._set_required = client.register_script(_SET_REQUIRED)
        self._confirmed = client.register_script(_CONFIRMED)
        #: Replicas the last write waited for: the next write's WAIT goes in its round trip.
        self._expected = 0
        #: When a replica online past the requirement was last given time to confirm a write
        #: (monotonic): at most once a CONFIRM_EVERY, so a replica listed but silent (an old
        #: link not yet dropped) costs writes little.
        self._asked_at = -CONFIRM_EVERY

    def write(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run a guarded script and wait for the replicas it names; fence a failover it
        reports, then run it once more. Returns what the script's body answered."""
        keys = [*keys, self.lineage_key]
        args = [*args, "1" if self.fewer else "0"]
        for _ in (1, 2):
            token = os.urandom(8).hex()
            answer, acks = self._call(partial(self._send, script, keys, [*args, token], token))
            if answer[0] == "failover":
                self.fence(str(answer[1]), str(answer[2]))
                continue
            if answer[0] == "fewer":
                raise StoreUnavailable(
                    f"store {self.display_url}: {answer[1]} replica(s) online and the store "
                    f"has waited for {answer[2]}: a failback to an older copy, or the loss of "
                    "this one, could repeat ids. Writes resume when a replica is back online; "
                    "if one is gone for good, lower the requirement with `idmint replicas "
                    "--set N --yes` (docs/stores.md)"
                )
            need, online = int(answer[0]), int(answer[1])
            body = answer[2] if len(answer) > 2 else None
            if self.unsafe:
                if online:
                    self._warn_unsafe(online)
                return body
            self._expected = need
            if need and acks < need:
                raise StoreUnavailable(
                    f"store {self.display_url}: a write reached {acks} of {need} replica(s) "
                    f"within {self._wait_ms} ms; not used (a failover could undo it). If a "
                    "replica was removed for good: `idmint replicas --set N --yes` "
                    "(docs/stores.md)"
                )
            if acks > need:  # more replicas confirmed it than the requirement counts
                # The write stands either way: a raise that fails is made by a later write
                # those replicas confirm (the requirement only counts them from then on).
                with contextlib.suppress(StoreUnavailable):
                    self._call(partial(self._confirmed, keys=[self.lineage_key], args=[acks]))
            return body
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

    def _send(
        self, script: Any, keys: list[str], args: list[Any], token: str
    ) -> tuple[list[Any], int]:
        """The script's answer (its token taken off), and how many replicas confirmed it (0
        when none was asked to), on ONE connection: WAIT counts the replicas that have the
        writes of the connection it is sent on, so on another pooled connection (one that
        wrote nothing since) it would answer at once. A WAIT for as many replicas as the last
        write needed goes in the same round trip; another follows only when the script asks
        for more. A reply out of step (left on a pooled connection by a request that gave
        up on it, and come after redis-py's check for unread data: torture seed 13 of
        redis-replica, where the next write read it and died on a TypeError) is a broken
        connection, never another request's answer taken for this one's."""
        expected = 0 if self.unsafe else self._expected
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            commands: list[tuple[Any, ...]] = [("EVALSHA", script.sha, len(keys), *keys, *args)]
            if expected:
                commands.append(("WAIT", expected, self._wait_ms))
            replies = self._exchange(conn, commands)
            if isinstance(replies[0], no_script_error()):  # not cached on this server yet
                commands[0] = ("EVAL", script.script, len(keys), *keys, *args)
                replies = self._exchange(conn, commands)
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            answer = _answer(replies[0], token)
            acks = _count(replies[1]) if expected else 0
            if self.unsafe or answer[0] in ("failover", "fewer"):
                return answer, acks
            need, online = int(answer[0]), int(answer[1])
            if need > expected:
                acks = self._wait(conn, need, self._wait_ms)
            if acks >= need and online > acks:
                acks = max(acks, self._ask_the_others(conn, online))
            return answer, acks
        except BaseException:
            conn.disconnect()  # replies may be left unread on it
            raise
        finally:
            pool.release(conn)

    def _ask_the_others(self, conn: Any, online: int) -> int:
        """How many replicas confirmed the connection's writes when those online past the
        ones that did are given CONFIRM_MS (once a CONFIRM_EVERY; 0 in between): a new
        replica is counted by the requirement from its first confirmation on."""
        now = time.monotonic()
        if now - self._asked_at < CONFIRM_EVERY:
            return 0
        self._asked_at = now
        return self._wait(conn, online, min(CONFIRM_MS, self._wait_ms))

    @staticmethod
    def _wait(conn: Any, replicas: int, ms: int) -> int:
        """WAIT on `conn`: the replicas that have its writes once `replicas` do, or `ms`."""
        conn.send_command("WAIT", replicas, ms)
        return _count(conn.read_response())

    @staticmethod
    def _exchange(conn: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send `commands` in one round trip; their replies, an error reply as its exception
        (every reply is read, so the connection stays in step)."""
        from redis.exceptions import ResponseError

        conn.send_packed_command(conn.pack_commands(commands))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies

    def set_required(self, replicas: int) -> int:
        """Set how many replicas every write must wait for (`idmint replicas --set`); the
        requirement it replaces. Lowering it fences the prefix as a failover does (see
        SqlConnection.set_required for why)."""
        old = int(self._call(lambda: self._set_required(keys=[self.lineage_key], args=[replicas])))
        if replicas < old:
            self._fence_under_lock(f"{old} replica(s)", f"{replicas} replica(s)", None)
        return old

    def fence(self, recorded: str, current: str) -> None:
        """Move every counter past what the old primary may have handed out and start the
        store's life again, then record the new primary (see the module doc). Done once per
        failover: a process that takes the lock after another fenced finds the new replid
        recorded and does nothing. StoreUnavailable while another process is fencing."""
        self._fence_under_lock(recorded, current, recorded)

    def _fence_under_lock(self, recorded: str, current: str, replid: str | None) -> None:
        """The fence's work under the prefix's fence lock. `replid`: the recorded replid the
        failover was seen against (None: the operator lowered the requirement)."""
        lock, token = f"{self._prefix}:fencing", uuid.uuid4().hex
        got = self._call(lambda: self._client.set(lock, token, nx=True, px=FENCE_LOCK_MS))
        if not got:
            raise StoreUnavailable(
                f"store {self.display_url}: another process is fencing a failover; try again"
            )
        try:
            if replid is not None:
                now = self._call(partial(self._client.hget, self.lineage_key, "replid"))
                if now != replid:
                    return  # another process fenced this failover already
            keys = self._fence_cells()
            # The store's life starts again: snowflake holders wait a ttl past it (the old
            # primary may have renewed leases the new one never saw, or made new ones).
            self._call(partial(self._new_life, keys=[f"{self._prefix}:meta"], args=[]))
            args = [replid or ""]  # "": the requirement lowered
            fences = self._call(lambda: self._record(keys=[self.lineage_key], args=args))
        finally:
            self._call(lambda: self._unlock(keys=[lock], args=[token]))
        log.error(
            "store %s: FAILOVER: %s, the store recorded %s: another server became the "
            "primary (or a replicated primary restarted, or the replica requirement was "
            "lowered), and may lack the last ranges and leases. Fenced: %d key cell(s) moved "
            "up %d ids; new snowflake holders wait out the longest lease ttl before their first "
            "id (fence %s of this store)",
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
