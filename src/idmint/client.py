"""Clients of the idmint server: ids served locally from whole ranges the server hands out.

    client = idmint.Client(["http://a:8080", "http://b:8080"])
    orders = client.segment("order")
    orders.next_id()

`Client.segment()` is the library's own SegmentGenerator over `HttpRangeStore`, a range store
whose `allocate` is `POST /v1/keys/{key}/ranges`: the same preload, dynamic step, bounds and
typed errors as on a database, with the server as the store. Servers are tried in turn; one that
does not answer or answers 5xx is skipped until the others fail too.

An https:// server is verified, always: against certifi's CAs, or only against the CA file
given as `ca=` (`idmint serve --tls-cert` with a private CA's certificate).

`AsyncClient` shares all of it: its hot path is the same non-blocking call, and only a caller
that finds nothing buffered waits, on a thread.

Every server names its store's identity in an `idmint-store` header. Servers on two different
stores hand out the same ids, so a client refuses a list that spans two stores: it checks every
server it can reach before its first range, and every answer after that.
"""

from __future__ import annotations

import asyncio
import functools
import os
import ssl
import threading
from collections.abc import Sequence
from typing import Any

import httpx

from ._errors import (
    Exhausted,
    IdmintError,
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    StoreUnavailable,
)
from ._fork import ForkAware, orphan
from .aio import AsyncSegment as AsyncSegment  # it lived here: re-exported for old imports
from .ids import Allocation, Key, Range, check_count, check_key_name, is_digits
from .stores.base import STORE_HEADER, StoreIdentity
from .stores.tls import handshake_failure
from .strategies.refills import SegmentOptions
from .strategies.segment import SegmentGenerator

DEFAULT_TIMEOUT = 2.0


