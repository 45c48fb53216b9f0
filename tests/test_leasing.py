"""The worker-choice rule (`stores/leasing.py`) and the engines that apply it: the Redis lease
store's Lua copy and the Python engines choose the worker id `choose_worker` chooses, over
generated tables of holders."""

from __future__ import annotations

import contextlib
import itertools
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from idmint import WorkersExhausted
from idmint.stores import open_lease_store
from idmint.stores.base import LeaseStore
from idmint.stores.leasing import HOLDER_NAME_MAX, choose_worker, holder_name
from idmint.stores.memory import MemoryLeaseStore, _Slot

# What a worker id's record is: none yet, released or expired (with a horizon), leased now, or
# reserved for a static holder that is not running.
STATES = ("absent", "free", "held", "static")
HELD_MS = 600_000  # a lease that outlives the test

# A table: per worker id, its state and stored horizon; and acquire's now_ms. Horizons and
# now_ms share a small range so "horizon <= now_ms" goes both ways and ties.
tables = st.tuples(
    st.lists(st.tuples(st.sampled_from(STATES), st.integers(0, 40)), min_size=0, max_size=12),
    st.one_of(st.none(), st.integers(0, 40)),
)
examples = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    database=None,
)
_namespaces = itertools.count()

Table = list[tuple[str, int]]


def expected(table: Table, now_ms: int | None, *, looks: int = 0) -> int | None:
    """The rule's choice for `table`, None when every id is taken."""
    free = (w for w, (state, _) in enumerate(table) if state in ("absent", "free"))
    floors = {w: (0 if state == "absent" else horizon) for w, (state, horizon) in enumerate(table)}
    try:
        return choose_worker("ns", len(table), free, floors.__getitem__, now_ms, looks=looks)
    except WorkersExhausted:
        return None


def chosen(store: LeaseStore, namespace: str, table: Table, now_ms: int | None) -> int | None:
    try:
        lease = store.acquire(namespace, workers=len(table), ttl=60, horizon_ms=0, now_ms=now_ms)
    except WorkersExhausted:
        return None
    return lease.worker_id


def test_the_rule() -> None:
    never = [("absent", 0)] * 3
    assert expected(never, 5) == 0
    assert expected([("free", 9), ("held", 0), ("free", 5), ("free", 1)], 5) == 2
    assert expected([("free", 9), ("static", 0), ("free", 7)], 5) == 0  # none usable now
    assert expected([("free", 9), ("free", 0)], None) == 0  # no now_ms: the lowest free
    assert expected([("held", 0), ("static", 0)], 5) is None
    assert expected([], 5) is None
    # With `looks`, only the first `looks` free ids' floors are read.
    assert expected([("free", 9), ("free", 9), ("free", 0)], 5, looks=2) == 0
    assert expected([("free", 9), ("free", 9), ("free", 0)], 5, looks=3) == 2


def test_the_rule_reads_no_further_than_its_choice() -> None:
    read: list[int] = []

    def free() -> Iterator[int]:
        for w in range(10):
            read.append(w)
            yield w

    assert choose_worker("ns", 10, free(), lambda w: 0 if w == 3 else 9, 5) == 3
    assert read == [0, 1, 2, 3]
    with pytest.raises(WorkersExhausted):
        choose_worker("ns", 4, iter(()), lambda w: 0, 5)


def test_a_holder_name_is_host_and_pid_bounded_for_every_engine() -> None:
    name = holder_name()
    assert name.rsplit(":", 1)[1].isdigit()
    assert len(name) <= HOLDER_NAME_MAX


@pytest.fixture
def redis_leases(redis_server: Any) -> Iterator[tuple[LeaseStore, Any]]:
    store = open_lease_store(redis_server.store_url("leasing"))
    admin = redis.Redis(port=redis_server.port)
    yield store, admin
    admin.close()
    store.close()


@seed(22)
@examples
@given(tables)
def test_the_lua_rule_is_the_python_rule(
    redis_leases: tuple[LeaseStore, Any], generated: tuple[Table, int | None]
) -> None:
    store, admin = redis_leases
    table, now_ms = generated
    ns = f"n{next(_namespaces)}"
    pipe = admin.pipeline()
    for w, (state, horizon) in enumerate(table):
        if state == "absent":
            continue
        pipe.hset(f"leasing:h:{ns}:{w}", mapping={"horizon": horizon, "host": "h", "owner": ""})
        if state == "held":
            pipe.set(f"leasing:w:{ns}:{w}", "someone", px=HELD_MS)
        if state == "static":
            pipe.hset(f"leasing:h:{ns}:{w}", "static", "1")
    pipe.execute()
    assert chosen(store, ns, table, now_ms) == expected(table, now_ms)


@seed(22)
@examples
@given(tables)
def test_the_memory_engine_applies_the_rule(generated: tuple[Table, int | None]) -> None:
    table, now_ms = generated
    store = MemoryLeaseStore(clock=lambda: 1000.0)
    for w, (state, horizon) in enumerate(table):
        if state != "absent":
            expires = 1000.0 + HELD_MS if state == "held" else 0.0
            owner = "someone" if state == "held" else ""
            store._slots[("ns", w)] = _Slot(owner, expires, horizon, "h")
        if state == "static":
            store._reserved.add(("ns", w))
    assert chosen(store, "ns", table, now_ms) == expected(table, now_ms)


@pytest.fixture
def sqlite_leases(tmp_path: Path) -> Iterator[tuple[LeaseStore, sqlite3.Connection]]:
    path = tmp_path / "leasing.db"
    store = open_lease_store(f"sqlite:///{path}")
    store.holders("ns")  # makes the schema
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        yield store, db
    store.close()


@seed(22)
@examples
@given(tables)
def test_the_sql_engines_apply_the_rule(
    sqlite_leases: tuple[LeaseStore, sqlite3.Connection], generated: tuple[Table, int | None]
) -> None:
    store, db = sqlite_leases
    table, now_ms = generated
    ns = f"n{next(_namespaces)}"
    for w, (state, horizon) in enumerate(table):
        if state == "absent":
            continue
        held = state == "held"
        db.execute(
            "INSERT INTO idmint_workers (namespace, worker_id, owner, host, expires_ms, "
            "horizon_ms) VALUES (?, ?, ?, 'h', ?, ?)",
            (ns, w, "someone" if held else "", 2**62 if held else 0, horizon),
        )
        if state == "static":
            db.execute(
                "INSERT INTO idmint_reserved_workers (namespace, worker_id) VALUES (?, ?)", (ns, w)
            )
    assert chosen(store, ns, table, now_ms) == expected(table, now_ms)
