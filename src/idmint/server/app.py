"""The HTTP app: one request handler with an RSGI shell (granian) and an ASGI shell (uvicorn).

The routes are declared as data (routes.py) in the modules that serve them: idmint's id routes
and Leaf's (id_routes.py), key admin (admin.py), the probes and reports (probes.py), and
tinyid's and CosId's (dropin.py). This module binds them to their handlers, routes each
request, checks its access and turns every error into a status and a one-line reason.

The id routes wait for the store on the event loop, and only when nothing is buffered
(IdService.draw); other store work runs on a bounded pool per kind of route (pools.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
from collections.abc import MutableMapping
from datetime import UTC, datetime
from typing import Any

from .. import __version__
from .._errors import Exhausted, IdmintError
from .._minter import Minter, connect
from ..ids import check_key_name, is_digits
from ..stores.base import STORE_HEADER, StoreIdentity
from ..strategies.refills import SegmentOptions, set_shared_threads
from . import admin, dropin, id_routes, probes
from . import tokens as tokens_module
from .config import ServerConfig
from .http import STATUS_OF, HttpError, Request, Response, bearer_in, bearer_is
from .id_routes import LEAF_PREFIX
from .openapi import openapi_document
from .pools import Pool, PoolTimeout
from .routes import ADMIN, IDS, Call, Handler, Route, Router
from .service import IdService
from .tokens import ADMIN_TOKEN, AUDIT_FIELDS, LOOPBACK, Token

audit_log = logging.getLogger("idmint.audit")
log = logging.getLogger("idmint.server")

#: The id routes with no key: a token with ids = true may use them, whatever its keys.
SNOWFLAKE_HANDLERS = ("snowflake_get", "snowflake_ids")
MAX_BODY = 64 * 1024
# Threads, and jobs queued or running, per pool (see pools.py): the id routes' slow path
# (unknown keys, whole ranges, the snowflake generator), key admin, and the probes
# (readiness, metrics, stats).
ID_THREADS, ID_SLOTS = 16, 64
ADMIN_THREADS, ADMIN_SLOTS = 4, 16
PROBE_THREADS, PROBE_SLOTS = 4, 16
CLOSE_SHARE = 0.6  # of the shutdown timeout, for giving unused ids back

_HOT_HEADERS = [("content-type", "text/plain; charset=utf-8")]
LAST_ID_HEADER = "idmint-last-id"
STRIPE_HEADER = "idmint-stripe"
STRIPES_HEADER = "idmint-stripes"
_CLOSE = (("connection", "close"),)


async def _read_body(length: str | None, proto: Any) -> bytes | None:
    """The request body as granian streams it, or None as soon as it is over MAX_BODY: the
    rest is never read (reading the whole body first let a 1 GiB POST take a worker to
    2.7 GB before its size was checked)."""
    if length is not None and is_digits(length.strip()) and int(length) > MAX_BODY:
        return None
    parts: list[bytes] = []
    size = 0
    async for chunk in proto:
        size += len(chunk)
        if size > MAX_BODY:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _is_loopback(client: str) -> bool:
    try:
        return ipaddress.ip_address(client).is_loopback
    except ValueError:
        return False


def _exhausted_headers(exc: Exhausted) -> tuple[tuple[str, str], ...]:
    """What a 410 says besides its reason: the key's maximum and, when only one stripe of a
    striped key is exhausted, which one and how many the key has (a client's generator then
    moves to another stripe)."""
    headers: list[tuple[str, str]] = []
    if exc.last_id is not None:
        headers.append((LAST_ID_HEADER, str(exc.last_id)))
    if exc.stripe is not None and exc.stripes:
        headers += [(STRIPE_HEADER, str(exc.stripe)), (STRIPES_HEADER, str(exc.stripes))]
    return tuple(headers)


def _label(methods: dict[str, Route] | None) -> str:
    """A path's name in the error counts (its routes share it); "" for no route."""
    return next(iter(methods.values())).label if methods else ""


