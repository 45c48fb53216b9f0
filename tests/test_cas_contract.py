"""The CasStore contract (compare-and-set cells), run against every engine on real servers:
what `open_engine(url).cas()` promises, whichever engine is behind it."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from idmint.stores import open_engine
from idmint.stores.base import CasStore
from idmint.stores.engine import Engine

from conftest import CAS_STORES, LOCKED_STORES, fresh_store_url

VALUES = ("plain", "", "ünïcødé ✓ 日本語 🎉 \"quoted\" 'single' \\ back\nslash", "x" * 4096)
ODD_KEYS = (
    "a/x",
    "ab/x",
    "a#1",
    "a:b",
    "a/b/c:d#2",
    "key/order#3",
    "%2F",
    "%",
    "100%",
    ".",
    "..",
    "a.b",
    "sp ace",
    "ünï/cødé",
    "日本/語",
    "back\\slash",
    "~tilde",
)


@pytest.fixture(params=(*CAS_STORES, *LOCKED_STORES))
def cas_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Every engine's cells, and every server engine again locked down (TLS, least privilege)."""
    return fresh_store_url(request.param, request, tmp_path)


@pytest.fixture
def engine(cas_store_url: str) -> Iterator[Engine]:
    e = open_engine(cas_store_url)
    yield e
    e.close()


@pytest.fixture
def cas(engine: Engine) -> CasStore:
    store = engine.cas()
    store.init()
    return store


