"""The `idmint` group and what its commands share: the store they work on (--store, --timeout,
--config; open_minter), how they print, and `idmint init`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import click

from .. import __version__
from .._errors import IdmintError, InvalidArgument, KeyNotFound, WrongKind, did_you_mean
from .._minter import Minter, connect
from ..ids import Key
from ..server.config import read_config_file, setting_from_file
from ..stores import DEFAULT_STORE_URL, DEFAULT_TIMEOUT
from ..stores.sql.sqlite import sqlite_path
from .options import TIMEOUT_RANGE, Finite, given_params, store_options

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
    given = given_params(ctx, *STORE_SETTINGS)
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


@cli.command()
@click.option(
    "--set",
    "required",
    type=click.IntRange(0, 1000),
    metavar="N",
    help="Make every write wait for N replicas. Lowering it fences the store as a failover "
    "does (every key skips the failover gap): say it only when the missing replicas are gone.",
)
@click.option("--yes", is_flag=True, help="Lower the requirement: keys skip the failover gap.")
@store_options
@click.pass_context
def replicas(ctx: click.Context, required: int | None, yes: bool) -> None:
    """Show the store's replication and the replicas every write must wait for; a store
    refuses to write with fewer than it has waited for, until this lowers the number."""
    with open_minter(ctx) as minter:
        state = minter.replication()
        if state is None:
            raise InvalidArgument(f"store {minter.url} does not replicate")
        if required is not None:
            if required < (state.required or 0) and not yes:
                raise click.UsageError(
                    f"lowering the requirement from {state.required} to {required} fences the "
                    "store (every key skips the failover gap): add --yes"
                )
            old = minter.set_required_replicas(required)
            click.echo(f"replica requirement: {old} -> {required}")
            state = minter.replication()
            assert state is not None
        click.echo(f"replication: {state.describe()}")
        if state.risk is not None:
            click.echo(f"replication risk: {state.risk} (docs/stores.md)")


@contextlib.contextmanager
def open_minter(
    ctx: click.Context, dc: str | None = None, dc_store: str | None = None, *, create: bool = False
) -> Iterator[Minter]:
    """A minter on the command's store. Only commands that `create` things make a SQLite
    store that is not there: a typo in --store would otherwise leave a stray file behind."""
    if not create:
        _must_exist(ctx.obj["store"])
    minter = connect(ctx.obj["store"], timeout=ctx.obj["timeout"], dc=dc, dc_store=dc_store)
    try:
        yield minter
    except KeyNotFound as exc:
        hint = "" if isinstance(exc, WrongKind) else _close_key_names(minter, exc.key)
        if hint:
            raise KeyNotFound(exc.key, f"{exc}{hint}") from None
        raise
    finally:
        minter.close()


def _close_key_names(minter: Minter, name: str) -> str:
    """ " (did you mean X?)" for the store's keys of any kind close to a mistyped name."""
    names: list[str] = []
    with contextlib.suppress(IdmintError):  # a store that does not answer: no hint
        names += [k.name for k in minter.ranges.list_keys()]
        names += [k.name for k in minter.quorum_keys()]
        names += [k.name for k in minter.datacenters().list_keys()]
    return did_you_mean(name, names)


def _must_exist(url: str) -> None:
    if not url.startswith("sqlite:///"):
        return
    path = sqlite_path(url)
    try:
        there = path == ":memory:" or Path(path).exists()
    except OSError as exc:  # a name too long for the file system, and the like
        raise InvalidArgument(f"bad store path {path}: {exc.strerror}") from None
    if not there:
        raise InvalidArgument(
            f"no store at {Path(path).resolve()}: `idmint init` (or adding a key) creates it; "
            "check --store or IDMINT_STORE (run from another directory, ./idmint.db is "
            "another file)"
        )


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Rows (the first one the header) in columns as wide as their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def describe_key(key: Key) -> str:
    if key.retired:
        return f"retired (its ids ran to {key.last_id}; none is handed out again)"
    striped = f", {key.stripes} stripes" if key.stripes > 1 else ""
    return f"ids {key.first_id}..{key.last_id}, step {key.step}{striped}"


def iso(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, UTC).isoformat(timespec="milliseconds")


def when(key: Key) -> str:
    return key.updated_at.strftime("%Y-%m-%d %H:%M:%S") if key.updated_at else "-"
