"""What is Cassandra's own: its URL, the keyspace it makes, a node killed and paused under a
connected store, swaps whose Paxos rounds timed out, a keyspace dropped behind the store's back,
processes and forks sharing one key. The contract suites (test_store_contract.py,
test_lease_contract.py) run on it too."""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import idmint
from idmint import DriverMissing, InvalidArgument, LeaseLost, StoreUnavailable
from idmint.ids import ID_MAX
from idmint.stores import open_engine
from idmint.stores.cassandra import parse_url

from checks import assert_unique, assert_within, assert_within_bound, run_threads, works
from server_cassandra import CassandraServer
from servers import wait_until

NOW = 1_800_000_000_000
TIMEOUT = 1.0
BOUND = TIMEOUT + 3.0  # the store timeout, and room for a loaded machine
WORKER = str(Path(__file__).with_name("worker.py"))
FORK = multiprocessing.get_context("fork")
PARENT: dict[str, Any] = {}  # what a forked pool's workers find of the parent


# -- the URL -------------------------------------------------------------------------------------


def test_url_settings_and_defaults() -> None:
    plain = parse_url("cassandra://db1", "x")
    assert (plain.hosts, plain.port, plain.keyspace) == (("db1",), 9042, "idmint")
    assert (plain.serial, plain.consistency, plain.dc, plain.protocol) == (
        "SERIAL",
        "QUORUM",
        None,
        3,
    )
    assert plain.replication == {"class": "SimpleStrategy", "replication_factor": "1"}
    local = parse_url(
        "cassandra://u:p%40ss@h1,h2:9142,[::1]:9142/ids?serial=local_serial&dc=dc1"
        "&replication=dc1:3,dc2:2&protocol=4",
        "x",
    )
    assert (local.hosts, local.port, local.keyspace) == (("h1", "h2", "::1"), 9142, "ids")
    assert (local.serial, local.consistency, local.dc, local.protocol) == (
        "LOCAL_SERIAL",
        "LOCAL_QUORUM",
        "dc1",
        4,
    )
    assert local.replication == {"class": "NetworkTopologyStrategy", "dc1": "3", "dc2": "2"}
    assert (local.username, local.password) == ("u", "p@ss")
    assert "p@ss" not in repr(local)
    assert parse_url("cassandra://h/k?replication=3&consistency=all", "x").consistency == "ALL"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("cassandra://h/k?serial=QUORUM", "serial must be SERIAL or LOCAL_SERIAL, not 'QUORUM'"),
        ("cassandra://h:99999/k", "port '99999' is not a number from 1 to 65535"),
        ("cassandra://h:x/k", "port 'x' is not a number"),
        ("cassandra://h:/k", "port '' is not a number"),
        ("cassandra://h1:9042,h2:9043/k", "every host must have the same port"),
        ("cassandra:///k", "it names no host"),
        ("cassandra://h/Bad-Name", "keyspace 'Bad-Name': lowercase letters"),
        ("cassandra://h/" + "k" * 49, "at most 48"),
        ("cassandra://h/k?consistency=SERIAL", "consistency must be one of"),
        ("cassandra://h/k?replication=dc1", "replication 'dc1'"),
        ("cassandra://h/k?replication=0", "replication '0'"),
        ("cassandra://h/k?protocol=2", "protocol must be 3, 4 or 5"),
        ("cassandra://h/k?prefix=x", "unknown parameter 'prefix'"),
        ("cassandra://h/k#frag", "no #fragment"),
    ],
)
def test_bad_urls_are_one_line_invalid_arguments(url: str, reason: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        open_engine(url)
    message = str(info.value)
    assert message.startswith(f"bad store URL {url!r}: ") and reason in message
    assert "\n" not in message


def test_a_bad_url_never_shows_its_password() -> None:
    with pytest.raises(InvalidArgument) as info:
        open_engine("cassandra://app:s3cret-pw@h:1/k?serial=nope")
    assert "s3cret-pw" not in str(info.value) and "app:***@h:1" in str(info.value)
    with pytest.raises(InvalidArgument) as info:  # a "/" the password should have encoded
        open_engine("cassandra://app:s3cr/et@h/k")
    assert "s3cr" not in str(info.value) and "percent-encode" in str(info.value)


def test_opening_does_no_io_and_the_first_call_fails_fast() -> None:
    started = time.monotonic()
    engine = open_engine("cassandra://127.0.0.1:1/nothing", timeout=TIMEOUT)  # nobody there
    ranges = engine.ranges()
    assert time.monotonic() - started < 0.5
    with pytest.raises(StoreUnavailable, match=r"^store cassandra://127\.0\.0\.1:1/nothing "):
        ranges.get_key("k")
    assert time.monotonic() - started < BOUND
    engine.close()


def test_without_the_driver_the_message_names_the_extra() -> None:
    # A Python on which `import cassandra` fails, as where the driver is not installed.
    code = (
        "import sys; sys.modules['cassandra'] = None\n"
        "from idmint.stores import open_engine\n"
        "try:\n"
        "    open_engine('cassandra://h/k')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout == (
        "DriverMissing cassandra:// stores need the DataStax driver: "
        "pip install 'idmint[cassandra]'\n"
    )
    assert issubclass(DriverMissing, InvalidArgument)


# -- the schema ----------------------------------------------------------------------------------


def test_the_keyspace_is_made_on_first_use_as_the_url_says(
    cassandra_server: CassandraServer,
) -> None:
    # SimpleSnitch puts every node in "datacenter1"
    url = cassandra_server.store_url(f"nts_{os.getpid()}") + "?replication=datacenter1:1"
    keyspace = url.split("/")[-1].split("?")[0]
    engine = open_engine(url)
    assert not _keyspace(cassandra_server, keyspace)  # opening made nothing
    engine.cas().init()
    engine.cas().init()  # again: nothing changes
    row = _keyspace(cassandra_server, keyspace)[0]
    assert row["strategy_class"].endswith("NetworkTopologyStrategy")
    assert row["strategy_options"] == '{"datacenter1":"1"}'
    tables = cassandra_server.execute(
        "SELECT columnfamily_name FROM system.schema_columnfamilies WHERE keyspace_name = %s",
        (keyspace,),
    )
    assert sorted(t["columnfamily_name"] for t in tables) == [
        "idmint_cells",
        "idmint_leases",
        "idmint_meta",
        "idmint_worker_ids",
    ]
    engine.close()
    plain = cassandra_server.store_url(f"simple_{os.getpid()}")
    with idmint.connect(plain) as minter:  # first use: adding a key makes it all
        minter.add_key("k")
    row = _keyspace(cassandra_server, plain.split("/")[-1])[0]
    assert row["strategy_class"].endswith("SimpleStrategy")
    assert row["strategy_options"] == '{"replication_factor":"1"}'


def _keyspace(server: CassandraServer, name: str) -> list[dict[str, Any]]:
    rows = server.execute(
        "SELECT strategy_class, strategy_options FROM system.schema_keyspaces "
        "WHERE keyspace_name = %s",
        (name,),
    )
    return rows


def test_a_dropped_keyspace_is_a_new_store(cassandra_server: CassandraServer) -> None:
    url = cassandra_server.store_url(f"dropped_{os.getpid()}")
    keyspace = url.split("/")[-1]
    engine = open_engine(url)
    cas, leases = engine.cas(), engine.leases()
    before = cas.identity()
    assert before is not None and leases.identity() == before
    lease = leases.acquire("ns", workers=4, ttl=30, horizon_ms=NOW)
    assert lease.store_id == before.id
    assert cas.create("cell", "v1")
    cassandra_server.execute(f"DROP KEYSPACE {keyspace}")
    # Made again on the next call, with a new identity: everything before is gone.
    after = cas.identity()
    assert after is not None and after.id != before.id
    assert cas.read("cell") is None
    with pytest.raises(LeaseLost):
        leases.renew(lease, NOW + 1)
    again = leases.acquire("ns", workers=4, ttl=30, horizon_ms=NOW)
    assert (again.worker_id, again.floor_ms, again.store_id) == (0, 0, after.id)
    engine.close()


def test_closing_is_once_and_safe_to_repeat(cassandra_server: CassandraServer) -> None:
    engine = open_engine(cassandra_server.store_url(f"close_{os.getpid()}"))
    ranges, leases, cas = engine.ranges(), engine.leases(), engine.cas()
    ranges.add_key("k", step=10, first_id=1, last_id=100)
    leases.holders("ns")
    cas.close()  # the ranges (over cas) are closed with it; the leases still work
    cas.close()
    with pytest.raises(StoreUnavailable, match="is closed"):
        ranges.allocate("k")
    assert leases.holders("ns") == []
    engine.close()
    engine.close()
    with pytest.raises(StoreUnavailable, match="is closed"):
        leases.holders("ns")


# -- a node killed, restarted, paused ------------------------------------------------------------


@pytest.fixture(scope="module")
def private_server() -> Iterator[CassandraServer]:
    """A node of its own: killing or pausing it must not touch the other tests' node. Its Paxos
    rounds give up after 20 ms of contention (1 s by default), so that concurrent writers get
    the WriteTimeouts whose outcome is unknown."""
    server = CassandraServer(settings={"cas_contention_timeout_in_ms": 20})
    server.start()
    yield server
    server.resume()
    server.close()


def test_a_killed_then_paused_node(private_server: CassandraServer) -> None:
    server = private_server
    url = server.store_url("faults")
    engine = open_engine(url, timeout=TIMEOUT)
    ranges, leases = engine.ranges(), engine.leases()
    ranges.add_key("k", step=10, first_id=1, last_id=ID_MAX)
    taken = [ranges.allocate("k").range]
    lease = leases.acquire("ns", workers=8, ttl=60, horizon_ms=NOW)

    server.kill()  # SIGKILL: a crash
    newcomer = open_engine(url, timeout=TIMEOUT)
    assert_within_bound(
        BOUND,
        {
            "allocate, connected before": lambda: ranges.allocate("k"),
            "renew, connected before": lambda: leases.renew(lease, NOW + 1),
            "allocate, connecting while down": lambda: newcomer.ranges().allocate("k"),
        },
    )
    server.start()  # same data, same port: it replays its commit log
    # The same store objects work again by themselves, with what was written before the kill.
    wait_until(functools.partial(works, ranges.get_key, "k"), 20, "the store again")
    taken += [ranges.allocate("k").range, newcomer.ranges().allocate("k").range]
    assert [(r.start, r.stop) for r in taken] == [(1, 11), (11, 21), (21, 31)]
    lease = leases.renew(lease, NOW + 2)
    assert lease.horizon_ms == NOW + 2

    server.pause()  # SIGSTOP: a hung node whose sockets stay open
    late = open_engine(url, timeout=TIMEOUT)
    try:
        assert_within_bound(
            BOUND,
            {
                "allocate, connected before": lambda: ranges.allocate("k"),
                "renew, connected before": lambda: leases.renew(lease, NOW + 3),
                "a statement not prepared yet": lambda: leases.unreserve("ns", 5),
                "acquire, connecting while paused": lambda: late.leases().acquire(
                    "ns", workers=8, ttl=60, horizon_ms=NOW
                ),
                # ... and more threads waiting for that one connection, not each in turn
                **{
                    f"holders, waiting for it ({n})": functools.partial(late.leases().holders, "ns")
                    for n in range(4)
                },
            },
        )
    finally:
        server.resume()
    wait_until(functools.partial(works, ranges.get_key, "k"), 20, "the store again")
    wait_until(functools.partial(works, late.leases().holders, "ns"), 20, "the newcomer too")
    assert ranges.allocate("k").range.start >= 31
    for each in (engine, newcomer, late):
        each.close()


def test_swaps_that_timed_out_answer_exactly(private_server: CassandraServer) -> None:
    # Writers on one cell, each appending its own number when its swap succeeds: under this
    # node's contention timeout many swaps end in a WriteTimeout, which the store resolves with
    # a Paxos read. Every True must be in the cell once, every False absent. (On one node such
    # a write was never applied: a store answering True for it fails here, one answering False
    # blindly would not.)
    private_server.resume()
    private_server.start()  # as the test before may have left it
    engine = open_engine(private_server.store_url("contention"), timeout=5.0)
    cas = engine.cas()
    assert cas.create("cell", "")
    numbers = itertools.count()
    answers: dict[int, bool | None] = {}

    def write() -> None:
        end = time.monotonic() + 4
        while time.monotonic() < end:
            try:
                cell = cas.read("cell")
            except StoreUnavailable:  # a Paxos read can time out under contention too
                continue
            assert cell is not None
            value, version = cell
            number = next(numbers)
            try:
                answers[number] = cas.swap("cell", version, f"{value},{number}")
            except StoreUnavailable:  # unknown: it may or may not be in the cell
                answers[number] = None

    run_threads(write, 12)
    got = cas.read("cell")
    assert got is not None
    written = [int(n) for n in got[0].split(",") if n]
    assert assert_unique(written) == len(written)
    wrong = [
        n
        for n, answer in answers.items()
        if (answer is True and n not in written) or (answer is False and n in written)
    ]
    assert not wrong, f"{len(wrong)} swaps answered wrongly, e.g. {wrong[:5]}"
    assert sum(1 for a in answers.values() if a) >= 10
    engine.close()


# -- processes and forks on one key --------------------------------------------------------------


def test_four_processes_on_one_key(cassandra_server: CassandraServer) -> None:
    url = cassandra_server.store_url(f"procs_{os.getpid()}")
    with idmint.connect(url) as minter:
        minter.add_key("shared", step=50, start=1000)
    # Small steps: the processes' compare-and-sets on the one cell collide all the time.
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, url, "shared", "1500", "--small-steps"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    ids: list[int] = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-2000:]
        ids += [int(line) for line in out.decode().split()]
    assert assert_unique(ids) >= 4 * 1500
    assert_within(ids, 1000, ID_MAX)
    with idmint.connect(url) as minter:
        assert minter.key("shared").max_id > max(ids)


