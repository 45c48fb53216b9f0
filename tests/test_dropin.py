"""The drop-in routes for tinyid's and CosId's callers (server/dropin.py), and Leaf's decode:
their exact wire formats, their errors, and clients that consume their segments exactly as
the peers' Java clients do, never seeing an id twice beside idmint's own routes."""

from __future__ import annotations

import itertools
import threading
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from idmint.server import App, ServerConfig

from checks import assert_unique, run_threads
from conftest import aged_sqlite_url
from http_server import ServerProcess
from test_app import call

# -- the peers' clients, as their source does it ---------------------------------------------


def _java_rem(a: int, b: int) -> int:
    """Java's `%`: the remainder takes the dividend's sign."""
    r = abs(a) % b
    return -r if a < 0 else r


class TinyIdSegment:
    """tinyid-base entity/SegmentId.java, as HttpSegmentIdServiceImpl builds it from a
    `currentId,loadingId,maxId,delta,remainder` answer: init() moves currentId to a number
    congruent to remainder (less one delta), nextId() adds delta and is OVER past maxId."""

    NORMAL, LOADING, OVER = 1, 2, 3  # entity/ResultCode.java

    def __init__(self, answer: str) -> None:
        parts = answer.split(",")
        self.current = int(parts[0])
        self.loading_id = int(parts[1])
        self.max_id = int(parts[2])
        self.delta = int(parts[3])
        self.remainder = int(parts[4])
        self.is_init = False

    def init(self) -> None:
        if self.is_init:
            return
        if _java_rem(self.current, self.delta) == self.remainder:
            self.is_init = True
            return
        for _ in range(self.delta + 1):
            self.current += 1
            if _java_rem(self.current, self.delta) == self.remainder:
                self.current -= self.delta
                self.is_init = True
                return

    def next_id(self) -> tuple[int, int]:
        self.init()
        self.current += self.delta
        i = self.current
        if i > self.max_id:
            return self.OVER, i
        return (self.LOADING if i >= self.loading_id else self.NORMAL), i


def tinyid_drain(answer: str) -> list[int]:
    """Every id a tinyid client hands out of one segment answer (until it is OVER)."""
    segment, ids = TinyIdSegment(answer), list[int]()
    while True:
        code, i = segment.next_id()
        if code == TinyIdSegment.OVER:
            return ids
        ids.append(i)


def cosid_drain(max_id: int, step: int) -> list[int]:
    """Every id of CosId's DefaultIdSegment(maxId, step): sequence from offset = maxId - step,
    incrementAndGet until it passes maxId."""
    sequence, ids = max_id - step, list[int]()
    while (sequence := sequence + 1) <= max_id:
        ids.append(sequence)
    return ids


# -- wire formats, in-process ----------------------------------------------------------------


@pytest.fixture
def app(tmp_path: Path) -> App:
    made = App(ServerConfig(store=aged_sqlite_url(tmp_path / "dropin.db"), admin_loopback=True))
    assert call(made, "POST", "/v1/keys", json={"name": "t", "start": 1, "step": 10}).is_success
    striped = {"name": "s", "start": 1, "step": 10, "stripes": 3}
    assert call(made, "POST", "/v1/keys", json=striped).is_success
    return made


