"""The toy engine of docs/design.md ("How to add an engine"): one folder (tests/toy_engine/),
one registry row (toy_engine.ROW, registered by conftest.py), one fixture (the "toy" kind of
conftest.py's store lists). With those, every contract suite runs on it: the CasStore, the
RangeStore and the LeaseStore contracts (tests/test_cas_contract.py, test_store_contract.py,
test_lease_contract.py, with `-k toy`), all from idmint's code over any CasStore.

Here: that the walk-through names what the toy has, that the engine opens by its URL like any
other, and a negative control: the same contract checks catch a toy whose compare-and-set
does not compare."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

import idmint
from idmint.stores import open_engine, registry
from idmint.stores.over_cas.leases import CasLeaseStore
from idmint.stores.over_cas.ranges import CasRangeStore

import test_lease_contract
import test_store_contract
import toy_engine
from toy_engine.cells import DirectoryCells

ROOT = Path(__file__).resolve().parents[1]


def test_the_walk_through_names_the_toy_engine_as_it_is() -> None:
    text = (ROOT / "docs/design.md").read_text()
    section = text[text.index("## How to add an engine") :]
    section = section[: section.index("\n## ", 3)]
    for path in ("tests/toy_engine/__init__.py", "tests/toy_engine/cells.py"):
        assert path in section and (ROOT / path).is_file()
    for name in ("EngineRow", "register", "CasLeaseStore", "CasRangeStore", "CasQuorumNode"):
        assert re.search(rf"\b{name}\b", section), name
    assert toy_engine.ROW in registry.ENGINES  # conftest.py's one line


def test_a_minter_on_the_toy_engine(tmp_path: Path) -> None:
    url = f"toy://{tmp_path / 'store'}"
    with idmint.connect(url) as minter:
        minter.add_key("order", step=5, start=100)
        with minter.segment("order") as order:
            assert [order.next_id() for _ in range(12)] == list(range(100, 112))
        assert minter.engine is not None and minter.engine.kind == "toy"
    engine = open_engine(url)
    try:
        assert engine.quorum().claim("q", 1, 10) == (True, 10)
    finally:
        engine.close()


class LastWriterWins(DirectoryCells):
    """The bug a new engine might have: create overwrites, swap ignores the version (a write
    without the compare), with a pause that lets other writers in between read and write."""

    def create(self, key: str, value: str) -> bool:
        return self._write(key, value)

    def swap(self, key: str, version: int, value: str) -> bool:
        return self.read(key) is not None and self._write(key, value)

    def _write(self, key: str, value: str) -> bool:
        time.sleep(0.002)
        with self._locked() as state:
            old = state["cells"].get(key, ["", 0])
            state["cells"][key] = [value, old[1] + 1]
            self._save(state)
        return True


def test_the_contract_checks_catch_a_compare_and_set_that_does_not_compare(
    tmp_path: Path,
) -> None:
    def unsafe(name: str) -> LastWriterWins:
        return LastWriterWins(str(tmp_path / name), "toy://unsafe", timeout=5.0)

    for attempt in range(5):  # races: each round may, rarely, find none; five never all do
        ranges = CasRangeStore(unsafe(f"ranges{attempt}"))
        with pytest.raises(AssertionError):
            test_store_contract.test_concurrent_allocations_are_disjoint(ranges)
        leases = CasLeaseStore(unsafe(f"leases{attempt}"), lambda: time.time_ns() // 1_000_000)
        try:
            test_lease_contract.test_concurrent_acquires_get_distinct_ids(leases)
        except AssertionError:
            return
    pytest.fail("five rounds of racing acquirers on a last-writer-wins store found no duplicate")


class TakenBetweenScanAndRead(DirectoryCells):
    """Cells on which `rival` acquires a worker id at the worst moment for this store's own
    acquire: after its scan chose an id, before its take reads that id's version."""

    rival: CasLeaseStore | None = None

    def read(self, key: str) -> tuple[str, int] | None:
        rival, self.rival = self.rival, None
        if rival is not None and key.startswith("worker/"):
            rival.acquire("ns", workers=4, ttl=30, horizon_ms=0)
        return super().read(key)


def test_an_id_taken_between_the_scan_and_the_take_is_not_taken_again(tmp_path: Path) -> None:
    # A scan gives no versions, so a take reads the chosen cell's version: it must go ahead
    # only while the cell is as the scan saw it, or it would swap over the rival's new lease.
    directory = str(tmp_path / "leases")

    def clock() -> int:
        return time.time_ns() // 1_000_000

    rival = CasLeaseStore(DirectoryCells(directory, "toy://rival", timeout=5.0), clock)
    rival.release(rival.acquire("ns", workers=4, ttl=30, horizon_ms=0))  # id 0: a free cell
    cells = TakenBetweenScanAndRead(directory, "toy://racer", timeout=5.0)
    cells.rival = rival
    lease = CasLeaseStore(cells, clock).acquire("ns", workers=4, ttl=30, horizon_ms=0)
    assert cells.rival is None  # the rival did acquire in between
    held = {row.worker_id: row.owner for row in rival.holders("ns") if row.owner}
    assert lease.worker_id == 1 and held == {0: held[0], 1: lease.owner}
    assert held[0] != lease.owner
