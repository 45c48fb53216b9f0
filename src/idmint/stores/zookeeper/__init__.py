"""Worker-id leases and compare-and-set cells (hence segment keys, see over_cas/ranges.py) on
ZooKeeper: `zk://host:port[,host:port...]/chroot` (chroot: /idmint).

Worker ids as Leaf does them with ZooKeeper, but fenced. Under the chroot:

- `w/{namespace}/{worker_id}`, the lease: an EPHEMERAL node holding the owner and host. It lives
  exactly as long as the ZooKeeper session that created it.
- `s/{namespace}/{worker_id}`, present while the id is reserved for static holders.
- `meta`, the store's identity: a UUID; its ctime (the leader's clock) is when it was made.
- `h/{namespace}/{worker_id}`, the horizon: a PERSISTENT node "horizon_ms owner". It outlives
  leases, only moves up (compare-and-set on its version), and names the holder that last moved
  it: a holder whose id has been taken over can never raise it again, and a new holder reads
  its floor after its lease node exists, so after the old session ended.
- `c/{key percent-encoded}`, a compare-and-set cell: a PERSISTENT node (see ZooKeeperCasStore).

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

Modules: session.py (sessions, the identity, kazoo), leases.py (worker ids), cas.py (cells);
this one opens the engine.
"""

from __future__ import annotations

import re

from ..._errors import InvalidArgument
from ..engine import Engine
from ..over_cas.quorum import CasQuorumNode
from ..over_cas.ranges import CasRangeStore
from .cas import ZooKeeperCasStore, _cell_key, _node_name
from .leases import ZooKeeperLeaseStore
from .session import SharedSession, load_kazoo

DEFAULT_CHROOT = "/idmint"

_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?")
_PATH_PART = re.compile(r"[A-Za-z0-9_:.-]+")


def _parse_url(url: str, display: str) -> tuple[str, str]:
    """(kazoo hosts string, chroot) of a zk:// URL."""
    bad = InvalidArgument(
        f"bad store URL {display!r}: expected zk://host:port[,host:port...][/chroot]"
    )
    rest = url.split("://", 1)[1]
    hosts, _, path = rest.partition("/")
    if not hosts or any(c in rest for c in "?#@"):
        raise bad
    for host in hosts.split(","):
        match = _HOST.fullmatch(host)
        if not match or (match.group(2) and not 0 < int(match.group(2)[1:]) < 65536):
            raise bad
    path = path.rstrip("/")
    parts = path.split("/") if path else []
    if any(not _PATH_PART.fullmatch(p) or p in (".", "..") for p in parts):
        raise bad
    return hosts, ("/" + path) if path else DEFAULT_CHROOT


def open_zookeeper_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The zookeeper engine of a URL: segment keys (over CAS), worker leases and
    compare-and-set cells, sharing one session (leases add one each). The URL is checked and
    kazoo imported here; no I/O until the first call."""
    hosts, chroot = _parse_url(url, display)
    kz = load_kazoo()
    shared = SharedSession(kz, hosts, display, timeout)
    return Engine(
        "zookeeper",
        display,
        {
            "ranges": lambda engine: CasRangeStore(engine.cas()),
            "leases": lambda _: ZooKeeperLeaseStore(kz, hosts, chroot, display, timeout, shared),
            "cas": lambda _: ZooKeeperCasStore(kz, shared, chroot, display),
            "quorum": lambda engine: CasQuorumNode(engine.cas()),
        },
    )


__all__ = [
    "ZooKeeperCasStore",
    "ZooKeeperLeaseStore",
    "_cell_key",
    "_node_name",
    "open_zookeeper_engine",
]
