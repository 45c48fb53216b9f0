"""The `idmint` command. A thin shell: parse, call the Minter, print.

Errors print one line on stderr, never a traceback. Exit codes: 0 done, 1 the store failed or a
key is exhausted (try again later, or look at the store), 2 bad input (a usage error, a bad URL,
an unknown key, a bad count).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import click

from . import __version__
from ._errors import (
    Exhausted,
    IdmintError,
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    NameTaken,
    StoreUnavailable,
    WrongKind,
    did_you_mean,
)
from ._minter import Minter, connect
from .ids import (
    BATCH_CAP_MAX,
    DEFAULT_FIRST_ID,
    DEFAULT_STEP,
    ID_MAX,
    MAX_STRIPES,
    UINT31_MAX,
    Key,
    Range,
    check_count,
    is_digits,
)
from .stores import DEFAULT_STORE_URL, DEFAULT_TIMEOUT
from .stores.sql.sqlite import sqlite_path
from .strategies.datacenter import ReservationSizing
from .strategies.quorum import QuorumOptions, split_nodes

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2

# `next -n` and `snowflake -n` at most: a typo of a few zeros must not burn a bounded key (or
# hold every id in memory) before anything is printed.
MAX_COUNT = 1_000_000
# `next` prints this many ids per write: its memory stays small whatever -n is.
PRINT_CHUNK = 10_000

_MAX_BATCH_HELP = (
    "The most ids one HTTP request may take from the key (a range, a batch); 0: the step x 100, "
    f"at most {BATCH_CAP_MAX:,}."
)

BAD_INPUT = (InvalidArgument, KeyNotFound, KeyExists)


class Finite(click.ParamType[float]):
    """A finite number, within [low, high] when given. click's FloatRange lets NaN through
    (every comparison with NaN is false) and float takes "inf": both broke later, with a
    traceback."""

    name = "number"

    def __init__(self, low: float | None = None, high: float | None = None) -> None:
        self.low, self.high = low, high

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if (self.low is not None and number < self.low) or (
            self.high is not None and number > self.high
        ):
            self.fail(f"{number:g} is not from {self.low:g} to {self.high:g}", param, ctx)
        return number


@contextmanager
def _minter(
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
    type=Finite(0.1, 600),
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
        for name in ("store", "timeout")
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    }
    # IDMINT_STORE_FILE: a URL with its password kept out of `ps`; a flag beats it.
    if ctx.get_parameter_source("store") is not click.core.ParameterSource.COMMANDLINE:
        from .server.config import setting_from_file

        from_file = setting_from_file("store")
        if from_file is not None:
            store = from_file
            given.add("store")
    ctx.obj = {"store": store, "timeout": timeout, "given": given}
    if config_file is not None:  # a flag or an environment variable beats the file
        from .server.config import read_config_file

        table = read_config_file(config_file)
        for name in ("store", "timeout"):
            if name in table and name not in given:
                ctx.obj[name] = table[name]
        if not isinstance(ctx.obj["timeout"], int | float) or not (
            0.1 <= ctx.obj["timeout"] <= 600
        ):
            raise InvalidArgument(
                f"bad config file {config_file}: timeout must be from 0.1 to 600 seconds"
            )


def _override(ctx: click.Context, param: click.Parameter, value: object) -> None:
    if value is not None and param.name:
        ctx.obj[param.name] = value
        ctx.obj["given"].add(param.name)


def store_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--store and --timeout after the command name too: `idmint serve --store URL`."""
    command = click.option(
        "--timeout",
        type=Finite(0.1, 600),
        expose_value=False,
        callback=_override,
        help="Seconds to wait for the store (also before the command).",
    )(command)
    return click.option(
        "--store",
        metavar="URL",
        expose_value=False,
        callback=_override,
        help="Store URL (also before the command, or IDMINT_STORE).",
    )(command)


_DC_HELP = "The datacenter this runs in, for datacenter keys (env IDMINT_DC)."
_DC_STORE_HELP = (
    "The datacenter's own store, for datacenter keys (env IDMINT_DC_STORE) [default on "
    "cassandra://: the same cluster at LOCAL_SERIAL]."
)


