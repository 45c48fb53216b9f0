"""A failover's fence on datacenter keys (issue 30, item 7), on real Redis replication: the
replica cut off and promoted while a datacenter writes what it never gets, the primary killed
-9, writes not waited for (`unsafe_replication=1`, where the fence is the only line). Each
test runs the default gap and the negative control, a gap of 0 (no fence), which repeats ids
and is caught by the same check. The fence's arithmetic is in test_datacenter.py."""

from __future__ import annotations

from pathlib import Path

import idmint
from idmint import DatacenterRanges, Minter, Range, ReservationSizing

from checks import assert_disjoint
from replicated import redis_pair
from server_redis import RedisServer
from servers import wait_until

UNSAFE = "&unsafe_replication=1"


def _cut(primary: RedisServer, replica: RedisServer) -> None:
    """The replica has every write so far, then takes no more: promoted, as by an operator."""
    assert primary.client().wait(1, 5000) == 1
    replica.client().replicaof("NO", "ONE")
    wait_until(
        lambda: primary.client().info("replication")["connected_slaves"] == 0,
        10,
        "the replica to leave",
    )


def _take(minter: Minter, count: int) -> Range:
    """`count` ids (fewer at a reservation's end), once the preload the take started, if any,
    is in: so what the lost primary holds is the same on every run."""
    got = minter.take("k", count)
    dcs = minter.store
    assert isinstance(dcs, DatacenterRanges)
    wait_until(lambda: not dcs._preloading, 10, "the preload")
    return got


def _overlaps(ranges: list[Range]) -> bool:
    try:
        assert_disjoint(ranges)
    except AssertionError:
        return True
    return False


def test_a_datacenter_store_failover_never_applies_a_grant_again(tmp_path: Path) -> None:
    """The datacenter's own store (a Redis pair; the global level on SQLite) fails over,
    losing the application of grant 3 and the 50 ids served from it. The global cell keeps
    the grant; the fenced datacenter cell never applies it again, and takes a new one. On
    main, whatever the gap, the replica's cell applied grant 3 again: 50 of 50 ids twice."""
    sizing = ReservationSizing(min_reservation=100, max_reservation=100, preload_at=1)
    for gap, repeats in ((0, True), (None, False)):
        with redis_pair() as (primary, replica):
            global_url = f"sqlite:///{tmp_path}/global-{gap}.db"
            params = UNSAFE + ("" if gap is None else f"&failover_gap={gap}")
            with idmint.connect(global_url) as minter:
                minter.add_datacenter_key("k", step=10, sizing=sizing)
            local = primary.store_url("dc") + params
            with idmint.connect(global_url, dc="eu", dc_store=local) as minter:
                served = [_take(minter, 100)]  # grant 1, spent: grant 2 is loaded
            _cut(primary, replica)
            with idmint.connect(global_url, dc="eu", dc_store=local) as minter:
                served.append(_take(minter, 100))  # grant 2, spent: grant 3 is loaded
                served.append(_take(minter, 50))
            primary.kill()
            moved = replica.store_url("dc") + params
            with idmint.connect(global_url, dc="eu", dc_store=moved) as minter:
                served += [_take(minter, 50) for _ in range(3)]
        assert _overlaps(served) == repeats, (gap, served)


def test_a_global_store_failover_skips_every_grant_it_may_have_lost(tmp_path: Path) -> None:
    """The global store (a Redis pair; each datacenter's own on SQLite) fails over, losing
    grants 2 and 3 of us, which us applied and serves from its own store: reservations of 10
    million, the gap 1 million. eu's next grants, from the fenced global cell, stay clear of
    them. On main eu's third reservation was [31000001, 41000001), over us's second
    [30000001, 40000001): 9 million ids twice once both are served."""
    size = 10_000_000
    sizing = ReservationSizing(min_reservation=size, max_reservation=size)
    for gap, repeats in ((0, True), (None, False)):
        with redis_pair() as (primary, replica):
            params = UNSAFE + ("" if gap is None else f"&failover_gap={gap}")
            on_primary = primary.store_url("global") + params
            stores = {dc: f"sqlite:///{tmp_path}/{dc}-{gap}.db" for dc in ("eu", "us")}
            with idmint.connect(on_primary) as minter:
                minter.add_datacenter_key("k", step=10, sizing=sizing)
            with idmint.connect(on_primary, dc="eu", dc_store=stores["eu"]) as minter:
                served = [_take(minter, size)]  # grant 1, spent: grant 2 is loaded
            with idmint.connect(on_primary, dc="us", dc_store=stores["us"]) as minter:
                served.append(_take(minter, 10))
                _cut(primary, replica)
                served.append(_take(minter, size))  # grant 1's rest: grant 2 is loaded
                served.append(_take(minter, size))  # grant 2: grant 3 is loaded
            primary.kill()
            moved = replica.store_url("global") + params
            with idmint.connect(moved, dc="eu", dc_store=stores["eu"]) as minter:
                served += [_take(minter, size), _take(minter, size)]  # grant 2, then 3
            with idmint.connect(moved, dc="us", dc_store=stores["us"]) as minter:
                served.append(_take(minter, size))  # us's grant 3, from its own store
        assert _overlaps(served) == repeats, (gap, served)
