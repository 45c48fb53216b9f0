"""A throw-away single-member etcd for the lease store tests, from Debian's /usr/bin/etcd.

It listens on 127.0.0.1 only and keeps its data dir and ``server.log`` in a temporary
directory; ``restart()`` and ``kill()`` keep both ports and the data, and an ``atexit`` hook
kills it if the test process forgets to.

Locked down (issue 33): ``locked_store_url(name)`` is a URL to a second etcd, started on first
ask (about a second), that takes only https clients with a certificate of the test CA and has
RBAC on, as a user made for that name whose one role reads and writes the keys under
``name/`` (docs/stores.md, etcd, "Locked down"). A second server because etcd's auth is
all-or-nothing: on, it refuses every request without a token, on every listener, which would
lock out every other test of the shared plain one.

Its clients' certificates have no CommonName: with auth on, etcd (3.4.10 and later) refuses a
certificate with one on its JSON gateway, which idmint speaks (the name would be ignored there,
while its gRPC API takes it for the user). So the twin trusts a client CA of its own that
signed one such certificate (``GatewayClient``); the server's certificate is the test CA's.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import datetime
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certs import Certs
from servers import Pausable, ServerStartError, free_port, wait_until

ETCD = os.environ.get("IDMINT_ETCD", "/usr/bin/etcd")
LOOPBACK = "127.0.0.1"


#: The root user's password on a locked-down server (the tests' admin, never idmint's).
ROOT_PASSWORD = "root-" + secrets.token_hex(8)


class GatewayClient:
    """A client CA and a client certificate it signed with no CommonName (see the module's
    doc), written under `directory`: ``ca``, ``cert``, ``key``."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "idmint etcd client CA")])
        ca = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "idmint")]))
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        self.ca = directory / "etcd-client-ca.pem"
        self.cert = directory / "etcd-client.pem"
        self.key = directory / "etcd-client-key.pem"
        self.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        self.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        self.key.chmod(0o600)


