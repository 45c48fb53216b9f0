"""The clock offset estimator: round trips bound the offset, and bounds are intersected."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest

from idmint.stores import open_lease_store
from idmint.strategies.clock_offset import KEEP, ClockOffset
from idmint.strategies.snowflake import SnowflakeGenerator, SnowflakeOptions


def test_one_round_trip_bounds_the_offset() -> None:
    clock = ClockOffset()
    assert clock.current() is None
    # sent at 1000, answered at 1010 (local), the store read 6000: offset about +5 s
    offset = clock.add(sent_ms=1000, received_ms=1010, store_ms=6000)
    assert (offset.low_ms, offset.high_ms) == (4989, 5001)
    assert offset.ms == 4995 and offset.error_ms == 6
    assert offset.surely_beyond(1000) and not offset.surely_beyond(5000)


def test_whole_second_readings_narrow_as_samples_come_in() -> None:
    # A store 1234.5 ms ahead, read through a whole-second Date header by 2 ms round trips
    # every 3.337 s (a renewal every ttl/3): each alone bounds it to a second; together they
    # close in on it as their phases within the second differ.
    true_offset = 1234.5
    clock = ClockOffset()
    for local in range(10_000, 10_000 + KEEP * 3337, 3337):
        store = int((local + 1 + true_offset) // 1000 * 1000)
        offset = clock.add(sent_ms=local, received_ms=local + 2, store_ms=store, step_ms=1000)
        assert offset.low_ms <= true_offset <= offset.high_ms
    assert offset.error_ms < 200


def test_a_stepped_clock_drops_the_samples_that_disagree() -> None:
    clock = ClockOffset()
    for local in range(0, 5000, 1000):
        clock.add(sent_ms=local, received_ms=local + 1, store_ms=local + 20)
    assert abs(clock.add(sent_ms=9000, received_ms=9001, store_ms=9020).ms - 20) <= 1
    # the local clock steps back 2 s: the store now reads 2 s ahead of it
    stepped = clock.add(sent_ms=8000, received_ms=8001, store_ms=10_020)
    assert abs(stepped.ms - 2020) <= 1
    assert clock.current() == stepped


def test_the_generator_measures_its_offset_from_the_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # This generator's clock runs 5 s behind the machine's; SQLite reads the machine's.
    store = open_lease_store(f"sqlite:///{tmp_path}/flakes.db")
    caplog.set_level(logging.WARNING, "idmint.snowflake")
    gen = SnowflakeGenerator(
        store,
        options=SnowflakeOptions(ttl=3),
        clock_ns=lambda: time.time_ns() - 5_000_000_000,
    )
    try:
        gen.next_id()
        stats = gen.stats()
        assert stats["clock_offset_ms"] == pytest.approx(5000, abs=50)
        error = stats["clock_offset_error_ms"]
        assert isinstance(error, float) and 0 < error < 50
        assert re.search(r"clock is -(49|50)\d\d ms", caplog.text)  # logged: ours is behind
    finally:
        gen.close()
        store.close()


def test_no_offset_from_a_store_without_a_clock() -> None:
    with SnowflakeGenerator(open_lease_store("memory://")) as gen:
        gen.next_id()
        assert gen.stats()["clock_offset_ms"] is None
