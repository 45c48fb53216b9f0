"""ZooKeeper sessions for the zookeeper engine: `Session` (one KazooClient, every call bounded
by the store timeout), `SharedSession` (the engine's one session that holds no ephemeral nodes:
the cells' and the lease store's reads), the store's identity node, the parts of kazoo used
(imported only when a zk:// store is opened), and `Target`: the servers and how to reach them
(digest credentials, TLS), which every session of an engine shares.

Locked down (issue 33): a session with a user adds its digest credentials when it connects, and
every node idmint creates (parents made on the way too) gets one ACL entry, that user with all
permissions: no other client, anonymous or not, can read, change or delete it. ZooKeeper checks
no digest password when a session adds it (it only names an identity), so a wrong password shows
as NoAuth on the first node it touches, said so in the message.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..._errors import DriverMissing, StoreUnavailable
from ..._fork import ForkAware, orphan
from ..base import StoreIdentity
from ..tls import TlsSettings, handshake_failure

SHARED_SESSION_TIMEOUT = 10.0  # seconds; the shared client holds no ephemeral nodes


@dataclass(frozen=True)
class Kazoo:
    """The parts of kazoo used here (kazoo is imported only when a zk:// store is opened)."""

    client: Any  # kazoo.client.KazooClient
    no_node: type[Exception]
    node_exists: type[Exception]
    bad_version: type[Exception]
    session_gone: type[Exception]  # SessionExpiredError, also ConnectionClosedError
    error: type[Exception]  # KazooException
    no_auth: type[Exception]  # NoAuthError: the node's ACL refuses this session
    digest_acl: Callable[..., Any]  # kazoo.security.make_digest_acl
    tls_handler: Callable[[ssl.SSLContext], Any]  # a kazoo handler connecting with a context


@dataclass(frozen=True)
class Target:
    """The servers (kazoo's hosts string), the digest user and password, and TLS: what every
    session of one engine connects with. The password and the ACL (its hash) show in no repr."""

    hosts: str
    user: str | None = None
    password: str = field(default="", repr=False)
    tls: TlsSettings | None = None
    acl: list[Any] | None = field(default=None, repr=False)
    context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)

    def client_args(self, kz: Kazoo) -> dict[str, Any]:
        """KazooClient's arguments for this target."""
        args: dict[str, Any] = {"hosts": self.hosts}
        if self.user is not None:
            args["auth_data"] = [("digest", f"{self.user}:{self.password}")]
            args["default_acl"] = self.acl  # create() and makepath's parents both use it
        if self.context is not None:
            # kazoo's own TLS builds a context per connection that trusts the system's CAs
            # on top of `ca` (and spends ~20 ms of CPU loading them, a lease's session each);
            # this handler connects with the engine's one context, which trusts `ca` alone.
            args.update(use_ssl=True, handler=kz.tls_handler(self.context))
        return args


class SessionGone(StoreUnavailable):
    """The session expired or its client was stopped: its ephemeral nodes are gone."""


class _SessionLog(logging.LoggerAdapter[logging.Logger]):
    """kazoo logs the session timeout the server negotiated, and keeps it nowhere else; and
    why a connection failed (a refused certificate), which it retries without telling."""

    negotiated_ms: int | None = None
    tls_failure: str | None = None  # the last connection's TLS failure, in a line
    tls_failures = 0  # connections in a row that failed TLS (a server's certificate, ours)

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if isinstance(msg, str) and msg.startswith("Session created") and len(args) >= 3:
            self.negotiated_ms = int(str(args[2]))
        if isinstance(msg, str) and msg.startswith("Connection dropped") and args:
            dropped = args[0]
            # kazoo's ConnectionDropped, raised while handling the ssl module's error
            if isinstance(dropped, BaseException):
                failure = handshake_failure(dropped)
                self.tls_failure = failure or self.tls_failure
                self.tls_failures = self.tls_failures + 1 if failure else 0
        super().log(level, msg, *args, **kwargs)


