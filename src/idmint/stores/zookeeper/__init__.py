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
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote, unquote

from ..._errors import (
    DriverMissing,
    InvalidArgument,
    LeaseLost,
    StoreUnavailable,
    WorkerInUse,
)
from ..._fork import ForkAware, orphan
from ...ids import check_key_name, is_digits
from ..base import (
    HorizonForgotten,
    Lease,
    StoreIdentity,
    WorkerInfo,
    check_claim,
    forgotten,
)
from ..engine import Engine
from ..leasing import choose_worker, holder_name
from ..over_cas.quorum import CasQuorumNode
from ..over_cas.ranges import CasRangeStore

DEFAULT_CHROOT = "/idmint"
PREFERENCE_LOOKS = 32  # free ids whose horizon acquire reads (a round trip each) to prefer one
SHARED_SESSION_TIMEOUT = 10.0  # seconds; the shared client holds no ephemeral nodes

_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?")
_PATH_PART = re.compile(r"[A-Za-z0-9_:.-]+")


@dataclass(frozen=True)
class _Kazoo:
    """The parts of kazoo used here (kazoo is imported only when a zk:// store is opened)."""

    client: Any  # kazoo.client.KazooClient
    no_node: type[Exception]
    node_exists: type[Exception]
    bad_version: type[Exception]
    session_gone: type[Exception]  # SessionExpiredError, also ConnectionClosedError
    error: type[Exception]  # KazooException


class _SessionGone(StoreUnavailable):
    """The session expired or its client was stopped: its ephemeral nodes are gone."""


class _SessionLog(logging.LoggerAdapter[logging.Logger]):
    """kazoo logs the session timeout the server negotiated, and keeps it nowhere else."""

    negotiated_ms: int | None = None

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if isinstance(msg, str) and msg.startswith("Session created") and len(args) >= 3:
            self.negotiated_ms = int(str(args[2]))
        super().log(level, msg, *args, **kwargs)


