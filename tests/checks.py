"""Checkers every test uses: ids unique, inside bounds, ranges disjoint; what a store that
refuses a client says."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

import pytest

import idmint
from idmint import Range, StoreUnavailable


def assert_unique(ids: Iterable[int]) -> int:
    """Every id appears once; returns how many there were."""
    ids = list(ids)
    if len(set(ids)) != len(ids):
        dupes = [i for i, n in Counter(ids).items() if n > 1]
        raise AssertionError(f"{len(dupes)} duplicate ids, e.g. {sorted(dupes)[:10]}")
    return len(ids)


def assert_within(ids: Iterable[int], first: int, last: int) -> None:
    """Every id lies in [first, last]."""
    outside = [i for i in ids if not first <= i <= last]
    assert not outside, f"{len(outside)} ids outside [{first}, {last}], e.g. {outside[:10]}"


def assert_disjoint(ranges: Iterable[Range], parent: Range | None = None) -> None:
    """Ranges pairwise disjoint and, given a parent, inside it. Strided ranges (stripes)
    are disjoint within their stripe; stripes never share an id."""
    stripes: dict[tuple[int, int], list[Range]] = {}
    for r in ranges:
        if len(r):
            stripes.setdefault((r.stride, r.start % r.stride), []).append(r)
    assert len({stride for stride, _ in stripes}) <= 1, f"mixed strides: {sorted(stripes)}"
    for group in stripes.values():
        ordered = sorted(group, key=lambda r: r.start)
        for a, b in itertools.pairwise(ordered):
            assert a.stop <= b.start, f"ranges overlap: {a} and {b}"
        if parent is not None and ordered:
            assert parent.start <= ordered[0].start, f"{ordered[0]} starts below {parent}"
            assert ordered[-1].last < parent.stop, f"{ordered[-1]} ends above {parent}"


def assert_increasing(ids: list[int]) -> None:
    """Strictly increasing, as one thread's ids are."""
    bad = [(a, b) for a, b in itertools.pairwise(ids) if a >= b]
    assert not bad, f"{len(bad)} steps not increasing, e.g. {bad[:5]}"


def works(call: Callable[..., object], *args: object) -> bool:
    """Whether `call(*args)` answered, rather than raised StoreUnavailable (for polling a
    store that is coming back)."""
    try:
        call(*args)
    except StoreUnavailable:
        return False
    return True


def run_threads(target: Callable[[], None], count: int) -> None:
    """Run `target` on `count` threads at once and wait for them all."""
    threads = [threading.Thread(target=target) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


Outcome = tuple[BaseException | None, float]


def race(calls: dict[str, Callable[[], object]], bound: float) -> dict[str, Outcome]:
    """Run the calls at once, each on its own thread; what each raised and how long it took.
    A call still blocked well past bound is missing from the answer (its thread is left to the
    server's resume)."""
    outcomes: dict[str, Outcome] = {}

    def run(name: str, call: Callable[[], object]) -> None:
        started = time.monotonic()
        try:
            call()
            outcomes[name] = (None, time.monotonic() - started)
        except BaseException as exc:
            outcomes[name] = (exc, time.monotonic() - started)

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in calls.items()]
    for thread in threads:
        thread.start()
    give_up = time.monotonic() + bound + 10
    for thread in threads:
        thread.join(max(0.0, give_up - time.monotonic()))
    return outcomes


def assert_within_bound(bound: float, calls: dict[str, Callable[[], object]]) -> None:
    """Every call, run at once on its own thread, raises StoreUnavailable within `bound` s."""
    outcomes = race(calls, bound)
    problems = []
    for name in calls:
        if name not in outcomes:
            problems.append(f"{name}: still blocked after {bound + 10:g} s")
            continue
        exc, took = outcomes[name]
        if not isinstance(exc, StoreUnavailable):
            problems.append(f"{name}: {exc!r} after {took:.1f} s, not StoreUnavailable")
        elif took > bound:
            problems.append(f"{name}: StoreUnavailable after {took:.1f} s (bound {bound:g} s)")
    assert not problems, "\n".join(problems)


def refusal(url: str, timeout: float = 10.0) -> StoreUnavailable:
    """What the first use of the store at `url` raises (a key added, an id taken): a store
    that refuses this client (TLS, password, grant)."""
    with (
        pytest.raises(StoreUnavailable) as caught,
        idmint.connect(url, timeout=timeout) as minter,
    ):
        minter.add_key("k")
        minter.take("k", 1)
    return caught.value


def one_clear_line(error: BaseException, secret: str, *shown: str) -> str:
    """The error's message, checked: one line, without `secret`, with each of `shown` (the
    store's scheme, host and port: it names the store)."""
    text = str(error)
    assert "\n" not in text, text
    assert secret not in text, text
    for piece in shown:
        assert piece in text, f"{piece!r} not in {text!r}"
    return text
