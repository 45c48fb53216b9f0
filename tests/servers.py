"""Throw-away PostgreSQL and MariaDB servers for the idmint test suite.

Each server lives in its own temporary directory (data dir, sockets, pid
file, ``server.log``), listens on 127.0.0.1 only, and is started from the
binaries installed on the machine; nothing is shared with any system service.

Typical use::

    with PostgresServer() as pg:
        url = pg.create_database("t1")   # postgresql://postgres@127.0.0.1:PORT/t1
        ...
        pg.restart()                     # same data dir, same port
        pg.kill()                        # SIGKILL, simulated crash
        pg.start()                       # crash recovery, same port

Public API: ``free_port()``, ``wait_until()``, ``PostgresServer``,
``MariaDBServer`` (``start``, ``stop``, ``restart``, ``kill``, ``pause``, ``resume``, ``close``,
``is_running``, ``url``, ``create_database``, ``port``, ``pid``,
``base_dir``, ``data_dir``, ``log_path``) and ``ServerStartError``.

Servers are started in their own session (so a Ctrl-C aimed at pytest does
not reach them first).  They cannot outlive the test process: an ``atexit``
hook kills any server still running and removes its directory, and a tiny
watchdog process per server kills it if the test process dies without
running ``atexit`` (SIGKILL, SIGTERM, ``os._exit``); the temporary
directory is then left behind.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import os
import pwd
import random
import re
import secrets
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, ClassVar, Protocol, Self, TypeVar
from urllib.parse import quote

import psycopg
import pymysql
from psycopg import sql

from certs import Certs

__all__ = [
    "MariaDBServer",
    "Pausable",
    "PostgresServer",
    "ServerStartError",
    "find_mariadb_binaries",
    "find_postgres_bindir",
    "free_port",
    "wait_until",
]

LOOPBACK = "127.0.0.1"
_LOG_TAIL_LINES = 40
_DB_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


class ServerStartError(RuntimeError):
    """A test server could not be initialised or did not become ready."""


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


class _Startable(Protocol):
    def start(self) -> None: ...
    def close(self) -> None: ...


StartableT = TypeVar("StartableT", bound=_Startable)


def start_all(servers: Sequence[_Startable]) -> None:
    """Start every server; if one fails to start, close them all (the started ones would
    outlive the test) and raise."""
    try:
        for server in servers:
            server.start()
    except BaseException:
        for server in servers:
            server.close()
        raise


@contextlib.contextmanager
def running(servers: Sequence[StartableT]) -> Iterator[Sequence[StartableT]]:
    """`servers`, started, and closed on the way out."""
    start_all(servers)
    try:
        yield servers
    finally:
        for server in servers:
            server.close()


def install_dirs(name: str) -> Iterator[Path]:
    """Where a .ci/install-NAME script may have put what it installs, in its order:
    $IDMINT_<NAME>_DIR, /var/cache/idmint-test/NAME (as root), the user's cache."""
    if os.environ.get(f"IDMINT_{name.upper()}_DIR"):
        yield Path(os.environ[f"IDMINT_{name.upper()}_DIR"])
    yield Path("/var/cache/idmint-test") / name
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    yield Path(xdg) / "idmint-test" / name


def wait_until(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    *,
    interval: float = 0.05,
) -> None:
    """Call ``predicate`` until it returns something truthy.

    Raises ``TimeoutError`` mentioning ``what`` after ``timeout`` seconds.
    Exceptions raised by ``predicate`` propagate immediately (use that to
    give up early).  The predicate is always called at least once.
    """
    deadline = time.monotonic() + timeout
    delay = min(interval, 0.01)
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, interval)


_port_lock = threading.Lock()
_ports_handed_out: set[int] = set()
_rng = random.SystemRandom()


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _non_ephemeral_ports() -> list[range]:
    """Port windows outside the kernel's ephemeral range.

    A port picked from the ephemeral range can be grabbed as the *local*
    port of some outgoing connection while a server is down for a restart,
    which makes the restart fail with EADDRINUSE.  Ports outside that range
    are only ever taken by an explicit bind().
    """
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        low, high = (int(x) for x in text.split())
    except (OSError, ValueError):
        return []
    windows = [range(max(10000, low - 12000), low), range(high + 1, 65536)]
    return [w for w in windows if len(w) >= 1000]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now.

    Prefers ports outside the ephemeral range and never hands out the same
    port twice in one process.  There is still a race with other processes;
    the servers below detect a lost race and retry with another port on
    their first start.
    """
    windows = _non_ephemeral_ports()
    for _ in range(200):
        if windows:
            port = _rng.choice(_rng.choice(windows))
            if not _port_is_free(port):
                continue
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((LOOPBACK, 0))
                port = int(s.getsockname()[1])
        with _port_lock:
            if port in _ports_handed_out:
                continue
            _ports_handed_out.add(port)
        return port
    raise RuntimeError("could not find a free TCP port on 127.0.0.1")


def _log_tail(path: Path, offset: int = 0, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError as exc:
        return f"<could not read {path}: {exc}>"
    text = data.decode("utf-8", errors="replace").rstrip("\n")
    return "\n".join(text.splitlines()[-lines:]) if text else "<empty>"


def _server_pids(data_dir: Path) -> set[int]:
    """Live processes whose working directory is ``data_dir``.

    Both servers chdir to their data directory and their children inherit
    it, so this finds every process of a server, also after it has been
    orphaned.  (The process group would not do: each PostgreSQL child calls
    setsid().)  Zombies do not count: they hold nothing, and PID 1 of a
    container may be slow to reap orphans.  Empty without /proc.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        return set()
    target = os.path.realpath(data_dir)
    found: set[int] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "cwd") != target:
                continue
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ..."; comm may contain spaces and parentheses.
        state = stat[stat.rfind(")") + 2 :][:1]
        if state not in ("Z", "X", "x", ""):
            found.add(int(entry.name))
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _kill_server_processes(
    proc: subprocess.Popen[bytes], data_dir: Path, timeout: float = 10.0
) -> bool:
    """SIGKILL a server's main process and all its other processes.

    Everything is frozen with SIGSTOP first, so no process keeps working
    (or forks) after its siblings are gone; then all get SIGKILL.  Returns
    True once nothing is left, False if something survived ``timeout``.
    """

    def targets() -> set[int]:
        pids = _server_pids(data_dir)
        if proc.poll() is None:
            pids.add(proc.pid)
        return pids

    frozen: set[int] = set()
    for _ in range(20):
        new = targets() - frozen
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        frozen |= new
    deadline = time.monotonic() + timeout
    while True:
        pids = targets()
        if not pids:
            return True
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _is_root() -> bool:
    return os.geteuid() == 0


