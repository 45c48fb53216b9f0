"""What a user does on each engine: add a striped key with the CLI, serve it, take ids over
HTTP and from a client generator; and the engine object's capabilities."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from idmint import Client, InvalidArgument
from idmint.stores import open_engine
from idmint.stores.engine import Engine

from checks import assert_unique
from conftest import SHARED_STORES, fresh_store_url
from http_server import ServerProcess


def idmint_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "idmint", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("kind", SHARED_STORES)
def test_a_striped_key_served_on_every_engine(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = fresh_store_url(kind, request, tmp_path)
    added = idmint_cli("keys", "add", "order", "--stripes", "5", "--step", "50", "--store", url)
    assert added.returncode == 0, added.stderr
    server = ServerProcess(url).start(timeout=60)
    try:
        ids = httpx.get(f"{server.url}/v1/keys/order/ids?count=300", timeout=30).json()["ids"]
        taken = httpx.post(f"{server.url}/v1/keys/order/ranges?stripe=3", timeout=30).json()
        assert (taken["stride"], taken["stripe"], taken["stripes"]) == (5, 3, 5)
        with Client(server.url) as client:
            gen = client.segment("order")
            ids += [gen.next_id() for _ in range(120)]
        ids += range(taken["start"], taken["stop"], taken["stride"])
    finally:
        server.stop()
    assert_unique(ids)
    listed = idmint_cli("keys", "list", "--store", url)
    assert listed.returncode == 0 and "order" in listed.stdout, listed.stderr


def test_an_engine_offers_its_capabilities_made_once() -> None:
    engine = open_engine("memory://")
    assert engine.capabilities == {"ranges", "leases", "cas", "quorum"}
    assert engine.ranges() is engine.ranges() and engine.cas() is engine.cas()
    engine.close()
    engine.close()  # safe to repeat


def test_a_missing_capability_names_the_engines_that_have_it() -> None:
    engine = Engine("toy", "toy://", {"leases": lambda _: None})
    with pytest.raises(InvalidArgument, match=r"toy:// \(toy\) has no segment keys; .*sqlite"):
        engine.ranges()
    assert not engine.has("cas") and engine.has("leases")


def test_a_bad_url_fails_when_the_engine_is_opened() -> None:
    with pytest.raises(InvalidArgument, match="must start with one of"):
        open_engine("nosuch://x")
