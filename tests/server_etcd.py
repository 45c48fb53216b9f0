"""A throw-away single-member etcd for the lease store tests, from Debian's /usr/bin/etcd.

It listens on 127.0.0.1 only and keeps its data dir and ``server.log`` in a temporary
directory; ``restart()`` and ``kill()`` keep both ports and the data, and an ``atexit`` hook
kills it if the test process forgets to.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import httpx

from certs import Certs
from servers import Pausable, ServerStartError, free_port, wait_until

ETCD = os.environ.get("IDMINT_ETCD", "/usr/bin/etcd")
LOOPBACK = "127.0.0.1"


class EtcdServer(Pausable):
    """One etcd member; ``store_url(name)`` is an etcd:// URL with its own key prefix."""

    def __init__(
        self,
        *,
        startup_timeout: float = 20.0,
        addresses: tuple[str, ...] = (LOOPBACK,),
        certs: Certs | None = None,
    ) -> None:
        self.certs = certs  # TLS and auth for locked-down clients (issue 33)
        # More addresses than 127.0.0.1: clients that a partition test cuts off by address.
        self.addresses = addresses
        if not Path(ETCD).is_file():
            raise ServerStartError(f"etcd not found at {ETCD} (set IDMINT_ETCD)")
        self.port, self.peer_port = free_port(), free_port()
        self.startup_timeout = startup_timeout
        self.base_dir = Path(tempfile.mkdtemp(prefix="idmint-etcd-"))
        self.log_path = self.base_dir / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        atexit.register(self._at_exit)

    def start(self) -> None:
        if self._proc is not None:
            return
        client = ",".join(f"http://{a}:{self.port}" for a in self.addresses)
        peer = f"http://{LOOPBACK}:{self.peer_port}"
        argv = [
            ETCD,
            "--name=default",
            f"--data-dir={self.base_dir / 'data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls=http://{self.addresses[0]}:{self.port}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.base_dir,
                env=env,
                start_new_session=True,
            )
        try:
            wait_until(self._ready, self.startup_timeout, "etcd to answer", interval=0.1)
        except (TimeoutError, ServerStartError) as exc:
            self.kill()
            tail = self.log_path.read_bytes()[offset:].decode(errors="replace")
            tail = "\n".join(tail.splitlines()[-40:])
            raise ServerStartError(f"etcd did not start: {exc}\n{tail}") from None

    def _ready(self) -> bool:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise ServerStartError("etcd exited")
        try:
            r = httpx.get(f"http://{LOOPBACK}:{self.port}/health", timeout=2)
            return r.status_code == 200 and r.json().get("health") == "true"
        except (httpx.HTTPError, ValueError):
            return False

    def stop(self) -> None:
        self.resume()  # a paused server cannot act on the signal
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL: a crash. ``start()`` brings it back on the same ports and data."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.base_dir, ignore_errors=True)
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        self.kill()
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def store_url(self, name: str, address: str = LOOPBACK) -> str:
        return f"etcd://{address}:{self.port}/{name}"
