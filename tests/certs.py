"""Certificates made at test time, for the locked-down servers (issue 33): a CA, a server
certificate it signed for the loopback names, a client certificate it signed, and what the
negative tests need: a second CA nobody used (the wrong CA) and a server certificate that
expired yesterday. Keys are EC P-256: quick to make, and every engine's TLS stack takes them.

    made = make_certs(directory)
    made.ca, made.server_cert, made.server_key, made.client_cert, made.client_key, ...
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: The names a server certificate is good for: every loopback address the tests use is
#: 127.0.0.x, so the whole /24 would be convenient, but a SAN names addresses one by one.
LOOPBACK_NAMES = ("localhost", *(f"127.0.0.{i}" for i in range(1, 100)))


@dataclass(frozen=True)
class Certs:
    directory: Path
    ca: Path  # the CA certificate (PEM): what clients trust
    server_cert: Path
    server_key: Path
    client_cert: Path  # signed by the same CA, CN "idmint"
    client_key: Path
    wrong_ca: Path  # a CA that signed nothing here
    expired_cert: Path  # a server certificate of `ca` that expired yesterday
    expired_key: Path
    #: the server certificate and its key in one file (servers that want a bundle)
    server_bundle: Path


_CA_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,  # Java (ZooKeeper, Cassandra) reads PKCS#8 only
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _ca(common: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(_name(common))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common: str,
    *,
    server: bool,
    expired: bool = False,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    begins, ends = (
        (now - datetime.timedelta(days=10), now - datetime.timedelta(days=1))
        if expired
        else (now - datetime.timedelta(days=1), now + datetime.timedelta(days=30))
    )
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(begins)
        .not_valid_after(ends)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        # Servers that check their peers both ways (etcd's, ZooKeeper's quorum) present the
        # server certificate as a client too.
        .add_extension(
            x509.ExtendedKeyUsage([usage, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
    )
    if server:
        names: list[x509.GeneralName] = [x509.DNSName("localhost")]
        names += [x509.IPAddress(ipaddress.ip_address(n)) for n in LOOPBACK_NAMES[1:]]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_certs(directory: Path) -> Certs:
    """A CA and what it signed, written under `directory` (made if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _ca("idmint test CA")
    wrong, _ = _ca("idmint wrong CA")
    server, server_key = _leaf(ca, ca_key, "localhost", server=True)
    client, client_key = _leaf(ca, ca_key, "idmint", server=False)
    expired, expired_key = _leaf(ca, ca_key, "localhost", server=True, expired=True)
    bundle = directory / "server-bundle.pem"
    bundle.write_bytes(
        server.public_bytes(serialization.Encoding.PEM)
        + server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    bundle.chmod(0o600)
    return Certs(
        directory=directory,
        ca=_write_cert(ca, directory / "ca.pem"),
        server_cert=_write_cert(server, directory / "server.pem"),
        server_key=_write_key(server_key, directory / "server-key.pem"),
        client_cert=_write_cert(client, directory / "client.pem"),
        client_key=_write_key(client_key, directory / "client-key.pem"),
        wrong_ca=_write_cert(wrong, directory / "wrong-ca.pem"),
        expired_cert=_write_cert(expired, directory / "expired.pem"),
        expired_key=_write_key(expired_key, directory / "expired-key.pem"),
        server_bundle=bundle,
    )


@contextlib.contextmanager
def tls_listener(cert: Path, key: Path, client_ca: Path | None = None) -> Iterator[int]:
    """A TLS listener on 127.0.0.1 that completes handshakes (and requires a client
    certificate signed by `client_ca`, if given); yields its port."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            with contextlib.suppress(OSError), conn:
                conn.settimeout(2)
                with context.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"ok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        sock.close()