def _find_executable(*names: str) -> str | None:
    extra = ["/usr/sbin", "/usr/local/sbin", "/usr/bin", "/usr/local/bin"]
    search = os.pathsep.join([os.environ.get("PATH", ""), *extra])
    for name in names:
        found = shutil.which(name, path=search)
        if found:
            return found
    return None


class Pausable:
    """pause() and resume() for a server that is one process group (Redis, etcd, ZooKeeper)."""

    _proc: subprocess.Popen[bytes] | None

    def _signal_group(self, sig: signal.Signals) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            _killpg(proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: a hung store whose sockets stay open."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after pause(). stop() and kill() resume a paused server first."""
        self._signal_group(signal.SIGCONT)


# --------------------------------------------------------------------------
# watchdog: kills the server if the test process dies hard
# --------------------------------------------------------------------------

_WATCHDOG_CODE = """\
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.stdin.buffer.read(1) != b"q":
    try:
        os.killpg(int(sys.argv[1]), signal.SIGKILL)
    except OSError:
        pass
    target = sys.argv[2]
    for _ in range(3 if target else 0):
        for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
            try:
                if name.isdigit() and os.readlink("/proc/" + name + "/cwd") == target:
                    os.kill(int(name), signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)
"""


class _Watchdog:
    """A helper process that reads a pipe from us.

    EOF without the disarm byte means we died: it then SIGKILLs the
    server's process group and every process working in its data dir (if
    it has one: `idmint serve` works in the caller's directory).
    """

    def __init__(self, pgid: int, data_dir: Path | None) -> None:
        read_fd, write_fd = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    "-c",
                    _WATCHDOG_CODE,
                    str(pgid),
                    "" if data_dir is None else os.path.realpath(data_dir),
                ],
                stdin=read_fd,
                cwd="/",
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self._pipe: IO[bytes] | None = os.fdopen(write_fd, "wb", buffering=0)

    def disarm(self) -> None:
        pipe, self._pipe = self._pipe, None
        if pipe is None:
            return
        with contextlib.suppress(OSError):
            pipe.write(b"q")
        with contextlib.suppress(OSError):
            pipe.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


# --------------------------------------------------------------------------
# common server machinery
# --------------------------------------------------------------------------

_live_lock = threading.Lock()
_live_servers: set[_Server] = set()


def _atexit_cleanup() -> None:
    with _live_lock:
        servers = list(_live_servers)
    for server in servers:
        with contextlib.suppress(Exception):
            server._emergency_cleanup()


atexit.register(_atexit_cleanup)


