"""The `idmint` command: what a user types, what they see, and the exit code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import idmint
from idmint.cli import main

from conftest import aged_sqlite_url


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'cli.db'}"


def test_the_readme_walkthrough(capsys: pytest.CaptureFixture[str], url: str) -> None:
    assert run(capsys, "--store", url, "init")[0] == 0
    code, out, _ = run(
        capsys, "--store", url, "keys", "add", "order", "--step", "1000", "--start", "100000000"
    )
    assert code == 0 and "order" in out
    code, out, _ = run(
        capsys, "--store", url, "keys", "add", "ticket", "--start", "1", "--max", "2147483647"
    )
    assert code == 0
    code, out, _ = run(capsys, "--store", url, "next", "order", "-n", "5")
    assert (code, out) == (0, "100000000\n100000001\n100000002\n100000003\n100000004\n")
    code, out, _ = run(capsys, "--store", url, "next", "order")
    assert (code, out) == (0, "100000005\n")
    code, out, _ = run(capsys, "--store", url, "keys", "list")
    assert code == 0
    assert out.splitlines()[0].split()[:3] == ["KEY", "NEXT", "STEP"]
    assert out.splitlines()[1].split()[:2] == ["order", "100000006"]
    code, out, _ = run(capsys, "--store", url, "keys", "show", "ticket", "--json")
    shown = json.loads(out)
    assert (shown["start"], shown["max"], shown["remaining"]) == (1, 2147483647, 2147483647)


def test_add_exist_ok(capsys: pytest.CaptureFixture[str], url: str) -> None:
    assert run(capsys, "--store", url, "keys", "add", "o", "--start", "9")[0] == 0
    code, out, _ = run(capsys, "--store", url, "keys", "add", "o", "--exist-ok")
    assert code == 0 and "exists" in out
    assert run(capsys, "--store", url, "next", "o")[1] == "9\n"


def test_raise(capsys: pytest.CaptureFixture[str], url: str) -> None:
    run(capsys, "--store", url, "keys", "add", "legacy")
    code, out, _ = run(capsys, "--store", url, "keys", "raise", "legacy", "--to", "5000")
    assert code == 0 and "5000" in out
    code, out, _ = run(capsys, "--store", url, "keys", "raise", "legacy", "--to", "10")
    assert code == 0 and "unchanged" in out
    assert run(capsys, "--store", url, "next", "legacy")[1] == "5000\n"


def test_env_var_names_the_store(
    capsys: pytest.CaptureFixture[str], url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IDMINT_STORE", url)
    run(capsys, "keys", "add", "e", "--start", "42")
    assert run(capsys, "next", "e")[1] == "42\n"


def test_exhausted_key_prints_what_it_got_then_fails(
    capsys: pytest.CaptureFixture[str], url: str
) -> None:
    run(capsys, "--store", url, "keys", "add", "tiny", "--start", "1", "--max", "3")
    code, out, err = run(capsys, "--store", url, "next", "tiny", "-n", "5")
    assert (code, out) == (1, "1\n2\n3\n")
    assert err.count("\n") == 1 and "exhausted" in err
    code, out, err = run(capsys, "--store", url, "next", "tiny")
    assert (code, out) == (1, "") and "exhausted" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["next", "nope"], "not found"),
        (["next", "order", "-n", "0"], "count must be"),
        (["next", "order", "-n", "-3"], "count must be"),
        (["next", "order", "-n", "lots"], "not a valid integer"),
        (["next", "order", "-n", "2000000000"], "count must be an integer from 1 to 1000000"),
        (["keys", "add", "x", "--max-batch", "10000001"], "max_batch must be"),
        (["keys", "set", "order", "--max-batch", "-1"], "max_batch must be"),
        (["keys", "set", "nope", "--max-batch", "5"], "not found"),
        (["next"], "Missing argument"),
        (["keys", "add", "bad name"], "bad key name"),
        (["keys", "add", "x", "--start", "10", "--max", "5"], "below start"),
        (["keys", "add", "x", "--step", "0"], "step must be"),
        (["keys", "add", "order"], "already exists"),
        (["keys", "raise", "order", "--to", "-1"], "--to': -1 is not in the range"),
        (["keys", "show", "nope"], "not found"),
        (["frobnicate"], "No such command"),
        (["--store", "oracle://x", "next", "order"], "bad store URL"),
        (["--store", "sqlite:///no/such/dir/x.db", "keys", "add", "order"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], url: str, args: list[str], message: str
) -> None:
    run(capsys, "--store", url, "keys", "add", "order")
    if args[0] != "--store":
        args = ["--store", url, *args]
    code, out, err = run(capsys, *args)
    assert code == 2, err
    assert out == ""
    assert err.startswith("idmint: error: ") and err.count("\n") == 1, err
    assert message in err


@pytest.mark.parametrize(
    "url", ["postgresql://idmint@127.0.0.1:1/x", "mysql://idmint@127.0.0.1:1/x"]
)
def test_unreachable_store_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], url: str
) -> None:
    code, out, err = run(capsys, "--store", url, "--timeout", "1", "next", "order")
    assert (code, out) == (1, "")
    assert err.startswith("idmint: error: store ") and "unavailable" in err
    assert err.count("\n") == 1


def test_password_never_printed(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "--store", "postgresql://u:s3cret@127.0.0.1:1/x", "next", "k")
    assert code == 1 and "s3cret" not in err and "u:***@" in err


def test_next_refuses_a_huge_count_before_taking_anything(
    capsys: pytest.CaptureFixture[str], url: str
) -> None:
    # A typo of a few zeros used to burn the whole key (and then die of MemoryError).
    run(capsys, "--store", url, "keys", "add", "small", "--max", "1500000")
    code, out, err = run(capsys, "--store", url, "next", "small", "-n", "1500000")
    assert (code, out) == (2, "") and "count must be an integer from 1 to 1000000" in err
    code, out, _ = run(capsys, "--store", url, "keys", "show", "small", "--json")
    assert json.loads(out)["remaining"] == 1_500_000  # nothing was taken


def test_next_prints_a_million_ids_without_holding_them(url: str) -> None:
    # Peak memory of the command itself (VmHWM: ru_maxrss would count the memory of pytest,
    # which forked it): the ids go out in chunks, not as one string.
    script = (
        "import re, sys\n"
        "from idmint.cli import main\n"
        "def peak():\n"
        "    status = open('/proc/self/status').read()\n"
        "    return int(re.search(r'VmHWM:\\s+(\\d+)', status).group(1))\n"
        f"main(['--store', {url!r}, 'keys', 'add', 'big'])\n"
        "sys.stdout.flush()\n"
        "before = peak()\n"
        f"code = main(['--store', {url!r}, 'next', 'big', '-n', '1000000'])\n"
        "sys.stdout.flush()\n"
        "print(code, peak() - before, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    lines = done.stdout.splitlines()
    assert lines[1:] == [str(i) for i in range(1, 1_000_001)]
    code, grown_kib = map(int, done.stderr.split())
    assert code == 0
    assert grown_kib < 20_000, f"{grown_kib} KiB more for the ids"  # joined at once: ~75 MB


def test_keys_batch_cap(capsys: pytest.CaptureFixture[str], url: str) -> None:
    assert (
        run(capsys, "--store", url, "keys", "add", "c", "--step", "10", "--max-batch", "50")[0] == 0
    )
    code, out, _ = run(capsys, "--store", url, "keys", "show", "c", "--json")
    assert (json.loads(out)["max_batch"], json.loads(out)["batch_cap"]) == (50, 50)
    code, out, _ = run(capsys, "--store", url, "keys", "set", "c", "--max-batch", "0")
    assert (code, out) == (
        0,
        "c: at most 1000 ids per HTTP request (the default, the step x 100)\n",
    )
    code, out, _ = run(capsys, "--store", url, "keys", "list")
    assert out.splitlines()[0].split()[6:8] == ["BATCH", "CAP"] and " 1000 " in out


def test_python_dash_m_and_no_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "IDMINT_STORE": f"sqlite:///{tmp_path / 'm.db'}"}

    def python_m(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "idmint", *args],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )

    ok = python_m("keys", "add", "m")
    assert ok.returncode == 0, ok.stderr
    bad = python_m("next", "m", "-n", "x")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert python_m("next", "m", "-n", "2").stdout == "1\n2\n"


def test_on_postgres_and_mariadb(capsys: pytest.CaptureFixture[str], shared_store_url: str) -> None:
    assert run(capsys, "--store", shared_store_url, "keys", "add", "o", "--start", "7")[0] == 0
    assert run(capsys, "--store", shared_store_url, "next", "o", "-n", "2")[1] == "7\n8\n"


def test_store_after_the_command(capsys: pytest.CaptureFixture[str], url: str) -> None:
    assert run(capsys, "keys", "add", "late", "--store", url, "--start", "3")[0] == 0
    assert run(capsys, "next", "late", "--store", url, "--timeout", "5")[1] == "3\n"
    # After the command wins over before it.
    code, _, err = run(
        capsys, "--store", "sqlite:////no/such/dir.db", "next", "late", "--store", url
    )
    assert code == 0, err


def test_snowflake_decode_and_workers(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, url: str
) -> None:
    code, out, err = run(capsys, "snowflake", "-n", "5", "--store", url, "-v")
    assert code == 0, err
    # A new store makes the first ids wait a ttl: said, not 10 s of silence (as on main).
    assert "waiting 10.0 s before the first id: the lease store" in caplog.text
    ids = [int(x) for x in out.split()]
    assert len(ids) == 5 and ids == sorted(ids)
    assert re.fullmatch(
        r"worker 0 of namespace 'default'; layout twitter, \d+\.\d years of time bits left; "
        r"this host's clock is [+-]\d+ ms \(±\d+\) off the store's\n",
        err,
    ), err
    code, out, _ = run(capsys, "decode", str(ids[0]), "--json")
    decoded = json.loads(out)
    assert decoded["worker"] == 0 and decoded["sequence"] == 0
    code, out, _ = run(capsys, "decode", "1861905812123455488")
    assert "worker 425" in out and "2024-11-27" in out
    code, out, _ = run(capsys, "workers", "list", "--store", url)
    assert code == 0 and out.splitlines()[1].split()[:4] == ["0", "leased", "-", "free"]
    for bad, message in (
        (["decode", "x1"], "not an id"),
        (["snowflake", "-n", "0"], "count"),
        (["snowflake", "--layout", "nope"], "unknown layout"),
        (["snowflake", "--state", "w.json"], "static worker id"),
    ):
        code, out, err = (
            run(capsys, *bad, "--store", url) if bad[0] != "decode" else run(capsys, *bad)
        )
        assert code == 2 and message in err and err.count("\n") == 1, err


def test_static_worker_from_the_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    url = aged_sqlite_url(tmp_path / "aged.db")
    state = str(tmp_path / "w9.json")
    code, _, err = run(capsys, "snowflake", "--worker-id", "9", "--state", state, "--store", url)
    assert code == 0, err
    assert json.loads(Path(state).read_text())["worker_id"] == 9


def test_striped_keys(capsys: pytest.CaptureFixture[str], url: str) -> None:
    code, out, _ = run(capsys, "--store", url, "keys", "add", "order", "--stripes", "5")
    assert (code, out) == (0, "added order: ids 1..9223372036854775802, step 1000, 5 stripes\n")
    code, out, _ = run(capsys, "--store", url, "keys", "add", "order", "--exist-ok")
    assert out == "order exists: ids 1..9223372036854775802, step 1000, 5 stripes\n"
    # Ten ids of one stripe, five apart; then of stripe 3: 4, 9, 14, ...
    code, out, _ = run(capsys, "--store", url, "next", "order", "-n", "10")
    first = [int(i) for i in out.split()]
    assert code == 0 and len(first) == 10
    assert first == list(range(first[0], first[0] + 50, 5)) and first[0] <= 5
    code, out, _ = run(capsys, "--store", url, "next", "order", "-n", "3", "--stripe", "3")
    assert code == 0 and [int(i) for i in out.split()] == (
        [54, 59, 64] if first[0] == 4 else [4, 9, 14]
    )
    code, out, _ = run(capsys, "--store", url, "keys", "show", "order", "--json")
    shown = json.loads(out)
    assert shown["stripes"] == 5 and len(shown["stripe_next"]) == 5
    assert shown["stripe_next"][first[0] - 1] == first[-1] + 5
    assert shown["stripe_next"][3] == (69 if first[0] == 4 else 19)
    code, out, _ = run(capsys, "--store", url, "keys", "show", "order")
    assert "stripes:     5\n" in out
    assert f"stripe_next: {' '.join(map(str, shown['stripe_next']))}\n" in out
    code, out, _ = run(capsys, "--store", url, "keys", "list")
    header, row = out.splitlines()
    assert header.split()[6:9] == ["BATCH", "CAP", "STRIPES"]
    assert row.split()[:2] == ["order", str(min(shown["stripe_next"]))]
    assert row.split()[7] == "5"
    code, out, _ = run(capsys, "--store", url, "keys", "list", "--json")
    assert json.loads(out)["stripe_next"] == shown["stripe_next"]
    # Raising a striped key moves every stripe, each onto its own ids.
    code, out, _ = run(capsys, "--store", url, "keys", "raise", "order", "--to", "1000")
    assert (code, out) == (0, "order: the next range starts at 1000\n")
    code, out, _ = run(capsys, "--store", url, "keys", "show", "order", "--json")
    assert json.loads(out)["stripe_next"] == [1001, 1002, 1003, 1004, 1000]
    code, out, _ = run(capsys, "--store", url, "keys", "raise", "order", "--to", "10")
    assert (code, out) == (0, "order: unchanged, the next range already starts at 1000\n")


def test_next_on_a_small_striped_key(capsys: pytest.CaptureFixture[str], url: str) -> None:
    # 12 ids on 3 stripes of 4 (stripe 1: 2, 5, 8, 11). Past a stripe's end `next` goes on
    # with another stripe; a stripe asked for stays that stripe.
    run(capsys, "--store", url, "keys", "add", "s", "--max", "12", "--stripes", "3")
    code, out, err = run(capsys, "--store", url, "next", "s", "-n", "6", "--stripe", "1")
    assert (code, out) == (1, "2\n5\n8\n11\n")
    assert err == "idmint: error: stripe 1 of key 's' is exhausted: every id is used\n"
    code, out, err = run(capsys, "--store", url, "next", "s", "-n", "7")
    got = [int(i) for i in out.split()]
    assert code == 0 and len(got) == 7, err
    code, out, err = run(capsys, "--store", url, "next", "s", "-n", "5")
    got += [int(i) for i in out.split()]
    assert code == 1 and sorted(got) == [1, 3, 4, 6, 7, 9, 10, 12]
    assert err == "idmint: error: key 's' is exhausted: every id up to its maximum 12 is used\n"
    code, out, err = run(capsys, "--store", url, "keys", "show", "s", "--json")
    assert json.loads(out)["remaining"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stripes", "0"], "stripes must be an integer from 1 to 1024, not 0"),
        (["--stripes", "1025"], "stripes must be an integer from 1 to 1024, not 1025"),
        (["--stripes", "-2"], "stripes must be an integer from 1 to 1024, not -2"),
        (["--stripes", "many"], "'many' is not a valid integer"),
        (
            ["--stripes", "5", "--start", "1", "--max", "4"],
            "a key with 5 stripes needs at least 5 ids; [1, 4] has 4",
        ),
        (["--stripes", "5", "--max", str(2**63 - 2)], "max must be an integer from 0 to"),
    ],
)
def test_bad_stripes_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], url: str, args: list[str], message: str
) -> None:
    code, out, err = run(capsys, "--store", url, "keys", "add", "x", *args)
    assert (code, out) == (2, "")
    assert err.startswith("idmint: error: ") and err.count("\n") == 1 and message in err, err
    assert run(capsys, "--store", url, "keys", "show", "x")[0] == 2  # not made


@pytest.mark.parametrize("stripe", ["3", "-1", "1024"])
def test_next_on_a_stripe_the_key_lacks(
    capsys: pytest.CaptureFixture[str], url: str, stripe: str
) -> None:
    run(capsys, "--store", url, "keys", "add", "s", "--stripes", "3")
    code, out, err = run(capsys, "--store", url, "next", "s", "--stripe", stripe)
    assert (code, out) == (2, "")
    assert err == (
        "idmint: error: stripe must be an integer from 0 to 2 (the key has 3 stripes), "
        f"not {stripe}\n"
    )
    code, out, _ = run(capsys, "--store", url, "keys", "show", "s", "--json")
    assert json.loads(out)["stripe_next"] == [1, 2, 3]  # nothing taken


def test_datacenter_keys(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """dc add / next --dc / status / retire / set, with each datacenter on its own SQLite file;
    bad input is one line and exit 2, and takes nothing."""
    top = f"sqlite:///{tmp_path}/global.db"
    eu = ("--dc", "eu", "--dc-store", f"sqlite:///{tmp_path}/eu.db")
    us = ("--dc", "us", "--dc-store", f"sqlite:///{tmp_path}/us.db")
    code, out, _ = run(
        capsys,
        "--store",
        top,
        "dc",
        "add",
        "order",
        "--max",
        "99999",
        "--dc-runway",
        "2h",
        "--min-reservation",
        "1000",
    )
    assert (code, out) == (0, "added datacenter key order: ids 1..99999, step 1000\n")
    assert run(capsys, "--store", top, "next", "order", "-n", "3", *eu)[:2] == (0, "1\n2\n3\n")
    code, out, _ = run(capsys, "--store", top, "next", "order", "-n", "1500", *us)
    assert code == 0
    assert out.split() == [str(i) for i in range(1001, 2001)] + [
        str(i) for i in range(2001, 2501)
    ]  # across the end of the first reservation
    code, out, _ = run(capsys, "--store", top, "dc", "status", "order", "--json", *eu)
    shown = {row["dc"]: row for row in map(json.loads, out.splitlines())}
    assert shown["eu"]["next_id"] == 4 and shown["eu"]["seen_from"] == "local"
    assert shown["us"]["grants"] >= 2 and shown["us"]["seen_from"] == "global"
    code, out, _ = run(capsys, "--store", top, "dc", "retire", "order", *eu)
    assert (code, out) == (0, "order: datacenter eu retired; gave back 4..1000\n")
    code, _, err = run(capsys, "--store", top, "next", "order", *eu)
    assert code == 1 and "retired" in err and err.count("\n") == 1
    code, _, err = run(capsys, "--store", top, "dc", "set", "order", "--runway", "3x")
    assert code == 2 and "is not a duration" in err
    code, _, err = run(capsys, "--store", top, "next", "order", "--dc", "eu")
    assert code == 2 and "--dc-store" in err
    code, _, err = run(
        capsys,
        "--store",
        top,
        "next",
        "order",
        "--dc",
        "e u",
        "--dc-store",
        f"sqlite:///{tmp_path}/x.db",
    )
    assert code == 2 and "bad datacenter name" in err
    code, out, _ = run(capsys, "--store", top, "dc", "set", "order", "--runway", "48h")
    assert code == 0 and "runway 48 h" in out


LONG_NAME = "a" * 255


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--timeout", "NaN", "keys", "list"], {}, "'NaN' is not a finite number"),
        (["--timeout", "inf", "keys", "list"], {}, "'inf' is not a finite number"),
        (["keys", "list"], {"IDMINT_TIMEOUT": "nan"}, "bad IDMINT_TIMEOUT='nan'"),
        (["next", "k", "--stripe", "9223372036854775808"], {}, "--stripe"),
        (["keys", "raise", "k", "--to", str(2**64)], {}, "--to"),
        (["workers", "unreserve", str(2**64)], {}, "WORKER_ID"),
        (["keys", "list", "--store", f"sqlite:///{LONG_NAME}.db"], {}, "File name too long"),
        (["serve", "--timeout", "nan"], {}, "'nan' is not a finite number"),
        (["serve", "--shutdown-timeout", "inf"], {}, "--shutdown-timeout"),
        (["serve", "--port", "1"], {"IDMINT_WAIT": "nan"}, "wait (IDMINT_WAIT) must be a finite"),
        (["serve", "--id-budget-days", "nan"], {}, "--id-budget-days"),
        (["dc", "add", "d", "--runway", "nan"], {}, "--runway"),
    ],
)
def test_numbers_out_of_range_get_one_line_and_exit_2(
    argv: list[str],
    env: dict[str, str],
    says: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On main `--timeout NaN` (and IDMINT_WAIT=nan for serve), a stripe past 2**63 and a
    255-byte SQLite file name ended in tracebacks; a bad environment variable was reported as
    a bad flag."""
    monkeypatch.chdir(tmp_path)
    store = ["--store", f"sqlite:///{tmp_path / 'a.db'}"] if "--store" not in argv else []
    assert main(["--store", f"sqlite:///{tmp_path / 'a.db'}", "keys", "add", "k"]) == 0
    capsys.readouterr()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main([*store, *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_keys_add_exist_ok_refuses_a_key_that_differs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On main `--exist-ok` accepted an existing key whatever its settings: a set-up script
    asking for ids from 200000000 got a key handing out ids from 100000000."""
    store = ["--store", f"sqlite:///{tmp_path / 'a.db'}"]
    add = [*store, "keys", "add", "order", "--exist-ok"]
    assert main([*add, "--start", "100000000"]) == 0
    assert main([*add, "--start", "100000000"]) == 0  # the same: fine, again and again
    capsys.readouterr()
    for extra, says in (
        (["--start", "200000000"], "hands out ids from 100000000, not 200000000"),
        (["--start", "100000000", "--max", "2147483647"], "largest id is"),
        (["--start", "100000000", "--stripes", "2"], "1 stripes, not 2"),
        (["--start", "100000000", "--step", "5"], "step is 1000, not 5"),
    ):
        assert main([*add, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    assert main([*store, "keys", "raise", "order", "--to", "300000000"]) == 0
    assert main([*add, "--start", "100000000"]) == 0  # raised since: still above what it asked


def test_ctrl_c_during_next_gives_back_what_was_not_printed(tmp_path: Path) -> None:
    """On main Ctrl-C during `next -n 1000000` burnt the unprinted rest (about 657k ids)
    silently. Now the ids never printed go back to the key (nobody took a range after them)
    and stderr says so."""
    import signal

    url = f"sqlite:///{tmp_path / 'a.db'}"
    assert main(["--store", url, "keys", "add", "k"]) == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "idmint", "--store", url, "next", "k", "-n", "1000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    printed = [int(proc.stdout.readline()) for _ in range(1000)]  # the pipe fills: it waits
    proc.send_signal(signal.SIGINT)
    rest = proc.stdout.read()
    err = proc.stderr.read()
    assert proc.wait(30) == 130, err
    last = int(rest.split()[-1]) if rest.split() else printed[-1]
    match = re.search(r"interrupted: ([\d,]+) ids not printed, given back", err)
    assert match and int(match[1].replace(",", "")) > 900_000, err
    assert "Traceback" not in err
    run_next = subprocess.run(
        [sys.executable, "-m", "idmint", "--store", url, "next", "k"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    following = int(run_next.stdout)
    assert last < following <= last + 10_001  # at most the chunk being written is skipped


def test_next_in_another_directory_makes_no_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On main `idmint next order` run from another directory silently made an empty
    ./idmint.db there, and said the key was not found."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("IDMINT_STORE", raising=False)
    assert main(["next", "order"]) == 2
    err = capsys.readouterr().err
    assert f"no store at {tmp_path / 'idmint.db'}" in err and err.count("\n") == 1, err
    assert not (tmp_path / "idmint.db").exists()


def test_a_mistyped_key_or_setting_gets_a_did_you_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from idmint.server.config import ServerConfig, read_config_file

    store = ["--store", f"sqlite:///{tmp_path / 'a.db'}"]
    assert main([*store, "keys", "add", "order"]) == 0
    assert main([*store, "quorum", "add", "receipt"]) == 0
    capsys.readouterr()
    assert main([*store, "next", "ordr"]) == 2
    assert "(did you mean order?)" in capsys.readouterr().err
    assert main([*store, "keys", "show", "reciept"]) == 2
    assert "(did you mean receipt?)" in capsys.readouterr().err
    config = tmp_path / "idmint.toml"
    config.write_text("[server]\nworkrs = 2\n")
    with pytest.raises(idmint.InvalidArgument, match=r"workrs \(did you mean workers\?\)"):
        read_config_file(config)
    monkeypatch.setenv("IDMINT_TIMOUT", "3")
    [hint] = [v for v in ServerConfig.unknown_env() if v.startswith("IDMINT_TIMOUT")]
    assert hint.startswith("IDMINT_TIMOUT (did you mean IDMINT_TIMEOUT or"), hint


def test_keys_retire(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = ["--store", f"sqlite:///{tmp_path / 'a.db'}"]
    assert main([*store, "keys", "add", "old", "--max", "100"]) == 0
    assert main([*store, "next", "old", "-n", "3"]) == 0
    capsys.readouterr()
    assert main([*store, "keys", "retire", "old"]) == 2
    assert "cannot be undone: add --yes" in capsys.readouterr().err
    assert main([*store, "keys", "retire", "old", "--yes"]) == 0
    assert "retired old" in capsys.readouterr().out
    assert main([*store, "next", "old"]) == 1
    assert "is retired" in capsys.readouterr().err
    assert main([*store, "keys", "show", "old"]) == 0
    assert "retired:" in capsys.readouterr().out


def test_the_cli_reads_the_servers_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On main the CLI could not read the server's idmint.toml: `keys add` run elsewhere
    landed in another store than the server's."""
    served = tmp_path / "srv" / "ids.db"
    served.parent.mkdir()
    config = tmp_path / "idmint.toml"
    config.write_text(f'[server]\nstore = "sqlite:///{served}"\ntimeout = 3\nport = 8081\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["--config", str(config), "keys", "add", "order"]) == 0
    monkeypatch.setenv("IDMINT_CONFIG", str(config))
    assert main(["next", "order"]) == 0
    assert capsys.readouterr().out.split()[-1] == "1"
    assert served.exists() and not (elsewhere / "idmint.db").exists()
    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert main(["--store", other, "keys", "add", "x"]) == 0  # a flag beats the file
    assert (tmp_path / "other.db").exists()


def test_the_store_url_from_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # IDMINT_STORE_FILE keeps a URL with its password out of `ps` and shell history.
    secret = tmp_path / "store-url"
    secret.write_text(f"sqlite:///{tmp_path / 'a.db'}\n")  # the newline echo adds
    monkeypatch.delenv("IDMINT_STORE", raising=False)
    monkeypatch.setenv("IDMINT_STORE_FILE", str(secret))
    assert main(["keys", "add", "order", "--start", "7"]) == 0
    assert main(["next", "order"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "7"
    assert main(["--store", "memory://", "keys", "list"]) == 0  # a flag beats the file
    monkeypatch.setenv("IDMINT_STORE", "memory://")
    assert main(["keys", "list"]) == 2
    assert "IDMINT_STORE and IDMINT_STORE_FILE are both set" in capsys.readouterr().err
    monkeypatch.delenv("IDMINT_STORE")
    monkeypatch.setenv("IDMINT_STORE_FILE", str(tmp_path / "missing"))
    assert main(["keys", "list"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read IDMINT_STORE_FILE" in err, err


def test_serve_has_an_option_for_each_flagged_setting_of_server_config() -> None:
    # serve's options are built from ServerConfig's fields (their Flag): none is restated.
    import click

    from idmint.cli import cli
    from idmint.server.config import FLAGS, SETTINGS, env_variable

    options = {p.name: p for p in cli.commands["serve"].params if isinstance(p, click.Option)}
    assert set(options) == {*FLAGS, "store", "timeout", "config_file"}
    for name, (flag, default) in FLAGS.items():
        assert options[name].help == flag.describe(name, default)
        assert "{" not in (options[name].help or "")  # every placeholder filled in
        assert options[name].envvar == (env_variable(name) if flag.env else None)
    # These come from the environment or the file only (store and timeout: the shared options).
    assert SETTINGS - set(FLAGS) == {
        "store",
        "timeout",
        "wait",
        "max_step",
        "preload_at",
        "snowflake_layout",
        "snowflake_namespace",
    }


def test_every_flag_of_serve_reaches_the_server_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from idmint.server.config import FLAGS, ServerConfig

    served: list[ServerConfig] = []
    monkeypatch.setattr("idmint.server.run.serve", served.append)
    texts = {
        "host": "localhost",
        "token": "admin-token",
        "client_token": "client-token",
        "dc": "eu",
        "dc_store": f"sqlite:///{tmp_path / 'eu.db'}",
        "quorum": ",".join(f"sqlite:///{tmp_path / n}.db" for n in "abc"),
        "tokens": str(tmp_path / "tokens.toml"),  # paths: run.serve, which reads them, is off
        "tls_cert": str(tmp_path / "cert.pem"),
        "tls_key": str(tmp_path / "key.pem"),
    }
    args: list[str] = []
    wanted: dict[str, object] = {}
    for name, (flag, default) in FLAGS.items():  # each one off its default
        option = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            args.append(option if not default else "--no-" + option[2:])
            wanted[name] = not default
        else:
            value = texts.get(name) or next((c for c in flag.choices if c != default), None)
            value = value or type(default)(default + 1)
            args += [option, str(value)]
            wanted[name] = value
    assert main(["--store", f"sqlite:///{tmp_path / 's.db'}", "serve", *args]) == 0, (
        capsys.readouterr().err
    )
    assert {name: getattr(served[0], name) for name in wanted} == wanted


def test_a_retired_key_shows_as_retired(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 31: on main `next` said a retired key's every id "is used" (3 of 100 were),
    `keys list` showed it as any key, with its floor past its max as FIRST, and `keys show`
    gave that floor as its start. The store keeps no other start: retiring moved it."""
    store = ["--store", f"sqlite:///{tmp_path / 'a.db'}"]
    assert main([*store, "keys", "add", "old", "--start", "10", "--max", "100"]) == 0
    assert main([*store, "keys", "add", "new"]) == 0
    assert main([*store, "next", "old", "-n", "3"]) == 0
    assert main([*store, "keys", "retire", "old", "--yes"]) == 0
    capsys.readouterr()
    code, out, err = run(capsys, *store, "next", "old")
    assert (code, out) == (1, "")
    assert err == (
        "idmint: error: key 'old' is retired (its ids ran to 100; none is handed out again)\n"
    )
    code, out, _ = run(capsys, *store, "keys", "list")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert rows["old"][1] == "(retired)" and rows["old"][4] == "-"  # FIRST: not kept
    assert rows["new"][1:2] == ["1"]
    code, out, _ = run(capsys, *store, "keys", "show", "old")
    assert "start:       not kept (retiring moved it past max, to 101)\n" in out
    assert "retired:     yes: it hands out no id again" in out
    code, out, _ = run(capsys, *store, "keys", "show", "new")
    assert "start:       1\n" in out and "retired" not in out


def test_help_and_negative_ids(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 31: `keys` help named add, list, show and raise only; `next --help` printed the
    stripe's range as two 19-digit numbers and said quorum keys take no --store (they are
    read from it); `decode -1` was "No such option"."""
    from idmint.cli.keys import keys

    code, out, _ = run(capsys, "keys", "--help")
    summary = out.split("\n\n")[1].lower()
    for name in keys.commands:
        assert name in summary, (name, summary)
    code, out, _ = run(capsys, "next", "--help")
    assert code == 0 and not re.search(r"\d{19}", out) and "no --store" not in out
    assert "--store holds its name and bounds" in " ".join(out.split())
    for argv in (["decode", "-1"], ["decode", "--", "-1"], ["decode", "5", "-1"]):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (2, "")
        assert err == "idmint: error: '-1' is not an id: ids are non-negative integers\n", argv
    code, out, err = run(capsys, "decode", "5", "--jsn")
    assert code == 2 and "No such option '--jsn'" in err and "'--json'" in err
    code, out, _ = run(capsys, "decode", "--layout", "sonyflake", "5", "--json")
    assert code == 0 and json.loads(out)["worker"] == 5