def dc_options(*, required: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--dc NAME and --dc-store URL: serve datacenter keys as that datacenter."""

    def add(command: Callable[..., Any]) -> Callable[..., Any]:
        command = click.option(
            "--dc-store", envvar="IDMINT_DC_STORE", metavar="URL", help=_DC_STORE_HELP
        )(command)
        return click.option(
            "--dc", envvar="IDMINT_DC", metavar="NAME", required=required, help=_DC_HELP
        )(command)

    return add


_QUORUM_HELP = (
    "Node URLs of a quorum key, joined by commas (env IDMINT_QUORUM): redis://, sqlite://, "
    "postgresql://, mysql://, etcd://, zk:// servers that share nothing, an odd number, 3 or more."
)


def quorum_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--quorum URLS and --unsafe-nodes: the nodes of a quorum key."""
    command = click.option(
        "--unsafe-nodes",
        is_flag=True,
        default=None,
        help="Use quorum nodes that do not fsync every write (ids may repeat after a crash).",
    )(command)
    return click.option("--quorum", envvar="IDMINT_QUORUM", metavar="URLS", help=_QUORUM_HELP)(
        command
    )


@cli.command()
@store_options
@click.pass_context
def init(ctx: click.Context) -> None:
    """Create the store's table (it is also created on first use)."""
    with _minter(ctx, create=True) as minter:
        minter.init()
        identity = minter.identity()
        made = ""
        if identity is not None and identity.created_ms:
            made = f", made {_iso(identity.created_ms)}"
        click.echo(
            f"initialised {minter.url}" + (f" (store {identity.id}{made})" if identity else "")
        )
        replication = minter.replication()
        if replication is not None:
            click.echo(f"replication: {replication.describe()}")
            if replication.risk is not None:
                click.echo(f"replication risk: {replication.risk} (docs/stores.md)")


@cli.group()
def keys() -> None:
    """Add, list, show and raise keys."""


@keys.command("add")
@store_options
@click.argument("name")
@click.option(
    "--step",
    type=int,
    default=DEFAULT_STEP,
    show_default=True,
    help="Ids per range taken from the store (the dynamic step grows from here).",
)
@click.option(
    "--start",
    type=int,
    default=DEFAULT_FIRST_ID,
    show_default=True,
    help="The first id, e.g. above legacy ids.",
)
@click.option(
    "--max",
    "max_",
    type=int,
    help=f"The largest id; {UINT31_MAX} for a 32-bit key [default: {ID_MAX}, less one per "
    "stripe after the first].",
)
@click.option("--description", default="", help="Free text, up to 256 characters.")
@click.option("--max-batch", type=int, default=0, show_default=True, help=_MAX_BATCH_HELP)
@click.option(
    "--stripes",
    type=int,
    default=1,
    show_default=True,
    help=f"Independent counters, 1 to {MAX_STRIPES}: stripe k hands out start + k, "
    "start + k + N, ... so N processes take ranges without waiting for each other.",
)
@click.option("--exist-ok", is_flag=True, help="A key of that name already there is not an error.")
@click.pass_context
def keys_add(
    ctx: click.Context,
    name: str,
    step: int,
    start: int,
    max_: int | None,
    description: str,
    max_batch: int,
    stripes: int,
    exist_ok: bool,
) -> None:
    """Create key NAME."""
    with _minter(ctx, create=True) as minter:
        try:
            key = minter.add_key(
                name,
                step=step,
                start=start,
                max=max_,
                description=description,
                max_batch=max_batch,
                stripes=stripes,
            )
        except KeyExists as exc:
            if not exist_ok or isinstance(exc, NameTaken):  # another kind's name: never fine
                raise
            key = minter.key(name)
            given = {
                name
                for name in ("step", "stripes")
                if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
            }
            differs = _differences(
                key,
                step if "step" in given else None,
                start,
                max_,
                stripes if "stripes" in given else None,
            )
            if differs:
                raise KeyExists(
                    name, f"key {name!r} exists with other settings: {'; '.join(differs)}"
                ) from None
            click.echo(f"{key.name} exists: {_describe_key(key)}")
            return
        click.echo(f"added {key.name}: {_describe_key(key)}")


def _differences(
    key: Key, step: int | None, start: int, max_: int | None, stripes: int | None
) -> list[str]:
    """How an existing key differs from the one `keys add --exist-ok` asked for. Its first id
    may have been raised since (keys raise): only a start above it differs, since the key
    would hand out ids below what was asked."""
    found = []
    if start > key.first_id:
        found.append(f"it hands out ids from {key.first_id}, not {start}")
    if max_ is not None and max_ != key.last_id:
        found.append(f"its largest id is {key.last_id}, not {max_}")
    if stripes is not None and stripes != key.stripes:
        found.append(f"it has {key.stripes} stripes, not {stripes}")
    if step is not None and step != key.step:
        found.append(f"its step is {key.step}, not {step}")
    return found


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    """Rows (the first one the header) in columns as wide as their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _describe_key(key: Key) -> str:
    if key.retired:
        return f"retired (its ids ran to {key.last_id}; none is handed out again)"
    striped = f", {key.stripes} stripes" if key.stripes > 1 else ""
    return f"ids {key.first_id}..{key.last_id}, step {key.step}{striped}"


@keys.command("list")
@store_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per key.")
@click.pass_context
def keys_list(ctx: click.Context, as_json: bool) -> None:
    """List every key."""
    with _minter(ctx) as minter:
        all_keys = minter.keys()
    if as_json:
        for key in all_keys:
            click.echo(json.dumps(key.as_dict()))
        return
    rows = [("KEY", "NEXT", "STEP", "FIRST", "MAX", "REMAINING", "BATCH CAP", "STRIPES", "UPDATED")]
    rows += [
        (
            k.name,
            str(k.next_id),  # a striped key's: the lowest stripe's
            str(k.step),
            str(k.first_id),
            str(k.last_id),
            str(k.remaining),
            str(k.batch_cap),
            str(k.stripes),
            _when(k),
        )
        for k in all_keys
    ]
    _print_table(rows)


@keys.command("show")
@store_options
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="As a JSON object.")
@click.pass_context
def keys_show(ctx: click.Context, name: str, as_json: bool) -> None:
    """Show key NAME."""
    with _minter(ctx) as minter:
        key = minter.key(name)
    if as_json:
        click.echo(json.dumps(key.as_dict()))
        return
    for field, value in key.as_dict().items():
        if isinstance(value, list):  # stripe_next: where each stripe's next range starts
            value = " ".join(map(str, value))
        click.echo(f"{field + ':':<13}{value}")


@keys.command("raise")
@store_options
@click.argument("name")
@click.option(
    "--to",
    "to",
    type=click.IntRange(0, ID_MAX),
    required=True,
    help="Every id from now on is at least this.",
)
@click.pass_context
def keys_raise(ctx: click.Context, name: str, to: int) -> None:
    """Raise key NAME's floor (for imported legacy ids). It only moves up."""
    with _minter(ctx) as minter:
        before = minter.key(name)
        key = minter.raise_floor(name, to)
    start = key.next_id
    if (key.first_id, key.next_ids) == (before.first_id, before.next_ids):  # every stripe
        click.echo(f"{name}: unchanged, the next range already starts at {start}")
    else:
        click.echo(f"{name}: the next range starts at {start}")


@keys.command("retire")
@store_options
@click.argument("name")
@click.option("--yes", is_flag=True, help="Retire it: there is no way back.")
@click.pass_context
def keys_retire(ctx: click.Context, name: str, yes: bool) -> None:
    """Retire key NAME for good: no id is handed out from it again, and its numbers are never
    reused (processes holding ranges serve them out first)."""
    if not yes:
        raise click.UsageError(f"retiring {name!r} cannot be undone: add --yes")
    with _minter(ctx) as minter:
        key = minter.retire_key(name)
    click.echo(f"retired {key.name}: it hands out no id again (max {key.last_id})")


@keys.command("set")
@store_options
@click.argument("name")
@click.option("--max-batch", type=int, required=True, help=_MAX_BATCH_HELP)
@click.pass_context
def keys_set(ctx: click.Context, name: str, max_batch: int) -> None:
    """Change key NAME's batch cap, for every server on the store."""
    with _minter(ctx) as minter:
        key = minter.set_max_batch(name, max_batch)
    rule = "set" if key.max_batch else "the default, the step x 100"
    click.echo(f"{key.name}: at most {key.batch_cap} ids per HTTP request ({rule})")


@cli.command("next")
@store_options
@click.argument("name")
@click.option(
    "-n",
    "count",
    type=int,
    default=1,
    show_default=True,
    help=f"How many ids, {MAX_COUNT:,} at most.",
)
@click.option(
    "--stripe",
    type=click.IntRange(-(2**63), 2**63 - 1),  # the store says which stripes the key has
    help="Of a striped key, take them from this stripe (0 to its stripes - 1) [default: any "
    "with ids left].",
)
@dc_options()
@quorum_options
@click.pass_context
def next_(
    ctx: click.Context,
    name: str,
    count: int,
    stripe: int | None,
    dc: str | None,
    dc_store: str | None,
    quorum: str | None,
    unsafe_nodes: bool | None,
) -> None:
    """Print COUNT new ids of key NAME, one per line.

    Takes exactly COUNT ids from the store in one allocation, so nothing is wasted (a striped
    key's ids are its stripes apart; at a stripe's end the rest come from another stripe).
    With --dc, of a datacenter key, from that datacenter's reservation. With --quorum, of a
    quorum key on those nodes: above every id of the key handed out before (no --store).
    """
    check_count(count, maximum=MAX_COUNT)  # before the store: nothing taken on a typo
    if quorum is not None:
        if dc or dc_store or stripe is not None:
            raise click.UsageError("--quorum takes no --dc, --dc-store or --stripe")
        _print_ids(_quorum_ids(ctx, name, quorum, bool(unsafe_nodes), count))
        return
    with _minter(ctx, dc, dc_store) as minter:  # a store that is not there has no key
        left = count
        while left:
            taken = minter.take(name, left, stripe=stripe)
            _print_or_give_back(minter, name, taken)
            left -= len(taken)
            if left and dc:
                continue  # the end of a reservation; the next take says if the key is spent
            if left and (stripe is not None or taken.stride == 1):
                # A bounded key (or the stripe asked for) ran out: the ids above are good.
                if stripe is None:
                    raise Exhausted(name, taken.last)
                raise Exhausted(name, stripe=stripe, stripes=taken.stride)
            # A striped key's stripe ran out: the next take is from another (or says the
            # whole key is exhausted).


def _quorum_ids(ctx: click.Context, name: str, nodes: str, unsafe: bool, count: int) -> Range:
    """Ids of quorum key `name` (made in the store with `idmint quorum add`) from `nodes`."""
    options = QuorumOptions(unsafe=unsafe, deadline=max(ctx.obj["timeout"], 5.0))
    node_urls = split_nodes(nodes)  # a bad list is bad input, whatever the store
    with _minter(ctx) as minter:
        return minter.quorum(name, node_urls, options).take(count)


def _print_ids(taken: Range, printing: list[int] | None = None) -> None:
    """The ids of a range, one per line, in chunks as they are made: one string of every id
    would be the whole batch in memory. `printing[0]` follows where the chunk being written
    ends (every id below it may have reached the reader)."""
    step = PRINT_CHUNK * taken.stride
    for start in range(taken.start, taken.stop, step):
        chunk = range(start, min(start + step, taken.stop), taken.stride)
        if printing is not None:
            printing[0] = chunk.stop
        click.echo("\n".join(map(str, chunk)))


def _print_or_give_back(minter: Minter, name: str, taken: Range) -> None:
    """Print a range's ids; interrupted (Ctrl-C, a closed pipe), give back the ids never
    printed, or say how many are skipped: they were taken for good."""
    printing = [taken.start]
    try:
        _print_ids(taken, printing)
    except (KeyboardInterrupt, BrokenPipeError):
        rest = Range(printing[0], taken.stop, taken.stride)
        if rest:
            back = False
            with contextlib.suppress(IdmintError):  # the store is gone too: they are skipped
                back = minter.ranges.give_back(name, rest)
            what = "given back" if back else "skipped (never reused)"
            click.echo(f"idmint: interrupted: {len(rest):,} ids not printed, {what}", err=True)
        raise


@cli.command()
@store_options
@click.option("--host", envvar="IDMINT_HOST", help="Address to listen on [default: 127.0.0.1].")
@click.option("--port", envvar="IDMINT_PORT", type=int, help="Port [default: 8080].")
@click.option("--workers", envvar="IDMINT_WORKERS", type=int, help="Worker processes [default: 1].")
@click.option(
    "--token",
    envvar="IDMINT_TOKEN",
    help="Bearer token for key admin over HTTP; without one, admin over HTTP is refused.",
)
@click.option(
    "--client-token",
    envvar="IDMINT_CLIENT_TOKEN",
    help="Bearer token the routes that hand out ids need (the admin token works there too); "
    "without one, they are open.",
)
@click.option(
    "--admin-loopback",
    envvar="IDMINT_ADMIN_LOOPBACK",
    is_flag=True,
    default=None,
    help="Allow key admin without the token from loopback clients. Not behind a reverse proxy "
    "on the same host: there every client is loopback.",
)
@click.option(
    "--shutdown-timeout",
    envvar="IDMINT_SHUTDOWN_TIMEOUT",
    type=Finite(),
    help="Seconds from SIGTERM to exit, whatever the store does [default: 10].",
)
@click.option(
    "--reuse-port",
    envvar="IDMINT_REUSE_PORT",
    is_flag=True,
    default=None,
    help="Share the port with other processes; without it, a port another process listens "
    "on is refused.",
)
@click.option(
    "--http",
    "http_version",
    envvar="IDMINT_HTTP",
    type=click.Choice(["auto", "1", "2"]),
    help="HTTP versions to speak [default: 1; auto and 2 do not time out silent connections].",
)
@click.option(
    "--max-connections",
    envvar="IDMINT_MAX_CONNECTIONS",
    type=int,
    help="Connections each worker holds at once, idle ones included [default: 4096].",
)
@click.option(
    "--backlog",
    envvar="IDMINT_BACKLOG",
    type=int,
    help="Connections the kernel queues before a worker takes them [default: 1024].",
)
@click.option(
    "--header-timeout",
    envvar="IDMINT_HEADER_TIMEOUT",
    type=Finite(),
    help="Seconds a connection has to send a request's headers; idle kept-alive connections "
    "close then too [default: 10].",
)
@click.option(
    "--keep-alive/--no-keep-alive",
    envvar="IDMINT_KEEP_ALIVE",
    default=None,
    help="HTTP/1.1 keep-alive [default: on].",
)
@click.option(
    "--refill-threads",
    envvar="IDMINT_REFILL_THREADS",
    type=int,
    help="Threads loading every key's next range, soonest dry first [default: 4].",
)
@click.option(
    "--warm-keys",
    envvar="IDMINT_WARM_KEYS",
    type=int,
    help="Keys that take a range at start; the rest start on first use [default: 1000].",
)
@click.option(
    "--metrics-keys",
    envvar="IDMINT_METRICS_KEYS",
    type=int,
    help="Keys with series of their own in /metrics and entries in /v1/stats: each worker's "
    "busiest; every key counts in the aggregates [default: 100; 0: aggregates only].",
)
@click.option(
    "--id-budget-days",
    envvar="IDMINT_ID_BUDGET_DAYS",
    type=Finite(),
    help="Each key's ids go out over HTTP no faster than its whole id space in this many days, "
    "per worker (a 32-bit key: 829 ids/s) [default: 30; 0: no budget].",
)
@click.option(
    "--log-format",
    envvar="IDMINT_LOG_FORMAT",
    type=click.Choice(["text", "json"]),
    help="Log lines for people, or one JSON object a line for log collectors [default: text].",
)
@dc_options()
@quorum_options
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="IDMINT_CONFIG",
    help="An idmint.toml with a [server] table.",
)
@click.pass_context
def serve(
    ctx: click.Context,
    host: str | None,
    port: int | None,
    workers: int | None,
    token: str | None,
    client_token: str | None,
    admin_loopback: bool | None,
    shutdown_timeout: float | None,
    reuse_port: bool | None,
    http_version: str | None,
    max_connections: int | None,
    backlog: int | None,
    header_timeout: float | None,
    keep_alive: bool | None,
    refill_threads: int | None,
    warm_keys: int | None,
    metrics_keys: int | None,
    id_budget_days: float | None,
    log_format: str | None,
    dc: str | None,
    dc_store: str | None,
    quorum: str | None,
    unsafe_nodes: bool | None,
    config_file: Path | None,
) -> None:
    """Serve ids over HTTP (Leaf-compatible routes, dashboard at /, metrics at /metrics)."""
    from .server.config import ServerConfig, read_config_file
    from .server.run import serve as run_server

    # A flag beats the environment, which beats the file: every setting, including those
    # without a flag of their own (IDMINT_WAIT, IDMINT_MAX_STEP, IDMINT_PRELOAD_AT, ...).
    values = read_config_file(config_file) if config_file else {}
    values.update(ServerConfig.env_values())
    for name in ("store", "timeout"):  # a flag or env var beats the file
        if name in ctx.obj["given"] or name not in values:
            values[name] = ctx.obj[name]
    flags = {
        "host": host,
        "port": port,
        "workers": workers,
        "token": token,
        "client_token": client_token,
        "admin_loopback": admin_loopback,
        "shutdown_timeout": shutdown_timeout,
        "reuse_port": reuse_port,
        "http": http_version,
        "max_connections": max_connections,
        "backlog": backlog,
        "header_timeout": header_timeout,
        "keep_alive": keep_alive,
        "refill_threads": refill_threads,
        "warm_keys": warm_keys,
        "metrics_keys": metrics_keys,
        "id_budget_days": id_budget_days,
        "log_format": log_format,
        "dc": dc,
        "dc_store": dc_store,
        "quorum": quorum,
        "unsafe_nodes": unsafe_nodes,
    }
    values.update({k: v for k, v in flags.items() if v is not None})
    run_server(ServerConfig.from_mapping(values))


