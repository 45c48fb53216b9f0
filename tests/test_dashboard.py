"""The dashboard in real headless Chromium: it loads offline, shows the keys and their ranges with
64-bit ids digit for digit, shows an empty state, and keeps the last data under a "stale" banner
when the server stops answering.

The screenshot is kept as a test artefact in artifacts/dashboard.png.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx
import pytest

import idmint
from idmint import ReservationSizing
from idmint.server.metrics import combine_views

import quorum_nodes
from conftest import aged_sqlite_url
from http_server import ServerProcess
from servers import wait_until

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
    "--hide-scrollbars",
    "--window-size=1400,900",
    "--virtual-time-budget=5000",  # let the page fetch /v1/stats (every 2 s) and render
]
DASH = "\N{EN DASH}"  # between the first and last id of a range
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}


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


#: The tables' rows: the attribute naming a row, and the Page dictionary it goes to.
ROWS = {"data-key": "keys", "data-quorum": "quorum", "data-dckey": "dc"}


class Page(HTMLParser):
    """The DOM Chromium rendered, reduced to what an operator reads: the text of each row's
    cells (`<tr data-key>` / `<td data-col>`; a key's row per worker is "name@pid"; quorum keys
    `data-quorum`, datacenter keys `data-dckey`), each key's error line, each quorum node's chip
    (`data-node`: its text and class), and each element with an id (its text, whether it is
    hidden, its class and href). Scripts and styles are not text."""

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.keys: dict[str, dict[str, str]] = {}
        self.quorum: dict[str, dict[str, str]] = {}
        self.dc: dict[str, dict[str, str]] = {}
        self.nodes: dict[tuple[str, str], tuple[str, str]] = {}  # (key, node): (text, class)
        self.errors: dict[str, str] = {}
        self.by_id: dict[str, str] = {}
        self.hidden: set[str] = set()
        self.classes: dict[str, str] = {}  # each element with an id: its class attribute
        self.hrefs: dict[str, str] = {}
        self.titles: dict[str, str] = {}  # each element with an id: its title (the tooltip)
        self._open: list[list[tuple[str, str]]] = []  # per open element: what its text goes to
        self._active: list[tuple[str, str]] = []
        self._parts: dict[tuple[str, str], list[str]] = {}
        self._row: tuple[dict[str, dict[str, str]], str] | None = None
        self._skip = 0
        self.feed(dom)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag in ("script", "style"):
            self._skip += 1
        if tag in VOID:
            return
        sinks: list[tuple[str, str]] = []
        for attr, table in ROWS.items():
            if tag == "tr" and a.get(attr):
                name = (a[attr] or "") + (f"@{a['data-pid']}" if a.get("data-pid") else "")
                self._row = (getattr(self, table), name)
                self._row[0][name] = {}
        if tag == "tr" and a.get("data-error-for") and "hidden" not in a:
            sinks.append(("error", a["data-error-for"] or ""))
        if tag == "td" and a.get("data-col") and self._row:
            sinks.append(("cell", a["data-col"] or ""))
        if a.get("data-node") and self._row:
            sinks.append(("node", f"{a['data-node']}\0{a.get('class') or ''}"))
        if a.get("id"):
            sinks.append(("id", a["id"] or ""))
            self.classes[a["id"] or ""] = a.get("class") or ""
            self.hrefs[a["id"] or ""] = a.get("href") or ""
            self.titles[a["id"] or ""] = a.get("title") or ""
            if "hidden" in a:
                self.hidden.add(a["id"] or "")
        for sink in sinks:
            self._parts[sink] = []
        self._open.append(sinks)
        self._active.extend(sinks)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip -= 1
        if tag in VOID or not self._open:
            return
        for sink in self._open.pop():
            self._active.remove(sink)
            text = " ".join("".join(self._parts.pop(sink)).split())
            kind, name = sink
            if kind == "cell" and self._row:
                self._row[0][self._row[1]][name] = text
            elif kind == "node" and self._row:
                node, classes = name.split("\0")
                self.nodes[self._row[1], node] = (text, classes)
            elif kind == "error":
                self.errors[name] = text
            else:
                self.by_id[name] = text

    def handle_data(self, data: str) -> None:
        if not self._skip:
            for sink in self._active:
                self._parts[sink].append(data)


def render(url: str) -> Page:
    return Page(chromium("--dump-dom", url).stdout)


def settled_stats(url: str) -> dict[str, Any]:
    """/v1/stats once no key is refilling and every key's row (read from the store every few
    seconds) has caught up with the ranges its generator took: the page, rendered later,
    must show the same figures (in CI a row refreshed between the two reads moved
    "remaining" by 7,000)."""
    reads: list[dict[str, Any]] = []

    def caught_up(key: dict[str, Any]) -> bool:
        gen = key["generator"]
        if gen is None:
            return True
        taken = [r["stop"] for r in (gen["current"], gen["next"]) if r is not None]
        return not gen["refilling"] and key["next_id"] >= max(taken, default=0)

    def settled() -> bool:
        reads.append(httpx.get(url + "/v1/stats").json())
        return all(caught_up(k) for k in reads[-1]["keys"])

    wait_until(settled, 15, "the keys' rows to catch up with their generators")
    return reads[-1]


def test_dashboard_shows_keys_and_ranges(idmint_server: ServerProcess) -> None:
    url = idmint_server.url
    empty = render(url + "/")
    assert "empty" not in empty.hidden and empty.keys == {}
    assert "No keys yet: idmint keys add NAME" in empty.by_id["empty"]

    for key in (
        {"name": "order", "start": 100_000_000, "step": 1000},
        {"name": "ticket", "start": 1, "max": 2**31 - 1},
    ):
        assert httpx.post(url + "/v1/keys", json=key).status_code == 201
    assert len(httpx.get(url + "/v1/keys/order/ids", params={"count": 1500}).json()["ids"]) == 1500
    assert httpx.get(url + "/api/segment/get/ticket").text == "1"
    # The page is compared with /v1/stats digit for digit: wait for the background preload
    # to land first, or it moves "remaining" between the two reads (seen in CI: by 7,000).
    stats = settled_stats(url)
    order, ticket = sorted(stats["keys"], key=lambda k: str(k["name"]))
    current, preloaded = order["generator"]["current"], order["generator"]["next"]

    page = render(url + "/")
    assert list(page.keys) == ["order", "ticket"]
    assert {"banner", "empty", "waiting"} <= page.hidden  # fresh data, keys, rendered
    shown = page.keys["order"]
    # Exactly, with thousands separators: "100,001,000 to 100,002,999".
    assert shown["current"] == f"{current['start']:,} {DASH} {current['stop'] - 1:,}"
    if preloaded is not None:
        assert shown["next"] == f"{preloaded['start']:,} {DASH} {preloaded['stop'] - 1:,}"
    assert shown["status"] == "ok" and shown["runway"] == "∞"
    assert re.fullmatch(r"\d+\.\d%", shown["fill"]), shown["fill"]
    # Above 2**53, where a JS number would round (to ...769000): the page keeps every digit.
    assert order["remaining"] > 2**53 and shown["remaining"] == f"{order['remaining']:,}"
    assert page.keys["ticket"]["current"] == f"1 {DASH} 1,000"
    assert page.keys["ticket"]["remaining"].startswith(f"{ticket['remaining']:,} ")
    assert "32-bit" in page.keys["ticket"]["key"]
    assert page.by_id["f-version"] == stats["server"]["version"]
    store_id = stats["server"]["store_id"]
    assert len(store_id) == 32 and page.by_id["f-store-id"] == store_id[:8]
    assert page.by_id["f-ready"] == "ready" and page.errors == {}
    assert shown["stripe"] == "—"  # a plain key: one counter
    assert "f-cas-box" in page.hidden  # SQLite locks rows: no compare-and-set loops
    # The totals, as /metrics has them: 1500 + 1 ids issued, and handed over HTTP.
    assert "s-totals-box" not in page.hidden and page.by_id["s-keys"] == "2"
    assert page.by_id["s-issued"] == "1,501" and page.by_id["s-handed"] == "1,501"
    assert page.by_id["s-workers"] == "1"
    assert page.by_id["f-pid"] == str(stats["server"]["pid"]) and "worker" not in shown["key"]
    # The links to what machines read, relative to the page (as v1/stats is): they answer.
    assert page.by_id["l-metrics"] == "/metrics" and page.by_id["l-openapi"] == "/openapi.json"
    metrics = httpx.get(urljoin(url + "/", page.hrefs["l-metrics"]))
    assert "idmint_keys_ids_issued_total 1501.0\n" in metrics.text
    assert httpx.get(urljoin(url + "/", page.hrefs["l-openapi"])).json()["openapi"]

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


@dataclass
class StubServer:
    """Serves the packaged dashboard and scripted /v1/stats answers: `answers[i]` for the i-th
    request (the last one repeats); an int is an HTTP error status."""

    answers: list[dict[str, Any] | int] = field(default_factory=list)
    url: str = ""
    requests: int = 0


@pytest.fixture
def stub() -> Iterator[StubServer]:
    page = resources.files("idmint.server").joinpath("dashboard.html").read_bytes()
    state = StubServer()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/":
                self.reply(200, page, "text/html; charset=utf-8")
            elif self.path.startswith("/v1/stats"):
                answer = state.answers[min(state.requests, len(state.answers) - 1)]
                state.requests += 1
                if isinstance(answer, int):
                    self.reply(answer, b'{"error": "shutting down"}', "application/json")
                else:
                    self.reply(200, json.dumps(answer).encode(), "application/json")
            else:
                self.reply(404, b"", "text/plain")

        def reply(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    # Polled every 50 ms, not 500: shutdown() waits for the poll (0.4 s per test otherwise).
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield state
    httpd.shutdown()
    httpd.server_close()
    thread.join(10)


def test_stale_data_errors_and_ids_near_2_63(stub: StubServer) -> None:
    top = 2**63 - 2
    base = top - 775_806  # 9223372036854000000: far above 2**53
    generator = {
        "current": {"start": base, "stop": base + 1000},
        "position": base + 999,
        "next": None,
        "fill": 0.001,
        "step": 1000,
        "refills": 1,
        "refilling": False,
        "last_refill_at": "2026-11-21T05:00:00+00:00",
        "last_refill_ms": 1.5,
        "issued": 999,
        "taken": 1000,
        "given_back": 0,
        "density": 0.999,
        "rate_per_s": 0.5,
        "runway_s": 200.0,
        "error": "store unavailable: connection refused",
    }
    key = {"name": "event", "max": top, "start": base, "step": 1000, "description": None}
    key |= {"next_id": base + 1000, "remaining": top - base - 999, "bounded": True}
    server = {"version": "9.9.9", "store": "postgresql://app:secret@db/app", "pid": 77}
    server |= {"started_at": "2026-11-21T05:00:00+00:00", "uptime_s": 60.0, "ready": True}
    stub.answers = [{"server": server, "keys": [key | {"generator": generator}]}, 503]

    page = render(stub.url + "/")
    assert stub.requests >= 2  # it refreshed itself, and the refresh failed
    assert "banner" not in page.hidden
    assert "Stale: cannot reach server" in page.by_id["banner"]
    assert "HTTP 503: shutting down" in page.by_id["banner"]
    assert page.by_id["f-ready"] == "unreachable"
    shown = page.keys["event"]  # the last good data stays on screen, digit for digit
    assert shown["current"] == f"9,223,372,036,854,000,000 {DASH} 9,223,372,036,854,000,999"
    assert shown["remaining"].startswith("774,807 ")
    assert shown["status"] == "error" and shown["runway"] == "3 min 20 s"
    assert page.errors == {"event": "error store unavailable: connection refused"}
    assert page.by_id["f-store"] == "postgresql://app:***@db/app"  # never a password on screen
    assert "s-totals-box" in page.hidden  # a server without totals (older): no box


def test_dashboard_shows_the_snowflake_worker(idmint_server: ServerProcess) -> None:
    before = render(idmint_server.url + "/").hidden  # no snowflake route used yet
    assert {"f-flake-box", "f-clock-box"} <= before
    # The fixture's store was made a minute ago: its first worker lease waits for nothing.
    first = httpx.get(idmint_server.url + "/api/snowflake/get/any", timeout=30)
    assert first.status_code == 200
    page = render(idmint_server.url + "/")
    assert "f-flake-box" not in page.hidden
    flake = page.by_id["f-flake"]
    assert re.fullmatch(r"twitter · worker 0 · lease \d+ s", flake), flake
    # this host's clock against the store's (SQLite reads this machine's own)
    assert "f-clock-box" not in page.hidden
    clock = page.by_id["f-clock"]
    assert re.fullmatch(r"[+\u2212]\d+ ms ±\d+ · rollbacks 0", clock), clock


def test_dashboard_shows_stripes_and_conflicts(stub: StubServer) -> None:
    generator = {
        "current": {"start": 102, "stop": 502, "stride": 5},
        "position": 152,
        "next": {"start": 1003, "stop": 2003, "stride": 5},
        "fill": 0.875,
        "step": 80,
        "refills": 2,
        "refilling": False,
        "last_refill_at": "2026-11-21T05:00:00+00:00",
        "last_refill_ms": 1.5,
        "issued": 10,
        "taken": 280,
        "given_back": 0,
        "density": 1.0,
        "rate_per_s": 0.5,
        "runway_s": None,
        "error": None,
        "stripe": 2,
        "stripes": 5,
        "conflicts": 3,
    }
    key = {"name": "order", "start": 100, "max": 2**63 - 6, "step": 40, "description": ""}
    key |= {"next_id": 100, "remaining": 10**12, "bounded": False, "stripes": 5}
    key |= {"stripe_next": [100, 101, 502, 103, 104]}
    cold = key | {"name": "cold", "generator": None}
    plain = key | {"name": "plain", "stripes": 1, "stripe_next": None}
    plain_gen = generator | {"stripe": 0, "stripes": 1, "conflicts": 0}
    plain_gen |= {"current": {"start": 1, "stop": 81, "stride": 1}, "position": 11}
    server = {"version": "9.9.9", "store": "etcd://db:2379/ids", "pid": 77}
    server |= {"started_at": "2026-11-21T05:00:00+00:00", "uptime_s": 60.0, "ready": True}
    stub.answers = [
        {
            "server": server,
            "keys": [cold, key | {"generator": generator}, plain | {"generator": plain_gen}],
            "cas": {"conflicts": 7, "retries": 4},
        }
    ]
    page = render(stub.url + "/")
    shown = page.keys["order"]
    assert shown["stripe"] == "2/5 3 conflicts"
    assert shown["current"] == f"102 {DASH} 497 every 5"  # its last id: stop - stride
    assert shown["next"] == f"1,003 {DASH} 1,998 every 5"
    assert page.keys["cold"]["stripe"] == f"{DASH}/5"  # no range taken here yet
    assert page.keys["plain"]["stripe"] == "—"
    assert page.keys["plain"]["current"] == f"1 {DASH} 80"
    assert "f-cas-box" not in page.hidden
    assert page.by_id["f-cas"] == "conflicts 7 · retries 4"


def test_dashboard_shows_a_striped_key_served(tmp_path: Path) -> None:
    # A real server on the memory store: ranges over compare-and-set cells.
    server = ServerProcess(f"memory://dash-{tmp_path.name}").start()
    try:
        made = {"name": "lanes", "start": 1, "step": 100, "stripes": 4}
        assert httpx.post(server.url + "/v1/keys", json=made).status_code == 201
        ids = httpx.get(server.url + "/v1/keys/lanes/ids", params={"count": 10}).json()["ids"]
        assert len({i % 4 for i in ids}) == 1  # one range: one stripe
        [stats] = httpx.get(server.url + "/v1/stats").json()["keys"]
        generator = stats["generator"]
        current = generator["current"]
        assert current["stride"] == 4 and generator["stripes"] == 4
        page = render(server.url + "/")
        shown = page.keys["lanes"]
        assert shown["stripe"] == f"{generator['stripe']}/4"
        last = current["stop"] - 4
        assert shown["current"] == f"{current['start']} {DASH} {last} every 4"
        assert "f-cas-box" not in page.hidden
        assert re.fullmatch(r"conflicts \d+ · retries \d+", page.by_id["f-cas"])
    finally:
        server.stop()


def test_dashboard_shows_a_datacenters_runway(stub: StubServer) -> None:
    server = {"version": "9.9.9", "store": "cassandra://db/ids", "pid": 77}
    server |= {"started_at": "2026-11-21T05:00:00+00:00", "uptime_s": 60.0, "ready": True}
    status: dict[str, object] = {"key": "order", "dc": "eu", "reserved": {"start": 1, "stop": 1001}}
    status |= {"next_id": 11, "preloaded": None, "grants": 1, "retired": False}
    counts = {"global_cas": 1, "global_conflicts": 0, "local_conflicts": 0, "grants": 1}
    counts |= {"preload_failures": 3, "runway_spent": 0}
    slow = status | {"key": "slow", "left": 5000, "rate": 1.0, "runway_s": 5000.0}
    fast = status | {"key": "fast", "left": 990, "rate": 0.5, "runway_s": 1980.0}
    stub.answers = [
        {
            "server": server,
            "keys": [],
            "datacenter": {"dc": "eu", "counts": counts, "keys": [slow, fast]},
        }
    ]
    page = render(stub.url + "/")
    assert "f-dc-box" not in page.hidden
    assert page.by_id["f-dc"].startswith("eu · fast 990 left · runway 33 min 0 s")
    assert page.by_id["f-dc"].endswith("preload failures 3")


def test_dashboard_shows_every_workers_totals_and_rows(tmp_path: Path) -> None:
    """Two workers: whichever answers the page's /v1/stats, it shows both workers' ids, the
    same totals /metrics has, and the same rows: the key's once per worker, with its ranges."""
    server = ServerProcess(f"sqlite:///{tmp_path / 'two.db'}", workers=2).start()
    try:
        assert httpx.post(server.url + "/v1/keys", json={"name": "order"}).status_code == 201
        received, serving = 0, set[int]()
        deadline = time.monotonic() + 30
        while len(serving) < 2 or received < 200:  # new connections: the kernel spreads them
            assert time.monotonic() < deadline, "one worker answered every request"
            answer = httpx.get(server.url + "/v1/keys/order/ids", params={"count": 10})
            received += len(answer.json()["ids"])
            keys = httpx.get(server.url + "/v1/stats").json()["keys"]
            serving = {k["pid"] for k in keys if k["generator"] is not None}
        time.sleep(2.5)  # each worker copies its counts into the metrics once a second
        metrics = httpx.get(server.url + "/metrics").text
        assert f"idmint_keys_ids_issued_total {received}.0\n" in metrics
        rows: dict[int, list[tuple[Any, ...]]] = {}  # answering pid: the rows it sent
        while len(rows) < 2:
            assert time.monotonic() < deadline + 10, "one worker answered every request"
            stats = httpx.get(server.url + "/v1/stats").json()
            rows[stats["server"]["pid"]] = [
                (k["name"], k["pid"], k["generator"]["current"], k["generator"]["issued"])
                for k in stats["keys"]
            ]
        first, second = rows.values()
        assert first == second  # the same, whichever worker answered
        assert [row[:2] for row in first] == [("order", pid) for pid in sorted(rows)]
        page = render(server.url + "/")
    finally:
        server.stop()
    assert page.by_id["s-issued"] == f"{received:,}" == page.by_id["s-handed"]
    assert page.by_id["s-workers"] == "2" and page.by_id["s-serving"] == "1"
    assert page.by_id["f-pid"] == ", ".join(map(str, sorted(rows)))
    for _, pid, current, _ in first:
        shown = page.keys[f"order@{pid}"]
        assert shown["key"] == f"order worker {pid}"
        assert shown["current"] == f"{current['start']:,} {DASH} {current['stop'] - 1:,}"


