"""`idmint serve` as a real subprocess, for the server tests."""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from servers import _Watchdog, free_port


class ServerProcess:
    """One `idmint serve` process on a free loopback port.

    Key admin over HTTP is on for loopback clients (`--admin-loopback`) unless the test says
    otherwise, so the tests can add keys without a token; `args` go after `serve`."""

    def __init__(
        self,
        store_url: str,
        *,
        workers: int = 1,
        token: str = "",
        port: int | None = None,
        admin_loopback: bool = True,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        ca: Path | None = None,
    ) -> None:
        self.store_url = store_url
        self.port = port or free_port()
        # A server given --tls-cert answers https only: `ca` is what the tests trust it with.
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca) if ca else True
        self.url = f"{'https' if ca else 'http'}://127.0.0.1:{self.port}"
        self.workers, self.token = workers, token
        self.admin_loopback = admin_loopback
        self.args, self.env = list(args), dict(env or {})
        self.log_path = Path(tempfile.mkdtemp(prefix="idmint-serve-")) / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        # Kills the server if this process dies first (SIGKILL, a CI timeout): the server runs
        # in a session of its own, which killing this one's process group does not reach.
        self._watchdog: _Watchdog | None = None

    def start(self, timeout: float = 20.0) -> ServerProcess:
        env = {
            **os.environ,
            "IDMINT_TOKEN": self.token,
            "IDMINT_ADMIN_LOOPBACK": "1" if self.admin_loopback else "0",
            **self.env,
        }
        args = [
            sys.executable,
            "-m",
            "idmint",
            "--store",
            self.store_url,
            "serve",
            "--port",
            str(self.port),
            "--workers",
            str(self.workers),
            *self.args,
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            self._watch(self.proc)
        except BaseException:  # unwatched, it would outlive us: stop it now
            self.kill()
            raise
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"idmint serve exited {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(self.url + "/livez", timeout=1, verify=self.verify).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"idmint serve did not start: {self.log()}")
            time.sleep(0.05)

    def _watch(self, proc: subprocess.Popen[bytes] | None) -> None:
        """Watch `proc` (None: nothing), disarming the watchdog of the process before: a
        watchdog left armed would kill its group id at our exit, by then maybe another's."""
        if self._watchdog is not None:
            self._watchdog.disarm()
        self._watchdog = None if proc is None else _Watchdog(proc.pid, None)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM, as an orchestrator stops it; returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._watch(None)
        return code

    def kill(self) -> None:
        """SIGKILL the whole process group (granian's workers too)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._watch(None)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._watch(None)
        shutil.rmtree(self.log_path.parent, ignore_errors=True)
