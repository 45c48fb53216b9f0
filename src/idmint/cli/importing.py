"""`idmint import leaf|tinyid`: make idmint keys from a Leaf or tinyid database, each starting
above every id the peer may have handed out (docs/migrating.md).

Leaf's `leaf_alloc.max_id` and tinyid's `tiny_id_info.max_id` are where the last range the
peer took ends (Leaf hands out ids below it, tinyid up to it), so a key whose first id is
above max_id never repeats one of the peer's. A dry run by default; `--apply` creates the keys.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import click

from .._errors import (
    IdmintError,
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    StoreUnavailable,
    WrongKind,
)
from .._minter import Minter
from ..ids import ID_MAX, MAX_STRIPES, check_key_bounds, check_key_name
from ..stores._urls import redact, scrub
from .options import store_options
from .root import open_minter, print_table


@dataclass(frozen=True)
class Peer:
    title: str
    table: str
    #: Its rows as (name, max_id, step, delta, remainder, description, update_time).
    query: str


PEERS = {
    # Meituan-Dianping/Leaf, scripts/leaf_alloc.sql
    "leaf": Peer(
        "Leaf",
        "leaf_alloc",
        "SELECT biz_tag, max_id, step, 1, 0, description, update_time FROM leaf_alloc",
    ),
    # didi/tinyid, tinyid-server/db.sql
    "tinyid": Peer(
        "tinyid",
        "tiny_id_info",
        "SELECT biz_type, max_id, step, delta, remainder, NULL, update_time FROM tiny_id_info",
    ),
}
TOKENS_QUERY = "SELECT token, biz_type FROM tiny_id_token ORDER BY token, biz_type"

# MySQL errors that mean the URL or the database is wrong (exit 2), not that it is down.
_BAD_INPUT_CODES = {
    1044: "access denied to the database",
    1045: "access denied",
    1049: "no such database",
    1142: "access denied to the table",
    1146: "no such table",
    1054: "a column is missing",
}


@dataclass(frozen=True)
class PeerRow:
    name: str
    max_id: int
    step: int | None
    delta: int
    remainder: int
    description: str
    updated: datetime | None


@dataclass
class Plan:
    """What the import does with one of the peer's keys."""

    name: str
    peer_max: int
    first_id: int  # the new key's, or the existing key's
    step: int
    stripes: int
    updated: datetime | None
    description: str
    action: str = "create"  # or exists-same, conflict, refuse
    why: str = ""


@click.command("import")
@store_options
@click.argument("peer", type=click.Choice(sorted(PEERS)))
@click.option(
    "--from",
    "sources",
    metavar="URL",
    multiple=True,
    required=True,
    help="The peer's database, mysql://user:password@host/db. Again for each database of a "
    "tinyid with several (delta > 1: one database per remainder).",
)
@click.option(
    "--margin",
    type=click.IntRange(0),  # too large a margin: each key is refused, naming its bound
    default=0,
    show_default=True,
    help="Ids left unused above the peer's max_id, for what a peer still running may take "
    "before it stops (docs/migrating.md).",
)
@click.option("--key", "only", multiple=True, metavar="NAME", help="Import only this key.")
@click.option("--apply", is_flag=True, help="Create the keys (without it: a dry run).")
@click.option("--show-tokens", is_flag=True, help="Print tinyid's tokens whole, not masked.")
@click.pass_context
def import_(
    ctx: click.Context,
    peer: str,
    sources: tuple[str, ...],
    margin: int,
    only: tuple[str, ...],
    apply: bool,
    show_tokens: bool,
) -> None:
    """Create a key for each of a Leaf's (leaf_alloc) or tinyid's (tiny_id_info) keys, above
    every id the peer may have handed out. Prints what it would do; --apply does it."""
    spec = PEERS[peer]
    rows: list[PeerRow] = []
    tokens: list[tuple[str, str]] | None = [] if peer == "tinyid" else None
    for url in sources:
        found, found_tokens = _read_peer(spec, url, ctx.obj["timeout"], tokens is not None)
        rows += found
        if tokens is not None and found_tokens is not None:
            tokens += found_tokens
    by_name: dict[str, list[PeerRow]] = defaultdict(list)
    for row in rows:
        by_name[row.name].append(row)
    missing = sorted(set(only) - set(by_name))
    if missing:
        raise InvalidArgument(f"no key {', '.join(missing)} in {spec.title}'s {spec.table}")
    names = sorted(only or by_name)

    with open_minter(ctx, create=apply) as minter:
        plans = [_plan(minter, spec, name, by_name[name], margin) for name in names]
        blocked = [p for p in plans if p.action in ("conflict", "refuse")]
        if apply and not blocked:
            for plan in plans:
                if plan.action == "create":
                    _create(minter, spec, plan, by_name[plan.name], margin)
    _print_plans(plans, applied=apply and not blocked)
    if tokens is not None:
        _print_tokens(tokens, set(names), show_tokens)
    if blocked:
        listed = ", ".join(f"{p.name} ({p.action})" for p in blocked)
        raise InvalidArgument(
            f"cannot import {listed}: nothing changed; see the table (--key NAME imports "
            "the others)"
        )
    made = sum(p.action == "create" for p in plans)
    if not plans:
        click.echo(f"{spec.title}'s {spec.table} has no keys: nothing to do")
    elif apply:
        click.echo(f"{made} created, {len(plans) - made} there already with the same settings")
    else:
        click.echo(f"dry run, nothing changed: --apply would create {made} (marked create)")