def test_dashboard_shows_the_stores_replication_and_failovers(stub: StubServer) -> None:
    server = {"version": "9.9.9", "store": "redis://db/0", "pid": 77}
    server |= {"started_at": "2026-11-21T05:00:00+00:00", "uptime_s": 60.0, "ready": True}
    state = {"role": "primary", "lineage": "ab12", "replicas": 2, "waits_for": 2}
    state |= {"detail": "master_repl_offset 42", "risk": None}
    replication = {"state": state, "failovers": 0, "last_failover": None}
    stub.answers = [{"server": server, "keys": [], "replication": replication}]
    page = render(stub.url + "/")
    assert "f-repl-box" not in page.hidden
    assert page.by_id["f-repl"] == "primary · 2 replica(s) · writes wait for 2"
    assert page.classes["f-repl"] == ""

    risky = state | {"waits_for": 0, "risk": "2 replica(s) connected and writes wait for 0"}
    fenced = replication | {"state": risky, "failovers": 1}
    stub.answers = [{"server": server, "keys": [], "replication": fenced}]
    page = render(stub.url + "/")
    assert page.by_id["f-repl"].endswith("writes wait for 0 · 1 failover(s) fenced")
    assert page.classes["f-repl"] == "warn"

    # Alone after the failover, below the store's requirement: writes are refused, in red.
    why = "writes wait for 0 replica(s) and the store has waited for 1: a failback ..."
    alone = state | {"replicas": 0, "waits_for": 0, "required": 1, "risk": why}
    stub.answers = [{"server": server, "keys": [], "replication": fenced | {"state": alone}}]
    page = render(stub.url + "/")
    assert page.by_id["f-repl"].startswith("primary · 0 replica(s) · writes wait for 0 of 1 ")
    assert page.classes["f-repl"] == "err"
    assert page.titles["f-repl"].startswith("writes refused: " + why)


