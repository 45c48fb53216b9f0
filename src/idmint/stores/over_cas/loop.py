"""The compare-and-set loop over any CasStore (stores/base.py): read, swap, and on a lost swap
back off and read again. Ranges over cells (over_cas/ranges.py) and datacenter keys
(strategies/datacenter.py) both loop with it; it knows no cell format.

The back-off is Broadcast's, made stricter (see Backoff): random first waits keep clients that
collided from colliding again in lockstep; growing waits keep a crowd from burning the
engine's capacity on conflicts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..._errors import InvalidArgument, StoreUnavailable
from ..._fork import private_random
from ..base import CasStore

T = TypeVar("T")

_jitter = private_random()


@dataclass(frozen=True)
class Backoff:
    """Waits between compare-and-set attempts that lost (Broadcast's random back-off).

    The first wait is random in [0, 2 x `initial`) seconds, drawn once per operation; the
    n-th is n times it, up to `longest`: without that cap a writer that lost a few times
    waits ever longer while newcomers, starting again from short waits, win (starvation).
    Past `deadline` seconds of trying the operation fails with StoreUnavailable.
    """

    initial: float = 0.004
    longest: float = 0.05
    deadline: float = 5.0

    def __post_init__(self) -> None:
        if self.initial < 0 or self.longest < 0 or self.deadline <= 0:
            raise InvalidArgument(
                "back-off: initial and longest must be at least 0, deadline above 0"
            )

    def waits(self, what: str) -> Callable[[], None]:
        """A function to call after each lost attempt of one operation: it sleeps, or raises
        StoreUnavailable once the deadline has passed."""
        first = _jitter.uniform(0.0, 2.0 * self.initial)
        give_up = time.monotonic() + self.deadline
        attempt = 0

        def wait() -> None:
            nonlocal attempt
            attempt += 1
            left = give_up - time.monotonic()
            if left <= 0:
                raise StoreUnavailable(
                    f"{what}: {attempt} compare-and-set attempts lost to other writers within "
                    f"{self.deadline:g} s; too many processes on one counter (give the key "
                    "stripes: idmint keys add NAME --stripes N)"
                )
            time.sleep(min(first * attempt, self.longest, left))

        return wait


def cas_update(
    cas: CasStore,
    cell: str,
    attempt: Callable[[], tuple[int | None, str | None, T]],
    backoff: Backoff,
    what: str,
    on_lost: Callable[[], None] | None = None,
) -> tuple[T, int]:
    """The compare-and-set loop every strategy over cells uses. `attempt` reads what it needs
    and returns (the version to swap against, or None to create the cell; the new value, or
    None to write nothing; the result). A lost swap (or create) calls `on_lost`, backs off
    and attempts again, until the back-off's deadline. Returns the result and how many
    attempts were lost."""
    wait: Callable[[], None] | None = None
    lost = 0
    while True:
        version, value, result = attempt()
        if value is None:
            return result, lost
        done = cas.create(cell, value) if version is None else cas.swap(cell, version, value)
        if done:
            return result, lost
        lost += 1
        if on_lost is not None:
            on_lost()
        if wait is None:
            wait = backoff.waits(what)
        wait()
