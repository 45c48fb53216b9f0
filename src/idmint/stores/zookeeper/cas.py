"""Compare-and-set cells on ZooKeeper (`ZooKeeperCasStore`): persistent nodes under the
chroot's `c/`, one per cell, named by the cell's key percent-encoded."""

from __future__ import annotations

from urllib.parse import quote, unquote

from ..._errors import StoreUnavailable
from ..base import StoreIdentity
from .session import Kazoo, Session, SharedSession, store_identity


def _node_name(key: str) -> str:
    """A cell's key as one node name: percent-encoded, every byte but A-Z a-z 0-9 - _ ~, so a
    "/" cannot nest it and neither the characters ZooKeeper refuses in names nor the names
    "." and ".." can occur. The empty key is "%", which no encoded key can be."""
    return quote(key, safe="").replace(".", "%2E") or "%"


def _cell_key(node_name: str) -> str:
    return "" if node_name == "%" else unquote(node_name)


class ZooKeeperCasStore:
    """A CasStore on ZooKeeper: cell `key` is the persistent node `c/{key percent-encoded}`
    under the chroot, its version the node's data version (stat.version, from 0).

    A create is a create (NodeExists: False); a swap is a setData with the expected version
    (BadVersion, NoNode: False). ZooKeeper answers a write once a quorum has logged it (fsynced
    unless the servers run with forceSync=no), in one order for all. Reads are sync + read:
    a server may lag the leader, and the sync makes it catch up first. A request whose answer
    never came (the connection was lost, or the timeout passed) raises StoreUnavailable: it
    may have been applied.
    """

    def __init__(self, kz: Kazoo, shared: SharedSession, chroot: str, display_url: str) -> None:
        self.display_url = display_url
        self._kz, self._shared, self._root = kz, shared, chroot
        self._cells = f"{chroot}/c"

    def _path(self, key: str) -> str:
        return f"{self._cells}/{_node_name(key)}"

    def init(self) -> None:
        """Nothing to create (cells are made by `create`); makes the store's identity."""
        self.identity()

    def identity(self) -> StoreIdentity | None:
        """The identity under this chroot, the lease store's: made on first use."""
        return store_identity(self._kz, self._shared.get(), self._root)

    def read(self, key: str) -> tuple[str, int] | None:
        try:
            data, version = self._shared.get().synced_get(self._path(key))
        except self._kz.no_node:
            return None
        return data.decode(), version

    def _writer(self) -> Session:
        """The shared session, if it is connected now. kazoo holds requests made while it is
        reconnecting and sends them when it is back: a write could then apply long after its
        caller gave up on it. Not sending it at all is the one outcome the caller can know."""
        session = self._shared.get()
        if not session.connected():
            raise StoreUnavailable(
                f"store {self.display_url} unavailable: connection lost, reconnecting"
            )
        return session

    def create(self, key: str, value: str) -> bool:
        try:
            self._writer().create(self._path(key), value.encode())
        except self._kz.node_exists:
            return False
        return True

    def swap(self, key: str, version: int, value: str) -> bool:
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**31:
            # ZooKeeper takes -1 for "any version", and versions are 32-bit: a larger one
            # would break kazoo's connection thread rather than be refused.
            return False
        try:
            self._writer().set(self._path(key), value.encode(), version)
        except (self._kz.bad_version, self._kz.no_node):
            return False
        return True

    def scan(self, prefix: str) -> list[tuple[str, str]]:
        session = self._shared.get()
        cells = sorted(
            (key, name)
            for name in session.synced_children(self._cells)
            if (key := _cell_key(name)).startswith(prefix)
        )
        found = session.get_many([f"{self._cells}/{name}" for _, name in cells])
        return [(key, got[0].decode()) for (key, _), got in zip(cells, found, strict=True) if got]

    def close(self) -> None:
        """Close the engine's shared session (the lease store's too); safe to repeat."""
        self._shared.close()