class App:
    """The idmint server. Build it with a config (or from IDMINT_* variables) and serve it with
    granian (RSGI) or any ASGI server."""

    def __init__(self, config: ServerConfig | None = None, minter: Minter | None = None) -> None:
        self.config = config = config or ServerConfig.from_env()
        set_shared_threads(config.refill_threads)
        self._minter = minter
        self.options = SegmentOptions(
            wait=config.wait, max_step=config.max_step, preload_at=config.preload_at
        )
        self.hot_handed = 0  # ids the hot path handed out: added to Leaf's route when read
        self.pools = {
            "id": Pool("id", ID_THREADS, ID_SLOTS),
            "admin": Pool("admin", ADMIN_THREADS, ADMIN_SLOTS),
            "probe": Pool("probe", PROBE_THREADS, PROBE_SLOTS),
        }
        #: What the route modules share (service.py).
        self.service = IdService(config, lambda: self.minter, self.pools["id"])
        self.counters = self.service.counters
        self.ids = id_routes.IdRoutes(self.service)
        self.dropin = dropin.DropIn(self.service)
        self.monitor = probes.Monitor(
            self.service,
            self.ids,
            self.pools["probe"],
            lambda: self._minter,
            lambda: self.hot_handed,
        )
        # Each module's routes, bound to the object that serves them (a typo fails here).
        bound: list[tuple[Route, Handler]] = [
            (route, getattr(server, route.handler))
            for routes, server in (
                (probes.ROUTES, self.monitor),
                (admin.ROUTES, admin.AdminRoutes(self.service, self.pools["admin"])),
                (id_routes.ROUTES, self.ids),
                (dropin.ROUTES, self.dropin),
            )
            for route in routes
        ]
        self.router = Router(tuple(bound))
        self.monitor.document = lambda: openapi_document(__version__, self.router.routes)
        # Every id route from the start, so a request adds to an entry that is there; the hot
        # path counts its ids apart (hot_handed), added to Leaf's route when metrics are read.
        for route in self.router.routes:
            if route.hands_ids:
                self.counters.handed[route.label] = 0
        # The hot path's own references: one attribute lookup each, no more.
        self._one_now = self.service.one_now
        self._id_bearers = self.service.bearers
        #: The tokens file's table (reloaded in place: the reference stays good), or None.
        self._tokens = self.service.tokens
        #: Who key admin over HTTP is, without a tokens file (the audit lines' `token`).
        self._admin_token = Token(ADMIN_TOKEN, b"", admin=True)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def minter(self) -> Minter:
        if self._minter is None:
            self._minter = connect(
                self.config.store,
                timeout=self.config.timeout,
                segment_options=self.options,
                dc=self.config.dc or None,
                dc_store=self.config.dc_store or None,
            )
        return self._minter

    @property
    def identity(self) -> StoreIdentity | None:
        """The store's identity as last read (probes.Monitor)."""
        return self.monitor.identity

    @property
    def shutting_down(self) -> bool:
        return self.monitor.shutting_down

    def startup(self) -> None:
        self.minter  # noqa: B018 - a bad store URL fails the start, not the first request
        log.info("idmint %s serving %s (pid %d)", __version__, self.minter.url, os.getpid())
        self.monitor.start()

    def shutdown(self) -> None:
        """Stop being ready and give every unused tail back to the store, within a share of
        the shutdown timeout whatever the store does (granian kills a worker that overruns
        the whole of it)."""
        monitor = self.monitor
        monitor.shutting_down = True
        monitor.stopped.set()
        monitor.views.remove()
        for pool in self.pools.values():
            pool.close()
        if self._minter is None:
            monitor.exporter.close()
            return
        generators = self._minter.generators()
        # The rest of the timeout is for in-flight requests (bounded by their deadlines) and
        # the process's exit. Minter.close logs what it could not give back in time.
        self._minter.close(timeout=self.config.shutdown_timeout * CLOSE_SHARE)
        returned = sum(gen.stats().given_back for gen in generators)
        log.info("stopped; %d unused ids given back to the store", returned)
        try:  # the last counts into the totals; this worker's gauges go
            monitor.exporter.close(monitor.sources())
        except Exception:
            log.exception("cannot write the last metrics")

    # -- RSGI (granian) ----------------------------------------------------------------------

    def __rsgi_init__(self, loop: Any) -> None:
        self.startup()
        self.reload_on_sighup(loop)

    def reload_on_sighup(self, loop: asyncio.AbstractEventLoop) -> None:
        """With a tokens file, SIGHUP reloads it on the event loop (between requests: nothing
        is dropped, no worker restarts). The main process of `idmint serve` checks the file and
        forwards the signal to each worker (run.py)."""
        if self._tokens is None:
            return
        try:
            loop.add_signal_handler(signal.SIGHUP, self.reload_tokens)
        except (NotImplementedError, RuntimeError, ValueError):
            # Not the main thread, or no SIGHUP (Windows): reload_tokens() stays callable,
            # and a SIGHUP is only noted (run.py's handler, inherited over fork).
            log.warning("SIGHUP cannot reload the tokens in this process")
            return
        if tokens_module.take_pending_reload():
            self.reload_tokens()  # a SIGHUP came between the fork and the line above

    def reload_tokens(self) -> bool:
        """Read the tokens file again; a bad one keeps the tokens as they are (logged)."""
        return self._tokens.reload() if self._tokens is not None else False

    def __rsgi_del__(self, loop: Any) -> None:
        self.shutdown()

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        path = scope.path
        if scope.method == "GET" and path.startswith(LEAF_PREFIX):
            # Leaf's route without the router: the generator's lock-free hot path, right here
            # (None: the full path below answers, with the right status). Without a token
            # the check is the one `not`; the tokens file's is per key (tokens.py).
            key = path[len(LEAF_PREFIX) :]
            bearers = self._id_bearers
            if not bearers or (
                bearer_in(scope.headers.get("authorization"), bearers)
                if self._tokens is None
                else self._tokens.may_take(key, scope.headers.get("authorization"))
            ):
                i = self._one_now(key)
                if i is not None:
                    self.hot_handed += 1  # a plain attribute: the cheapest count there is
                    proto.response_str(200, _HOT_HEADERS, str(i))
                    return
        elif scope.method == "GET" and path.startswith(dropin.NOW_PREFIXES):
            # tinyid's and CosId's one id, as Leaf's: from the buffer, before routing.
            now = self.dropin.answer_now(path, scope)
            if now is not None:
                proto.response_str(200, now[1], now[0])
                return
        body: bytes | None = b""
        if scope.method in ("POST", "PUT", "PATCH"):
            body = await _read_body(scope.headers.get("content-length"), proto)
        client = scope.client.rsplit(":", 1)[0].strip("[]") if scope.client else ""
        request = Request(
            scope.method,
            path,
            scope.query_string,
            scope.headers.get("authorization"),
            client,
            body or b"",
            oversized=body is None,
        )
        response = await self.handle(request)
        headers = [("content-type", response.content_type), *response.headers]
        proto.response_str(response.status, headers, response.body)

    # -- ASGI (uvicorn and others) -----------------------------------------------------------

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self.startup()
                    self.reload_on_sighup(asyncio.get_running_loop())
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    self.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > MAX_BODY:
                break  # stop reading: the rest is never buffered
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization")
        client = (scope.get("client") or ("", 0))[0]
        request = Request(
            scope["method"],
            scope["path"],
            scope.get("query_string", b"").decode(),
            auth.decode("latin-1") if auth else None,
            client,
            b"" if len(body) > MAX_BODY else body,
            oversized=len(body) > MAX_BODY,
        )
        response = await self.handle(request)
        raw = [(b"content-type", response.content_type.encode())]
        raw += [(k.encode(), v.encode()) for k, v in response.headers]
        await send({"type": "http.response.start", "status": response.status, "headers": raw})
        await send({"type": "http.response.body", "body": response.body.encode()})

    # -- routing -----------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        """Answer one request; every error becomes a status code and a one-line reason. Every
        answer names the store's identity once it is known."""
        response = await self._answer(request)
        identity = self.monitor.identity
        if identity is not None:
            response.headers = (*response.headers, (STORE_HEADER, identity.id))
        return response

    async def _answer(self, request: Request) -> Response:
        template, args = self.router.match(request.path)
        methods = self.router.by_path.get(template)
        # Set once key admin is authorized: whose action the audit line names.
        principal: Token | None = None
        route: Route | None = None
        try:
            if methods is None:
                raise HttpError(404, f"no route {request.path}; see /openapi.json")
            route = methods.get(request.method)
            if route is None:
                allow = ", ".join(sorted(methods))
                raise HttpError(
                    405,
                    f"{request.method} not allowed on {_label(methods)}; use {allow}",
                    (("allow", allow),),
                )
            if request.oversized or len(request.body) > MAX_BODY:
                # Close: the rest of the body was never read, and is not worth draining.
                raise HttpError(413, f"the body is over {MAX_BODY} bytes", _CLOSE)
            if route.access == ADMIN:
                principal = self._authorize(request)
                if not principal.admin:  # a token of the file, known: its attempt is audited
                    raise HttpError(
                        403, f"token {principal.name!r} may not use key admin (admin = false)"
                    )
                if "key" in args and not principal.covers(args["key"]):
                    raise HttpError(403, principal.not_admin_of(args["key"]))
            elif route.access == IDS and self._id_bearers:
                self._authorize_ids(request, route, args)
            if "key" in args:  # the other path parameters are checked by their handlers
                check_key_name(args["key"])
            handler = self.router.handlers[template, request.method]
            response = await handler(Call(request, route, args, principal))
        except HttpError as exc:
            self.counters.error(_label(methods) or "unknown", exc.status)
            response = Response(exc.status, exc.reason + "\n", headers=exc.headers)
        except PoolTimeout as exc:
            self.counters.error(_label(methods), 503)
            response = Response(503, f"{exc}\n", headers=PoolTimeout.headers)
        except IdmintError as exc:
            status = next((code for kind, code in STATUS_OF if isinstance(exc, kind)), 500)
            self.counters.error(_label(methods), status)
            headers = _exhausted_headers(exc) if isinstance(exc, Exhausted) else ()
            response = Response(status, " ".join(str(exc).split()) + "\n", headers=headers)
        except Exception:
            log.exception("unexpected error answering %s %s", request.method, request.path)
            self.counters.error(_label(methods), 500)
            response = Response(500, "internal error; see the server log\n")
        if principal is not None and route is not None:
            audit(principal, route, request, args.get("key"), response.status)
        return response

    def _authorize(self, request: Request) -> Token:
        """Admin needs the admin token (or, with a tokens file, a token with admin = true);
        without it, only a loopback client of a server started with --admin-loopback (behind
        a reverse proxy on the same host every client is loopback, so that is never the
        default). Returns who it is, for the audit line and the keys it may administer (a
        token of the file with admin = false too: the caller refuses it)."""
        tokens = self._tokens
        token = self.config.token
        if tokens is not None:
            found = tokens.identify(request.authorization)
            if found is not None:
                return found  # admin = false: the caller refuses it, with an audit line
        elif token and bearer_is(request.authorization, token):
            return self._admin_token
        if self.config.admin_loopback and _is_loopback(request.client):
            return LOOPBACK
        if tokens is not None:
            raise HttpError(
                401,
                "this route needs a token of the tokens file with admin = true (Authorization: "
                "Bearer ...)",
                (("www-authenticate", 'Bearer realm="idmint"'),),
            )
        if token:
            raise HttpError(
                401,
                "this route needs the admin token (Authorization: Bearer ...)",
                (("www-authenticate", 'Bearer realm="idmint"'),),
            )
        if self.config.admin_loopback:
            raise HttpError(
                403,
                "key admin answers only to loopback clients (--admin-loopback) when no admin "
                "token is configured (IDMINT_TOKEN)",
            )
        raise HttpError(
            403,
            "key admin over HTTP needs an admin token (--token, IDMINT_TOKEN), or "
            "--admin-loopback for loopback clients; the idmint keys command works on the store",
        )

    def _authorize_ids(self, request: Request, route: Route, args: dict[str, str]) -> None:
        """With a client token set, the routes that hand out ids need it (or the admin
        token): without a credential, anyone could burn a key's ids for good. With a tokens
        file, a token that may take ids of the route's key (the snowflake routes have none:
        any token with ids = true)."""
        if self._tokens is not None:
            key = None if route.handler in SNOWFLAKE_HANDLERS else args.get("key")
            found = self._tokens.identify(request.authorization)
            self.service.check_access(key, found, "Authorization: Bearer ...")
            return
        if self.service.accepts(request.authorization):
            return
        raise HttpError(
            401,
            "this route needs the client token (Authorization: Bearer ...)",
            (("www-authenticate", 'Bearer realm="idmint"'),),
        )


def audit(principal: Token, route: Route, request: Request, key: str | None, status: int) -> None:
    """One line per admin request that got past the token check (docs/deploy.md, "Audit"):
    who (the token's name, never its secret), what, on which key, the outcome and when."""
    if key is None and route.handler == "add_key":
        try:  # the new key's name, as the body gave it (a bad body: none)
            name = request.json().get("name")
        except HttpError:
            name = None
        key = name if isinstance(name, str) else None
    at = datetime.now(UTC).isoformat(timespec="milliseconds")
    fields = {
        "event": "admin",
        "token": principal.name,
        "action": route.handler,
        "key": key,
        "method": request.method,
        "path": request.path,
        "client": request.client,
        "status": status,
        "at": at,
    }
    audit_log.info(
        "admin %s key=%s by token %s from %s: %d",
        route.handler,
        key or "-",
        principal.name,
        request.client or "-",
        status,
        extra={AUDIT_FIELDS: fields},
    )


def create_app() -> App:
    """The app factory granian and uvicorn call in each worker (config from IDMINT_*)."""
    return App()
