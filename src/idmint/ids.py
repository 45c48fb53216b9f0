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

# A key may have up to this many stripes (independent counters, see Key.stripes). Its maximum
# then stays at most ID_MAX + 1 - stripes, so a stripe's counter (up to last_id + stripes)
# still fits in a BIGINT.
MAX_STRIPES = 1024

# The most ids one request may take over HTTP (a range, a batch), per key: the key's
# `max_batch` when an admin set one, else its step x BATCH_CAP_STEPS; never above BATCH_CAP_MAX.
# Without it, a client with no credential burned a whole 32-bit key in 215 requests.
BATCH_CAP_STEPS = 100
BATCH_CAP_MAX = 10_000_000

KEY_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
KEY_NAME_RULE = "1 to 128 characters from A-Z a-z 0-9 . _ : -, starting with a letter or a digit"


def is_digits(text: str) -> bool:
    """Whether `text` is one or more ASCII digits 0-9: str.isdigit() is also true of "²" and
    other Unicode digits, which int() then refuses."""
    return text.isascii() and text.isdigit()


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
    """The ids start, start + stride, start + 2 * stride, ... below stop.

    A plain key's ranges have stride 1: the half-open interval [start, stop). A key with n
    stripes hands out ranges of stride n, each inside one stripe (see docs/design.md). `stop`
    is always the id the range's stripe would hand out next: start + len(range) * stride.
    """

    start: int
    stop: int
    stride: int = 1

    def __post_init__(self) -> None:
        if self.stride < 1:
            raise ValueError(f"a range's stride must be at least 1, not {self.stride}")
        if self.stop < self.start:
            raise ValueError(f"empty range with stop {self.stop} < start {self.start}")
        if (self.stop - self.start) % self.stride:
            raise ValueError(f"range [{self.start}, {self.stop}) is not whole strides")

    @classmethod
    def of(cls, start: int, count: int, stride: int = 1) -> Range:
        """The `count` ids from `start`, `stride` apart."""
        return cls(start, start + count * stride, stride)

    def __len__(self) -> int:
        return (self.stop - self.start) // self.stride

    def __contains__(self, value: object) -> bool:
        return (
            isinstance(value, int)
            and self.start <= value < self.stop
            and (value - self.start) % self.stride == 0
        )

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop, self.stride))

    @property
    def last(self) -> int:
        """The highest id in the range."""
        return self.stop - self.stride

    def as_dict(self) -> dict[str, int]:
        """The range as the HTTP API shows it."""
        return {"start": self.start, "stop": self.stop, "stride": self.stride}


