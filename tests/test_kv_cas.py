"""What the contract suite cannot say for every engine: Redis's warning about persistence that
can lose a confirmed swap, etcd's paged scans, ZooKeeper's key encoding, bad URLs refused
before any I/O, and no secret in what a debugger shows of a cell store."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import redis
from kazoo.client import KazooClient
from server_zookeeper import ZooKeeperServer

from idmint import InvalidArgument, StoreUnavailable
from idmint.stores import etcd as etcd_module
from idmint.stores import open_engine
from idmint.stores.redis import weak_persistence
from idmint.stores.zookeeper import ZooKeeperCasStore, _cell_key, _node_name

from checks import works
from server_redis import RedisServer
from servers import wait_until

SECRET = "Zq7-s3cr3t-Pw9"


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own: its settings change."""
    server = RedisServer()
    server.start()
    yield server
    server.close()


def warnings_in(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The Redis engine's warnings (its loggers: idmint.stores.redis and those under it)."""
    engine = "idmint.stores.redis"
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == engine or r.name.startswith(engine + ".")
    ]


def test_redis_refuses_to_write_when_persistence_can_lose_a_swap(
    private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """On main a Redis with appendfsync everysec was only warned about for segment keys (a
    crash can lose a range it confirmed: ids repeat), while the same server was refused as a
    quorum node. Now it is refused before the first write unless the URL accepts it."""
    admin = redis.Redis(port=private_redis.port)
    url = private_redis.store_url("weak")
    caplog.set_level(logging.WARNING, logger="idmint.stores.redis")
    safe = open_engine(url)
    safe.ranges().add_key("k", step=10, first_id=1, last_id=10**6)
    assert safe.ranges().allocate("k").range.start == 1
    safe.close()
    assert warnings_in(caplog) == []

    admin.config_set("appendfsync", "everysec")
    refused = open_engine(url)
    try:
        with pytest.raises(InvalidArgument, match=r"appendfsync everysec.*\?unsafe=1"):
            refused.ranges().allocate("k")
        with pytest.raises(InvalidArgument, match="appendfsync everysec"):
            refused.cas().init()
    finally:
        refused.close()
    engines = [open_engine(f"{url}&unsafe=1") for _ in range(2)]
    try:
        taken = [engine.ranges().allocate("k").range.start for engine in engines]
        assert taken == [11, 21]  # nothing was taken by the refused calls
    finally:
        for engine in engines:
            engine.close()
        admin.config_set("appendfsync", "always")
    [message] = warnings_in(caplog)  # once for the process, however many engines
    assert "appendfsync everysec" in message and "appendonly yes and appendfsync always" in message
    with pytest.raises(InvalidArgument, match="unsafe must be 1 or 0"):
        open_engine(f"{url}&unsafe=maybe")


def test_redis_says_nothing_when_config_get_is_refused(
    private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis.Redis(port=private_redis.port)
    admin.config_set("appendonly", "no")
    admin.acl_setuser(
        "app", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-config"]
    )
    caplog.set_level(logging.WARNING, logger="idmint.stores.redis")
    engine = open_engine(f"redis://app:pw@127.0.0.1:{private_redis.port}/0?prefix=acl")
    try:
        cas = engine.cas()
        cas.init()
        assert cas.create("k", "v") is True
        assert (cas.read("k") or ("", 0))[0] == "v"
    finally:
        engine.close()
    assert warnings_in(caplog) == []


def test_weak_persistence_settings() -> None:
    assert weak_persistence({"appendonly": "yes", "appendfsync": "always"}) is None
    assert weak_persistence({}) is None  # no answer about persistence: no opinion
    assert weak_persistence({"appendonly": "no", "appendfsync": "always"}) == "appendonly no"
    assert weak_persistence({"appendonly": "yes", "appendfsync": "everysec"}) == (
        "appendfsync everysec"
    )
    assert weak_persistence(
        {"appendonly": "yes", "appendfsync": "always", "no-appendfsync-on-rewrite": "yes"}
    ) == ("no-appendfsync-on-rewrite yes")


def test_redis_cells_scan_through_their_index(redis_server: Any) -> None:
    """A scan reads the index the create script keeps, not the keyspace: keys of the lease
    store and of other prefixes never show up, and neither does a hash made by hand."""
    url = redis_server.store_url("indexed")
    engine = open_engine(url)
    try:
        engine.cas().create("a", "1")
        lease = engine.leases().acquire("ns", workers=2, ttl=30, horizon_ms=1)
        admin = redis.Redis(port=redis_server.port, decode_responses=True)
        admin.hset("indexed:c:forged", mapping={"value": "x", "version": "1"})
        assert engine.cas().scan("") == [("a", "1")]
        assert admin.zrange("indexed:cells", 0, -1) == ["a"]
        assert admin.hgetall("indexed:c:a") == {"value": "1", "version": "1"}
        engine.leases().release(lease)
    finally:
        engine.close()


def test_etcd_scans_page_through_one_snapshot(
    etcd_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(etcd_module, "SCAN_PAGE", 3)
    engine = open_engine(etcd_server.store_url("paged"))
    try:
        cas = engine.cas()
        keys = [f"p/{i:02d}" for i in range(10)] + ["p", "q/0"]
        for key in keys:
            cas.create(key, key.upper())
        assert cas.scan("p/") == [(k, k.upper()) for k in sorted(keys) if k.startswith("p/")]
        assert [k for k, _ in cas.scan("")] == sorted(keys)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "key", ["", ".", "..", "a/b", "%", "%2F", "a.b", "zookeeper", "ünï", "\x7f", "x" * 300]
)
def test_zookeeper_node_names(key: str) -> None:
    name = _node_name(key)
    assert "/" not in name and name not in ("", ".", "..")
    assert name.isascii() and name.isprintable()
    assert _cell_key(name) == key


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:notaport/0",
        "redis://127.0.0.1:6379/zero",
        "redis://127.0.0.1:6379/0?prefix=",
        "redis://127.0.0.1:6379/0?other=1",
        "etcd://127.0.0.1",
        "etcd://127.0.0.1:2379?x=1",
        "etcd://:pw@127.0.0.1:2379",  # a password with no user (issue 33: users are taken)
        "zk://127.0.0.1:2181/bad chroot",
        "zk://127.0.0.1:2181/ok?x=1",
        "zk://",
    ],
)
def test_a_bad_url_is_refused_when_the_engine_opens(url: str) -> None:
    with pytest.raises(InvalidArgument, match="bad store URL"):
        open_engine(url)


