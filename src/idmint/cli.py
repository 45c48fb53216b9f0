"""The `idmint` command. A thin shell: parse, call the Minter, print.

Errors print one line on stderr, never a traceback. Exit codes: 0 done, 1 the store failed or a
key is exhausted (try again later, or look at the store), 2 bad input (a usage error, a bad URL,
an unknown key, a bad count).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from . import __version__
from ._errors import Exhausted, IdmintError, InvalidArgument, KeyExists, KeyNotFound
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
)
from .stores import DEFAULT_STORE_URL, DEFAULT_TIMEOUT

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


@contextmanager
def _minter(ctx: click.Context) -> Iterator[Minter]:
    minter = connect(ctx.obj["store"], timeout=ctx.obj["timeout"])
    try:
        yield minter
    finally:
        minter.close()


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
    type=click.FloatRange(min=0.1, max=600),
    default=DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds to wait for the store (env IDMINT_TIMEOUT).",
)
@click.version_option(__version__, prog_name="idmint")
@click.pass_context
def cli(ctx: click.Context, store: str, timeout: float) -> None:
    """Mint short, unique integer ids from the databases you already run."""
    given = {
        name
        for name in ("store", "timeout")
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    }
    ctx.obj = {"store": store, "timeout": timeout, "given": given}


def _override(ctx: click.Context, param: click.Parameter, value: object) -> None:
    if value is not None and param.name:
        ctx.obj[param.name] = value
        ctx.obj["given"].add(param.name)


def store_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--store and --timeout after the command name too: `idmint serve --store URL`."""
    command = click.option(
        "--timeout",
        type=click.FloatRange(min=0.1, max=600),
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


@cli.command()
@store_options
@click.pass_context
def init(ctx: click.Context) -> None:
    """Create the store's table (it is also created on first use)."""
    with _minter(ctx) as minter:
        minter.init()
        identity = minter.identity()
        made = ""
        if identity is not None and identity.created_ms:
            made = f", made {_iso(identity.created_ms)}"
        click.echo(
            f"initialised {minter.url}" + (f" (store {identity.id}{made})" if identity else "")
        )


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
    with _minter(ctx) as minter:
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
        except KeyExists:
            if not exist_ok:
                raise
            key = minter.key(name)
            click.echo(f"{key.name} exists: {_describe_key(key)}")
            return
        click.echo(f"added {key.name}: {_describe_key(key)}")


def _describe_key(key: Key) -> str:
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
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


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
@click.option("--to", "to", type=int, required=True, help="Every id from now on is at least this.")
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
    type=int,
    help="Of a striped key, take them from this stripe (0 to its stripes - 1) [default: any "
    "with ids left].",
)
@click.pass_context
def next_(ctx: click.Context, name: str, count: int, stripe: int | None) -> None:
    """Print COUNT new ids of key NAME, one per line.

    Takes exactly COUNT ids from the store in one allocation, so nothing is wasted (a striped
    key's ids are its stripes apart; at a stripe's end the rest come from another stripe).
    """
    check_count(count, maximum=MAX_COUNT)  # before the store: nothing taken on a typo
    with _minter(ctx) as minter:
        left = count
        while left:
            taken = minter.take(name, left, stripe=stripe)
            _print_ids(taken)
            left -= len(taken)
            if left and (stripe is not None or taken.stride == 1):
                # A bounded key (or the stripe asked for) ran out: the ids above are good.
                if stripe is None:
                    raise Exhausted(name, taken.last)
                raise Exhausted(name, stripe=stripe, stripes=taken.stride)
            # A striped key's stripe ran out: the next take is from another (or says the
            # whole key is exhausted).


def _print_ids(taken: Range) -> None:
    """The ids of a range, one per line, in chunks as they are made: one string of every id
    would be the whole batch in memory."""
    step = PRINT_CHUNK * taken.stride
    for start in range(taken.start, taken.stop, step):
        chunk = range(start, min(start + step, taken.stop), taken.stride)
        click.echo("\n".join(map(str, chunk)))


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
    type=float,
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
    type=float,
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
    config_file: Path | None,
) -> None:
    """Serve ids over HTTP (Leaf-compatible routes, dashboard at /, metrics at /metrics)."""
    from .server.config import ServerConfig, read_config_file
    from .server.run import serve as run_server

    values = read_config_file(config_file) if config_file else {}
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
    with _minter(ctx) as minter:
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
    bad = [text for text in ids if not text.isdigit()]
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
@click.argument("worker_id", type=click.IntRange(min=0))
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


def _when(key: Key) -> str:
    return key.updated_at.strftime("%Y-%m-%d %H:%M:%S") if key.updated_at else "-"


def _fail(message: str, code: int) -> int:
    click.echo(f"idmint: error: {message}", err=True)
    return code


def main(argv: list[str] | None = None, run: Callable[..., Any] = cli.main) -> int:
    """Run the CLI and turn every error into one line on stderr and an exit code."""
    try:
        result = run(args=argv, prog_name="idmint", standalone_mode=False)
    except click.exceptions.Abort:
        return _fail("interrupted", 130)
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
