"""A member of a three-member cluster cut from its peers (clusters.py, isolate(): the torture
harness's "split") is cut both ways, its clients still reach it, and heal() ends the cut.

On loopback every connection comes from 127.0.0.1, so a cut by address alone is one way only
(see clusters.py): these read the members' own view to tell. A leader cut off both ways loses
its followers (they elect another: what it sends is cut) and never hears of the new leader
(what they send is cut); a follower cut off loses its leader, and the other two keep serving.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

from clusters import EtcdCluster, EtcdMember, ZooKeeperEnsemble, loopback_addresses

from servers import wait_until


def _etcd_view(member: EtcdMember) -> tuple[int, str] | None:
    """(raft term, leader id; "0" for none) as the member tells its clients; None if no
    answer (proto3 JSON leaves zero values out: a member without a leader has no "leader")."""
    try:
        status: dict[str, Any] = member.status()
    except (OSError, ValueError):
        return None
    return int(status.get("raftTerm", 0)), str(status.get("leader", "0"))


def _leader(member: EtcdMember) -> str:
    return (_etcd_view(member) or (0, ""))[1]


def _stays(predicate: Callable[[], bool], seconds: float = 1.5) -> bool:
    """True throughout `seconds` (a cut that leaks ends sooner or later: a member rejoins)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not predicate():
            return False
        time.sleep(0.1)
    return True


def _reachable(address: str, port: int) -> bool:
    with socket.create_connection((address, port), timeout=2):
        return True


def test_an_etcd_member_cut_from_its_peers_is_cut_both_ways() -> None:
    with EtcdCluster(3, addresses=loopback_addresses(3, first=91), cgroups=True) as cluster:
        leader = cluster.leader()
        follower = next(m for m in cluster.members if m is not leader)
        others = [m for m in cluster.members if m is not follower]
        with follower.isolate():
            # peers -> it cut: it hears no leader (heartbeats every 50 ms, elections after 500)
            wait_until(lambda: _leader(follower) == "0", 10, "the follower to lose its leader")
            assert _stays(lambda: _leader(follower) == "0")
            # the other two keep a quorum (a busy machine may make them hold an election)
            assert all(m.serving() for m in others)
            assert _reachable(follower.address, follower.port)  # clients still reach it
        wait_until(follower.serving, 30, "the follower to rejoin")

        leader = cluster.leader()
        with leader.isolate():
            # it -> peers cut: the others elect a leader of their own
            wait_until(lambda: cluster.leader() is not leader, 15, "another leader")
            # peers -> it cut: it never hears of the new leader (CheckQuorum: it steps down)
            wait_until(lambda: _leader(leader) == "0", 10, "the old leader to step down")
            assert _stays(lambda: _leader(leader) == "0")
            assert _reachable(leader.address, leader.port)
        wait_until(leader.serving, 30, "the old leader to rejoin")
        cluster.wait_ready(30)


def test_a_zookeeper_member_cut_from_its_peers_is_cut_both_ways() -> None:
    with ZooKeeperEnsemble(3, addresses=loopback_addresses(3, first=94), cgroups=True) as zk:
        leader = zk.leader()
        follower = next(m for m in zk.members if m is not leader)
        with follower.isolate():
            # peers -> it cut: the leader's pings stop, it leaves the quorum (looking: no answer)
            wait_until(lambda: follower.mode() is None, 15, "the follower to lose its leader")
            assert _stays(lambda: follower.mode() is None)
            assert leader.mode() == "leader"  # the other two keep their quorum
            assert _reachable(follower.address, follower.port)
        wait_until(lambda: follower.mode() == "follower", 30, "the follower to rejoin")

        with leader.isolate():
            # it -> peers cut: the others elect another leader; peers -> it: it never joins
            wait_until(
                lambda: any(m.mode() == "leader" for m in zk.members if m is not leader),
                30,
                "another leader",
            )
            wait_until(lambda: leader.mode() is None, 15, "the old leader to step down")
            assert _stays(lambda: leader.mode() is None)
            assert _reachable(leader.address, leader.port)
        wait_until(lambda: leader.mode() == "follower", 30, "the old leader to follow")
        zk.wait_ready(30)
