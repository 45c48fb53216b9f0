"""`idmint next`: ids of a segment, datacenter or quorum key, printed as they are taken."""

from __future__ import annotations

import contextlib

import click

from .._errors import Exhausted, IdmintError
from .._minter import Minter
from ..ids import Range, check_count
from ..strategies.quorum_nodes import QuorumOptions, split_nodes
from .options import MAX_COUNT, Int64, count_option, dc_options, quorum_options, store_options
from .root import describe_key, open_minter

#: Ids printed per write: the memory of `next` stays small whatever -n is.
PRINT_CHUNK = 10_000


@click.command("next")
@store_options
@click.argument("name")
@count_option(help=f"How many ids, {MAX_COUNT:,} at most.")
@click.option(
    "--stripe",
    type=Int64(),  # the store says which stripes the key has
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
    replicated_nodes: bool | None,
) -> None:
    """Print COUNT new ids of key NAME, one per line.

    Takes exactly COUNT ids from the store in one allocation, so nothing is wasted (a striped
    key's ids are its stripes apart; at a stripe's end the rest come from another stripe).
    With --dc, of a datacenter key, from that datacenter's reservation. With --quorum, of a
    quorum key on those nodes (--store holds its name and bounds): above every id of the key
    handed out before.
    """
    check_count(count, maximum=MAX_COUNT)  # before the store: nothing taken on a typo
    if quorum is not None:
        if dc or dc_store or stripe is not None:
            raise click.UsageError("--quorum takes no --dc, --dc-store or --stripe")
        options = QuorumOptions(
            unsafe=bool(unsafe_nodes),
            replicated_nodes=bool(replicated_nodes),
            deadline=max(ctx.obj["timeout"], 5.0),
        )
        _print_ids(_quorum_ids(ctx, name, quorum, options, count))
        return
    with open_minter(ctx, dc, dc_store) as minter:  # a store that is not there has no key
        left = count
        while left:
            try:
                taken = minter.take(name, left, stripe=stripe)
            except Exhausted:
                _refuse_if_retired(minter, name, dc)
                raise
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


def _refuse_if_retired(minter: Minter, name: str, dc: str | None) -> None:
    """Say a retired key is retired: the store refuses its ranges as exhausted, "every id up
    to its maximum is used", which is not so (`idmint keys retire` moved its floor past it)."""
    if dc:
        return  # a datacenter key's retirement is a datacenter's, and says so itself
    try:
        key = minter.key(name)
    except IdmintError:  # the store is gone: the store's own error stands
        return
    if key.retired:
        raise IdmintError(f"key {name!r} is {describe_key(key)}")


def _quorum_ids(
    ctx: click.Context, name: str, nodes: str, options: QuorumOptions, count: int
) -> Range:
    """Ids of quorum key `name` (made in the store with `idmint quorum add`) from `nodes`."""
    node_urls = split_nodes(nodes)  # a bad list is bad input, whatever the store
    with open_minter(ctx) as minter:
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
