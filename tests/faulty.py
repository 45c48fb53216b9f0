"""A store wrapper that fails and stalls on command, around a real store.

It adds faults, never answers: every successful call is the wrapped store's own answer. A
failure "after commit" lets the inner store commit and then reports an error, as a connection
lost during COMMIT does: the range is taken but its holder never learns it.
"""

from __future__ import annotations

import threading
import time

from idmint import Range, StoreUnavailable
from idmint.ids import Allocation, Key
from idmint.stores.base import RangeStore, StoreIdentity


class FaultyStore:
    def __init__(self, inner: RangeStore) -> None:
        self.inner = inner
        self.display_url = f"faulty+{inner.display_url}"
        self.down = False  # every call fails at once
        self.delay = 0.0  # seconds every allocation takes
        self.fail_before = 0  # the next N allocations fail before touching the store
        self.fail_after = 0  # the next N allocations commit, then report a failure
        self.allocations: list[Range] = []  # every range the inner store committed
        self.calls = 0
        self._lock = threading.Lock()

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailable(f"{self.display_url} is down (injected)")

    def init(self) -> None:
        self._check()
        self.inner.init()

    def add_key(
        self,
        name: str,
        *,
        step: int,
        first_id: int,
        last_id: int,
        description: str = "",
        stripes: int = 1,
    ) -> Key:
        self._check()
        return self.inner.add_key(
            name,
            step=step,
            first_id=first_id,
            last_id=last_id,
            description=description,
            stripes=stripes,
        )

    def get_key(self, name: str) -> Key:
        self._check()
        return self.inner.get_key(name)

    def list_keys(self) -> list[Key]:
        self._check()
        return self.inner.list_keys()

    def allocate(
        self, name: str, count: int | None = None, *, stripe: int | None = None
    ) -> Allocation:
        with self._lock:
            self.calls += 1
            before = self.fail_before > 0
            self.fail_before -= before
            after = not before and self.fail_after > 0
            self.fail_after -= after
        if self.delay:
            time.sleep(self.delay)
        self._check()
        if before:
            raise StoreUnavailable("injected failure before commit")
        taken = self.inner.allocate(name, count, stripe=stripe)
        with self._lock:
            self.allocations.append(taken.range)
        if after:
            raise StoreUnavailable("injected failure after commit: outcome unknown")
        return taken

    def give_back(self, name: str, unused: Range) -> bool:
        self._check()
        return self.inner.give_back(name, unused)

    def identity(self) -> StoreIdentity | None:
        self._check()
        return self.inner.identity()

    def raise_floor(self, name: str, to: int) -> Key:
        self._check()
        return self.inner.raise_floor(name, to)

    def set_max_batch(self, name: str, max_batch: int) -> Key:
        self._check()
        return self.inner.set_max_batch(name, max_batch)

    def close(self) -> None:
        self.inner.close()
