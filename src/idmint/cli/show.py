"""How commands print what they found: tables, keys, times."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import click

from ..ids import Key


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