def test_dashboard_shows_quorum_nodes_and_a_datacenters_keys(tmp_path: Path) -> None:
    """One real server of datacenter eu with a quorum key on three Redis nodes: the quorum
    key's counts and each node up, then the one stopped down; the datacenter's key with its
    reservation, ids left, and the global store reachable. Ids near 2**63 digit for digit.
    The screenshot of every section is artifacts/dashboard-operate.png."""
    top, eu = aged_sqlite_url(tmp_path / "global.db"), f"sqlite:///{tmp_path / 'eu.db'}"
    high = 2**63 - 1_000_000  # far above 2**53: the nodes' counters too
    with idmint.connect(top) as minter:
        sizing = ReservationSizing(min_reservation=100_000)
        minter.add_datacenter_key("order", step=100, max=2**31 - 1, sizing=sizing)
        minter.add_quorum_key("ticket", start=high)
    with quorum_nodes.running(3) as nodes:
        joined = nodes.joined(f"dash{os.getpid()}")
        args = ["--dc", "eu", "--dc-store", eu, "--quorum", joined]
        server = ServerProcess(top, args=args).start()
        try:
            ids = httpx.get(server.url + "/v1/keys/order/ids", params={"count": 250}).json()
            assert ids["ids"] == list(range(1, 251))
            quorum = server.url + "/v1/quorum/ticket/ids"
            assert httpx.get(quorum, params={"count": 5}).json()["start"] == high
            nodes.servers[0].stop()
            # The next round's call to the stopped node (asked first) fails: it asks the third.
            assert httpx.get(quorum, params={"count": 5}, timeout=10).json()["start"] == high + 5
            [served] = httpx.get(server.url + "/v1/stats").json()["keys"]
            page = render(server.url + "/")
            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / "dashboard-operate.png"
            shot.unlink(missing_ok=True)
            chromium(f"--screenshot={shot}", server.url + "/")
            assert shot.stat().st_size > 10_000
        finally:
            server.stop()
    assert "quorum" not in page.hidden and "dc" not in page.hidden
    ticket = page.quorum["ticket"]
    assert ticket["up"] == "2 of 3 up" and ticket["ids"] == "10" and ticket["rounds"] == "2"
    assert ticket["failures"] == "0" and ticket["burnt"] == "0"
    hosts = [f"127.0.0.{21 + i}:{s.port}" for i, s in enumerate(nodes.servers)]
    for host in hosts[1:]:
        text, classes = page.nodes["ticket", host]
        assert classes == "node up" and text == f"{host} up {high + 9:,}", text
    text, classes = page.nodes["ticket", hosts[0]]
    assert classes == "node down" and text.startswith(f"{hosts[0]} down "), text
    order = page.dc["order"]
    assert page.by_id["dc-name"] == "eu" and page.by_id["dc-global"] == "global store reachable"
    assert order["state"] == "serving" and order["reserved"] == f"1 {DASH} 100,000"
    assert order["grants"] == "1" and order["preloaded"] == "none"
    left = int(order["left"].replace(",", ""))
    assert 99_000 <= left <= 99_750 and order["left"] == f"{left:,}"  # a generator took more
    assert order["next"] == f"{100_001 - left:,}"
    current = served["generator"]["current"]  # the datacenter key's generator, in the table
    assert page.keys["order"]["current"] == f"{current['start']:,} {DASH} {current['stop'] - 1:,}"


