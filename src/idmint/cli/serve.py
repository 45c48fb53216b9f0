"""`idmint serve`: the HTTP server, its options built from ServerConfig's fields.

The server's own dependencies (granian, prometheus-client, uvloop) come with the `server`
extra: without it, `serve` says so in one line and the other commands work as ever. Nothing of
the server but its config is loaded before `serve` runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from .._errors import DriverMissing
from ..server.config import FLAGS, ServerConfig, read_config_file
from .options import setting_options, store_options
from .root import STORE_SETTINGS

#: What `pip install 'idmint[server]'` brings, by the name it is imported as.
SERVER_EXTRA = ("granian", "prometheus_client", "uvloop")


@click.command()
@store_options
@setting_options(*FLAGS)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="IDMINT_CONFIG",
    help="An idmint.toml with a [server] table.",
)
@click.pass_context
def serve(ctx: click.Context, /, config_file: Path | None, **flags: Any) -> None:
    """Serve ids over HTTP (Leaf-compatible routes, dashboard at /, metrics at /metrics)."""
    run_server = _server_runner()
    # A flag beats the environment, which beats the file: every setting, including those
    # without a flag of their own (IDMINT_WAIT, IDMINT_MAX_STEP, IDMINT_PRELOAD_AT, ...).
    values = read_config_file(config_file) if config_file else {}
    values.update(ServerConfig.env_values())
    for name in STORE_SETTINGS:  # a flag or env var beats the file
        if name in ctx.obj["given"] or name not in values:
            values[name] = ctx.obj[name]
    values.update({k: v for k, v in flags.items() if v is not None})
    run_server(ServerConfig.from_mapping(values))


def _server_runner() -> Callable[[ServerConfig], None]:
    """server.run's serve, or DriverMissing naming the module of the server extra that is
    not installed. granian may be missing where uvicorn is there: run.py falls back to it."""
    try:
        from ..server import run
    except ModuleNotFoundError as exc:  # prometheus_client, which the metrics import
        module = (exc.name or "").partition(".")[0]
        if module not in SERVER_EXTRA:
            raise  # not a missing extra: a bug, with its traceback
        raise _missing(module) from None
    if not (_importable("granian") or _importable("uvicorn")):
        raise _missing("granian")
    return run.serve


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _missing(module: str) -> DriverMissing:
    return DriverMissing(f"idmint serve needs {module}: pip install 'idmint[server]'")