class Session:
    """One KazooClient, hence one ZooKeeper session; every call bounded by `timeout`."""

    def __init__(
        self, kz: Kazoo, target: Target, display: str, session_timeout: float, timeout: float
    ) -> None:
        self._kz, self._display, self._timeout = kz, display, timeout
        self._user = target.user
        self._servers = target.hosts.count(",") + 1
        # a refused handshake may mean the server wants a client certificate the URL lacks
        self._cert_hint = target.tls is not None and target.tls.cert is None
        self._log = _SessionLog(logging.getLogger("kazoo.client"))
        self._client = kz.client(
            **target.client_args(kz), timeout=session_timeout, logger=self._log
        )
        self.session_timeout = session_timeout
        self.session_id = 0
        self._stalled = False  # a call got no answer in time: stop() does not wait on it again

    def _unavailable(self, what: object) -> StoreUnavailable:
        return StoreUnavailable(f"store {self._display} unavailable: {what}")

    def start(self) -> None:
        # Not KazooClient.start(timeout): after its timeout it stops the client and waits for
        # the connection thread, up to max(10 s, the session timeout) on a frozen server.
        try:
            connected = self._wait_connected(self._client.start_async())
        except Exception as exc:
            self.stop()
            raise self._unavailable(f"cannot connect ({type(exc).__name__})") from exc
        if not (connected and self._client.connected):
            self._stalled = True
            self.stop()
            why = self._log.tls_failure or f"no connection within {self._timeout:g} s"
            if self._log.tls_failure and self._cert_hint:
                why += " (does ZooKeeper want a client certificate? cert=PATH&key=PATH)"
            raise self._unavailable(why)
        self.session_id = int(self._client.client_id[0])
        if self._log.negotiated_ms is not None:
            self.session_timeout = self._log.negotiated_ms / 1000

    def _wait_connected(self, event: Any) -> bool:
        """Whether the session connected within the timeout; given up sooner once every
        server has refused TLS (kazoo would go on trying for as long: a certificate does not
        get better; a single server whose certificate fails still leaves the others)."""
        deadline = time.monotonic() + self._timeout
        while True:
            left = deadline - time.monotonic()
            if event.wait(timeout=max(0.0, min(left, 0.05))):
                return True
            if left <= 0 or self._log.tls_failures >= self._servers:
                return False

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
            raise SessionGone(f"store {self._display} unavailable: session ended") from exc
        except kz.no_auth as exc:
            who = f"ZooKeeper user {self._user!r}" if self._user else "a client without a user"
            raise self._unavailable(
                f"permission denied: the node's ACL does not let {who} do this (a wrong "
                "password is another digest identity; docs/stores.md, ZooKeeper, Locked down)"
            ) from exc
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


class SharedSession(ForkAware):
    """The one session of an engine that holds no ephemeral nodes: the lease store's reads and
    every compare-and-set cell share it. Opened on first use; after `close`, the next use
    opens another. kazoo reconnects it by itself, to a new session if the old one expired,
    which is fine for what it does: nothing it made dies with it."""

    def __init__(self, kz: Kazoo, target: Target, display_url: str, timeout: float) -> None:
        self._kz, self._target, self._display, self._timeout = kz, target, display_url, timeout
        self._session: Session | None = None
        self._lock = threading.Lock()
        self._watch_fork()

    def _after_fork(self) -> None:
        # kazoo's threads did not survive the fork, and the session is the parent's: closing
        # it here would close it for the parent. Leave it, and start afresh.
        orphan(self._session)
        self._session = None
        self._lock = threading.Lock()

    def get(self) -> Session:
        self._check_fork()
        with self._lock:
            if self._session is None:
                session = Session(
                    self._kz, self._target, self._display, SHARED_SESSION_TIMEOUT, self._timeout
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


def store_identity(kz: Kazoo, session: Session, root: str) -> StoreIdentity:
    """The store's identity, made if it is missing; its creation time is the node's ctime."""
    path = f"{root}/meta"
    while True:
        try:
            data, ctime = session.created(path)
            return StoreIdentity(data.decode(), ctime)
        except kz.no_node:
            with contextlib.suppress(kz.node_exists):
                session.create(path, uuid.uuid4().hex.encode())


def load_kazoo() -> Kazoo:
    """The parts of kazoo used here, or DriverMissing naming the extra to install."""
    try:
        from kazoo import exceptions
        from kazoo.client import KazooClient
        from kazoo.handlers.threading import SequentialThreadingHandler
        from kazoo.security import make_digest_acl
    except ImportError:
        raise DriverMissing("zk:// stores need kazoo: pip install 'idmint[zookeeper]'") from None
    return Kazoo(
        client=KazooClient,
        no_node=exceptions.NoNodeError,
        node_exists=exceptions.NodeExistsError,
        bad_version=exceptions.BadVersionError,
        session_gone=exceptions.SessionExpiredError,
        error=exceptions.KazooException,
        no_auth=exceptions.NoAuthError,
        digest_acl=make_digest_acl,
        tls_handler=_tls_handler(SequentialThreadingHandler),
    )


def _tls_handler(base: type[Any]) -> Callable[[ssl.SSLContext], Any]:
    """A maker of kazoo handlers (`base`'s subclass) whose connections are TLS with a given
    context: the server's certificate and name verified as the context says (stores/tls.py)."""

    class TlsHandler(base):  # type: ignore[misc]
        def __init__(self, context: ssl.SSLContext) -> None:
            super().__init__()
            self._context = context

        def create_connection(
            self,
            address: tuple[str, int],
            hostname: str | None = None,
            timeout: float | None = None,
            **_kazoo_tls: Any,  # kazoo's own TLS settings: this context replaces them
        ) -> ssl.SSLSocket:
            sock = socket.create_connection(address, timeout)
            try:
                tls = self._context.wrap_socket(sock, server_hostname=hostname or address[0])
            except BaseException:
                sock.close()
                raise
            tls.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return tls

    return TlsHandler