def test_dashboard_shows_a_retired_datacenter_cut_off(stub: StubServer) -> None:
    """A datacenter cut off from the global store for 200 s: one key retired (no runway), one
    with 3 h 12 min of ids left at its rate; the header names every worker's pid."""
    server = {"version": "9.9.9", "store": "cassandra://db/ids", "pid": 78, "pids": [77, 78]}
    # The page reads "since" on the server's clock: its start plus its uptime.
    started = datetime.fromtimestamp(time.time() - 60, UTC).isoformat()
    server |= {"started_at": started, "uptime_s": 60.0, "ready": True}
    cell: dict[str, object] = {"key": "fast", "dc": "eu", "reserved": {"start": 1, "stop": 20001}}
    cell |= {"next_id": 8481, "preloaded": None, "left": 11_520, "rate": 1.0, "grants": 3}
    cell |= {"runway_s": 11_520.4, "retired": False, "seen_from": "local"}
    old = cell | {"key": "old", "next_id": 20001, "left": 0, "runway_s": 0.0, "retired": True}
    counts = {"global_cas": 9, "global_conflicts": 1, "local_conflicts": 2, "grants": 3}
    counts |= {"preload_failures": 1234, "runway_spent": 0}
    level = {"reachable": False, "since": time.time() - 200, "error": "connection refused"}
    datacenter = {"dc": "eu", "global": level, "counts": counts, "keys": [cell, old]}
    stub.answers = [{"server": server, "keys": [], "datacenter": datacenter}]
    page = render(stub.url + "/")
    assert page.by_id["dc-global"].startswith("global store cut off for 3 min ")
    assert page.classes["dc-global"] == "pill bad"
    assert "preload failures 1,234" in page.by_id["dc-counts"]
    assert page.dc["old"]["state"] == "retired" and page.dc["old"]["runway"] == "—"
    assert page.dc["old"]["left"] == "0" and page.dc["old"]["next"] == "20,001"
    fast = page.dc["fast"]
    assert fast["state"] == "serving" and fast["runway"] == "3 h 12 min"
    assert fast["left"] == "11,520" and fast["reserved"] == f"1 {DASH} 20,000"
    assert "retired: old" in page.by_id["f-dc"] and "global level cut off" in page.by_id["f-dc"]
    assert page.by_id["f-pid-label"] == "pids" and page.by_id["f-pid"] == "77, 78"
    assert "quorum" in page.hidden  # no quorum key served


