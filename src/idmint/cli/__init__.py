"""The `idmint` command. A thin shell: parse, call the Minter, print.

Errors print one line on stderr, never a traceback. Exit codes: 0 done, 1 the store failed or a
key is exhausted (try again later, or look at the store), 2 bad input (a usage error, a bad URL,
an unknown key, a bad count).

One module per command group; root.py has the group and what every command shares (the store,
printing), options.py the options several take (`serve`'s built from ServerConfig's fields).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import click

from .._errors import IdmintError, InvalidArgument, KeyExists, KeyNotFound
from . import datacenter, importing, keys, next_ids, serve, snowflake
from .root import cli

__all__ = ["cli", "main"]

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2

BAD_INPUT = (InvalidArgument, KeyNotFound, KeyExists)

# The modules keep their own names: `idmint.cli.serve` is the module, its command `.serve`.
for _command in (
    keys.keys,
    next_ids.next_,
    serve.serve,
    snowflake.snowflake,
    snowflake.decode,
    snowflake.workers,
    keys.quorum_group,
    datacenter.dc_group,
    importing.import_,
):
    cli.add_command(_command)


class _LogLines(logging.Handler):
    """Where log records go when no handler takes them (`logging.lastResort`, as in the CLI
    outside `serve`): one line each, `idmint: warning: ...`. It notes what it printed, so that
    the closing error line is left out when a record said it already: a quorum node refused
    is logged, for servers, where no caller may see the error, and raised too."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = " ".join(record.getMessage().split())
        self.said.add(message)
        click.echo(f"idmint: {record.levelname.lower()}: {message}", err=True)


_log_lines = _LogLines()


def _fail(message: str, code: int) -> int:
    if " ".join(message.split()) not in _log_lines.said:
        click.echo(f"idmint: error: {message}", err=True)
    return code


def _bad_parameter(exc: click.BadParameter) -> str:
    """click's message, naming the environment variable when the value came from one (click
    names the flag, which the user never typed)."""
    ctx, param = exc.ctx, exc.param
    if ctx is not None and param is not None and param.name and isinstance(param, click.Option):
        source = ctx.get_parameter_source(param.name)
        if source is click.core.ParameterSource.ENVIRONMENT and param.envvar:
            var = param.envvar if isinstance(param.envvar, str) else param.envvar[0]
            return f"bad {var}={os.environ.get(var, '')!r}: {' '.join(exc.message.split())}"
    return " ".join(exc.format_message().split())


def main(argv: list[str] | None = None, run: Callable[..., Any] = cli.main) -> int:
    """Run the CLI and turn every error into one line on stderr and an exit code."""
    # The drivers' own warnings (kazoo's "Connection dropped", cassandra-driver's) would come
    # before idmint's one line, which already says what failed.
    for driver in ("kazoo", "cassandra"):
        logging.getLogger(driver).setLevel(logging.CRITICAL)
    last_resort, logging.lastResort = logging.lastResort, _log_lines
    _log_lines.said.clear()
    try:
        return _run(argv, run)
    finally:
        logging.lastResort = last_resort


def _run(argv: list[str] | None, run: Callable[..., Any]) -> int:
    try:
        result = run(args=argv, prog_name="idmint", standalone_mode=False)
    except click.exceptions.Abort:
        return _fail("interrupted", 130)
    except click.exceptions.NoArgsIsHelpError as exc:  # `idmint`, `idmint keys`: the help, whole
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        return EXIT_BAD_INPUT
    except click.BadParameter as exc:
        return _fail(_bad_parameter(exc), EXIT_BAD_INPUT)
    except click.ClickException as exc:
        return _fail(" ".join(exc.format_message().split()), EXIT_BAD_INPUT)
    except BAD_INPUT as exc:
        return _fail(str(exc), EXIT_BAD_INPUT)
    except IdmintError as exc:
        return _fail(str(exc), EXIT_FAILED)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    return result if isinstance(result, int) else 0
