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
