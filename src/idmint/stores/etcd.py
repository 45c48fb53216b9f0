"""Worker-id leases on etcd, through its v3 JSON gateway (plain HTTP, httpx).

Keys, under the URL's prefix (default "idmint"), with the namespace percent-encoded:

    {prefix}/w/{namespace}/{worker_id}   the holder's owner string, attached to an etcd lease,
                                         so etcd's own TTL judges expiry
    {prefix}/h/{namespace}/{worker_id}   "{horizon_ms} {host}", no lease: outlives the holders
                                         and only moves up

URL: etcd://host:port[,host2:port2...][/prefix]. Endpoints are tried in turn when one cannot
be connected to.

etcd's API reports no time; its HTTP Date header (whole seconds, from the member that answered)
is the store's clock that a lease reports.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import functools
import json
import math
import threading
import uuid
from dataclasses import replace
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from .._errors import InvalidArgument, LeaseLost, StoreUnavailable, WorkersExhausted
from ._sql_leases import holder_name
from .base import Lease, WorkerInfo, pick_worker

DATE_STEP_MS = 1000  # an HTTP Date header counts whole seconds
ATTEMPTS = 100  # optimistic transactions lost in a row to concurrent writers: each lost one
# means another writer won, so this bounds only pathological contention

Json = dict[str, Any]


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(data: str) -> str:
    return base64.b64decode(data).decode()


def _prefix_end(prefix: str) -> str:
    """The range_end that makes a range cover every key starting with `prefix`."""
    raw = prefix.encode()
    return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()


def _range(prefix: str) -> Json:
    return {"request_range": {"key": _b64(prefix), "range_end": _prefix_end(prefix)}}


def _put(key: str, value: str, lease_id: str = "0") -> Json:
    return {"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease_id}}


def _unchanged(key: str, mod_revision: str) -> Json:
    """A compare that holds while `key` is as read (mod_revision "0": still absent)."""
    if mod_revision == "0":
        return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}


def _holds(key: str, owner: str) -> Json:
    return {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(owner)}


def _kvs(response: Json) -> list[Json]:
    kvs: list[Json] = response.get("response_range", {}).get("kvs", [])
    return kvs


def _horizon(kv: Json | None) -> tuple[int, str, str]:
    """(horizon_ms, host, mod_revision) of a horizon key; (0, "", "0") when absent."""
    if kv is None:
        return 0, "", "0"
    ms, _, host = _unb64(kv.get("value", "")).partition(" ")
    return int(ms), host, str(kv["mod_revision"])


def _stored_floor(horizons: dict[int, Json], worker_id: int) -> int:
    return _horizon(horizons.get(worker_id))[0]


class EtcdLeaseStore:
    """A LeaseStore on an etcd cluster; thread-safe (httpx.Client is)."""

    def __init__(
        self, endpoints: list[str], prefix: str, display_url: str, *, timeout: float
    ) -> None:
        self.display_url = display_url
        self._endpoints = endpoints
        self._prefix = prefix
        self._client = httpx.Client(timeout=timeout)
        self._leases: dict[str, str] = {}  # owner -> etcd lease id, for renew and release
        self._lock = threading.Lock()
        self._answered = threading.local()  # date_ms: the Date of this thread's last answer

    # -- HTTP --------------------------------------------------------------------------------

    def _call(self, path: str, body: Json) -> Json:
        """POST to the first endpoint that can be connected to; an etcd error is raised."""
        problems: list[str] = []
        with self._lock:
            endpoints = list(self._endpoints)
        for endpoint in endpoints:
            try:
                r = self._client.post(f"http://{endpoint}/v3/{path}", json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                problems.append(f"{endpoint}: {exc}")
                continue
            except httpx.HTTPError as exc:  # the request may have been applied: no failover
                raise self._unavailable(f"{endpoint}: {type(exc).__name__} {exc}") from None
            with self._lock:  # the endpoint that answered goes first from now on
                if self._endpoints[0] != endpoint:
                    self._endpoints.remove(endpoint)
                    self._endpoints.insert(0, endpoint)
            self._answered.date_ms = _date_ms(r.headers.get("date"))
            # keepalive is a stream: one JSON message a line, the first is the answer
            text = r.text.split("\n", 1)[0]
            try:
                answer: Json = json.loads(text)
            except ValueError:
                why = f"{endpoint} answered {r.status_code}: {text[:200]}"
                raise self._unavailable(why) from None
            error = answer.get("error")
            if r.status_code != 200 or error:
                message = error.get("message") if isinstance(error, dict) else error
                raise _EtcdError(str(message or answer.get("message") or r.status_code))
            result: Json = answer.get("result", answer)
            return result
        raise self._unavailable("; ".join(problems))

    def _unavailable(self, why: str) -> StoreUnavailable:
        why = " ".join(why.split())
        return StoreUnavailable(f"store {self.display_url} unavailable: {why}")

    def _txn(
        self, compare: list[Json], success: list[Json], failure: list[Json] | None = None
    ) -> Json:
        body = {"compare": compare, "success": success, "failure": failure or []}
        try:
            return self._call("kv/txn", body)
        except _EtcdError as exc:
            raise self._unavailable(str(exc)) from None

    def _lease_call(self, path: str, lease_id: str) -> Json | None:
        """A /v3/lease/ call; None when etcd says the lease does not exist."""
        try:
            return self._call(f"lease/{path}", {"ID": lease_id})
        except _EtcdError as exc:
            if "not found" in str(exc):
                return None
            raise self._unavailable(str(exc)) from None

    # -- keys --------------------------------------------------------------------------------

    def _keys(self, namespace: str) -> tuple[str, str]:
        ns = quote(namespace, safe="")
        return f"{self._prefix}/w/{ns}/", f"{self._prefix}/h/{ns}/"

    def _scan(self, namespace: str) -> list[Json]:
        """Txn ops reading the namespace's lease keys and horizon keys."""
        return [_range(prefix) for prefix in self._keys(namespace)]

    def _scanned(self, namespace: str, answer: Json) -> tuple[dict[int, Json], dict[int, Json]]:
        """The lease keys and horizon keys by worker id, from a txn answer to `_scan`."""
        found: list[dict[int, Json]] = []
        for prefix, response in zip(self._keys(namespace), answer["responses"], strict=True):
            found.append({int(_unb64(kv["key"])[len(prefix) :]): kv for kv in _kvs(response)})
        return found[0], found[1]

    # -- LeaseStore --------------------------------------------------------------------------

    def acquire(
        self,
        namespace: str,
        *,
        workers: int,
        ttl: float,
        horizon_ms: int,
        now_ms: int | None = None,
    ) -> Lease:
        owner, host = uuid.uuid4().hex, holder_name()
        lease_keys, horizon_keys = self._keys(namespace)
        lease_id = ""
        answer = self._txn([], self._scan(namespace))
        try:
            for _ in range(ATTEMPTS):
                held, horizons = self._scanned(namespace, answer)
                free = pick_worker(
                    (w for w in range(workers) if w not in held),
                    functools.partial(_stored_floor, horizons),
                    now_ms,
                )
                if free is None:
                    raise WorkersExhausted(namespace, workers)
                if not lease_id:
                    granted = self._call("lease/grant", {"TTL": max(1, math.ceil(ttl))})
                    lease_id = str(granted["ID"])
                floor, _, mod = _horizon(horizons.get(free))
                horizon = max(floor, horizon_ms)
                lease_key, horizon_key = f"{lease_keys}{free}", f"{horizon_keys}{free}"
                answer = self._txn(
                    [_unchanged(lease_key, "0"), _unchanged(horizon_key, mod)],
                    [_put(lease_key, owner, lease_id), _put(horizon_key, f"{horizon} {host}")],
                    self._scan(namespace),  # lost the race: read again in the same round trip
                )
                if answer.get("succeeded"):
                    with self._lock:
                        self._leases[owner] = lease_id
                    lease_id = ""
                    return Lease(
                        namespace,
                        free,
                        owner,
                        floor,
                        horizon,
                        ttl,
                        store_ms=self._last_date_ms(),
                        store_ms_step=DATE_STEP_MS,
                    )
        except _EtcdError as exc:
            raise self._unavailable(str(exc)) from None
        finally:
            if lease_id:  # granted but never attached to a worker id
                with contextlib.suppress(StoreUnavailable):  # else it expires on its own
                    self._lease_call("revoke", lease_id)
        raise self._unavailable(f"{ATTEMPTS} concurrent writers in a row took worker ids")

    def renew(self, lease: Lease, horizon_ms: int) -> Lease:
        lost = LeaseLost(f"worker {lease.worker_id} of namespace {lease.namespace!r} is lost")
        lease_key, horizon_key = (f"{k}{lease.worker_id}" for k in self._keys(lease.namespace))
        with self._lock:
            lease_id = self._leases.get(lease.owner)
        if lease_id is None:
            raise lost
        alive = self._lease_call("keepalive", lease_id)
        if alive is None or int(alive.get("TTL", 0)) <= 0:
            raise lost
        for _ in range(ATTEMPTS):
            read = self._txn([_holds(lease_key, lease.owner)], [_range(horizon_key)])
            if not read.get("succeeded"):
                raise lost
            kvs = _kvs(read["responses"][0])
            current, host, mod = _horizon(kvs[0] if kvs else None)
            horizon = max(current, horizon_ms)
            if horizon == current:
                break
            wrote = self._txn(
                [_holds(lease_key, lease.owner), _unchanged(horizon_key, mod)],
                [_put(horizon_key, f"{horizon} {host}")],
            )
            if wrote.get("succeeded"):
                break
        else:
            raise self._unavailable(f"{ATTEMPTS} concurrent writers in a row moved the horizon")
        return replace(
            lease,
            horizon_ms=horizon,
            store_ms=self._last_date_ms(),
            store_ms_step=DATE_STEP_MS,
        )

    def _last_date_ms(self) -> int | None:
        """The store's clock: the Date of this thread's last answer."""
        date_ms: int | None = getattr(self._answered, "date_ms", None)
        return date_ms

    def release(self, lease: Lease, issued_ms: int | None = None) -> None:
        lease_keys, horizon_keys = self._keys(lease.namespace)
        lease_key = f"{lease_keys}{lease.worker_id}"
        with self._lock:
            self._leases.pop(lease.owner, None)
        free = [{"request_delete_range": {"key": _b64(lease_key), "prev_kv": True}}]
        if issued_ms is not None:  # nobody else writes the horizon while we hold the id
            down = max(lease.floor_ms, issued_ms)
            free.append(_put(f"{horizon_keys}{lease.worker_id}", f"{down} {holder_name()}"))
        answer = self._txn([_holds(lease_key, lease.owner)], free)
        if answer.get("succeeded"):
            for kv in answer["responses"][0]["response_delete_range"].get("prev_kvs", []):
                # the id is free already; an unrevoked etcd lease just runs out
                with contextlib.suppress(StoreUnavailable):
                    self._lease_call("revoke", str(kv.get("lease", "0")))

    def holders(self, namespace: str) -> list[WorkerInfo]:
        held, horizons = self._scanned(namespace, self._txn([], self._scan(namespace)))
        rows = []
        for worker_id in sorted(held.keys() | horizons.keys()):
            horizon, host, _ = _horizon(horizons.get(worker_id))
            kv = held.get(worker_id)
            owner, expires_in = "", None
            if kv is not None:
                owner = _unb64(kv.get("value", ""))
                alive = self._lease_call("timetolive", str(kv.get("lease", "0")))
                expires_in = float(alive.get("TTL", -1)) if alive is not None else -1.0
            rows.append(WorkerInfo(namespace, worker_id, owner, host, expires_in, horizon))
        return rows

    def close(self) -> None:
        self._client.close()


