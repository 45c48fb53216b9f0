"""Ids for asyncio code: awaiting one never blocks the event loop.

    orders = minter.async_segment("order")      # or idmint.AsyncClient(...).segment("order")
    await orders.next_id()

An `AsyncSegment` wraps the key's ordinary SegmentGenerator; it holds no logic of its own. An id
that is buffered (nearly every call: the generator loads its next range when 10% of the current
one is used) is drawn on the loop, without a lock or I/O. Only when both buffered ranges are
gone does a caller wait for the store, and it waits on the loop itself (`draw`): the generator's
refill thread, which the non-blocking draw started, wakes it, so a waiting caller holds no
thread and other coroutines run meanwhile. That wait is bounded as for `next_id()`: the
generator's `wait` (1 s by default), then StoreUnavailable.

`draw` is also how the HTTP server's id routes wait for a key's refill (server/service.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools

from ._errors import IdmintError, StoreUnavailable
from .strategies.segment import SegmentGenerator


async def draw(
    gen: SegmentGenerator,
    count: int,
    wait: float,
    *,
    per_range: bool = True,
    partial: bool = False,
) -> list[int]:
    """`count` ids of the generator, waiting for its refills on the event loop.

    `wait` bounds each wait for a range (`per_range`, as `SegmentGenerator.next_ids` waits:
    the bound starts again when a load ends), or the whole draw (`per_range=False`:
    the server, whose request has one deadline); past it, StoreUnavailable. Errors are the
    generator's own (KeyNotFound, Exhausted, StoreUnavailable, Closed), raised as they come;
    with `partial`, the ids drawn before a failure are returned instead (fewer than asked:
    the server would otherwise lose them), and the failure only when there are none.
    """
    # The non-blocking draw starts the refill when the buffers run low or out, so waiting
    # for its callback (on_refill) is enough: nobody else has to start it.
    ids = gen.try_next_ids(count)
    if len(ids) == count:
        return ids
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    try:
        while len(ids) < count:
            refilled: asyncio.Future[None] = loop.create_future()
            gen.on_refill(functools.partial(_wake, loop, refilled))
            # Again after listening: a load that ended before it would never call back.
            ids += gen.try_next_ids(count - len(ids))
            if len(ids) == count:
                break
            left = deadline - loop.time()
            if left <= 0 or not (await asyncio.wait({refilled}, timeout=left))[0]:
                raise StoreUnavailable(
                    f"no ids buffered for key {gen.key!r} and the store gave no range "
                    f"within {wait:g} s ({gen.display_url})"
                )
            if per_range:  # a load ended: the wait for the next range starts afresh
                deadline = loop.time() + wait
    except IdmintError:
        if not (partial and ids):
            raise
    return ids


def _wake(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    """Settle `future` on its loop, from a refill thread."""
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
        loop.call_soon_threadsafe(_settle, future)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class AsyncSegment:
    """A segment generator for event loops: `await next_id()` never blocks the loop.
    Errors are the generator's own (KeyNotFound, Exhausted, StoreUnavailable, Closed)."""

    __slots__ = ("generator",)

    def __init__(self, generator: SegmentGenerator) -> None:
        #: The generator it draws from (close it, or its minter/client, when done).
        self.generator = generator

    @property
    def key(self) -> str:
        return self.generator.key

    async def next_id(self) -> int:
        i = self.generator.try_next_id()
        if i is None:  # nothing buffered: wait for the refill on the loop
            i = (await draw(self.generator, 1, self.generator.options.wait))[0]
        return i

    async def next_ids(self, count: int) -> list[int]:
        """`count` ids (1 to 1,000,000), as SegmentGenerator.next_ids gives them."""
        return await draw(self.generator, count, self.generator.options.wait)
