"""Every `idmint ...` command line in the README and docs/ is one the CLI takes as written:
each is parsed by the real command tree (options, types, choices), with the commands' bodies
swapped out, so no store is needed. A renamed option or a dropped command fails here before a
reader finds it."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from idmint.cli import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
COMMAND = re.compile(r"(?:^|&&\s*)(?:\.venv/bin/)?idmint\s+([^&]*)")


def doc_commands() -> Iterator[tuple[str, str]]:
    """(where, the argument string) of every idmint command in a shell block of the docs."""
    for page in PAGES:
        block: str | None = None  # the language of the fenced block we are in
        for number, line in enumerate(page.read_text().splitlines(), 1):
            fence = FENCE.match(line.strip())
            if fence:
                block = fence.group(1) if block is None else None
                continue
            if block in ("sh", "bash", "shell", ""):
                for found in COMMAND.finditer(line.strip()):
                    yield f"{page.name}:{number}", found.group(1)


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
