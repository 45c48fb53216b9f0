"""An in-process store: for strategy unit tests and trying idmint out.

It meets the same contract as the real stores (the contract suite runs on it), but it lives
and dies with the process. `memory://NAME` stores are shared within a process by name;
`memory://` is a new, private store each time.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import replace
from datetime import UTC, datetime

from .._errors import KeyExists, KeyNotFound
from ..ids import Allocation, Key, Range, next_range, raised_floor
from .base import StoreIdentity

_named: dict[str, MemoryRangeStore] = {}
_named_lock = threading.Lock()


class MemoryRangeStore:
    """A RangeStore in a dict, every operation under one lock."""

    def __init__(self, display_url: str = "memory://") -> None:
        self.display_url = display_url
        self._keys: dict[str, Key] = {}
        self._lock = threading.Lock()
        self._identity = StoreIdentity(uuid.uuid4().hex, None)

    def identity(self) -> StoreIdentity | None:
        return self._identity

    def init(self) -> None:
        pass

    def add_key(
        self, name: str, *, step: int, first_id: int, last_id: int, description: str = ""
    ) -> Key:
        with self._lock:
            if name in self._keys:
                raise KeyExists(name)
            key = Key(name, first_id, step, first_id, last_id, description, datetime.now(UTC))
            self._keys[name] = key
            return key

    def _get(self, name: str) -> Key:
        try:
            return self._keys[name]
        except KeyError:
            raise KeyNotFound(name) from None

    def get_key(self, name: str) -> Key:
        with self._lock:
            return self._get(name)

    def list_keys(self) -> list[Key]:
        with self._lock:
            return sorted(self._keys.values(), key=lambda key: key.name)

    def _update(self, key: Key, *, max_id: int, first_id: int | None = None) -> Key:
        first_id = key.first_id if first_id is None else first_id
        key = replace(key, max_id=max_id, first_id=first_id, updated_at=datetime.now(UTC))
        self._keys[key.name] = key
        return key

    def allocate(self, name: str, count: int | None = None) -> Allocation:
        with self._lock:
            key = self._get(name)
            taken = next_range(key, count)
            return Allocation(taken, self._update(key, max_id=taken.stop))

    def give_back(self, name: str, unused: Range) -> bool:
        with self._lock:
            key = self._keys.get(name)
            if (
                key is None
                or not unused
                or key.max_id != unused.stop
                or unused.start < key.first_id
            ):
                return False
            self._update(key, max_id=unused.start)
            return True

    def raise_floor(self, name: str, to: int) -> Key:
        with self._lock:
            key = self._get(name)
            first_id, max_id = raised_floor(key, to)
            return self._update(key, first_id=first_id, max_id=max_id)

    def set_max_batch(self, name: str, max_batch: int) -> Key:
        with self._lock:
            key = replace(self._get(name), max_batch=max_batch, updated_at=datetime.now(UTC))
            self._keys[name] = key
            return key

    def close(self) -> None:
        pass


def open_memory(url: str) -> MemoryRangeStore:
    name = url[len("memory://") :]
    if not name:
        return MemoryRangeStore(url)
    with _named_lock:
        return _named.setdefault(name, MemoryRangeStore(url))
