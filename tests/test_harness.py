"""The fault harness's own checks: each checker finds what it is for, on histories made by hand,
and a cut made with iptables stops traffic until healed."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from idmint import Range

from harness import (
    History,
    Op,
    Partition,
    duplicates,
    heal_all,
    outside,
    overlaps,
    parse,
    real_time_violations,
    strays,
)
from servers import free_port


def test_the_recorder_reads_what_a_worker_printed_and_skips_torn_lines() -> None:
    ops, ranges = parse(
        "p",
        "R 1 51\nO 1.0 1.5 1\nE 2.0 2.1 RunwaySpent\nR 51 101\nG 60 101\nO 3.0 3.",
    )
    assert ops == [Op("p", 1.0, 1.5, value=1), Op("p", 2.0, 2.1, error="RunwaySpent")]
    assert ranges == [Range(1, 51), Range(51, 60)]  # the give-back trimmed the second


def test_a_give_back_may_span_two_ranges() -> None:
    _, ranges = parse("p", "R 1 51\nR 51 101\nG 40 101\n")
    assert ranges == [Range(1, 40)]


def test_the_checkers_find_repeats_strays_and_overlaps() -> None:
    assert duplicates([1, 2, 3, 2, 1]) == [1, 2]
    assert duplicates(range(100)) == []
    assert outside([0, 1, 5, 11], 1, 10) == [0, 11]
    assert overlaps([("a", Range(1, 10)), ("b", Range(10, 20))]) == []
    found = overlaps([("a", Range(1, 10)), ("b", Range(20, 30)), ("c", Range(9, 12))])
    assert [(x, y) for x, _, y, _ in found] == [("a", "c")]
    hist = History(
        [Op("a", 0, 1, value=5), Op("a", 1, 2, value=15), Op("b", 1, 2, value=15)],
        {"a": [Range(1, 10)], "b": [Range(10, 20)]},
    )
    assert strays(hist) == [Op("a", 1, 2, value=15)]


def test_the_real_time_checker_finds_an_id_lower_than_one_returned_before() -> None:
    ok = [
        Op("a", 0.0, 1.0, value=1),
        Op("b", 0.5, 3.0, value=3),  # overlaps c: either order is fine
        Op("c", 0.6, 2.0, value=2),
        Op("a", 3.5, 4.0, value=4),
    ]
    assert real_time_violations(ok) == []
    late = Op("d", 2.5, 2.6, value=2)  # began after c returned 2: must be above it
    found = real_time_violations([*ok, late])
    assert (Op("c", 0.6, 2.0, value=2), late) in found
    assert all(b == late for _, b in found)


@pytest.mark.skipif(sys.platform != "linux", reason="iptables")
def test_a_cut_drops_traffic_to_an_address_until_healed() -> None:
    heal_all()
    port = free_port()
    address = "127.0.0.14"
    server = socket.create_server((address, port))
    try:
        with Partition() as cut:
            cut.cut_address(address, port)
            with pytest.raises(TimeoutError):  # the SYN is dropped: nobody refuses
                socket.create_connection((address, port), timeout=0.5).close()
            rules = subprocess.run(["iptables", "-S", "OUTPUT"], capture_output=True, text=True)
            assert address in rules.stdout
        socket.create_connection((address, port), timeout=2).close()
        rules = subprocess.run(["iptables", "-S", "OUTPUT"], capture_output=True, text=True)
        assert address not in rules.stdout
    finally:
        server.close()


def test_heal_all_removes_what_a_killed_run_left() -> None:
    left = Partition()  # never healed, as after a kill -9 of the test run
    left.cut_address("127.0.0.15", free_port())
    heal_all()
    rules = subprocess.run(["iptables", "-S", "OUTPUT"], capture_output=True, text=True)
    assert "idmint-test-partition" not in rules.stdout
