"""PostgreSQL failover and failback as HA managers do them (issue 30), under load: a primary
with a synchronous standby, the primary killed -9 and the standby promoted, the old primary
rewound with pg_rewind and attached as the new one's synchronous standby; then a switchover
back (the new primary stopped cleanly, the old one promoted, the other rewound and attached).
Then the same failover under Patroni. The recipe and the Patroni members are in
tests/postgres_ha.py.

Four threads take ids all along, each through a Minter of its own, on one URL naming both
servers with `target_session_attrs=read-write`: libpq tries them in turn and keeps the one
that takes writes, so the threads follow every switch by themselves. The outage of a switch
is the longest any thread went without an id.
"""

from __future__ import annotations

import itertools
import threading
import time

import idmint
from idmint import Range, StoreUnavailable
from idmint.stores.replication import failovers

from harness import Partition, duplicates
from postgres_ha import (
    PatroniNode,
    ha_pair,
    patroni_cluster,
    switch,
    wait_for_replay,
)
from servers import LOOPBACK, PostgresServer, wait_until

KEY = "k"


def _url(*servers: PostgresServer, params: str = "") -> str:
    """One URL for the servers, whichever is the primary (libpq tries each in turn)."""
    hosts = ",".join(f"{LOOPBACK}:{server.port}" for server in servers)
    return (
        f"postgresql://postgres@{hosts}/postgres"
        f"?target_session_attrs=read-write&connect_timeout=2{params}"
    )


class Load:
    """Threads taking a range of ten ids at a time straight from the store (every take is a
    write: no buffer hides an outage), each through a Minter of its own; every range kept
    with when it came. A context manager: the threads stop when the block ends."""

    def __init__(self, url: str, threads: int = 4) -> None:
        with idmint.connect(url) as minter:
            minter.add_key(KEY, step=10)
        self.taken: list[list[tuple[float, Range]]] = [[] for _ in range(threads)]
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(url, taken), daemon=True)
            for taken in self.taken
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        try:
            wait_until(lambda: all(self.taken), 20, "ids in every thread")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _run(self, url: str, taken: list[tuple[float, Range]]) -> None:
        with idmint.connect(url, timeout=2) as minter:
            while not self._stop.is_set():
                try:
                    got = minter.ranges.allocate(KEY).range
                except StoreUnavailable:
                    self._stop.wait(0.02)
                    continue
                taken.append((time.monotonic(), got))

    def ids(self) -> list[int]:
        return [i for taken in self.taken for _, got in taken for i in got]

    def wait_for_ids_after(self, moment: float) -> None:
        """Until every thread has taken ids after `moment` (30 s at most)."""
        wait_until(
            lambda: all(taken[-1][0] > moment for taken in self.taken),
            30,
            "ids in every thread",
        )

    def first_after(self, moment: float) -> float:
        """When the first thread to do so took ids after `moment`."""
        return min(at for taken in self.taken for at, _ in taken if at > moment)

    def outage(self, since: float, until: float) -> float:
        """The longest any thread went without ids, of the stretches that ended in
        (since, until]."""
        return max(
            b - a
            for taken in self.taken
            for (a, _), (b, _) in itertools.pairwise(taken)
            if since < b <= until
        )


def _assert_no_repeats_and_fenced(
    load: Load, fenced_before: int, lineages: list[tuple[str, str]]
) -> None:
    """No id taken twice, and the failovers this process fenced since it had fenced
    `fenced_before` went from and to these lineages (the store's, the new primary's)."""
    ids = load.ids()
    assert ids and not duplicates(ids), duplicates(ids)[:10]
    fences = [(f.recorded, f.lineage) for f in failovers()[fenced_before:]]
    assert fences == lineages, fences


def test_a_failover_and_a_switchover_back_repeat_no_id() -> None:
    """The default configuration. Each switch is fenced (a new timeline), and the new
    primary, alone, serves nothing: the store has waited for one replica. Ids come again only
    once the old primary, rewound, is started as its standby. No id repeats. The outages are
    printed (-s)."""
    fenced_before = len(failovers())
    with ha_pair() as (a, b), Load(_url(a, b)) as load:
        failover = switch(a, b, crash=True)
        load.wait_for_ids_after(failover.attached)
        switchover = switch(b, a, crash=False)
        load.wait_for_ids_after(switchover.attached)
        ended = time.monotonic()
    for done in (failover, switchover):
        assert load.first_after(done.promoted) >= done.rewound, done
    outages = (load.outage(failover.began, switchover.began), load.outage(switchover.began, ended))
    print(
        f"\nfailover (kill -9): promoted after {failover.promoted - failover.began:.2f} s, "
        f"the old primary attached after {failover.attached - failover.began:.2f} s, "
        f"outage {outages[0]:.2f} s; switchover back: promoted after "
        f"{switchover.promoted - switchover.began:.2f} s, attached after "
        f"{switchover.attached - switchover.began:.2f} s, outage {outages[1]:.2f} s"
    )
    _assert_no_repeats_and_fenced(
        load, fenced_before, [("timeline 1", "timeline 2"), ("timeline 2", "timeline 3")]
    )


