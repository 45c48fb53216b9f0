"""A throw-away ZooKeeper server for the idmint test suite, from Debian's zookeeper package.

One standalone server in its own temporary directory (zoo.cfg, data dir, ``server.log``), on
127.0.0.1 only, run in the foreground with java directly. tickTime is 200 ms, so sessions may
be as short as 400 ms (2 ticks) and as long as 20 s (the maxSessionTimeout set below).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from kazoo.client import KazooClient

from certs import Certs
from servers import Pausable, ServerStartError, free_port, wait_until

__all__ = ["ZooKeeperServer", "find_classpath"]

ZK_ENV = Path("/usr/share/zookeeper/bin/zkEnv.sh")
JAVA = os.environ.get("JAVA", "/usr/bin/java")
MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
# slf4j with no binding logs nothing; the simple one writes to stderr, which is our log file.
LOG_BINDING = Path("/usr/share/java/slf4j-simple.jar")


def find_classpath() -> str:
    """The jars of the CLASSPATH zkEnv.sh sets (Debian's zookeeper.jar names its dependencies
    in its manifest), else those of an upstream tarball layout, plus an slf4j binding."""
    jars: list[str] = []
    if ZK_ENV.is_file():
        match = re.search(r'^CLASSPATH="?([^"\n]*)"?', ZK_ENV.read_text(), re.MULTILINE)
        if match:
            jars = [p for p in match.group(1).split(":") if p.endswith(".jar")]
    if not jars:
        jars = sorted(str(p) for p in Path("/usr/share/zookeeper").glob("**/*.jar"))
    if not any(Path(j).is_file() for j in jars):
        raise ServerStartError(f"no ZooKeeper jars found (looked at {ZK_ENV})")
    if LOG_BINDING.is_file():
        jars.append(str(LOG_BINDING))
    return ":".join(jars)


class ZooKeeperServer(Pausable):
    """A private standalone ZooKeeper on 127.0.0.1; stores get a fresh chroot each."""

    def __init__(
        self, *, port: int | None = None, startup_timeout: float = 30.0, certs: Certs | None = None
    ) -> None:
        self.certs = certs  # TLS and auth for locked-down clients (issue 33)
        self.classpath = find_classpath()
        self.port = port or free_port()
        self._port_fixed = port is not None
        self.startup_timeout = startup_timeout
        self.base_dir = Path(tempfile.mkdtemp(prefix="idmint-zookeeper-"))
        self.data_dir = self.base_dir / "data"
        self.data_dir.mkdir()
        self.log_path = self.base_dir / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_once = False
        atexit.register(self.close)

    def _write_config(self) -> Path:
        cfg = self.base_dir / "zoo.cfg"
        settings = {
            "tickTime": 200,
            "dataDir": self.data_dir,
            "clientPort": self.port,
            "clientPortAddress": "127.0.0.1",
            "admin.enableServer": "false",
            "4lw.commands.whitelist": "ruok,srvr",
            "minSessionTimeout": 400,
            "maxSessionTimeout": 20000,
        }
        cfg.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        return cfg

    def start(self) -> None:
        if self._proc is not None:
            return
        attempts = 1 if self._port_fixed or self._started_once else 3
        for attempt in range(1, attempts + 1):
            try:
                self._spawn_and_wait()
                self._started_once = True
                return
            except ServerStartError as exc:
                if attempt == attempts or "Address already in use" not in str(exc):
                    raise
                self.port = free_port()

    def _spawn_and_wait(self) -> None:
        argv = [JAVA, "-Xmx256m", "-XX:+UseSerialGC", "-cp", self.classpath, MAIN]
        argv.append(str(self._write_config()))
        with self.log_path.open("ab") as log:
            offset = log.tell()
            self._proc = proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.base_dir,
                start_new_session=True,
            )

        def ready() -> bool:
            if proc.poll() is not None:
                raise ServerStartError(f"ZooKeeper exited with code {proc.returncode}")
            client = KazooClient(hosts=f"127.0.0.1:{self.port}", timeout=2.0)
            try:
                client.start(timeout=1.0)
                client.get_children("/")
                return True
            except Exception:
                return False
            finally:
                client.stop()
                client.close()

        try:
            wait_until(ready, self.startup_timeout, f"ZooKeeper on 127.0.0.1:{self.port}")
        except (TimeoutError, ServerStartError) as exc:
            self.kill()
            with self.log_path.open("rb") as f:
                f.seek(offset)
                tail = f.read().decode(errors="replace").splitlines()[-40:]
            raise ServerStartError(
                f"{exc}\ncommand: {' '.join(argv)}\n--- {self.log_path} (tail) ---\n"
                + "\n".join(tail)
            ) from exc

    def _signal_and_wait(self, sig: signal.Signals, timeout: float) -> None:
        self.resume()  # a paused server cannot act on the signal
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        """SIGTERM, and SIGKILL if the server has not exited 20 s later."""
        self._signal_and_wait(signal.SIGTERM, 20.0)

    def kill(self) -> None:
        """Simulate a crash."""
        self._signal_and_wait(signal.SIGKILL, 20.0)

    def restart(self) -> None:
        """stop() then start(): same port, same data dir."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and delete its directory."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            atexit.unregister(self.close)

    def store_url(self, name: str) -> str:
        """A zk:// URL with the chroot /NAME: a fresh, private store on this server."""
        return f"zk://127.0.0.1:{self.port}/{name}"
