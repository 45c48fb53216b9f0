"""A quorum node on Redis: a key's counter is the string `{prefix}:q:{key}`, claimed by one
Lua script (atomic on the server).

A quorum key is only as safe as its nodes' memory: a node that restarts without a claim it
acknowledged lets a later round take those ids again. Redis keeps an acknowledged write
through a crash of the machine only with `appendonly yes` and `appendfsync always`, so
`durability()` reads CONFIG GET and names anything weaker; the strategy refuses such nodes
unless the caller opts in to being unsafe. Likewise a node must be independent: a replica
promoted by a failover may lack the last claims, so `replication()` reads INFO replication and
the strategy refuses a replica, and a primary with replicas unless the caller opts in.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ..._errors import InvalidArgument, StoreUnavailable
from ..._fork import orphan
from ..base import StoreIdentity
from ..replication import ReplicationState, redis_state
from .acl import describe
from .cas import RedisCasStore, weak_persistence
from .failover import no_script_error

T = TypeVar("T")

# KEYS[1] the counter; ARGV[1] start, ARGV[2] end, ARGV[3] limit, ARGV[4] the count of ids
# (end - start + 1): decimal integers without leading zeros, compared as text (length first,
# then digits) and added digit by digit, so counters past 2^53 (where Lua's numbers lose
# precision) come out exact. Below `start` the counter is set to `end`; else, while the counter
# is below `limit`, the range is placed just above it (the counter moves up by the count), so
# its start is at most `limit`. Answers {1, the range's end} when it moved the counter, else
# {0, counter}; then the claim's start, so that an answer is never taken for another claim's.
# A limit equal to start is the exact claim of QuorumNode.claim. (The addition is done here,
# not with INCRBY: the ACL rule of idmint's user, docs/stores.md, grants no INCRBY.)
_CLAIM = """
local function below(a, b)
    return #a < #b or (#a == #b and a < b)
