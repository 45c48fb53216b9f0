"""The RangeStore contract, run against every store on real servers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import idmint
from idmint import (
    Exhausted,
    InvalidArgument,
    Key,
    KeyExists,
    KeyNotFound,
    Range,
    RangeStore,
    open_store,
)
from idmint.ids import ID_MAX, UINT31_MAX

from checks import assert_disjoint, assert_unique, run_threads
from conftest import LOCKED_STORES, STORES, fresh_store_url


@pytest.fixture(params=(*STORES, *LOCKED_STORES))
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Every store, and every server engine again locked down (TLS, least privilege)."""
    return fresh_store_url(request.param, request, tmp_path)


@pytest.fixture
def store(store_url: str) -> Iterator[RangeStore]:
    s = open_store(store_url)
    s.init()
    yield s
    s.close()


def add(
    store: RangeStore,
    name: str = "k",
    step: int = 10,
    first: int = 1,
    last: int = ID_MAX,
    stripes: int = 1,
) -> Key:
    return store.add_key(
        name, step=step, first_id=first, last_id=last, description="d", stripes=stripes
    )


def test_meets_the_protocol(store: RangeStore) -> None:
    assert isinstance(store, RangeStore)


def test_init_is_idempotent(store: RangeStore) -> None:
    store.init()
    store.init()
    assert store.list_keys() == []


def test_add_and_get(store: RangeStore) -> None:
    key = add(store, "order", step=1000, first=100_000_000)
    assert (key.name, key.step, key.first_id, key.max_id) == (
        "order",
        1000,
        100_000_000,
        100_000_000,
    )
    assert key.last_id == ID_MAX and key.description == "d"
    assert key.updated_at is not None
    assert store.get_key("order") == key


def test_add_twice_is_key_exists(store: RangeStore) -> None:
    add(store, "order")
    with pytest.raises(KeyExists):
        add(store, "order")


def test_unknown_key(store: RangeStore) -> None:
    with pytest.raises(KeyNotFound):
        store.get_key("nope")
    with pytest.raises(KeyNotFound):
        store.allocate("nope")
    with pytest.raises(KeyNotFound):
        store.raise_floor("nope", 5)
    assert store.give_back("nope", Range(1, 2)) is False


def test_list_is_sorted(store: RangeStore) -> None:
    for name in ("b", "c", "a"):
        add(store, name)
    assert [k.name for k in store.list_keys()] == ["a", "b", "c"]


def test_allocate_takes_consecutive_ranges(store: RangeStore) -> None:
    add(store, "k", step=10, first=5)
    first = store.allocate("k")
    assert first.range == Range(5, 15)
    assert first.key.max_id == 15 and first.key.step == 10
    assert store.allocate("k", 3).range == Range(15, 18)
    assert store.get_key("k").max_id == 18


def test_bounded_key_is_clamped_then_exhausted(store: RangeStore) -> None:
    add(store, "k32", step=1000, first=UINT31_MAX - 1499, last=UINT31_MAX)
    assert len(store.allocate("k32").range) == 1000
    last = store.allocate("k32").range
    assert last == Range(UINT31_MAX - 499, UINT31_MAX + 1)
    with pytest.raises(Exhausted) as info:
        store.allocate("k32")
    assert "k32" in str(info.value)
    assert store.get_key("k32").remaining == 0


def test_the_top_of_the_id_space(store: RangeStore) -> None:
    add(store, "top", step=10, first=ID_MAX - 4)
    assert store.allocate("top").range == Range(ID_MAX - 4, ID_MAX + 1)
    with pytest.raises(Exhausted):
        store.allocate("top", 1)


def test_give_back_only_when_nobody_allocated_after(store: RangeStore) -> None:
    add(store, "k", step=10)
    a = store.allocate("k").range  # 1..10
    assert store.give_back("k", Range(a.start + 4, a.stop)) is True
    assert store.get_key("k").max_id == a.start + 4
    b = store.allocate("k").range
    assert b.start == a.start + 4
    store.allocate("k")  # someone else allocates after b
    assert store.give_back("k", Range(b.start + 1, b.stop)) is False
    assert store.give_back("k", Range(b.stop, b.stop)) is False  # empty


def test_give_back_never_undoes_a_raise(store: RangeStore) -> None:
    add(store, "k", step=100)
    held = store.allocate("k").range  # 1..100
    store.raise_floor("k", held.stop)  # floor at exactly the held range's stop
    assert store.give_back("k", Range(held.start + 10, held.stop)) is False
    assert store.allocate("k").range.start == held.stop


def test_raise_only_moves_up(store: RangeStore) -> None:
    add(store, "k", step=10)
    store.allocate("k")
    key = store.raise_floor("k", 1000)
    assert (key.first_id, key.max_id) == (1000, 1000)
    assert store.allocate("k").range.start == 1000
    key = store.raise_floor("k", 500)
    assert (key.first_id, key.max_id) == (1000, 1010)


def test_raise_beyond_the_maximum_is_refused(store: RangeStore) -> None:
    add(store, "k", last=100)
    # 101 (one past the maximum) retires the key; anything above is refused.
    with pytest.raises(ValueError, match="maximum 100"):
        store.raise_floor("k", 102)
    assert store.get_key("k").first_id == 1