def test_a_retired_key_and_a_datacenters_grants_read_right(stub: StubServer) -> None:
    """Issue 31. On main a retired key (idmint keys retire) was a red error row with its
    refusal as the error line, and counted among the errors; and the datacenter's header said
    "grants 1" (its workers' grants since they started) over a table saying 2 (the key's
    latest grant, every process's: here one taken before this server started)."""
    server = {"version": "9.9.9", "store": "sqlite:///x.db", "pid": 77}
    server |= {"started_at": "2026-11-21T05:00:00+00:00", "uptime_s": 60.0, "ready": True}
    refusal = "key 'old' is exhausted: every id up to its maximum 100 is used"
    generator: dict[str, object] = {"current": None, "position": None, "next": None}
    generator |= {
        "fill": None,
        "step": 1000,
        "refills": 0,
        "refilling": False,
        "issued": 0,
        "taken": 0,
        "given_back": 0,
    }
    generator |= {"density": 1.0, "rate_per_s": 0.0, "runway_s": None, "error": refusal}
    old = {"name": "old", "start": 101, "max": 100, "step": 1000, "description": ""}
    old |= {"next_id": 101, "remaining": 0, "bounded": True, "retired": True}
    cell = {"key": "order", "dc": "eu", "reserved": {"start": 1, "stop": 1001}, "next_id": 11}
    cell |= {"preloaded": None, "grants": 2, "retired": False, "left": 990, "rate": 0.5}
    cell |= {"runway_s": 1980.0}
    counts = {"global_cas": 1, "global_conflicts": 0, "local_conflicts": 0, "grants": 1}
    counts |= {"preload_failures": 0, "runway_spent": 0}
    stub.answers = [
        {
            "server": server,
            "keys": [old | {"generator": generator}],
            "datacenter": {"dc": "eu", "counts": counts, "keys": [cell]},
        }
    ]
    page = render(stub.url + "/")
    assert page.keys["old"]["status"] == "retired"
    assert page.errors == {} and page.by_id["s-errors"] == "0"
    assert page.classes["s-errors-box"] == "stat"
    assert page.dc["order"]["grants"] == "2"
    assert page.by_id["dc-counts"].startswith("grants 2 (1 by this server since it started) · ")