end
local function plus(a, b)
    local digits, carry, i, j = {}, 0, #a, #b
    while i > 0 or j > 0 or carry > 0 do
        local d = carry + (i > 0 and a:byte(i) - 48 or 0) + (j > 0 and b:byte(j) - 48 or 0)
        digits[#digits + 1] = d % 10
        carry = (d - d % 10) / 10
        i, j = i - 1, j - 1
    end
    return string.reverse(table.concat(digits))
end
local current = redis.call('GET', KEYS[1]) or '0'
local start = ARGV[1]
if below(current, start) then
    redis.call('SET', KEYS[1], ARGV[2])
    return {1, ARGV[2], start}
end
if below(current, ARGV[3]) then
    local moved = plus(current, ARGV[4])
    redis.call('SET', KEYS[1], moved)
    return {1, moved, start}
end
return {0, current, start}
"""


# A claim on the multiplexed connection, as RESP: EVAL, the script, one key, then the key's
# counter, start, end, limit and count as bulk strings (see send_claim).
_EVAL_HEAD = b"*8\r\n$4\r\nEVAL\r\n$%d\r\n%s\r\n$1\r\n1\r\n" % (
    len(_CLAIM.encode()),
    _CLAIM.encode(),
)


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def parse_claim_answer(data: bytes) -> tuple[bool, int, int] | None:
    """The script's answer {applied, counter, start} in `data` (RESP 2 or 3: an array of an
    integer and two bulk strings), or None while part of it has still to come. A Redis error
    reply raises StoreUnavailable with its text; anything else, or bytes past the answer
    (there is one claim outstanding at a time), raises ValueError."""
    if not data.endswith(b"\r\n"):
        return None
    lines = data.split(b"\r\n")
    lines.pop()  # after the last CRLF
    if lines[0][:1] == b"-":
        raise StoreUnavailable(lines[0][1:].decode(errors="replace"))
    if lines[0] != b"*3":
        raise ValueError(f"not the claim script's answer: {data[:80]!r}")
    values: list[int] = []
    i = 1
    while i < len(lines) and len(values) < 3:
        kind = lines[i][:1]
        if kind == b":":
            values.append(int(lines[i][1:]))
            i += 1
        elif kind == b"$" and i + 1 < len(lines):
            values.append(int(lines[i + 1]))
            i += 2
        elif kind == b"$":
            return None
        else:
            raise ValueError(f"not the claim script's answer: {data[:80]!r}")
    if len(values) < 3:
        return None
    if i != len(lines):
        raise ValueError(f"bytes past the claim's answer: {data[:80]!r}")
    return bool(values[0]), values[1], values[2]


class RedisQuorumNode:
    """QuorumNode on one Redis server (a primary), sharing the connection pool of the engine's
    compare-and-set cells (their error mapping and identity too).

    Claims go over a connection of their own, straight through redis-py's Connection (send,
    read): the client's command path (pool, retry, script objects) costs three times the CPU,
    and a quorum round makes one claim per node."""

    def __init__(self, cells: RedisCasStore) -> None:
        self.display_url = cells.display_url
        self._cells = cells
        self._client: Any = cells._client
        self._prefix = cells._prefix
        self._sha = hashlib.sha1(_CLAIM.encode()).hexdigest()
        self._lock = threading.Lock()
        self._conn: Any = None
        self._conn_pid = 0
        self._mux: Any = None  # the multiplexed claims' connection, used by one thread
        self._mux_pid = 0
        self._mux_sock: Any = None  # its socket: claims and answers go straight through it
        self._mux_read = b""  # the part of an answer read so far

    def _counter(self, key: str) -> str:
        return f"{self._prefix}:q:{key}"

    def _call(self, op: Callable[[], T], *, idempotent: bool) -> T:
        return self._cells._call(op, idempotent=idempotent)

    def read(self, key: str) -> int:
        counter = self._counter(key)
        got = self._call(lambda: self._client.get(counter), idempotent=True)
        return 0 if got is None else int(got)

    def claim(self, key: str, start: int, end: int) -> tuple[bool, int]:
        # Not re-sent on a broken connection: a claim that applied would then answer False
        # (harmless here, but an error says more than a refusal that was not one).
        args = (1, self._counter(key), str(start), str(end), str(start), str(end - start + 1))
        with self._lock:
            applied, value, _ = cast(
                list[Any], self._call(lambda: self._send(args), idempotent=False)
            )
        return bool(applied), int(value)

    def _send(self, args: tuple[Any, ...]) -> Any:
        if self._conn is None or self._conn_pid != os.getpid():
            if self._conn is not None:
                orphan(self._conn)  # a parent's socket: never used nor closed here
            self._conn = self._new_connection()
            self._conn_pid = os.getpid()
        conn = self._conn
        try:
            conn.send_command("EVALSHA", self._sha, *args)
            try:
                return conn.read_response()
            except no_script_error():  # a new or restarted server: send the script itself
                conn.send_command("EVAL", _CLAIM, *args)
                return conn.read_response()
        except BaseException:
            conn.disconnect()  # its state is unknown: the next claim connects afresh
            self._conn = None
            raise

    def _new_connection(self) -> Any:
        """A connection of our own, outside the pool: the pool counts the connections it
        makes against its limit (100) and a dropped one never goes back to it."""
        pool = self._client.connection_pool
        return pool.connection_class(**pool.connection_kwargs)

    # -- multiplexed claims (MultiplexedQuorumNode): one round, one thread ------------------

    def mux_connected(self) -> bool:
        conn = self._mux
        return conn is not None and self._mux_pid == os.getpid() and conn._sock is not None

    def mux_connect(self) -> None:
        def connect() -> None:
            conn = self._new_connection()
            conn.connect()
            self._mux, self._mux_pid, self._mux_sock = conn, os.getpid(), conn._sock
            self._mux_read = b""

        self.mux_reset()
        self._call(connect, idempotent=True)

    # The claims and their answers go over the connection's socket as RESP bytes, not through
    # redis-py's send_command and read_response (its packing, parser and buffers): a claim is
    # one small command and its answer one small array, and that took about half the CPU of
    # a round. redis-py still makes the connection (TLS, AUTH, SELECT, HELLO).

    def send_claim(self, key: str, start: int, end: int, limit: int | None = None) -> None:
        if not self.mux_connected():
            raise StoreUnavailable(f"store {self.display_url}: no claim connection")
        # EVAL, not EVALSHA: a server that restarted has no script cache, and an answer that
        # comes later cannot be followed by a second try. Redis caches the script by its hash.
        claim = b"".join(
            (
                _EVAL_HEAD,
                _bulk(self._counter(key).encode()),
                _bulk(b"%d" % start),
                _bulk(b"%d" % end),
                _bulk(b"%d" % (start if limit is None else limit)),
                _bulk(b"%d" % (end - start + 1)),
            )
        )
        self._mux_read = b""
        try:
            self._mux_sock.sendall(claim)
        except OSError as exc:
            raise self._unavailable(exc) from exc

    def fileno(self) -> int:
        return int(self._mux_sock.fileno())

    def receive_claim(self) -> tuple[bool, int, int]:
        """The answer, read once the socket is readable (a part still missing is waited for
        within the connection's socket timeout)."""
        try:
            while True:
                chunk = self._mux_sock.recv(4096)
                if not chunk:
                    raise ConnectionError("the server closed the connection")
                self._mux_read += chunk
                if (answer := parse_claim_answer(self._mux_read)) is not None:
                    break
        except StoreUnavailable as exc:  # an error reply (NOPERM, say): said as any other
            raise StoreUnavailable(describe(exc, self.display_url)) from exc
        except (OSError, ValueError) as exc:
            raise self._unavailable(exc) from exc
        self._mux_read = b""
        return answer

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        return StoreUnavailable(describe(exc, self.display_url))

    def mux_reset(self) -> None:
        conn, self._mux, self._mux_sock = self._mux, None, None
        if conn is None:
            return
        if self._mux_pid == os.getpid():
            conn.disconnect()
        else:
            orphan(conn)  # a parent's socket: never used nor closed here

    def _read_settings(self, ask: Callable[[], T]) -> T | BaseException:
        """`ask`'s answer, or why the server refused it (ACLs, a renamed command, a managed
        Redis), returned: a setting that cannot be read shows nothing about the node. A node
        down or slow raises StoreUnavailable: it is asked again once it answers."""
        errors = self._cells._errors
        try:
            return self._call(ask, idempotent=True)
        except StoreUnavailable as exc:
            cause = exc.__cause__
            if isinstance(cause, errors.broken | errors.timeout):
                raise
            return cause or exc

    def durability(self) -> str | None:
        config = self._read_settings(lambda: self._client.config_get("*append*"))
        if isinstance(config, BaseException):  # nothing shows it fsyncs
            return f"its persistence settings cannot be read: {config}"
        weak = weak_persistence(cast(dict[str, str], config))
        if weak is None and "appendonly" not in config:
            return "CONFIG GET answered without its persistence settings"
        return None if weak is None else f"Redis runs with {weak}"

    def replication(self) -> ReplicationState:
        """The server's replication now (INFO replication). A claim is not followed by WAIT
        (it would cost a round trip and still not make a replica take over with the claim),
        so no replica counts as waited for."""
        info = self._read_settings(lambda: self._client.info("replication"))
        if isinstance(info, BaseException):
            raise InvalidArgument(
                f"quorum node {self.display_url}: its replication cannot be read "
                f"(INFO replication: {info}), so nothing shows it is no replica and "
                "has none; let idmint's user run INFO (docs/quorum.md)"
            ) from info
        return redis_state(cast(dict[str, Any], info), waits=False)

    def identity(self) -> StoreIdentity | None:
        return self._cells.identity()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._conn_pid == os.getpid():
                self._conn.disconnect()
            self._conn = None
        self.mux_reset()
        self._cells.close()
