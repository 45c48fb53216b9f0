"""The `idmint` group: where the store is (--store, --timeout, --config), and `idmint init`."""

from __future__ import annotations

from pathlib import Path

import click

from .. import __version__
from .._errors import InvalidArgument
from ..server.config import read_config_file, setting_from_file
from ..stores import DEFAULT_STORE_URL, DEFAULT_TIMEOUT
from .minter import open_minter
from .options import TIMEOUT_RANGE, Finite, store_options
from .show import iso

#: The settings every command reads from the server's idmint.toml (`--config`).
STORE_SETTINGS = ("store", "timeout")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--store",
    envvar="IDMINT_STORE",
    default=DEFAULT_STORE_URL,
    show_default=True,
    metavar="URL",
    help="Store URL: sqlite:///path, postgresql://..., mysql://... (env IDMINT_STORE).",
)
@click.option(
    "--timeout",
    envvar="IDMINT_TIMEOUT",
    type=Finite(*TIMEOUT_RANGE),
    default=DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds to wait for the store (env IDMINT_TIMEOUT).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="IDMINT_CONFIG",
    help="The server's idmint.toml: its [server] store and timeout, unless given otherwise "
    "(env IDMINT_CONFIG), so every command works on the server's store.",
)
@click.version_option(__version__, prog_name="idmint")
@click.pass_context
def cli(ctx: click.Context, store: str, timeout: float, config_file: Path | None) -> None:
    """Mint short, unique integer ids from the databases you already run."""
    given = {
        name
        for name in STORE_SETTINGS
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    }
    # IDMINT_STORE_FILE: a URL with its password kept out of `ps`; a flag beats it.
    if ctx.get_parameter_source("store") is not click.core.ParameterSource.COMMANDLINE:
        from_file = setting_from_file("store")
        if from_file is not None:
            store = from_file
            given.add("store")
    ctx.obj = {"store": store, "timeout": timeout, "given": given}
    if config_file is not None:  # a flag or an environment variable beats the file
        table = read_config_file(config_file)
        for name in STORE_SETTINGS:
            if name in table and name not in given:
                ctx.obj[name] = table[name]
        low, high = TIMEOUT_RANGE
        if not isinstance(ctx.obj["timeout"], int | float) or not (
            low <= ctx.obj["timeout"] <= high
        ):
            raise InvalidArgument(
                f"bad config file {config_file}: timeout must be from {low:g} to {high:g} seconds"
            )


@cli.command()
@store_options
@click.pass_context
def init(ctx: click.Context) -> None:
    """Create the store's table (it is also created on first use)."""
    with open_minter(ctx, create=True) as minter:
        minter.init()
        identity = minter.identity()
        made = ""
        if identity is not None and identity.created_ms:
            made = f", made {iso(identity.created_ms)}"
        click.echo(
            f"initialised {minter.url}" + (f" (store {identity.id}{made})" if identity else "")
        )
        replication = minter.replication()
        if replication is not None:
            click.echo(f"replication: {replication.describe()}")
            if replication.risk is not None:
                click.echo(f"replication risk: {replication.risk} (docs/stores.md)")
