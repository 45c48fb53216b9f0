"""A throw-away Redis server for the lease-store tests, started from /usr/bin/redis-server.

It listens on 127.0.0.1 only and keeps its data in a temporary directory with the append-only
file fsynced on every write, so `restart()` and `kill()` + `start()` keep every horizon.
Tests share one server; each gets a private key prefix from `store_url(name)`.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from servers import LOOPBACK, Pausable, ServerStartError, free_port, wait_until

REDIS_SERVER = "/usr/bin/redis-server"


class RedisServer(Pausable):
    """`start`, `stop`, `restart` (same port and data), `kill` (SIGKILL), `close`."""

    def __init__(
        self,
        startup_timeout: float = 20.0,
        *,
        host: str = LOOPBACK,
        also: tuple[str, ...] = (),
        appendfsync: str | None = "always",
        replica_of: tuple[str, int] | None = None,
    ) -> None:
        """`also`: more addresses to listen on (clients cut off apart: harness.Partition).
        `appendfsync`: the append-only file's fsync policy; None: no append-only file (a
        restart then comes back empty). `replica_of`: (host, port) of the primary it follows."""
        self.host, self.also = host, also
        self.replica_of = replica_of
        self.appendfsync = appendfsync
        self.port = free_port()
        self.startup_timeout = startup_timeout
        self.base_dir = Path(tempfile.mkdtemp(prefix="idmint-redis-"))
        self.log_path = self.base_dir / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        atexit.register(self._atexit)

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
            # A primary starts a replica's first sync at once, not after Redis's 5 s wait for
            # more replicas to share it: each replicated pair in the tests came up 5 s later.
            *("--repl-diskless-sync-delay", "0"),
        ]
        if self.replica_of is not None:
            argv += ["--replicaof", self.replica_of[0], str(self.replica_of[1])]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            wait_until(self._ready, self.startup_timeout, f"redis-server on port {self.port}")
        except (TimeoutError, ServerStartError) as exc:
            self.kill()
            raise ServerStartError(f"{exc}; log tail:\n{self._log_tail()}") from None

    def _ready(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise ServerStartError(f"redis-server exited with code {self._proc.returncode}")
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=2)
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

    def kill(self) -> None:
        """SIGKILL, a simulated crash; `start()` brings it back with its data."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def _atexit(self) -> None:
        self.kill()
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def client(self) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, socket_timeout=5)

    def store_url(self, name: str) -> str:
        """A URL to a fresh, private key prefix on this server."""
        return f"redis://{self.host}:{self.port}/0?prefix={name}"
