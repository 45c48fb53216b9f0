"""Whole ranges of a striped key straight from a store, for one-off batches and for ranges
handed to clients (Minter.take, the server's range routes): a generator moves between
stripes itself (segment_refills.py), a single allocation needs this rule instead.
"""

from __future__ import annotations

from .._errors import Exhausted
from .._fork import private_random
from ..ids import Allocation
from ..stores.base import RangeStore

_jitter = private_random()


def allocate_any(
    store: RangeStore, name: str, count: int | None = None, *, stripe: int | None = None
) -> Allocation:
    """`store.allocate`, except that with no `stripe` a striped key hands out a range while
    any of its stripes has ids left: when the stripe the store chose is exhausted, the others
    that still have some (as the key's row says) are tried in random order. Only then does it
    raise Exhausted for the whole key (no `stripe`). With a `stripe`, that stripe or nothing.
    """
    try:
        return store.allocate(name, count, stripe=stripe)
    except Exhausted as exc:
        if stripe is not None or exc.stripe is None or (exc.stripes or 1) < 2:
            raise
        spent = exc
    key = store.get_key(name)
    left = [s for s, start in enumerate(key.next_ids) if s != spent.stripe and start <= key.last_id]
    _jitter.shuffle(left)
    for other in left:
        try:
            return store.allocate(name, count, stripe=other)
        except Exhausted as exc:
            if exc.stripe is None:
                raise
    raise Exhausted(name, key.last_id) from spent
