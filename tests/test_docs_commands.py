"""Every `idmint ...` command line in the README and docs/ is one the CLI takes as written:
each is parsed by the real command tree (options, types, choices), with the commands' bodies
swapped out, so no store is needed. A renamed option or a dropped command fails here before a
reader finds it. Then every block of commands that needs no server of its own is run, in
order, on a fresh SQLite store, and the outputs its comments promise are checked."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from idmint.cli import cli, main
from idmint.server import App, ServerConfig

from conftest import aged_sqlite_url

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
COMMAND = re.compile(r"(?:^|&&\s*)(?:\.venv/bin/)?idmint\s+([^&]*)")


def doc_blocks() -> Iterator[list[tuple[str, str]]]:
    """The idmint commands of each shell block of the docs: (where, the argument string)."""
    for page in PAGES:
        block: str | None = None  # the language of the fenced block we are in
        commands: list[tuple[str, str]] = []
        for number, line in enumerate(page.read_text().splitlines(), 1):
            fence = FENCE.match(line.strip())
            if fence:
                if block is not None and commands:
                    yield commands
                block = fence.group(1) if block is None else None
                commands = []
                continue
            if block in ("sh", "bash", "shell", ""):
                for found in COMMAND.finditer(line.strip()):
                    commands.append((f"{page.name}:{number}", found.group(1)))


def doc_commands() -> Iterator[tuple[str, str]]:
    """(where, the argument string) of every idmint command in a shell block of the docs."""
    for block in doc_blocks():
        yield from block


def leaves(group: click.Group) -> Iterator[click.Command]:
    for command in group.commands.values():
        if isinstance(command, click.Group):
            yield from leaves(command)
        else:
            yield command


@pytest.fixture
def parse_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    for command in leaves(cli):
        monkeypatch.setattr(command, "callback", nothing)


def test_the_docs_show_idmint_commands() -> None:
    assert len(list(doc_commands())) > 30


def parse(line: str) -> None:
    cli.main(args=shlex.split(line, comments=True), prog_name="idmint", standalone_mode=False)


@pytest.mark.parametrize(("where", "line"), list(doc_commands()))
def test_a_documented_command_parses(where: str, line: str, parse_only: None) -> None:
    try:
        parse(line)
    except click.ClickException as exc:
        pytest.fail(f"{where}: idmint {line.strip()}: {exc.format_message()}")


def test_a_stale_command_would_fail(parse_only: None) -> None:
    for stale in ("keys add order --stepp 5", "next order -n many", "keys remove order", "nope"):
        with pytest.raises(click.UsageError):
            parse(stale)


def test_the_scripts_the_docs_run_exist() -> None:
    named = {
        match.group(1)
        for page in PAGES
        for match in re.finditer(
            r"(?:python3?|bash) ((?:bench|tests|\.ci)/[\w./-]+)", page.read_text()
        )
    }
    assert "bench/quorum.py" in named and ".ci/venv" in named
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, f"the docs run scripts that are not there: {missing}"


#: What a command needs that a SQLite file is not: a server, a cluster of datacenters, quorum
#: nodes, a replicated store. Those are run by their own tests (test_server, test_datacenter*,
#: test_quorum*, test_replication and test_failback).
NEEDS_MORE = ("serve", "dc", "--quorum", "--dc", "replicas", "import")


def runnable(line: str) -> list[str] | None:
    """The command's arguments without --store (the test's store is IDMINT_STORE), or None
    if it needs more than a store."""
    args = shlex.split(line, comments=True)
    for i, arg in enumerate(args):
        if arg == "--store":
            del args[i : i + 2]
            break
    return None if any(a in NEEDS_MORE for a in args) else args


def promised(line: str, output: str) -> None:
    """The output a command's comment promises: ids ("# 3, 8, 13") or JSON fields
    ("# \"stripes\": 5, ...")."""
    comment = line.partition("#")[2].strip()
    if re.fullmatch(r"\d+(, \d+)+", comment):
        assert output.split() == comment.split(", "), (line, output)
    elif comment.startswith('"'):
        assert comment in json.dumps(json.loads(output)), (line, output)


@pytest.mark.parametrize(
    "block",
    [b for b in doc_blocks() if any(runnable(line) is not None for _, line in b)],
    ids=lambda block: block[0][0],
)
def test_a_documented_block_runs_on_a_store(
    block: list[tuple[str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Made a minute ago: a snowflake command on a store made now waits out a lease ttl (10 s)
    # first, which tests/test_snowflake*.py test; here it would only cost time.
    monkeypatch.setenv("IDMINT_STORE", aged_sqlite_url(tmp_path / "docs.db"))
    monkeypatch.chdir(tmp_path)
    for where, line in block:
        args = runnable(line)
        if args is None:
            continue
        code = main(args)
        out, err = capsys.readouterr()
        assert code == 0, f"{where}: idmint {line.strip()}: exit {code}: {err.strip()}"
        promised(line, out)


def test_most_documented_commands_run_and_a_broken_promise_fails() -> None:
    commands = list(doc_commands())
    assert sum(runnable(line) is not None for _, line in commands) >= len(commands) // 2
    with pytest.raises(AssertionError):
        promised("next order -n 3   # 3, 8, 13", "3\n8\n14\n")
    with pytest.raises(AssertionError):
        promised('keys show x --json   # "stripes": 5', '{"stripes": 4}')


CURL = re.compile(r"curl\s+'?(?:-[^\s]+\s+)*'?(?:https?://)?localhost:\d+(/[^\s'`]*)")


def test_every_documented_curl_names_a_route_that_answers_get(tmp_path: Path) -> None:
    app = App(ServerConfig(store=f"sqlite:///{tmp_path / 'curl.db'}"))
    paths = {m.group(1) for page in PAGES for m in CURL.finditer(page.read_text())}
    assert "/api/segment/get/order" in paths and len(paths) >= 3
    for path in paths:
        pattern, _ = app.router.match(path.partition("?")[0])
        assert pattern and "GET" in app.router.by_path[pattern], f"the docs curl {path}: no route"
    assert not app.router.match("/v1/key/order/ids")[0]  # a stale path would fail
