"""The HTTP side of one etcd URL, through etcd's v3 JSON gateway, shared by its engine's lease
store and cells: endpoints tried in turn, the store's identity under the prefix, the JSON
shapes of the requests both send, and the kept-alive connections they go over (`Connections`).

`Connections` is a lean HTTP/1.1 client from the standard library, a handful of function calls
per request: httpx spent about a millisecond of CPU on each etcd call (some 1,900 Python calls
in its layers), and with ten processes on one machine that CPU, not etcd, was the ceiling. What
it keeps from it is what the callers rely on: a request that could not be connected was not
sent (another endpoint may take it), one that was sent and got no answer may have been applied
(it must not be sent elsewhere).

etcd's API reports no time; its HTTP Date header (whole seconds, from the member that answered)
is the store's clock that a lease reports.

Locked down (issue 33): with a TLS context every endpoint is https, the server's certificate
and name verified (stores/tls.py); with credentials, the client authenticates to etcd's RBAC
(`/v3/auth/authenticate`, a bcrypt check on the server and a raft round) once, sends the token
in the `Authorization` header, and authenticates again when etcd calls the token invalid: a
simple token expires after `--auth-token-ttl` (300 s) unused, a JWT at its `ttl`, and a member
restart or a password change drops them. A request refused for its token was not applied, so
it is sent again, once, with the new token.
"""

from __future__ import annotations

import base64
import email.utils
import http.client
import json
import socket
import ssl
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..._errors import StoreUnavailable
from ..._fork import ForkAware, orphan
from ..._poll import readable
from ..base import StoreIdentity
from ..tls import handshake_failure


class NotSent(Exception):
    """No connection could be made: the request was not sent."""


