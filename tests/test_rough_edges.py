"""What a newcomer hit (issue 12's list), each pinned by a test: bad input is one line on stderr
and exit code 2, never a traceback; settings are read from where the docs say; nothing is
created by a command that only reads."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

import idmint
from idmint import InvalidArgument
from idmint.cli import main
from idmint.server import App, ServerConfig
from idmint.server.run import listen_address

from test_app import call


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, _, err = run(capsys, *args)
    assert code == 2, (code, err)
    assert err.startswith("idmint: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def in_tmp(tmp_path: Path) -> Any:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(cwd)


def test_serve_reads_every_setting_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    served: list[ServerConfig] = []
    monkeypatch.setattr("idmint.server.run.serve", served.append)
    store = f"sqlite:///{tmp_path / 's.db'}"
    for name, value in (
        ("IDMINT_WAIT", "2.5"),
        ("IDMINT_MAX_STEP", "5000"),
        ("IDMINT_PRELOAD_AT", "0.3"),
        ("IDMINT_SNOWFLAKE_LAYOUT", "sonyflake"),
        ("IDMINT_SNOWFLAKE_NAMESPACE", "eu"),
        ("IDMINT_REFILL_THREADS", "8"),
        ("IDMINT_WARM_KEYS", "0"),
    ):
        monkeypatch.setenv(name, value)
    assert run(capsys, "--store", store, "serve")[0] == 0
    config = served[0]
    assert (config.wait, config.max_step, config.preload_at) == (2.5, 5000, 0.3)
    assert (config.snowflake_layout, config.snowflake_namespace) == ("sonyflake", "eu")
    assert (config.refill_threads, config.warm_keys) == (8, 0)
    (tmp_path / "idmint.toml").write_text("[server]\nwait = 9\nport = 9000\n")
    run(capsys, "--store", store, "serve", "--config", str(tmp_path / "idmint.toml"))
    assert (served[1].wait, served[1].port) == (2.5, 9000)  # the environment beats the file
    for name, value, reason in (
        ("IDMINT_WAIT", "abc", "bad value for wait: 'abc'"),
        ("IDMINT_SNOWFLAKE_LAYOUT", "nope", "unknown layout 'nope'"),
        ("IDMINT_REFILL_THREADS", "0", "refill threads must be from 1 to 256, not 0"),
        ("IDMINT_WARM_KEYS", "-1", "warm_keys must be from 0 to 1000000, not -1"),
    ):
        monkeypatch.setenv(name, value)
        assert reason in one_line_error(capsys, "--store", store, "serve")
        monkeypatch.delenv(name)


def test_serve_listens_on_a_host_name_and_refuses_a_bad_one() -> None:
    assert listen_address("localhost", 8080) in ("127.0.0.1", "::1")
    assert listen_address("::1", 8080) == "::1"
    assert listen_address("0.0.0.0", 8080) == "0.0.0.0"
    for bad in ("999.1.1.1", "no-such-host.invalid", "a" * 300):
        with pytest.raises(InvalidArgument, match=f"cannot listen on {bad[:20]}"):
            listen_address(bad, 8080)


def test_unicode_digits_are_not_ids_nor_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert "'²' is not an id" in one_line_error(capsys, "decode", "²")
    err = one_line_error(capsys, "--store", "redis://127.0.0.1:6379/²", "keys", "list")
    assert "the database must be a number" in err


def test_bare_groups_print_their_whole_help(capsys: pytest.CaptureFixture[str]) -> None:
    for args in ((), ("keys",), ("dc",)):
        code, out, err = run(capsys, *args)
        assert code == 2 and not err
        assert out.startswith("Usage: idmint") and out.count("\n") > 5, out


def test_store_urls_that_are_wrong_say_so(capsys: pytest.CaptureFixture[str], in_tmp: Path) -> None:
    assert "the store URL is empty" in one_line_error(capsys, "--store", "", "keys", "list")
    err = one_line_error(capsys, "--store", "sqlite:///x.db?mode=ro", "init")
    assert "takes no parameters" in err
    (in_tmp / "notes.db").write_text("not a database")
    err = one_line_error(capsys, "--store", "sqlite:///notes.db", "keys", "list")
    assert "notes.db is not a SQLite database" in err
    err = one_line_error(capsys, "--store", "postgresql://u@127.0.0.1:99999/db", "keys", "list")
    assert "port '99999' is not a number from 1 to 65535" in err
    assert sorted(p.name for p in in_tmp.iterdir()) == ["notes.db"]  # no x.db?mode=ro


def test_commands_that_only_read_create_no_store(
    capsys: pytest.CaptureFixture[str], in_tmp: Path
) -> None:
    for args in (
        ("keys", "list"),
        ("keys", "show", "k"),
        ("workers", "list"),
        ("dc", "list"),
        ("next", "k"),
    ):
        assert f"no store at {in_tmp / 'idmint.db'}" in one_line_error(capsys, *args)
    assert not (in_tmp / "idmint.db").exists()
    assert run(capsys, "init")[0] == 0
    assert run(capsys, "keys", "list")[0] == 0


def test_a_driver_logs_nothing_before_the_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--store", "zk://127.0.0.1:1/x", "--timeout", "1", "keys", "list")
    assert code == 1 and not out
    assert err.count("\n") == 1 and "unavailable" in err, err


def test_decoding_a_negative_id_over_http_says_it_is_not_an_id(tmp_path: Path) -> None:
    app = App(ServerConfig(store=f"sqlite:///{tmp_path / 'a.db'}"))
    got = call(app, "GET", "/v1/snowflake/decode/-1")
    assert got.status_code == 400 and "'-1' is not an id" in got.text


ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_names_every_error_and_the_exports_it_uses() -> None:
    import idmint

    readme = (ROOT / "README.md").read_text()
    errors = [
        name
        for name in idmint.__all__
        if isinstance(getattr(idmint, name), type)
        and issubclass(getattr(idmint, name), idmint.IdmintError)
    ]
    assert len(errors) > 10
    missing = [name for name in errors if f"`{name}`" not in readme]
    assert not missing, f"the README's error list lacks {missing}"
    for name in ("Layout", "SnowflakeGenerator", "SnowflakeOptions", "open_quorum"):
        assert name in idmint.__all__ and getattr(idmint, name)


def test_the_package_says_its_license_and_the_docs_stay_in_the_repo() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression, not the old table
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert "../shared" not in page.read_text(), f"{page.name} points outside the repo"


def test_the_sdist_carries_the_tests_and_pypi_would_take_both(tmp_path: Path) -> None:
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--sdist",
            "--wheel",
            "--no-isolation",
            "-o",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (archive,) = tmp_path.glob("idmint-*.tar.gz")
    (wheel,) = tmp_path.glob("idmint-*.whl")
    # What PyPI would refuse or render badly: the long description (the README), metadata.
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(archive), str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with zipfile.ZipFile(wheel) as whl:
        [metadata] = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        fields = whl.read(metadata).decode()
    for field in (
        "Project-URL: Documentation, ",
        "Classifier: Typing :: Typed",
        "Description-Content-Type: text/markdown",
        "Provides-Extra: sqlalchemy",
        "Provides-Extra: server",
    ):
        assert field in fields, field
    # The server's dependencies come with its extra only: a library install has no server.
    always = [
        line
        for line in fields.splitlines()
        if line.startswith("Requires-Dist: ") and "extra ==" not in line
    ]
    server = ("granian", "prometheus", "uvloop")
    assert always and not [d for d in always if any(name in d for name in server)], always
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path, filter="data")
    unpacked = next(p for p in tmp_path.iterdir() if p.is_dir())
    ours = {p.name for p in (ROOT / "tests").glob("*.py")}
    assert {p.name for p in (unpacked / "tests").glob("*.py")} == ours
    assert (unpacked / "LICENSE").is_file() and (unpacked / ".ci" / "install").is_file()
    assert (unpacked / "deploy" / "idmint.toml").is_file()  # tests/test_deploy.py reads it
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=unpacked,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-2000:]
    assert "error" not in collected.stdout.lower().splitlines()[-1]


def test_no_code_trusts_str_isdigit_outside_is_digits() -> None:
    """str.isdigit() is true of "²", which int() refuses: a 500 or a traceback each time it
    crept back (decode, the redis db, CosId's offset). ids.is_digits is the one check."""
    src = Path(idmint.__file__).parent
    found = [
        f"{path.relative_to(src)}:{number}"
        for path in sorted(src.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ".isdigit()" in line and path.name != "ids.py"
    ]
    assert not found, f"use ids.is_digits: {found}"


def test_the_cli_reads_the_servers_settings_without_loading_the_server(tmp_path: Path) -> None:
    # `--config` and IDMINT_STORE_FILE read idmint.server.config; that must not load the app,
    # prometheus-client or granian: the first step of a library install without the server.
    config = tmp_path / "idmint.toml"
    config.write_text(f'[server]\nstore = "sqlite:///{tmp_path / "a.db"}"\n')
    script = (
        "import sys\n"
        "from idmint.cli import main\n"
        f"assert main(['--config', {str(config)!r}, 'init']) == 0\n"
        "print(sorted(m for m in ('prometheus_client', 'granian', 'idmint.server.app')"
        " if m in sys.modules))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "[]", run.stdout