def _child_ids(_: int) -> tuple[int, list[int]]:
    return os.getpid(), list(PARENT["minter"].take("forked", 7))


def _child_version(queue: Any) -> None:
    cas = PARENT["cas"]
    cell = f"child{os.getpid()}"
    cas.create(cell, "x")
    queue.put(cas.read(cell)[1])


def test_forked_children_connect_anew(cassandra_server: CassandraServer) -> None:
    minter = idmint.connect(cassandra_server.store_url(f"fork_{os.getpid()}"))
    minter.add_key("forked", step=100)
    ids = list(minter.take("forked", 7))  # the parent is connected when it forks
    PARENT["minter"] = minter
    try:
        with FORK.Pool(2) as pool:
            results = pool.map(_child_ids, range(6))
        assert {pid for pid, _ in results} - {os.getpid()}
        ids += [i for _, got in results for i in got]
        ids += list(minter.take("forked", 7))  # the children left the parent's sockets alone
        assert assert_unique(ids) == 8 * 7
    finally:
        PARENT.clear()
        minter.close()


def test_forked_children_write_versions_of_their_own(cassandra_server: CassandraServer) -> None:
    # A cell's version is a random token: children must not draw their parent's sequence (two
    # of them writing the same "new" version would each take the other's write for its own).
    engine = open_engine(cassandra_server.store_url(f"forkver_{os.getpid()}"))
    PARENT["cas"] = engine.cas()
    PARENT["cas"].create("parent", "x")
    queue = FORK.Queue()
    children = [FORK.Process(target=_child_version, args=(queue,)) for _ in range(3)]
    try:
        for child in children:
            child.start()
        versions = [queue.get(timeout=60) for _ in children]
        assert len(set(versions)) == len(children), versions
    finally:
        for child in children:
            child.join(30)
        PARENT.clear()
        engine.close()
