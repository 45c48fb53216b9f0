"""A quorum node on Redis: a key's counter is the string `{prefix}:q:{key}`, claimed by one
Lua script (atomic on the server).

A quorum key is only as safe as its nodes' memory: a node that restarts without a claim it
acknowledged lets a later round take those ids again. Redis keeps an acknowledged write
through a crash of the machine only with `appendonly yes` and `appendfsync always`, so
`durability()` reads CONFIG GET and names anything weaker; the strategy refuses such nodes
unless the caller opts in to being unsafe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from .._errors import StoreUnavailable
from .base import StoreIdentity

if TYPE_CHECKING:
    from .redis import RedisCasStore

T = TypeVar("T")

# KEYS[1] the counter, ARGV[1] start, ARGV[2] end: decimal integers without leading zeros,
# compared as text (length first, then digits), so counters past 2^53 (where Lua's numbers
# lose precision) compare right. Answers {1, end} when it set the counter, else {0, counter}.
_CLAIM = """
local current = redis.call('GET', KEYS[1]) or '0'
local start = ARGV[1]
if #current < #start or (#current == #start and current < start) then
    redis.call('SET', KEYS[1], ARGV[2])
    return {1, ARGV[2]}
end
return {0, current}
"""


class RedisQuorumNode:
    """QuorumNode on one Redis server (a primary), sharing the connection pool of the engine's
    compare-and-set cells (their error mapping and identity too)."""

    def __init__(self, cells: RedisCasStore) -> None:
        self.display_url = cells.display_url
        self._cells = cells
        self._client: Any = cells._client
        self._prefix = cells._prefix
        self._claim = self._client.register_script(_CLAIM)

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
        keys, args = [self._counter(key)], [str(start), str(end)]
        applied, value = cast(
            list[Any], self._call(lambda: self._claim(keys=keys, args=args), idempotent=False)
        )
        return bool(applied), int(value)

    def durability(self) -> str | None:
        from .redis import weak_persistence

        errors = self._cells._errors
        try:
            config = self._call(lambda: self._client.config_get("*append*"), idempotent=True)
        except StoreUnavailable as exc:
            cause = exc.__cause__
            if isinstance(cause, errors.broken | errors.timeout):
                raise  # down or slow: asked again once it answers
            # refused (ACLs, a renamed CONFIG, a managed Redis): nothing shows it fsyncs
            return f"its persistence settings cannot be read: {cause or exc}"
        weak = weak_persistence(cast(dict[str, str], config))
        if weak is None and "appendonly" not in config:
            return "CONFIG GET answered without its persistence settings"
        return None if weak is None else f"Redis runs with {weak}"

    def identity(self) -> StoreIdentity | None:
        return self._cells.identity()

    def close(self) -> None:
        self._cells.close()
