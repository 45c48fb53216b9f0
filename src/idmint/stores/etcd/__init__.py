"""Worker-id leases (leases.py) and compare-and-set cells (hence segment keys, see
over_cas/ranges.py) on etcd, through its v3 JSON gateway (plain HTTP, kept-alive connections),
one client for both (client.py).

Keys, under the URL's prefix (default "idmint"): the leases' `w/`, `h/` and `s/` (see
leases.py), the store's identity `meta` (client.py), and `c/{key}`, a compare-and-set cell (see
EtcdCasStore).

URL: etcd://host:port[,host2:port2...][/prefix]. Endpoints are tried in turn when one cannot
be connected to.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from ..._errors import InvalidArgument
from .._urls import ENCODE_HINT, misplaced_at, scrub
from ..base import StoreIdentity
from ..engine import Engine
from ..over_cas.quorum import CasQuorumNode
from ..over_cas.ranges import CasRangeStore
from ..tls import TlsSettings, tls_only
from .client import Credentials, EtcdClient, Json, b64, prefix_end, put_op, unb64, unchanged
from .leases import EtcdLeaseStore

SCAN_PAGE = 500  # cells per range request of a scan (4 KB values: 2 MB answers at most)


class EtcdCasStore:
    """A CasStore on etcd: cell `key` is the etcd key `{prefix}/c/{key}`, its version the key's
    mod_revision (the cluster's revision of its last write: a new one on every change).

    A create is a txn "create_revision == 0 -> put", a swap "mod_revision == version -> put";
    etcd answers a txn after a majority of members has written it to their logs (fsynced), and
    every read here is linearizable (etcd's default, not `serializable`), so an answer never
    comes from a member that lags behind.
    """

    def __init__(self, etcd: EtcdClient) -> None:
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
        kvs = self._etcd.range({"key": b64(self._cells + key)}).get("kvs", [])
        if not kvs:
            return None
        return unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"])

    def create(self, key: str, value: str) -> bool:
        cell = self._cells + key
        return bool(self._etcd.txn([unchanged(cell, "0")], [put_op(cell, value)]).get("succeeded"))

    def swap(self, key: str, version: int, value: str) -> bool:
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            return False  # a compare on mod_revision 0 would match a missing key
        cell = self._cells + key
        answer = self._etcd.txn([unchanged(cell, str(version))], [put_op(cell, value)])
        return bool(answer.get("succeeded"))

    def scan(self, prefix: str) -> list[tuple[str, str]]:
        start = self._cells + prefix
        body: Json = {"key": b64(start), "range_end": prefix_end(start), "limit": SCAN_PAGE}
        found: list[tuple[str, str]] = []
        while True:
            answer = self._etcd.range(body)
            kvs = answer.get("kvs", [])
            found += [
                (unb64(kv["key"])[len(self._cells) :], unb64(kv.get("value", ""))) for kv in kvs
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


@dataclass(frozen=True)
class _Parsed:
    endpoints: list[str]
    prefix: str
    credentials: Credentials | None
    tls: TlsSettings | None


_FORM = "etcd://[user:password@]host:port[,host:port...][/prefix][?ca=&cert=&key=&tls=1]"


def _parse_url(url: str, display: str) -> _Parsed:
    """Endpoints, prefix ("idmint" if none), RBAC credentials and TLS of an etcd:// URL."""

    def bad(why: str) -> InvalidArgument:
        # urlsplit's reasons may quote what it made of the URL: maybe pieces of a password
        return InvalidArgument(f"bad store URL {display!r}: {scrub(why, url)}")

    if misplaced_at(url):
        raise bad(ENCODE_HINT)
    rest = url.split("://", 1)[1]
    if "#" in rest.rpartition("@")[2]:
        raise bad(f"expected {_FORM}")
    before_query, _, query_text = rest.rpartition("@")[2].partition("?")
    userinfo = rest.rpartition("@")[0] if "@" in rest else None
    hosts, _, path = before_query.partition("/")
    endpoints = [h.strip() for h in hosts.split(",") if h.strip()]
    prefix = path.strip("/") or "idmint"
    for endpoint in endpoints:
        try:
            parts = urlsplit(f"//{endpoint}")
            ok = bool(parts.hostname) and parts.port is not None
        except ValueError:
            ok = False
        if not ok:
            raise bad(f"{endpoint!r} is not host:port ({_FORM})")
    if not endpoints:
        raise bad(f"expected {_FORM}")
    credentials = None
    if userinfo is not None:
        user, _, password = userinfo.partition(":")
        if not user:
            # etcd's RBAC knows users by name: a password alone names nobody
            raise bad("a password needs a user name (etcd://user:password@host:port)")
        credentials = Credentials(unquote(user), unquote(password))
    return _Parsed(endpoints, prefix, credentials, tls_only(query_text, display))


def open_etcd_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The etcd engine of a URL: segment keys (over CAS), worker leases and compare-and-set
    cells, all on one HTTP client. The URL is checked here; no I/O until the first call."""
    parsed = _parse_url(url, display)
    # Files are read now: a CA or a key that cannot be used is a bad URL, not a failed call.
    context = parsed.tls.context(display) if parsed.tls is not None else None
    etcd = EtcdClient(
        parsed.endpoints,
        parsed.prefix,
        display,
        timeout=timeout,
        tls=context,
        credentials=parsed.credentials,
        client_cert=parsed.tls is not None and parsed.tls.cert is not None,
    )
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


__all__ = ["EtcdCasStore", "EtcdLeaseStore", "open_etcd_engine"]