@cli.command()
@store_options
@click.option("-n", "count", type=int, default=1, show_default=True, help="How many ids.")
@click.option("--layout", default="twitter", show_default=True, help="twitter, sonyflake or js53.")
@click.option(
    "--namespace",
    default="default",
    show_default=True,
    help="The worker ids' namespace in the store.",
)
@click.option(
    "--worker-id",
    type=int,
    help="Claim this worker id statically instead of leasing one: the store reserves it for "
    "static holders and refuses a second one.",
)
@click.option(
    "--state",
    help="With --worker-id: a local file that also keeps the worker's horizon (it outlives a "
    "store that loses its data).",
)
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Also say on stderr which worker id was used, the layout's runway and how far this "
    "host's clock is from the store's.",
)
@click.pass_context
def snowflake(
    ctx: click.Context,
    count: int,
    layout: str,
    namespace: str,
    worker_id: int | None,
    state: str | None,
    verbose: bool,
) -> None:
    """Print COUNT snowflake ids, one per line, from a leased worker id."""
    from .strategies.snowflake import SnowflakeOptions

    check_count(count, maximum=MAX_COUNT)
    with _minter(ctx, create=True) as minter:
        flakes = minter.snowflake(
            layout, SnowflakeOptions(namespace=namespace), worker_id=worker_id, state=state
        )
        ids = flakes.next_ids(count)
        stats = flakes.stats()
    click.echo("\n".join(map(str, ids)))
    if verbose:
        click.echo(_describe_snowflake(namespace, stats), err=True)


