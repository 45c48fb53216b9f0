"""Datacenter admin racing its own datacenter, and one datacenter name on two local stores
(issue 19, items 3 and 4): each race is run deterministically, the racing process's steps
played at the exact point where the admin command would stall (a GC pause, SIGSTOP, a slow
global store), and every id handed out is checked to be handed out once."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import idmint
from idmint import DatacenterRanges, InvalidArgument, ReservationSizing
from idmint.stores.base import CasStore, StoreIdentity
from idmint.stores.memory import MemoryCasStore
from idmint.strategies.datacenter_cells import global_cell

from checks import assert_unique


class Paused:
    """A CasStore that runs `meanwhile` once, at the first call `when(op, cell)` picks: as if
    the process calling it stalled there while others went on."""

    def __init__(
        self, inner: CasStore, when: Callable[[str, str], bool], meanwhile: Callable[[], None]
    ) -> None:
        self.inner, self.when, self.meanwhile = inner, when, meanwhile
        self.display_url = inner.display_url
        self.ran = False

    def _maybe(self, op: str, cell: str) -> None:
        if not self.ran and self.when(op, cell):
            self.ran = True
            self.meanwhile()

    def init(self) -> None:
        self.inner.init()

    def read(self, key: str) -> tuple[str, int] | None:
        self._maybe("read", key)
        return self.inner.read(key)

    def create(self, key: str, value: str) -> bool:
        self._maybe("create", key)
        return self.inner.create(key, value)

    def swap(self, key: str, version: int, value: str) -> bool:
        self._maybe("swap", key)
        done = self.inner.swap(key, version, value)
        self._maybe("swapped", key)
        return done

    def scan(self, prefix: str) -> list[tuple[str, str]]:
        return self.inner.scan(prefix)

    def identity(self) -> StoreIdentity | None:
        return self.inner.identity()

    def close(self) -> None:
        self.inner.close()


def _key(top: CasStore) -> None:
    DatacenterRanges(top).add_key(
        "k", step=10, last_id=10**6, sizing=ReservationSizing(min_reservation=100)
    )


def _serve(dcs: DatacenterRanges, ids: list[int], count: int = 10) -> None:
    """Hand out `count` allocations of 10 ids each, recorded one by one."""
    for _ in range(count):
        ids.extend(dcs.allocate("k", 10).range)


def test_a_stalled_retire_does_not_give_back_a_grant_the_reopened_datacenter_serves() -> None:
    """4a: a retire that stalls after closing eu's cell, while another retire completes, eu is
    reopened and serves grant 2: on main the first retire then gave grant 2 back, and us took
    it again (its ids twice)."""
    top, eu_store = MemoryCasStore("memory://global"), MemoryCasStore("memory://eu")
    _key(top)
    served: list[int] = []
    eu = DatacenterRanges(top, eu_store, "eu")
    us = DatacenterRanges(top, MemoryCasStore("memory://us"), "us")
    _serve(eu, served, 10)  # grant 1, used up

    def another_retire_then_reopen_and_serve() -> None:
        other = DatacenterRanges(top, eu_store, "eu")
        other.retire("k")
        other.reopen("k")
        _serve(eu, served, 3)  # grant 2 applied and served from

    stalled = DatacenterRanges(
        Paused(
            top,
            lambda op, cell: op == "read" and cell == global_cell("k"),
            another_retire_then_reopen_and_serve,
        ),
        eu_store,
        "eu",
    )
    stalled.retire("k")
    _serve(eu, served, 3)
    _serve(us, served, 30)  # every reservation us can take, the free list first
    assert assert_unique(served) == len(served)


def test_a_reset_racing_its_datacenter_never_applies_a_grant_twice() -> None:
    """4b: `dc reset` abandons eu's grants in the global cell, then writes eu's cell afresh.
    eu's processes, retrying, make a cell and apply grant 2 in between: on main the reset's
    second step then made grant 2 apply again from its start."""
    top = MemoryCasStore("memory://global")
    _key(top)
    first_store = MemoryCasStore("memory://eu-old")
    served: list[int] = []
    _serve(DatacenterRanges(top, first_store, "eu"), served, 2)  # grant 1; then eu's store is lost
    new_store = MemoryCasStore("memory://eu-new")
    process = DatacenterRanges(top, new_store, "eu")
    with pytest.raises(InvalidArgument, match=r"lost its data.*dc reset"):
        process.allocate("k")

    reset = DatacenterRanges(
        Paused(top, lambda op, cell: op == "swapped", lambda: _serve(process, served, 3)),
        new_store,
        "eu",
    )
    reset.reset("k")
    _serve(process, served, 5)
    assert assert_unique(served) == len(served)


def test_one_datacenter_name_on_two_local_stores_is_refused_before_any_id(tmp_path: Path) -> None:
    """3: two processes of `eu` on different local stores, on a key eu has not used: on main
    both made eu's cell in their own store and served the same reservations. The global cell
    binds eu to the first store; the second is refused before it serves an id, and a reset
    moves eu to another store deliberately."""
    top = f"sqlite:///{tmp_path / 'global.db'}"
    one, two = (f"sqlite:///{tmp_path / name}" for name in ("eu1.db", "eu2.db"))
    with idmint.connect(top) as minter:
        minter.add_datacenter_key("k", step=10, max=10**6)
        first = minter.datacenter("k", "eu", dc_store=one)
        ids = [first.next_id() for _ in range(5)]
        second = minter.datacenter("k", "eu", dc_store=two)
        with pytest.raises(InvalidArgument, match=r"datacenter 'eu' .*eu1\.db.*not in .*eu2\.db"):
            second.next_id()
        assert ids == [1, 2, 3, 4, 5]
    with idmint.connect(top, dc="eu", dc_store=two) as minter:
        minter.datacenters("eu", dc_store=two).reset("k")  # eu moves to eu2.db on purpose
        moved = [minter.segment("k").next_id() for _ in range(5)]
    with idmint.connect(top, dc="eu", dc_store=one) as minter:
        # The old store serves out the reservation its cell holds (the reset abandoned it: it
        # is never anyone else's), then is refused its next grant.
        old = minter.take("k", 10**6)
        with pytest.raises(InvalidArgument, match=r"eu2\.db"):
            minter.take("k", 10)
    assert assert_unique([*ids, *moved, *old]) == len(ids) + len(moved) + len(old)


def _serve_keys(
    top: str, dc_store: str, keys: list[str], start: Any, out: multiprocessing.Queue[Any]
) -> None:
    """One process of datacenter eu on `dc_store`: 200 ids of each key, or why not."""
    start.wait(30)
    served: dict[str, list[int] | str] = {}
    with idmint.connect(top) as minter:
        for key in keys:
            try:
                gen = minter.datacenter(key, "eu", dc_store=dc_store)
                served[key] = gen.next_ids(200)
            except idmint.IdmintError as exc:
                served[key] = type(exc).__name__
    out.put((dc_store, served))


def test_two_processes_of_one_datacenter_on_two_stores_never_share_ids(tmp_path: Path) -> None:
    """3, as it happens: two processes both `--dc eu` on different local stores, started
    together on 20 keys eu has not used. On main both served every key they raced on from
    the same reservations; now each key is served from one store and refused on the other."""
    top = f"sqlite:///{tmp_path / 'global.db'}"
    keys = [f"k{i}" for i in range(20)]
    with idmint.connect(top) as minter:
        for key in keys:
            minter.add_datacenter_key(key, step=10, max=10**6)
    context = multiprocessing.get_context("fork")
    start, out = context.Barrier(2), context.Queue()
    stores = [f"sqlite:///{tmp_path / name}" for name in ("eu1.db", "eu2.db")]
    procs = [
        context.Process(target=_serve_keys, args=(top, url, keys, start, out)) for url in stores
    ]
    for proc in procs:
        proc.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(30)
    ids: list[tuple[str, int]] = []
    for key in keys:
        got = [results[url][key] for url in stores]
        assert sum(isinstance(g, list) for g in got) == 1 and "InvalidArgument" in got, got
        ids.extend((key, i) for g in got if isinstance(g, list) for i in g)
    assert len(set(ids)) == len(ids) == 20 * 200  # per key, each id once