@dataclass(frozen=True, slots=True)
class Key:
    """A key's row in a store: its counter and the bounds of its ids.

    `max_id` keeps Leaf's meaning: every id below it has been handed out, and the next range
    starts there. A key issues ids in [first_id, last_id]; `first_id` only moves up (see
    `raise_floor`).

    A key with `stripes` n > 1 keeps n counters (Broadcast's stripes, tinyid's delta and
    remainder): stripe k hands out the ids congruent to the key's first id + k modulo n, in
    ranges of stride n. Each stripe is a row of its own in the store, a Key with `stripe` k
    whose `first_id` and `max_id` are that stripe's ids; `get_key` shows stripe 0's row with
    every stripe's next id in `stripe_next`.
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
    stripes: int = 1
    #: Which stripe's row this is (0 for a plain key).
    stripe: int = 0
    #: Where each stripe's next range starts, for a striped key as get_key shows it.
    stripe_next: tuple[int, ...] = ()

    @property
    def batch_cap(self) -> int:
        """The most ids one request may take over HTTP: `max_batch`, or by default the step
        x 100, at most 10,000,000."""
        return self.max_batch or min(self.step * BATCH_CAP_STEPS, BATCH_CAP_MAX)

    @property
    def next_ids(self) -> tuple[int, ...]:
        """Where the next range of each stripe (of this row, when it is one stripe's) starts."""
        return self.stripe_next or (max(self.max_id, self.first_id),)

    @property
    def next_id(self) -> int:
        """The lowest id any stripe of the key would hand out next."""
        return min(self.next_ids)

    @property
    def remaining(self) -> int:
        """How many ids the key can still hand out."""
        return sum(
            (self.last_id - start) // self.stripes + 1
            for start in self.next_ids
            if start <= self.last_id
        )

    @property
    def exhausted(self) -> bool:
        return self.remaining == 0

    def differences(
        self, *, step: int | None, start: int, last_id: int | None, stripes: int | None
    ) -> list[str]:
        """How this key differs from one asked for again (`exist_ok`); None: not asked. Its
        first id may have been raised since (keys raise): only a start above it differs,
        since the key would hand out ids below what was asked."""
        found = []
        if start > self.first_id:
            found.append(f"it hands out ids from {self.first_id}, not {start}")
        if last_id is not None and last_id != self.last_id:
            found.append(f"its largest id is {self.last_id}, not {last_id}")
        if stripes is not None and stripes != self.stripes:
            found.append(f"it has {self.stripes} stripes, not {stripes}")
        if step is not None and step != self.step:
            found.append(f"its step is {self.step}, not {step}")
        return found

    @property
    def retired(self) -> bool:
        """Its floor is past its maximum (`idmint keys retire`): it hands out no id again."""
        return self.first_id > self.last_id

    @property
    def id_max(self) -> int:
        """The highest maximum a key with this many stripes may have."""
        return ID_MAX + 1 - self.stripes

    @property
    def bounded(self) -> bool:
        """True when the key's maximum is below the 64-bit ceiling (a 32-bit key, say)."""
        return self.last_id < self.id_max

    def as_dict(self) -> dict[str, object]:
        """The key as the CLI's --json and the HTTP API show it: `start` and `max` are the
        bounds, `next_id` where the next range taken by anyone starts (the lowest stripe's)."""
        shown: dict[str, object] = {
            "name": self.name,
            "next_id": self.next_id,
            "step": self.step,
            "start": self.first_id,
            "max": self.last_id,
            "remaining": self.remaining,
            "bounded": self.bounded,
            "description": self.description,
            "updated_at": self.updated_at.isoformat() if self.updated_at else None,
            "max_batch": self.max_batch,
            "batch_cap": self.batch_cap,
            "stripes": self.stripes,
        }
        if self.retired:
            shown["retired"] = True
        if self.stripes > 1:
            shown["stripe_next"] = list(self.next_ids)
        return shown


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


def check_key_bounds(step: int, first_id: int, last_id: int, stripes: int = 1) -> None:
    """Validate a new key's step, bounds and stripes, raising InvalidArgument with the reason."""
    check_count(stripes, what="stripes", maximum=MAX_STRIPES)
    check_count(step, what="step")
    top = ID_MAX + 1 - stripes
    for what, value in (("start", first_id), ("max", last_id)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            striped = f" (a key with {stripes} stripes)" if stripes > 1 else ""
            raise InvalidArgument(
                f"{what} must be an integer from 0 to {top}{striped}, not {value!r}"
            )
    if last_id < first_id:
        raise InvalidArgument(f"max {last_id} is below start {first_id}")
    if last_id - first_id + 1 < stripes:
        raise InvalidArgument(
            f"a key with {stripes} stripes needs at least {stripes} ids; "
            f"[{first_id}, {last_id}] has {last_id - first_id + 1}"
        )


def check_stripe(stripe: int, stripes: int) -> int:
    """Return `stripe` if it is one of a key's `stripes` stripes (0 to stripes - 1)."""
    if isinstance(stripe, bool) or not isinstance(stripe, int) or not 0 <= stripe < stripes:
        raise InvalidArgument(
            f"stripe must be an integer from 0 to {stripes - 1} (the key has {stripes} "
            f"stripe{'s' if stripes > 1 else ''}), not {stripe!r}"
        )
    return stripe


def align_up(value: int, like: int, stride: int) -> int:
    """The smallest integer >= value congruent to `like` modulo `stride`."""
    return value + (like - value) % stride


def stripe_row(key: Key, stripe: int) -> Key:
    """The row stripe `stripe` of a new key starts with: its ids are key.first_id + stripe +
    j * key.stripes (at or above the key's floor, when that was raised)."""
    origin = key.first_id + stripe
    return Key(
        key.name,
        max_id=origin,
        step=key.step,
        first_id=origin,
        last_id=key.last_id,
        stripes=key.stripes,
        stripe=stripe,
        updated_at=key.updated_at,
    )


@dataclass(frozen=True, slots=True)
class Allocation:
    """What a store hands back from one allocation: the range, the row it came from after it
    (the key's, or its stripe's), how many compare-and-set conflicts it took, and its epoch."""

    range: Range
    key: Key
    conflicts: int = 0
    #: Ranges of one epoch only move up (a generator checks that, per stripe, to notice a
    #: store that lost data). A datacenter key's epoch is the reservation a range came from:
    #: a later reservation may be lower (ids another datacenter gave back).
    epoch: int = 0


def next_range(key: Key, count: int | None) -> Range:
    """The range an allocation of `count` ids (default: the key's step) takes from `key` (a
    plain key, or one stripe's row: then the range has that stripe's stride).

    Bounded keys get a shorter range near their end; a key (or stripe) with nothing left
    raises Exhausted. Every store applies this one rule inside its own atomic update.
    """
    start = max(key.max_id, key.first_id)
    if start > key.last_id:
        if key.stripes == 1:
            raise Exhausted(key.name, key.last_id)
        raise Exhausted(key.name, key.last_id, stripe=key.stripe, stripes=key.stripes)
    size = key.step if count is None else count
    left = (key.last_id - start) // key.stripes + 1
    return Range.of(start, min(size, left), key.stripes)


def raised_floor(key: Key, to: int) -> tuple[int, int]:
    """(first_id, max_id) of `key` (or of one stripe's row) after raising its floor to `to`;
    both only move up, and a stripe's stay on that stripe's ids. One past the key's maximum
    retires it: no range is taken from it again."""
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to <= key.last_id + 1:
        raise InvalidArgument(
            f"cannot raise key {key.name!r} to {to!r}: it must be an integer from 0 to the "
            f"key's maximum {key.last_id} (one more retires it: idmint keys retire)"
        )
    to = align_up(to, key.first_id, key.stripes)
    return max(key.first_id, to), max(key.max_id, to)