def _describe_snowflake(namespace: str, stats: dict[str, Any]) -> str:
    """One line on the worker a `snowflake` command used."""
    line = (
        f"worker {stats['worker_id']} of namespace {namespace!r}; layout {stats['layout']}, "
        f"{stats['runway_years']:.1f} years of time bits left"
    )
    if stats["clock_offset_ms"] is None:
        return line + "; the store has no clock to compare with"
    ahead = -float(stats["clock_offset_ms"])
    return (
        f"{line}; this host's clock is {ahead:+.0f} ms (±{stats['clock_offset_error_ms']:.0f}) "
        "off the store's"
    )


@cli.command()
@click.argument("ids", nargs=-1, required=True)
@click.option("--layout", default="twitter", show_default=True, help="twitter, sonyflake or js53.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per id.")
def decode(ids: tuple[str, ...], layout: str, as_json: bool) -> None:
    """Show the time, worker and sequence of snowflake IDS."""
    from .layout import layout_named

    chosen = layout_named(layout)
    bad = [text for text in ids if not is_digits(text)]
    if bad:
        raise InvalidArgument(f"{bad[0]!r} is not an id: ids are non-negative integers")
    for parts in [chosen.decode(int(text)) for text in ids]:
        if as_json:
            click.echo(json.dumps(parts.as_dict()))
        else:
            click.echo(
                f"{parts.id}  time {parts.time.isoformat()}  worker {parts.worker}  "
                f"sequence {parts.sequence}"
            )


