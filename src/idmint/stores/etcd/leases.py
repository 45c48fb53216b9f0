"""Worker-id leases on etcd, by the protocol of lease_protocol.py. Keys, under the URL's prefix,
with the namespace percent-encoded:

    {prefix}/w/{namespace}/{worker_id}   the holder's owner string, attached to an etcd lease,
                                         so etcd's own TTL judges expiry
    {prefix}/h/{namespace}/{worker_id}   "{horizon_ms} {host}", no lease: outlives the holders
                                         and only moves up
    {prefix}/s/{namespace}/{worker_id}   present while the id is reserved for static holders
    {prefix}/meta                        the store's identity (client.py)

A take is one txn: the lease key still absent, the horizon key as read (its mod_revision) and
the meta key as read (the store is still the one whose identity the lease reports) -> put the
lease key on a new etcd lease, the horizon, and for a static claim the reservation; when it
fails, the same round trip reads the namespace again.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from urllib.parse import quote

from ..._errors import StoreUnavailable
from ..._fork import ForkAware
from ..base import Lease, StoreIdentity, WorkerInfo
from ..lease_protocol import LOST, FencedLeases, Found, Request, Taken
from ..leasing import holder_name
from .client import (
    DATE_STEP_MS,
    EtcdClient,
    EtcdError,
    Json,
    b64,
    holds,
    kvs_of,
    put_op,
    range_op,
    unb64,
    unchanged,
)


def _horizon(kv: Json | None) -> tuple[int, str, str]:
    """(horizon_ms, host, mod_revision) of a horizon key; (0, "", "0") when absent."""
    if kv is None:
        return 0, "", "0"
    ms, _, host = unb64(kv.get("value", "")).partition(" ")
    return int(ms), host, str(kv["mod_revision"])


@dataclass
class _Table:
    """A namespace's lease and horizon keys by worker id, and its reserved ids."""

    leases: dict[int, Json]
    horizons: dict[int, Json]
    reserved_ids: set[int]

    def held(self, worker_id: int) -> bool:
        return worker_id in self.leases

    def reserved(self, worker_id: int) -> bool:
        return worker_id in self.reserved_ids

    def floor_ms(self, worker_id: int) -> int:
        return _horizon(self.horizons.get(worker_id))[0]

    def holder(self, worker_id: int) -> tuple[str, float | None]:
        return _horizon(self.horizons.get(worker_id))[1], None


class _Acquisition:
    """One acquire: the identity read first (its key's revision is compared by every take), the
    last answer that read the namespace, and the etcd lease granted for the take (revoked if
    the acquire ends without attaching it)."""

    def __init__(self, store: EtcdLeaseStore, request: Request) -> None:
        self._store, self._request = store, request
        self._identity, self._meta_revision = store._etcd.meta()
        self._answer: Json | None = None
        self.lease_id = ""

    def read(self) -> _Table:
        store, namespace = self._store, self._request.namespace
        if self._answer is None:
            self._answer = store._txn([], store._scan(namespace))
        answer, self._answer = self._answer, None
        return store._scanned(namespace, answer)

    def take(self, table: _Table, worker_id: int, horizon_ms: int) -> Taken | None:
        store, request = self._store, self._request
        lease_keys, horizon_keys, static_keys = store._keys(request.namespace)
        if not self.lease_id:
            try:
                granted = store._call("lease/grant", {"TTL": max(1, math.ceil(request.ttl))})
            except EtcdError as exc:
                raise store._etcd.unavailable(str(exc)) from None
            self.lease_id = str(granted["ID"])
        floor, _, mod = _horizon(table.horizons.get(worker_id))
        horizon = max(floor, horizon_ms)
        lease_key, horizon_key = f"{lease_keys}{worker_id}", f"{horizon_keys}{worker_id}"
        puts = [
            put_op(lease_key, request.owner, self.lease_id),
            put_op(horizon_key, f"{horizon} {request.host}"),
        ]
        if request.claim is not None:
            puts.append(put_op(f"{static_keys}{worker_id}", request.host))
        answer = store._txn(
            # ... and the store is still the one whose identity we read
            [
                unchanged(lease_key, "0"),
                unchanged(horizon_key, mod),
                unchanged(f"{store._prefix}/meta", self._meta_revision),
            ],
            puts,
            store._scan(request.namespace),  # lost the race: read again in the same round trip
        )
        if not answer.get("succeeded"):
            self._answer = answer
            return None
        with store._lock:
            store._leases[request.owner] = self.lease_id
        self.lease_id = ""
        return Taken(
            floor,
            horizon,
            store_ms=store._etcd.last_date_ms(),
            store_ms_step=DATE_STEP_MS,
            identity=self._identity,
        )