def test_tinyid_wire_formats(app: App) -> None:
    # A segment is a fresh range of the key's step (10 ids); the first, 1..10.
    segment = call(app, "POST", "/tinyid/id/nextSegmentId?bizType=t")
    assert segment.headers["content-type"] == "application/json"
    assert segment.json() == {
        "data": {"maxId": 10, "loadingId": 2, "currentId": 0, "delta": 1, "remainder": 0},
        "code": 200,
        "message": "",
    }
    answer = call(app, "POST", "/tinyid/id/nextSegmentIdSimple?bizType=t").text
    assert answer == "10,12,20,1,0" and tinyid_drain(answer) == list(range(11, 21))
    ids = call(app, "GET", "/tinyid/id/nextId?bizType=t&batchSize=3")
    assert ids.headers["content-type"] == "application/json"
    assert ids.text == '{"data":[21,22,23],"code":200,"message":""}'
    simple = call(app, "POST", "/tinyid/id/nextIdSimple?bizType=t&batchSize=3")
    assert simple.headers["content-type"].startswith("text/plain") and simple.text == "24,25,26"
    assert call(app, "GET", "/tinyid/id/nextIdSimple?bizType=t").text == "27"
    # A striped key's range has stride 3: delta 3, remainder the range's residue.
    striped = call(app, "GET", "/tinyid/id/nextSegmentIdSimple?bizType=s").text
    assert striped == "0,6,28,3,1" and tinyid_drain(striped) == list(range(1, 29, 3))
    data = call(app, "GET", "/tinyid/id/nextSegmentId?bizType=s").json()["data"]
    assert data["delta"] == 3 and data["remainder"] in (0, 1, 2)
    answer = ",".join(
        str(data[f]) for f in ("currentId", "loadingId", "maxId", "delta", "remainder")
    )
    drained = tinyid_drain(answer)
    assert len(drained) == 10 and {i % 3 for i in drained} == {data["remainder"]}
    metrics = call(app, "GET", "/metrics").text
    assert 'idmint_ids_handed_total{route="/tinyid/id/nextIdSimple"} 4' in metrics
    assert 'idmint_ids_handed_total{route="/tinyid/id/nextSegmentIdSimple"} 20' in metrics


TINYID_ERRORS = [
    ("nextId?bizType=t&batchSize=0", 400, 6),
    ("nextId?bizType=t&batchSize=100001", 400, 6),
    ("nextId?bizType=t&batchSize=ten", 400, 6),
    ("nextId?batchSize=2", 400, 6),
    ("nextId?bizType=bad%20name", 400, 6),
    ("nextId?bizType=nope", 200, 6),  # tinyid: "can not find biztype", HTTP 200
    ("nextSegmentId?bizType=nope", 200, 6),
    ("nextIdSimple?bizType=t&batchSize=0", 400, None),
    ("nextIdSimple?bizType=t&batchSize=100001", 400, None),
    ("nextIdSimple?bizType=t&batchSize=x", 400, None),
    ("nextIdSimple?bizType=nope", 404, None),
    ("nextSegmentIdSimple?bizType=nope", 404, None),
    ("nextSegmentIdSimple", 400, None),
]


@pytest.mark.parametrize(("path", "status", "code"), TINYID_ERRORS)
def test_tinyid_errors(app: App, path: str, status: int, code: int | None) -> None:
    for method in ("GET", "POST"):
        response = call(app, method, "/tinyid/id/" + path)
        assert response.status_code == status, response.text
        if code is None:  # the plain forms: idmint's one-line reason
            assert response.text.count("\n") == 1 and len(response.text) > 5
        else:
            body = response.json()
            assert set(body) == {"data", "code", "message"}
            assert body["data"] is None and body["code"] == code and body["message"]
    assert call(app, "GET", "/tinyid/id/nextIdSimple?bizType=t").status_code == 200