def test_the_workers_views_combine_alike_whichever_answers() -> None:
    """/v1/stats of several workers (combine_views): a key's row per worker serving it; a
    quorum node down if its last call failed in any worker; a datacenter's cell as the worker
    that saw it last has it (retired); the global level's latest change; counts added up."""
    generator = {"current": {"start": 1, "stop": 101}, "issued": 5}
    key = {"name": "order", "generator": generator}
    node = {"url": "redis://n1:6379/0", "up": True, "counter": 10, "last_error": None}
    node |= {"last_ok_at": 100.0, "in_flight": False, "refused": None}
    quorum = {"key": "ticket", "nodes": [node], "majority": 1, "ids": 5, "rounds": 1}
    quorum |= {"retries": 0, "burnt": 0, "requests": 1, "largest_batch": 5, "failures": 0}
    quorum |= {"last_error": None, "closed": False}
    cell = {"key": "order", "next_id": 500, "left": 501, "grants": 1, "retired": False}
    counts = {"grants": 1, "preload_failures": 0}
    level = {"reachable": True, "since": 100.0, "error": None}
    flake = {"layout": "twitter", "worker_id": 3, "lease_deadline_s": 9.0, "rollbacks": 0}
    flake |= {"clock_offset_ms": 1.0, "clock_offset_error_ms": 0.5, "renewals": 4}
    flake |= {"runway_years": 60.0}
    first: dict[str, Any] = {"pid": 11, "started": 5.0, "keys": [key], "cas": None}
    first |= {"snowflake": flake, "quorum": [quorum], "replication": None}
    first |= {"datacenter": {"dc": "eu", "global": level, "counts": counts, "keys": [cell]}}
    down = node | {"up": False, "counter": 12, "last_error": "refused", "last_ok_at": 90.0}
    cut = {"reachable": False, "since": 200.0, "error": "timed out"}
    retired = cell | {"next_id": 1001, "left": 0, "retired": True}
    second = first | {"pid": 12, "started": 6.0, "keys": [key | {"generator": None}]}
    second |= {"snowflake": flake | {"worker_id": 1, "lease_deadline_s": 4.0}}
    second |= {"quorum": [quorum | {"nodes": [down], "ids": 3}]}
    second |= {"datacenter": {"dc": "eu", "global": cut, "counts": counts, "keys": [retired]}}
    whole = combine_views([second, first])
    assert whole == combine_views([first, second])
    assert whole["pids"] == [11, 12] and whole["started"] == 5.0
    assert whole["keys"] == [key | {"pid": 11}]  # worker 12 serves no range of it
    [ticket] = whole["quorum"]
    assert ticket["ids"] == 8 and ticket["workers"] == 2
    assert ticket["nodes"] == [node | {"up": False, "counter": 12, "last_error": "refused"}]
    dc = whole["datacenter"]
    assert dc["keys"] == [retired] and dc["global"] == cut and dc["counts"]["grants"] == 2
    flakes = whole["snowflake"]
    assert flakes["worker_ids"] == [1, 3] and flakes["lease_deadline_s"] == 4.0
    assert flakes["renewals"] == 8
    # One worker serving the key, the other not yet: its row once, with no pid.
    idle = combine_views([first | {"keys": [key | {"generator": None}]}])
    assert idle["keys"] == [key | {"generator": None, "pid": None}]
