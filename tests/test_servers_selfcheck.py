"""Self-check for tests/servers.py: real servers, start/stop/restart/kill."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pymysql
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import servers
from servers import (
    MariaDBServer,
    PostgresServer,
    ServerStartError,
    free_port,
    wait_until,
)


def _timed(label: str, fn: Callable[[], None]) -> None:
    t0 = time.perf_counter()
    fn()
    print(f"{label}: {time.perf_counter() - t0:.3f}s")


# ---------------------------------------------------------------- helpers


def pg_exec(url: str, query: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(query, params)
        return list(cur.fetchall()) if cur.description else []


def my_exec(url: str, query: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    u = urlsplit(url)
    conn = pymysql.connect(
        host=u.hostname,
        port=u.port or 3306,
        user=u.username or "root",
        database=u.path.lstrip("/"),
        autocommit=True,
    )
    try:
        with conn.cursor() as cur:
            cur.execute(query, params)
            return list(cur.fetchall())
    finally:
        conn.close()


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    # Z: a zombie; X/x: dead and being reaped. Both hold nothing.
    return stat[stat.rfind(")") + 2] in "ZXx"


# ---------------------------------------------------------------- generic


def test_free_port_distinct() -> None:
    ports = {free_port() for _ in range(50)}
    assert len(ports) == 50


def test_wait_until() -> None:
    calls: list[int] = []

    def third_call() -> bool:
        calls.append(1)
        return len(calls) >= 3

    wait_until(third_call, 5, "three calls")
    assert len(calls) == 3
    with pytest.raises(TimeoutError, match="never"):
        wait_until(lambda: False, 0.2, "never")


# ---------------------------------------------------------------- postgres


@pytest.fixture
def pg() -> Iterator[PostgresServer]:
    server = PostgresServer()
    t0 = time.perf_counter()
    server.start()
    print(f"PG cold initdb+start: {time.perf_counter() - t0:.3f}s")
    try:
        yield server
    finally:
        base = server.base_dir
        server.close()
        assert not base.exists()


def test_postgres_lifecycle(pg: PostgresServer) -> None:
    port = pg.port
    assert pg.is_running
    url = pg.create_database("selfcheck")
    assert url == f"postgresql://postgres@127.0.0.1:{port}/selfcheck"
    assert pg.url() == f"postgresql://postgres@127.0.0.1:{port}/postgres"
    assert pg_exec(url, "SELECT 1") == [(1,)]
    assert pg_exec(url, "SELECT current_user") == [("postgres",)]
    pg_exec(url, "CREATE TABLE t (id bigint PRIMARY KEY, v text)")
    pg_exec(url, "INSERT INTO t VALUES (1, 'one')")

    _timed("PG restart", pg.restart)
    assert pg.is_running
    assert pg.port == port
    assert pg_exec(url, "SELECT id, v FROM t") == [(1, "one")]

    # An open connection must see the server go away on kill().
    conn = psycopg.connect(url, autocommit=True)
    pg_exec(url, "INSERT INTO t VALUES (2, 'two')")
    old_pid = pg.pid
    assert len(servers._server_pids(pg.data_dir)) >= 5  # postmaster + children + backend
    pg.kill()
    assert servers._server_pids(pg.data_dir) == set()
    assert not pg.is_running
    assert pg.pid is None
    assert old_pid is not None
    with pytest.raises(psycopg.OperationalError):
        conn.execute("SELECT 1")
    conn.close()
    _timed("PG start after kill (crash recovery)", pg.start)
    assert pg.port == port
    assert pg_exec(url, "SELECT id FROM t ORDER BY id") == [(1,), (2,)]
    assert "redo" in pg.log_path.read_text() or "recover" in pg.log_path.read_text()

    # stop/start and idempotency
    pg.stop()
    pg.stop()
    assert not pg.is_running
    pg.start()
    pg.start()
    assert pg_exec(url, "SELECT count(*) FROM t") == [(2,)]
    assert pg_exec(url, "SHOW fsync") == [("off",)]
    assert pg_exec(url, "SHOW max_connections") == [("200",)]
    assert pg_exec(url, "SHOW listen_addresses") == [("127.0.0.1",)]


def test_postgres_kill_repeatedly(pg: PostgresServer) -> None:
    url = pg.create_database("crashy")
    pg_exec(url, "CREATE TABLE c (n int)")
    for i in range(3):
        pg_exec(url, "INSERT INTO c VALUES (%s)", (i,))
        pg.kill()
        pg.start()
    assert pg_exec(url, "SELECT count(*) FROM c") == [(3,)]


def test_postgres_runs_as_postgres_user(pg: PostgresServer) -> None:
    pid = pg.pid
    assert pid is not None
    uid = os.stat(f"/proc/{pid}").st_uid
    if os.geteuid() == 0:
        import pwd

        assert uid == pwd.getpwnam("postgres").pw_uid
    # own session / process group
    assert os.getpgid(pid) == pid


def test_postgres_context_manager_and_port_conflict() -> None:
    with PostgresServer() as a:
        # A second server told to use a's port must fail clearly.
        b = PostgresServer(port=a.port, startup_timeout=10)
        try:
            with pytest.raises(Exception, match=r"Address already in use|another server"):
                b.start()
        finally:
            b.close()
        assert a.is_running
        assert pg_exec(a.url(), "SELECT 1") == [(1,)]


# ---------------------------------------------------------------- mariadb


@pytest.fixture
def my() -> Iterator[MariaDBServer]:
    server = MariaDBServer()
    t0 = time.perf_counter()
    server.start()
    print(f"MariaDB cold install-db+start: {time.perf_counter() - t0:.3f}s")
    try:
        yield server
    finally:
        base = server.base_dir
        server.close()
        assert not base.exists()


def test_mariadb_lifecycle(my: MariaDBServer) -> None:
    port = my.port
    url = my.create_database("selfcheck")
    assert url == f"mysql://root@127.0.0.1:{port}/selfcheck"
    assert my_exec(url, "SELECT 1") == [(1,)]
    my_exec(url, "CREATE TABLE t (id BIGINT PRIMARY KEY, v VARCHAR(10)) ENGINE=InnoDB")
    my_exec(url, "INSERT INTO t VALUES (1, 'one')")

    _timed("MariaDB restart", my.restart)
    assert my.is_running
    assert my.port == port
    assert my_exec(url, "SELECT id, v FROM t") == [(1, "one")]

    my_exec(url, "INSERT INTO t VALUES (2, 'two')")
    my.kill()
    assert not my.is_running
    _timed("MariaDB start after kill (crash recovery)", my.start)
    assert my.port == port
    assert my_exec(url, "SELECT id FROM t ORDER BY id") == [(1,), (2,)]

    rows = my_exec(
        url,
        "SELECT @@innodb_flush_log_at_trx_commit, @@max_connections, "
        "@@bind_address, @@character_set_server",
    )
    assert rows == [(1, 300, "127.0.0.1", "utf8mb4")]


def test_mariadb_1000_transactions(my: MariaDBServer) -> None:
    url = my.create_database("speed")
    my_exec(url, "CREATE TABLE s (id BIGINT AUTO_INCREMENT PRIMARY KEY, v INT) ENGINE=InnoDB")
    u = urlsplit(url)
    conn = pymysql.connect(host=u.hostname, port=u.port or 3306, user="root", database="speed")
    try:
        t0 = time.perf_counter()
        with conn.cursor() as cur:
            for i in range(1000):
                cur.execute("INSERT INTO s (v) VALUES (%s)", (i,))
                conn.commit()
        print(f"MariaDB 1000 committed transactions: {time.perf_counter() - t0:.3f}s")
    finally:
        conn.close()
    assert my_exec(url, "SELECT count(*) FROM s") == [(1000,)]


def test_postgres_1000_transactions(pg: PostgresServer) -> None:
    url = pg.create_database("speed")
    pg_exec(url, "CREATE TABLE s (id bigserial PRIMARY KEY, v int)")
    with psycopg.connect(url) as conn:
        t0 = time.perf_counter()
        for i in range(1000):
            conn.execute("INSERT INTO s (v) VALUES (%s)", (i,))
            conn.commit()
        print(f"PG 1000 committed transactions: {time.perf_counter() - t0:.3f}s")
    assert pg_exec(url, "SELECT count(*) FROM s") == [(1000,)]


def test_mariadb_kill_repeatedly(my: MariaDBServer) -> None:
    url = my.create_database("crashy")
    my_exec(url, "CREATE TABLE c (n INT) ENGINE=InnoDB")
    for i in range(3):
        my_exec(url, "INSERT INTO c VALUES (%s)", (i,))
        my.kill()
        my.start()
    assert my_exec(url, "SELECT count(*) FROM c") == [(3,)]


def test_both_at_once_and_cleanup_of_dirs() -> None:
    with PostgresServer() as pg, MariaDBServer() as my:
        assert pg.port != my.port
        assert pg.base_dir.name.startswith("idmint-pg-")
        assert my.base_dir.name.startswith("idmint-mariadb-")
        dirs = [pg.base_dir, my.base_dir]
    assert not any(d.exists() for d in dirs)
    assert not pg.is_running
    assert not my.is_running


# ---------------------------------------------------------------- failure paths


def test_postgres_bad_setting_reports_log_tail() -> None:
    server = PostgresServer(extra_settings={"no_such_setting": "1"}, startup_timeout=10)
    try:
        with pytest.raises(ServerStartError) as info:
            server.start()
        print(info.value)
        assert "no_such_setting" in str(info.value)
        assert not server.is_running
    finally:
        server.close()


def test_a_cassandra_start_that_hangs_reports_its_main_thread() -> None:
    """A node whose port never looks open is stopped with its threads' stacks in the message
    (the main thread's while it still runs): where a start hung."""
    from server_cassandra import CassandraServer

    server = CassandraServer(startup_timeout=4)
    server._ready = lambda: False  # type: ignore[method-assign]
    try:
        with pytest.raises(ServerStartError) as info:
            server.start()
        print(info.value)
        assert "--- threads when it was stopped ---" in str(info.value)
        assert "java.lang.Thread.State" in str(info.value)
        assert not server.is_running
    finally:
        server.close()


def test_mariadb_bad_option_reports_log_tail() -> None:
    server = MariaDBServer(extra_options=["--no-such-option=1"], startup_timeout=10)
    try:
        with pytest.raises(ServerStartError) as info:
            server.start()
        print(info.value)
        assert "no-such-option" in str(info.value)
        assert not server.is_running
    finally:
        server.close()


@pytest.mark.parametrize("cls", [PostgresServer, MariaDBServer])
def test_lost_port_race_is_retried(
    cls: type[PostgresServer] | type[MariaDBServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        real_free_port = servers.free_port
        monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or real_free_port())
        with cls() as server:
            assert server.port != taken
            assert server.is_running
            assert "Address already in use" in server.log_path.read_text()


@pytest.mark.parametrize("cls", [PostgresServer, MariaDBServer])
def test_restart_and_kill_with_open_connections(
    cls: type[PostgresServer] | type[MariaDBServer],
) -> None:
    with cls() as server:
        url = server.create_database("held")
        execute = pg_exec if cls is PostgresServer else my_exec
        closers: list[Callable[[], None]] = []
        for _ in range(5):
            if cls is PostgresServer:
                closers.append(psycopg.connect(url).close)
            else:
                u = urlsplit(url)
                closers.append(
                    pymysql.connect(host=u.hostname, port=u.port or 0, user="root").close
                )
        t0 = time.perf_counter()
        server.restart()
        assert time.perf_counter() - t0 < 10
        assert execute(url, "SELECT 1") == [(1,)]
        before = servers._server_pids(server.data_dir)
        assert server.pid in before
        server.kill()
        assert servers._server_pids(server.data_dir) == set()
        # A process in the middle of exiting has already dropped its files and
        # working directory (so _server_pids no longer sees it) but is not a
        # zombie yet: give the kernel a moment to finish.
        servers.wait_until(
            lambda: all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in before),
            5,
            "the killed server's processes to finish exiting",
        )
        server.start()
        assert execute(url, "SELECT 1") == [(1,)]
        for close in closers:
            close()


_STARTS_A_SERVE = {
    "the tests' ServerProcess": (
        "from http_server import ServerProcess\n"
        "server = ServerProcess(sys.argv[1]).start()\n"
        "print(server.proc.pid, flush=True)\n"
    ),
    "the benchmarks' running()": (
        "sys.path.insert(0, str(ROOT / 'bench'))\n"
        "from http_bench import free_port, running\n"
        "port = free_port()\n"
        "serve = [sys.executable, '-m', 'idmint', '--store', sys.argv[1], 'serve',"
        " '--port', str(port)]\n"
        "with running(serve, f'http://127.0.0.1:{port}/livez') as proc:\n"
        "    print(proc.pid, flush=True)\n"
        "    time.sleep(60)\n"
    ),
}


@pytest.mark.parametrize("starter", sorted(_STARTS_A_SERVE))
def test_an_idmint_serve_outlives_no_killed_parent(starter: str, tmp_path: Path) -> None:
    """`idmint serve` runs in a session of its own (so a test can kill its whole group), which
    killing its parent's group does not reach: a test run or bench killed by a timeout left
    it running for good. A watchdog now kills it when its parent dies."""
    code = (
        "import sys, time\nfrom pathlib import Path\n"
        f"ROOT = Path({str(Path(__file__).resolve().parents[1])!r})\n"
        "sys.path.insert(0, str(ROOT / 'tests'))\n" + _STARTS_A_SERVE[starter] + "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, f"sqlite:///{tmp_path}/s.db"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        serve = int(parent.stdout.readline())
        assert _alive(serve)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
    wait_until(lambda: not _alive(serve), 10, f"idmint serve ({serve}) to go with its parent")


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: it holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
