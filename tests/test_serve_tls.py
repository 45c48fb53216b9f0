"""TLS on `idmint serve` itself (`--tls-cert`, `--tls-key`; issue 33), for a site with no proxy
in front: a real server with certificates made at test time (tests/certs.py), and
`idmint.Client`, which verifies the server always, against the CA it is given."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest

import idmint
from idmint import InvalidArgument, StoreUnavailable

from certs import make_certs
from http_server import ServerProcess


def test_serve_over_tls(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    store = f"sqlite:///{tmp_path / 'tls.db'}"
    with idmint.connect(store) as minter:
        minter.add_key("order", start=1000)
    server = ServerProcess(
        store,
        args=["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)],
        ca=certs.ca,
    ).start()
    try:
        assert server.url.startswith("https://")
        with idmint.Client(server.url, ca=certs.ca) as client:
            assert client.segment("order").next_id() >= 1000  # the server warmed one range
            assert len(client.take("order", 5)) == 5
        # Leaf's route, answered before routing, over TLS too.
        trusted = ssl.create_default_context(cafile=certs.ca)
        leaf = httpx.get(server.url + "/api/segment/get/order", verify=trusted)
        assert leaf.status_code == 200 and int(leaf.text) >= 1000
        # Without the CA (certifi's CAs), or with another one: refused, and said so.
        for ca in (None, certs.wrong_ca):
            with idmint.Client(server.url, ca=ca) as client, pytest.raises(StoreUnavailable) as no:
                client.take("order", 1)
            assert "certificate was not accepted" in str(no.value), no.value
            assert "ca=PATH" in str(no.value)
        # Plain HTTP to the TLS port gets no answer.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{server.port}/livez", timeout=5)
        assert "serving HTTPS" in server.log()
    finally:
        server.stop()


def test_a_client_with_a_bad_ca_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read the CA file"):
        idmint.Client("https://127.0.0.1:1", ca=tmp_path / "missing.pem")