class HttpRangeStore(ForkAware):
    """A RangeStore backed by idmint servers, with failover between them."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        token: str | None = None,
        transport: httpx.BaseTransport | None = None,
        ca: str | os.PathLike[str] | None = None,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise InvalidArgument("a client needs at least one server URL")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise InvalidArgument(f"bad server URL {url!r}: use http://host:port")
        self.urls = [u.rstrip("/") for u in self.urls]
        self.display_url = ",".join(self.urls)
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._new_http = functools.partial(
            httpx.Client,
            timeout=timeout,
            headers=headers,
            transport=transport,
            verify=_verify(ca),
        )
        self._http = self._new_http()
        self._preferred = 0
        self._lock = threading.Lock()
        self._caps: dict[str, int] = {}  # each key's batch cap, as the servers last said
        self._store_id: str | None = None  # the one store every server must be on
        self._store_server = ""
        self._surveyed = False
        self._watch_fork()

    def _after_fork(self) -> None:
        # The parent's pooled connections are not the child's.
        orphan(self._http)
        self._http = self._new_http()
        self._lock = threading.Lock()

    def _check_store(self, server: str, response: httpx.Response) -> None:
        """Raise if `server` answers for another store than the servers before it."""
        store_id = response.headers.get(STORE_HEADER)
        if not store_id:
            return  # a server that has not reached its store yet: nothing to compare
        with self._lock:
            if self._store_id is None:
                self._store_id, self._store_server = store_id, server
                return
            known, first = self._store_id, self._store_server
        if store_id != known:
            raise InvalidArgument(
                f"servers {first} and {server} serve different stores ({known} and "
                f"{store_id}): they would hand out the same ids; a client's servers must all "
                "share one store"
            )

    def _survey(self) -> None:
        """Before the first range: ask every server which store it serves (those that do not
        answer are checked when they first do)."""
        for url in self.urls:
            try:
                response = self._http.get(url + "/livez")
            except httpx.HTTPError:
                continue
            self._check_store(url, response)
        self._surveyed = True

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send to the preferred server, failing over to the others on a connection error or
        a 5xx; map 4xx answers to idmint's errors."""
        self._check_fork()
        failures = []
        count = len(self.urls)
        start = self._preferred
        for offset in range(count):
            index = (start + offset) % count
            url = self.urls[index] + path
            try:
                response = self._http.request(method, url, **kwargs)
            except httpx.HTTPError as exc:
                failures.append(f"{self.urls[index]}: {_failure(exc)}")
                continue
            self._check_store(self.urls[index], response)
            if response.status_code >= 500:
                failures.append(f"{self.urls[index]}: {response.status_code} {_reason(response)}")
                continue
            with self._lock:
                self._preferred = index
            if response.status_code >= 400:
                cap = response.headers.get("idmint-batch-cap", "")
                if is_digits(cap) and path.startswith("/v1/keys/"):
                    self._caps[path.split("/")[3]] = int(cap)
                raise _error_for(response, path)
            return response.json()
        raise StoreUnavailable("no idmint server answered: " + "; ".join(failures))

    def init(self) -> None:
        self._request("GET", "/livez")

    def add_key(
        self,
        name: str,
        *,
        step: int,
        first_id: int,
        last_id: int,
        description: str = "",
        stripes: int = 1,
    ) -> Key:
        body = {
            "name": name,
            "step": step,
            "start": first_id,
            "max": last_id,
            "description": description,
            "stripes": stripes,
        }
        return _key(self._request("POST", "/v1/keys", json=body))

    def get_key(self, name: str) -> Key:
        return _key(self._request("GET", f"/v1/keys/{check_key_name(name)}"))

    def list_keys(self) -> list[Key]:
        return [_key(k) for k in self._request("GET", "/v1/keys")["keys"]]

    def allocate(
        self, name: str, count: int | None = None, *, stripe: int | None = None
    ) -> Allocation:
        self._check_fork()  # before the survey, which talks to the servers too
        if not self._surveyed:
            self._survey()
        # A key's batch cap (kept in its row, the same on every server) bounds what one request
        # may take: ask for no more than the servers last said, as a bounded key's end also
        # shortens a range; and once more within it when a server refused (a lowered cap).
        path = f"/v1/keys/{check_key_name(name)}/ranges"
        cap = self._caps.get(name)
        if count is not None and cap is not None:
            count = min(count, cap)
        params: dict[str, int] = {} if stripe is None else {"stripe": stripe}
        try:
            data = self._request(
                "POST", path, params={**params, "size": count} if count else params
            )
        except InvalidArgument:
            cap = self._caps.get(name)
            if count is None or cap is None or count <= cap:
                raise
            count = cap
            data = self._request("POST", path, params={**params, "size": count})
        if "batch_cap" in data:
            self._caps[name] = int(data["batch_cap"])
        try:
            stride = int(data.get("stride") or 1)
            taken = Range(int(data["start"]), int(data["stop"]), stride)
            step = int(data.get("step") or len(taken) or 1)
            # What the client knows of the key: enough for the dynamic step (its floor is
            # `step`) and for telling which stripe the range came from, of how many.
            key = Key(
                name,
                taken.stop,
                step,
                taken.start,
                taken.last,
                stripes=int(data.get("stripes") or stride),
                stripe=int(data.get("stripe") or 0),
            )
            conflicts = int(data.get("conflicts") or 0)
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreUnavailable(
                f"a server answered a range of key {name!r} the client cannot read: {exc}"
            ) from exc
        return Allocation(taken, key, conflicts=conflicts)

    def give_back(self, name: str, unused: Range) -> bool:
        # Never over HTTP: the server cannot tell that a range returned by a client was that
        # client's, and returning someone else's would repeat ids. The tail is skipped.
        return False

    def set_max_batch(self, name: str, max_batch: int) -> Key:
        return _key(
            self._request(
                "PATCH", f"/v1/keys/{check_key_name(name)}", json={"max_batch": max_batch}
            )
        )

    def raise_floor(self, name: str, to: int) -> Key:
        return _key(
            self._request("POST", f"/v1/keys/{check_key_name(name)}/raise", json={"to": to})
        )

    def identity(self) -> StoreIdentity | None:
        """The identity of the store the servers answered for, once one has."""
        with self._lock:
            return StoreIdentity(self._store_id, None) if self._store_id else None

    def close(self) -> None:
        self._http.close()


def _verify(ca: str | os.PathLike[str] | None) -> ssl.SSLContext | bool:
    """What httpx verifies https:// servers with: certifi's CAs (httpx's default), or only the
    CA in the file `ca` (a private CA's certificate, PEM). Verification is never off."""
    if ca is None:
        return True
    try:
        return ssl.create_default_context(cafile=os.fspath(ca))
    except (OSError, ssl.SSLError) as exc:
        reason = exc.strerror or str(exc)
        raise InvalidArgument(f"cannot read the CA file {os.fspath(ca)}: {reason}") from None


