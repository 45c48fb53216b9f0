"""Pure value types shared by the strategies and the stores: no I/O here."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

from ._errors import Exhausted, InvalidArgument

# Ids are positive signed 64-bit integers. A key's counter (`max_id`, the next id to hand out)
# can reach last_id + 1, and that must still fit in a BIGINT, hence the - 2.
ID_MAX = 2**63 - 2
UINT31_MAX = 2**31 - 1  # the largest id of a "32-bit" key: a signed INT column holds it

DEFAULT_STEP = 1000
DEFAULT_FIRST_ID = 1

# The most ids one request may take over HTTP (a range, a batch), per key: the key's
# `max_batch` when an admin set one, else its step x BATCH_CAP_STEPS; never above BATCH_CAP_MAX.
# Without it, a client with no credential burned a whole 32-bit key in 215 requests.
BATCH_CAP_STEPS = 100
BATCH_CAP_MAX = 10_000_000

KEY_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
KEY_NAME_RULE = "1 to 128 characters from A-Z a-z 0-9 . _ : -, starting with a letter or a digit"


def check_key_name(name: str) -> str:
    """Return `name` if it is a valid key name, else raise InvalidArgument."""
    if not isinstance(name, str) or not KEY_NAME_PATTERN.fullmatch(name):
        raise InvalidArgument(f"bad key name {name!r}: a key name is {KEY_NAME_RULE}")
    return name


def check_count(count: int, *, what: str = "count", maximum: int = ID_MAX) -> int:
    """Return `count` if it is an int in [1, maximum], else raise InvalidArgument."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= maximum:
        raise InvalidArgument(f"{what} must be an integer from 1 to {maximum}, not {count!r}")
    return count


@dataclass(frozen=True, slots=True)
class Range:
    """Half-open interval of ids [start, stop)."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.stop < self.start:
            raise ValueError(f"empty range with stop {self.stop} < start {self.start}")

    def __len__(self) -> int:
        return self.stop - self.start

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and self.start <= value < self.stop

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    @property
    def last(self) -> int:
        """The highest id in the range."""
        return self.stop - 1


@dataclass(frozen=True, slots=True)
class Key:
    """A key's row in a store: its counter and the bounds of its ids.

    `max_id` keeps Leaf's meaning: every id below it has been handed out, and the next range
    starts there. A key issues ids in [first_id, last_id]; `first_id` only moves up (see
    `raise_floor`).
    """

    name: str
    max_id: int
    step: int
    first_id: int
    last_id: int
    description: str = ""
    updated_at: datetime | None = None
    #: The most ids one request may take over HTTP; 0: the default rule (see batch_cap).
    max_batch: int = 0

    @property
    def batch_cap(self) -> int:
        """The most ids one request may take over HTTP: `max_batch`, or by default the step
        x 100, at most 10,000,000."""
        return self.max_batch or min(self.step * BATCH_CAP_STEPS, BATCH_CAP_MAX)

    @property
    def remaining(self) -> int:
        """How many ids the key can still hand out."""
        return max(0, self.last_id + 1 - max(self.max_id, self.first_id))

    @property
    def exhausted(self) -> bool:
        return self.remaining == 0

    @property
    def bounded(self) -> bool:
        """True when the key's maximum is below the 64-bit ceiling (a 32-bit key, say)."""
        return self.last_id < ID_MAX

    def as_dict(self) -> dict[str, object]:
        """The key as the CLI's --json and the HTTP API show it: `start` and `max` are the
        bounds, `next_id` where the next range taken by anyone starts."""
        return {
            "name": self.name,
            "next_id": max(self.max_id, self.first_id),
            "step": self.step,
            "start": self.first_id,
            "max": self.last_id,
            "remaining": self.remaining,
            "bounded": self.bounded,
            "description": self.description,
            "updated_at": self.updated_at.isoformat() if self.updated_at else None,
            "max_batch": self.max_batch,
            "batch_cap": self.batch_cap,
        }


def check_max_batch(max_batch: int) -> int:
    """Return `max_batch` if it is an int in [0, BATCH_CAP_MAX] (0: the default rule)."""
    if (
        isinstance(max_batch, bool)
        or not isinstance(max_batch, int)
        or not 0 <= max_batch <= BATCH_CAP_MAX
    ):
        raise InvalidArgument(
            f"max_batch must be an integer from 0 (the default: the step x {BATCH_CAP_STEPS}) "
            f"to {BATCH_CAP_MAX}, not {max_batch!r}"
        )
    return max_batch


def check_key_bounds(step: int, first_id: int, last_id: int) -> None:
    """Validate a new key's step and bounds, raising InvalidArgument with the reason."""
    check_count(step, what="step")
    for what, value in (("start", first_id), ("max", last_id)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= ID_MAX:
            raise InvalidArgument(f"{what} must be an integer from 0 to {ID_MAX}, not {value!r}")
    if last_id < first_id:
        raise InvalidArgument(f"max {last_id} is below start {first_id}")


@dataclass(frozen=True, slots=True)
class Allocation:
    """What a store hands back from one allocation: the range and the key's row after it."""

    range: Range
    key: Key


def next_range(key: Key, count: int | None) -> Range:
    """The range an allocation of `count` ids (default: the key's step) takes from `key`.

    Bounded keys get a shorter range near their end; a key with nothing left raises Exhausted.
    Every store applies this one rule inside its own atomic update.
    """
    start = max(key.max_id, key.first_id)
    if start > key.last_id:
        raise Exhausted(key.name, key.last_id)
    size = key.step if count is None else count
    return Range(start, min(start + size, key.last_id + 1))


def raised_floor(key: Key, to: int) -> tuple[int, int]:
    """(first_id, max_id) of `key` after raising its floor to `to`; both only move up."""
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to <= key.last_id:
        raise InvalidArgument(
            f"cannot raise key {key.name!r} to {to!r}: it must be an integer from 0 to the "
            f"key's maximum {key.last_id}"
        )
    return max(key.first_id, to), max(key.max_id, to)