class _Session:
    """One KazooClient, hence one ZooKeeper session; every call bounded by `timeout`."""

    def __init__(
        self, kz: _Kazoo, hosts: str, display: str, session_timeout: float, timeout: float
    ) -> None:
        self._kz, self._display, self._timeout = kz, display, timeout
        self._log = _SessionLog(logging.getLogger("kazoo.client"))
        self._client = kz.client(hosts=hosts, timeout=session_timeout, logger=self._log)
        self.session_timeout = session_timeout
        self.session_id = 0
        self._stalled = False  # a call got no answer in time: stop() does not wait on it again

    def _unavailable(self, what: object) -> StoreUnavailable:
        return StoreUnavailable(f"store {self._display} unavailable: {what}")

    def start(self) -> None:
        # Not KazooClient.start(timeout): after its timeout it stops the client and waits for
        # the connection thread, up to max(10 s, the session timeout) on a frozen server.
        try:
            connected = self._client.start_async().wait(timeout=self._timeout)
        except Exception as exc:
            self.stop()
            raise self._unavailable(f"cannot connect ({type(exc).__name__})") from exc
        if not (connected and self._client.connected):
            self._stalled = True
            self.stop()
            raise self._unavailable(f"no connection within {self._timeout:g} s")
        self.session_id = int(self._client.client_id[0])
        if self._log.negotiated_ms is not None:
            self.session_timeout = self._log.negotiated_ms / 1000

    def state(self) -> str:
        """CONNECTED, SUSPENDED (connection lost, session maybe alive) or LOST (session gone).

        kazoo opens a new session after one expired: then this one counts as LOST."""
        client_id = self._client.client_id
        if client_id is not None and int(client_id[0]) != self.session_id:
            return "LOST"
        return str(self._client.state)

    def connected(self) -> bool:
        """The client has a live connection now (to this session or, after one expired, to
        the new one kazoo opened: unlike `state`, which counts that as LOST)."""
        return str(self._client.state) == "CONNECTED"

    def _wait(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._answer(call(*args, **kwargs), self._timeout)

    def _answer(self, pending: Any, timeout: float) -> Any:
        """The answer to a request already sent (a kazoo IAsyncResult), waited for at most
        `timeout`. A request whose outcome is unknown (the connection was lost before its
        answer, or none came in time) raises StoreUnavailable: it may have been applied."""
        kz = self._kz
        try:
            answer = pending.get(timeout=max(timeout, 0.0))
            self._stalled = False
            return answer
        except (kz.no_node, kz.node_exists, kz.bad_version):
            self._stalled = False
            raise
        except kz.session_gone as exc:
            raise _SessionGone(f"store {self._display} unavailable: session ended") from exc
        except kz.error as exc:
            raise self._unavailable(type(exc).__name__) from exc
        except self._client.handler.timeout_exception as exc:
            self._stalled = True
            raise self._unavailable(f"no answer within {self._timeout:g} s") from exc

    def get(self, path: str) -> tuple[bytes, int]:
        """The node's data and version. Raises NoNodeError."""
        data, stat = self._wait(self._client.get_async, path)
        return bytes(data), int(stat.version)

    def synced_get(self, path: str) -> tuple[bytes, int]:
        """`get` after a sync: the answering server has caught up with the leader as of the
        call, so the read is not stale. Sent back to back: a session's requests are handled
        in order, so the read waits for the sync on the server, not for a round trip here."""
        deadline = time.monotonic() + self._timeout
        synced = self._client.sync_async(path)
        got = self._client.get_async(path)
        self._answer(synced, self._timeout)
        data, stat = self._answer(got, deadline - time.monotonic())
        return bytes(data), int(stat.version)

    def synced_children(self, path: str) -> list[str]:
        """`children` after a sync (see synced_get); none if the node does not exist."""
        deadline = time.monotonic() + self._timeout
        synced = self._client.sync_async(path)
        listed = self._client.get_children_async(path)
        self._answer(synced, self._timeout)
        try:
            return [str(c) for c in self._answer(listed, deadline - time.monotonic())]
        except self._kz.no_node:
            return []

    def get_many(self, paths: list[str]) -> list[tuple[bytes, int] | None]:
        """Each node's data and version (None for a node that is gone), every request sent
        before the first answer is waited for; all within one timeout."""
        deadline = time.monotonic() + self._timeout
        pending = [self._client.get_async(path) for path in paths]
        found: list[tuple[bytes, int] | None] = []
        for each in pending:
            try:
                data, stat = self._answer(each, deadline - time.monotonic())
            except self._kz.no_node:
                found.append(None)
                continue
            found.append((bytes(data), int(stat.version)))
        return found

    def created(self, path: str) -> tuple[bytes, int]:
        """The node's data and its ctime (the leader's Unix ms). Raises NoNodeError."""
        data, stat = self._wait(self._client.get_async, path)
        return bytes(data), int(stat.ctime)

    def children(self, path: str) -> list[str]:
        """The node's children's names; none if it does not exist."""
        try:
            return [str(c) for c in self._wait(self._client.get_children_async, path)]
        except self._kz.no_node:
            return []

    def create(self, path: str, data: bytes, *, ephemeral: bool = False) -> int:
        """Create the node and its missing parents; its mtime (the leader's Unix ms).
        Raises NodeExistsError."""
        _, stat = self._wait(
            self._client.create_async,
            path,
            data,
            ephemeral=ephemeral,
            makepath=True,
            include_data=True,
        )
        return int(stat.mtime)

    def set(self, path: str, data: bytes, version: int) -> int:
        """Compare-and-set; the node's new mtime (the leader's Unix ms). Raises
        BadVersionError, NoNodeError."""
        return int(self._wait(self._client.set_async, path, data, version=version).mtime)

    def delete(self, path: str) -> None:
        self._wait(self._client.delete_async, path)

    def stop(self) -> None:
        """Close the session (deleting its ephemeral nodes) and free the client, waiting at
        most `timeout`: kazoo waits for the server to confirm the close, which a frozen server
        never does; not at all after a call that got no answer. The close then goes on in the
        background, and the server ends the session when it answers again (or when the session
        times out)."""
        closer = threading.Thread(target=self._close, name="idmint-zk-close", daemon=True)
        closer.start()
        closer.join(0 if self._stalled else self._timeout)

    def _close(self) -> None:
        try:
            self._client.stop()
            self._client.close()
        except Exception:  # a client that cannot close cleanly leaves its session to expire
            logging.getLogger(__name__).debug("closing a ZooKeeper client failed", exc_info=True)


@dataclass
class _Held:
    """A lease this store acquired: its session and the timer that ends it unless renewed."""

    session: _Session
    lock: threading.Lock = field(default_factory=threading.Lock)
    timer: threading.Timer | None = None
    generation: int = 0


def _horizon_data(horizon_ms: int, owner: str) -> bytes:
    return f"{horizon_ms} {owner}".encode()


def _parse_horizon(data: bytes) -> tuple[int, str]:
    horizon, _, owner = data.decode().partition(" ")
    return int(horizon), owner


class _SharedSession(ForkAware):
    """The one session of an engine that holds no ephemeral nodes: the lease store's reads and
    every compare-and-set cell share it. Opened on first use; after `close`, the next use
    opens another. kazoo reconnects it by itself, to a new session if the old one expired,
    which is fine for what it does: nothing it made dies with it."""

    def __init__(self, kz: _Kazoo, hosts: str, display_url: str, timeout: float) -> None:
        self._kz, self._hosts, self._display, self._timeout = kz, hosts, display_url, timeout
        self._session: _Session | None = None
        self._lock = threading.Lock()
        self._watch_fork()

    def _after_fork(self) -> None:
        # kazoo's threads did not survive the fork, and the session is the parent's: closing
        # it here would close it for the parent. Leave it, and start afresh.
        orphan(self._session)
        self._session = None
        self._lock = threading.Lock()

    def get(self) -> _Session:
        self._check_fork()
        with self._lock:
            if self._session is None:
                session = _Session(
                    self._kz, self._hosts, self._display, SHARED_SESSION_TIMEOUT, self._timeout
                )
                session.start()
                self._session = session
            return self._session

    def close(self) -> None:
        """Close the session if one is open: safe to repeat, and from any store sharing it."""
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.stop()


def _identity(kz: _Kazoo, session: _Session, root: str) -> StoreIdentity:
    """The store's identity, made if it is missing; its creation time is the node's ctime."""
    path = f"{root}/meta"
    while True:
        try:
            data, ctime = session.created(path)
            return StoreIdentity(data.decode(), ctime)
        except kz.no_node:
            with contextlib.suppress(kz.node_exists):
                session.create(path, uuid.uuid4().hex.encode())


class ZooKeeperLeaseStore(ForkAware):
    """A LeaseStore on ZooKeeper: one session per lease, the engine's shared one for reading."""

    def __init__(
        self,
        kz: _Kazoo,
        hosts: str,
        chroot: str,
        display_url: str,
        timeout: float,
        shared: _SharedSession,
    ) -> None:
        self.display_url = display_url
        self._kz, self._hosts, self._root, self._timeout = kz, hosts, chroot, timeout
        self._shared_session = shared
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()  # guards _held
        self._watch_fork()

    def _after_fork(self) -> None:
        # The lease sessions are the parent's: closing one here would end the parent's lease.
        # Leave them, and start afresh (the shared session resets itself).
        orphan(self._held)
        self._held = {}
        self._lock = threading.Lock()

    def _session(self, session_timeout: float) -> _Session:
        session = _Session(self._kz, self._hosts, self.display_url, session_timeout, self._timeout)
        session.start()
        return session

    def _shared(self) -> _Session:
        self._check_fork()
        return self._shared_session.get()

    def _paths(self, namespace: str, worker_id: int | None = None) -> tuple[str, str]:
        check_key_name(namespace)  # so it is one safe path component
        tail = "" if worker_id is None else f"/{worker_id}"
        return f"{self._root}/w/{namespace}{tail}", f"{self._root}/h/{namespace}{tail}"

    def _reserved_path(self, namespace: str) -> str:
        return f"{self._root}/s/{check_key_name(namespace)}"

    def _identity(self, session: _Session) -> StoreIdentity:
        return _identity(self._kz, session, self._root)

    def identity(self) -> StoreIdentity | None:
        return self._identity(self._shared())

    def _stored_id(self, session: _Session) -> str | None:
        try:
            return session.get(f"{self._root}/meta")[0].decode()
        except self._kz.no_node:
            return None

    def acquire(
        self,
        namespace: str,
        *,
        workers: int,
        ttl: float,
        horizon_ms: int,
        now_ms: int | None = None,
        worker_id: int | None = None,
    ) -> Lease:
        claim = None if worker_id is None else check_claim(worker_id, workers)
        leases, horizons = self._paths(namespace)
        reserved_path = self._reserved_path(namespace)
        owner = uuid.uuid4().hex
        session: _Session | None = None
        try:
            identity = self._identity(self._shared())
            while True:
                shared = self._shared()
                taken = set(shared.children(leases))
                if claim is None:
                    reserved = set(shared.children(reserved_path))
                    hint = functools.partial(self._floor_hint, shared, horizons)
                    free = (i for i in range(workers) if str(i) not in taken | reserved)
                    worker_id = choose_worker(
                        namespace, workers, free, hint, now_ms, looks=PREFERENCE_LOOKS
                    )
                else:
                    worker_id = claim
                    if str(claim) in taken:
                        raise WorkerInUse(
                            namespace, claim, self._holder(shared, leases, claim), None
                        )
                    with contextlib.suppress(self._kz.node_exists):
                        shared.create(f"{reserved_path}/{claim}", holder_name().encode())
                if session is None:
                    session = self._session(ttl)
                node = {"owner": owner, "host": holder_name(), "session": session.session_timeout}
                try:
                    session.create(
                        f"{leases}/{worker_id}", json.dumps(node).encode(), ephemeral=True
                    )
                except self._kz.node_exists:
                    continue  # taken meanwhile: list again
                _, horizon_path = self._paths(namespace, worker_id)
                floor, horizon, written_ms = self._move_horizon(
                    session, horizon_path, owner, horizon_ms, take=True
                )
                # The session may be shorter than asked (the server caps it, at 20 s by
                # default), and it ends the lease: the holder must count on the shorter one.
                ttl = min(ttl, session.session_timeout)
                held = _Held(session)
                with self._lock:
                    self._held[owner] = held
                with held.lock:
                    self._arm(owner, held, ttl)
                return Lease(
                    namespace,
                    worker_id,
                    owner,
                    floor,
                    horizon,
                    ttl,
                    store_ms=written_ms,
                    store_id=identity.id,
                    store_created_ms=identity.created_ms,
                    static=claim is not None,
                )
        except BaseException:
            if session is not None:
                session.stop()
            raise

    def _holder(self, shared: _Session, leases: str, worker_id: int) -> str:
        try:
            return str(json.loads(shared.get(f"{leases}/{worker_id}")[0]).get("host", ""))
        except self._kz.no_node:
            return ""

    def _floor_hint(self, shared: _Session, horizons: str, worker_id: int) -> int:
        """A free worker id's stored horizon (0 if it has none), to choose among free ids; the
        floor a lease gets is read again after its lease node exists."""
        try:
            return _parse_horizon(shared.get(f"{horizons}/{worker_id}")[0])[0]
        except self._kz.no_node:
            return 0

    def _move_horizon(
        self,
        session: _Session,
        path: str,
        owner: str,
        horizon_ms: int,
        *,
        take: bool,
        known: Lease | None = None,
    ) -> tuple[int, int, int | None]:
        """(stored horizon, new horizon, the write's mtime or None when nothing was written)
        after raising the horizon to horizon_ms by compare-and-set.

        `take`: make `owner` the horizon's holder; else raise LeaseLost if it is not, or if
        the stored horizon is below the one the `known` lease was given."""
        kz = self._kz
        while True:
            try:
                data, version = session.get(path)
            except kz.no_node:
                if not take:
                    raise LeaseLost(f"{path} is gone") from None
                try:
                    return 0, horizon_ms, session.create(path, _horizon_data(horizon_ms, owner))
                except kz.node_exists:
                    continue
            stored, holder = _parse_horizon(data)
            if not take and holder != owner:
                raise LeaseLost(f"{path} has another holder")
            if known is not None and stored < known.horizon_ms:
                raise forgotten(known, stored)
            new = max(stored, horizon_ms)
            if new == stored and holder == owner:
                return stored, stored, None
            try:
                return stored, new, session.set(path, _horizon_data(new, owner), version)
            except kz.bad_version:
                continue

    def _lower_horizon(self, session: _Session, path: str, owner: str, to: int) -> None:
        """Set the horizon to `to` if `owner` still holds it (the one time it moves down)."""
        while True:
            try:
                data, version = session.get(path)
            except self._kz.no_node:
                return
            stored, holder = _parse_horizon(data)
            if holder != owner or stored == to:
                return
            try:
                session.set(path, _horizon_data(to, owner), version)
                return
            except self._kz.bad_version:
                continue

    def _arm(self, owner: str, held: _Held, ttl: float) -> None:
        """(Re)start the timer that ends the lease ttl seconds from now. Hold held.lock."""
        if held.timer is not None:
            held.timer.cancel()
        held.generation += 1
        held.timer = threading.Timer(ttl, self._lapse, (owner, held, held.generation))
        held.timer.daemon = True
        held.timer.start()

    def _lapse(self, owner: str, held: _Held, generation: int) -> None:
        with held.lock:
            if held.generation != generation:  # renewed while this timer was starting
                return
            held.generation += 1
            self._forget(owner)
            held.session.stop()

    def _forget(self, owner: str) -> _Held | None:
        with self._lock:
            return self._held.pop(owner, None)

    def renew(self, lease: Lease, horizon_ms: int) -> Lease:
        lost = LeaseLost(
            f"worker {lease.worker_id} of namespace {lease.namespace!r} is no longer held: "
            "its lease lapsed or another owner holds it now"
        )
        with self._lock:
            held = self._held.get(lease.owner)
        if held is None:
            raise lost
        lease_path, horizon_path = self._paths(lease.namespace, lease.worker_id)
        with held.lock:
            session = held.session
            try:
                state = session.state()
                if state == "SUSPENDED":
                    raise StoreUnavailable(
                        f"store {self.display_url} unavailable: connection lost, reconnecting"
                    )
                if state != "CONNECTED":
                    raise lost
                try:
                    data, _ = session.get(lease_path)
                except self._kz.no_node:
                    raise lost from None
                if json.loads(data).get("owner") != lease.owner:
                    raise lost
                _, horizon, written_ms = self._move_horizon(
                    session, horizon_path, lease.owner, horizon_ms, take=False, known=lease
                )
                store_id = self._stored_id(session)
            except (LeaseLost, _SessionGone) as exc:
                held.generation += 1
                if held.timer is not None:
                    held.timer.cancel()
                self._forget(lease.owner)
                session.stop()
                raise (exc if isinstance(exc, HorizonForgotten) else lost) from exc
            self._arm(lease.owner, held, lease.ttl)
        return replace(lease, horizon_ms=horizon, store_ms=written_ms, store_id=store_id)

    def release(self, lease: Lease, issued_ms: int | None = None) -> None:
        held = self._forget(lease.owner)
        if held is None:
            return  # lapsed, released already, or never ours
        lease_path, horizon_path = self._paths(lease.namespace, lease.worker_id)
        with held.lock:
            held.generation += 1
            if held.timer is not None:
                held.timer.cancel()
            try:
                data, _ = held.session.get(lease_path)
                if json.loads(data).get("owner") == lease.owner:
                    if issued_ms is not None:  # while the lease node still fences the id
                        down = max(lease.floor_ms, issued_ms)
                        self._lower_horizon(held.session, horizon_path, lease.owner, down)
                    held.session.delete(lease_path)
            except (self._kz.no_node, _SessionGone):
                pass
            finally:
                held.session.stop()  # ends the session, so the node goes even if delete failed

    def holders(self, namespace: str) -> list[WorkerInfo]:
        leases, horizons = self._paths(namespace)
        shared = self._shared()
        reserved = set(shared.children(self._reserved_path(namespace)))
        rows = []
        for name in sorted((c for c in shared.children(horizons) if is_digits(c)), key=int):
            try:
                horizon, _ = _parse_horizon(shared.get(f"{horizons}/{name}")[0])
            except self._kz.no_node:
                continue
            try:
                node = json.loads(shared.get(f"{leases}/{name}")[0])
            except self._kz.no_node:
                rows.append(
                    WorkerInfo(namespace, int(name), "", "", None, horizon, static=name in reserved)
                )
                continue
            # ZooKeeper has no per-node TTL: a lease node lives as long as its session, which
            # ends at most one session timeout after its holder stops heart-beating.
            expires_in = float(node.get("session", 0.0))
            owner, host = str(node.get("owner", "")), str(node.get("host", ""))
            rows.append(
                WorkerInfo(
                    namespace, int(name), owner, host, expires_in, horizon, static=name in reserved
                )
            )
        return rows

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        try:
            self._shared().delete(f"{self._reserved_path(namespace)}/{worker_id}")
        except self._kz.no_node:
            return False
        return True

    def close(self) -> None:
        self._shared_session.close()


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

    def __init__(self, kz: _Kazoo, shared: _SharedSession, chroot: str, display_url: str) -> None:
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
        return _identity(self._kz, self._shared.get(), self._root)

    def read(self, key: str) -> tuple[str, int] | None:
        try:
            data, version = self._shared.get().synced_get(self._path(key))
        except self._kz.no_node:
            return None
        return data.decode(), version

    def _writer(self) -> _Session:
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


def _kazoo() -> _Kazoo:
    """The parts of kazoo used here, or DriverMissing naming the extra to install."""
    try:
        from kazoo import exceptions
        from kazoo.client import KazooClient
    except ImportError:
        raise DriverMissing("zk:// stores need kazoo: pip install 'idmint[zookeeper]'") from None
    return _Kazoo(
        client=KazooClient,
        no_node=exceptions.NoNodeError,
        node_exists=exceptions.NodeExistsError,
        bad_version=exceptions.BadVersionError,
        session_gone=exceptions.SessionExpiredError,
        error=exceptions.KazooException,
    )


def open_zookeeper_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The zookeeper engine of a URL: segment keys (over CAS), worker leases and
    compare-and-set cells, sharing one session (leases add one each). The URL is checked and
    kazoo imported here; no I/O until the first call."""
    hosts, chroot = _parse_url(url, display)
    kz = _kazoo()
    shared = _SharedSession(kz, hosts, display, timeout)
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
