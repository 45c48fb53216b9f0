"""What every lease store decides the same way: which worker id a new lease takes, and the
name a holder goes by. The Redis lease store runs the worker-choice rule inside Redis, in Lua
(`_ACQUIRE` in redis/leases.py); tests/test_leasing.py checks that copy chooses as
`choose_worker` does."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable

from .._errors import WorkersExhausted

# The longest holder name: the SQL engines' `host` column is sized to it.
HOLDER_NAME_MAX = 255


def holder_name() -> str:
    """Who holds a lease, for `idmint workers list`: host and process id, at most
    HOLDER_NAME_MAX characters (the same name on every engine)."""
    return f"{socket.gethostname()}:{os.getpid()}"[:HOLDER_NAME_MAX]


def choose_worker(
    namespace: str,
    workers: int,
    free: Iterable[int],
    floor_ms: Callable[[int], int],
    now_ms: int | None,
    *,
    looks: int = 0,
) -> int:
    """The worker id a new lease without a claim takes among `free`, the ids below `workers`
    that are neither leased nor reserved for a static holder, in ascending order: the first
    whose floor (its stored horizon) is at most now_ms, so the holder can issue at once, else
    the first. Without now_ms, the first. With `looks`, at most that many floors are read
    (for stores where each is a round trip). `free` is read no further than the chosen id.
    Raises WorkersExhausted when `free` is empty."""
    first = None
    for looked, worker_id in enumerate(free):
        if first is None:
            first = worker_id
        if now_ms is None or (looks and looked >= looks):
            break
        if floor_ms(worker_id) <= now_ms:
            return worker_id
    if first is None:
        raise WorkersExhausted(namespace, workers)
    return first
