"""Ids for asyncio code: awaiting one never blocks the event loop.

    orders = minter.async_segment("order")      # or idmint.AsyncClient(...).segment("order")
    await orders.next_id()

An `AsyncSegment` wraps the key's ordinary SegmentGenerator; it holds no logic of its own. An id
that is buffered (nearly every call: the generator loads its next range when 10% of the current
one is used) is drawn on the loop, without a lock or I/O. Only when both buffered ranges are
gone does a caller wait for the store, and it waits on a thread of the loop's default executor,
so other coroutines run meanwhile. That wait is bounded as for `next_id()`: the generator's
`wait` (1 s by default), then StoreUnavailable.
"""

from __future__ import annotations

import asyncio

from .strategies.segment import SegmentGenerator


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
        if i is None:  # nothing buffered: wait for the refill off the loop
            i = await asyncio.to_thread(self.generator.next_id)
        return i

    async def next_ids(self, count: int) -> list[int]:
        """`count` ids (1 to 1,000,000), as SegmentGenerator.next_ids gives them."""
        ids = self.generator.try_next_ids(count)
        if len(ids) < count:
            ids += await asyncio.to_thread(self.generator.next_ids, count - len(ids))
        return ids
