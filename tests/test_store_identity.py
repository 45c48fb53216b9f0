"""The store's identity on the server (the `idmint-store` header, /readyz, /v1/stats,
/metrics), and a client that refuses servers on two different stores: their ids overlap."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

import idmint
from idmint import InvalidArgument
from idmint.stores import open_lease_store

from checks import assert_unique, run_threads
from conftest import fresh_store_url
from http_server import ServerProcess


def test_the_server_names_its_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'one.db'}"
    with idmint.connect(url) as minter:
        minter.add_key("order")
        identity = minter.identity()
    assert identity is not None
    server = ServerProcess(url).start()
    try:
        ready = httpx.get(server.url + "/readyz", timeout=10)
        while ready.status_code != 200:  # warming up
            ready = httpx.get(server.url + "/readyz", timeout=10)
        assert ready.text == f"ready (store {identity.id})\n"
        assert ready.headers["idmint-store"] == identity.id
        stats = httpx.get(server.url + "/v1/stats", timeout=10).json()["server"]
        assert stats["store_id"] == identity.id and stats["store_created_at"].startswith("20")
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert f'store_id="{identity.id}"' in metrics
    finally:
        server.stop()


def test_a_client_refuses_servers_on_two_stores(tmp_path: Path) -> None:
    servers = []
    for name in ("a", "b"):
        url = f"sqlite:///{tmp_path / name}.db"
        with idmint.connect(url) as minter:
            minter.add_key("order")  # both start at 1: every id of one is an id of the other
        servers.append(ServerProcess(url).start())
    try:
        for server in servers:  # the header comes once each server has read its store
            httpx.get(server.url + "/readyz", timeout=10)
        with (
            idmint.Client([s.url for s in servers]) as client,
            pytest.raises(InvalidArgument, match="serve different stores"),
        ):
            client.segment("order").next_id()
        # One store behind both: fine, and failover keeps ids unique.
        with idmint.Client([servers[0].url, servers[0].url]) as client:
            assert_unique(client.segment("order").next_ids(3000))
    finally:
        for server in servers:
            server.stop()


@pytest.mark.parametrize("kind", ["sqlite", "postgres", "mariadb"])
def test_many_first_connections_at_once_agree_on_one_identity(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # Twelve processes' first touch of a fresh database, at the same instant: they race to
    # create the schema and the identity; none may fail, and all must see the same identity.
    url = fresh_store_url(kind, request, tmp_path)
    barrier = threading.Barrier(12)
    seen: list[str] = []
    errors: list[BaseException] = []

    def first_touch() -> None:
        store = open_lease_store(url)
        try:
            barrier.wait()
            identity = store.identity()
            assert identity is not None
            seen.append(identity.id)
        except BaseException as exc:
            errors.append(exc)
        finally:
            store.close()

    run_threads(first_touch, 12)
    assert not errors, errors[0]
    assert len(seen) == 12 and len(set(seen)) == 1
