"""A throw-away Redis server for the lease-store tests, started from /usr/bin/redis-server.

It listens on 127.0.0.1 only and keeps its data in a temporary directory with the append-only
file fsynced on every write, so `restart()` and `kill()` + `start()` keep every horizon.
Tests share one server; each gets a private key prefix from `store_url(name)`.

Locked down (issue 33): a server given `certs` also listens with TLS on `tls_port`, where it
asks every client for a certificate of the test CA (`tls-auth-clients yes`); the plain port and
its `default` user stay as they are for every other test. `locked_store_url(name)` makes an ACL
user with exactly the grant docs/stores.md gives (idmint.stores.redis.acl.acl_rule) and returns
its URL over TLS with the client certificate.
"""

from __future__ import annotations

import atexit
import contextlib
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import redis

from idmint.stores.redis.acl import acl_rule

from certs import Certs
from servers import LOOPBACK, Pausable, ServerStartError, free_port, start_all, wait_until

REDIS_SERVER = "/usr/bin/redis-server"


class _RedisProcess(Pausable):
    """What a redis-server process has, whatever its role: a port on `host`, a temporary
    directory with its log, start (by `_spawn`), readiness, kill (SIGKILL) and the log tail."""

    what = "redis-server"

    def __init__(self, startup_timeout: float, host: str, prefix: str) -> None:
        self.host = host
        self.port = free_port()
        self.startup_timeout = startup_timeout
        self.base_dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.log_path = self.base_dir / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        atexit.register(self._atexit)

    def client(self) -> redis.Redis:
        raise NotImplementedError

    def _spawn(self, argv: list[str]) -> None:
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            wait_until(self._ready, self.startup_timeout, f"{self.what} on port {self.port}")
        except (TimeoutError, ServerStartError) as exc:
            self.kill()
            raise ServerStartError(f"{exc}; log tail:\n{self._log_tail()}") from None

    def _ready(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise ServerStartError(f"{self.what} exited with code {self._proc.returncode}")
        client = self.client()
        try:
            return bool(client.ping())
        except redis.exceptions.RedisError:  # refused, or still loading the append-only file
            return False
        finally:
            client.close()

    def _log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def kill(self) -> None:
        """SIGKILL, a simulated crash; `start()` brings it back with its data."""
        self.resume()
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            proc.wait()

    def _atexit(self) -> None:
        self.kill()
        shutil.rmtree(self.base_dir, ignore_errors=True)


class RedisServer(_RedisProcess):
    """`start`, `stop`, `restart` (same port and data), `kill` (SIGKILL), `close`."""

    def __init__(
        self,
        startup_timeout: float = 20.0,
        *,
        host: str = LOOPBACK,
        also: tuple[str, ...] = (),
        appendfsync: str | None = "always",
        replica_of: tuple[str, int] | None = None,
        diskless_sync_delay: int = 0,
        certs: Certs | None = None,
        server_cert: Path | None = None,
        tls_replication: bool = False,
    ) -> None:
        """`also`: more addresses to listen on (clients cut off apart: harness.Partition).
        `appendfsync`: the append-only file's fsync policy; None: no append-only file (a
        restart then comes back empty). `replica_of`: (host, port) of the primary it follows.
        `diskless_sync_delay`: seconds it waits, as a primary, before a replica's first sync
        (for more replicas to share it): 0 here, 5 in Redis's own default. `certs`: TLS on
        `tls_port` too; `server_cert`: the certificate it shows there (certs.expired_cert, say);
        `tls_replication`: it follows its primary over TLS (`replica_of` then names the primary's
        TLS port) and tells it its own TLS port, which Sentinels then see."""
        self.server_cert = server_cert
        self.tls_replication = tls_replication
        self.certs = certs  # TLS and auth for locked-down clients (issue 33)
        super().__init__(startup_timeout, host, "idmint-redis-")
        self.tls_port = free_port() if certs is not None else None
        self.also = also
        self.replica_of = replica_of
        self.appendfsync = appendfsync
        self.diskless_sync_delay = diskless_sync_delay

    def start(self) -> None:
        if self._proc is not None:
            return
        try:
            subprocess.run([REDIS_SERVER, "--version"], check=True, capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ServerStartError(f"{REDIS_SERVER} --version failed: {exc}") from exc
        argv = [
            REDIS_SERVER,
            *(
                "--port",
                str(self.port),
                "--bind",
                self.host,
                *self.also,
                "--dir",
                str(self.base_dir),
            ),
            *("--save", "", "--appendonly", "no" if self.appendfsync is None else "yes"),
            *("--appendfsync", self.appendfsync or "always"),
            *("--daemonize", "no", "--protected-mode", "no"),
            # By default a primary starts a replica's first sync at once, not after Redis's 5 s
            # wait for more replicas to share it: each replicated pair in the tests came up 5 s
            # later.
            *("--repl-diskless-sync-delay", str(self.diskless_sync_delay)),
        ]
        if self.replica_of is not None:
            argv += ["--replicaof", self.replica_of[0], str(self.replica_of[1])]
        if self.certs is not None and self.tls_port is not None:
            argv += tls_arguments(self.certs, self.tls_port, cert=self.server_cert)
            if self.tls_replication:
                argv += ["--tls-replication", "yes", *tls_client_arguments(self.certs)]
        self._spawn(argv)

    def stop(self) -> None:
        """SIGTERM: redis-server flushes the append-only file and exits."""
        self.resume()  # a paused server cannot act on the signal
        proc, self._proc = self._proc, None
        if proc is None:
            return
        # Again every half second: Redis refuses a SIGTERM, once, while it writes its first
        # append-only file ("Writing initial AOF, can't exit"), which a replica just synced
        # or promoted does; one signal left such a server running until the kill below.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            proc.terminate()
            try:
                proc.wait(timeout=0.5)
                return
            except subprocess.TimeoutExpired:
                continue
        proc.kill()
        proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def client(self) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, socket_timeout=5)

    def store_url(self, name: str) -> str:
        """A URL to a fresh, private key prefix on this server."""
        return f"redis://{self.host}:{self.port}/0?prefix={name}"

    def make_user(self, name: str, rule: str) -> str:
        """An ACL user `name` with a new random password and `rule` (ACL SETUSER syntax, its
        words split on blanks); its password."""
        password = secrets.token_urlsafe(16)
        client = self.client()
        try:
            cast(Any, client).execute_command(
                "ACL", "SETUSER", name, "reset", "on", f">{password}", *rule.split()
            )
        finally:
            client.close()
        return password

    def tls_url(self, name: str, user: str, password: str, *, ca: Path | None = None) -> str:
        """A redis:// URL over TLS on `tls_port` with the client certificate, as `user`, under
        the prefix `name`; `ca`: the CA to trust (the test CA by default)."""
        assert self.certs is not None and self.tls_port is not None, "started without certs"
        c = self.certs
        return (
            f"redis://{user}:{password}@{self.host}:{self.tls_port}/0?prefix={name}"
            f"&ca={ca or c.ca}&cert={c.client_cert}&key={c.client_key}"
        )

    def locked_store_url(self, name: str) -> str:
        """A fresh prefix `name` reached as docs/stores.md's least-privileged user (an ACL user
        of its own, allowed that prefix's keys and idmint's commands only), over TLS with a
        client certificate."""
        return self.tls_url(name, name, self.make_user(name, acl_rule(name)))


def tls_arguments(certs: Certs, tls_port: int, *, cert: Path | None = None) -> list[str]:
    """redis-server's arguments for TLS on `tls_port` next to its plain port: the server's
    certificate (`cert`, with its key beside it in Certs: the expired one, say), and client
    certificates of the test CA required there."""
    key = certs.expired_key if cert == certs.expired_cert else certs.server_key
    return [
        *("--tls-port", str(tls_port)),
        *("--tls-cert-file", str(cert or certs.server_cert)),
        *("--tls-key-file", str(key)),
        *("--tls-ca-cert-file", str(certs.ca)),
        *("--tls-auth-clients", "yes"),
    ]


def tls_client_arguments(certs: Certs) -> list[str]:
    """The certificate a server or Sentinel shows when it connects to another over TLS (to its
    primary, to the servers it monitors): the client one, which the others require."""
    return [
        *("--tls-client-cert-file", str(certs.client_cert)),
        *("--tls-client-key-file", str(certs.client_key)),
    ]


class SentinelServer(_RedisProcess):
    """A throw-away Redis Sentinel (`redis-server sentinel.conf --sentinel`) on 127.0.0.1 and
    a free port, its config file in a temporary directory: Sentinel rewrites it with its id,
    the primaries it monitors and what it learnt of them. `password`: its requirepass (the
    Sentinels of one set share it: they authenticate to each other with their own)."""

    what = "redis sentinel"

    def __init__(
        self,
        startup_timeout: float = 20.0,
        *,
        host: str = LOOPBACK,
        password: str | None = None,
        certs: Certs | None = None,
    ) -> None:
        """`certs`: TLS on `tls_port` too (clients need a certificate of the test CA), and TLS
        to the servers it monitors and the other Sentinels (`tls-replication`)."""
        super().__init__(startup_timeout, host, "idmint-sentinel-")
        self.password = password
        self.certs = certs
        self.tls_port = free_port() if certs is not None else None
        self.config_path = self.base_dir / "sentinel.conf"

    def start(self) -> None:
        if self._proc is not None:
            return
        if not self.config_path.exists():  # kept across restarts: Sentinel's own state
            lines = [
                f"port {self.port}",
                f"bind {self.host}",
                "protected-mode no",
                "daemonize no",
                f'dir "{self.base_dir}"',
            ]
            if self.password is not None:
                lines.append(f'requirepass "{self.password}"')
            self.config_path.write_text("\n".join(lines) + "\n")
        argv = [REDIS_SERVER, str(self.config_path), "--sentinel"]
        if self.certs is not None and self.tls_port is not None:
            argv += tls_arguments(self.certs, self.tls_port)
            argv += ["--tls-replication", "yes", *tls_client_arguments(self.certs)]
        self._spawn(argv)
        client = self.client()
        try:
            # The test's pace (Redis 7 and later; an older Sentinel keeps its own): INFO to
            # every server each second, not 10 (it sees a restarted primary sooner), hellos
            # every half second (Sentinels find each other sooner; a restarted primary is
            # made a replica 4 hello periods after it came back: 2 s, not 8), and a TILT
            # (a timer that ran late on a busy machine) of 2 s, not 30.
            cast(Any, client).execute_command(
                "SENTINEL",
                "DEBUG",
                *("info-period", 1000, "publish-period", 500, "tilt-period", 2000),
            )
        except redis.exceptions.ResponseError:
            pass
        finally:
            client.close()

    def close(self) -> None:
        self._atexit()

    def client(self) -> redis.Redis:
        return redis.Redis(
            host=self.host,
            port=self.port,
            password=self.password,
            socket_timeout=5,
            decode_responses=True,
        )


class Sentinels:
    """A set of Sentinels (three by default) that monitor primaries under service names:
    `monitor(service, primary)`, `primary(service)` (where they say it is), `url(service)`
    (a redis+sentinel:// store URL naming them all), `remove(service)`, `close()`."""

    def __init__(
        self, count: int = 3, *, password: str | None = None, certs: Certs | None = None
    ) -> None:
        self.password = password
        self.servers = [SentinelServer(password=password, certs=certs) for _ in range(count)]

    def start(self) -> Sentinels:
        start_all(self.servers)
        return self

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def __enter__(self) -> Sentinels:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def monitor(
        self,
        service: str,
        primary: RedisServer,
        *,
        quorum: int = 2,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 4000,
        replicas: int = 1,
        port: int | None = None,
    ) -> None:
        """Every Sentinel monitors `primary` as `service` (at `port`: its TLS port, say): it is
        down for them `down_after_ms` after its last answer, and `quorum` of them agreeing start
        a failover. Returns once
        each Sentinel knows the others and the primary's `replicas` (what a failover needs)."""
        for server in self.servers:
            client = server.client()
            try:
                client.sentinel_monitor(service, primary.host, port or primary.port, quorum)
                client.sentinel_set(service, "down-after-milliseconds", down_after_ms)
                client.sentinel_set(service, "failover-timeout", failover_timeout_ms)
            finally:
                client.close()

        def known() -> bool:
            for server in self.servers:
                client = server.client()
                try:
                    state = cast(dict[str, Any], client.sentinel_master(service))
                finally:
                    client.close()
                others, found = state["num-other-sentinels"], state["num-slaves"]
                if others < len(self.servers) - 1 or found < replicas:
                    return False
            return True

        wait_until(known, 30, f"the Sentinels to know each other and {service}'s replicas")

    def remove(self, service: str) -> None:
        for server in self.servers:
            client = server.client()
            try:
                with contextlib.suppress(redis.exceptions.RedisError):
                    client.sentinel_remove(service)
            finally:
                client.close()

    def primary(self, service: str) -> tuple[str, int] | None:
        """(host, port) of the primary the first Sentinel that answers names for `service`."""
        for server in self.servers:
            client = server.client()
            try:
                found = client.sentinel_get_master_addr_by_name(service)
            except redis.exceptions.RedisError:
                continue
            finally:
                client.close()
            if isinstance(found, tuple | list):
                return str(found[0]), int(found[1])
        return None

    def await_primary(
        self, service: str, server: RedisServer, timeout: float = 30, *, port: int | None = None
    ) -> None:
        """Return once the Sentinels name `server` (at `port`, its TLS port say) the primary of
        `service` (a failover to it done); TimeoutError after `timeout` s."""
        port = port or server.port
        wait_until(
            lambda: self.primary(service) == (server.host, port),
            timeout,
            f"the Sentinels to name port {port} the primary of {service}",
        )

    def url(self, service: str, query: str = "", *, tls: bool = False) -> str:
        """A redis+sentinel:// store URL of `service` through every Sentinel (their TLS ports
        with `tls`: give ca=, cert= and key= in `query`); `query` is more parameters
        ("prefix=p&unsafe_replication=1")."""
        hosts = ",".join(f"{s.host}:{s.tls_port if tls else s.port}" for s in self.servers)
        params = [query] if query else []
        if self.password is not None:
            params.append(f"sentinel_password={self.password}")
        return f"redis+sentinel://{hosts}/{service}" + ("?" + "&".join(params) if params else "")
