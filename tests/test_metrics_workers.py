"""/metrics of a real `idmint serve --workers 2`: every scrape, whichever worker answers, covers
both workers, no counter goes down between two scrapes, and the totals equal the ids the clients
received; promtool accepts the exposition (and rejects a broken one)."""

from __future__ import annotations

import itertools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import idmint
from idmint.server.metrics import Exporter
from idmint.server.metrics_sources import Sources

from http_server import ServerProcess
from servers import free_port

Series = tuple[str, tuple[tuple[str, str], ...]]
SYNC_WAIT = 2.5  # a worker copies its counts into the metrics once a second: wait past that


def counters(text: str) -> dict[Series, float]:
    """Every counter sample of an exposition, by name and labels."""
    out: dict[Series, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def decreases(before: dict[Series, float], after: dict[Series, float]) -> list[str]:
    """The counter series that went down, or vanished, from one scrape to the next."""
    return [
        f"{name}{dict(labels)}: {value} -> {after.get((name, labels))}"
        for (name, labels), value in before.items()
        if after.get((name, labels), -1.0) < value
    ]


def test_the_checker_flags_a_counter_that_went_down() -> None:
    # The negative control: two scrapes where a worker's count went missing (106, then 94).
    first = "# TYPE idmint_ids_issued_total counter\nidmint_ids_issued_total 106.0\n"
    second = "# TYPE idmint_ids_issued_total counter\nidmint_ids_issued_total 94.0\n"
    assert decreases(counters(first), counters(second)) == [
        "idmint_ids_issued_total{}: 106.0 -> 94.0"
    ]
    assert decreases(counters(first), counters("")) != []  # a series that vanished
    assert decreases(counters(second), counters(first)) == []


def _sample(text: str, name: str, **labels: str) -> float:
    return counters(text)[name, tuple(sorted(labels.items()))]


def test_every_scrape_covers_every_worker(tmp_path: Path) -> None:
    server = ServerProcess(f"sqlite:///{tmp_path / 'w.db'}", workers=2).start()
    try:
        url = server.url
        assert httpx.post(url + "/v1/keys", json={"name": "w", "step": 50}).status_code == 201
        received: list[int] = []
        stop = threading.Event()
        failures: list[str] = []

        def hammer(n: int) -> None:
            try:
                with httpx.Client(base_url=url, timeout=10) as http:
                    while not stop.is_set():
                        if n % 2:
                            answer = http.get("/api/segment/get/w")
                            assert answer.status_code == 200, answer.text
                            received.append(int(answer.text))
                        else:
                            answer = http.get("/v1/keys/w/ids", params={"count": 20})
                            assert answer.status_code == 200, answer.text
                            received.extend(answer.json()["ids"])
            except Exception as exc:  # shown by the test thread
                failures.append(repr(exc))

        threads = [threading.Thread(target=hammer, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        scrapes: list[tuple[str, dict[Series, float]]] = []
        try:
            deadline = time.monotonic() + 60
            # A new connection per scrape, so the kernel hands them to both workers.
            while len(scrapes) < 60 or len({pid for pid, _ in scrapes}) < 2:
                assert time.monotonic() < deadline, "one worker answered every scrape"
                answer = httpx.get(url + "/metrics", timeout=10)
                assert answer.status_code == 200
                scrapes.append((answer.headers["idmint-pid"], counters(answer.text)))
                time.sleep(0.02)
        finally:
            stop.set()
            for thread in threads:
                thread.join(20)
        assert not failures, failures
        assert len({pid for pid, _ in scrapes}) == 2
        for (_, before), (_, after) in itertools.pairwise(scrapes):
            assert not decreases(before, after)
        issued = [s.get(("idmint_keys_ids_issued_total", ()), 0.0) for _, s in scrapes]
        assert issued[-1] > issued[0]  # it grew while the scrapes went on

        time.sleep(SYNC_WAIT)  # every worker has synced its last counts
        assert len(set(received)) == len(received) > 0
        for _ in range(10):  # whichever worker answers, the same totals
            text = httpx.get(url + "/metrics", timeout=10).text
            assert _sample(text, "idmint_keys_ids_issued_total") == len(received)
            assert _sample(text, "idmint_ids_issued_total", key="w") == len(received)
            handed = sum(
                v for (n, _), v in counters(text).items() if n == "idmint_ids_handed_total"
            )
            assert handed == len(received)
            totals = httpx.get(url + "/v1/stats", timeout=10).json()["totals"]
            assert totals["ids_issued"] == len(received) and totals["workers"] == 2

        # New workers (SIGHUP: granian replaces them gracefully; it stops the whole server when
        # one dies): the old ones' counts stay in the totals (their files stay), and the live
        # gauges are the new workers' only.
        old = {pid for pid, _ in scrapes}
        assert server.proc is not None
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        seen: set[str] = set()
        while len(seen - old) < 2:
            assert time.monotonic() < deadline, f"new workers never answered: {seen}"
            try:
                answer = httpx.get(url + "/metrics", timeout=5)
            except httpx.HTTPError:
                continue
            seen.add(answer.headers["idmint-pid"])
            assert _sample(answer.text, "idmint_keys_ids_issued_total") >= len(received)
        assert _sample(answer.text, "idmint_keys_ids_issued_total") == len(received)
        # The old workers' live gauges go as each finishes its shutdown (mark_process_dead).
        while (workers := httpx.get(url + "/v1/stats", timeout=10).json()["totals"]["workers"]) > 2:
            assert time.monotonic() < deadline, f"{workers} workers' gauges after the restart"
            time.sleep(0.1)
        assert workers == 2
        assert int(httpx.get(url + "/api/segment/get/w").text) > max(received)
    finally:
        server.stop()


def promtool(text: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed: .ci/install installs Debian's prometheus"
    return subprocess.run(
        [binary, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """/metrics of a real two-worker server with keys: plain, bounded, striped, an error."""
    tmp = tmp_path_factory.mktemp("promtool")
    server = ServerProcess(f"sqlite:///{tmp / 'p.db'}", workers=2).start()
    try:
        url = server.url
        for key in (
            {"name": "order", "step": 100},
            {"name": "ticket", "start": 1, "max": 2**31 - 1},
            {"name": "lanes", "stripes": 3},
        ):
            assert httpx.post(url + "/v1/keys", json=key).status_code == 201
        for _ in range(20):
            assert httpx.get(url + "/v1/keys/order/ids", params={"count": 10}).status_code == 200
            assert httpx.get(url + "/api/segment/get/ticket").status_code == 200
            assert httpx.get(url + "/api/segment/get/lanes").status_code == 200
        assert httpx.post(url + "/v1/keys/order/ranges", params={"size": 30}).status_code == 200
        assert httpx.get(url + "/v1/keys/nope/ids").status_code == 404
        time.sleep(SYNC_WAIT)
        return {
            "all": httpx.get(url + "/metrics").text,
            "keys": httpx.get(url + "/metrics", params=[("key", "order"), ("key", "lanes")]).text,
        }
    finally:
        server.stop()


def test_promtool_accepts_the_metrics(exposition: dict[str, str]) -> None:
    text = exposition["all"]
    assert 'idmint_ids_issued_total{key="ticket"} 20.0' in text  # both workers' ids
    assert 'idmint_http_errors_total{route="/v1/keys/{key}/ids",status="404"} 1.0' in text
    assert "idmint_keys_ids_issued_total 240.0" in text
    done = promtool(text)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr
    keys = exposition["keys"]
    assert 'idmint_ids_issued_total{key="order",pid="' in keys and "ticket" not in keys
    done = promtool(keys)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_promtool_rejects_a_broken_exposition(exposition: dict[str, str]) -> None:
    # The negative control: the same text with one family's TYPE line given twice.
    broken = exposition["all"] + "# TYPE idmint_keys_ids_issued_total counter\n"
    assert promtool(broken).returncode != 0
    assert promtool("idmint_bad{key=unquoted} 1\n").returncode != 0


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (("--metrics-keys", "-1"), {}, "metrics_keys must be from 0 to 1000, not -1"),
        ((), {"IDMINT_METRICS_KEYS": "1001"}, "metrics_keys must be from 0 to 1000, not 1001"),
        (("--metrics-keys", "x"), {}, "'x' is not a valid integer"),
    ],
)
def test_a_bad_metrics_keys_is_one_line(
    args: tuple[str, ...], env: dict[str, str], says: str
) -> None:
    run = subprocess.run(
        [
            *(sys.executable, "-m", "idmint", "--store", "memory://", "serve"),
            *("--port", str(free_port()), *args),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
        env={**os.environ, **env},
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert says in run.stderr and run.stderr.count("\n") == 1, run.stderr


def test_the_metrics_directory_is_private_or_the_users(tmp_path: Path) -> None:
    # Private: made for the run, named after the server's pid, removed at exit.
    server = ServerProcess(f"sqlite:///{tmp_path / 'd.db'}", workers=2).start()
    assert server.proc is not None
    try:
        assert httpx.get(server.url + "/metrics").status_code == 200
        [made] = Path(tempfile.gettempdir()).glob(f"idmint-metrics-{server.proc.pid}-*")
        assert {p.name.split("_")[0] for p in made.iterdir()} >= {"counter", "gauge"}
        assert server.terminate() == 0
        assert not made.exists()
    finally:
        server.stop()
    # The user's (PROMETHEUS_MULTIPROC_DIR): a previous run's files go at start, the directory
    # stays at exit. A stale counter file would add its totals (and this one is not even valid).
    own = tmp_path / "prom"
    own.mkdir()
    (own / "counter_1.db").write_bytes(b"\x00" * 64 + b"stale")
    (own / "notes.txt").write_text("not ours")
    env = {"PROMETHEUS_MULTIPROC_DIR": str(own)}
    server = ServerProcess(f"sqlite:///{tmp_path / 'd.db'}", workers=2, env=env).start()
    try:
        assert httpx.post(server.url + "/v1/keys", json={"name": "k"}).status_code == 201
        assert httpx.get(server.url + "/v1/keys/k/ids", params={"count": 5}).status_code == 200
        time.sleep(SYNC_WAIT)
        text = httpx.get(server.url + "/metrics").text
        assert _sample(text, "idmint_keys_ids_issued_total") == 5
        assert not (own / "counter_1.db").exists() and (own / "notes.txt").exists()
        assert server.terminate() == 0
        assert own.is_dir() and any(own.glob("counter_*.db"))
    finally:
        server.stop()


def test_a_runway_gauge_goes_back_to_inf_when_its_key_goes_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A gauge not written keeps its last value: before, a burst's short runway stayed in
    # /metrics (and could keep IdmintKeyRunway* firing) after the key went idle.
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with idmint.connect(f"sqlite:///{tmp_path / 'a.db'}") as minter:
        minter.add_key("k", step=10, max=1000)
        gen = minter.segment("k")
        gen.next_id()
        exporter = Exporter(10)

        def runway(rate: float) -> float:
            src = Sources(
                counts={"k": gen.counts()},
                gens={"k": gen},
                rates={"k": rate},
                rows={"k": minter.key("k")},
                ranges_handed={},
                handed={},
                errors={},
                started=time.time(),
            )
            text = exporter.render(src, {})
            [family] = [
                f
                for f in text_string_to_metric_families(text)
                if f.name == "idmint_key_runway_seconds"
            ]
            return float(family.samples[0].value)

        assert runway(10.0) == minter.key("k").remaining / 10.0
        assert runway(0.0) == math.inf  # the old code left the 10/s runway here