@cli.group()
def workers() -> None:
    """Snowflake worker-id leases."""


@workers.command("list")
@store_options
@click.option("--namespace", default="default", show_default=True)
@click.pass_context
def workers_list(ctx: click.Context, namespace: str) -> None:
    """Who holds which worker id, until when, and each id's horizon."""
    with _minter(ctx) as minter:
        if minter.lease_store is None:
            raise InvalidArgument(f"store {minter.url} keeps no worker leases")
        rows = minter.lease_store.holders(namespace)
    click.echo("WORKER  KIND    HOLDER                          EXPIRES_IN  HORIZON")
    for row in rows:
        live = row.owner and row.expires_in is not None and row.expires_in > 0
        holder = row.host if live else "-"
        left = f"{row.expires_in:.1f}s" if live and row.expires_in is not None else "free"
        horizon = _iso(row.horizon_ms) if row.horizon_ms else "-"
        kind = "static" if row.static else "leased"
        click.echo(f"{row.worker_id:<7} {kind:<7} {holder:<31} {left:<11} {horizon}")


@workers.command("unreserve")
@store_options
@click.argument("worker_id", type=click.IntRange(0, 2**31 - 1))
@click.option("--namespace", default="default", show_default=True)
@click.pass_context
def workers_unreserve(ctx: click.Context, worker_id: int, namespace: str) -> None:
    """Let the store lease WORKER_ID again after a static holder claimed it.

    Its horizon stays, so whoever takes it next still starts above every id issued under it.
    """
    with _minter(ctx) as minter:
        if minter.lease_store is None:
            raise InvalidArgument(f"store {minter.url} keeps no worker leases")
        freed = minter.lease_store.unreserve(namespace, worker_id)
    if freed:
        click.echo(f"worker {worker_id} of namespace {namespace!r} can be leased again")
    else:
        click.echo(f"worker {worker_id} of namespace {namespace!r} was not reserved")


