"""Start the server: granian (RSGI) when installed, uvicorn (ASGI) as the fallback.

Its log lines are text for people, or one JSON object a line for log collectors. Every line,
idmint's and granian's own, goes to stderr through one handler on the root logger, in the main
process and in every worker (granian applies the same dictConfig in each). JSON fields
(docs/deploy.md): `time` (UTC, ISO 8601 with milliseconds), `level`, `logger`, `message`,
`pid`, and `exception` (the traceback) when the line carries one.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import logging.config
import math
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .._errors import InvalidArgument, StoreUnavailable
from ..ids import is_digits
from ..stores import RangeStore, open_store
from .config import FILE_SUFFIX, ServerConfig
from .metrics import MULTIPROC_ENV, VIEW_PREFIX, pid_running
from .tokens import AUDIT_FIELDS, implicit_tokens, note_pending_reload, read_tokens

TARGET = "idmint.server.app:create_app"

log = logging.getLogger("idmint.server")


def describe_access(config: ServerConfig) -> list[tuple[int, str]]:
    """What the start-up log says about who may do what over HTTP, each with its log level."""
    if config.tokens:
        admin = "needs a token with admin = true in the tokens file" + (
            " (or --token)" if config.token else ""
        )
        if config.admin_loopback:
            admin += ", except from loopback clients (--admin-loopback)"
    elif config.token and config.admin_loopback:
        admin = "needs the admin token, except from loopback clients (--admin-loopback)"
    elif config.token:
        admin = "needs the admin token"
    elif config.admin_loopback:
        admin = "open to loopback clients without a token (--admin-loopback)"
    else:
        admin = "refused: no admin token (--token); use the idmint keys command on the store"
    lines = [(logging.INFO, f"key admin over HTTP {admin}")]
    budget = (
        f"each key's ids go out no faster than its whole id space in {config.id_budget_days:g} "
        "days per worker (--id-budget-days)"
        if config.id_budget_days
        else "no budget on how fast a key's ids go out (--id-budget-days 0): a bounded key can "
        "be spent for good in seconds"
    )
    if config.tokens:
        lines.append(
            (
                logging.INFO,
                f"the id routes need a token of the tokens file {config.tokens} that may take "
                f"the key's ids (reloaded on SIGHUP); {budget}",
            )
        )
    elif config.client_token:
        lines.append((logging.INFO, f"the id routes need the client token; {budget}"))
    else:
        open_to = "the id routes are open to anyone who reaches this port (no --client-token)"
        lines.append((logging.WARNING, f"{open_to}; {budget}"))
    return lines


def serve(config: ServerConfig) -> None:
    """Run until SIGTERM or SIGINT; then /readyz turns 503, in-flight requests finish and unused
    tails go back to the store."""
    # A bad tokens file or certificate is one line and exit code 2, before anything starts.
    implicit = implicit_tokens(config.token, config.client_token)
    tokens = read_tokens(config.tokens, implicit) if config.tokens else []
    if config.tls_cert:
        check_tls(config.tls_cert, config.tls_key)
    store = open_store(config.store, timeout=config.timeout)  # a bad URL fails here, once
    address = listen_address(config.host, config.port)
    try:
        if not config.reuse_port:
            check_port_free(address, config.port)
        down = _store_down(store)
    finally:
        store.close()
    # Workers are separate processes that build their app from the environment. They get
    # the resolved values: an IDMINT_<NAME>_FILE beside its IDMINT_<NAME> would be refused.
    os.environ.update(config.to_env())
    for name in config.to_env():
        os.environ.pop(name + FILE_SUFFIX, None)
    configure_logs(config.log_format)
    for level, line in describe_access(config):
        log.log(level, "%s", line)
    if config.tokens:
        log.info("tokens: %s", ", ".join(t.name for t in tokens) or "none")
    if config.tls_cert:
        log.info("serving HTTPS (TLS 1.2 and up) with the certificate %s", config.tls_cert)
    for variable in ServerConfig.unknown_env():
        log.warning("%s is no setting of idmint serve: ignored", variable)
    if down:
        # An outage is no reason to exit: under systemd or Kubernetes that is a restart loop.
        # The workers start not-ready, /readyz says why, and they become ready by themselves.
        log.warning(
            "the store does not answer at start (%s): serving not-ready until it does", down
        )
    if config.reuse_port:
        log.warning(
            "--reuse-port: other processes may serve port %d too; with another store that "
            "would repeat ids",
            config.port,
        )
    if config.admin_loopback:
        log.warning(
            "--admin-loopback: behind a reverse proxy on this host, every client is loopback"
        )
    _raise_fd_limit(config.max_connections * config.workers + 256)
    with metrics_dir():
        _serve(config, address)


def _store_down(store: RangeStore) -> str | None:
    """Make the store's schema if it is missing; why not when the store does not answer (or
    refuses to be written: a read-only SQLite file), None when it did."""
    try:
        store.init()
    except StoreUnavailable as exc:
        return " ".join(str(exc).split())
    return None


METRICS_PREFIX = "idmint-metrics-"
# What a run leaves in the metrics directory: prometheus-client's multiprocess files
# (counter_<pid>.db, gauge_<mode>_<pid>.db, ...) and each worker's view.
METRICS_FILES = (
    "counter_*.db",
    "gauge_*.db",
    "histogram_*.db",
    "summary_*.db",
    f"{VIEW_PREFIX}*.json",  # each worker's part of /v1/stats (metrics.WorkerViews)
)


@contextlib.contextmanager
def metrics_dir() -> Iterator[Path]:
    """The directory the workers keep their metrics in (prometheus-client's multiprocess
    mode), set in PROMETHEUS_MULTIPROC_DIR before any worker starts: a private one made for
    this run and removed at the end, or the one the variable names (kept, as it is the
    user's). Either way it starts empty: a previous run's counts would add to this run's."""
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        path = Path(given)
        try:
            path.mkdir(parents=True, exist_ok=True)
            stale = [f for pattern in METRICS_FILES for f in path.glob(pattern)]
            for f in stale:
                f.unlink()
        except OSError as exc:
            raise InvalidArgument(
                f"cannot use {MULTIPROC_ENV}={given} for the metrics: {exc.strerror}"
            ) from exc
        if stale:
            log.info("metrics in %s; %d files of a previous run removed", path, len(stale))
        yield path
        return
    _remove_orphans()
    path = Path(tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-"))
    os.environ[MULTIPROC_ENV] = str(path)
    try:
        yield path
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(path, ignore_errors=True)


def _remove_orphans() -> None:
    """Remove the private metrics directories of servers that were killed (SIGKILL leaves
    theirs behind): each is named after its server's pid; one whose process runs stays."""
    for path in Path(tempfile.gettempdir()).glob(f"{METRICS_PREFIX}*-*"):
        pid = path.name[len(METRICS_PREFIX) :].split("-", 1)[0]
        if not is_digits(pid) or not path.is_dir() or (_uid() and path.stat().st_uid != _uid()):
            continue
        if not pid_running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _serve(config: ServerConfig, address: str) -> None:
    try:
        from granian import Granian
        from granian.constants import HTTPModes, Interfaces
        from granian.http import HTTP1Settings
    except ImportError:
        _serve_uvicorn(config)
        return
    log.info(
        "HTTP %s; up to %d connections per worker, backlog %d; request headers within %g s%s",
        {"1": "1.1", "2": "2", "auto": "1.1 and 2"}[config.http],
        config.max_connections,
        config.backlog,
        config.header_timeout,
        ", idle kept-alive connections close then" if config.keep_alive else ", no keep-alive",
    )
    if config.http != "1":
        log.warning(
            "--http %s: granian waits for a new connection's first bytes without a timeout; "
            "silent connections are bounded only by --max-connections",
            config.http,
        )
    tls: dict[str, Any] = {}
    if config.tls_cert:
        from granian.constants import SSLProtocols

        tls = {
            "ssl_cert": Path(config.tls_cert),
            "ssl_key": Path(config.tls_key),
            # 1.2 too, not granian's default of 1.3 only: the drop-in routes' Java clients
            # (Leaf's, tinyid's, CosId's) often run on JVMs whose TLS 1.3 is off.
            "ssl_protocol_min": SSLProtocols.tls12,
        }
    server = Granian(
        TARGET,
        address=address,
        port=config.port,
        interface=Interfaces.RSGI,
        workers=config.workers,
        http=HTTPModes(config.http),
        backlog=config.backlog,
        # granian's backpressure counts connections, idle ones included, not requests.
        backpressure=config.max_connections,
        http1_settings=HTTP1Settings(
            header_read_timeout=max(1, round(config.header_timeout * 1000)),
            keep_alive=config.keep_alive,
        ),
        # The backstop of --shutdown-timeout: a worker still busy then (closing on a hung
        # store past its own share of the timeout) is killed.
        workers_kill_timeout=max(1, math.floor(config.shutdown_timeout)),  # whole seconds
        factory=True,
        log_access=False,
        log_dictconfig=log_config(config.log_format),
        **tls,
    )
    if config.tokens:
        # After granian's own signal handlers (its startup sets them, then runs the hooks,
        # then forks the workers).
        server.on_startup(lambda: _reload_on_sighup(server, config))
    server.serve()


def _reload_on_sighup(server: Any, config: ServerConfig) -> None:
    """With a tokens file, SIGHUP to the main process checks the file and, if it is good, has
    every worker reload it in place. granian's own SIGHUP restarts the workers one by one,
    which can reset the connections queued on a stopping worker (granian warns of it without
    net.ipv4.tcp_migrate_req) and gives back every worker's ranges: too much for a token
    change. A bad file is one error line here, and the workers keep their tokens."""
    main = os.getpid()
    implicit = implicit_tokens(config.token, config.client_token)

    def forward(signum: int, frame: object) -> None:
        if os.getpid() != main:
            # A worker forked with this handler, its event loop's not installed yet: the app
            # reloads once it is (App.reload_on_sighup).
            note_pending_reload()
            return
        try:
            tokens = read_tokens(config.tokens, implicit)
        except InvalidArgument as exc:
            log.error("tokens not reloaded, the workers keep theirs: %s", exc)
            return
        try:  # granian's own worker list (2.5 to 2.8): tests/test_tokens.py reloads through it
            pids = [worker._id() for worker in list(server.wrks)]
        except (AttributeError, TypeError) as exc:  # a granian whose internals moved
            log.error(
                "tokens not reloaded: this granian (%s) does not list its workers as idmint "
                "expects (%s); restart the server to load them",
                _granian_version(),
                exc,
            )
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # a worker that just exited
                os.kill(pid, signal.SIGHUP)
        log.info(
            "SIGHUP: %d tokens (%s) read from %s; %d workers reload them",
            len(tokens),
            ", ".join(t.name for t in tokens) or "none",
            config.tokens,
            len(pids),
        )

    signal.signal(signal.SIGHUP, forward)


def _granian_version() -> str:
    from importlib.metadata import version

    return version("granian")


def check_tls(cert: str, key: str) -> None:
    """Refuse a certificate and key granian could not serve, in one line (granian's own
    check is a traceback)."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except OSError as exc:  # ssl.SSLError is one
        reason = exc.strerror or getattr(exc, "reason", None) or str(exc)
        raise InvalidArgument(
            f"cannot serve TLS with --tls-cert {cert} and --tls-key {key}: {reason}"
        ) from None


def _raise_fd_limit(needed: int) -> None:
    """Raise the soft limit on open files to what the connection limit needs (as far as the
    hard limit allows): at the usual soft limit of 1024, accepting fails long before
    --max-connections is reached."""
    try:
        import resource
    except ImportError:  # not on Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning(
            "open files are limited to %d (ulimit -n): fewer connections than "
            "--max-connections x --workers (%d) can be held",
            target,
            needed,
        )


def listen_address(host: str, port: int) -> str:
    """The IP address to listen on for `host`: itself if it is one, else what it resolves to
    (granian takes addresses only: `--host localhost` is 127.0.0.1)."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(host))
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else "not a host name"
        raise InvalidArgument(f"cannot listen on {host}:{port}: {reason}") from exc
    return str(found[0][4][0])


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on. granian binds with SO_REUSEPORT, so a second
    server on a served port would start silently and the kernel would share the connections
    between the two: with two stores, that repeats ids. A bind without SO_REUSEPORT fails on
    a listening port whatever options the listener set. (Another process can still take the
    port between this check and granian's bind: this catches mistakes, not races.)"""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise InvalidArgument(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    with socket.socket(family, kind, proto) as probe:
        # SO_REUSEADDR: connections of a server that just stopped (TIME_WAIT) are no reason
        # to refuse; a listening socket still is.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InvalidArgument(
                    f"port {port} on {host} is in use by another process; stop it, choose "
                    "another --port, or pass --reuse-port to share the port on purpose"
                ) from exc
            raise InvalidArgument(f"cannot listen on {host}:{port}: {exc.strerror}") from exc


def _serve_uvicorn(config: ServerConfig) -> None:
    try:
        import uvicorn  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise InvalidArgument(
            "idmint serve needs granian (or uvicorn): pip install 'idmint[server]'"
        ) from exc
    uvicorn.run(
        TARGET,
        factory=True,
        host=config.host,
        port=config.port,
        workers=config.workers,
        log_level="info",
        log_config=log_config(config.log_format),
        access_log=False,
        timeout_graceful_shutdown=config.shutdown_timeout,
        ssl_certfile=config.tls_cert or None,  # never plain HTTP where TLS was asked for
        ssl_keyfile=config.tls_key or None,
    )


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0  # no uids on Windows


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object a line; a message's own newlines are escaped, so a line is a record."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        audit = getattr(record, AUDIT_FIELDS, None)
        if isinstance(audit, dict):  # an audit line's own fields (app.audit), side by side
            entry.update(audit)
        return json.dumps(entry, ensure_ascii=False, default=str)


def log_config(log_format: str) -> dict[str, Any]:
    """A logging dictConfig for `log_format`: granian merges it over its own defaults (whose
    loggers print to stdout in their own format), so its loggers are named here and sent to
    the root handler."""
    formatter: dict[str, Any] = (
        {"()": f"{__name__}.JsonFormatter"} if log_format == "json" else {"format": TEXT_FORMAT}
    )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"idmint": formatter},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "idmint",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"handlers": ["stderr"], "level": "INFO"},
        "loggers": {
            "_granian": {"handlers": [], "propagate": True},
            "granian.access": {"handlers": [], "propagate": True},
        },
    }


def configure_logs(log_format: str) -> None:
    logging.config.dictConfig(log_config(log_format))
