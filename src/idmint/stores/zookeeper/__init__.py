"""Worker-id leases and compare-and-set cells (hence segment keys, see over_cas/ranges.py) on
ZooKeeper: `zk://[user:password@]host:port[,host:port...][/chroot][?ca=PATH&cert=PATH&key=PATH]`
(chroot: /idmint). A user and password: digest authentication, and an ACL on every node idmint
creates that lets that user alone near it (session.py). `ca`, `cert`, `key` (or `tls=1`, the
system's CAs): TLS, to the servers' `secureClientPort` (stores/tls.py).

Worker ids as Leaf does them with ZooKeeper, but fenced: lease, reservation and horizon nodes
under the chroot's `w/`, `s/` and `h/` (see leases.py). Also under the chroot: `meta`, the
store's identity (a UUID; its ctime, the leader's clock, is when it was made), and
`c/{key percent-encoded}`, a compare-and-set cell (a PERSISTENT node, see ZooKeeperCasStore).

ZooKeeper sessions belong to clients, while every lease has its own ttl. So every lease gets its
own KazooClient, whose session timeout is the lease's ttl as the server negotiates it (clamped
to [2, 20] tickTimes unless the server says otherwise). kazoo's heartbeats keep that session
alive while the process lives and reaches ZooKeeper; a process that dies or is cut off loses
its leases when their sessions expire. A live process that stops renewing loses them too, as in
the other stores: a timer closes a lease's session when `renew` has not been called for ttl
seconds, which deletes the lease node at once. A lease whose session ended is lost for good:
renew raises LeaseLost even if nobody has taken the id since. A lease's ttl is the shorter of
the ttl asked for and the negotiated session timeout. `close` stops only the engine's
shared session (the cells' and the lease store's reads); open leases keep their sessions until
released or until their ttl runs out.

The store's clock that a lease reports is the horizon node's mtime after a write: the time the
ZooKeeper leader gave that write.

Modules: session.py (sessions, the identity, kazoo), leases.py (worker ids); this one has the
cells and opens the engine.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

from ..._errors import InvalidArgument, StoreUnavailable
from .._urls import ENCODE_HINT, misplaced_at
from ..base import StoreIdentity
from ..engine import Engine
from ..over_cas.quorum import CasQuorumNode
from ..over_cas.ranges import CasRangeStore
from ..tls import tls_only
from .leases import ZooKeeperLeaseStore
from .session import Kazoo, Session, SharedSession, Target, load_kazoo, store_identity

DEFAULT_CHROOT = "/idmint"

_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?")
_PATH_PART = re.compile(r"[A-Za-z0-9_:.-]+")


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


_FORM = "zk://[user:password@]host:port[,host:port...][/chroot][?ca=&cert=&key=&tls=1]"


def _parse_url(url: str, display: str, kz: Kazoo) -> tuple[Target, str]:
    """(the servers and how to reach them, chroot) of a zk:// URL."""

    def bad(why: str = f"expected {_FORM}") -> InvalidArgument:
        return InvalidArgument(f"bad store URL {display!r}: {why}")

    if misplaced_at(url):
        raise bad(ENCODE_HINT)
    rest = url.split("://", 1)[1]
    userinfo, at, after = rest.rpartition("@")
    rest, _, query_text = after.partition("?")
    hosts, _, path = rest.partition("/")
    if not hosts or "#" in after:
        raise bad()
    for host in hosts.split(","):
        match = _HOST.fullmatch(host)
        if not match or (match.group(2) and not 0 < int(match.group(2)[1:]) < 65536):
            raise bad()
    path = path.rstrip("/")
    parts = path.split("/") if path else []
    if any(not _PATH_PART.fullmatch(p) or p in (".", "..") for p in parts):
        raise bad()
    tls = tls_only(query_text, display)
    # Files are read now: one that cannot be used is a bad URL, not a failed call.
    context = tls.context(display) if tls is not None else None
    target = Target(hosts, tls=tls, context=context)
    if at:
        user, _, password = (unquote(piece) for piece in userinfo.partition(":"))
        if not user or ":" in user:
            # a digest identity is "user:password": the user holds no ":"
            raise bad("digest authentication needs a user name without ':' (zk://user:pw@...)")
        acl = [kz.digest_acl(user, password, all=True)]
        target = Target(hosts, user, password, tls, acl, context)
    return target, ("/" + path) if path else DEFAULT_CHROOT


def open_zookeeper_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The zookeeper engine of a URL: segment keys (over CAS), worker leases and
    compare-and-set cells, sharing one session (leases add one each). The URL is checked and
    kazoo imported here; no I/O until the first call."""
    kz = load_kazoo()
    target, chroot = _parse_url(url, display, kz)
    shared = SharedSession(kz, target, display, timeout)
    return Engine(
        "zookeeper",
        display,
        {
            "ranges": lambda engine: CasRangeStore(engine.cas()),
            "leases": lambda _: ZooKeeperLeaseStore(kz, target, chroot, display, timeout, shared),
            "cas": lambda _: ZooKeeperCasStore(kz, shared, chroot, display),
            "quorum": lambda engine: CasQuorumNode(engine.cas()),
        },
    )
