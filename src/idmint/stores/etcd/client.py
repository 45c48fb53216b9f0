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
"""

from __future__ import annotations

import base64
import email.utils
import http.client
import json
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..._errors import StoreUnavailable
from ..._fork import ForkAware, orphan
from ..._poll import readable
from ..base import StoreIdentity


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


class Connections:
    """Idle kept-alive connections per endpoint ("host:port"), shared by threads: a thread
    takes one for a request and puts it back after a whole answer. Thread-safe."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self.closed = False

    def post(self, endpoint: str, path: str, body: bytes) -> Answer:
        """POST `body` (JSON) to http://endpoint/path. Raises NotSent or NoAnswer."""
        conn = self._take(endpoint)
        if conn is None:
            where = urlsplit(f"//{endpoint}")  # "[::1]:2379" too
            host = where.hostname or endpoint
            conn = http.client.HTTPConnection(host, where.port, timeout=self.timeout)
            try:
                conn.connect()
            except TimeoutError:
                conn.close()
                raise NotSent(f"{endpoint}: no connection within {self.timeout:g} s") from None
            except OSError as exc:
                conn.close()
                raise NotSent(f"{endpoint}: {exc.strerror or exc}") from None
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
        except TimeoutError:
            conn.close()
            raise NoAnswer(f"{endpoint}: no answer within {self.timeout:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise NoAnswer(f"{endpoint}: {type(exc).__name__} {exc}".strip()) from None
        if response.will_close:
            conn.close()
        else:
            self._put(endpoint, conn)
        return Answer(response.status, data, response.getheader("date"))

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


class EtcdClient(ForkAware):
    """The HTTP side of one etcd URL, shared by its engine's lease store and cells: endpoints
    tried in turn, one pool of connections (thread-safe), the store's identity under the
    prefix."""

    def __init__(
        self, endpoints: list[str], prefix: str, display_url: str, *, timeout: float
    ) -> None:
        self.display_url = display_url
        self.prefix = prefix
        self.timeout = timeout
        self._endpoints = endpoints
        self._client = Connections(timeout)
        self._lock = threading.Lock()
        self._answered = threading.local()  # date_ms: the Date of this thread's last answer
        self._watch_fork()

    def _after_fork(self) -> None:
        # The parent's pooled sockets are not the child's: an answer could go to either.
        orphan(self._client)
        self._client = Connections(self.timeout)
        self._lock = threading.Lock()
        self._answered = threading.local()

    def _http(self) -> Connections:
        """The connections; new ones after `close` (closing releases them, nothing else)."""
        self._check_fork()
        with self._lock:
            if self._client.closed:
                self._client = Connections(self.timeout)
            return self._client

    def call(self, path: str, body: Json) -> Json:
        """POST to the first endpoint that can be connected to; an etcd error is raised."""
        client = self._http()
        problems: list[str] = []
        with self._lock:
            endpoints = list(self._endpoints)
        data = json.dumps(body).encode()
        for endpoint in endpoints:
            try:
                r = client.post(endpoint, f"/v3/{path}", data)
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
        why = " ".join(why.split())
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
