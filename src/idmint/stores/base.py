"""The contract every range store meets (see docs/design.md, "Stores").

A strategy never imports a store module: it is handed an object with these methods. Every
method is thread-safe. Every method either completes atomically and durably or raises; a range
is returned only after the store has committed it, so a range whose commit outcome is unknown
is never served.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..ids import Allocation, Key, Range


@runtime_checkable
class RangeStore(Protocol):
    """Keys with a counter each; `allocate` atomically takes a range from a key's counter."""

    #: The store's URL with any password removed: safe to print and log.
    display_url: str

    def init(self) -> None:
        """Create the schema if it is missing. Safe to call any number of times, concurrently."""

    def add_key(
        self, name: str, *, step: int, first_id: int, last_id: int, description: str = ""
    ) -> Key:
        """Create a key whose first range starts at `first_id`. Raises KeyExists."""

    def get_key(self, name: str) -> Key:
        """The key's row. Raises KeyNotFound."""

    def list_keys(self) -> list[Key]:
        """Every key, sorted by name."""

    def allocate(self, name: str, count: int | None = None) -> Allocation:
        """Take `count` ids (default: the key's step) from the key's counter, atomically.

        A bounded key near its end yields a shorter range; one with none left raises Exhausted.
        Raises KeyNotFound, StoreUnavailable.
        """

    def give_back(self, name: str, unused: Range) -> bool:
        """Return an unused tail: if the counter still stands at `unused.stop` (nobody has
        allocated since), move it back to `unused.start`. True if it moved.

        Never moves the counter below the key's floor (`first_id`), so a raise that happened
        while the range was held still stands.
        """

    def raise_floor(self, name: str, to: int) -> Key:
        """Make every future range start at or above `to`; the floor only moves up."""

    def close(self) -> None:
        """Release connections. The store may not be used afterwards."""
