"""`idmint import leaf|tinyid`: keys made from a real Leaf or tinyid database (their own CREATE
TABLE statements, in tests/data/) on MariaDB, each above every id the peer handed out."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable
from pathlib import Path

import pymysql
import pytest

import idmint
from idmint.cli import main

from servers import MariaDBServer

DATA = Path(__file__).with_name("data")
_numbers = itertools.count(1)

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def database(mariadb: MariaDBServer, schema: str | None = None) -> str:
    """A fresh database, with the tables of tests/data/`schema` when given."""
    url = mariadb.create_database(f"peer{os.getpid()}_{next(_numbers)}")
    if schema:
        text = (DATA / schema).read_text(encoding="utf-8")
        lines = [line for line in text.splitlines() if not line.startswith("--")]
        sql(url, *(s for s in "\n".join(lines).split(";\n") if s.strip()))
    return url


def sql(url: str, *statements: str) -> None:
    host_port, db = url.split("@", 1)[1].split("/", 1)
    host, port = host_port.split(":")
    conn = pymysql.connect(host=host, port=int(port), user="root", database=db, autocommit=True)
    with contextlib.closing(conn), conn.cursor() as cur:
        for statement in statements:
            cur.execute(statement)


def table(out: str) -> dict[str, list[str]]:
    """The plan's rows by key: peer max_id, first id, step, stripes, date, time, action..."""
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["KEY", "PEER", "MAX_ID"]
    rows = {}
    for line in lines[1:]:
        if not line or line.startswith(("tokens", " ", "dry run")) or " created, " in line:
            break
        cells = line.split()
        rows[cells[0]] = cells[1:]
    return rows