def test_concurrent_allocations_are_disjoint(store: RangeStore) -> None:
    add(store, "k", step=7)
    taken: list[Range] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(40):
            r = store.allocate("k").range
            with lock:
                taken.append(r)

    run_threads(worker, 4)
    assert_disjoint(taken, Range(1, store.get_key("k").max_id))
    assert sum(map(len, taken)) == 4 * 40 * 7
    assert_unique(i for r in taken for i in r)


def test_two_store_objects_share_one_counter(store_url: str, store: RangeStore) -> None:
    add(store, "k", step=10)
    other = open_store(store_url)
    try:
        ranges = [store.allocate("k").range, other.allocate("k").range, store.allocate("k").range]
    finally:
        other.close()
    assert ranges == [Range(1, 11), Range(11, 21), Range(21, 31)]


# -- stripes ---------------------------------------------------------------------------------


def test_stripe_k_hands_out_first_plus_k_modulo_n(store: RangeStore) -> None:
    key = add(store, "s", step=10, first=100, last=ID_MAX - 4, stripes=5)
    assert key.stripes == 5 and key.stripe_next == (100, 101, 102, 103, 104)
    for k in (3, 0, 4, 1, 2):
        taken = store.allocate("s", stripe=k)
        assert taken.range == Range.of(100 + k, 10, 5)
        assert (taken.key.stripe, taken.key.stripes) == (k, 5)
        assert all(i % 5 == (100 + k) % 5 for i in taken.range)
    again = store.allocate("s", 3, stripe=3).range
    assert again == Range(153, 168, 5) and list(again) == [153, 158, 163]
    assert store.get_key("s").stripe_next == (150, 151, 152, 168, 154)
    assert store.get_key("s").next_id == 150
    [listed] = store.list_keys()
    assert listed.stripes == 5 and listed.stripe_next == (150, 151, 152, 168, 154)


def test_the_store_chooses_a_stripe_when_none_is_given(store: RangeStore) -> None:
    add(store, "s", step=4, first=1, last=10_000, stripes=3)
    seen = set()
    for _ in range(30):
        taken = store.allocate("s")
        assert taken.range.stride == 3 and taken.key.stripes == 3
        assert taken.range.start % 3 == (1 + taken.key.stripe) % 3
        seen.add(taken.key.stripe)
    assert seen <= {0, 1, 2}


def test_a_stripe_the_key_does_not_have_is_refused(store: RangeStore) -> None:
    add(store, "s", stripes=3)
    add(store, "plain")
    for stripe in (3, -1):
        with pytest.raises(InvalidArgument, match="stripe"):
            store.allocate("s", stripe=stripe)
    with pytest.raises(InvalidArgument, match="stripe"):
        store.allocate("plain", stripe=1)
    with pytest.raises(KeyNotFound):
        store.allocate("nope", stripe=1)


def test_a_striped_32_bit_key_hands_out_every_integer_once(store: RangeStore) -> None:
    first = UINT31_MAX - 99
    add(store, "s32", step=7, first=first, last=UINT31_MAX, stripes=3)
    ids: list[int] = []
    for k in range(3):
        while store.get_key("s32").stripe_next[k] <= UINT31_MAX:
            taken = store.allocate("s32", stripe=k)
            assert taken.range.last <= UINT31_MAX
            ids += list(taken.range)
        with pytest.raises(Exhausted) as info:
            store.allocate("s32", stripe=k)
        assert (info.value.stripe, info.value.stripes) == (k, 3)
    assert sorted(ids) == list(range(first, UINT31_MAX + 1))
    assert store.get_key("s32").remaining == 0


def test_give_back_works_per_stripe(store: RangeStore) -> None:
    add(store, "s", step=10, first=0, last=10_000, stripes=4)
    held = store.allocate("s", stripe=2).range  # 2, 6, ..., 38
    store.allocate("s", stripe=1)  # another stripe moving does not matter
    tail = Range(held.start + 5 * 4, held.stop, 4)
    assert store.give_back("s", tail) is True
    assert store.allocate("s", 1, stripe=2).range == Range.of(22, 1, 4)
    store.allocate("s", stripe=2)
    assert store.give_back("s", Range(26, held.stop, 4)) is False  # stripe 2 moved on


def test_raise_moves_every_stripe_up(store: RangeStore) -> None:
    add(store, "s", step=10, first=0, last=100_000, stripes=3)
    store.allocate("s", stripe=0)
    key = store.raise_floor("s", 1000)
    assert key.stripe_next == (1002, 1000, 1001)  # each stripe's first id at or above
    for k in range(3):
        start = store.allocate("s", stripe=k).range.start
        assert start >= 1000 and start % 3 == k


def test_a_retired_key_hands_out_no_id_again(store_url: str) -> None:
    """On main a key could not be retired. Now its floor moves past its maximum: every range
    is refused, on every store, and the key shows as retired."""
    with idmint.connect(store_url) as minter:
        minter.add_key("gone", step=10, start=1, max=1000, stripes=2)
        taken = minter.take("gone", 6)
        key = minter.retire_key("gone")
        assert key.retired and key.remaining == 0 and key.as_dict()["retired"] is True
        for stripe in (None, 0, 1):
            with pytest.raises(idmint.Exhausted):
                minter.take("gone", 1, stripe=stripe)
        with pytest.raises(idmint.Exhausted):
            minter.segment("gone").next_id()
        assert minter.key("gone").first_id > 1000 >= taken.last
        with pytest.raises(idmint.InvalidArgument, match="one more retires it"):
            minter.raise_floor("gone", 5000)