def _failure(exc: httpx.HTTPError) -> str:
    """Why a server did not answer, in a few words: a TLS failure says what to do."""
    tls = handshake_failure(exc)
    if tls is not None:
        if isinstance(exc, httpx.ConnectError) and "not accepted" in tls:
            return f"{tls}; a server with a private CA needs Client(..., ca=PATH)"
        return tls
    return type(exc).__name__


def _reason(response: httpx.Response) -> str:
    return " ".join(response.text.split())[:300]


def _error_for(response: httpx.Response, path: str) -> IdmintError:
    reason = _reason(response)
    key = path.split("/")[3] if path.startswith("/v1/keys/") else ""
    if response.status_code == 404 and key:
        return KeyNotFound(key, reason or None)  # the server's reason: what the name is
    if response.status_code == 409:
        return KeyExists(key or "?", reason or None)
    if response.status_code == 410:
        # One stripe of a striped key, or the whole key (see the server's 410 headers).
        last_id = _header_int(response, "idmint-last-id")
        stripe = _header_int(response, "idmint-stripe")
        stripes = _header_int(response, "idmint-stripes")
        if stripe is not None and stripes:
            return Exhausted(key, last_id, stripe=stripe, stripes=stripes)
        return Exhausted(key, last_id)
    if response.status_code in (401, 403):
        return InvalidArgument(f"the server refused: {reason}")
    return InvalidArgument(reason or f"HTTP {response.status_code}")


def _header_int(response: httpx.Response, name: str) -> int | None:
    value = response.headers.get(name, "").strip()
    return int(value) if is_digits(value) else None


def _key(data: dict[str, Any]) -> Key:
    next_id = int(data["next_id"])
    return Key(
        str(data["name"]),
        next_id,
        int(data["step"]),
        int(data["start"]),
        int(data["max"]),
        str(data.get("description") or ""),
        max_batch=int(data.get("max_batch") or 0),  # absent from older servers' answers
        stripes=int(data.get("stripes") or 1),
        stripe_next=tuple(int(n) for n in data.get("stripe_next") or ()),
    )


class _ClientBase:
    """What Client and AsyncClient share: the servers, options and one generator per key."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        token: str | None = None,
        segment_options: SegmentOptions | None = None,
        transport: httpx.BaseTransport | None = None,
        ca: str | os.PathLike[str] | None = None,
    ) -> None:
        self.store = HttpRangeStore(urls, timeout=timeout, token=token, transport=transport, ca=ca)
        self.segment_options = segment_options or SegmentOptions()
        self._segments: dict[str, SegmentGenerator] = {}
        self._lock = threading.Lock()

    def _generator(self, key: str) -> SegmentGenerator:
        check_key_name(key)
        with self._lock:
            gen = self._segments.get(key)
            if gen is None:
                gen = SegmentGenerator(self.store, key, self.segment_options)
                self._segments[key] = gen
            return gen

    def _take(self, key: str, count: int, stripe: int | None) -> Range:
        check_count(count)
        return self.store.allocate(check_key_name(key), count, stripe=stripe).range

    def _close(self) -> None:
        with self._lock:
            generators, self._segments = list(self._segments.values()), {}
        for gen in generators:
            gen.close()
        self.store.close()


class Client(_ClientBase):
    """Ids from idmint servers, served in-process from ranges. Thread-safe.

    with idmint.Client("http://localhost:8080") as client:
        orders = client.segment("order")
        orders.next_id()
    """

    def segment(self, key: str) -> SegmentGenerator:
        """The key's generator: ids from ranges taken from the servers, prefetched."""
        return self._generator(key)

    def take(self, key: str, count: int, *, stripe: int | None = None) -> Range:
        """One range of `count` ids straight from a server: fewer at a bounded key's end (or
        its stripe's), and at most the key's batch cap (see `idmint keys set --max-batch`).
        A striped key's range has stride `stripes`, from stripe `stripe` or, by default, any
        stripe with ids left."""
        return self._take(key, count, stripe)

    def close(self) -> None:
        self._close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """Client for asyncio code: `await client.segment("order").next_id()`."""

    def segment(self, key: str) -> AsyncSegment:
        return AsyncSegment(self._generator(key))

    async def take(self, key: str, count: int, *, stripe: int | None = None) -> Range:
        """Client.take, awaited: the request runs off the event loop, which goes on."""
        return await asyncio.to_thread(self._take, key, count, stripe)

    async def close(self) -> None:
        """Close every generator (their unused ids go back) and the connections, off the
        event loop."""
        await asyncio.to_thread(self._close)

    aclose = close  # the name httpx's AsyncClient uses

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