def _iso(unix_ms: int) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(unix_ms / 1000, UTC).isoformat(timespec="milliseconds")


# -- datacenter keys ---------------------------------------------------------------------------


class Duration(click.ParamType[float]):
    """Seconds, or a number with a unit: 90s, 30m, 24h, 7d."""

    name = "duration"
    _units: ClassVar[dict[str, int]] = {"s": 1, "m": 60, "h": 3600, "d": 86400}

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, int | float):
            return float(value)
        text = str(value).strip().lower()
        unit = self._units.get(text[-1:], 0)
        try:
            seconds = float(text[:-1] if unit else text) * (unit or 1)
        except ValueError:
            self.fail(f"{value!r} is not a duration (like 90s, 30m, 24h, 7d)", param, ctx)
        if not 0 < seconds < float("inf"):
            self.fail(f"{value!r} must be longer than 0", param, ctx)
        return seconds


def _sizing_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(
        [
            click.option(
                "--runway",
                "--dc-runway",
                type=Duration(),
                help="Reserve enough for this long at each datacenter's rate [default: 24h].",
            ),
            click.option(
                "--min-reservation",
                type=int,
                help="The fewest ids a reservation takes [default: 1/64 of the key's "
                "ids, at most 10,000,000].",
            ),
            click.option(
                "--max-reservation",
                type=int,
                help="The most ids a reservation takes [default: 1/8 of the key's ids].",
            ),
            click.option(
                "--preload-at",
                type=Finite(),
                help="Load a datacenter's next reservation once this share of its "
                "current one is handed out [default: 0.5].",
            ),
            click.option(
                "--window",
                type=Duration(),
                help="The rate is measured over the last one or two of these [default: 1h].",
            ),
        ]
    ):
        command = option(command)
    return command


