"""The server as a real subprocess: routes, bad input, shutdown, kill -9, many servers, clients."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import idmint

from checks import assert_unique, assert_within, run_threads
from conftest import aged_sqlite_url
from http_server import ServerProcess
from servers import free_port


def add_key(server: ServerProcess, name: str, **fields: int) -> dict[str, object]:
    response = httpx.post(server.url + "/v1/keys", json={"name": name, **fields})
    assert response.status_code == 201, response.text
    data: dict[str, object] = response.json()
    return data


def test_ids_over_every_route(idmint_server: ServerProcess) -> None:
    url = idmint_server.url
    add_key(idmint_server, "order", start=100_000_000, step=1000)
    first = httpx.get(url + "/api/segment/get/order")
    assert (first.status_code, first.text) == (200, "100000000")
    assert first.headers["content-type"].startswith("text/plain")
    batch = httpx.get(url + "/v1/keys/order/ids", params={"count": 1000}).json()
    assert batch["key"] == "order"
    assert batch["ids"] == list(range(100_000_001, 100_001_001))
    taken = httpx.post(url + "/v1/keys/order/ranges", params={"size": 500}).json()
    assert taken["stop"] - taken["start"] == 500 and taken["step"] == 1000
    default = httpx.post(url + "/v1/keys/order/ranges").json()
    assert default["stop"] - default["start"] == 1000  # the key's step
    ids = [int(httpx.get(url + "/api/segment/get/order").text) for _ in range(50)]
    all_ids = [
        100_000_000,
        *batch["ids"],
        *range(taken["start"], taken["stop"]),
        *range(default["start"], default["stop"]),
        *ids,
    ]
    assert_unique(all_ids)
    keys = httpx.get(url + "/v1/keys").json()["keys"]
    assert [k["name"] for k in keys] == ["order"]
    shown = httpx.get(url + "/v1/keys/order").json()
    assert shown["start"] == 100_000_000
    raised = httpx.post(url + "/v1/keys/order/raise", json={"to": 500_000_000}).json()
    assert raised["next_id"] == 500_000_000


def test_operations_routes(idmint_server: ServerProcess) -> None:
    url = idmint_server.url
    add_key(idmint_server, "ticket", start=1, max=2**31 - 1)
    httpx.get(url + "/v1/keys/ticket/ids", params={"count": 10})
    assert httpx.get(url + "/livez").status_code == 200
    ready = httpx.get(url + "/readyz")
    assert ready.text == f"ready (store {ready.headers['idmint-store']})\n"
    metrics = httpx.get(url + "/metrics").text
    for name in (
        "idmint_ids_issued_total",
        "idmint_allocations_total",
        "idmint_step",
        "idmint_buffer_fill_ratio",
        "idmint_density_ratio",
        "idmint_key_remaining",
    ):
        assert f'{name}{{key="ticket"}}' in metrics, name
    assert 'idmint_ids_issued_total{key="ticket"} 10.0\n' in metrics
    stats = httpx.get(url + "/v1/stats").json()
    [ticket] = stats["keys"]
    assert ticket["bounded"] is True and ticket["generator"]["issued"] == 10
    assert ticket["generator"]["current"]["start"] == 1
    spec = httpx.get(url + "/openapi.json").json()
    assert spec["openapi"].startswith("3.") and "/api/segment/get/{key}" in spec["paths"]
    page = httpx.get(url + "/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert 'src="http' not in page.text and 'href="http' not in page.text  # served offline
    for _ in range(3):  # warm: Leaf's route on the RSGI hot path, which counts too
        assert httpx.get(url + "/api/segment/get/ticket").status_code == 200
    metrics = httpx.get(url + "/metrics").text
    assert 'idmint_ids_handed_total{route="/api/segment/get/{key}"} 3.0\n' in metrics
    assert 'idmint_ids_handed_total{route="/v1/keys/{key}/ids"} 10.0\n' in metrics


def test_the_rate_is_ready_at_the_first_read(idmint_server: ServerProcess) -> None:
    # The server samples every key's issued count once a second on its own, so the very first
    # read of /v1/stats already has a rate (it used to sample only when read: 0/s at first).
    url = idmint_server.url
    add_key(idmint_server, "busy", start=1)
    with httpx.Client(base_url=url) as http:
        deadline = time.monotonic() + 2.5
        drawn = 0
        while time.monotonic() < deadline:
            drawn += len(http.get("/v1/keys/busy/ids", params={"count": 1000}).json()["ids"])
        [busy] = http.get("/v1/stats").json()["keys"]
    rate = busy["generator"]["rate_per_s"]
    assert 0 < rate <= drawn, (rate, drawn)


BAD_REQUESTS = [
    ("GET", "/v1/keys/k/ids?count=0", 400),
    ("GET", "/v1/keys/k/ids?count=-5", 400),
    ("GET", "/v1/keys/k/ids?count=100001", 400),
    ("GET", "/v1/keys/k/ids?count=99999999999999999999999", 400),
    ("GET", "/v1/keys/k/ids?count=abc", 400),
    ("GET", "/v1/keys/k/ids?count=1.5", 400),
    ("GET", "/v1/keys/k/ids?count=", 400),
    ("POST", "/v1/keys/k/ranges?size=0", 400),
    ("POST", "/v1/keys/k/ranges?size=10000001", 400),
    ("POST", "/v1/keys/k/ranges?size=x", 400),
    ("GET", "/api/segment/get/bad%20key", 400),
    ("GET", "/api/segment/get/" + "x" * 200, 400),
    ("GET", "/api/segment/get/", 400),
    ("GET", "/api/segment/get/nope", 404),
    ("GET", "/v1/keys/nope/ids", 404),
    ("POST", "/v1/keys/nope/ranges", 404),
    ("GET", "/no/such/route", 404),
    ("GET", "/v1/keys/k/whatever", 404),
    ("DELETE", "/v1/keys/k/ids", 405),
    ("OPTIONS", "/api/segment/get/k", 405),  # Leaf takes GET, POST, PUT, PATCH, DELETE
    ("GET", "/v1/keys/k/ranges", 405),
    ("PUT", "/livez", 405),
]


@pytest.mark.parametrize(("method", "path", "status"), BAD_REQUESTS)
def test_bad_input_is_4xx_with_a_reason(
    idmint_server: ServerProcess, method: str, path: str, status: int
) -> None:
    add_key(idmint_server, "k")
    response = httpx.request(method, idmint_server.url + path)
    assert response.status_code == status, response.text
    assert response.text.endswith("\n") and response.text.count("\n") == 1
    assert len(response.text) > 5
    assert httpx.get(idmint_server.url + "/api/segment/get/k").status_code == 200


BAD_BODIES = [
    ("/v1/keys", b"not json", 400),
    ("/v1/keys", b"[1, 2]", 400),
    ("/v1/keys", b'{"name": 5}', 400),
    ("/v1/keys", b'{"name": "bad name"}', 400),
    ("/v1/keys", b'{"name": "ok", "step": "big"}', 400),
    ("/v1/keys", b'{"name": "ok", "step": 0}', 400),
    ("/v1/keys", b'{"name": "ok", "start": 10, "max": 5}', 400),
    ("/v1/keys", b'{"name": "ok", "colour": "red"}', 400),
    ("/v1/keys", b'{"name": "ok", "step": true}', 400),
    ("/v1/keys", b'{"name": "k"}', 409),
    ("/v1/keys", b"x" * 70_000, 413),
    ("/v1/keys/k/raise", b'{"to": -1}', 400),
    ("/v1/keys/k/raise", b'{"to": "high"}', 400),
    ("/v1/keys/k/raise", b"{}", 400),
    ("/v1/keys/nope/raise", b'{"to": 5}', 404),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD_BODIES)
def test_bad_bodies(idmint_server: ServerProcess, path: str, body: bytes, status: int) -> None:
    add_key(idmint_server, "k")
    response = httpx.post(idmint_server.url + path, content=body)
    assert response.status_code == status, response.text
    assert response.text.count("\n") == 1


def test_token_guards_admin_only(tmp_path: Path) -> None:
    server = ServerProcess(
        f"sqlite:///{tmp_path / 't.db'}", token="s3cret", admin_loopback=False
    ).start()
    try:
        url = server.url
        assert httpx.get(url + "/v1/keys").status_code == 401
        wrong = {"authorization": "Bearer nope"}
        assert httpx.get(url + "/v1/keys", headers=wrong).status_code == 401
        assert httpx.post(url + "/v1/keys", json={"name": "k"}).status_code == 401
        good = {"authorization": "Bearer s3cret"}
        assert httpx.post(url + "/v1/keys", json={"name": "k"}, headers=good).status_code == 201
        assert httpx.get(url + "/v1/keys", headers=good).status_code == 200
        assert httpx.get(url + "/api/segment/get/k").status_code == 200  # ids need no token
    finally:
        server.stop()


def test_admin_over_http_is_off_without_a_token(tmp_path: Path) -> None:
    # A reverse proxy on the same host makes every client loopback: without a token, admin
    # over HTTP is refused unless the operator opted in with --admin-loopback; the log says so.
    store = f"sqlite:///{tmp_path / 'a.db'}"
    server = ServerProcess(store, admin_loopback=False).start()
    try:
        refused = httpx.post(server.url + "/v1/keys", json={"name": "k"})
        assert refused.status_code == 403 and "--admin-loopback" in refused.text
        assert httpx.get(server.url + "/v1/keys").status_code == 403
        assert "key admin over HTTP refused" in server.log()
    finally:
        server.stop()
    opted = ServerProcess(store, admin_loopback=False, args=["--admin-loopback"]).start()
    try:
        assert httpx.post(opted.url + "/v1/keys", json={"name": "k"}).status_code == 201
        log = opted.log()
        assert "open to loopback clients without a token (--admin-loopback)" in log
        assert "every client is loopback" in log
    finally:
        opted.stop()


def test_json_logs_and_a_token_from_a_file(tmp_path: Path) -> None:
    # --log-format json: every line, the main process's, each worker's and granian's own, is
    # one JSON object with the documented fields. The admin token comes from a file
    # (IDMINT_TOKEN_FILE), not from a command line every user can read in `ps`.
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    server = ServerProcess(
        aged_sqlite_url(tmp_path / "a.db"),
        workers=2,
        admin_loopback=False,
        args=["--log-format", "json"],
        env={"IDMINT_TOKEN_FILE": str(secret)},
    ).start()
    try:
        url = server.url + "/v1/keys"
        assert httpx.post(url, json={"name": "k"}).status_code == 401
        admin = {"Authorization": "Bearer s3cret"}
        assert httpx.post(url, json={"name": "k"}, headers=admin).status_code == 201
        assert server.terminate() == 0
        text = server.log_path.read_text()
    finally:
        server.stop()
    lines = text.splitlines()
    entries = [json.loads(line) for line in lines]  # a line that is not JSON fails here
    assert all({"time", "level", "logger", "message", "pid"} <= set(e) for e in entries)
    assert {e["logger"] for e in entries} >= {"idmint.server", "_granian"}
    assert len({e["pid"] for e in entries}) == 3, lines  # the main process and two workers
    assert sum("unused ids given back" in e["message"] for e in entries) == 2, lines
    assert "s3cret" not in text


def test_a_non_ascii_token_is_refused_at_start() -> None:
    run = subprocess.run(
        [
            *(sys.executable, "-m", "idmint", "--store", "memory://", "serve"),
            *("--token", "t\u00f6k", "--port", str(free_port())),  # not 8080: it may be in use
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "ASCII" in run.stderr


def _worker_pids(server: ServerProcess) -> list[int]:
    """granian's worker processes: the children of the server's main process."""
    assert server.proc is not None
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == server.proc.pid:
            found.append(int(name))
    assert found, "no worker process"
    return found


def _rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def test_a_huge_body_is_refused_as_it_streams(idmint_server: ServerProcess) -> None:
    # The RSGI shell read the whole body before checking its size: a 1 GiB POST took the
    # worker to 2.7 GB. Now it stops reading at 64 KiB. The body is a generator, so this test
    # never holds it either; it stops early (and fails) if the worker starts buffering.
    workers = _worker_pids(idmint_server)
    before = _rss_mib(workers)
    sent = 0

    def body() -> Iterator[bytes]:
        nonlocal sent
        chunk = b"x" * (1 << 20)
        while sent < 1 << 30:
            if sent % (32 << 20) == 0:
                grown = _rss_mib(workers) - before
                assert grown < 200, f"the worker grew {grown:.0f} MiB after {sent >> 20} MiB"
            sent += len(chunk)
            yield chunk

    response = httpx.post(idmint_server.url + "/v1/keys", content=body(), timeout=30)
    assert response.status_code == 413 and "65536" in response.text
    assert sent < 1 << 30
    assert _rss_mib(workers) - before < 50
    assert httpx.get(idmint_server.url + "/livez").status_code == 200


def _open_idle(port: int, count: int) -> list[socket.socket]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count + 512:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 1024), hard))
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]


def test_idle_connections_do_not_stall_the_server(idmint_server: ServerProcess) -> None:
    # 1,030 connections that sent nothing stalled the default server for good: granian held
    # 1,024 per worker (its backpressure counts connections) and waited on them forever.
    idle = _open_idle(idmint_server.port, 1100)
    try:
        started = time.monotonic()
        response = httpx.get(idmint_server.url + "/livez", timeout=10)
        assert response.status_code == 200
        assert time.monotonic() - started < 3
    finally:
        for sock in idle:
            sock.close()


def test_silent_connections_close_after_the_header_timeout(tmp_path: Path) -> None:
    server = ServerProcess(
        f"sqlite:///{tmp_path / 'h.db'}", args=["--header-timeout", "1", "--max-connections", "50"]
    ).start()
    try:
        kept = socket.create_connection(("127.0.0.1", server.port))
        kept.sendall(b"GET /livez HTTP/1.1\r\nHost: idmint\r\n\r\n")
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        silent = _open_idle(server.port, 120)  # more than one worker holds
        started = time.monotonic()
        # A fresh request gets through once the silent ones time out, a batch a second.
        assert httpx.get(server.url + "/livez", timeout=20).status_code == 200
        assert time.monotonic() - started < 10
        for sock in [kept, *silent]:
            sock.settimeout(10)
            assert sock.recv(1) == b""  # closed by the server
            sock.close()
        assert time.monotonic() - started < 15
        assert "up to 50 connections per worker" in server.log()
    finally:
        server.stop()


def test_schemathesis_finds_no_5xx(idmint_server: ServerProcess, tmp_path: Path) -> None:
    add_key(idmint_server, "k")
    add_key(idmint_server, "order", max=2**31 - 1)
    run = subprocess.run(
        [
            str(Path(sys.executable).with_name("schemathesis")),
            "run",
            idmint_server.url + "/openapi.json",
            # Every check but "schema-valid data must be accepted": the schema cannot say
            # that max must not be below start, so such keys are rightly refused with a 400.
            "--checks=all",
            "--exclude-checks=positive_data_acceptance",
            "--max-examples=8",
            "--seed",
            "1",
            "--request-timeout",
            "10",
            "--report",
            "junit",
            "--report-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert httpx.get(idmint_server.url + "/livez").status_code == 200


def held_ranges(server: ServerProcess, key: str) -> list[tuple[int, int]]:
    stats = httpx.get(server.url + "/v1/stats").json()
    [entry] = [k for k in stats["keys"] if k["name"] == key]
    gen = entry["generator"]
    return [(r["start"], r["stop"]) for r in (gen["current"], gen["next"]) if r]


def test_graceful_shutdown_gives_tails_back(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 's.db'}"
    server = ServerProcess(store).start()
    add_key(server, "g", start=1000, step=1000)
    ids = httpx.get(server.url + "/v1/keys/g/ids", params={"count": 150}).json()["ids"]
    deadline = time.monotonic() + 5
    while len(held_ranges(server, "g")) < 2:  # the next range is loaded too
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert server.terminate() == 0
    assert "unused ids given back" in server.log()
    with idmint.connect(store) as minter:
        assert minter.key("g").max_id == ids[-1] + 1


def test_kill_9_loses_at_most_the_ranges_it_held(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'k.db'}"
    server = ServerProcess(store).start()
    add_key(server, "k9", start=1, step=100)
    ids = httpx.get(server.url + "/v1/keys/k9/ids", params={"count": 250}).json()["ids"]
    held = held_ranges(server, "k9")
    server.kill()
    with idmint.connect(store) as minter:
        counter = minter.key("k9").max_id
    lost = counter - (ids[-1] + 1)
    assert lost <= sum(stop - start for start, stop in held)
    again = ServerProcess(store).start()
    try:
        more = httpx.get(again.url + "/v1/keys/k9/ids", params={"count": 100}).json()["ids"]
    finally:
        again.stop()
    assert more[0] == counter
    assert_unique(ids + more)


@pytest.mark.slow
def test_three_servers_one_postgres_300k_ids(
    postgres: object, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("postgres").create_database("three_servers")
    with idmint.connect(url) as minter:
        minter.add_key("shared", step=1000, start=1, max=2**31 - 1)
    servers = [ServerProcess(url).start() for _ in range(3)]
    got: list[list[int]] = []
    lock = threading.Lock()
    turn = iter(range(6))

    def client_work() -> None:
        index = next(turn)
        server = servers[index % 3]
        mine: list[int] = []
        with idmint.Client(server.url) as client:
            gen = client.segment("shared")
            mine += gen.next_ids(40_000)
            mine += [gen.next_id() for _ in range(5_000)]
        with httpx.Client(base_url=server.url) as http:
            for _ in range(20):  # the server's own routes too, 5,000 ids per client
                mine += http.get("/v1/keys/shared/ids", params={"count": 240}).json()["ids"]
                mine += [int(http.get("/api/segment/get/shared").text) for _ in range(10)]
        with lock:
            got.append(mine)

    try:
        run_threads(client_work, 6)
    finally:
        for server in servers:
            server.stop()
    ids = [i for chunk in got for i in chunk]
    assert assert_unique(ids) == 300_000
    assert_within(ids, 1, 2**31 - 1)


def test_client_fails_over_when_a_server_stops(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'f.db'}"
    a, b = ServerProcess(store).start(), ServerProcess(store).start()
    add_key(a, "f", step=50)
    options = idmint.SegmentOptions(max_step=50, wait=5.0)
    ids: list[int] = []
    try:
        with idmint.Client([a.url, b.url], segment_options=options) as client:
            gen = client.segment("f")
            ids += gen.next_ids(500)
            a.kill()  # mid-stream: the client was talking to a
            for _ in range(30):
                ids += gen.next_ids(100)
    finally:
        b.stop()
    assert len(ids) == 3500
    assert_unique(ids)


def test_async_client(idmint_server: ServerProcess) -> None:
    import asyncio

    add_key(idmint_server, "a")

    async def main() -> list[int]:
        async with idmint.AsyncClient(idmint_server.url) as client:
            seg = client.segment("a")
            return [await seg.next_id() for _ in range(3000)] + await seg.next_ids(2000)

    ids = asyncio.run(main())
    assert assert_unique(ids) == 5000


def test_client_errors_are_typed(idmint_server: ServerProcess) -> None:
    add_key(idmint_server, "tiny", max=3)
    with idmint.Client(idmint_server.url) as client:
        with pytest.raises(idmint.KeyNotFound):
            client.segment("nope").next_id()
        assert client.segment("tiny").next_ids(3) == [1, 2, 3]
        with pytest.raises(idmint.Exhausted):
            client.segment("tiny").next_id()
    with (
        idmint.Client("http://127.0.0.1:9", timeout=0.5) as dead,
        pytest.raises(idmint.StoreUnavailable),
    ):
        dead.take("x", 5)
    with pytest.raises(ValueError, match="bad server URL"):
        idmint.Client("localhost:8080")


def test_serve_with_a_bad_store_is_one_line() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "idmint", "--store", "nope://x", "serve"],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "bad store URL" in run.stderr


def test_a_second_server_on_a_served_port_is_refused(tmp_path: Path) -> None:
    # granian binds with SO_REUSEPORT: a second server on the same port used to start silently
    # and share the connections; with another store that repeats ids.
    first = ServerProcess(f"sqlite:///{tmp_path / 'one.db'}").start()
    try:
        # Its own process group: a server that does start (the bug) must not outlive the test.
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "idmint", "--store", f"sqlite:///{tmp_path / 'two.db'}"),
                *("serve", "--port", str(first.port)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        second = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        assert second.returncode == 2, second.stderr
        assert second.stderr.startswith("idmint: error: ") and second.stderr.count("\n") == 1
        assert f"port {first.port}" in second.stderr and "--reuse-port" in second.stderr
        # Asked for, sharing still works.
        shared = ServerProcess(
            f"sqlite:///{tmp_path / 'one.db'}", port=first.port, args=["--reuse-port"]
        ).start()
        try:
            # /livez answered by either server: wait for this one's own start-up log.
            deadline = time.monotonic() + 20
            while "Started worker" not in shared.log():
                assert time.monotonic() < deadline, shared.log()
                time.sleep(0.05)
            assert "--reuse-port" in shared.log()
            assert shared.proc is not None and shared.proc.poll() is None
        finally:
            shared.stop()
    finally:
        first.stop()


def test_config_file(tmp_path: Path) -> None:
    conf = tmp_path / "idmint.toml"
    conf.write_text('[server]\nport = "not a port"\n')
    run = subprocess.run(
        [sys.executable, "-m", "idmint", "serve", "--config", str(conf)],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert run.returncode == 2 and "port" in run.stderr and run.stderr.count("\n") == 1


def test_workers_share_the_store(tmp_path: Path) -> None:
    server = ServerProcess(f"sqlite:///{tmp_path / 'w.db'}", workers=2).start()
    try:
        add_key(server, "w", step=100)
        ids: list[int] = []
        # No keep-alive: a new connection each time, so both workers answer.
        fresh = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(base_url=server.url, limits=fresh) as http:
            for _ in range(400):
                ids.append(int(http.get("/api/segment/get/w").text))
                ids += http.get("/v1/keys/w/ids", params={"count": 7}).json()["ids"]
            pids = {http.get("/v1/stats").json()["server"]["pid"] for _ in range(30)}
    finally:
        assert server.terminate() == 0
    assert assert_unique(ids) == 3200
    assert len(pids) == 2


def test_readyz_follows_the_store_and_warm_buffers(request: pytest.FixtureRequest) -> None:
    postgres = request.getfixturevalue("postgres")
    url = postgres.create_database("readyz")
    with idmint.connect(url) as minter:
        minter.add_key("warm", step=100)
    server = ServerProcess(url).start()
    try:
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.05)
        # Warm before any request: the key's first range is already loaded.
        [warm] = httpx.get(server.url + "/v1/stats").json()["keys"]
        assert warm["generator"]["next"] is not None
        postgres.stop()
        try:
            down = httpx.get(server.url + "/readyz", timeout=10)
            assert down.status_code == 503 and "store" in down.text
            assert httpx.get(server.url + "/livez").status_code == 200
            ids = httpx.get(server.url + "/v1/keys/warm/ids", params={"count": 50}).json()["ids"]
            assert len(ids) == 50  # buffered ids keep coming with the store down
        finally:
            postgres.start()
        deadline = time.monotonic() + 15
        while httpx.get(server.url + "/readyz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "not ready again after the store came back"
            time.sleep(0.1)
    finally:
        server.stop()


def _timed(method: str, url: str, **kwargs: object) -> tuple[int | None, float]:
    """(status, seconds) of one request; status None when it got no answer in 20 s."""
    started = time.monotonic()
    try:
        status: int | None = httpx.request(method, url, timeout=20, **kwargs).status_code  # type: ignore[arg-type]
    except httpx.HTTPError:
        status = None
    return status, time.monotonic() - started


def _warm_server(
    request: pytest.FixtureRequest, name: str, **env: str
) -> tuple[object, str, ServerProcess]:
    postgres = request.getfixturevalue("postgres")
    url = postgres.create_database(name)
    with idmint.connect(url) as minter:
        minter.add_key("warm", step=100_000)
    server = ServerProcess(url, env=env).start()
    deadline = time.monotonic() + 15
    while httpx.get(server.url + "/readyz").status_code != 200:
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.05)
    return postgres, url, server


def test_a_hung_store_holds_up_no_route(request: pytest.FixtureRequest) -> None:
    # PostgreSQL SIGSTOPped, its sockets open: store reads used to fill the shared default
    # executor, and then every route that needs a thread hung without bound.
    postgres, _, server = _warm_server(request, "hung_routes")
    url = server.url
    try:
        postgres.pause()  # type: ignore[attr-defined]
        try:
            # Readiness answers 503 with a reason, within the store timeout (2 s) and some slack.
            response = httpx.get(url + "/readyz", timeout=20)
            assert response.status_code == 503, response.text
            assert response.text.count("\n") == 1 and "store" in response.text
            for path in ("/readyz", "/api/segment/get/nope", "/v1/keys"):
                status, took = _timed("GET", url + path)
                assert status == 503, (path, status)
                assert took < 6, (path, took)
            # Metrics and stats read no store (the keys' rows as last read): they answer, at
            # once, while it hangs; an outage is when they matter most.
            for path in ("/metrics", "/v1/stats"):
                status, took = _timed("GET", url + path)
                assert status == 200 and took < 1, (path, status, took)
            stop = threading.Event()
            outcomes: list[int | None] = []

            def flood() -> None:  # readiness, metrics, stats and admin, as hard as they can
                paths = ["/readyz", "/metrics", "/v1/stats", "/v1/keys", "/api/segment/get/x1"]
                with httpx.Client(base_url=url, timeout=20) as http:
                    while not stop.is_set():
                        for path in paths:
                            try:
                                outcomes.append(http.get(path).status_code)
                            except httpx.HTTPError:
                                outcomes.append(None)

            flooders = [threading.Thread(target=flood) for _ in range(24)]
            for thread in flooders:
                thread.start()
            try:
                slowest = 0.0
                ids: list[int] = []
                with httpx.Client(base_url=url, timeout=20) as http:
                    for _ in range(100):  # warm keys keep answering from their buffers
                        started = time.monotonic()
                        ids.append(int(http.get("/api/segment/get/warm").text))
                        ids += http.get("/v1/keys/warm/ids", params={"count": 10}).json()["ids"]
                        slowest = max(slowest, time.monotonic() - started)
                        time.sleep(0.02)
                assert slowest < 1.0, slowest
                assert assert_unique(ids) == 1100
                status, took = _timed("GET", url + "/api/segment/get/nope2")
                assert status in (503, 404) and took < 6, (status, took)
            finally:
                stop.set()
                for thread in flooders:
                    thread.join(30)
            assert outcomes and None not in outcomes  # every request got an answer
            assert set(outcomes) <= {200, 503}, set(outcomes)  # 200: metrics and stats
        finally:
            postgres.resume()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 20
        while httpx.get(url + "/readyz", timeout=20).status_code != 200:
            assert time.monotonic() < deadline, "not ready again after the store came back"
            time.sleep(0.1)
        assert httpx.get(url + "/api/segment/get/nope").status_code == 404
    finally:
        server.stop()


def test_sigterm_exits_within_the_shutdown_timeout_on_a_hung_store(
    request: pytest.FixtureRequest,
) -> None:
    # From the environment, which older versions ignored: they waited for the store forever.
    postgres, _, server = _warm_server(request, "hung_stop", IDMINT_SHUTDOWN_TIMEOUT="3")
    try:
        httpx.get(server.url + "/v1/keys/warm/ids", params={"count": 10})
        postgres.pause()  # type: ignore[attr-defined]
        try:
            assert server.proc is not None
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            try:
                code = server.proc.wait(3 + 4)
            except subprocess.TimeoutExpired:
                server.kill()
                pytest.fail(f"SIGTERM took over 7 s with a hung store: {server.log()}")
            took = time.monotonic() - started
        finally:
            postgres.resume()  # type: ignore[attr-defined]
        assert code == 0, server.log()
        assert took < 7
        assert "did not answer within" in server.log()
    finally:
        server.stop()


def test_the_client_token_on_a_real_server(tmp_path: Path) -> None:
    server = ServerProcess(
        f"sqlite:///{tmp_path / 'ct.db'}", token="adm", args=["--client-token", "cli"]
    ).start()
    try:
        url = server.url
        admin = {"authorization": "Bearer adm"}
        made = httpx.post(url + "/v1/keys", json={"name": "k", "step": 100}, headers=admin)
        assert made.status_code == 201
        good = {"authorization": "Bearer cli"}
        assert httpx.get(url + "/api/segment/get/k", headers=good).status_code == 200
        # Warm now: the RSGI hot path checks the token too, in any spelling of the scheme.
        assert httpx.get(url + "/api/segment/get/k").status_code == 401
        assert (
            httpx.get(url + "/api/segment/get/k", headers={"authorization": "x"}).status_code == 401
        )
        lower = {"authorization": "bearer   cli"}
        assert httpx.get(url + "/api/segment/get/k", headers=lower).status_code == 200
        assert httpx.get(url + "/api/segment/get/k", headers=admin).status_code == 200
        with idmint.Client(url, token="cli") as client:
            assert len(set(client.segment("k").next_ids(300))) == 300
        with (
            idmint.Client(url) as anonymous,
            pytest.raises(idmint.InvalidArgument, match="client token"),
        ):
            anonymous.take("k", 5)
        assert "key admin over HTTP needs the admin token" in server.log()
    finally:
        server.stop()


def test_a_32_bit_key_cannot_be_burned(idmint_server: ServerProcess) -> None:
    # 215 requests of size=10000000 used to take every id of a 32-bit key, for good.
    url = idmint_server.url
    add_key(idmint_server, "ticket", max=2**31 - 1)
    refused = httpx.post(url + "/v1/keys/ticket/ranges", params={"size": 10_000_000})
    assert refused.status_code == 400 and "cap of 100000" in refused.text
    with idmint.connect(idmint_server.store_url) as minter:
        assert minter.key("ticket").remaining == 2**31 - 1  # nothing taken


def test_clients_keep_within_the_cap(idmint_server: ServerProcess) -> None:
    # A client's dynamic step grows past a small cap, and an admin lowers the cap while it
    # runs: the client asks within the cap the server names, and never fails for it.
    url = idmint_server.url
    add_key(idmint_server, "c", step=50)
    assert httpx.patch(url + "/v1/keys/c", json={"max_batch": 120}).status_code == 200
    options = idmint.SegmentOptions(max_step=100_000)
    ids: list[int] = []
    with idmint.Client(url, segment_options=options) as client:
        gen = client.segment("c")
        ids += gen.next_ids(1000)  # steps 50, 100, then 120 at most
        assert httpx.patch(url + "/v1/keys/c", json={"max_batch": 60}).status_code == 200
        ids += gen.next_ids(1000)
        assert len(client.take("c", 1000)) == 60
    assert assert_unique(ids) == 2000
    with idmint.connect(idmint_server.store_url) as minter:
        # Every range the client took was within the cap in force: no id burned beyond it.
        assert minter.key("c").max_id - 1 <= max(ids) + 60 + 120 * 2


def test_clients_on_a_striped_key(idmint_server: ServerProcess) -> None:
    # stripe k hands out 1 + k, 5 + k, 9 + k, ...: a client's generator serves from its stripe.
    url = idmint_server.url
    made = add_key(idmint_server, "s", step=50, stripes=4)
    assert made["stripes"] == 4 and made["stripe_next"] == [1, 2, 3, 4]
    pinned = idmint.SegmentOptions(stripe=2)
    with idmint.Client(url, segment_options=pinned) as client:
        gen = client.segment("s")
        ids = gen.next_ids(120)  # three ranges of stripe 2 (the step grows: 50, 100)
        assert ids == list(range(3, 3 + 120 * 4, 4))
        stats = gen.stats()
        assert (stats.stripe, stats.stripes) == (2, 4)
        assert stats.current is not None and stats.current.stride == 4
        taken = client.take("s", 10, stripe=1)
        assert taken == idmint.Range(2, 42, 4) and list(taken)[:2] == [2, 6]
        anywhere = client.take("s", 10)  # the store's choice, a strided range all the same
        assert anywhere.stride == 4 and len(anywhere) == 10
        with pytest.raises(idmint.InvalidArgument, match="the key has 4 stripes"):
            client.take("s", 5, stripe=4)
    with idmint.Client(url) as client:
        spread = client.segment("s")
        more = spread.next_ids(300)
        assert spread.stats().stripes == 4
        assert len({i % 4 for i in more[:50]}) == 1  # one range: one stripe
    assert_unique([*ids, *taken, *anywhere, *more])
    with idmint.connect(idmint_server.store_url) as minter:
        assert minter.key("s").stripes == 4


def test_client_generators_move_off_exhausted_stripes(idmint_server: ServerProcess) -> None:
    # 40 ids on 4 stripes of 10: a generator pinned to stripe 1 drains it, is told (410 with
    # the stripe) and moves on, until the whole key is gone.
    add_key(idmint_server, "few", step=3, max=40, stripes=4)
    options = idmint.SegmentOptions(stripe=1, retry_after=0)
    with idmint.Client(idmint_server.url, segment_options=options) as client:
        assert list(client.take("few", 20, stripe=1)) == list(range(2, 41, 4))  # shorter
        with pytest.raises(idmint.Exhausted) as spent:
            client.take("few", 1, stripe=1)
        assert (spent.value.stripe, spent.value.stripes, spent.value.last_id) == (1, 4, 40)
        assert str(spent.value) == (
            "stripe 1 of key 'few' is exhausted: every id up to its maximum 40 is used"
        )
        gen = client.segment("few")
        ids = []
        with pytest.raises(idmint.Exhausted) as gone:
            while True:
                ids.append(gen.next_id())
        assert gone.value.stripe is None and "key 'few' is exhausted" in str(gone.value)
    assert sorted(ids) == [i for i in range(1, 41) if i % 4 != 2]  # the other stripes' ids


def test_clients_share_a_striped_key(idmint_server: ServerProcess) -> None:
    add_key(idmint_server, "busy", step=20, stripes=3, max=2**31 - 1)
    got: list[int] = []
    lock = threading.Lock()

    def work() -> None:
        with idmint.Client(idmint_server.url) as client:
            mine = client.segment("busy").next_ids(2000)
        with lock:
            got.extend(mine)

    run_threads(work, 6)
    assert assert_unique(got) == 12_000
    assert_within(got, 1, 2**31 - 1)


def test_serve_starts_with_its_store_down_and_becomes_ready_when_it_answers() -> None:
    """On main `serve` exited 1 when the store was down at start: under systemd or Kubernetes
    a restart loop. Now it starts, answers not-ready saying why, and becomes ready (and serves)
    once the store answers."""
    from server_redis import RedisServer

    redis = RedisServer()  # made, not started: its port refuses connections
    url = f"redis://127.0.0.1:{redis.port}/0?prefix=down"
    server = ServerProcess(url, args=["--timeout", "0.5"]).start()
    try:
        assert httpx.get(server.url + "/livez").status_code == 200
        probe = httpx.get(server.url + "/readyz", timeout=10)
        assert probe.status_code == 503 and "not reachable" in probe.text, probe.text
        assert str(redis.port) in probe.text or "refused" in probe.text.lower(), probe.text
        assert "does not answer at start" in server.log()
        redis.start()
        with idmint.connect(url) as minter:
            minter.add_key("order")
        deadline = time.monotonic() + 20
        while httpx.get(server.url + "/readyz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        assert httpx.get(server.url + "/api/segment/get/order").text == "1"
    finally:
        server.stop()
        redis.close()


def test_async_client_take_leaves_the_event_loop_running() -> None:
    """On main AsyncClient.take() blocked the event loop for the whole request (and the docs
    showed an AsyncClient.close() that did not exist)."""
    import asyncio

    from server_redis import RedisServer

    redis = RedisServer()
    redis.start()
    url = f"redis://127.0.0.1:{redis.port}/0?prefix=async"
    with idmint.connect(url) as minter:
        minter.add_key("order")
    server = ServerProcess(url, args=["--timeout", "1"]).start()
    try:

        async def main() -> tuple[int, BaseException | None]:
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            client = idmint.AsyncClient(server.url, timeout=5)
            assert len(await client.take("order", 5)) == 5
            redis.pause()  # every request now waits for the store: a second or so
            error = None
            try:
                await client.take("order", 5)
            except idmint.IdmintError as exc:
                error = exc
            ticker.cancel()
            redis.resume()
            await client.close()
            return ticks, error

        ticks, error = asyncio.run(main())
        assert isinstance(error, idmint.StoreUnavailable) or error is None, error
        assert ticks >= 20, ticks  # the loop ran on while the request waited
    finally:
        server.stop()
        redis.close()
