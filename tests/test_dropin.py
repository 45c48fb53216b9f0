"""The drop-in routes for tinyid's and CosId's callers (server/dropin.py), and Leaf's decode:
their exact wire formats, their errors, and clients that consume their segments exactly as
the peers' Java clients do, never seeing an id twice beside idmint's own routes."""

from __future__ import annotations

import itertools
import json
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

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
                    # One id: from the buffer, before routing (DropIn.answer_now).
                    keep(key, [int(http.get(f"/tinyid/id/nextIdSimple?bizType={key}").text)])
                    keep(key, http.get(f"/tinyid/id/nextId?bizType={key}").json()["data"])
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
    """CosId v2.12.3's SegmentChainId asks nextMaxId for its step (10) x its prefetch segments,
    doubling while its callers go hungry up to 100,000,000: 163,840 ... 671,088,640, then
    1,000,000,000. Past 10,000,000 (the largest batch cap) idmint answered 400 and the client
    degraded (5,187 SEVERE lines, 1.66M -> 122k ids/s). Its segment is (maxId - step, maxId]
    whatever it is answered, so the key made as docs/server.md's migration note says serves
    every step whole: each a range of exactly `step` ids, none shared with another segment or
    with the ids other routes hand out between them."""
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
    segments, others = [], []
    distance = 2**14
    while True:
        step = 10 * min(distance, 100_000_000)  # IdSegmentDistributor.getStep(segments)
        got = call(app, "PATCH", f"/segments/app/order?step={step}")
        assert got.status_code == 200, (step, got.text)
        segments.append((int(got.text) - step, int(got.text)))  # CosId's (maxId - step, maxId]
        others += call(app, "GET", "/v1/keys/order/ids?count=3").json()["ids"]
        others.append(int(call(app, "GET", "/api/segment/get/order").text))
        if step == 1_000_000_000:
            break
        distance *= 2
    assert len(segments) == 14 and segments[0] == (1_000_000, 1_163_840)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(segments))
    assert not [i for i in others for low, high in segments if low < i <= high]
    # Past CosId's largest step, and past the cap of a key that did not opt in (a smaller
    # cap, or a maximum): the cap's 400, nothing taken.
    assert call(app, "PATCH", "/segments/app/order?step=1000000001").status_code == 400
    for name, cap, bound in (
        ("small", "9999999", []),
        ("bounded", "10000000", ["--max", "9000000000"]),
    ):
        assert cli_main(["--store", url, "keys", "add", name, "--max-batch", cap, *bound]) == 0
        refused = call(app, "PATCH", f"/segments/app/{name}?step=10485760")
        assert refused.status_code == 400 and "cap" in refused.json()["msg"], refused.text
        assert call(app, "PATCH", f"/segments/app/{name}?step=5").text == "5"
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


def _section(title: str, end: str) -> str:
    text = (Path(__file__).parent.parent / "docs" / "server.md").read_text()
    return " ".join(text[text.index(title) : text.index(end)].split())


def test_leaf_and_tinyid_docs_say_what_the_routes_do(idmint_server: ServerProcess) -> None:
    """docs/server.md listed Leaf's route as GET only and said every routed answer carries
    `idmint-store`, while the route answered every method (Spring's) and its GETs served from
    the buffer (granian's hot path) had no header; and it said tinyid's form bodies are not
    read, while they are. The drop-in sections now say what the server does; this holds the
    server (a real one: the hot path is granian's) to them."""
    intro = _section("## Drop-in routes", "### tinyid")
    leaf = _section("### Leaf", "## Many keys")
    tinyid = _section("### tinyid", "### CosId proxy")
    assert "to GET, POST, PUT, PATCH and DELETE" in leaf
    assert "The one kind of answer without the `idmint-store` header" in intro
    assert "GET of Leaf's `/api/segment/get/{key}`, of tinyid's `nextId` or `nextIdSimple`" in intro
    assert "in a form body (`curl -d 'bizType=k&batchSize=2'`)" in tinyid
    assert "not read" not in tinyid
    url = idmint_server.url
    assert httpx.post(url + "/v1/keys", json={"name": "k"}).status_code == 201
    assert httpx.get(url + "/api/segment/get/k").status_code == 200  # loads the key
    store = httpx.get(url + "/livez").headers["idmint-store"]
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        got = httpx.request(method, url + "/api/segment/get/k")
        assert got.status_code == 200 and got.text.isdigit(), (method, got.text)
        assert got.headers["idmint-store"] == store, method
    got = httpx.get(url + "/api/segment/get/k")
    assert got.text.isdigit() and "idmint-store" not in got.headers
    for now in ("/tinyid/id/nextIdSimple?bizType=k", "/tinyid/id/nextId?bizType=k", "/ids/k"):
        got = httpx.get(url + now)
        assert got.status_code == 200 and "idmint-store" not in got.headers, now
    form = httpx.post(url + "/tinyid/id/nextIdSimple", data={"bizType": "k", "batchSize": "2"})
    assert form.status_code == 200 and len(form.text.split(",")) == 2, form.text
    assert form.headers["idmint-store"] == store
    more = httpx.get(url + "/tinyid/id/nextIdSimple?bizType=k&batchSize=2")
    assert more.headers["idmint-store"] == store