def _given(options: dict[str, Any]) -> dict[str, Any]:
    """The options the command line gave (the others are None)."""
    return {k: v for k, v in options.items() if v is not None}


@cli.group("quorum")
def quorum_group() -> None:
    """Quorum keys: ids strictly increasing across every caller, from a majority of nodes.

    The store (--store) keeps each key's name and bounds, so that a name is one key of one
    kind; the key's counters live on the nodes it is served from (--quorum URLS)."""


@quorum_group.command("add")
@store_options
@click.argument("name")
@click.option(
    "--start", type=int, default=DEFAULT_FIRST_ID, show_default=True, help="The first id."
)
@click.option(
    "--max",
    "max_",
    type=int,
    default=ID_MAX,
    help=f"The largest id; {UINT31_MAX} for a 32-bit key [default: {ID_MAX}].",
)
@click.option("--description", default="", help="Free text, up to 256 characters.")
@click.option(
    "--exist-ok", is_flag=True, help="The same key already there (same bounds) is not an error."
)
@click.pass_context
def quorum_add(
    ctx: click.Context, name: str, start: int, max_: int, description: str, exist_ok: bool
) -> None:
    """Create quorum key NAME (its name and bounds, in the store)."""
    with _minter(ctx, create=True) as minter:
        key = minter.add_quorum_key(
            name, start=start, max=max_, description=description, exist_ok=exist_ok
        )
    click.echo(f"quorum key {key.name}: ids {key.start}..{key.max}")


@quorum_group.command("list")
@store_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per key.")
@click.pass_context
def quorum_list(ctx: click.Context, as_json: bool) -> None:
    """List every quorum key."""
    with _minter(ctx) as minter:
        found = minter.quorum_keys()
    for key in found:
        click.echo(
            json.dumps(key.as_dict()) if as_json else f"{key.name}  ids {key.start}..{key.max}"
        )


@cli.group("dc")
def dc_group() -> None:
    """Datacenter keys: ids that keep coming while a datacenter is cut off (Farfetch's design).

    A global counter hands each datacenter a reservation sized by time; processes take ranges
    from their datacenter's reservation with a local compare-and-set."""


@dc_group.command("add")
@store_options
@click.argument("name")
@click.option(
    "--step",
    type=int,
    default=DEFAULT_STEP,
    show_default=True,
    help="Ids a process takes at a time (it grows with the rate).",
)
@click.option(
    "--start", type=int, default=DEFAULT_FIRST_ID, show_default=True, help="The first id."
)
@click.option(
    "--max",
    "max_",
    type=int,
    default=UINT31_MAX,
    show_default=True,
    help="The last id (2147483647: a 32-bit key).",
)
@click.option("--description", default="", help="Free text, up to 256 characters.")
@_sizing_options
@click.option("--exist-ok", is_flag=True, help="A key of that name already there is not an error.")
@click.pass_context
def dc_add(
    ctx: click.Context,
    /,
    name: str,
    step: int,
    start: int,
    max_: int,
    description: str,
    exist_ok: bool,
    **sizing: Any,
) -> None:
    """Create datacenter key NAME (on the global store, --store)."""
    with _minter(ctx, create=True) as minter:
        try:
            key = minter.add_datacenter_key(
                name,
                step=step,
                start=start,
                max=max_,
                description=description,
                sizing=ReservationSizing(**_given(sizing)),
            )
        except KeyExists as exc:
            if not exist_ok or isinstance(exc, NameTaken):  # another kind's name: never fine
                raise
            key = minter.datacenters().get_key(name)
            click.echo(f"{key.name} exists: {_describe_key(key)}")
            return
        click.echo(f"added datacenter key {key.name}: {_describe_key(key)}")


@dc_group.command("list")
@store_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per key.")
@click.pass_context
def dc_list(ctx: click.Context, as_json: bool) -> None:
    """List every datacenter key."""
    with _minter(ctx) as minter:
        found = minter.datacenters().list_keys()
    for key in found:
        click.echo(
            json.dumps(key.as_dict())
            if as_json
            else f"{key.name}  {_describe_key(key)}, next unreserved {key.next_id}"
        )