class NoAnswer(Exception):
    """The request was sent (or may have been), and no whole answer came: it may have been
    applied."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    date: str | None  # the Date header: the server's clock


def _failure(exc: OSError) -> str:
    """A connection's failure in a line: what TLS said, else the socket's reason."""
    return handshake_failure(exc) or str(exc.strerror or exc)


class Connections:
    """Idle kept-alive connections per endpoint ("host:port"), shared by threads: a thread
    takes one for a request and puts it back after a whole answer. Thread-safe. With a TLS
    context, https: the handshake is part of connecting, so a certificate refused on either
    side is NotSent (no request left)."""

    def __init__(self, timeout: float, tls: ssl.SSLContext | None = None) -> None:
        self.timeout = timeout
        self.tls = tls
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self.closed = False

    def post(self, endpoint: str, path: str, body: bytes, token: str = "") -> Answer:
        """POST `body` (JSON) to http(s)://endpoint/path, with an auth token if one is given.
        Raises NotSent or NoAnswer."""
        conn = self._take(endpoint)
        fresh = conn is None
        if conn is None:
            conn = self._connect(endpoint)
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        try:
            conn.request("POST", path, body, headers)
            response = conn.getresponse()
            data = response.read()
        except TimeoutError:
            conn.close()
            raise NoAnswer(f"{endpoint}: no answer within {self.timeout:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            refused = handshake_failure(exc) if fresh else None
            if refused is not None:
                # TLS 1.3 tells the client its certificate was refused only at the first read:
                # the server took no request on that connection.
                raise NotSent(f"{endpoint}: {refused}") from None
            raise NoAnswer(f"{endpoint}: {type(exc).__name__} {exc}".strip()) from None
        if response.will_close:
            conn.close()
        else:
            self._put(endpoint, conn)
        return Answer(response.status, data, response.getheader("date"))

    def _connect(self, endpoint: str) -> http.client.HTTPConnection:
        """A new connection (TLS handshake done), or NotSent."""
        where = urlsplit(f"//{endpoint}")  # "[::1]:2379" too
        host = where.hostname or endpoint
        conn: http.client.HTTPConnection
        if self.tls is not None:
            conn = http.client.HTTPSConnection(
                host, where.port, timeout=self.timeout, context=self.tls
            )
        else:
            conn = http.client.HTTPConnection(host, where.port, timeout=self.timeout)
        try:
            conn.connect()
        except TimeoutError:
            conn.close()
            raise NotSent(f"{endpoint}: no connection within {self.timeout:g} s") from None
        except OSError as exc:
            conn.close()
            raise NotSent(f"{endpoint}: {_failure(exc)}") from None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _take(self, endpoint: str) -> http.client.HTTPConnection | None:
        """An idle connection the server has not closed, or None."""
        while True:
            with self._lock:
                idle = self._idle.get(endpoint)
                if not idle:
                    return None
                conn = idle.pop()
            sock = conn.sock
            # An idle socket with something to read has been closed by the server (or has
            # junk on it): a request sent on it would fail after leaving, outcome unknown.
            if sock is not None and not readable([sock.fileno()], 0):
                return conn
            conn.close()

    def _put(self, endpoint: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self.closed:
                self._idle.setdefault(endpoint, []).append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections; safe to repeat. Connections in use are closed when
        their request ends."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


DATE_STEP_MS = 1000  # an HTTP Date header counts whole seconds

Json = dict[str, Any]


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def unb64(data: str) -> str:
    return base64.b64decode(data).decode()


def prefix_end(prefix: str) -> str:
    """The range_end that makes a range cover every key starting with `prefix`."""
    raw = prefix.encode()
    return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()


def range_op(prefix: str) -> Json:
    return {"request_range": {"key": b64(prefix), "range_end": prefix_end(prefix)}}


def put_op(key: str, value: str, lease_id: str = "0") -> Json:
    return {"request_put": {"key": b64(key), "value": b64(value), "lease": lease_id}}


def unchanged(key: str, mod_revision: str) -> Json:
    """A compare that holds while `key` is as read (mod_revision "0": still absent)."""
    if mod_revision == "0":
        return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}


def holds(key: str, owner: str) -> Json:
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(owner)}


def kvs_of(response: Json) -> list[Json]:
    kvs: list[Json] = response.get("response_range", {}).get("kvs", [])
    return kvs


class EtcdError(Exception):
    """etcd answered with an error."""


@dataclass(frozen=True)
class Credentials:
    """An etcd RBAC user and its password (never shown: not in repr)."""

    user: str
    password: str = field(repr=False)


#: etcd's errors that mean "authenticate again": the token expired or was dropped (a member
#: restart, a password change), the auth store moved on since it was issued, or none was sent.
_STALE_TOKEN = ("invalid auth token", "revision of auth store is old", "user name is empty")
_BAD_PASSWORD = "authentication failed"
_DENIED = "permission denied"


class EtcdClient(ForkAware):
    """The HTTP side of one etcd URL, shared by its engine's lease store and cells: endpoints
    tried in turn, one pool of connections (thread-safe), the store's identity under the
    prefix."""

    def __init__(
        self,
        endpoints: list[str],
        prefix: str,
        display_url: str,
        *,
        timeout: float,
        tls: ssl.SSLContext | None = None,
        credentials: Credentials | None = None,
        client_cert: bool = False,
    ) -> None:
        self.display_url = display_url
        self.prefix = prefix
        self.timeout = timeout
        self._endpoints = endpoints
        self._tls = tls
        self._client_cert = client_cert  # the URL gives one (else a refused handshake may want it)
        self._credentials = credentials
        # etcd's auth token: None until authenticated, "" when etcd has auth off
        self._token: str | None = None
        self._client = Connections(timeout, tls)
        self._lock = threading.Lock()
        self._auth_lock = threading.Lock()  # one authentication at a time
        self._answered = threading.local()  # date_ms: the Date of this thread's last answer
        self._watch_fork()

    def _after_fork(self) -> None:
        # The parent's pooled sockets are not the child's: an answer could go to either.
        # (The token is the user's, not the connection's: the child keeps it.)
        orphan(self._client)
        self._client = Connections(self.timeout, self._tls)
        self._lock = threading.Lock()
        self._auth_lock = threading.Lock()
        self._answered = threading.local()

    def _http(self) -> Connections:
        """The connections; new ones after `close` (closing releases them, nothing else)."""
        self._check_fork()
        with self._lock:
            if self._client.closed:
                self._client = Connections(self.timeout, self._tls)
            return self._client

    def call(self, path: str, body: Json) -> Json:
        """POST to the first endpoint that can be connected to, authenticated when the URL
        has a user; an etcd error is raised."""
        if self._credentials is None:
            return self._post(path, body, "")
        token = self._token if self._token is not None else self._authenticate(None)
        try:
            return self._post(path, body, token)
        except EtcdError as exc:
            if not any(why in str(exc) for why in _STALE_TOKEN):
                raise
        # Refused for its token, so not applied: safe to send again with a new one.
        return self._post(path, body, self._authenticate(token))

    def _authenticate(self, stale: str | None) -> str:
        """A token for the URL's user: the one another thread got meanwhile, if it replaced
        `stale`, else a new one. StoreUnavailable naming the store for a wrong password."""
        credentials = self._credentials
        assert credentials is not None
        with self._auth_lock:
            if self._token is not None and self._token != stale:
                return self._token
            body = {"name": credentials.user, "password": credentials.password}
            try:
                answer = self._post("auth/authenticate", body, "")
            except EtcdError as exc:
                if "authentication is not enabled" not in str(exc):
                    raise self.unavailable(str(exc)) from None
                # an open etcd: no token, until one turns auth on ("user name is empty")
                answer = {"token": ""}
            self._token = str(answer.get("token", ""))
            return self._token

    def _post(self, path: str, body: Json, token: str) -> Json:
        """POST to the first endpoint that can be connected to; an etcd error is raised."""
        client = self._http()
        problems: list[str] = []
        with self._lock:
            endpoints = list(self._endpoints)
        data = json.dumps(body).encode()
        for endpoint in endpoints:
            try:
                r = client.post(endpoint, f"/v3/{path}", data, token)
            except NotSent as exc:  # the next endpoint may answer
                problems.append(str(exc))
                continue
            except NoAnswer as exc:  # sent, maybe applied: no failover for this request
                with self._lock:  # but the next one tries the others first: a hung member
                    if len(self._endpoints) > 1 and self._endpoints[0] == endpoint:
                        self._endpoints.append(self._endpoints.pop(0))  # (SIGSTOP, a full
                raise self.unavailable(str(exc)) from None  # disk) would stall every call
            with self._lock:  # the endpoint that answered goes first from now on
                if self._endpoints[0] != endpoint:
                    self._endpoints.remove(endpoint)
                    self._endpoints.insert(0, endpoint)
            self._answered.date_ms = date_ms(r.date)
            # keepalive is a stream: one JSON message a line, the first is the answer
            text = r.body.decode(errors="replace").split("\n", 1)[0]
            try:
                answer: Json = json.loads(text)
            except ValueError:
                why = f"{endpoint} answered {r.status}: {text[:200]}"
                raise self.unavailable(why) from None
            error = answer.get("error")
            if r.status != 200 or error:
                message = error.get("message") if isinstance(error, dict) else error
                raise EtcdError(str(message or answer.get("message") or r.status))
            result: Json = answer.get("result", answer)
            return result
        raise self.unavailable("; ".join(problems))

    def unavailable(self, why: str) -> StoreUnavailable:
        """StoreUnavailable naming the store, saying in one line what to do about a refusal."""
        why = " ".join(why.split())
        user = self._credentials.user if self._credentials else None
        if _BAD_PASSWORD in why:
            why = f"authentication failed: wrong user name or password for etcd user {user!r}"
        elif _DENIED in why:
            who = f"etcd user {user!r}" if user else "a client without a user (add user:password@)"
            why = (
                f"permission denied: {who} needs a role with readwrite on the keys under "
                f"{self.prefix + '/'!r} (docs/stores.md, etcd, Locked down)"
            )
        elif any(stale in why for stale in _STALE_TOKEN[2:]):
            why = "etcd has authentication on: give user:password@ in the URL"
        elif "TLS: the handshake failed" in why and self._tls and not self._client_cert:
            why += " (does etcd want a client certificate? cert=PATH&key=PATH)"
        elif "CommonName of client" in why:
            # etcd 3.4.10+: with auth on, its JSON gateway (which idmint speaks) refuses a
            # client certificate with a CN, which only its gRPC API would take for the user
            why = (
                "etcd refuses a client certificate with a CommonName on its JSON gateway while "
                "auth is on: use one without (docs/stores.md, etcd, Locked down)"
            )
        return StoreUnavailable(f"store {self.display_url} unavailable: {why}")

    def txn(
        self, compare: list[Json], success: list[Json], failure: list[Json] | None = None
    ) -> Json:
        body = {"compare": compare, "success": success, "failure": failure or []}
        try:
            return self.call("kv/txn", body)
        except EtcdError as exc:
            raise self.unavailable(str(exc)) from None

    def range(self, body: Json) -> Json:
        """A /v3/kv/range call: linearizable (etcd's default), answered by the leader's view."""
        try:
            return self.call("kv/range", body)
        except EtcdError as exc:
            raise self.unavailable(str(exc)) from None

    def last_date_ms(self) -> int | None:
        """The store's clock: the Date of this thread's last answer."""
        answered: int | None = getattr(self._answered, "date_ms", None)
        return answered

    def meta(self) -> tuple[StoreIdentity, str]:
        """The store's identity and its key's mod_revision, made if it is missing. Its creation
        time is the Date etcd sent with the read that found it missing, rounded up."""
        key = f"{self.prefix}/meta"
        found = kvs_of(self.txn([], [range_op(key)])["responses"][0])
        if not found:
            created_ms = (self.last_date_ms() or 0) + DATE_STEP_MS
            value = json.dumps({"id": uuid.uuid4().hex, "created_ms": created_ms})
            answer = self.txn([unchanged(key, "0")], [put_op(key, value)], [range_op(key)])
            if answer.get("succeeded"):
                found = kvs_of(self.txn([], [range_op(key)])["responses"][0])
            else:
                found = kvs_of(answer["responses"][0])
        kv = found[0]
        data = json.loads(unb64(kv["value"]))
        return StoreIdentity(str(data["id"]), int(data["created_ms"])), str(kv["mod_revision"])

    def close(self) -> None:
        """Close the connections; safe to repeat, and from any of the stores sharing them."""
        with self._lock:
            client = self._client
        client.close()


def date_ms(header: str | None) -> int | None:
    """Unix milliseconds of an HTTP Date header (whole seconds); None if absent or unreadable."""
    if not header:
        return None
    try:
        return int(email.utils.parsedate_to_datetime(header).timestamp()) * 1000
    except (TypeError, ValueError):
        return None
