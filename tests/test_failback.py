"""Failback (issue 30): the old primary comes back as a primary, alone, after the promoted
replica served and died (keepalived `preempt`, Patroni's non-strict synchronous mode, an
operator). It knows nothing of what the promoted one handed out. On main the PostgreSQL
primary was not fenced at all (its own row said timeline 1) and the Redis one was fenced by
the same gap from the same base as the replica had been: 50 of 50 ids handed out again.

Now a store keeps the most replicas its writes have waited for, and a fence never lowers that:
a primary that comes back alone refuses to write until an operator says the others are gone
(`idmint replicas --set`), which it cannot have done on a copy that never saw the promoted
one's history. The negative controls let writes go on with fewer replicas (`fewer_replicas=1`,
or `unsafe_replication=1`, which implies it) with a small gap, and the check catches the
repeats."""

from __future__ import annotations

import pytest

import idmint
from idmint import StoreUnavailable

from replicated import postgres_pair, redis_pair
from servers import wait_until

GAP = 20  # the fence's gap here: small, so that 50 ids on a fenced branch reach past it


def _take(minter: idmint.Minter, count: int) -> list[int]:
    return [i for _ in range(count // 10) for i in minter.ranges.allocate("k").range]


@pytest.mark.parametrize("fewer", [False, True], ids=["default", "fewer-replicas"])
def test_a_postgres_primary_that_fails_back_alone_serves_nothing(fewer: bool) -> None:
    extra = f"?failover_gap={GAP}" + ("&fewer_replicas=1" if fewer else "")
    with postgres_pair(synchronous=True) as (primary, standby):
        with idmint.connect(primary.url() + extra, timeout=3) as minter:
            minter.add_key("k", step=10)
            first = _take(minter, 10)
        primary.kill()
        standby.promote()
        wait_until(lambda: not standby.in_recovery(), 30, "the promotion")
        with idmint.connect(standby.url() + extra, timeout=3) as minter:
            if not fewer:  # alone, it waits for the operator
                with pytest.raises(StoreUnavailable, match="has waited for 1"):
                    minter.ranges.allocate("k")
                assert minter.set_required_replicas(0) == 1
            served = _take(minter, 50)
        standby.kill()
        # The old primary restarts as a primary with its standby list emptied.
        primary.extra_settings["synchronous_standby_names"] = ""
        primary.start()
        with idmint.connect(primary.url() + extra, timeout=3) as minter:
            if not fewer:
                with pytest.raises(StoreUnavailable, match="has waited for 1"):
                    minter.ranges.allocate("k")
                return
            again = _take(minter, 50)
    assert not set(first) & set(served)
    assert set(again) & set(served)  # the negative control: the checker sees the repeats


@pytest.mark.parametrize(
    "control",
    ["", "&fewer_replicas=1", "&unsafe_replication=1"],
    ids=["default", "fewer", "unsafe"],
)
def test_a_redis_primary_that_fails_back_alone_serves_nothing(control: str) -> None:
    extra = f"&failover_gap={GAP}" + control
    fewer = bool(control)  # writes go on alone
    with redis_pair() as (primary, replica):
        with idmint.connect(primary.store_url("fb") + extra, timeout=2) as minter:
            minter.add_key("k", step=10)
            first = _take(minter, 10)
        assert primary.client().wait(1, 5000) == 1
        primary.kill()
        replica.client().replicaof("NO", "ONE")
        with idmint.connect(replica.store_url("fb") + extra, timeout=2) as minter:
            if not fewer:
                with pytest.raises(StoreUnavailable, match=r"0 replica.* has waited for 1"):
                    minter.ranges.allocate("k")
                assert minter.set_required_replicas(0) == 1
            served = _take(minter, 50)
        replica.kill()
        primary.start()  # alone, from its append-only file: a new replication id
        with idmint.connect(primary.store_url("fb") + extra, timeout=2) as minter:
            if not fewer:
                with pytest.raises(StoreUnavailable, match=r"0 replica.* has waited for 1"):
                    minter.ranges.allocate("k")
                return
            again = _take(minter, 50)
    assert not set(first) & set(served)
    assert set(again) & set(served)