def run_threads(target: Callable[[], None], count: int, timeout: float = 120.0) -> None:
    """Run `target` on `count` threads at once; re-raise the first failure; bounded."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    give_up = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, give_up - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout} s"
    if failures:
        raise failures[0]


def test_meets_the_protocol(cas: CasStore) -> None:
    assert isinstance(cas, CasStore)
    cas.init()  # again: idempotent


def test_a_missing_cell_reads_none(cas: CasStore) -> None:
    assert cas.read("nope") is None
    assert cas.scan("") == []


def test_create_then_read(cas: CasStore) -> None:
    assert cas.create("k", "v1") is True
    value, version = cas.read("k") or ("", -1)
    assert value == "v1" and isinstance(version, int)


def test_create_twice_is_false_and_keeps_the_value(cas: CasStore) -> None:
    assert cas.create("k", "first") is True
    before = cas.read("k")
    assert cas.create("k", "second") is False
    assert cas.read("k") == before


def test_swap_with_the_current_version(cas: CasStore) -> None:
    cas.create("k", "v1")
    _, v1 = cas.read("k") or ("", -1)
    assert cas.swap("k", v1, "v2") is True
    value, v2 = cas.read("k") or ("", -1)
    assert value == "v2" and v2 != v1
    assert cas.swap("k", v2, "v3") is True
    value, v3 = cas.read("k") or ("", -1)
    assert value == "v3" and v3 not in (v1, v2)


def test_swap_with_a_stale_version_is_false(cas: CasStore) -> None:
    cas.create("k", "v1")
    _, stale = cas.read("k") or ("", -1)
    assert cas.swap("k", stale, "v2") is True
    current = cas.read("k")
    assert cas.swap("k", stale, "lost") is False
    assert cas.read("k") == current


def test_swap_of_a_missing_cell_is_false(cas: CasStore) -> None:
    # Every version a caller might hold, 0 and -1 (ZooKeeper's "any version") included.
    for version in (-1, 0, 1, 2, 10**12):
        assert cas.swap("missing", version, "v") is False
    assert cas.read("missing") is None
    # Nor does a version of another cell open this one.
    cas.create("other", "v")
    _, version = cas.read("other") or ("", -1)
    assert cas.swap("missing", version, "v") is False
    assert cas.read("missing") is None


def test_scan_by_prefix_sorted(cas: CasStore) -> None:
    for key in ("b/2", "a/y", "ab/x", "a/x", "a", "b/1", "a/", "ab"):
        assert cas.create(key, f"value of {key}")
    assert cas.scan("a/") == [
        ("a/", "value of a/"),
        ("a/x", "value of a/x"),
        ("a/y", "value of a/y"),
    ]
    assert [k for k, _ in cas.scan("ab")] == ["ab", "ab/x"]
    assert [k for k, _ in cas.scan("a")] == ["a", "a/", "a/x", "a/y", "ab", "ab/x"]
    assert [k for k, _ in cas.scan("")] == ["a", "a/", "a/x", "a/y", "ab", "ab/x", "b/1", "b/2"]
    assert cas.scan("c") == [] and cas.scan("a/z") == [] and cas.scan("b/1/") == []


def test_scan_shows_the_latest_values(cas: CasStore) -> None:
    cas.create("s/1", "old")
    _, version = cas.read("s/1") or ("", -1)
    cas.swap("s/1", version, "new")
    assert cas.scan("s/") == [("s/1", "new")]


def test_keys_with_odd_characters(cas: CasStore) -> None:
    for key in ODD_KEYS:
        assert cas.create(key, f"v:{key}") is True, key
    for key in ODD_KEYS:
        value, version = cas.read(key) or ("", -1)
        assert value == f"v:{key}", key
        assert cas.swap(key, version, f"w:{key}") is True, key
    assert cas.scan("") == sorted((key, f"w:{key}") for key in ODD_KEYS)
    assert cas.scan("a/") == [("a/b/c:d#2", "w:a/b/c:d#2"), ("a/x", "w:a/x")]
    assert cas.scan("%") == [("%", "w:%"), ("%2F", "w:%2F")]
    assert cas.scan(".") == [(".", "w:."), ("..", "w:..")]
    assert [k for k, _ in cas.scan("日本")] == ["日本/語"]


def test_values_round_trip(cas: CasStore) -> None:
    for i, value in enumerate(VALUES):
        assert cas.create(f"v{i}", value) is True
        assert (cas.read(f"v{i}") or ("?", 0))[0] == value
    for i in range(len(VALUES)):  # a swap carries any value too, the other way round
        _, version = cas.read(f"v{i}") or ("", -1)
        other = VALUES[-1 - i]
        assert cas.swap(f"v{i}", version, other) is True
        assert (cas.read(f"v{i}") or ("?", 0))[0] == other
    assert cas.scan("v") == [(f"v{i}", VALUES[-1 - i]) for i in range(len(VALUES))]


def test_two_engines_on_one_url_see_each_others_writes(cas_store_url: str, cas: CasStore) -> None:
    other_engine = open_engine(cas_store_url)
    try:
        other = other_engine.cas()
        assert cas.create("shared", "one") is True
        assert other.create("shared", "two") is False
        value, version = other.read("shared") or ("", -1)
        assert value == "one"
        assert other.swap("shared", version, "three") is True
        assert cas.read("shared") == other.read("shared")
        assert (cas.read("shared") or ("", 0))[0] == "three"
        assert cas.swap("shared", version, "stale") is False
        assert other.create("mine", "m") is True
        assert [k for k, _ in cas.scan("")] == ["mine", "shared"]
    finally:
        other_engine.close()


def test_concurrent_increments_lose_no_update(cas_store_url: str, cas: CasStore) -> None:
    """8 threads, half of them on an engine of their own, increment one counter through
    read/swap loops: every increment lands once, and each value is written by one swap."""
    threads, each = 8, 25
    cas.create("counter", "0")
    other_engine = open_engine(cas_store_url)
    written: list[int] = []
    lost: list[int] = []
    lock = threading.Lock()
    turn = iter(range(threads))

    def worker() -> None:
        with lock:
            store = cas if next(turn) % 2 else other_engine.cas()
        for _ in range(each):
            conflicts = 0
            while True:
                value, version = store.read("counter") or ("", -1)
                if store.swap("counter", version, str(int(value) + 1)):
                    with lock:
                        written.append(int(value) + 1)
                        lost.append(conflicts)
                    break
                conflicts += 1
                assert conflicts < 10_000, "no progress"
                time.sleep(0.0005 * min(conflicts, 20))

    try:
        run_threads(worker, threads)
    finally:
        other_engine.close()
    total = threads * each
    assert (cas.read("counter") or ("", 0))[0] == str(total)
    assert sorted(written) == list(range(1, total + 1))  # no value written twice
    assert len(lost) == total


def test_identity_is_stable_and_the_lease_stores(cas_store_url: str, engine: Engine) -> None:
    identity = engine.cas().identity()
    assert identity is not None and identity.id
    assert engine.cas().identity() == identity
    assert engine.leases().identity() == identity
    other = open_engine(cas_store_url)
    try:
        assert other.leases().identity() == identity
        assert other.cas().identity() == identity
    finally:
        other.close()


def test_ranges_live_in_cells_on_engines_without_sql_ranges(engine: Engine) -> None:
    """On the engines whose segment keys are ranges over CAS, a key is a cell."""
    ranges = engine.ranges()
    ranges.add_key("order", step=10, first_id=1, last_id=1000)
    assert ranges.allocate("order").range.start == 1
    cells = dict(engine.cas().scan("key/"))
    if engine.kind in ("sqlite", "postgresql", "mysql"):
        assert cells == {}  # one-statement ranges in their own table
    else:
        assert '"max_id":11' in cells["key/order"]


def test_close_twice(cas_store_url: str) -> None:
    engine = open_engine(cas_store_url)
    cas, leases = engine.cas(), engine.leases()
    cas.create("k", "v")
    leases.identity()
    cas.close()
    cas.close()
    leases.close()
    engine.close()
    engine.close()
    again = open_engine(cas_store_url)
    try:
        if again.kind != "memory" or "://t" in cas_store_url:  # a private memory store is gone
            assert (again.cas().read("k") or ("", 0))[0] == "v"
    finally:
        again.close()


# -- fork --------------------------------------------------------------------------------------

FORK = multiprocessing.get_context("fork")
_PARENT: dict[str, CasStore] = {}


def _swap_in_child(key: str) -> str:
    """Append "+child" to the cell (the other child may swap first: then read again)."""
    store = _PARENT["cas"]
    for _ in range(1000):
        value, version = store.read(key) or ("", -1)
        if store.swap(key, version, value + "+child"):
            return value + "+child"
        time.sleep(0.01)
    raise AssertionError("no swap in 1000 attempts")


@pytest.mark.parametrize("kind", ["sqlite", "postgres", "redis", "etcd", "zookeeper"])
def test_a_forked_child_uses_its_own_connection(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A store object made (and connected) before fork(): the child's calls must not go down
    the parent's sockets or session, and the parent's must keep working."""
    engine = open_engine(fresh_store_url(kind, request, tmp_path))
    try:
        cas = _PARENT["cas"] = engine.cas()
        cas.create("f", "parent")
        with FORK.Pool(2) as pool:
            seen = pool.map_async(_swap_in_child, ["f", "f"]).get(timeout=60)
        assert sorted(seen) in (
            ["parent+child", "parent+child+child"],
            ["parent+child+child", "parent+child+child"],
        )
        value, version = cas.read("f") or ("", -1)
        assert value == "parent+child+child"
        assert cas.swap("f", version, "parent again") is True
    finally:
        _PARENT.clear()
        engine.close()


def test_keys_are_exact(cas: CasStore) -> None:
    """Keys that a collation would take for one another are different cells."""
    for key in ("k", "K", "k ", "é", "e", "E\u0301"):
        assert cas.create(key, key) is True, repr(key)
    for key in ("k", "K", "k ", "é", "e", "E\u0301"):
        assert (cas.read(key) or ("", 0))[0] == key
    assert [k for k, _ in cas.scan("k")] == ["k", "k "]
