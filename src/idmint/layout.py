"""Snowflake bit layouts as values: compose and decode are exact inverses. No I/O.

    bit 63 | time (ticks since the epoch) | worker | sequence      twitter, js53, custom
    bit 63 | time                         | sequence | worker      sonyflake

The top bit stays 0 so ids are positive signed 64-bit integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from ._errors import InvalidArgument

MS_PER_YEAR = 365.2425 * 86_400_000
END_OF_CALENDAR_MS = 253_402_300_800_000  # 10000-01-01T00:00:00Z: datetime stops before it


@dataclass(frozen=True)
class Decoded:
    """The parts of a snowflake id."""

    id: int
    time: datetime
    unix_ms: int
    ticks: int
    worker: int
    sequence: int

    def as_dict(self) -> dict[str, object]:
        return {
            "id": self.id,
            "time": self.time.isoformat(),
            "unix_ms": self.unix_ms,
            "ticks": self.ticks,
            "worker": self.worker,
            "sequence": self.sequence,
        }


@dataclass(frozen=True)
class Layout:
    """How a snowflake id splits into time, worker and sequence bits.

    time_bits count ticks of `tick_ms` milliseconds since `epoch_ms` (Unix milliseconds).
    worker_low puts the worker bits below the sequence bits (sonyflake's order).
    """

    name: str
    time_bits: int
    worker_bits: int
    sequence_bits: int
    tick_ms: int = 1
    epoch_ms: int = 0
    worker_low: bool = False

    def __post_init__(self) -> None:
        for what, bits in (
            ("time", self.time_bits),
            ("worker", self.worker_bits),
            ("sequence", self.sequence_bits),
        ):
            if isinstance(bits, bool) or not isinstance(bits, int) or bits < 1:
                raise InvalidArgument(f"{what} bits must be a positive integer, not {bits!r}")
        total = self.time_bits + self.worker_bits + self.sequence_bits
        if total > 63:
            raise InvalidArgument(f"layout {self.name!r} has {total} bits: at most 63 fit")
        if not isinstance(self.tick_ms, int) or self.tick_ms < 1:
            raise InvalidArgument(
                f"tick must be a whole number of milliseconds, not {self.tick_ms!r}"
            )
        if not isinstance(self.epoch_ms, int) or self.epoch_ms < 0:
            raise InvalidArgument(f"epoch must be Unix milliseconds >= 0, not {self.epoch_ms!r}")
        if self.end_ms >= END_OF_CALENDAR_MS:
            years = (self.end_ms - self.epoch_ms) / MS_PER_YEAR
            raise InvalidArgument(
                f"layout {self.name!r} spans {years:,.0f} years, past the year 9999 that dates "
                "can show: use fewer time bits or a shorter tick"
            )

    @property
    def bits(self) -> int:
        return self.time_bits + self.worker_bits + self.sequence_bits

    @property
    def workers(self) -> int:
        return 1 << self.worker_bits

    @property
    def sequences(self) -> int:
        """Ids one worker can issue per tick."""
        return 1 << self.sequence_bits

    @property
    def max_ticks(self) -> int:
        return (1 << self.time_bits) - 1

    @property
    def capacity_per_s(self) -> float:
        """The layout's physical limit for one worker: sequences per tick, ticks per second."""
        return self.sequences * 1000 / self.tick_ms

    @property
    def end_ms(self) -> int:
        """The last Unix millisecond the time bits can express."""
        return self.epoch_ms + self.max_ticks * self.tick_ms + self.tick_ms - 1

    @property
    def end(self) -> datetime:
        return datetime.fromtimestamp(self.end_ms / 1000, UTC)

    def runway_years(self, now_ms: int) -> float:
        return (self.end_ms - now_ms) / MS_PER_YEAR

    def ticks(self, unix_ms: int) -> int:
        return (unix_ms - self.epoch_ms) // self.tick_ms

    def tick_start_ms(self, ticks: int) -> int:
        return self.epoch_ms + ticks * self.tick_ms

    def compose(self, ticks: int, worker: int, sequence: int) -> int:
        if not 0 <= ticks <= self.max_ticks:
            raise InvalidArgument(f"time {ticks} ticks is outside layout {self.name!r}")
        if not 0 <= worker < self.workers:
            raise InvalidArgument(f"worker {worker} does not fit in {self.worker_bits} bits")
        if not 0 <= sequence < self.sequences:
            raise InvalidArgument(f"sequence {sequence} does not fit in {self.sequence_bits} bits")
        if self.worker_low:
            low = (sequence << self.worker_bits) | worker
        else:
            low = (worker << self.sequence_bits) | sequence
        return (ticks << (self.worker_bits + self.sequence_bits)) | low

    def base(self, ticks: int, worker: int) -> int:
        """The id of sequence 0 at this tick and worker (twitter order: a tick's ids are
        base .. base + sequences - 1)."""
        return self.compose(ticks, worker, 0)

    def decode(self, id_: int) -> Decoded:
        if isinstance(id_, bool) or not isinstance(id_, int) or not 0 <= id_ < (1 << self.bits):
            raise InvalidArgument(
                f"{id_!r} is not an id of layout {self.name!r} ({self.bits} bits)"
            )
        low_bits = self.worker_bits + self.sequence_bits
        ticks = id_ >> low_bits
        low = id_ & ((1 << low_bits) - 1)
        if self.worker_low:
            worker, sequence = low & (self.workers - 1), low >> self.worker_bits
        else:
            worker, sequence = low >> self.sequence_bits, low & (self.sequences - 1)
        unix_ms = self.tick_start_ms(ticks)
        when = datetime.fromtimestamp(0, UTC) + timedelta(milliseconds=unix_ms)
        return Decoded(id_, when, unix_ms, ticks, worker, sequence)


TWITTER = Layout("twitter", 41, 10, 12, tick_ms=1, epoch_ms=1_288_834_974_657)
SONYFLAKE = Layout("sonyflake", 39, 16, 8, tick_ms=10, epoch_ms=1_409_529_600_000, worker_low=True)
# 53 bits, so ids survive JavaScript's Number: 41 bits of ms from 2024 (69 years), 32 workers,
# 128 ids per ms per worker.
JS53 = Layout("js53", 41, 5, 7, tick_ms=1, epoch_ms=1_704_067_200_000)

LAYOUTS = {layout.name: layout for layout in (TWITTER, SONYFLAKE, JS53)}


def layout_named(name: str | Layout) -> Layout:
    """A preset by name (twitter, sonyflake, js53), or a Layout as it is."""
    if isinstance(name, Layout):
        return name
    try:
        return LAYOUTS[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown layout {name!r}: use {', '.join(LAYOUTS)} or Layout(...)"
        ) from None