class _Server:
    """Shared lifecycle; subclasses provide the database-specific parts."""

    kind: ClassVar[str] = "server"
    _dir_prefix: ClassVar[str] = "idmint-server-"
    _stop_signal: ClassVar[signal.Signals] = signal.SIGTERM
    # What a connection attempt to a server that is not up yet may raise.
    _probe_errors: ClassVar[tuple[type[Exception], ...]] = (OSError,)

    def __init__(
        self,
        *,
        port: int | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 60.0,
    ) -> None:
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._port_fixed = port is not None
        self._port = port if port is not None else free_port()
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog: _Watchdog | None = None
        self._initialized = False
        self._ever_started = False
        self._closed = False
        self.base_dir = Path(tempfile.mkdtemp(prefix=self._dir_prefix))
        self.data_dir = self.base_dir / "data"
        self.log_path = self.base_dir / "server.log"
        with _live_lock:
            _live_servers.add(self)

    # ---- hooks ---------------------------------------------------------

    def _initialize(self) -> None:
        raise NotImplementedError

    def _server_command(self) -> list[str]:
        raise NotImplementedError

    def _popen_env(self) -> dict[str, str] | None:
        """Environment for server processes (None: inherit ours)."""
        return None

    def _popen_ids(self) -> tuple[int, int] | None:
        """(uid, gid) to run server processes as (None: as ourselves)."""
        return None

    def _probe(self) -> str:
        """Connect once and return the data directory the server reports."""
        raise NotImplementedError

    def _same_data_dir(self, reported: str) -> bool:
        return os.path.realpath(reported.rstrip("/")) == os.path.realpath(self.data_dir)

    def _after_crash_cleanup(self) -> None:
        """Remove stale lock files once every server process is gone."""

    def url(self, dbname: str) -> str:
        raise NotImplementedError

    def create_database(self, name: str) -> str:
        raise NotImplementedError

    # ---- public lifecycle ---------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def pid(self) -> int | None:
        """PID of the running server (postmaster / mariadbd), else None."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def is_running(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None

    def start(self) -> None:
        """Start the server (initialising the data dir on first use).

        Blocks until a client can connect.  A no-op if already running.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.kind} server has been closed")
            if self.is_running:
                return
            self._reap()
            if not self._initialized:
                self._log_marker(f"initialising data directory {self.data_dir}")
                try:
                    self._initialize()
                except BaseException:
                    shutil.rmtree(self.data_dir, ignore_errors=True)  # allow a retry
                    raise
                self._initialized = True
            # A port picked by free_port() can be lost to another process
            # before the server binds it; retry only while the port has not
            # been handed out through a successful start yet.
            attempts = 1 if (self._port_fixed or self._ever_started) else 5
            for attempt in range(1, attempts + 1):
                log_offset = self._log_marker(f"starting on port {self._port}")
                try:
                    self._spawn_and_wait(log_offset)
                except ServerStartError:
                    port_taken = "Address already in use" in _log_tail(
                        self.log_path, log_offset, lines=1000
                    )
                    if port_taken and attempt < attempts:
                        self._port = free_port()
                        continue
                    raise
                self._ever_started = True
                return

    def stop(self) -> None:
        """Shut down cleanly and wait for the server to exit."""
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            self._disarm_watchdog()
            if proc.poll() is None:
                self._log_marker("stopping")
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(self._stop_signal)
                for pid in self._all_pids():  # a paused server must wake up to stop
                    _signal(pid, signal.SIGCONT)
                try:
                    proc.wait(timeout=self.stop_timeout)
                except subprocess.TimeoutExpired:
                    self._log_marker("clean shutdown timed out, killing")
            self._finish_dead(proc)

    def restart(self) -> None:
        """stop() then start(), same data directory and same port."""
        with self._lock:
            self.stop()
            self.start()

    def kill(self) -> None:
        """Simulate a crash: SIGKILL the server and all its processes.

        All of them (postmaster and backends) are frozen and then killed
        together, so no orphaned backend keeps working after the postmaster
        is gone.  Returns once they are all dead.  start() afterwards goes
        through the database's crash recovery.
        """
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            self._disarm_watchdog()
            if proc.poll() is None:
                self._log_marker("sending SIGKILL")
            self._finish_dead(proc)

    def pause(self) -> None:
        """SIGSTOP every process of the server: a hung store, its sockets still open. Clients
        connect (the kernel completes the handshake) and then wait for answers that never come.
        """
        with self._lock:
            for pid in self._all_pids():
                _signal(pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after pause()."""
        with self._lock:
            for pid in self._all_pids():
                _signal(pid, signal.SIGCONT)

    def _all_pids(self) -> set[int]:
        pids = _server_pids(self.data_dir)
        if self.pid is not None:
            pids.add(self.pid)
        return pids

    def close(self) -> None:
        """Stop the server and delete its temporary directory."""
        with self._lock:
            if self._closed:
                return
            try:
                try:
                    self.stop()
                except Exception:
                    self.kill()
                    raise
            finally:
                self._closed = True
                shutil.rmtree(self.base_dir, ignore_errors=True)
                with _live_lock:
                    _live_servers.discard(self)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.is_running else "stopped"
        return f"<{type(self).__name__} {state} port={self._port} dir={self.base_dir}>"

    # ---- internals -----------------------------------------------------

    def _log_marker(self, message: str) -> int:
        """Append a line of ours to the log; return the offset after it."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with self.log_path.open("ab") as f:
            f.write(f"=== idmint tests {stamp}: {message}\n".encode())
            return f.tell()

    def _run_logged(self, argv: list[str], what: str) -> None:
        """Run a one-off command with output appended to the log."""
        with self.log_path.open("ab") as log:
            proc = self._popen(argv, log)
            try:
                returncode = proc.wait(timeout=300)
            except BaseException:
                _killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        if returncode != 0:
            raise ServerStartError(
                f"{what} failed with exit code {returncode}: "
                f"{' '.join(argv)}\n--- {self.log_path} (tail) ---\n"
                f"{_log_tail(self.log_path)}"
            )

    def _popen(self, argv: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
        ids = self._popen_ids()
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.base_dir,
            env=self._popen_env(),
            start_new_session=True,
            user=None if ids is None else ids[0],
            group=None if ids is None else ids[1],
            extra_groups=None if ids is None else [],
        )

    def _spawn_and_wait(self, log_offset: int) -> None:
        argv = self._server_command()
        with self.log_path.open("ab") as log:
            proc = self._popen(argv, log)
        self._proc = proc
        try:
            self._watchdog = _Watchdog(proc.pid, self.data_dir)
        except BaseException:
            self.kill()
            raise
        last_error: list[BaseException | None] = [None]

        def ready() -> bool:
            if proc.poll() is not None:
                raise ServerStartError(
                    f"{self.kind} exited with code {proc.returncode} during "
                    f"start-up on port {self._port}"
                )
            try:
                reported = self._probe()
            except self._probe_errors as exc:
                last_error[0] = exc
                return False
            if not self._same_data_dir(reported):
                # Someone else's server answered on our port; ours will
                # fail to bind and exit, which the check above reports.
                last_error[0] = RuntimeError(
                    f"port {self._port} is served by another server (data dir {reported!r})"
                )
                return False
            return True

        what = f"{self.kind} on 127.0.0.1:{self._port} to accept connections"
        try:
            wait_until(ready, self.startup_timeout, what)
        except BaseException as exc:
            self.kill()
            if not isinstance(exc, TimeoutError | ServerStartError):
                raise
            detail = f"{exc}"
            if last_error[0] is not None:
                detail += f"\nlast connection error: {last_error[0]!r}"
            raise ServerStartError(
                f"{detail}\ncommand: {' '.join(argv)}\n"
                f"--- {self.log_path} (tail) ---\n"
                f"{_log_tail(self.log_path, log_offset)}"
            ) from exc

    def _disarm_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.disarm()

    def _finish_dead(self, proc: subprocess.Popen[bytes]) -> None:
        """Kill whatever is left of the server and forget it."""
        all_gone = _kill_server_processes(proc, self.data_dir)
        proc.wait()
        if all_gone:
            self._after_crash_cleanup()
        else:
            self._log_marker(f"server processes survived SIGKILL: {_server_pids(self.data_dir)}")
        self._proc = None
        self._log_marker(f"exited with code {proc.returncode}")

    def _reap(self) -> None:
        """Clean up after a server that died on its own."""
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            self._disarm_watchdog()
            self._finish_dead(proc)

    def _emergency_cleanup(self) -> None:
        proc = self._proc
        if proc is not None:
            _kill_server_processes(proc, self.data_dir, timeout=5)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._disarm_watchdog()
        self._proc = None
        self._closed = True
        shutil.rmtree(self.base_dir, ignore_errors=True)
        with _live_lock:
            _live_servers.discard(self)


def _check_db_name(name: str, *, allow_empty: bool = False) -> str:
    if not (allow_empty and name == "") and not _DB_NAME_RE.fullmatch(name):
        raise ValueError(
            f"database name {name!r} must match {_DB_NAME_RE.pattern} (letters, digits, underscore)"
        )
    return name


def _locked_password() -> str:
    """A fresh password for a locked-down account; with characters a URL must percent-encode,
    so the locked-down URLs exercise that too."""
    return f"pw/{secrets.token_hex(8)}@:"


def _der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


# --------------------------------------------------------------------------
# PostgreSQL
# --------------------------------------------------------------------------

#: The least privilege idmint's runtime role needs on PostgreSQL once the schema's owner has
#: made the schema (`idmint init`): docs/stores.md, "Locked down", gives these statements
#: (test_locked_sql.py checks that it does). {db}, {schema} and {user}: the database, the
#: schema idmint's tables are in (public, in a database of idmint's own) and the role.
POSTGRES_GRANTS = (
    "GRANT CONNECT ON DATABASE {db} TO {user}",
    "GRANT USAGE ON SCHEMA {schema} TO {user}",
    "GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA {schema} TO {user}",
    "GRANT DELETE ON {schema}.idmint_reserved_workers TO {user}",
    "GRANT pg_read_all_stats TO {user}",
)

#: The group whose members the locked-down server takes over TLS with a password only
#: (pg_hba.conf below); every other role keeps the trust the plain tests use.
POSTGRES_TLS_GROUP = "idmint_tls_clients"
#: The role that owns the locked-down stores' schemas (it ran `idmint init`), and their
#: database.
LOCKED_OWNER = "idmint_owner"
LOCKED_DATABASE = "idmint_locked"

#: The role that logs in by its client certificate alone (pg_hba.conf `cert`: the certificate's
#: common name, tests/certs.py's client certificate's, names the role).
POSTGRES_CERT_ROLE = "idmint"

_POSTGRES_HBA = f"""\
# Written by tests/servers.py: locked-down roles over TLS with a password (issue 33), or with
# a client certificate, the rest as initdb --auth=trust had them. The first line that matches
# decides.
local   all          all                                 trust
hostssl all          {POSTGRES_CERT_ROLE}                127.0.0.0/8  cert
host    all          {POSTGRES_CERT_ROLE}                127.0.0.0/8  reject
hostssl all          +{POSTGRES_TLS_GROUP}  127.0.0.0/8  scram-sha-256
host    all          +{POSTGRES_TLS_GROUP}  127.0.0.0/8  reject
host    all          all                   127.0.0.0/8  trust
local   replication  all                                 trust
host    replication  all                   127.0.0.0/8  trust
"""


def _pg_version_key(bindir: str) -> tuple[int, ...]:
    version = Path(bindir).parent.name
    return tuple(int(p) for p in re.findall(r"\d+", version)) or (0,)


def _has_pg_server(bindir: Path) -> bool:
    return (bindir / "postgres").is_file() and (bindir / "initdb").is_file()


@functools.cache
def find_postgres_bindir() -> Path:
    """Directory holding ``initdb`` and ``postgres``.

    Order: ``$IDMINT_PG_BINDIR``, ``pg_config --bindir``, the newest
    ``/usr/lib/postgresql/*/bin``, then ``postgres`` on the PATH.
    """
    candidates: list[Path] = []
    override = os.environ.get("IDMINT_PG_BINDIR")
    if override:
        candidates.append(Path(override))
    pg_config = _find_executable("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"],
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            )
            candidates.append(Path(out.stdout.strip()))
    globbed = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_pg_version_key, reverse=True)
    candidates.extend(Path(p) for p in globbed)
    on_path = _find_executable("postgres")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    for candidate in candidates:
        if _has_pg_server(candidate):
            return candidate
    raise ServerStartError(
        "PostgreSQL server binaries (initdb, postgres) not found; looked in "
        + ", ".join(str(c) for c in candidates)
        + " (set IDMINT_PG_BINDIR to override)"
    )