def test_the_negative_control_repeats_ids_and_the_checker_sees_them() -> None:
    """The same failover with an asynchronous standby that the URL accepts with no gap
    (`unsafe_replication=1&failover_gap=0`), its link cut (iptables) a second before the
    kill: the promoted standby lacks the ranges handed out after the cut, and hands them out
    again. The failover is fenced all the same (with a gap of 0)."""
    link = "127.0.0.46"  # the standby follows the primary on this address only: cut apart
    fenced_before = len(failovers())
    url_params = "&unsafe_replication=1&failover_gap=0"
    with (
        ha_pair(synchronous=False, link=link) as (a, b),
        Partition() as partition,
        Load(_url(a, b, params=url_params)) as load,
    ):
        wait_for_replay(a, b)  # the key and some ranges on the standby: else nothing repeats
        partition.cut_address(link, a.port)
        time.sleep(1.0)
        switch(a, b, crash=True)
        wait_until(lambda: duplicates(load.ids()), 30, "ids handed out again")
    assert duplicates(load.ids())
    assert [f.lineage for f in failovers()[fenced_before:]] == ["timeline 2"]


def _kill_the_leader(leader: PatroniNode, standby: PatroniNode) -> tuple[float, float]:
    """Kill -9 the leader's Patroni and PostgreSQL; when (monotonic s) that was, and when
    Patroni had promoted the standby (once the leader's key expired in etcd: the test
    expires it at once instead of waiting its ttl out)."""
    began = time.monotonic()
    leader.kill()
    leader.expire_leader_key()
    wait_until(lambda: standby.answers("/primary"), 60, "Patroni to promote the standby")
    return began, time.monotonic()


def test_a_patroni_failover_repeats_no_id() -> None:
    """Two members under Patroni (synchronous_mode, not strict) on one etcd, the leader's
    Patroni and PostgreSQL killed -9 under load. Patroni promotes the synchronous standby,
    with no synchronous standby of its own: alone, it serves nothing (the store has waited
    for one replica). The old leader's Patroni, started again, rewinds it and makes it the
    new leader's synchronous standby; ids come again only after that restart. The failover
    is fenced, and no id repeats. The outage is printed (-s)."""
    fenced_before = len(failovers())
    with (
        patroni_cluster({"synchronous_mode": True}) as (leader, standby),
        Load(_url(leader, standby)) as load,
    ):
        began, promoted = _kill_the_leader(leader, standby)
        leader.start()  # returns once its PostgreSQL answers (Patroni starts it read-only)
        restarted = time.monotonic()
        wait_until(lambda: leader.answers("/sync"), 60, "the old leader to be synchronous")
        attached = time.monotonic()
        load.wait_for_ids_after(attached)
        ended = time.monotonic()
    resumed = load.first_after(promoted)
    assert resumed >= restarted  # not the new leader alone: it would serve at once
    print(
        f"\npatroni failover (kill -9): promoted after {promoted - began:.2f} s, ids again "
        f"after {resumed - began:.2f} s, the old leader synchronous after "
        f"{attached - began:.2f} s; outage {load.outage(began, ended):.2f} s"
    )
    _assert_no_repeats_and_fenced(load, fenced_before, [("timeline 1", "timeline 2")])


def test_the_patroni_negative_control_repeats_ids_and_the_checker_sees_them() -> None:
    """The same Patroni failover with asynchronous replication (synchronous_mode off, and
    any lag accepted: maximum_lag_on_failover 1 GiB), the URL accepting it with no gap,
    and the standby's link to the leader cut a second before the kill: the promoted standby
    lacks the ranges handed out after the cut, and hands them out again."""
    link = "127.0.0.47"  # standbys follow the leader on this address only: cut apart
    fenced_before = len(failovers())
    dcs: dict[str, object] = {"synchronous_mode": False, "maximum_lag_on_failover": 2**30}
    with (
        patroni_cluster(dcs, link=link) as (leader, standby),
        Partition() as partition,
        Load(_url(leader, standby, params="&unsafe_replication=1&failover_gap=0")) as load,
    ):
        wait_for_replay(leader, standby)  # the key and some ranges there: else nothing repeats
        partition.cut_address(link, leader.port)
        time.sleep(1.0)
        _kill_the_leader(leader, standby)
        wait_until(lambda: duplicates(load.ids()), 30, "ids handed out again")
    assert duplicates(load.ids())
    assert [f.lineage for f in failovers()[fenced_before:]] == ["timeline 2"]
