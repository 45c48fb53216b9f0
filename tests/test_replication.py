"""Replicated stores (issue 20): idmint reads each engine's replication, on real replication
set up with the engines' own tools on loopback (tests/replicated.py)."""

from __future__ import annotations

from typing import Any

import pytest

import idmint
from idmint import InvalidArgument, StoreUnavailable
from idmint.stores import open_engine
from idmint.stores.replication import PRIMARY, STANDALONE

from replicated import postgres_pair, redis_pair


def _replication(url: str) -> Any:
    engine = open_engine(url, timeout=5)
    try:
        return engine.ranges().replication()  # type: ignore[attr-defined]
    finally:
        engine.close()


def test_postgres_replication_is_read_on_the_primary_and_the_standby() -> None:
    """An asynchronous standby is a risk the primary reports, refused unless the URL accepts
    it (on main nothing warned, and a failover repeated 179,995 ids); a standby is refused as
    a store (it takes no writes: on main the first write failed with psycopg's
    ReadOnlySqlTransaction); a promoted standby is a primary on a new timeline."""
    with postgres_pair(synchronous=False) as (primary, standby):
        with pytest.raises(InvalidArgument, match=r"writes wait for 0.*\?unsafe_replication=1"):
            _replication(primary.url())  # refused: the standby is not waited for
        on_primary = _replication(primary.url() + "?unsafe_replication=1")
        assert on_primary.role == PRIMARY and on_primary.replicas == 1
        assert on_primary.waits_for == 0 and "wait for 0" in on_primary.risk
        assert on_primary.lineage == "timeline 1"
        with pytest.raises(StoreUnavailable, match=r"is a replica \(in recovery.*takes no writes"):
            _replication(standby.url())
        standby.promote()
        promoted = _replication(standby.url())
        assert promoted.role == STANDALONE and promoted.lineage == "timeline 2", promoted
        assert promoted.risk is None


def test_a_synchronous_standby_is_waited_for() -> None:
    with postgres_pair(synchronous=True) as (primary, _):
        state = _replication(primary.url())
        assert (state.role, state.replicas, state.waits_for, state.risk) == (PRIMARY, 1, 1, None)
        assert "synchronous_standby_names='standby'" in state.detail


def test_redis_writes_wait_for_the_replica_and_one_it_did_not_confirm_is_not_used() -> None:
    """On main a range write was acknowledged once the primary had it: a failover to a
    replica that lacked it handed the range out again. Now each write waits (WAIT) for every
    replica the primary has had; with the replica frozen (its link open, silent), the write
    is reported unavailable and its range never used: the next one starts above it."""
    with redis_pair() as (primary, replica):
        url = primary.store_url("wait")
        engine = open_engine(url, timeout=2)
        try:
            state = engine.cas().replication()  # type: ignore[attr-defined]
            assert (state.role, state.replicas, state.waits_for, state.risk) == (
                PRIMARY,
                1,
                1,
                None,
            )
        finally:
            engine.close()
        with idmint.connect(url, timeout=2) as minter:
            minter.add_key("k", step=10)
            first = minter.ranges.allocate("k").range
            replica.pause()
            try:
                with pytest.raises(StoreUnavailable, match=r"reached 0 of 1 replica"):
                    minter.ranges.allocate("k")
            finally:
                replica.resume()
            after = minter.ranges.allocate("k").range
            assert after.start >= first.stop + 10, (first, after)  # the unconfirmed one: skipped
