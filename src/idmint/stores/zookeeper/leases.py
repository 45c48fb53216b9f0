"""Worker-id leases on ZooKeeper, by the protocol of lease_protocol.py. Under the chroot:

- `w/{namespace}/{worker_id}`, the lease: an EPHEMERAL node holding the owner, host and session
  timeout. It lives exactly as long as the ZooKeeper session that created it.
- `s/{namespace}/{worker_id}`, present while the id is reserved for static holders.
- `h/{namespace}/{worker_id}`, the horizon: a PERSISTENT node "horizon_ms owner". It outlives
  leases, only moves up (compare-and-set on its version), and names the holder that last moved
  it: a holder whose id has been taken over can never raise it again, and a new holder reads
  its floor after its lease node exists, so after the old session ended.

A take is the create of the lease node (it fails if the node exists); the horizon is raised
after it, by the holder alone. Every lease has its own session, whose timeout is its ttl (see
the package's doc); a timer ends it when `renew` has not been called for ttl seconds.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from ..._errors import StoreUnavailable
from ..._fork import ForkAware, orphan
from ...ids import check_key_name, is_digits
from ..base import Lease, StoreIdentity, WorkerInfo
from ..lease_protocol import LOST, FencedLeases, Found, Request, Taken
from .session import Kazoo, Session, SessionGone, SharedSession, Target, store_identity

PREFERENCE_LOOKS = 32  # free ids whose horizon acquire reads (a round trip each) to prefer one


@dataclass
class _Held:
    """A lease this store acquired: its session and the timer that ends it unless renewed."""

    session: Session
    lock: threading.Lock = field(default_factory=threading.Lock)
    timer: threading.Timer | None = None
    generation: int = 0


def _horizon_data(horizon_ms: int, owner: str) -> bytes:
    return f"{horizon_ms} {owner}".encode()


def _parse_horizon(data: bytes) -> tuple[int, str]:
    horizon, _, owner = data.decode().partition(" ")
    return int(horizon), owner


@dataclass
class _Table:
    """The namespace's lease nodes and reservations; horizons and holders read when asked."""

    store: ZooKeeperLeaseStore
    shared: Session
    namespace: str
    taken: set[str]
    reserved_ids: set[str]

    def held(self, worker_id: int) -> bool:
        return str(worker_id) in self.taken

    def reserved(self, worker_id: int) -> bool:
        return str(worker_id) in self.reserved_ids

    def floor_ms(self, worker_id: int) -> int:
        """A free worker id's stored horizon (0 if it has none), to choose among free ids;
        the floor a lease gets is read again after its lease node exists."""
        try:
            path = self.store._paths(self.namespace, worker_id)[1]
            return _parse_horizon(self.shared.get(path)[0])[0]
        except self.store._kz.no_node:
            return 0

    def holder(self, worker_id: int) -> tuple[str, float | None]:
        try:
            path = self.store._paths(self.namespace, worker_id)[0]
            return str(json.loads(self.shared.get(path)[0]).get("host", "")), None
        except self.store._kz.no_node:
            return "", None


class _Acquisition:
    """One acquire: the identity it reports and the lease's own session, made for its first
    take and ended unless a take kept it."""

    def __init__(self, store: ZooKeeperLeaseStore, request: Request) -> None:
        self._store, self._request = store, request
        # The namespace is checked (one safe path component) before any call.
        self._leases = store._paths(request.namespace)[0]
        self._reserved = store._reserved_path(request.namespace)
        self.session: Session | None = None
        self.kept = False
        self._identity = store._identity(store._shared())

    def read(self) -> _Table:
        store, namespace = self._store, self._request.namespace
        shared = store._shared()
        taken = set(shared.children(self._leases))
        reserved: set[str] = set()
        if self._request.claim is None:
            reserved = set(shared.children(self._reserved))
        return _Table(store, shared, namespace, taken, reserved)

    def take(self, table: _Table, worker_id: int, horizon_ms: int) -> Taken | None:
        store, request = self._store, self._request
        kz = store._kz
        if request.claim is not None:
            reservation = f"{self._reserved}/{worker_id}"
            with contextlib.suppress(kz.node_exists):
                table.shared.create(reservation, request.host.encode())
        if self.session is None:
            self.session = store._session(request.ttl)
        session = self.session
        node = {"owner": request.owner, "host": request.host, "session": session.session_timeout}
        lease_path, horizon_path = store._paths(request.namespace, worker_id)
        try:
            session.create(lease_path, json.dumps(node).encode(), ephemeral=True)
        except kz.node_exists:
            return None  # taken meanwhile: list again
        floor, horizon, written_ms = store._take_horizon(
            session, horizon_path, request.owner, horizon_ms
        )
        # The session may be shorter than asked (the server caps it, at 20 s by default), and
        # it ends the lease: the holder must count on the shorter one.
        ttl = min(request.ttl, session.session_timeout)
        held = _Held(session)
        with store._lock:
            store._held[request.owner] = held
        with held.lock:
            store._arm(request.owner, held, ttl)
        self.kept = True
        return Taken(floor, horizon, store_ms=written_ms, identity=self._identity, ttl=ttl)


