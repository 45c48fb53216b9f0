"""`idmint quorum`: quorum keys' names and bounds, kept in the store."""

from __future__ import annotations

import json

import click

from ..ids import ID_MAX, UINT31_MAX
from .minter import open_minter
from .options import (
    description_option,
    exist_ok_option,
    json_option,
    max_option,
    start_option,
    store_options,
)


@click.group("quorum")
def quorum_group() -> None:
    """Quorum keys: ids strictly increasing across every caller, from a majority of nodes.

    The store (--store) keeps each key's name and bounds, so that a name is one key of one
    kind; the key's counters live on the nodes it is served from (--quorum URLS)."""


@quorum_group.command("add")
@store_options
@click.argument("name")
@start_option()
@max_option(
    default=ID_MAX, help=f"The largest id; {UINT31_MAX} for a 32-bit key [default: {ID_MAX}]."
)
@description_option()
@exist_ok_option(help="The same key already there (same bounds) is not an error.")
@click.pass_context
def quorum_add(
    ctx: click.Context, name: str, start: int, max_: int, description: str, exist_ok: bool
) -> None:
    """Create quorum key NAME (its name and bounds, in the store)."""
    with open_minter(ctx, create=True) as minter:
        key = minter.add_quorum_key(
            name, start=start, max=max_, description=description, exist_ok=exist_ok
        )
    click.echo(f"quorum key {key.name}: ids {key.start}..{key.max}")


@quorum_group.command("list")
@store_options
@json_option()
@click.pass_context
def quorum_list(ctx: click.Context, as_json: bool) -> None:
    """List every quorum key."""
    with open_minter(ctx) as minter:
        found = minter.quorum_keys()
    for key in found:
        click.echo(
            json.dumps(key.as_dict()) if as_json else f"{key.name}  ids {key.start}..{key.max}"
        )