def _read_peer(
    spec: Peer, url: str, timeout: float, with_tokens: bool
) -> tuple[list[PeerRow], list[tuple[str, str]] | None]:
    """The peer's rows (and tinyid's tokens; None without a token table) from database `url`."""
    # Imported here, as open_minter's stores are: only this command needs the driver.
    from ..stores.sql.mysql import mysql_dialect

    shown = redact(url)
    if url.split("://", 1)[0].lower() not in ("mysql", "mariadb"):
        raise InvalidArgument(
            f"bad --from {shown!r}: {spec.title}'s database is mysql://user:password@host/db"
        )
    dialect = mysql_dialect(url, shown, timeout=timeout)
    try:
        conn = dialect.connect()
    except Exception as exc:
        raise _peer_error(exc, url, shown, spec) from None
    try:
        with conn.cursor() as cur:
            try:
                cur.execute(spec.query)
                rows = [_peer_row(spec, *row) for row in cur.fetchall()]
            except Exception as exc:
                raise _peer_error(exc, url, shown, spec) from None
            if not with_tokens:
                return rows, None
            try:
                cur.execute(TOKENS_QUERY)
            except Exception as exc:
                if _code(exc) != 1146:
                    raise _peer_error(exc, url, shown, spec) from None
                return rows, None  # tinyid without tokens: its clients' calls were refused
            return rows, [(str(t), str(b)) for t, b in cur.fetchall()]
    finally:
        conn.close()


def _peer_row(spec: Peer, name: Any, max_id: Any, step: Any, *rest: Any) -> PeerRow:
    delta, remainder, description, updated = rest
    return PeerRow(
        name=str(name),
        max_id=int(max_id),
        step=None if step is None else int(step),  # tinyid's step column may be NULL
        delta=int(delta),
        remainder=int(remainder),
        description=str(description or "") or f"imported from {spec.title}",
        updated=updated if isinstance(updated, datetime) else None,
    )


def _code(exc: BaseException) -> int | None:
    args = getattr(exc, "args", ())
    return int(args[0]) if args and isinstance(args[0], int) else None


def _peer_error(exc: Exception, url: str, shown: str, spec: Peer) -> IdmintError:
    """One line for what went wrong with the peer's database: bad input (exit 2) when the URL,
    the database or its tables are wrong, else the database is unavailable (exit 1)."""
    if isinstance(exc, IdmintError):
        return exc
    code = _code(exc)
    detail = scrub(str(exc.args[-1] if exc.args else exc), url)
    if code in _BAD_INPUT_CODES:
        hint = f": is it {spec.title}'s database?" if code in (1146, 1054) else ""
        return InvalidArgument(
            f"{spec.title} database {shown}: {_BAD_INPUT_CODES[code]} ({detail}){hint}"
        )
    return StoreUnavailable(f"{spec.title} database {shown} unavailable: {detail}")


def _plan(minter: Minter, spec: Peer, name: str, rows: Sequence[PeerRow], margin: int) -> Plan:
    peer_max = max(r.max_id for r in rows)
    stripes = rows[0].delta
    # tinyid's step is integers per range (ids of one remainder: step / delta); idmint's
    # step counts ids of one stripe.
    step = max((r.step or 0) for r in rows) // max(stripes, 1)
    first = max(peer_max + 1 + margin, 0)
    if stripes > 1:  # first = 0 mod delta: stripe k hands out tinyid's remainder k
        first += -first % stripes
    updated = max((r.updated for r in rows if r.updated), default=None)
    plan = Plan(name, peer_max, first, step, stripes, updated, rows[0].description)
    why = _unrepresentable(spec, name, rows)
    if not why:
        try:
            check_key_name(name)
            check_key_bounds(step, first, ID_MAX + 1 - stripes, stripes)
        except InvalidArgument as exc:
            why = str(exc)
    if why:
        plan.action, plan.why = "refuse", why
        return plan
    try:
        key = minter.key(name)
    except WrongKind as exc:
        plan.action, plan.why = "conflict", str(exc)
        return plan
    except KeyNotFound:
        return plan  # create
    plan.first_id = key.first_id
    differs = []
    if key.retired:
        differs.append("it is retired")
    elif key.first_id <= peer_max:
        differs.append(f"its ids start at {key.first_id}, not above the peer's max_id")
    if key.step != step:
        differs.append(f"its step is {key.step}, not {step}")
    if key.stripes != stripes:
        differs.append(f"it has {key.stripes} stripes, not {stripes}")
    plan.action, plan.why = ("conflict", "; ".join(differs)) if differs else ("exists-same", "")
    return plan


