"""`idmint dc`: datacenter keys, their reservations and the datacenters that take them."""

from __future__ import annotations

import json
from typing import Any

import click

from .._errors import KeyExists, NameTaken, StoreUnavailable
from ..ids import UINT31_MAX
from ..strategies.datacenter_cells import ReservationSizing
from .options import (
    Duration,
    Finite,
    dc_options,
    description_option,
    exist_ok_option,
    json_option,
    max_option,
    stacked,
    start_option,
    step_option,
    store_options,
)
from .root import describe_key, open_minter, print_table

#: How reservations are sized (ReservationSizing's fields): `dc add` and `dc set` take them,
#: each None unless given, so the key's (or the default) setting stays.
_sizing_options = stacked(
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
)

#: Key NAME and datacenter --dc: what `dc retire`, `dc reopen` and `dc reset` act on.
_named_dc = stacked(store_options, click.argument("name"), dc_options(required=True))


def _given(options: dict[str, Any]) -> dict[str, Any]:
    """The options the command line gave (the others are None)."""
    return {k: v for k, v in options.items() if v is not None}


def _describe_sizing(s: ReservationSizing) -> str:
    return (
        f"runway {s.runway / 3600:g} h at the rate of the last {s.window / 60:g} min, "
        f"{s.min_reservation:,} to {s.max_reservation:,} ids a reservation, preloaded at "
        f"{s.preload_at:.0%}"
    )


@click.group("dc")
def dc_group() -> None:
    """Datacenter keys: ids that keep coming while a datacenter is cut off (Farfetch's design).

    A global counter hands each datacenter a reservation sized by time; processes take ranges
    from their datacenter's reservation with a local compare-and-set."""


@dc_group.command("add")
@store_options
@click.argument("name")
@step_option(help="Ids a process takes at a time (it grows with the rate).")
@start_option()
@max_option(default=UINT31_MAX, show_default=True, help="The last id (2147483647: a 32-bit key).")
@description_option()
@_sizing_options
@exist_ok_option()
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
    with open_minter(ctx, create=True) as minter:
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
            click.echo(f"{key.name} exists: {describe_key(key)}")
            return
        click.echo(f"added datacenter key {key.name}: {describe_key(key)}")


@dc_group.command("list")
@store_options
@json_option()
@click.pass_context
def dc_list(ctx: click.Context, as_json: bool) -> None:
    """List every datacenter key."""
    with open_minter(ctx) as minter:
        found = minter.datacenters().list_keys()
    for key in found:
        click.echo(
            json.dumps(key.as_dict())
            if as_json
            else f"{key.name}  {describe_key(key)}, next unreserved {key.next_id}"
        )


@dc_group.command("set")
@store_options
@click.argument("name")
@_sizing_options
@click.pass_context
def dc_set(ctx: click.Context, /, name: str, **sizing: Any) -> None:
    """Change how NAME's reservations are sized, from each datacenter's next one."""
    with open_minter(ctx) as minter:
        now = minter.datacenters().set_sizing(name, **_given(sizing))
    click.echo(f"{name}: {_describe_sizing(now)}")


@dc_group.command("status")
@store_options
@click.argument("name")
@dc_options()
@json_option(help="One JSON object per datacenter.")
@click.pass_context
def dc_status(
    ctx: click.Context, name: str, dc: str | None, dc_store: str | None, as_json: bool
) -> None:
    """Each datacenter's reservation of NAME, what it preloaded, its rate and runway.

    Datacenters whose cells the global store does not hold (on etcd, each has its own) show
    their latest reservation only; give --dc and --dc-store to see one from its own store."""
    sizing: ReservationSizing | None = None
    with open_minter(ctx) as minter:
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
    print_table(rows)


@dc_group.command("retire")
@_named_dc
@click.pass_context
def dc_retire(ctx: click.Context, name: str, dc: str, dc_store: str | None) -> None:
    """Stop datacenter --dc taking ids of NAME and give its unused ones back to the key."""
    with open_minter(ctx) as minter:
        back = minter.datacenters(dc, dc_store=dc_store).retire(name)
    given = ", ".join(f"{r.start}..{r.last}" for r in back) or "nothing (given back already)"
    click.echo(f"{name}: datacenter {dc} retired; gave back {given}")


@dc_group.command("reopen")
@_named_dc
@click.pass_context
def dc_reopen(ctx: click.Context, name: str, dc: str, dc_store: str | None) -> None:
    """Let a retired datacenter take ids of NAME again (from a new reservation)."""
    with open_minter(ctx) as minter:
        minter.datacenters(dc, dc_store=dc_store).reopen(name)
    click.echo(f"{name}: datacenter {dc} takes ids again")


@dc_group.command("reset")
@_named_dc
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
    with open_minter(ctx) as minter:
        minter.datacenters(dc, dc_store=dc_store).reset(name)
    click.echo(f"{name}: datacenter {dc} starts from a new reservation")
