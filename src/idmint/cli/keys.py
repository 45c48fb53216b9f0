"""`idmint keys`: add, list, show, raise, retire and set segment keys; `idmint quorum`: quorum
keys' names and bounds, kept in the store."""

from __future__ import annotations

import json

import click

from .._errors import KeyExists, NameTaken
from ..ids import ID_MAX, MAX_STRIPES, UINT31_MAX, Key
from .options import (
    description_option,
    exist_ok_option,
    given_params,
    json_option,
    max_batch_option,
    max_option,
    start_option,
    step_option,
    store_options,
)
from .root import describe_key, open_minter, print_table, when


@click.group()
def keys() -> None:
    """Add, list, show, raise, retire and set keys."""


@keys.command("add")
@store_options
@click.argument("name")
@step_option(help="Ids per range taken from the store (the dynamic step grows from here).")
@start_option(help="The first id, e.g. above legacy ids.")
@max_option(
    help=f"The largest id; {UINT31_MAX} for a 32-bit key [default: {ID_MAX}, less one per "
    "stripe after the first]."
)
@description_option()
@max_batch_option(default=0, show_default=True)
@click.option(
    "--stripes",
    type=int,
    default=1,
    show_default=True,
    help=f"Independent counters, 1 to {MAX_STRIPES}: stripe k hands out start + k, "
    "start + k + N, ... so N processes take ranges without waiting for each other.",
)
@exist_ok_option()
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
    given = given_params(ctx, "step", "stripes")  # compared with a key there only if given
    with open_minter(ctx, create=True) as minter:

        def add(exist_ok: bool) -> Key:
            return minter.add_key(
                name,
                step=step if "step" in given else None,
                start=start,
                max=max_,
                description=description,
                max_batch=max_batch,
                stripes=stripes if "stripes" in given else None,
                exist_ok=exist_ok,
            )

        try:
            key = add(exist_ok=False)
        except KeyExists as exc:
            if not exist_ok or isinstance(exc, NameTaken):  # another kind's name: never fine
                raise
            key = add(exist_ok=True)  # the key there, unless it differs from what was asked
            click.echo(f"{key.name} exists: {describe_key(key)}")
            return
        click.echo(f"added {key.name}: {describe_key(key)}")


@keys.command("list")
@store_options
@json_option()
@click.pass_context
def keys_list(ctx: click.Context, as_json: bool) -> None:
    """List every key."""
    with open_minter(ctx) as minter:
        all_keys = minter.keys()
    if as_json:
        for key in all_keys:
            click.echo(json.dumps(key.as_dict()))
        return
    rows = [("KEY", "NEXT", "STEP", "FIRST", "MAX", "REMAINING", "BATCH CAP", "STRIPES", "UPDATED")]
    rows += [
        (
            # Retired: its FIRST is past its MAX, the store keeps no other (see keys show).
            f"{k.name} (retired)" if k.retired else k.name,
            str(k.next_id),  # a striped key's: the lowest stripe's
            str(k.step),
            "-" if k.retired else str(k.first_id),
            str(k.last_id),
            str(k.remaining),
            str(k.batch_cap),
            str(k.stripes),
            when(k),
        )
        for k in all_keys
    ]
    print_table(rows)


@keys.command("show")
@store_options
@click.argument("name")
@json_option(help="As a JSON object.")
@click.pass_context
def keys_show(ctx: click.Context, name: str, as_json: bool) -> None:
    """Show key NAME."""
    with open_minter(ctx) as minter:
        key = minter.key(name)
    if as_json:
        click.echo(json.dumps(key.as_dict()))
        return
    for field, value in key.as_dict().items():
        if isinstance(value, list):  # stripe_next: where each stripe's next range starts
            value = " ".join(map(str, value))
        elif field == "retired":
            value = "yes: it hands out no id again, and its unused ids are never reused"
        elif field == "start" and key.retired:
            # Retiring raised the key's floor past its maximum: the store keeps no other start.
            value = f"not kept (retiring moved it past max, to {value})"
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
    with open_minter(ctx) as minter:
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
    with open_minter(ctx) as minter:
        key = minter.retire_key(name)
    click.echo(f"retired {key.name}: it hands out no id again (max {key.last_id})")


@keys.command("set")
@store_options
@click.argument("name")
@max_batch_option(required=True)
@click.pass_context
def keys_set(ctx: click.Context, name: str, max_batch: int) -> None:
    """Change key NAME's batch cap, for every server on the store."""
    with open_minter(ctx) as minter:
        key = minter.set_max_batch(name, max_batch)
    rule = "set" if key.max_batch else "the default, the step x 100"
    click.echo(f"{key.name}: at most {key.batch_cap} ids per HTTP request ({rule})")


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
