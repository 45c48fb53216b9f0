"""`idmint snowflake`, `idmint decode` and `idmint workers`: snowflake ids and the worker ids
they are made under."""

from __future__ import annotations

import difflib
import json
from typing import Any

import click

from .._errors import InvalidArgument
from ..ids import check_count, is_digits
from ..layout import layout_named
from ..strategies.snowflake import SnowflakeOptions
from .options import (
    MAX_COUNT,
    count_option,
    json_option,
    layout_option,
    namespace_option,
    store_options,
)
from .root import iso, open_minter


@click.command()
@store_options
@count_option()
@layout_option()
@namespace_option(help="The worker ids' namespace in the store.")
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
    check_count(count, maximum=MAX_COUNT)
    with open_minter(ctx, create=True) as minter:
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


# Unknown options reach IDS: click took `decode -1` for an option ("No such option"); a
# negative number is then refused as an id, and anything else as the option it looks like.
@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("ids", nargs=-1, required=True)
@layout_option()
@json_option(help="One JSON object per id.")
@click.pass_context
def decode(ctx: click.Context, ids: tuple[str, ...], layout: str, as_json: bool) -> None:
    """Show the time, worker and sequence of snowflake IDS."""
    chosen = layout_named(layout)
    bad = [text for text in ids if not is_digits(text)]
    if bad:
        if bad[0].startswith("-") and not is_digits(bad[0][1:]):
            options = [o for p in ctx.command.params for o in p.opts if o.startswith("-")]
            close = difflib.get_close_matches(bad[0], options)
            raise click.NoSuchOption(bad[0], possibilities=close, ctx=ctx)
        raise InvalidArgument(f"{bad[0]!r} is not an id: ids are non-negative integers")
    for parts in [chosen.decode(int(text)) for text in ids]:
        if as_json:
            click.echo(json.dumps(parts.as_dict()))
        else:
            click.echo(
                f"{parts.id}  time {parts.time.isoformat()}  worker {parts.worker}  "
                f"sequence {parts.sequence}"
            )


@click.group()
def workers() -> None:
    """Snowflake worker-id leases."""


@workers.command("list")
@store_options
@namespace_option()
@click.pass_context
def workers_list(ctx: click.Context, namespace: str) -> None:
    """Who holds which worker id, until when, and each id's horizon."""
    with open_minter(ctx) as minter:
        if minter.lease_store is None:
            raise InvalidArgument(f"store {minter.url} keeps no worker leases")
        rows = minter.lease_store.holders(namespace)
    click.echo("WORKER  KIND    HOLDER                          EXPIRES_IN  HORIZON")
    for row in rows:
        live = row.owner and row.expires_in is not None and row.expires_in > 0
        holder = row.host if live else "-"
        left = f"{row.expires_in:.1f}s" if live and row.expires_in is not None else "free"
        horizon = iso(row.horizon_ms) if row.horizon_ms else "-"
        kind = "static" if row.static else "leased"
        click.echo(f"{row.worker_id:<7} {kind:<7} {holder:<31} {left:<11} {horizon}")


@workers.command("unreserve")
@store_options
@click.argument("worker_id", type=click.IntRange(0, 2**31 - 1))
@namespace_option()
@click.pass_context
def workers_unreserve(ctx: click.Context, worker_id: int, namespace: str) -> None:
    """Let the store lease WORKER_ID again after a static holder claimed it.

    Its horizon stays, so whoever takes it next still starts above every id issued under it.
    """
    with open_minter(ctx) as minter:
        if minter.lease_store is None:
            raise InvalidArgument(f"store {minter.url} keeps no worker leases")
        freed = minter.lease_store.unreserve(namespace, worker_id)
    if freed:
        click.echo(f"worker {worker_id} of namespace {namespace!r} can be leased again")
    else:
        click.echo(f"worker {worker_id} of namespace {namespace!r} was not reserved")
