"""The dashboard in real headless Chromium: it loads offline and shows the keys and their ranges.

The screenshot is kept as a test artefact in artifacts/dashboard.png.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx

from http_server import ServerProcess

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",  # this machine's network is closed: no phoning home
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,900",
    "--virtual-time-budget=5000",  # let the page fetch /v1/stats and render
]


def chromium(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "chromium is not installed: .ci/install installs Debian's chromium"
    with tempfile.TemporaryDirectory(prefix="idmint-chromium-") as profile:
        return subprocess.run(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )


def test_dashboard_shows_keys_and_ranges(idmint_server: ServerProcess) -> None:
    url = idmint_server.url
    for key in (
        {"name": "order", "start": 100_000_000, "step": 1000},
        {"name": "ticket", "start": 1, "max": 2**31 - 1},
    ):
        assert httpx.post(url + "/v1/keys", json=key).status_code == 201
    assert len(httpx.get(url + "/v1/keys/order/ids", params={"count": 1500}).json()["ids"]) == 1500
    assert httpx.get(url + "/api/segment/get/ticket").text == "1"
    order, ticket = httpx.get(url + "/v1/stats").json()["keys"]
    current = order["generator"]["current"]

    dom = chromium("--dump-dom", url + "/").stdout
    text = re.sub(r"<[^>]+>", " ", dom)
    assert "order" in text and "ticket" in text
    assert str(current["start"]) in text  # the current range of "order", exactly
    assert str(current["stop"] - 1) in text
    assert str(ticket["remaining"]) in text  # the 32-bit key's remaining ids

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    shot.unlink(missing_ok=True)
    chromium(f"--screenshot={shot}", url + "/")
    assert shot.stat().st_size > 10_000


def test_dashboard_needs_no_network(idmint_server: ServerProcess) -> None:
    page = httpx.get(idmint_server.url + "/").text
    # Nothing loaded from elsewhere: no external scripts, styles, fonts or images.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "@import" not in page and "url(http" not in page