def _unrepresentable(spec: Peer, name: str, rows: Sequence[PeerRow]) -> str:
    """Why the peer's key cannot be an idmint key, or ""."""
    if any(not r.step or r.step < 1 for r in rows):
        return f"its step is not positive: {spec.title} hands out no id with it"
    deltas = sorted({r.delta for r in rows})
    if len(deltas) > 1:
        return f"its databases disagree on delta: {', '.join(map(str, deltas))}"
    delta = deltas[0]
    if delta == 1:
        return ""  # every id in the range: a plain key (remainder means nothing mod 1)
    if not 1 < delta <= MAX_STRIPES:
        return f"its delta {delta} is not from 1 to {MAX_STRIPES}"
    have = {r.remainder for r in rows}
    if len(have) < len(rows) or not have <= set(range(delta)):
        return f"its remainders {sorted(r.remainder for r in rows)} do not fit delta {delta}"
    absent = sorted(set(range(delta)) - have)
    if absent:
        # An idmint key hands out every id above its start (a striped key's stripes
        # together), never only one remainder; and the databases not given hold the other
        # remainders' max_id, which the new key must also be above.
        return (
            f"tinyid hands out only ids = {', '.join(map(str, sorted(have)))} mod {delta} "
            f"from the databases given: give --from for remainder "
            f"{', '.join(map(str, absent))} too, or, if its clients need no such remainder, "
            f"add it yourself above every database's max_id (idmint keys add {name} --start N)"
        )
    return ""


def _create(minter: Minter, spec: Peer, plan: Plan, rows: Sequence[PeerRow], margin: int) -> None:
    try:
        minter.add_key(
            plan.name,
            step=plan.step,
            start=plan.first_id,
            stripes=plan.stripes,
            description=plan.description[:256],
        )
    except KeyExists:  # made since the plan: fine if it is what the plan would accept
        again = _plan(minter, spec, plan.name, rows, margin)
        if again.action != "exists-same":
            raise KeyExists(
                plan.name,
                f"key {plan.name!r} was made meanwhile with other settings ({again.why}); "
                "the keys above it in the table were created",
            ) from None


def _print_plans(plans: Sequence[Plan], *, applied: bool) -> None:
    if not plans:
        return
    rows: list[tuple[str, ...]] = [
        ("KEY", "PEER MAX_ID", "FIRST ID", "STEP", "STRIPES", "PEER UPDATED", "ACTION", "WHY")
    ]
    for p in plans:
        action = "created" if applied and p.action == "create" else p.action
        updated = p.updated.strftime("%Y-%m-%d %H:%M:%S") if p.updated else "-"
        cells = (p.name, p.peer_max, p.first_id, p.step, p.stripes, updated, action, p.why)
        rows.append(tuple(map(str, cells)))
    print_table(rows)


def _print_tokens(tokens: Iterable[tuple[str, str]], imported: set[str], whole: bool) -> None:
    """tinyid's tokens and the keys each may use. idmint has no token per key: one client
    token (--client-token, or the admin token) opens every id route, tinyid's too."""
    keys_of: dict[str, set[str]] = defaultdict(set)
    for token, biz_type in tokens:
        keys_of[token].add(biz_type)
    if not keys_of:
        click.echo("tokens: tiny_id_token is empty or missing")
        return
    click.echo("tokens (tiny_id_token; idmint takes one client token for every key):")
    for token, names in sorted(keys_of.items()):
        shown = token if whole else (token[:4] + "..." if len(token) > 8 else "***")
        elsewhere = sorted(names - imported)
        note = f"  (not imported: {', '.join(elsewhere)})" if elsewhere else ""
        click.echo(f"  {shown}  {', '.join(sorted(names & imported)) or '-'}{note}")
    if len(keys_of) == 1:
        click.echo(
            "  one token: serve with it as the client token (IDMINT_CLIENT_TOKEN_FILE) and "
            "tinyid's clients keep sending it unchanged"
        )
    else:
        click.echo(
            f"  {len(keys_of)} tokens: serve without a client token (any token is taken) "
            "where only your clients reach it, or give every client the one client token"
        )
