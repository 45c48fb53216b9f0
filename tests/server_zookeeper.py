"""A throw-away ZooKeeper server for the idmint test suite, from Debian's zookeeper package.

One standalone server in its own temporary directory (zoo.cfg, data dir, ``server.log``), on
127.0.0.1 only, run in the foreground with java directly. tickTime is 200 ms, so sessions may
be as short as 400 ms (2 ticks) and as long as 20 s (the maxSessionTimeout set below).

Locked down (issue 33): given certificates, the same server also listens on a TLS port
(``secure_port``: ZooKeeper's ``secureClientPort``, Netty serving both ports) that takes only
clients with a certificate of the test CA; the plain port stays as it was, since ACLs are per
node and digest credentials per session, so the other tests see no change and no second server
is started. ``locked_store_url(name)`` is a zk:// URL over that port with digest credentials made
for `name`, whose chroot an admin made beforehand with the one ACL docs/stores.md gives.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import quote

from kazoo.client import KazooClient
from kazoo.security import make_digest_acl

from certs import Certs
from servers import Pausable, ServerStartError, free_port, wait_until

__all__ = ["ZooKeeperServer", "find_classpath"]

ZK_ENV = Path("/usr/share/zookeeper/bin/zkEnv.sh")
JAVA = os.environ.get("JAVA", "/usr/bin/java")
MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
# slf4j with no binding logs nothing; the simple one writes to stderr, which is our log file.
LOG_BINDING = Path("/usr/share/java/slf4j-simple.jar")
#: What Netty, hence the TLS port, needs beyond the jars Debian's zookeeper.jar names in its
#: manifest (which leaves out netty-codec: NoClassDefFoundError ByteToMessageDecoder on the
#: first connection).
NETTY_EXTRA = tuple(
    f"/usr/share/java/netty-{name}.jar"
    for name in ("codec", "resolver", "transport-native-unix-common")
)


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
        self,
        *,
        port: int | None = None,
        startup_timeout: float = 30.0,
        certs: Certs | None = None,
        server_pair: tuple[Path, Path] | None = None,
    ) -> None:
        self.certs = certs  # TLS and auth for locked-down clients (issue 33)
        # The TLS port's certificate and key (default: the CA's server certificate; an
        # expired one for the negative tests).
        self.server_pair = server_pair
        self.classpath = find_classpath()
        if certs is not None:
            self.classpath += "".join(f":{jar}" for jar in NETTY_EXTRA if Path(jar).is_file())
        self.port = port or free_port()
        self.secure_port = free_port() if certs is not None else None
        self._port_fixed = port is not None
        self.startup_timeout = startup_timeout
        self.base_dir = Path(tempfile.mkdtemp(prefix="idmint-zookeeper-"))
        self.data_dir = self.base_dir / "data"
        self.data_dir.mkdir()
        self.log_path = self.base_dir / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_once = False
        self._tls_warm = False  # warm_tls() has run since the last start
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
        if self.certs is not None:
            settings.update(self._tls_settings())
        cfg.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        return cfg

    def _tls_settings(self) -> dict[str, object]:
        """The TLS port: Netty (the only connection factory that speaks TLS; it serves the
        plain port too), PEM files (ZooKeeper 3.6+ reads them: no Java keystore to make), and
        a client certificate required (ssl.clientAuth=need, the default, said anyway)."""
        assert self.certs is not None
        bundle = self.certs.server_bundle
        if self.server_pair is not None:
            bundle = self.base_dir / "server-bundle.pem"
            cert, key = self.server_pair
            bundle.write_bytes(cert.read_bytes() + key.read_bytes())
        return {
            "secureClientPort": self.secure_port,
            "secureClientPortAddress": "127.0.0.1",
            "serverCnxnFactory": "org.apache.zookeeper.server.NettyServerCnxnFactory",
            # The TLS port checks a client's certificate through this provider; a session then
            # also has an x509 identity next to its digest one (idmint's ACLs name the digest).
            "authProvider.x509": "org.apache.zookeeper.server.auth.X509AuthenticationProvider",
            "ssl.keyStore.location": bundle,
            "ssl.keyStore.type": "PEM",
            "ssl.trustStore.location": self.certs.ca,
            "ssl.trustStore.type": "PEM",
            "ssl.clientAuth": "need",
        }

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
                if self.secure_port is not None:
                    self.secure_port = free_port()

    def _spawn_and_wait(self) -> None:
        self._tls_warm = False  # a new JVM
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

    def admin(self) -> KazooClient:
        """A started client on the plain port, anonymous (the caller stops it)."""
        client = KazooClient(hosts=f"127.0.0.1:{self.port}", timeout=10.0)
        client.start(timeout=10.0)
        return client

    def locked_store_url(self, name: str) -> str:
        """A zk:// URL over the TLS port with the client certificate and digest credentials
        made for `name`, whose chroot /NAME exists (made here as an admin would) with the grant
        docs/stores.md gives: create, delete, read, write for that user, nothing for others."""
        if not self._tls_warm:
            self.warm_tls()
        password = secrets.token_urlsafe(12)
        self.make_chroot(name, name, password)
        return self.url_as(name, password, name)

    def warm_tls(self) -> None:
        """One TLS session through the secure port. The JVM's first TLS handshake (its TLS
        code loaded and compiled) takes seconds on a busy machine, more than the 2 s store
        timeout the contract suites use; the later ones take milliseconds."""
        assert self.certs is not None
        c = self.certs
        client = KazooClient(
            hosts=f"127.0.0.1:{self.secure_port}",
            use_ssl=True,
            verify_certs=True,
            ca=str(c.ca),
            certfile=str(c.client_cert),
            keyfile=str(c.client_key),
            timeout=10.0,
        )
        try:
            client.start(timeout=30.0)
            client.get_children("/")
        finally:
            client.stop()
            client.close()
        self._tls_warm = True

    def make_chroot(self, chroot: str, user: str, password: str) -> None:
        """The node /CHROOT, its one ACL `user` with cdrw (no admin: idmint sets ACLs only on
        nodes it creates, which it does in the create itself)."""
        acl = make_digest_acl(user, password, read=True, write=True, create=True, delete=True)
        client = self.admin()
        try:
            client.create(f"/{chroot}", b"", acl=[acl])
        finally:
            client.stop()
            client.close()

    def url_as(self, user: str, password: str, chroot: str, ca: Path | None = None) -> str:
        """A URL over the TLS port as digest `user`, with the client certificate."""
        assert self.certs is not None and self.secure_port is not None
        c = self.certs
        return (
            f"zk://{quote(user, safe='')}:{quote(password, safe='')}@127.0.0.1:{self.secure_port}"
            f"/{chroot}?ca={ca or c.ca}&cert={c.client_cert}&key={c.client_key}"
        )