@dc_group.command("set")
@store_options
@click.argument("name")
@_sizing_options
@click.pass_context
def dc_set(ctx: click.Context, /, name: str, **sizing: Any) -> None:
    """Change how NAME's reservations are sized, from each datacenter's next one."""
    with _minter(ctx) as minter:
        now = minter.datacenters().set_sizing(name, **_given(sizing))
    click.echo(f"{name}: {_describe_sizing(now)}")


def _describe_sizing(s: ReservationSizing) -> str:
    return (
        f"runway {s.runway / 3600:g} h at the rate of the last {s.window / 60:g} min, "
        f"{s.min_reservation:,} to {s.max_reservation:,} ids a reservation, preloaded at "
        f"{s.preload_at:.0%}"
    )


@dc_group.command("status")
@store_options
@click.argument("name")
@dc_options()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per datacenter.")
@click.pass_context
def dc_status(
    ctx: click.Context, name: str, dc: str | None, dc_store: str | None, as_json: bool
) -> None:
    """Each datacenter's reservation of NAME, what it preloaded, its rate and runway.

    Datacenters whose cells the global store does not hold (on etcd, each has its own) show
    their latest reservation only; give --dc and --dc-store to see one from its own store."""
    sizing: ReservationSizing | None = None
    with _minter(ctx) as minter:
        level = minter.datacenters(dc, dc_store=dc_store) if dc else minter.datacenters()
        try:
            shown = level.status(name)
            sizing = level.settings(name)
        except StoreUnavailable as exc:
            if not dc:
                raise
            # Cut off from the global level: the datacenter's own cell still answers.
            mine = level.local_status(name)
            shown = [] if mine is None else [mine]
            click.echo(
                f"idmint: the global store does not answer ({' '.join(str(exc).split())}); "
                f"datacenter {dc} from its own store only",
                err=True,
            )
    if as_json:
        for status in shown:
            click.echo(json.dumps(status.as_dict()))
        return
    if sizing is not None:
        click.echo(f"{name}: {_describe_sizing(sizing)}")
    if not shown:
        click.echo(f"no datacenter has taken a reservation of {name} yet")
        return
    rows = [("DC", "RESERVED", "NEXT", "PRELOADED", "LEFT", "RATE/S", "RUNWAY", "GRANTS", "SEEN")]
    for st in shown:
        rows.append(
            (
                st.dc + (" (retired)" if st.retired else ""),
                f"{st.reserved[0]}..{st.reserved[1] - 1}" if st.reserved else "-",
                "-" if st.next_id is None else str(st.next_id),
                f"{st.preloaded[0]}..{st.preloaded[1] - 1}" if st.preloaded else "-",
                "-" if st.left is None else str(st.left),
                "-" if st.rate is None else f"{st.rate:.1f}",
                "-" if st.runway_s is None else f"{st.runway_s / 3600:.1f} h",
                str(st.grants),
                st.seen_from,
            )
        )
    _print_table(rows)


@dc_group.command("retire")
@store_options
@click.argument("name")
@dc_options(required=True)
@click.pass_context
def dc_retire(ctx: click.Context, name: str, dc: str, dc_store: str | None) -> None:
    """Stop datacenter --dc taking ids of NAME and give its unused ones back to the key."""
    with _minter(ctx) as minter:
        back = minter.datacenters(dc, dc_store=dc_store).retire(name)
    given = ", ".join(f"{r.start}..{r.last}" for r in back) or "nothing (given back already)"
    click.echo(f"{name}: datacenter {dc} retired; gave back {given}")


@dc_group.command("reopen")
@store_options
@click.argument("name")
@dc_options(required=True)
@click.pass_context
def dc_reopen(ctx: click.Context, name: str, dc: str, dc_store: str | None) -> None:
    """Let a retired datacenter take ids of NAME again (from a new reservation)."""
    with _minter(ctx) as minter:
        minter.datacenters(dc, dc_store=dc_store).reopen(name)
    click.echo(f"{name}: datacenter {dc} takes ids again")


@dc_group.command("reset")
@store_options
@click.argument("name")
@dc_options(required=True)
@click.option(
    "--yes",
    is_flag=True,
    required=True,
    help="Confirm that no process of the datacenter serves the old reservations.",
)
@click.pass_context
def dc_reset(ctx: click.Context, name: str, dc: str, dc_store: str | None, yes: bool) -> None:
    """Abandon what datacenter --dc held of NAME after its store lost data: its reservations
    are skipped, never reused, and it starts from a new one."""
    with _minter(ctx) as minter:
        minter.datacenters(dc, dc_store=dc_store).reset(name)
    click.echo(f"{name}: datacenter {dc} starts from a new reservation")


def _when(key: Key) -> str:
    return key.updated_at.strftime("%Y-%m-%d %H:%M:%S") if key.updated_at else "-"


def _fail(message: str, code: int) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
