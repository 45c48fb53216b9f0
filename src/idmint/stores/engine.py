"""One engine object per store URL: what that engine can do, each capability made once.

A strategy asks the engine for the capability it needs (`ranges()`, `leases()`, `cas()`); an
engine without it raises InvalidArgument naming the engines that have it. Capabilities are
made on first ask and connect on first use, so opening an engine does no I/O.

    engine = open_engine("etcd://127.0.0.1:2379/ids")
    engine.ranges().allocate("order")     # segment keys, over compare-and-set
    engine.leases()                       # snowflake worker ids
    engine.quorum()                       # one node of quorum keys
    engine.close()
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, cast

from .._errors import InvalidArgument
from .base import CasStore, LeaseStore, QuorumNode, RangeStore
from .registry import engines_with

#: What each capability is, for the error naming the engines that have it (registry.py).
CAPABILITIES = {
    "ranges": "segment keys",
    "leases": "snowflake worker leases",
    "cas": "compare-and-set cells",
    "quorum": "quorum nodes",
}


class Engine:
    """The capabilities of one store URL's engine (see the module doc). Thread-safe."""

    def __init__(
        self,
        kind: str,
        display_url: str,
        makers: dict[str, Callable[[Engine], Any]],
        *,
        local_cas: Callable[[str], CasStore] | None = None,
    ) -> None:
        unknown = set(makers) - set(CAPABILITIES)
        if unknown:
            raise ValueError(f"unknown capabilities {sorted(unknown)}")
        self.kind = kind
        self.display_url = display_url
        self._makers = makers
        self._local_cas = local_cas
        self._made: dict[str, Any] = {}
        self._lock = threading.RLock()  # a maker may ask for another capability (ranges: cas)

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset(self._makers)

    def has(self, capability: str) -> bool:
        return capability in self._makers

    def _get(self, capability: str) -> Any:
        with self._lock:
            made = self._made.get(capability)
            if made is None:
                maker = self._makers.get(capability)
                if maker is None:
                    engines = ", ".join(engines_with(capability))
                    raise InvalidArgument(
                        f"store {self.display_url} ({self.kind}) has no "
                        f"{CAPABILITIES[capability]}; the engines that have them: {engines}"
                    )
                made = self._made[capability] = maker(self)
            return made

    def ranges(self) -> RangeStore:
        return cast(RangeStore, self._get("ranges"))

    def leases(self) -> LeaseStore:
        return cast(LeaseStore, self._get("leases"))

    def cas(self) -> CasStore:
        return cast(CasStore, self._get("cas"))

    def quorum(self) -> QuorumNode:
        return cast(QuorumNode, self._get("quorum"))

    def local_cas(self, dc: str) -> CasStore:
        """Compare-and-set cells that only datacenter `dc` needs to reach, on this engine's own
        cluster: for an engine whose one cluster spans datacenters (Cassandra: LOCAL_SERIAL in
        that datacenter). A new store each call, the caller's to close. Other engines raise
        InvalidArgument: a datacenter there has a store of its own."""
        if self._local_cas is None:
            raise InvalidArgument(
                f"store {self.display_url} ({self.kind}) has no datacenter-local level: give "
                "the datacenter's own store (--dc-store URL, IDMINT_DC_STORE, dc_store=); only "
                "cassandra:// clusters span datacenters themselves"
            )
        return self._local_cas(dc)

    def close(self) -> None:
        """Close every capability made so far (each close is safe to repeat)."""
        with self._lock:
            made, self._made = list(self._made.values()), {}
        for capability in reversed(made):
            with contextlib.suppress(Exception):  # closing is best effort, and must go on
                capability.close()

    def __repr__(self) -> str:
        return f"<Engine {self.kind} {self.display_url} {sorted(self._makers)}>"
