"""The Minter a command works on: the store that --store, IDMINT_STORE or --config names."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from .._errors import IdmintError, InvalidArgument, KeyNotFound, WrongKind, did_you_mean
from .._minter import Minter, connect
from ..stores.sql.sqlite import sqlite_path


@contextmanager
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