NOW_QUERIES = [  # tinyid's queries answered before routing, and those left to the router
    ("bizType=t", True),
    ("bizType=t&batchSize=", True),
    ("batchSize=1&bizType=t&token=any", True),  # no client token set: any token goes
    ("bizType=nope&bizType=t", True),  # the last one counts, as in Call.arg
    ("bizType=t&batchSize=2", False),
    ("bizType=t&batchSize=0", False),
    ("bizType=t&batchSize=1&batchSize=x", False),  # Call.arg checks every value: a 400
    ("bizType=%74", False),  # escapes: parse_qs's to undo
    ("bizType=nope", False),
    ("bizType=", False),
    ("batchSize=1", False),
]


@pytest.mark.parametrize(("query", "now"), NOW_QUERIES)
def test_tinyid_ids_before_routing(app: App, query: str, now: bool) -> None:
    """tinyid's nextId and nextIdSimple hand out one id from the key's buffer before any
    routing (DropIn.answer_now), as Leaf's route does: through the router they served 0.53 to
    0.59 of its requests a second. Only plain queries of one id of a loaded key; the router
    answers the rest."""
    first = int(call(app, "GET", "/api/segment/get/t").text)  # loads the key
    simple = app.dropin.answer_now("/tinyid/id/nextIdSimple", _Scope("", query, {}))
    json_form = app.dropin.answer_now("/tinyid/id/nextId", _Scope("", query, {}))
    if not now:
        assert simple is None and json_form is None
        return
    assert simple == (str(first + 1), [("content-type", "text/plain; charset=utf-8")])
    assert json_form == (
        f'{{"data":[{first + 2}],"code":200,"message":""}}',
        [("content-type", "application/json")],
    )
    routed = call(app, "GET", "/tinyid/id/nextId?" + query).text  # the same shape
    assert routed == f'{{"data":[{first + 3}],"code":200,"message":""}}'
    metrics = call(app, "GET", "/metrics").text
    assert 'idmint_ids_handed_total{route="/tinyid/id/nextIdSimple"} 1' in metrics
    assert 'idmint_ids_handed_total{route="/tinyid/id/nextId"} 2' in metrics


def test_tinyid_and_cosid_ids_before_routing_take_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through App.__rsgi__ (granian's shell): with a client token, tinyid's `token=` or a
    bearer header, and CosId's bearer header, answered before routing; anything else goes to
    the router, which answers as before (tinyid's token error, CosId's 401)."""
    import asyncio

    app = App(ServerConfig(store=aged_sqlite_url(tmp_path / "now.db"), client_token="cli"))
    app.minter.add_key("t")
    bearer = {"authorization": "Bearer cli"}
    assert call(app, "GET", "/api/segment/get/t", headers=bearer).text == "1"  # loads it
    routed: list[str] = []
    handle = app.handle

    async def counted(request: Any) -> Any:
        routed.append(request.path)
        return await handle(request)

    monkeypatch.setattr(app, "handle", counted)

    def rsgi(path: str, query: str = "", headers: dict[str, str] | None = None) -> tuple[int, str]:
        proto = _Proto()
        asyncio.run(app.__rsgi__(_Scope(path, query, headers or {}), proto))
        [(status, _, body)] = proto.answers
        return status, body

    assert rsgi("/tinyid/id/nextIdSimple", "bizType=t&token=cli") == (200, "2")
    assert rsgi("/tinyid/id/nextId", "token=cli&bizType=t") == (
        200,
        '{"data":[3],"code":200,"message":""}',
    )
    assert rsgi("/tinyid/id/nextIdSimple", "bizType=t", bearer) == (200, "4")
    assert rsgi("/ids/t", "", bearer) == (200, "5")
    assert not routed
    assert rsgi("/tinyid/id/nextIdSimple", "bizType=t&token=wrong")[0] == 401
    status, body = rsgi("/tinyid/id/nextId", "bizType=t")
    assert (status, json.loads(body)["code"]) == (200, 5)  # tinyid's "token is error"
    assert rsgi("/ids/t", "token=cli")[0] == 401
    assert rsgi("/ids/nope", "", bearer)[0] == 404
    assert len(routed) == 4
    app.shutdown()


class _Scope:
    """What App.__rsgi__ reads of granian's RSGI scope, for a GET."""

    def __init__(self, path: str, query: str, headers: dict[str, str]) -> None:
        self.method, self.path, self.query_string = "GET", path, query
        self.headers, self.client = headers, "127.0.0.1:40000"


class _Proto:
    def __init__(self) -> None:
        self.answers: list[tuple[int, list[tuple[str, str]], str]] = []

    def response_str(self, status: int, headers: list[tuple[str, str]], body: str) -> None:
        self.answers.append((status, headers, body))


def test_leafs_route_before_routing_pays_the_id_budget(tmp_path: Path) -> None:
    """Leaf's one-id GET, answered from the buffer before routing (App.__rsgi__), took no id
    from the key's HTTP budget (--id-budget-days) since the budget came: a bounded key's
    Leaf clients were never paced. Now it is charged as every other route: a key of 100,000
    ids (a budget of 0.04 ids/s, a burst of its batch cap, 1,000) answers 1,000 ids, then 429."""
    import asyncio

    app = App(ServerConfig(store=aged_sqlite_url(tmp_path / "budget.db")))
    app.minter.add_key("b", step=10, max=100_000, max_batch=1000)
    statuses = []
    for _ in range(1002):
        proto = _Proto()
        asyncio.run(app.__rsgi__(_Scope("/api/segment/get/b", "", {}), proto))
        [(status, _, _)] = proto.answers
        statuses.append(status)
    assert statuses == [200] * 1000 + [429, 429]
    app.shutdown()
