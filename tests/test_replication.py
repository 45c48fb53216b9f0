"""Replicated stores (issue 20): idmint reads each engine's replication, on real replication
set up with the engines' own tools on loopback (tests/replicated.py)."""

from __future__ import annotations

from typing import Any

import pytest

from idmint import StoreUnavailable
from idmint.stores import open_engine
from idmint.stores.replication import PRIMARY, STANDALONE

from replicated import postgres_pair


def _replication(url: str) -> Any:
    engine = open_engine(url, timeout=5)
    try:
        return engine.ranges().replication()  # type: ignore[attr-defined]
    finally:
        engine.close()


def test_postgres_replication_is_read_on_the_primary_and_the_standby() -> None:
    """An asynchronous standby is a risk the primary reports; a standby is refused as a store
    (it takes no writes: on main the first write failed with psycopg's ReadOnlySqlTransaction);
    a promoted standby is a primary on a new timeline (its lineage changed)."""
    with postgres_pair(synchronous=False) as (primary, standby):
        on_primary = _replication(primary.url())
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
