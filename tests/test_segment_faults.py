"""Property: whatever the interleaving of failures, stalls, refills, raises and closes, every id
the generators hand out is unique and inside the key's bounds, and the store's counter stays
above every id handed out (a give-back never returns a served id)."""

from __future__ import annotations

import time

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from idmint import Closed, Exhausted, SegmentGenerator, SegmentOptions, StoreUnavailable
from idmint.stores.memory import MemoryRangeStore

from checks import assert_within
from faulty import FaultyStore

FIRST = 1000


class SegmentUnderFaults(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.memory = MemoryRangeStore()
        self.last = FIRST + 3000
        self.memory.add_key("k", step=7, first_id=FIRST, last_id=self.last)
        self.store = FaultyStore(self.memory)
        self.generators: list[SegmentGenerator] = []
        self.issued: set[int] = set()
        self.errors: dict[str, int] = {}

    def _collect(self, ids: list[int]) -> None:
        repeated = self.issued.intersection(ids)
        assert not repeated, f"ids handed out twice: {sorted(repeated)[:10]}"
        assert len(set(ids)) == len(ids), "a batch repeats an id"
        self.issued.update(ids)

    @rule(
        preload_at=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
        max_step=st.sampled_from([7, 20, 64]),
        give_back=st.booleans(),
    )
    def open_generator(self, preload_at: float, max_step: int, give_back: bool) -> None:
        options = SegmentOptions(
            preload_at=preload_at,
            max_step=max_step,
            wait=0.05,
            retry_after=0.0,
            give_back=give_back,
            grow_below=0.001,
        )
        self.generators.append(SegmentGenerator(self.store, "k", options))

    @precondition(lambda self: self.generators)
    @rule(data=st.data(), n=st.integers(1, 40), batch=st.booleans())
    def draw(self, data: st.DataObject, n: int, batch: bool) -> None:
        gen = data.draw(st.sampled_from(self.generators))
        ids: list[int] = []
        try:
            if batch:
                ids = gen.next_ids(n)
            else:
                for _ in range(n):
                    ids.append(gen.next_id())
        except (StoreUnavailable, Exhausted, Closed) as exc:
            self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
        self._collect(ids)

    @precondition(lambda self: self.generators)
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        gen = data.draw(st.sampled_from(self.generators))
        gen.close()
        self.generators.remove(gen)

    @rule(down=st.booleans())
    def set_down(self, down: bool) -> None:
        self.store.down = down

    @rule(before=st.integers(0, 3), after=st.integers(0, 3))
    def inject_failures(self, before: int, after: int) -> None:
        self.store.fail_before, self.store.fail_after = before, after

    @rule(delay=st.sampled_from([0.0, 0.0, 0.002, 0.03]))
    def set_delay(self, delay: float) -> None:
        self.store.delay = delay

    @rule(by=st.integers(0, 200))
    def raise_floor(self, by: int) -> None:
        key = self.memory.get_key("k")
        self.memory.raise_floor("k", min(self.last, key.max_id + by))

    @rule(seconds=st.sampled_from([0.001, 0.01]))
    def let_refills_run(self, seconds: float) -> None:
        time.sleep(seconds)

    @invariant()
    def ids_inside_bounds(self) -> None:
        assert_within(self.issued, FIRST, self.last)

    @invariant()
    def counter_above_every_served_id(self) -> None:
        # A give-back that moved the counter over a served id would hand it out again later.
        if self.issued:
            assert self.memory.get_key("k").max_id > max(self.issued)

    def teardown(self) -> None:
        self.store.down = False
        self.store.delay = 0.0
        for gen in self.generators:
            gen.close()
        self.counter_above_every_served_id()


SegmentUnderFaults.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSegmentUnderFaults = SegmentUnderFaults.TestCase