def test_engines_open_without_io() -> None:
    """Nobody listens on port 1: opening the engine and making its capabilities is fine, the
    first call is what fails."""
    for url in ("redis://127.0.0.1:1/0", "etcd://127.0.0.1:1", "zk://127.0.0.1:1"):
        engine = open_engine(url, timeout=0.5)
        assert engine.capabilities == {"ranges", "leases", "cas", "quorum"}
        engine.cas()
        engine.leases()
        engine.ranges()
        engine.quorum()
        engine.close()


def test_a_cell_store_shows_no_secret() -> None:
    engine = open_engine(f"redis://app:{SECRET}@127.0.0.1:1/0?prefix=p")
    cas = engine.cas()
    shown = repr(cas) + repr(vars(cas)) + cas.display_url + repr(engine)
    assert SECRET not in shown and "s3cr3t" not in shown
    engine.close()


def test_zookeeper_cells_outlive_an_expired_session(zookeeper_server: Any) -> None:
    """The engine's shared session expires (ended from outside, as the server does when it
    heard nothing for the session timeout): kazoo opens a new one, and the cells go on."""
    url = zookeeper_server.store_url("expired")
    engine = open_engine(url)
    try:
        cas = cast(ZooKeeperCasStore, engine.cas())
        cas.create("k", "0")
        client = cas._shared.get()._client
        session_id, password = client.client_id
        # Another client on the same session, closed: the server ends the session for both.
        thief = KazooClient(
            hosts=f"127.0.0.1:{zookeeper_server.port}", client_id=(session_id, password)
        )
        thief.start(timeout=10)
        thief.stop()
        thief.close()
        wait_until(lambda: (client.client_id or [session_id])[0] != session_id, 20, "a new session")

        def swapped() -> bool:
            try:
                value, version = cas.read("k") or ("", -1)
                return cas.swap("k", version, str(int(value) + 1))
            except StoreUnavailable:
                return False

        wait_until(swapped, 20, "a swap on the new session")
        assert engine.leases().identity() == cas.identity()
    finally:
        engine.close()


def test_zookeeper_writes_are_not_queued_while_disconnected() -> None:
    """With the server gone, a create or swap fails at once (kazoo would send it whenever it
    reconnects); reads wait out the timeout; everything works again once the server is back."""
    server = ZooKeeperServer()
    server.start()
    engine = open_engine(server.store_url("gone"), timeout=2.0)
    try:
        cas = cast(ZooKeeperCasStore, engine.cas())
        cas.create("k", "v")
        _, version = cas.read("k") or ("", -1)
        session = cas._shared.get()
        server.stop()
        wait_until(lambda: not session.connected(), 10, "kazoo to see the loss")
        writes: list[Callable[[], bool]] = [
            lambda: cas.swap("k", version, "w"),
            lambda: cas.create("new", "v"),
        ]
        for write in writes:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="connection lost, reconnecting"):
                write()
            assert time.monotonic() - started < 0.5
        with pytest.raises(StoreUnavailable, match="within 2 s"):
            cas.read("k")
        server.start()

        def back() -> bool:
            try:
                return cas.swap("k", version, "w")
            except StoreUnavailable:
                return False

        wait_until(back, 30, "a swap after the server came back")
        assert cas.read("new") is None  # the refused create was never sent
        assert (cas.read("k") or ("", 0))[0] == "w"
    finally:
        engine.close()
        server.close()


def test_etcd_calls_after_a_restart_use_new_connections() -> None:
    """Kept-alive connections the restarted server closed are not reused: a write after the
    restart is sent on a new connection and answered (on a dead one it would fail after
    leaving, outcome unknown); with the server down a call is not sent, and says so."""
    from server_etcd import EtcdServer

    server = EtcdServer()
    server.start()
    engine = open_engine(server.store_url("restart"), timeout=2.0)
    try:
        cas = engine.cas()
        for n in range(3):  # several connections idle in the pool
            assert cas.create(f"k{n}", "v") is True
        server.stop()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="refused"):
            cas.create("never", "v")
        assert time.monotonic() - started < 1.0
        server.start()
        probe = open_engine(server.store_url("restart"))  # back? asked on its own connections
        wait_until(lambda: works(probe.cas().read, "k0"), 20, "etcd back")
        probe.close()
        for n in range(3):  # as many calls as connections were idle: each one must succeed
            _, version = cas.read(f"k{n}") or ("", -1)
            assert cas.swap(f"k{n}", version, "w") is True
        assert cas.read("never") is None
    finally:
        engine.close()
        server.close()