class EtcdLeaseStore(ForkAware, FencedLeases):
    """A LeaseStore on an etcd cluster; thread-safe."""

    def __init__(self, etcd: EtcdClient) -> None:
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

    def _lease_call(self, path: str, lease_id: str) -> Json | None:
        """A /v3/lease/ call; None when etcd says the lease does not exist."""
        try:
            return self._call(f"lease/{path}", {"ID": lease_id})
        except EtcdError as exc:
            if "not found" in str(exc):
                return None
            raise self._etcd.unavailable(str(exc)) from None

    # -- keys --------------------------------------------------------------------------------

    def _keys(self, namespace: str) -> tuple[str, str, str]:
        """The prefixes of the namespace's lease, horizon and reservation keys."""
        ns = quote(namespace, safe="")
        return f"{self._prefix}/w/{ns}/", f"{self._prefix}/h/{ns}/", f"{self._prefix}/s/{ns}/"

    def _scan(self, namespace: str) -> list[Json]:
        """Txn ops reading the namespace's lease, horizon and reservation keys."""
        return [range_op(prefix) for prefix in self._keys(namespace)]

    def _scanned(self, namespace: str, answer: Json) -> _Table:
        """Lease and horizon keys by worker id and the reserved ids, from an answer to `_scan`."""
        found: list[dict[int, Json]] = []
        for prefix, response in zip(self._keys(namespace), answer["responses"], strict=True):
            found.append({int(unb64(kv["key"])[len(prefix) :]): kv for kv in kvs_of(response)})
        return _Table(found[0], found[1], set(found[2]))

    def identity(self) -> StoreIdentity | None:
        return self._etcd.meta()[0]

    # -- the protocol's primitives -----------------------------------------------------------

    @contextlib.contextmanager
    def _acquiring(self, request: Request) -> Iterator[_Acquisition]:
        acquisition = _Acquisition(self, request)
        try:
            yield acquisition
        finally:
            if acquisition.lease_id:  # granted but never attached to a worker id
                with contextlib.suppress(StoreUnavailable):  # else it expires on its own
                    self._lease_call("revoke", acquisition.lease_id)

    def _refresh(self, lease: Lease, horizon_ms: int, expected_ms: int) -> Lease | Found:
        """Keep the etcd lease alive, read the horizon while the lease key holds the owner,
        and raise it by a txn on its mod_revision (Found when that lost a race)."""
        lease_key, horizon_key, _ = (f"{k}{lease.worker_id}" for k in self._keys(lease.namespace))
        with self._lock:
            lease_id = self._leases.get(lease.owner)
        if lease_id is None:
            return LOST
        alive = self._lease_call("keepalive", lease_id)
        if alive is None or int(alive.get("TTL", 0)) <= 0:
            return LOST
        meta_key = f"{self._prefix}/meta"
        read = self._txn(
            [holds(lease_key, lease.owner)], [range_op(horizon_key), range_op(meta_key)]
        )
        if not read.get("succeeded"):
            return LOST
        meta = kvs_of(read["responses"][1])
        store_id = json.loads(unb64(meta[0]["value"]))["id"] if meta else None
        kvs = kvs_of(read["responses"][0])
        current, host, mod = _horizon(kvs[0] if kvs else None)
        if current < lease.horizon_ms:
            return Found(True, current)
        horizon = max(current, horizon_ms)
        if horizon != current:
            wrote = self._txn(
                [holds(lease_key, lease.owner), unchanged(horizon_key, mod)],
                [put_op(horizon_key, f"{horizon} {host}")],
            )
            if not wrote.get("succeeded"):
                return Found(True, current)
        return replace(
            lease,
            horizon_ms=horizon,
            store_ms=self._etcd.last_date_ms(),
            store_ms_step=DATE_STEP_MS,
            store_id=store_id,
        )

    def _free(self, lease: Lease, horizon_ms: int | None) -> None:
        lease_keys, horizon_keys, _ = self._keys(lease.namespace)
        lease_key = f"{lease_keys}{lease.worker_id}"
        with self._lock:
            self._leases.pop(lease.owner, None)
        free = [{"request_delete_range": {"key": b64(lease_key), "prev_kv": True}}]
        if horizon_ms is not None:  # nobody else writes the horizon while we hold the id
            free.append(put_op(f"{horizon_keys}{lease.worker_id}", f"{horizon_ms} {holder_name()}"))
        answer = self._txn([holds(lease_key, lease.owner)], free)
        if answer.get("succeeded"):
            for kv in answer["responses"][0]["response_delete_range"].get("prev_kvs", []):
                # the id is free already; an unrevoked etcd lease just runs out
                with contextlib.suppress(StoreUnavailable):
                    self._lease_call("revoke", str(kv.get("lease", "0")))

    def _rows(self, namespace: str) -> list[WorkerInfo]:
        table = self._scanned(namespace, self._txn([], self._scan(namespace)))
        rows = []
        for worker_id in sorted(table.leases.keys() | table.horizons.keys() | table.reserved_ids):
            horizon, host, _ = _horizon(table.horizons.get(worker_id))
            kv = table.leases.get(worker_id)
            owner, expires_in = "", None
            if kv is not None:
                owner = unb64(kv.get("value", ""))
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
                    static=worker_id in table.reserved_ids,
                )
            )
        return rows

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        key = f"{self._keys(namespace)[2]}{worker_id}"
        answer = self._txn([], [{"request_delete_range": {"key": b64(key)}}])
        return int(answer["responses"][0]["response_delete_range"].get("deleted", 0)) > 0

    def close(self) -> None:
        self._etcd.close()