class ZooKeeperLeaseStore(ForkAware, FencedLeases):
    """A LeaseStore on ZooKeeper: one session per lease, the engine's shared one for reading."""

    preference_looks = PREFERENCE_LOOKS

    def __init__(
        self,
        kz: Kazoo,
        target: Target,
        chroot: str,
        display_url: str,
        timeout: float,
        shared: SharedSession,
    ) -> None:
        self.display_url = display_url
        self._kz, self._target, self._root, self._timeout = kz, target, chroot, timeout
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

    def _session(self, session_timeout: float) -> Session:
        session = Session(self._kz, self._target, self.display_url, session_timeout, self._timeout)
        session.start()
        return session

    def _shared(self) -> Session:
        self._check_fork()
        return self._shared_session.get()

    def _paths(self, namespace: str, worker_id: int | None = None) -> tuple[str, str]:
        check_key_name(namespace)  # so it is one safe path component
        tail = "" if worker_id is None else f"/{worker_id}"
        return f"{self._root}/w/{namespace}{tail}", f"{self._root}/h/{namespace}{tail}"

    def _reserved_path(self, namespace: str) -> str:
        return f"{self._root}/s/{check_key_name(namespace)}"

    def _identity(self, session: Session) -> StoreIdentity:
        return store_identity(self._kz, session, self._root)

    def identity(self) -> StoreIdentity | None:
        return self._identity(self._shared())

    def _stored_id(self, session: Session) -> str | None:
        try:
            return session.get(f"{self._root}/meta")[0].decode()
        except self._kz.no_node:
            return None

    # -- the protocol's primitives -----------------------------------------------------------

    @contextlib.contextmanager
    def _acquiring(self, request: Request) -> Iterator[_Acquisition]:
        acquisition = _Acquisition(self, request)
        try:
            yield acquisition
        finally:
            if acquisition.session is not None and not acquisition.kept:
                acquisition.session.stop()

    def _take_horizon(
        self, session: Session, path: str, owner: str, horizon_ms: int
    ) -> tuple[int, int, int | None]:
        """(stored horizon, new horizon, the write's mtime or None when nothing was written)
        after raising the horizon to horizon_ms by compare-and-set and making `owner` its
        holder, for a new lease whose node exists."""
        kz = self._kz
        while True:
            try:
                data, version = session.get(path)
            except kz.no_node:
                try:
                    return 0, horizon_ms, session.create(path, _horizon_data(horizon_ms, owner))
                except kz.node_exists:
                    continue
            stored, holder = _parse_horizon(data)
            new = max(stored, horizon_ms)
            if new == stored and holder == owner:
                return stored, stored, None
            try:
                return stored, new, session.set(path, _horizon_data(new, owner), version)
            except kz.bad_version:
                continue

    def _raise_horizon(
        self, session: Session, path: str, lease: Lease, horizon_ms: int
    ) -> tuple[int, int | None] | Found:
        """(new horizon, the write's mtime or None when nothing was written) after raising
        the horizon of a held id to horizon_ms by compare-and-set; what was found instead when
        the lease no longer holds it, the horizon is below the lease's, or it moved."""
        try:
            data, version = session.get(path)
        except self._kz.no_node:
            return LOST
        stored, holder = _parse_horizon(data)
        if holder != lease.owner:
            return LOST
        if stored < lease.horizon_ms:
            return Found(True, stored)
        new = max(stored, horizon_ms)
        if new == stored:
            return stored, None
        try:
            return new, session.set(path, _horizon_data(new, lease.owner), version)
        except self._kz.bad_version:
            return Found(True, stored)

    def _lower_horizon(self, session: Session, path: str, owner: str, to: int) -> None:
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

    def _refresh(self, lease: Lease, horizon_ms: int, expected_ms: int) -> Lease | Found:
        with self._lock:
            held = self._held.get(lease.owner)
        if held is None:
            return LOST
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
                    return LOST
                try:
                    data, _ = session.get(lease_path)
                except self._kz.no_node:
                    return LOST
                if json.loads(data).get("owner") != lease.owner:
                    return LOST
                raised = self._raise_horizon(session, horizon_path, lease, horizon_ms)
                if isinstance(raised, Found):
                    return raised
                store_id = self._stored_id(session)
            except SessionGone:
                return LOST
            self._arm(lease.owner, held, lease.ttl)
        horizon, written_ms = raised
        return replace(lease, horizon_ms=horizon, store_ms=written_ms, store_id=store_id)

    def _dropped(self, lease: Lease) -> None:
        """End the lost lease's session (unless its timer did meanwhile)."""
        with self._lock:
            held = self._held.get(lease.owner)
        if held is None:
            return
        with held.lock:
            if self._forget(lease.owner) is None:
                return  # lapsed meanwhile: its timer ended the session
            held.generation += 1
            if held.timer is not None:
                held.timer.cancel()
            held.session.stop()

    def _free(self, lease: Lease, horizon_ms: int | None) -> None:
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
                    if horizon_ms is not None:  # while the lease node still fences the id
                        self._lower_horizon(held.session, horizon_path, lease.owner, horizon_ms)
                    held.session.delete(lease_path)
            except (self._kz.no_node, SessionGone):
                pass  # the node or the session is gone already: nothing of ours to free
            finally:
                held.session.stop()  # ends the session, so the node goes even if delete failed

    def _rows(self, namespace: str) -> list[WorkerInfo]:
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
                # ZooKeeper has no per-node TTL: a lease node lives as long as its session,
                # which ends at most one session timeout after its holder stops heart-beating.
                expires_in: float | None = float(node.get("session", 0.0))
            except self._kz.no_node:
                node, expires_in = {}, None
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