class EtcdServer(Pausable):
    """One etcd member; ``store_url(name)`` is an etcd:// URL with its own key prefix.

    ``tls``: https clients only, each with a certificate of ``certs.ca`` (the member's own
    certificate is ``server_pair``, the CA's server certificate unless given: an expired one
    for the negative tests). ``auth``: RBAC on, with a root user (ROOT_PASSWORD)."""

    def __init__(
        self,
        *,
        startup_timeout: float = 20.0,
        addresses: tuple[str, ...] = (LOOPBACK,),
        certs: Certs | None = None,
        tls: bool = False,
        auth: bool = False,
        server_pair: tuple[Path, Path] | None = None,
    ) -> None:
        self.certs = certs  # TLS and auth for locked-down clients (issue 33)
        if (tls or auth) and certs is None:
            raise ServerStartError("a locked-down etcd needs certs")
        self.tls, self.auth = tls, auth
        self.server_pair = server_pair
        self._locked: EtcdServer | None = None  # the locked-down twin, made on first ask
        self._auth_enabled = False
        self._admin: httpx.Client | None = None
        self._root_token = ""
        # More addresses than 127.0.0.1: clients that a partition test cuts off by address.
        self.addresses = addresses
        if not Path(ETCD).is_file():
            raise ServerStartError(f"etcd not found at {ETCD} (set IDMINT_ETCD)")
        self.port, self.peer_port = free_port(), free_port()
        self.startup_timeout = startup_timeout
        self.base_dir = Path(tempfile.mkdtemp(prefix="idmint-etcd-"))
        self.log_path = self.base_dir / "server.log"
        self.client = GatewayClient(self.base_dir / "client") if tls else None
        self._proc: subprocess.Popen[bytes] | None = None
        atexit.register(self._at_exit)

    def start(self) -> None:
        if self._proc is not None:
            return
        scheme = "https" if self.tls else "http"
        client = ",".join(f"{scheme}://{a}:{self.port}" for a in self.addresses)
        peer = f"http://{LOOPBACK}:{self.peer_port}"
        argv = [
            ETCD,
            "--name=default",
            f"--data-dir={self.base_dir / 'data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={scheme}://{self.addresses[0]}:{self.port}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        if self.tls:
            assert self.certs is not None
            cert, key = self.server_pair or (self.certs.server_cert, self.certs.server_key)
            argv += [
                f"--cert-file={cert}",
                f"--key-file={key}",
                "--client-cert-auth",
                f"--trusted-ca-file={self._trusted()}",
            ]
        if self.auth:
            # bcrypt at its least cost: every store the tests open authenticates once, and
            # cost 10 (the default) spends some 60 ms of a shared core on each
            argv.append("--bcrypt-cost=4")
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
        if self.auth and not self._auth_enabled:
            self._enable_auth()

    def _trusted(self) -> Path:
        """The CAs whose client certificates the member takes: the CN-less client's, and the
        test CA, which signed the member's own certificate: its gateway presents that one when
        it calls the member's gRPC API."""
        assert self.certs is not None and self.client is not None
        bundle = self.base_dir / "trusted-ca.pem"
        bundle.write_bytes(self.certs.ca.read_bytes() + self.client.ca.read_bytes())
        return bundle

    def _context(self) -> ssl.SSLContext:
        """The tests' admin client context: the CA's client certificate, the server's
        verified; not verified for a server whose certificate is meant to fail (expired)."""
        assert self.certs is not None
        context = ssl.create_default_context(cafile=self.certs.ca)
        if self.server_pair is not None:
            # the negative tests' server: only checked to be up, its certificate fails on purpose
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        assert self.client is not None
        context.load_cert_chain(self.client.cert, self.client.key)
        return context

    def _base(self) -> str:
        return f"{'https' if self.tls else 'http'}://{LOOPBACK}:{self.port}"

    def admin(self, path: str, body: dict[str, Any], token: str = "") -> dict[str, Any]:
        """POST to the gateway's /v3/`path` as the tests' admin; etcd's error raised."""
        if self._admin is None:
            # one kept-alive client: every locked-down store the tests make costs a few calls
            verify: Any = self._context() if self.tls else True
            self._admin = httpx.Client(base_url=self._base(), verify=verify, timeout=10)
        headers = {"Authorization": token} if token else {}
        r = self._admin.post(f"/v3/{path}", json=body, headers=headers)
        answer: dict[str, Any] = r.json()
        if r.status_code != 200 or answer.get("error"):
            raise RuntimeError(f"etcd {path}: {answer}")
        return answer

    def root_token(self) -> str:
        """The root user's token (made once: etcd keeps it while it is used)."""
        if not self._root_token:
            login = {"name": "root", "password": ROOT_PASSWORD}
            self._root_token = str(self.admin("auth/authenticate", login)["token"])
        return self._root_token

    def _enable_auth(self) -> None:
        """A root user (etcd refuses auth without one, holding the root role), then auth on."""
        self.admin("auth/role/add", {"name": "root"})
        self.admin("auth/user/add", {"name": "root", "password": ROOT_PASSWORD})
        self.admin("auth/user/grant", {"user": "root", "role": "root"})
        self.admin("auth/enable", {})
        self._auth_enabled = True

    def add_user(self, user: str, password: str, prefix: str | None) -> None:
        """An RBAC user; with a prefix, a role of its own with readwrite on the keys under
        "prefix/", the grant docs/stores.md gives (no prefix: a user without a role)."""
        try:
            token = self.root_token()
            self.admin("auth/user/add", {"name": user, "password": password}, token)
        except RuntimeError as exc:
            if "invalid auth token" not in str(exc):
                raise
            self._root_token = ""  # unused too long, or the server restarted: log in again
            token = self.root_token()
            self.admin("auth/user/add", {"name": user, "password": password}, token)
        if prefix is None:
            return
        start = f"{prefix}/".encode()
        end = start[:-1] + bytes([start[-1] + 1])  # the range of every key starting with it
        perm = {
            "permType": "READWRITE",
            "key": base64.b64encode(start).decode(),
            "range_end": base64.b64encode(end).decode(),
        }
        self.admin("auth/role/add", {"name": user}, token)
        self.admin("auth/role/grant", {"name": user, "perm": perm}, token)
        self.admin("auth/user/grant", {"user": user, "role": user}, token)

    def locked(self) -> EtcdServer:
        """The locked-down twin of this server (TLS, client certificates, RBAC): started on
        first ask, closed with this one."""
        if self._locked is None:
            assert self.certs is not None, "locked-down stores need certs (conftest's fixture)"
            twin = EtcdServer(certs=self.certs, tls=True, auth=True)
            twin.start()
            self._locked = twin
        return self._locked

    def locked_store_url(self, name: str) -> str:
        """An etcd:// URL over TLS with the client certificate, as a user made for `name`
        whose one role is readwrite on "name/", on the locked-down twin."""
        server = self.locked()
        password = secrets.token_urlsafe(12)
        server.add_user(name, password, name)
        return server.url_as(name, password, name)

    def url_as(self, user: str, password: str, prefix: str, ca: Path | None = None) -> str:
        """A URL to this (TLS) server as `user`, with the client certificate."""
        assert self.certs is not None and self.client is not None
        return (
            f"etcd://{quote(user, safe='')}:{quote(password, safe='')}@{LOOPBACK}:{self.port}"
            f"/{prefix}?ca={ca or self.certs.ca}&cert={self.client.cert}&key={self.client.key}"
        )

    def _ready(self) -> bool:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise ServerStartError("etcd exited")
        try:
            verify: Any = self._context() if self.tls else True
            r = httpx.get(f"{self._base()}/health", timeout=2, verify=verify)
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
        if self._locked is not None:
            self._locked.close()
        if self._admin is not None:
            self._admin.close()
        self.stop()
        shutil.rmtree(self.base_dir, ignore_errors=True)
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        self.kill()
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def store_url(self, name: str, address: str = LOOPBACK) -> str:
        return f"etcd://{address}:{self.port}/{name}"
