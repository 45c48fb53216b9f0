"""The QuorumNode contract (set-if-less-than counters), on every engine that has it, on real
servers: what `open_engine(url).quorum()` promises."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from idmint import InvalidArgument, StoreUnavailable
from idmint.stores import open_engine
from idmint.stores.base import QuorumNode
from idmint.stores.redis.quorum import RedisQuorumNode, parse_claim_answer

from checks import run_threads
from conftest import fresh_store_url

QUORUM_STORES = ("memory", "sqlite", "postgres", "mariadb", "redis", "etcd", "zookeeper")


@pytest.fixture(params=QUORUM_STORES)
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[QuorumNode]:
    engine = open_engine(fresh_store_url(request.param, request, tmp_path))
    yield engine.quorum()
    engine.close()


def test_a_counter_starts_at_zero_and_moves_only_up(node: QuorumNode) -> None:
    assert isinstance(node, QuorumNode)
    assert node.read("k") == 0
    assert node.claim("k", 1, 10) == (True, 10)
    assert node.read("k") == 10
    assert node.claim("k", 10, 20) == (False, 10)  # start not above the counter
    assert node.claim("k", 5, 50) == (False, 10)
    assert node.read("k") == 10
    assert node.claim("k", 11, 11) == (True, 11)
    assert node.read("other") == 0  # keys are apart
    assert node.claim("K", 1, 1) == (True, 1)  # and case tells them apart (MySQL too)
    assert node.read("k") == 11


def test_counters_past_2_to_the_53_compare_exactly(node: QuorumNode) -> None:
    big = 2**60
    assert node.claim("big", big, big + 5) == (True, big + 5)
    assert node.claim("big", big + 5, big + 6) == (False, big + 5)  # a double would round
    assert node.claim("big", big + 6, 2**63 - 2) == (True, 2**63 - 2)
    assert node.claim("big", 10**18, 10**18) == (False, 2**63 - 2)  # fewer digits
    assert node.read("big") == 2**63 - 2


def test_one_claim_per_start_wins_among_racing_threads(node: QuorumNode) -> None:
    wins: list[int] = []
    lock = threading.Lock()

    def race() -> None:
        for start in range(1, 41):
            applied, _ = node.claim("race", start, start)
            if applied:
                with lock:
                    wins.append(start)

    run_threads(race, 6)
    assert sorted(wins) == list(range(1, 41))  # each start taken once, none twice


def test_durability_and_identity_are_reported(
    node: QuorumNode, request: pytest.FixtureRequest
) -> None:
    engine = request.node.callspec.params["node"]
    why = node.durability()
    if engine == "memory":
        assert why is not None and "while this process runs" in why
    elif engine == "postgres":  # the test server runs with fsync=off, for speed
        assert why == "PostgreSQL runs with fsync=off"
    else:  # Redis here runs appendfsync always; the others fsync by default
        assert why is None, why
    assert node.identity() is not None


def test_a_redis_node_names_weak_persistence() -> None:
    from server_redis import RedisServer

    weak = RedisServer(host="127.0.0.1", appendfsync="everysec")
    weak.start()
    try:
        engine = open_engine(weak.store_url("w"))
        assert engine.quorum().durability() == "Redis runs with appendfsync everysec"
        engine.close()
    finally:
        weak.close()
    volatile = RedisServer(appendfsync=None)
    volatile.start()
    try:
        engine = open_engine(volatile.store_url("v"))
        assert engine.quorum().durability() == "Redis runs with appendonly no"
        engine.close()
    finally:
        volatile.close()


def test_engines_without_quorum_nodes_say_which_have_them(tmp_path: Path) -> None:
    engine = open_engine("cassandra://127.0.0.1:1/ks")
    with pytest.raises(InvalidArgument, match=r"no quorum nodes.*redis"):
        engine.quorum()


def test_a_redis_node_s_multiplexed_claims_go_as_resp_on_its_socket(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The claims of a round (send_claim, receive_claim) go as RESP bytes on the claim
    connection's socket, not through redis-py's command path (half the CPU of a round)."""
    engine = open_engine(fresh_store_url("redis", request, tmp_path))
    node = engine.quorum()
    assert isinstance(node, RedisQuorumNode)
    node.mux_connect()
    node.send_claim("k", 2**60, 2**63 - 2)
    assert node.receive_claim() == (True, 2**63 - 2, 2**60)
    node.send_claim("k", 5, 9)
    assert node.receive_claim() == (False, 2**63 - 2, 5)
    assert node.read("k") == 2**63 - 2
    engine.close()


def test_a_placed_claim_goes_just_above_the_counter_within_its_limit(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A placed claim (a limit): at its start while the counter is below, else just above
    the counter, added as decimal text (Lua's doubles would round past 2^53; the ACL rule has
    no INCRBY), and refused once its start would pass the limit."""
    engine = open_engine(fresh_store_url("redis", request, tmp_path))
    node = engine.quorum()
    assert isinstance(node, RedisQuorumNode)
    node.mux_connect()
    node.send_claim("p", 10, 19, 1000)
    assert node.receive_claim() == (True, 19, 10)  # below: at its start
    node.send_claim("p", 10, 19, 1000)
    assert node.receive_claim() == (True, 29, 10)  # [20, 29]: just above the counter
    node.send_claim("p", 2**60 + 1, 2**60 + 3, 2**62)
    assert node.receive_claim() == (True, 2**60 + 3, 2**60 + 1)
    node.send_claim("p", 5, 7, 2**62)
    assert node.receive_claim() == (True, 2**60 + 6, 5)  # exact past 2^53
    node.send_claim("p", 5, 7, 2**60 + 6)  # its start would be 2^60 + 7: past the limit
    assert node.receive_claim() == (False, 2**60 + 6, 5)
    assert node.claim("p", 2**60 + 7, 2**60 + 7) == (True, 2**60 + 7)  # exact: limit = start
    assert node.claim("p", 2**60 + 7, 2**60 + 8) == (False, 2**60 + 7)
    for counter, count in ((999, 1), (99_999_999, 12_345), (2**62 - 1, 2**62 - 5)):
        node.send_claim(f"c{counter}", 1, counter, 2**63)
        assert node.receive_claim() == (True, counter, 1)  # the counter, set as it is
        node.send_claim(f"c{counter}", 1, count, 2**63)
        assert node.receive_claim() == (True, counter + count, 1)  # carried digit by digit
    engine.close()


def test_claim_answers_are_read_whole_and_errors_named() -> None:
    whole = b"*3\r\n:1\r\n$19\r\n9223372036854775806\r\n$1\r\n5\r\n"
    for cut in range(len(whole)):  # an answer that has come in part
        assert parse_claim_answer(whole[:cut]) is None, whole[:cut]
    assert parse_claim_answer(whole) == (True, 2**63 - 2, 5)
    assert parse_claim_answer(b"*3\r\n:0\r\n$2\r\n10\r\n$1\r\n5\r\n") == (False, 10, 5)
    with pytest.raises(StoreUnavailable, match="BUSY Redis is busy"):
        parse_claim_answer(b"-BUSY Redis is busy running a script\r\n")
    with pytest.raises(ValueError, match="past the claim"):
        parse_claim_answer(whole + b":1\r\n")
    with pytest.raises(ValueError, match="not the claim"):
        parse_claim_answer(b"+OK\r\n")