def one_line_error(err: str, *words: str) -> None:
    assert err.startswith("idmint: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err


def test_leaf_dry_run_apply_then_again(mariadb: MariaDBServer, run: Run) -> None:
    leaf, store = database(mariadb, "leaf_alloc.sql"), database(mariadb)
    sql(
        leaf,
        "INSERT INTO leaf_alloc (biz_tag, max_id, step, description) VALUES "
        "('order', 1000000, 2000, 'orders'), ('ticket', 1, 500, NULL)",
    )
    code, out, err = run("import", "leaf", "--from", leaf, "--store", store)
    assert (code, err) == (0, "")
    rows = table(out)
    assert rows["order"][:4] == ["1000000", "1000001", "2000", "1"]
    assert rows["order"][6] == rows["ticket"][6] == "create"
    assert "dry run, nothing changed" in out
    with idmint.connect(store) as minter:
        assert minter.keys() == []

    code, out, err = run("import", "leaf", "--from", leaf, "--store", store, "--apply")
    assert (code, err) == (0, "")
    assert table(out)["order"][6] == "created" and "2 created, 0 there already" in out
    with idmint.connect(store) as minter:
        order = minter.segment("order")
        ids = [order.next_id() for _ in range(3)]
        assert ids == [1000001, 1000002, 1000003]  # above Leaf's max_id
        assert minter.segment("ticket").next_id() == 2
        assert minter.key("order").description == "orders"
        assert minter.key("order").step == 2000

    for again in ((), ("--apply",)):  # idempotent, with or without --apply
        code, out, err = run("import", "leaf", "--from", leaf, "--store", store, *again)
        assert (code, err) == (0, "")
        assert {row[6] for row in table(out).values()} == {"exists-same"}


def test_a_key_there_with_other_settings_is_refused_and_nothing_changes(
    mariadb: MariaDBServer, run: Run
) -> None:
    leaf, store = database(mariadb, "leaf_alloc.sql"), database(mariadb)
    sql(
        leaf,
        "INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES "
        "('order', 5000, 1000), ('user', 7000, 100), ('bad name', 1, 10), ('quo', 1, 10), "
        "('fresh', 1, 10)",
    )
    with idmint.connect(store) as minter:
        minter.add_key("order", step=50, start=9000)  # another step
        minter.add_key("user", step=100, start=10)  # below Leaf's ids
        minter.add_quorum_key("quo")  # a name is one key of one kind
    code, out, err = run("import", "leaf", "--from", leaf, "--store", store, "--apply")
    assert code == 2
    one_line_error(err, "order (conflict)", "quo (conflict)", "user (conflict)", "nothing changed")
    assert "its step is 50, not 1000" in out and "not above the peer's max_id" in out
    assert "is a quorum key" in out
    assert "refuse" in table(out)["bad"][5:]  # "bad name": not an idmint key name
    assert table(out)["fresh"][6] == "create"  # would be, were it not for the others
    with idmint.connect(store) as minter:
        assert [k.name for k in minter.keys()] == ["order", "user"]  # noqa: SIM118 - a method
        # not "fresh": nothing changed
        assert minter.key("order").step == 50
    # --key imports only the keys asked for
    assert run("import", "leaf", "--from", leaf, "--store", store, "--key", "nope")[0] == 2
    sql(leaf, "UPDATE leaf_alloc SET step = 50 WHERE biz_tag = 'order'")
    code, out, _ = run("import", "leaf", "--from", leaf, "--store", store, "--key", "order")
    assert code == 0 and list(table(out)) == ["order"]


def test_margin_and_a_peer_that_ran_past_the_import(mariadb: MariaDBServer, run: Run) -> None:
    leaf, store = database(mariadb, "leaf_alloc.sql"), database(mariadb)
    sql(leaf, "INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('order', 3000, 1000)")
    args = ("import", "leaf", "--from", leaf, "--store", store)
    code, out, _ = run(*args, "--margin", "10000", "--apply")
    assert code == 0 and table(out)["order"][:2] == ["3000", "13001"]
    sql(leaf, "UPDATE leaf_alloc SET max_id = 9000")  # Leaf, still running, took more
    code, out, _ = run(*args)
    assert code == 0 and table(out)["order"][:2] == ["9000", "13001"]
    assert table(out)["order"][6] == "exists-same"  # still above everything Leaf handed out
    sql(leaf, "UPDATE leaf_alloc SET max_id = 14000")  # past the margin: ids may repeat
    code, out, err = run(*args)
    assert code == 2 and table(out)["order"][6] == "conflict"
    one_line_error(err, "order (conflict)")


def test_the_documented_fence_stops_the_peers_next_range(mariadb: MariaDBServer, run: Run) -> None:
    """docs/migrating.md's triggers, on the peers' tables: their own range-taking statements
    (Leaf's IDAllocMapper, tinyid's TinyIdInfoDAOImpl) fail, the import still reads."""
    doc = (DATA.parent.parent / "docs" / "migrating.md").read_text(encoding="utf-8")
    fence = doc.split("```sql\n", 1)[1].split("```", 1)[0].strip().splitlines()
    leaf, tinyid = database(mariadb, "leaf_alloc.sql"), database(mariadb, "tinyid.sql")
    sql(leaf, "INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('order', 3000, 1000)")
    sql(tinyid, "INSERT INTO tiny_id_info (biz_type, max_id, step) VALUES ('order', 5, 10)")
    sql(leaf, *(s for s in fence if " ON leaf_alloc " in s))
    sql(tinyid, *(s for s in fence if " ON tiny_id_info " in s))
    with pytest.raises(pymysql.Error, match="moved to idmint"):
        sql(leaf, "UPDATE leaf_alloc SET max_id = max_id + step WHERE biz_tag = 'order'")
    with pytest.raises(pymysql.Error, match="moved to idmint"):
        sql(tinyid, "update tiny_id_info set max_id = 15, version = version + 1 where id = 1")
    code, out, _ = run("import", "leaf", "--from", leaf, "--store", database(mariadb))
    assert code == 0 and table(out)["order"][:2] == ["3000", "3001"]


def test_tinyid_delta_and_remainder_become_stripes(mariadb: MariaDBServer, run: Run) -> None:
    """tinyid on two databases, delta 2: remainder 0 in one, 1 in the other. Together they are
    every id; one alone is only the even (or odd) ones, which no idmint key is."""
    even, odd = database(mariadb, "tinyid.sql"), database(mariadb, "tinyid.sql")
    store = database(mariadb)
    row = "INSERT INTO tiny_id_info (biz_type, begin_id, max_id, step, delta, remainder) VALUES "
    sql(even, row + "('pay', 1, 200000, 1000, 2, 0), ('test', 1, 1, 100000, 1, 0)")
    sql(odd, row + "('pay', 1, 180001, 1000, 2, 1)")
    token = "0f673adf80504e2eaa552f5d791b644c"  # tinyid's sample token
    sql(
        even,
        f"INSERT INTO tiny_id_token (token, biz_type) VALUES ('{token}', 'pay'), "
        f"('{token}', 'test'), ('{token}', 'gone')",
    )

    code, out, err = run("import", "tinyid", "--from", even, "--store", store)
    assert code == 2
    one_line_error(err, "pay (refuse)")
    assert "give --from for remainder 1" in out
    assert "0f67..." in out and token not in out  # masked unless --show-tokens
    assert "not imported: gone" in out and "one token: serve with it" in out

    both = ("--from", even, "--from", odd, "--store", store)
    code, out, err = run("import", "tinyid", *both, "--apply", "--show-tokens")
    assert (code, err) == (0, "")
    rows = table(out)
    # above both databases' max_id, 0 mod 2: stripe k hands out tinyid's remainder k
    assert rows["pay"][:4] == ["200000", "200002", "500", "2"]
    assert rows["test"][:4] == ["1", "2", "100000", "1"]
    assert token in out
    with idmint.connect(store) as minter:
        pay = minter.segment("pay")
        ids = [pay.next_id() for _ in range(5)]
        assert min(ids) > 200000 and len(set(ids)) == 5
        assert minter.segment("test").next_id() == 2
    code, out, _ = run("import", "tinyid", *both)
    assert code == 0 and {r[6] for r in table(out).values()} == {"exists-same"}


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["import", "leaf", "--from", "mysql://root@127.0.0.1:1/x"], 1, ["unavailable"]),
        (["import", "leaf", "--from", "postgresql://a@b/c"], 2, ["mysql://"]),
        (["import", "snowflake", "--from", "mysql://a@b/c"], 2, ["'leaf', 'tinyid'"]),
        (["import", "leaf"], 2, ["--from"]),
        (["import", "leaf", "--from", "EMPTY"], 2, ["no such table", "Leaf's database?"]),
        (["import", "tinyid", "--from", "EMPTY"], 2, ["no such table", "tinyid's database?"]),
        (["import", "leaf", "--from", "NODB"], 2, ["no such database"]),
        (["import", "leaf", "--from", "mysql://u:s3cret@127.0.0.1:1/x"], 1, ["u:***@"]),
    ],
)
def test_bad_input_is_one_line(
    mariadb: MariaDBServer,
    run: Run,
    tmp_path: Path,
    args: list[str],
    code: int,
    words: list[str],
) -> None:
    swap = {"EMPTY": database, "NODB": lambda server: server.url("no_such_db")}
    args = [swap[a](mariadb) if a in swap else a for a in args]
    store = f"sqlite:///{tmp_path / 'idmint.db'}"
    got, out, err = run("--timeout", "1", "--store", store, *args)
    assert (got, out) == (code, "")
    one_line_error(err, *words)
    assert "s3cret" not in err
    assert not (tmp_path / "idmint.db").exists()  # a dry run makes no store
