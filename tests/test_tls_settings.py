"""The TLS spelling every engine's URL shares (src/idmint/stores/tls.py): what the query asks
for, the errors of a bad one, and real handshakes against a TLS listener with the test
certificates (tests/certs.py): the right CA, the wrong CA, an expired certificate, a client
certificate the listener requires."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import pytest

from idmint import InvalidArgument
from idmint.stores.tls import TlsSettings, handshake_failure, tls_settings

from certs import Certs, make_certs
from certs import tls_listener as listener


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def handshake(settings: TlsSettings, port: int, host: str = "127.0.0.1") -> bytes:
    context = settings.context("test-store")
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        return tls.recv(2)


def test_the_query_turns_tls_on_only_when_asked() -> None:
    assert tls_settings({}, "s") is None
    assert tls_settings({"tls": "0"}, "s") is None
    assert tls_settings({"tls": "1"}, "s") == TlsSettings()
    assert tls_settings({"ca": "/c"}, "s") == TlsSettings(ca="/c")
    assert tls_settings({"cert": "/c", "key": "/k"}, "s") == TlsSettings(cert="/c", key="/k")


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ({"tls": "maybe"}, "tls must be 1 or 0"),
        ({"key": "/k"}, "give cert= too"),
        ({"ca": ""}, "ca= needs a file path"),
        ({"tls": "0", "ca": "/c"}, "contradicts"),
    ],
)
def test_a_bad_query_is_one_clear_error(query: dict[str, str], said: str) -> None:
    with pytest.raises(InvalidArgument, match=said):
        tls_settings(query, "redis://h/x")


def test_unreadable_files_are_invalid_at_once_naming_the_store(
    certs: Certs, tmp_path: Path
) -> None:
    with pytest.raises(InvalidArgument, match="store shown: cannot use ca=/nowhere"):
        TlsSettings(ca="/nowhere").context("shown")
    with pytest.raises(InvalidArgument, match=r"cannot use cert=.* with key="):
        TlsSettings(cert=str(certs.client_cert), key=str(certs.server_key)).context("shown")


def test_the_right_ca_is_trusted_the_wrong_one_and_an_expired_certificate_are_not(
    certs: Certs,
) -> None:
    with listener(certs.server_cert, certs.server_key) as port:
        assert handshake(TlsSettings(ca=str(certs.ca)), port) == b"ok"
        assert handshake(TlsSettings(ca=str(certs.ca)), port, "localhost") == b"ok"
        with pytest.raises(ssl.SSLError) as wrong:
            handshake(TlsSettings(ca=str(certs.wrong_ca)), port)
        said = handshake_failure(wrong.value)
        assert said is not None and "not accepted" in said and "issuer" in said
        with pytest.raises(ssl.SSLError) as misnamed:  # a name the certificate does not hold
            handshake(TlsSettings(ca=str(certs.ca)), port, "db.example.com")
        said = handshake_failure(misnamed.value)
        assert said is not None and "mismatch" in said
    with listener(certs.expired_cert, certs.expired_key) as port:
        with pytest.raises(ssl.SSLError) as expired:
            handshake(TlsSettings(ca=str(certs.ca)), port)
        said = handshake_failure(expired.value)
        assert said is not None and "expired" in said


def test_a_listener_that_requires_a_client_certificate(certs: Certs) -> None:
    with listener(certs.server_cert, certs.server_key, client_ca=certs.ca) as port:
        client = TlsSettings(
            ca=str(certs.ca), cert=str(certs.client_cert), key=str(certs.client_key)
        )
        assert handshake(client, port) == b"ok"
        with pytest.raises((ssl.SSLError, ConnectionError)):  # TLS 1.3: refused after the hello
            assert handshake(TlsSettings(ca=str(certs.ca)), port) == b"ok"


def test_a_failure_wrapped_by_a_driver_is_still_named() -> None:
    try:
        try:
            raise ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")
        except ssl.SSLError as inner:
            raise ConnectionError("driver: connect failed") from inner
    except ConnectionError as outer:
        said = handshake_failure(outer)
    assert said is not None and said.startswith("TLS: the handshake failed")
    assert handshake_failure(ConnectionRefusedError(111, "Connection refused")) is None
