"""aio.draw, the one wait on the event loop for a generator's refill, as AsyncSegment uses it
(the server's id routes use it too: tests/test_refills.py): waiters hold no thread, and the
errors are the generator's own, StoreUnavailable after its `wait`."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import idmint
from idmint import AsyncSegment, SegmentOptions, StoreUnavailable
from idmint.ids import Allocation, Range
from idmint.stores.base import RangeStore
from idmint.strategies.segment import SegmentGenerator


class Gated:
    """A store whose allocations wait until the gate opens (a hung store, then a good one)."""

    display_url = "gated://"

    def __init__(self, inner: RangeStore) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def allocate(
        self, name: str, count: int | None = None, *, stripe: int | None = None
    ) -> Allocation:
        self.gate.wait(30)
        return self.inner.allocate(name, count, stripe=stripe)

    def give_back(self, name: str, unused: Range) -> bool:
        return self.inner.give_back(name, unused)


def _segment(wait: float) -> tuple[AsyncSegment, Gated]:
    minter = idmint.connect("memory://")
    minter.add_key("k", step=10)
    store = Gated(minter.store)
    gen = SegmentGenerator(store, "k", SegmentOptions(wait=wait))  # type: ignore[arg-type]
    return AsyncSegment(gen), store


def _no_threads(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a waiter took a thread")


def test_awaiters_hold_no_thread_and_get_distinct_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(asyncio, "to_thread", _no_threads)
    segment, store = _segment(wait=10)

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(_NoExecutor())
        threads = threading.active_count()
        singles = [asyncio.create_task(segment.next_id()) for _ in range(200)]
        batches = [asyncio.create_task(segment.next_ids(7)) for _ in range(20)]
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in singles + batches)
        assert threading.active_count() <= threads  # nobody waits on a thread of its own
        store.gate.set()
        ids = list(await asyncio.gather(*singles))
        for batch in await asyncio.gather(*batches):
            assert batch == sorted(batch)
            ids += batch
        return ids

    ids = asyncio.run(main())
    assert len(ids) == len(set(ids)) == 200 + 20 * 7
    segment.generator.close()


def test_a_hung_store_is_store_unavailable_after_wait() -> None:
    segment, store = _segment(wait=0.3)

    async def main() -> float:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"gave no range within 0\.3 s \(gated://\)"):
            await segment.next_id()
        return time.monotonic() - started

    waited = asyncio.run(main())
    assert 0.25 <= waited < 3, waited
    store.gate.set()
    segment.generator.close()


class _NoExecutor(ThreadPoolExecutor):
    """The loop's default executor while waiters wait: it refuses work."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a waiter took an executor thread")
