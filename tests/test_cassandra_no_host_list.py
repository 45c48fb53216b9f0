"""A Cassandra session whose first connection pools all fail is StoreUnavailable, not a crash.

The torture harness found it (bench/torture.py --setup cassandra-2dc --seconds 180 --seed 21):
when the driver's control connection reached a node but no pool could be opened (nodes killed,
paused and cut at that moment), Session() raised NoHostAvailable with the nodes' addresses in a
list, where every other NoHostAvailable carries a dict of each node's error. Mapping it read the
list as a dict: AttributeError escaped from every call of that process (`minter.take` on a
datacenter key, a refill thread), instead of the typed, retried StoreUnavailable, and the
client never served again.

The driver's own exception, in both shapes it raises, goes through the engine's mapping; no
server is needed (the engine connects lazily, and the mapping does no I/O).
"""

from __future__ import annotations

from cassandra.cluster import NoHostAvailable

from idmint import StoreUnavailable
from idmint.stores import open_engine
from idmint.stores.cassandra import CassandraCasStore

URL = "cassandra://127.0.0.1:1/nowhere?dc=dc1"


def _mapped(exc: Exception) -> Exception:
    engine = open_engine(URL, timeout=1)
    try:
        store = engine.cas()
        assert isinstance(store, CassandraCasStore)
        return store._conn.error(exc)  # the mapping every driver error goes through
    finally:
        engine.close()


def test_no_host_with_the_addresses_in_a_list_is_store_unavailable() -> None:
    # What cassandra.cluster.Session.__init__ raises when no first pool opened.
    exc = NoHostAvailable("Unable to connect to any servers", ["127.0.0.1", "127.0.0.2"])
    mapped = _mapped(exc)
    assert type(mapped) is StoreUnavailable
    assert "Unable to connect to any servers" in str(mapped)


def test_no_host_with_each_nodes_error_is_store_unavailable_as_before() -> None:
    exc = NoHostAvailable("Unable to connect to any servers", {"127.0.0.1:1": OSError(111, "no")})
    mapped = _mapped(exc)
    assert type(mapped) is StoreUnavailable
    assert "NoHostAvailable" in str(mapped)
