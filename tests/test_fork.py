"""Generators made before fork(): gunicorn --preload, celery prefork, multiprocessing's fork
pool. The children must never serve what the parent holds: no id may repeat across the parent
and its children, before or after the children close their own generators."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest

import idmint
from idmint import Minter
from idmint.strategies.snowflake import SnowflakeOptions

from checks import assert_unique
from conftest import fresh_store_url

# The pool's workers find the parent's objects here: a fork copies them, as --preload does.
PARENT: dict[str, Any] = {}

FORK = multiprocessing.get_context("fork")


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return fresh_store_url(request.param, request, tmp_path)


def segment_ids(_: int) -> tuple[int, list[int]]:
    gen = PARENT["segment"]
    return os.getpid(), gen.next_ids(50) + [gen.next_id() for _ in range(50)]


def snowflake_ids(_: int) -> tuple[int, list[int]]:
    gen = PARENT["snowflake"]
    ids = gen.next_ids(2000)
    return gen.worker_id, ids


def close_in_child(_: int) -> list[tuple[str, Any]]:
    # A celery worker shutting down: its close must neither give back the parent's range
    # nor release the parent's worker id.
    minter: Minter = PARENT["minter"]
    return [(key, (r.start, r.stop)) for key, r in minter.close()]


def test_a_warm_segment_generator_in_a_fork_pool(url: str) -> None:
    minter = idmint.connect(url)
    minter.add_key("order", step=1000)
    gen = minter.segment("order")
    parent_ids = gen.next_ids(10)  # warm: the parent holds [1, 1001) and preloads the next
    PARENT.update(segment=gen, minter=minter)
    try:
        with FORK.Pool(2) as pool:
            # 800 ids in all: within what the parent had buffered when it forked
            results = pool.map(segment_ids, range(8))
            child_ids = [i for _, ids in results for i in ids]
            assert assert_unique(parent_ids + child_ids) == 10 + 8 * 100
            results = pool.map(segment_ids, range(40))  # and far past it
            child_ids += [i for _, ids in results for i in ids]
            pool.map(close_in_child, range(2))
        parent_ids += gen.next_ids(2000)  # the parent goes on with its own ranges
        assert len({pid for pid, _ in results} - {os.getpid()}) >= 1
        assert assert_unique(parent_ids + child_ids) == 2010 + 48 * 100
    finally:
        PARENT.clear()
        minter.close()


def test_a_snowflake_generator_in_a_fork_pool(url: str) -> None:
    minter = idmint.connect(url)
    flakes = minter.snowflake(options=SnowflakeOptions(namespace="fork"))
    parent_ids = flakes.next_ids(2000)
    parent_worker = flakes.worker_id
    PARENT.update(snowflake=flakes, minter=minter)
    try:
        with FORK.Pool(2) as pool:
            results = pool.map(snowflake_ids, range(6))
            child_ids = [i for _, ids in results for i in ids]
            assert assert_unique(parent_ids + child_ids) == 2000 + 6 * 2000
            pool.map(close_in_child, range(2))
        parent_ids += flakes.next_ids(2000)
        assert flakes.worker_id == parent_worker  # still the parent's: nobody released it
        assert parent_worker not in {worker for worker, _ in results}
        assert assert_unique(parent_ids + child_ids) == 4000 + 6 * 2000
        holders = {w.worker_id: w for w in minter.lease_store.holders("fork")}  # type: ignore[union-attr]
        assert holders[parent_worker].owner  # the children's close left the parent's lease
    finally:
        PARENT.clear()
        minter.close()


def test_a_child_forked_by_hand_serves_its_own_range(tmp_path: Path) -> None:
    # os.fork() itself, the way a pre-forking server does it; the child reports over a pipe.
    url = f"sqlite:///{tmp_path / 'fork.db'}"
    with idmint.connect(url) as minter:
        minter.add_key("k", step=100)
        gen = minter.segment("k")
        first = gen.next_id()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            try:
                os.write(write, " ".join(map(str, gen.next_ids(150))).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            child = [int(x) for x in pipe.read().split()]
        os.waitpid(pid, 0)
        parent = gen.next_ids(150)
        assert len(child) == 150
        assert assert_unique([first, *parent, *child]) == 301
        assert min(child) >= 101  # the child's first range is a new one, past the parent's
