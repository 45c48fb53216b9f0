"""The HTTP side of one etcd URL, through etcd's v3 JSON gateway (kept-alive connections:
http.py), shared by its engine's lease store and cells: endpoints tried in turn, the store's
identity under the prefix, and the JSON shapes of the requests both send.

etcd's API reports no time; its HTTP Date header (whole seconds, from the member that answered)
is the store's clock that a lease reports.
"""

from __future__ import annotations

import base64
import email.utils
import json
import threading
import uuid
from typing import Any

from ..._errors import StoreUnavailable
from ..._fork import ForkAware, orphan
from ..base import StoreIdentity
from .http import Connections, NoAnswer, NotSent

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
            except NoAnswer as exc:  # sent, maybe applied: no failover
                raise self.unavailable(str(exc)) from None
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