def _date_ms(header: str | None) -> int | None:
    """Unix milliseconds of an HTTP Date header (whole seconds); None if absent or unreadable."""
    if not header:
        return None
    try:
        return int(email.utils.parsedate_to_datetime(header).timestamp()) * 1000
    except (TypeError, ValueError):
        return None


class _EtcdError(Exception):
    """etcd answered with an error."""


def open_etcd_leases(url: str, display: str, *, timeout: float) -> EtcdLeaseStore:
    """`etcd://host:port[,host:port...][/prefix]`; the prefix defaults to "idmint"."""
    rest = url.split("://", 1)[1]
    hosts, _, path = rest.partition("/")
    endpoints = [h.strip() for h in hosts.split(",") if h.strip()]
    prefix = path.strip("/") or "idmint"
    if "@" in hosts:
        raise InvalidArgument(f"bad store URL {display!r}: etcd:// URLs take no user or password")
    for endpoint in endpoints:
        try:
            parts = urlsplit(f"//{endpoint}")
            ok = bool(parts.hostname) and parts.port is not None
        except ValueError:
            ok = False
        if not ok:
            raise InvalidArgument(
                f"bad store URL {display!r}: {endpoint!r} is not host:port "
                "(etcd://host:port[,host:port...][/prefix])"
            )
    if not endpoints or "?" in rest or "#" in rest:
        raise InvalidArgument(
            f"bad store URL {display!r}: expected etcd://host:port[,host:port...][/prefix]"
        )
    return EtcdLeaseStore(endpoints, prefix, display, timeout=timeout)