def test_cosid_wire_formats_and_errors(app: App) -> None:
    # nextMaxId: a fresh range of step ids (1..5), answered as its last id; the client's
    # (maxId - step, maxId] is that range.
    max_id = call(app, "PATCH", "/segments/app/t?step=5")
    assert max_id.headers["content-type"] == "application/json" and max_id.text == "5"
    assert cosid_drain(5, 5) == [1, 2, 3, 4, 5]
    one = call(app, "GET", "/ids/t")
    assert one.headers["content-type"] == "application/json" and one.text == "6"
    made = call(app, "POST", "/segments/distributor/app/t?offset=0&step=5")
    assert (made.status_code, made.text) == (200, "")
    errors = [
        ("GET", "/ids/nope", 404),
        ("PATCH", "/segments/app/t", 400),
        ("PATCH", "/segments/app/t?step=0", 400),
        ("PATCH", "/segments/app/t?step=many", 400),
        ("PATCH", "/segments/app/s?step=5", 400),  # striped: not consecutive ids
        ("PATCH", "/segments/a%20b/t?step=5", 400),
        ("PATCH", "/segments/app/nope?step=5", 404),
        ("POST", "/segments/distributor/app/nope?offset=0&step=5", 404),
        ("POST", "/segments/distributor/app/t?offset=-1&step=5", 400),
        ("POST", "/segments/distributor/app/t?offset=%C2%B2&step=5", 400),  # "²": isdigit()
        ("POST", "/segments/distributor/app/t?offset=1000&step=5", 409),  # ids below it
    ]
    for method, path, status in errors:
        response = call(app, method, path)
        assert response.status_code == status, (path, response.text)
        body = response.json()  # CosId's ErrorResponse
        assert body["code"] == str(status) and body["msg"] and body["errors"] == []
    assert call(app, "GET", "/segments/app/t?step=5").status_code == 405
    metrics = call(app, "GET", "/metrics").text
    assert 'idmint_ids_handed_total{route="/segments/{namespace}/{key}"} 5' in metrics
    assert 'idmint_http_errors_total{route="/segments/{namespace}/{key}",status="400"} 5' in metrics


def test_cosid_segment_of_a_bounded_key_is_whole_or_refused(app: App) -> None:
    assert call(app, "POST", "/v1/keys", json={"name": "b", "start": 1, "max": 12}).is_success
    assert call(app, "PATCH", "/segments/app/b?step=5").text == "5"
    assert call(app, "PATCH", "/segments/app/b?step=5").text == "10"
    # Two ids left: a shorter range would make the client count back into 6..10.
    short = call(app, "PATCH", "/segments/app/b?step=5")
    assert short.status_code == 410 and "fewer than 5" in short.json()["msg"]