class PostgresServer(_Server):
    """A private PostgreSQL cluster on 127.0.0.1 with trust authentication.

    Superuser ``postgres``, no password.  When the tests run as root the
    cluster runs as the ``postgres`` OS user (PostgreSQL refuses root).
    ``fsync=off`` for speed: committed data still survives ``kill()``
    (the OS keeps the written WAL), it would not survive a machine crash.

    With ``certs`` it is locked down too (issue 33): TLS on with the test CA's
    server certificate, and the roles ``locked_store_url()`` makes (members of
    POSTGRES_TLS_GROUP) come over TLS with a password or not at all; plain
    clients as before.
    """

    kind = "PostgreSQL"
    _dir_prefix = "idmint-pg-"
    _stop_signal = signal.SIGINT  # "fast" shutdown
    _probe_errors = (psycopg.Error, OSError)

    def __init__(
        self,
        *,
        port: int | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 60.0,
        max_connections: int = 200,
        extra_settings: dict[str, str] | None = None,
        certs: Certs | None = None,
    ) -> None:
        self.certs = certs  # TLS and auth for locked-down clients (issue 33)
        if certs is not None:
            # With ssl=on, libpq's default sslmode (prefer) would take every plain client of
            # the tests over TLS: other handshakes, other error messages on a killed server.
            # A URL's own sslmode (the locked-down ones) still wins.
            os.environ.setdefault("PGSSLMODE", "disable")
        self.bindir = find_postgres_bindir()
        self.max_connections = max_connections
        self.extra_settings = dict(extra_settings or {})
        self._template = ""  # see _locked_template
        self._os_user: pwd.struct_passwd | None = None
        if _is_root():
            # PostgreSQL refuses to run as root.
            try:
                self._os_user = pwd.getpwnam("postgres")
            except KeyError:
                raise ServerStartError(
                    "running as root, but there is no 'postgres' OS user to run "
                    "PostgreSQL as (PostgreSQL refuses to run as root)"
                ) from None
        super().__init__(port=port, startup_timeout=startup_timeout, stop_timeout=stop_timeout)
        self.socket_dir = self.base_dir / "sock"
        try:
            self.socket_dir.mkdir()
            self.log_path.touch()
            if self._os_user is not None:
                for path in (self.base_dir, self.socket_dir):
                    os.chown(path, self._os_user.pw_uid, self._os_user.pw_gid)
                # The server must be able to reach its directory.
                _check_traversable(self.base_dir)
        except BaseException:
            self.close()
            raise

    def _popen_env(self) -> dict[str, str] | None:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("PG") and not k.startswith("LC_")
        }
        env.update(LANG="C", LC_ALL="C", TZ="UTC")
        if self._os_user is not None:
            env.update(
                HOME=str(self.base_dir),
                USER=self._os_user.pw_name,
                LOGNAME=self._os_user.pw_name,
            )
        return env

    def _popen_ids(self) -> tuple[int, int] | None:
        user = self._os_user
        return None if user is None else (user.pw_uid, user.pw_gid)

    def _initialize(self) -> None:
        self._run_logged(
            [
                str(self.bindir / "initdb"),
                "-D",
                str(self.data_dir),
                "--auth=trust",
                "-U",
                "postgres",
                "--no-sync",
                "--encoding=UTF8",
                "--locale=C",
            ],
            "initdb",
        )
        if self.certs is not None:
            self._tls_file(self.certs.server_cert, "server.crt")
            self._tls_file(self.certs.server_key, "server.key")
            self._tls_file(self.certs.ca, "root.crt")
            self._tls_file(None, "pg_hba.conf", _POSTGRES_HBA)

    def _tls_file(self, source: Path | None, name: str, text: str = "") -> None:
        """A file in the data directory the server's OS user owns and alone reads (the key
        must be: PostgreSQL refuses one others can read; the test certificates' directory is
        root's, not the postgres user's)."""
        target = self.data_dir / name
        target.write_bytes(source.read_bytes() if source is not None else text.encode())
        target.chmod(0o600)
        if self._os_user is not None:
            os.chown(target, self._os_user.pw_uid, self._os_user.pw_gid)

    def _server_command(self) -> list[str]:
        settings = {
            "listen_addresses": LOOPBACK,
            "fsync": "off",
            "max_connections": str(self.max_connections),
            **(
                {"ssl": "on", "ssl_cert_file": "server.crt", "ssl_key_file": "server.key"}
                | {"ssl_ca_file": "root.crt"}  # asks for a client certificate, optional
                if self.certs is not None
                else {}
            ),
            **self.extra_settings,
        }
        argv = [
            str(self.bindir / "postgres"),
            "-D",
            str(self.data_dir),
            "-p",
            str(self._port),
            "-k",
            str(self.socket_dir),
        ]
        for key, value in settings.items():
            argv += ["-c", f"{key}={value}"]
        return argv

    def _probe(self) -> str:
        with psycopg.connect(self.url(), connect_timeout=2, autocommit=True) as conn:
            row = conn.execute("SHOW data_directory").fetchone()
        return str(row[0]) if row else ""

    def _after_crash_cleanup(self) -> None:
        # Every process of the old cluster is gone, so its lock files are
        # stale.  PostgreSQL would accept them unless the old PID has been
        # reused by an unrelated process; remove them to be safe.
        for stale in (
            self.data_dir / "postmaster.pid",
            self.socket_dir / f".s.PGSQL.{self._port}.lock",
            self.socket_dir / f".s.PGSQL.{self._port}",
        ):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()

    def url(self, dbname: str = "postgres") -> str:
        """``postgresql://postgres@127.0.0.1:PORT/dbname`` (no password)."""
        db = _check_db_name(dbname, allow_empty=True)
        return f"postgresql://postgres@{LOOPBACK}:{self._port}/{db}"

    def create_database(self, name: str) -> str:
        """CREATE DATABASE ``name`` and return its URL."""
        _check_db_name(name)
        with psycopg.connect(self.url(), connect_timeout=10, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    # ---- locked down (issue 33) ------------------------------------------

    def _certs(self) -> Certs:
        if self.certs is None:
            raise RuntimeError("this PostgresServer was started without certs: not locked down")
        return self.certs

    def locked_url(self, user: str, password: str, dbname: str, *, ca: Path | None = None) -> str:
        """The URL of `user` over TLS, the server verified (its name too: verify-full)."""
        return (
            f"postgresql://{quote(user, safe='')}:{quote(password, safe='')}@{LOOPBACK}:"
            f"{self._port}/{dbname}?sslmode=verify-full&sslrootcert={ca or self._certs().ca}"
        )

    def add_locked_role(
        self,
        user: str,
        dbname: str = LOCKED_DATABASE,
        grants: Sequence[str] = POSTGRES_GRANTS,
        *,
        schema: str = "public",
    ) -> tuple[str, str]:
        """A login role that comes over TLS with a password only, its search_path `schema`,
        granted `grants` (formatted with the database, the schema and the role) in `dbname`;
        (its password, its URL)."""
        self._certs()
        password = _locked_password()
        names = {
            "db": sql.Identifier(dbname),
            "schema": sql.Identifier(schema),
            "user": sql.Identifier(user),
        }
        with psycopg.connect(self.url(dbname), connect_timeout=10, autocommit=True) as conn:
            with contextlib.suppress(psycopg.errors.DuplicateObject):
                conn.execute(
                    sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(POSTGRES_TLS_GROUP))
                )
            conn.execute(
                sql.SQL("CREATE ROLE {user} LOGIN PASSWORD {} IN ROLE {}").format(
                    sql.Literal(password), sql.Identifier(POSTGRES_TLS_GROUP), **names
                )
            )
            if schema != "public":
                conn.execute(
                    sql.SQL("ALTER ROLE {user} SET search_path = {schema}").format(**names)
                )
            for grant in grants:
                conn.execute(sql.SQL(grant).format(**names))
        return password, self.locked_url(user, password, dbname)

    def locked_store_url(self, name: str) -> str:
        """A fresh store `name` as a locked-down deployment has it (docs/stores.md, "Locked
        down"): schema `name` of LOCKED_DATABASE, the tables as the owner role made them with
        `idmint init` over TLS; idmint runs as role `name`, over TLS with a password, its
        search_path that schema, holding POSTGRES_GRANTS and nothing else (PUBLIC's default
        rights on the database and schema public revoked, so that nothing else could be what
        makes it work). A schema per store, not a database: CREATE DATABASE is what costs."""
        _check_db_name(name)
        template = self._locked_template()
        with psycopg.connect(
            self.url(LOCKED_DATABASE), connect_timeout=10, autocommit=True
        ) as conn:
            conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(LOCKED_OWNER)))
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
            tables = conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s", (template,)
            ).fetchall()
            for (table,) in tables:
                conn.execute(
                    sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(
                        sql.Identifier(name, table), sql.Identifier(template, table)
                    )
                )
        _, url = self.add_locked_role(name, schema=name)
        return url

    def _locked_template(self) -> str:
        """The schema of LOCKED_DATABASE whose tables every locked-down store's copy, made once:
        as the owner role made it with `idmint init` over TLS."""
        with self._lock:
            if self._template:
                return self._template
            import idmint  # here alone: starting a server needs no idmint

            template = "idmint_template"
            names = {
                "owner": sql.Identifier(LOCKED_OWNER),
                "db": sql.Identifier(LOCKED_DATABASE),
                "template": sql.Identifier(template),
            }
            _, owner_url = self.add_locked_role(
                LOCKED_OWNER, "postgres", ("GRANT pg_read_all_stats TO {user}",), schema=template
            )
            owner_url = owner_url.replace("/postgres?", f"/{LOCKED_DATABASE}?", 1)
            with psycopg.connect(self.url(), connect_timeout=10, autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {db} OWNER {owner}").format(**names))
            with psycopg.connect(
                self.url(LOCKED_DATABASE), connect_timeout=10, autocommit=True
            ) as conn:
                for statement in (
                    "REVOKE ALL ON DATABASE {db} FROM PUBLIC",
                    "REVOKE ALL ON SCHEMA public FROM PUBLIC",
                    "CREATE SCHEMA {template} AUTHORIZATION {owner}",
                ):
                    conn.execute(sql.SQL(statement).format(**names))
            with idmint.connect(owner_url) as minter:
                minter.init()
            self._template = template
            return template

    def served_certificate(self) -> bytes:
        """The certificate the server presents now (DER), read with a handshake of our own."""
        with socket.create_connection((LOOPBACK, self._port), timeout=5) as raw:
            raw.sendall(struct.pack("!ii", 8, 80877103))  # SSLRequest
            if raw.recv(1) != b"S":
                raise RuntimeError("the server does not take TLS")
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            with context.wrap_socket(raw) as tls:
                return tls.getpeercert(binary_form=True) or b""

    @contextlib.contextmanager
    def serving_certificate(self, cert: Path, key: Path) -> Iterator[None]:
        """The server presents `cert` (with `key`) inside the block, then its own again: a
        reload, no restart (PostgreSQL reads its TLS files again on SIGHUP)."""
        certs = self._certs()

        def serve(cert: Path, key: Path) -> None:
            self._tls_file(cert, "server.crt")
            self._tls_file(key, "server.key")
            with psycopg.connect(self.url(), connect_timeout=10, autocommit=True) as conn:
                conn.execute("SELECT pg_reload_conf()")
            # the postmaster reloads after it answered: wait until new connections see it
            wait_until(lambda: self.served_certificate() == _der(cert), 10, "the reload")

        serve(cert, key)
        try:
            yield
        finally:
            serve(certs.server_cert, certs.server_key)


def _check_traversable(path: Path) -> None:
    """The postgres OS user needs search permission on every ancestor."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            raise ServerStartError(
                f"{parent} is not searchable by other users, so the postgres "
                f"OS user cannot reach {path}; point TMPDIR elsewhere (e.g. /tmp)"
            )


# --------------------------------------------------------------------------
# MariaDB
# --------------------------------------------------------------------------

#: The least privilege idmint's runtime account needs on MariaDB once the schema's owner has
#: made the schema (`idmint init`): docs/stores.md, "Locked down", gives these statements
#: (test_locked_sql.py checks that it does). {db} and {user} are the database and the account.
MARIADB_GRANTS = (
    "GRANT SELECT, INSERT, UPDATE ON {db}.* TO {user}",
    "GRANT DELETE ON {db}.idmint_reserved_workers TO {user}",
    "GRANT PROCESS, SLAVE MONITOR ON *.* TO {user}",
)


@functools.cache
def find_mariadb_binaries() -> tuple[str, str]:
    """Paths of (``mariadb-install-db``, ``mariadbd``)."""
    install_db = _find_executable("mariadb-install-db", "mysql_install_db")
    server = _find_executable("mariadbd", "mysqld")
    if install_db is None or server is None:
        raise ServerStartError(
            "MariaDB binaries not found (need mariadb-install-db and mariadbd "
            f"on PATH or in /usr/sbin); found install_db={install_db!r}, "
            f"server={server!r}"
        )
    return install_db, server


class MariaDBServer(_Server):
    """A private MariaDB server on 127.0.0.1; ``root`` has no password.

    InnoDB keeps its durable defaults (``innodb_flush_log_at_trx_commit=1``).
    The character set is utf8mb4, as in Debian's packaged configuration.

    With ``certs`` it is locked down too (issue 33): TLS on with the test CA's
    server certificate; the accounts ``locked_store_url()`` makes require TLS
    (and a client certificate), root keeps its plain access for the tests.
    """

    kind = "MariaDB"
    _dir_prefix = "idmint-mariadb-"
    _stop_signal = signal.SIGTERM
    _probe_errors = (pymysql.Error, OSError)

    def __init__(
        self,
        *,
        port: int | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 60.0,
        max_connections: int = 300,
        extra_options: list[str] | None = None,
        certs: Certs | None = None,
    ) -> None:
        self.certs = certs  # TLS and auth for locked-down clients (issue 33)
        self.install_db, self.server_binary = find_mariadb_binaries()
        self.max_connections = max_connections
        self.extra_options = list(extra_options or [])
        self._template = ""  # see _locked_template
        super().__init__(port=port, startup_timeout=startup_timeout, stop_timeout=stop_timeout)
        self.socket_path = self.base_dir / "mysqld.sock"
        self.pid_path = self.base_dir / "mysqld.pid"
        self.log_path.touch()
        # Copies the server reads (FLUSH SSL reads them again: serving_certificate)
        self.tls_dir = self.base_dir / "tls"
        if certs is not None:
            self.tls_dir.mkdir()
            self._serve(certs.server_cert, certs.server_key)

    def _serve(self, cert: Path, key: Path) -> None:
        for source, name in ((cert, "server.pem"), (key, "server-key.pem")):
            (self.tls_dir / name).write_bytes(source.read_bytes())
            (self.tls_dir / name).chmod(0o600)

    def _user_args(self) -> list[str]:
        # mariadbd refuses to run as root unless told to explicitly.
        return ["--user=root"] if _is_root() else []

    def _initialize(self) -> None:
        self._run_logged(
            [
                self.install_db,
                "--no-defaults",
                f"--datadir={self.data_dir}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--skip-name-resolve",
                # Its own temporary files: in a shared /tmp, another install's "#sql-temptable-
                # <pid>-..." (another PID namespace) made this one fail ("Could not remove").
                f"--tmpdir={self.base_dir}",
                *self._user_args(),
            ],
            "mariadb-install-db",
        )

    def _server_command(self) -> list[str]:
        return [
            self.server_binary,
            "--no-defaults",  # must come first
            f"--datadir={self.data_dir}",
            f"--port={self._port}",
            f"--bind-address={LOOPBACK}",
            f"--socket={self.socket_path}",
            f"--pid-file={self.pid_path}",
            f"--max-connections={self.max_connections}",
            "--skip-name-resolve",
            f"--tmpdir={self.base_dir}",
            "--character-set-server=utf8mb4",
            "--collation-server=utf8mb4_general_ci",
            *self._user_args(),
            *(
                [
                    f"--ssl-ca={self.certs.ca}",
                    f"--ssl-cert={self.tls_dir / 'server.pem'}",
                    f"--ssl-key={self.tls_dir / 'server-key.pem'}",
                ]
                if self.certs is not None
                else []
            ),
            *self.extra_options,
        ]

    def _connect(self, io_timeout: float) -> pymysql.Connection[pymysql.cursors.Cursor]:
        # PyMySQL's connect_timeout covers only the TCP connect; without a
        # read timeout a process that accepts but never answers on our port
        # would hang the handshake forever.
        return pymysql.connect(
            host=LOOPBACK,
            port=self._port,
            user="root",
            password="",
            connect_timeout=2,
            read_timeout=io_timeout,
            write_timeout=io_timeout,
            autocommit=True,
            ssl_disabled=True,  # PyMySQL 1.2 would try TLS with a server that offers it
        )

    def _probe(self) -> str:
        conn = self._connect(io_timeout=5)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT @@datadir")
                row = cur.fetchone()
        finally:
            conn.close()
        return str(row[0]) if row else ""

    def url(self, dbname: str = "mysql") -> str:
        """``mysql://root@127.0.0.1:PORT/dbname`` (no password; "" = no database)."""
        db = _check_db_name(dbname, allow_empty=True)
        return f"mysql://root@{LOOPBACK}:{self._port}/{db}"

    def create_database(self, name: str) -> str:
        """CREATE DATABASE ``name`` and return its URL."""
        _check_db_name(name)
        conn = self._connect(io_timeout=120)
        try:
            with conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE `{name}`")
        finally:
            conn.close()
        return self.url(name)

    # ---- locked down (issue 33) ------------------------------------------

    def _certs(self) -> Certs:
        if self.certs is None:
            raise RuntimeError("this MariaDBServer was started without certs: not locked down")
        return self.certs

    def _as_root(self, *statements: tuple[str, tuple[str, ...]]) -> None:
        conn = self._connect(io_timeout=120)
        try:
            with conn.cursor() as cur:
                for statement, args in statements:
                    cur.execute(statement, args or None)  # no args: "%" is no marker
        finally:
            conn.close()

    def locked_url(
        self, user: str, password: str, dbname: str, *, x509: bool = True, ca: Path | None = None
    ) -> str:
        """The URL of `user` over TLS, the server verified (with the client certificate when
        `x509`)."""
        certs = self._certs()
        query = f"ca={ca or certs.ca}"
        if x509:
            query += f"&cert={certs.client_cert}&key={certs.client_key}"
        return (
            f"mysql://{quote(user, safe='')}:{quote(password, safe='')}@{LOOPBACK}:"
            f"{self._port}/{dbname}?{query}"
        )

    def add_locked_user(
        self,
        user: str,
        dbname: str,
        grants: Sequence[str] = MARIADB_GRANTS,
        *,
        require: str = "X509",
    ) -> tuple[str, str]:
        """An account that logs in over TLS only (`require`: SSL, or X509: with a client
        certificate of the CA too), granted `grants` (formatted with the database and the
        account); (its password, its URL)."""
        self._certs()
        password = _locked_password()
        account = f"'{user}'@'%'"
        self._as_root(
            (f"CREATE USER '{user}'@'%%' IDENTIFIED BY %s REQUIRE {require}", (password,)),
            *((grant.format(db=f"`{dbname}`", user=account), ()) for grant in grants),
        )
        return password, self.locked_url(user, password, dbname, x509=require == "X509")

    def locked_store_url(self, name: str) -> str:
        """A fresh store `name` as a locked-down deployment has it (docs/stores.md, "Locked
        down"): database `name`, its schema made by the owner account (`idmint init`, over
        TLS); idmint runs as account `name`, over TLS with a client certificate, holding
        MARIADB_GRANTS and nothing else."""
        _check_db_name(name)
        template = self._locked_template()
        conn = self._connect(io_timeout=120)
        try:
            with conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE `{name}`")
                cur.execute(
                    "SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s",
                    (template,),
                )
                for (table,) in cur.fetchall():
                    cur.execute(f"CREATE TABLE `{name}`.`{table}` LIKE `{template}`.`{table}`")
        finally:
            conn.close()
        _, url = self.add_locked_user(name, name)
        return url

    def _locked_template(self) -> str:
        """The database whose tables every locked-down store's copy (CREATE TABLE ... LIKE:
        a third of what making the schema over TLS each time costs): the schema as the owner
        account made it with `idmint init` over TLS. Its rows stay behind."""
        with self._lock:
            if self._template:
                return self._template
            import idmint  # here alone: starting a server needs no idmint

            template = "idmint_locked_template"
            self._as_root((f"CREATE DATABASE `{template}`", ()))
            # the owner: makes the schema, reads what the replication guard reads
            grants = ("GRANT ALL ON {db}.* TO {user}", MARIADB_GRANTS[-1])
            _, owner_url = self.add_locked_user(LOCKED_OWNER, template, grants, require="SSL")
            with idmint.connect(owner_url) as minter:
                minter.init()
            self._template = template
            return template

    @contextlib.contextmanager
    def serving_certificate(self, cert: Path, key: Path) -> Iterator[None]:
        """The server presents `cert` (with `key`) inside the block, then its own again:
        FLUSH SSL (MariaDB 10.4+) reads the files again, no restart."""
        certs = self._certs()
        self._serve(cert, key)
        self._as_root(("FLUSH SSL", ()))
        try:
            yield
        finally:
            self._serve(certs.server_cert, certs.server_key)
            self._as_root(("FLUSH SSL", ()))
