"""Worker-id leases and compare-and-set cells (hence segment keys, see over_cas/ranges.py) on etcd,
through its v3 JSON gateway (plain HTTP, kept-alive connections: http.py), one client for both.

Keys, under the URL's prefix (default "idmint"), with the namespace percent-encoded:

    {prefix}/w/{namespace}/{worker_id}   the holder's owner string, attached to an etcd lease,
                                         so etcd's own TTL judges expiry
    {prefix}/h/{namespace}/{worker_id}   "{horizon_ms} {host}", no lease: outlives the holders
                                         and only moves up
    {prefix}/s/{namespace}/{worker_id}   present while the id is reserved for static holders
    {prefix}/meta                        the store's identity: {"id": UUID, "created_ms": ...}
    {prefix}/c/{key}                     a compare-and-set cell (see EtcdCasStore)

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

from ..._errors import InvalidArgument, LeaseLost, StoreUnavailable, WorkerInUse
from ..._fork import ForkAware, orphan
from .._urls import scrub
from ..base import Lease, StoreIdentity, WorkerInfo, check_claim, forgotten
from ..engine import Engine
from ..leasing import choose_worker, holder_name
from ..over_cas.quorum import CasQuorumNode
from ..over_cas.ranges import CasRangeStore
from .http import Connections, NoAnswer, NotSent

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


class _EtcdClient(ForkAware):
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
            self._answered.date_ms = _date_ms(r.date)
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
                raise _EtcdError(str(message or answer.get("message") or r.status))
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
        except _EtcdError as exc:
            raise self.unavailable(str(exc)) from None

    def range(self, body: Json) -> Json:
        """A /v3/kv/range call: linearizable (etcd's default), answered by the leader's view."""
        try:
            return self.call("kv/range", body)
        except _EtcdError as exc:
            raise self.unavailable(str(exc)) from None

    def last_date_ms(self) -> int | None:
        """The store's clock: the Date of this thread's last answer."""
        date_ms: int | None = getattr(self._answered, "date_ms", None)
        return date_ms

    def meta(self) -> tuple[StoreIdentity, str]:
        """The store's identity and its key's mod_revision, made if it is missing. Its creation
        time is the Date etcd sent with the read that found it missing, rounded up."""
        key = f"{self.prefix}/meta"
        found = _kvs(self.txn([], [_range(key)])["responses"][0])
        if not found:
            created_ms = (self.last_date_ms() or 0) + DATE_STEP_MS
            value = json.dumps({"id": uuid.uuid4().hex, "created_ms": created_ms})
            answer = self.txn([_unchanged(key, "0")], [_put(key, value)], [_range(key)])
            if answer.get("succeeded"):
                found = _kvs(self.txn([], [_range(key)])["responses"][0])
            else:
                found = _kvs(answer["responses"][0])
        kv = found[0]
        data = json.loads(_unb64(kv["value"]))
        return StoreIdentity(str(data["id"]), int(data["created_ms"])), str(kv["mod_revision"])

    def close(self) -> None:
        """Close the connections; safe to repeat, and from any of the stores sharing them."""
        with self._lock:
            client = self._client
        client.close()


class EtcdLeaseStore(ForkAware):
    """A LeaseStore on an etcd cluster; thread-safe."""

    def __init__(self, etcd: _EtcdClient) -> None:
        self.display_url = etcd.display_url
        self._etcd = etcd
        self._prefix = etcd.prefix
        self._leases: dict[str, str] = {}  # owner -> etcd lease id, for renew and release
        self._lock = threading.Lock()
        self._watch_fork()

    def _after_fork(self) -> None:
        # The parent's etcd leases are not the child's (the client resets itself).
        self._leases = {}
        self._lock = threading.Lock()

    def _call(self, path: str, body: Json) -> Json:
        self._check_fork()
        return self._etcd.call(path, body)

    def _txn(
        self, compare: list[Json], success: list[Json], failure: list[Json] | None = None
    ) -> Json:
        self._check_fork()
        return self._etcd.txn(compare, success, failure)

    def _unavailable(self, why: str) -> StoreUnavailable:
        return self._etcd.unavailable(why)

    def _lease_call(self, path: str, lease_id: str) -> Json | None:
        """A /v3/lease/ call; None when etcd says the lease does not exist."""
        try:
            return self._call(f"lease/{path}", {"ID": lease_id})
        except _EtcdError as exc:
            if "not found" in str(exc):
                return None
            raise self._unavailable(str(exc)) from None

    # -- keys --------------------------------------------------------------------------------

    def _keys(self, namespace: str) -> tuple[str, str, str]:
        """The prefixes of the namespace's lease, horizon and reservation keys."""
        ns = quote(namespace, safe="")
        return f"{self._prefix}/w/{ns}/", f"{self._prefix}/h/{ns}/", f"{self._prefix}/s/{ns}/"

    def _scan(self, namespace: str) -> list[Json]:
        """Txn ops reading the namespace's lease, horizon and reservation keys."""
        return [_range(prefix) for prefix in self._keys(namespace)]

    def _scanned(
        self, namespace: str, answer: Json
    ) -> tuple[dict[int, Json], dict[int, Json], set[int]]:
        """Lease and horizon keys by worker id and the reserved ids, from an answer to `_scan`."""
        found: list[dict[int, Json]] = []
        for prefix, response in zip(self._keys(namespace), answer["responses"], strict=True):
            found.append({int(_unb64(kv["key"])[len(prefix) :]): kv for kv in _kvs(response)})
        return found[0], found[1], set(found[2])

    def _meta(self) -> tuple[StoreIdentity, str]:
        return self._etcd.meta()

    def identity(self) -> StoreIdentity | None:
        return self._meta()[0]

    # -- LeaseStore --------------------------------------------------------------------------

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
        owner, host = uuid.uuid4().hex, holder_name()
        lease_keys, horizon_keys, static_keys = self._keys(namespace)
        identity, meta_revision = self._meta()
        meta_key = f"{self._prefix}/meta"
        lease_id = ""
        answer = self._txn([], self._scan(namespace))
        try:
            for _ in range(ATTEMPTS):
                held, horizons, reserved = self._scanned(namespace, answer)
                if claim is None:
                    free = choose_worker(
                        namespace,
                        workers,
                        (w for w in range(workers) if w not in held and w not in reserved),
                        functools.partial(_stored_floor, horizons),
                        now_ms,
                    )
                else:
                    free = claim
                    if free in held:
                        holder = _horizon(horizons.get(free))[1]
                        raise WorkerInUse(namespace, free, holder, None)
                if not lease_id:
                    granted = self._call("lease/grant", {"TTL": max(1, math.ceil(ttl))})
                    lease_id = str(granted["ID"])
                floor, _, mod = _horizon(horizons.get(free))
                horizon = max(floor, horizon_ms)
                lease_key, horizon_key = f"{lease_keys}{free}", f"{horizon_keys}{free}"
                puts = [_put(lease_key, owner, lease_id), _put(horizon_key, f"{horizon} {host}")]
                if claim is not None:
                    puts.append(_put(f"{static_keys}{free}", host))
                answer = self._txn(
                    # ... and the store is still the one whose identity we read
                    [
                        _unchanged(lease_key, "0"),
                        _unchanged(horizon_key, mod),
                        _unchanged(meta_key, meta_revision),
                    ],
                    puts,
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
                        store_id=identity.id,
                        store_created_ms=identity.created_ms,
                        static=claim is not None,
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
        lease_key, horizon_key, _ = (f"{k}{lease.worker_id}" for k in self._keys(lease.namespace))
        meta_key = f"{self._prefix}/meta"
        store_id = None
        with self._lock:
            lease_id = self._leases.get(lease.owner)
        if lease_id is None:
            raise lost
        alive = self._lease_call("keepalive", lease_id)
        if alive is None or int(alive.get("TTL", 0)) <= 0:
            raise lost
        for _ in range(ATTEMPTS):
            read = self._txn(
                [_holds(lease_key, lease.owner)], [_range(horizon_key), _range(meta_key)]
            )
            if not read.get("succeeded"):
                raise lost
            meta = _kvs(read["responses"][1])
            store_id = json.loads(_unb64(meta[0]["value"]))["id"] if meta else None
            kvs = _kvs(read["responses"][0])
            current, host, mod = _horizon(kvs[0] if kvs else None)
            if current < lease.horizon_ms:
                raise forgotten(lease, current)
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
            store_id=store_id,
        )

    def _last_date_ms(self) -> int | None:
        return self._etcd.last_date_ms()

    def release(self, lease: Lease, issued_ms: int | None = None) -> None:
        lease_keys, horizon_keys, _ = self._keys(lease.namespace)
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
        held, horizons, reserved = self._scanned(namespace, self._txn([], self._scan(namespace)))
        rows = []
        for worker_id in sorted(held.keys() | horizons.keys() | reserved):
            horizon, host, _ = _horizon(horizons.get(worker_id))
            kv = held.get(worker_id)
            owner, expires_in = "", None
            if kv is not None:
                owner = _unb64(kv.get("value", ""))
                alive = self._lease_call("timetolive", str(kv.get("lease", "0")))
                expires_in = float(alive.get("TTL", -1)) if alive is not None else -1.0
            rows.append(
                WorkerInfo(
                    namespace,
                    worker_id,
                    owner,
                    host,
                    expires_in,
                    horizon,
                    static=worker_id in reserved,
                )
            )
        return rows

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        key = f"{self._keys(namespace)[2]}{worker_id}"
        answer = self._txn([], [{"request_delete_range": {"key": _b64(key)}}])
        return int(answer["responses"][0]["response_delete_range"].get("deleted", 0)) > 0

    def close(self) -> None:
        self._etcd.close()


SCAN_PAGE = 500  # cells per range request of a scan (4 KB values: 2 MB answers at most)


class EtcdCasStore:
    """A CasStore on etcd: cell `key` is the etcd key `{prefix}/c/{key}`, its version the key's
    mod_revision (the cluster's revision of its last write: a new one on every change).

    A create is a txn "create_revision == 0 -> put", a swap "mod_revision == version -> put";
    etcd answers a txn after a majority of members has written it to their logs (fsynced), and
    every read here is linearizable (etcd's default, not `serializable`), so an answer never
    comes from a member that lags behind.
    """

    def __init__(self, etcd: _EtcdClient) -> None:
        self.display_url = etcd.display_url
        self._etcd = etcd
        self._cells = f"{etcd.prefix}/c/"

    def init(self) -> None:
        """Nothing to create (cells are made by `create`); makes the store's identity."""
        self._etcd.meta()

    def identity(self) -> StoreIdentity | None:
        """The identity under this prefix, the lease store's: made on first use."""
        return self._etcd.meta()[0]

    def read(self, key: str) -> tuple[str, int] | None:
        kvs = self._etcd.range({"key": _b64(self._cells + key)}).get("kvs", [])
        if not kvs:
            return None
        return _unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"])

    def create(self, key: str, value: str) -> bool:
        cell = self._cells + key
        return bool(self._etcd.txn([_unchanged(cell, "0")], [_put(cell, value)]).get("succeeded"))

    def swap(self, key: str, version: int, value: str) -> bool:
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            return False  # a compare on mod_revision 0 would match a missing key
        cell = self._cells + key
        answer = self._etcd.txn([_unchanged(cell, str(version))], [_put(cell, value)])
        return bool(answer.get("succeeded"))

    def scan(self, prefix: str) -> list[tuple[str, str]]:
        start = self._cells + prefix
        body: Json = {"key": _b64(start), "range_end": _prefix_end(start), "limit": SCAN_PAGE}
        found: list[tuple[str, str]] = []
        while True:
            answer = self._etcd.range(body)
            kvs = answer.get("kvs", [])
            found += [
                (_unb64(kv["key"])[len(self._cells) :], _unb64(kv.get("value", ""))) for kv in kvs
            ]
            if not answer.get("more") or not kvs:
                return sorted(found)
            # The next page starts just past the last key, at the first page's revision: the
            # pages make one snapshot.
            body["revision"] = body.get("revision") or answer["header"]["revision"]
            body["key"] = base64.b64encode(base64.b64decode(kvs[-1]["key"]) + b"\0").decode()

    def close(self) -> None:
        """Close the connections (the engine's lease store shares them); safe to repeat."""
        self._etcd.close()


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


def _parse_url(url: str, display: str) -> tuple[list[str], str]:
    """(endpoints, prefix) of `etcd://host:port[,host:port...][/prefix]` (prefix: "idmint")."""
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
                f"bad store URL {display!r}: {scrub(endpoint, url)!r} is not host:port "
                "(etcd://host:port[,host:port...][/prefix])"
            )
    if not endpoints or "?" in rest or "#" in rest:
        raise InvalidArgument(
            f"bad store URL {display!r}: expected etcd://host:port[,host:port...][/prefix]"
        )
    return endpoints, prefix


def open_etcd_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The etcd engine of a URL: segment keys (over CAS), worker leases and compare-and-set
    cells, all on one HTTP client. The URL is checked here; no I/O until the first call."""
    endpoints, prefix = _parse_url(url, display)
    etcd = _EtcdClient(endpoints, prefix, display, timeout=timeout)
    return Engine(
        "etcd",
        display,
        {
            "ranges": lambda engine: CasRangeStore(engine.cas()),
            "leases": lambda _: EtcdLeaseStore(etcd),
            "cas": lambda _: EtcdCasStore(etcd),
            "quorum": lambda engine: CasQuorumNode(engine.cas()),
        },
    )