def test_leaf_decode_shape(app: App) -> None:
    one = int(call(app, "GET", "/api/snowflake/get/any").text)
    decoded = call(app, "GET", f"/v1/snowflake/decode/{one}").json()
    leaf = call(app, "GET", f"/decodeSnowflakeId?snowflakeId={one}")
    assert leaf.status_code == 200 and leaf.headers["content-type"] == "application/json"
    ms = decoded["unix_ms"]
    local = datetime.fromtimestamp(ms // 1000).strftime("%Y-%m-%d %H:%M:%S")
    # LeafMonitorController.decodeSnowflakeId: three strings, the time in the server's zone.
    assert leaf.json() == {
        "timestamp": f"{ms}({local}.{ms % 1000:03d})",
        "workerId": str(decoded["worker"]),
        "sequenceId": str(decoded["sequence"]),
    }
    for bad in ("abc", "-1", "", "99999999999999999999"):
        answer = call(app, "GET", f"/decodeSnowflakeId?snowflakeId={bad}")
        assert answer.status_code == 200, bad  # Leaf answers its errorMsg with a 200
        assert list(answer.json()) == ["errorMsg"] and answer.json()["errorMsg"]
    assert call(app, "GET", "/decodeSnowflakeId").status_code == 400  # Spring's: required
    app.shutdown()


# -- a real server: tokens, and uniqueness under concurrent clients --------------------------


def test_tinyid_token_on_a_real_server(tmp_path: Path) -> None:
    server = ServerProcess(
        f"sqlite:///{tmp_path / 'tok.db'}", token="adm", args=["--client-token", "cli"]
    ).start()
    try:
        url = server.url + "/tinyid/id/"
        admin = {"authorization": "Bearer adm"}
        assert httpx.post(server.url + "/v1/keys", json={"name": "k"}, headers=admin).is_success
        token_error = {"data": None, "code": 5, "message": "token is error"}
        for query in ("bizType=k", "bizType=k&token=wrong", "bizType=k&token="):
            for form in ("nextId", "nextSegmentId"):
                answer = httpx.get(url + form + "?" + query)
                assert (answer.status_code, answer.json()) == (200, token_error), query
            for form in ("nextIdSimple", "nextSegmentIdSimple"):
                assert httpx.post(url + form + "?" + query).status_code == 401, query
        for token in ("cli", "adm"):
            ok = httpx.get(url + "nextId", params={"bizType": "k", "token": token}).json()
            assert ok["code"] == 200 and len(ok["data"]) == 1
        bearer = httpx.get(url + "nextIdSimple?bizType=k", headers={"authorization": "Bearer cli"})
        assert bearer.status_code == 200 and bearer.text.isdigit()
        # CosId's routes take the client token as idmint's own routes do: a bearer header.
        assert httpx.get(server.url + "/ids/k?token=cli").status_code == 401
        assert httpx.get(server.url + "/ids/k", headers=admin).status_code == 200
    finally:
        server.stop()


def test_peer_clients_beside_idmint_routes_never_share_an_id(
    idmint_server: ServerProcess,
) -> None:
    url = idmint_server.url
    for made in ({"name": "plain", "step": 20}, {"name": "striped", "step": 20, "stripes": 4}):
        assert httpx.post(url + "/v1/keys", json=made).status_code == 201
    seen: dict[str, list[int]] = {"plain": [], "striped": []}
    lock = threading.Lock()
    counter = iter(range(1000))

    def keep(key: str, ids: list[int]) -> None:
        with lock:
            seen[key].extend(ids)

    def tinyid_client(http: httpx.Client, key: str) -> None:
        # IdGeneratorFactoryClient's URL; TinyIdHttpUtils.post with an empty form body.
        answer = http.post(f"/tinyid/id/nextSegmentIdSimple?token=t&bizType={key}")
        assert answer.status_code == 200, answer.text
        ids = tinyid_drain(answer.text)
        assert len(ids) == 20  # the key's step: the whole range, and only it
        keep(key, ids)

    def cosid_client(http: httpx.Client, key: str) -> None:
        answer = http.patch(f"/segments/app/{key}", params={"step": 7})
        assert answer.status_code == 200, answer.text
        keep(key, cosid_drain(answer.json(), 7))

    def work() -> None:
        with lock:
            me = next(counter)
        with httpx.Client(base_url=url) as http:
            for _ in range(25):
                for key in ("plain", "striped"):
                    tinyid_client(http, key)
                    keep(key, http.get(f"/v1/keys/{key}/ids", params={"count": 9}).json()["ids"])
                    keep(key, [int(http.get(f"/api/segment/get/{key}").text)])
                    keep(
                        key, http.get(f"/tinyid/id/nextId?bizType={key}&batchSize=3").json()["data"]
                    )
                    simple = http.get(f"/tinyid/id/nextIdSimple?bizType={key}&batchSize=4").text
                    keep(key, [int(i) for i in simple.split(",")])
                if me % 2:
                    cosid_client(http, "plain")
                    keep("plain", [http.get("/ids/plain").json()])
                else:
                    # Each stripe, named: the store's own choice is stripe 0 while it lasts.
                    stripe = {"size": 5, "stripe": me // 2 % 4}
                    taken = http.post("/v1/keys/striped/ranges", params=stripe).json()
                    keep("striped", list(range(taken["start"], taken["stop"], taken["stride"])))

    run_threads(work, 8)
    for key, ids in seen.items():
        assert assert_unique(ids) > 2000, key
    assert {i % 4 for i in seen["striped"]} == {0, 1, 2, 3}  # every stripe served


def test_the_duplicate_checker_catches_a_segment_consumed_twice(
    idmint_server: ServerProcess,
) -> None:
    # Negative control: the same answer consumed by two clients is a duplicate, and caught.
    url = idmint_server.url
    assert httpx.post(url + "/v1/keys", json={"name": "k", "step": 5}).status_code == 201
    tinyid = httpx.get(url + "/tinyid/id/nextSegmentIdSimple?bizType=k").text
    cosid = httpx.patch(url + "/segments/app/k?step=5").json()
    with pytest.raises(AssertionError, match="5 duplicate ids"):
        assert_unique(tinyid_drain(tinyid) * 2)
    with pytest.raises(AssertionError, match="5 duplicate ids"):
        assert_unique(tinyid_drain(tinyid) + cosid_drain(cosid, 5) + cosid_drain(cosid, 5))
    assert assert_unique(tinyid_drain(tinyid) + cosid_drain(cosid, 5)) == 10


def test_a_key_set_up_as_the_cosid_note_says_serves_cosids_growing_prefetch(
    tmp_path: Path,
) -> None:
    """CosId's default SegmentChainId asked for 163,840, 327,680 then 655,360 ids in one PATCH
    (its prefetch doubling) and got a 400 at the default cap: SEVERE in its log three times a
    run. The key made as docs/server.md's migration note says serves the whole sequence, each
    segment exactly `step` consecutive ids above CosId's offset."""
    import shlex

    from idmint.cli import main as cli_main

    note = (Path(__file__).parent.parent / "docs" / "server.md").read_text()
    note = note[note.index("### CosId proxy") : note.index("### Leaf")]
    [command] = [line for line in note.splitlines() if line.startswith("idmint keys add ")]
    url = f"sqlite:///{tmp_path / 'cosid.db'}"
    argv = shlex.split(command.split("#")[0])[1:]
    assert cli_main(["--store", url, *argv]) == 0, command
    app = App(ServerConfig(store=url))
    made = call(app, "POST", "/segments/distributor/app/order?offset=1000000&step=10")
    assert made.status_code == 200, made.text
    segments = []
    step = 163_840
    while step <= 10_000_000:
        got = call(app, "PATCH", f"/segments/app/order?step={step}")
        assert got.status_code == 200, (step, got.text)
        segments.append((int(got.text) - step, int(got.text)))  # CosId's (maxId - step, maxId]
        step *= 2
    assert len(segments) == 6 and segments[0] == (1_000_000, 1_163_840)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(segments))
    app.shutdown()


def test_tinyid_and_leaf_routes_take_what_their_servers_take(tmp_path: Path) -> None:
    """On main: a form-encoded POST (`curl -d 'bizType=t'`, as tinyid's users call it) was a
    400, Leaf's and tinyid's routes answered 405 to methods their Spring controllers take, an
    empty batchSize was a 400 where tinyid takes 1, and the tinyid routes refused `bearer X`
    and `Bearer  X`, which the other id routes accept."""
    url = f"sqlite:///{tmp_path / 'a.db'}"
    app = App(ServerConfig(store=url, admin_loopback=True, client_token="sekrit"))
    bearer = {"authorization": "Bearer sekrit"}
    assert call(app, "POST", "/v1/keys", json={"name": "t"}, headers=bearer).is_success
    form = {"content-type": "application/x-www-form-urlencoded", **bearer}
    got = call(
        app, "POST", "/tinyid/id/nextIdSimple", content=b"bizType=t&batchSize=2", headers=form
    )
    assert (got.status_code, got.text) == (200, "1,2")
    got = call(app, "POST", "/tinyid/id/nextId", content=b"bizType=t", headers=form)
    assert got.json()["data"] == [3]
    assert (
        call(app, "GET", "/tinyid/id/nextIdSimple?bizType=t&batchSize=", headers=bearer).text == "4"
    )
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        for path in ("/api/segment/get/t", "/tinyid/id/nextIdSimple?bizType=t"):
            got = call(app, method, path, headers=bearer)
            assert got.status_code == 200, (method, path, got.status_code, got.text)
    for header in ("bearer sekrit", "Bearer  sekrit", "BEARER sekrit"):
        got = call(
            app, "GET", "/tinyid/id/nextIdSimple?bizType=t", headers={"authorization": header}
        )
        assert got.status_code == 200, (header, got.text)
        assert call(app, "GET", "/v1/keys/t/ids", headers={"authorization": header}).is_success
    assert call(app, "GET", "/tinyid/id/nextIdSimple?bizType=t").status_code == 401
    paths = call(app, "GET", "/openapi.json").json()["paths"]
    for path in ("/api/segment/get/{key}", "/tinyid/id/nextIdSimple"):
        assert set(paths[path]) == {"get", "post", "put", "patch", "delete"}, path
    app.shutdown()
