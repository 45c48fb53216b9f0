"""A datacenter's store is where its cell's compare-and-sets are decided, not only which store
identity it has: one Cassandra keyspace decided at SERIAL, or at LOCAL_SERIAL in one datacenter
or another, is as many stores. The torture harness found processes named dc2 served from dc1's
Paxos group beside dc2's own, bound to the one keyspace's identity and accepted, repeating ids
(`bench/torture.py --setup cassandra-2dc --unsafe`, seed 1, before the fix: 5,190 ids twice).

On the session's one-node Cassandra (SimpleSnitch: datacenter "datacenter1")."""

from __future__ import annotations

import os
from typing import Any

import pytest

import idmint
from idmint import InvalidArgument, ReservationSizing

DC = "datacenter1"


def _url(cassandra_server: Any, name: str) -> str:
    url: str = cassandra_server.store_url(f"{name}_{os.getpid()}")
    return url


def test_a_datacenter_store_deciding_in_another_datacenter_is_refused_at_once(
    cassandra_server: Any,
) -> None:
    url = _url(cassandra_server, "dcscope_open")
    with idmint.connect(url) as minter:
        elsewhere = f"{url}?dc=dc9&serial=LOCAL_SERIAL"
        with pytest.raises(InvalidArgument, match=r"LOCAL_SERIAL in datacenter 'dc9', not in"):
            minter.datacenters(DC, dc_store=elsewhere)
        with pytest.raises(InvalidArgument, match="whichever datacenter it reaches"):
            minter.datacenters(DC, dc_store=f"{url}?serial=LOCAL_SERIAL")  # whichever it reaches


def test_one_keyspace_at_serial_and_at_local_serial_is_two_stores(cassandra_server: Any) -> None:
    """Bound at SERIAL, the datacenter refuses a process at LOCAL_SERIAL at its first read of
    the datacenter's cell, which names the store that last wrote it: before the cell did, the
    binding was checked only with a grant, and such a process served from the cell as it found
    it until its next grant (the gap the torture harness's cassandra-2dc control showed)."""
    url = _url(cassandra_server, "dcscope_bind")
    with idmint.connect(url, timeout=10) as minter:
        minter.add_datacenter_key(
            "k", step=100, sizing=ReservationSizing(min_reservation=1000, max_reservation=1000)
        )
        # The first process binds the datacenter to the keyspace decided at SERIAL...
        at_serial = minter.datacenter("k", DC, dc_store=url)
        assert at_serial.next_id() >= 1
        # ...so the same keyspace at LOCAL_SERIAL (the default) is another store: refused at
        # its first take, with the reservation still holding ids, naming both.
        with idmint.connect(url, timeout=10) as other:
            local = other.datacenter("k", DC)
            with pytest.raises(
                InvalidArgument,
                match=r"last written through store .*\(SERIAL\), not .*LOCAL_SERIAL",
            ):
                local.next_ids(100)
        assert at_serial.next_id() >= 1  # the datacenter's own processes serve on
        # Moved on purpose (`idmint dc reset`), the datacenter serves from its new store.
        minter.datacenters(DC).reset("k")
        with idmint.connect(url, timeout=10) as other:
            assert other.datacenter("k", DC).next_ids(100)
