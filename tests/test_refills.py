"""The refill pool: a few threads load ranges for every generator, soonest dry first."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import idmint
from idmint import InvalidArgument, Minter, SegmentGenerator, SegmentOptions
from idmint._sync import WaitableLock
from idmint.server import App, ServerConfig
from idmint.strategies.refills import RefillPool

from checks import assert_unique
from faulty import FaultyStore


class Job:
    """A job that records when it ran; it can hold its thread, fail, or raise."""

    def __init__(
        self,
        name: str,
        log: list[str],
        due: float = 0.0,
        hold: threading.Event | None = None,
        fails: int = 0,
        raises: bool = False,
    ) -> None:
        self.name, self.log, self.due = name, log, due
        self.hold, self.fails, self.raises = hold, fails, raises
        self.delay = 0.05  # the back-off a failure asks for
        self.done = threading.Event()

    def refill_due(self) -> float:
        return self.due

    def run_refill(self) -> float | None:
        self.log.append(self.name)
        if self.hold is not None:
            assert self.hold.wait(10)
        if self.raises:
            self.done.set()
            raise RuntimeError("a bug in a job")
        if self.fails:
            self.fails -= 1
            return self.delay
        self.done.set()
        return None


def test_jobs_run_soonest_dry_first() -> None:
    pool = RefillPool(1)
    ran: list[str] = []
    release = threading.Event()
    blocker = Job("blocker", ran, hold=release)
    pool.submit(blocker)
    now = time.monotonic()
    jobs = [Job(name, ran, due=now + due) for name, due in (("c", 30), ("a", 10), ("b", 20))]
    waiting = Job("waiting caller", ran, due=now - 1)
    for job in [*jobs, waiting]:
        pool.submit(job)
    release.set()
    for job in [*jobs, waiting]:
        assert job.done.wait(5)
    assert ran == ["blocker", "waiting caller", "a", "b", "c"]


def test_a_failing_job_backs_off_without_holding_its_thread() -> None:
    pool = RefillPool(1)
    ran: list[str] = []
    failing = Job("failing", ran, fails=3)
    pool.submit(failing)
    time.sleep(0.01)  # its first try failed: it waits 50 ms off the thread
    healthy = Job("healthy", ran)
    pool.submit(healthy)
    assert healthy.done.wait(1) and failing.done.wait(5)
    assert ran.index("healthy") < len(ran) - 1, ran  # ran between the failing job's tries
    assert ran.count("failing") == 4
    assert pool.stats()["retried"] == 3


def test_a_job_that_raises_leaves_the_pool_working() -> None:
    pool = RefillPool(1)
    ran: list[str] = []
    broken, fine = Job("broken", ran, raises=True), Job("fine", ran)
    pool.submit(broken)
    pool.submit(fine)
    assert fine.done.wait(5)
    assert ran == ["broken", "fine"]


@pytest.mark.parametrize("threads", [0, -1, 257, True, 2.5])
def test_a_pool_size_out_of_bounds_is_refused(threads: object) -> None:
    with pytest.raises(InvalidArgument, match="refill threads must be from 1 to 256"):
        RefillPool(threads)  # type: ignore[arg-type]


def store_with_keys(path: Path, names: list[str], step: int) -> Minter:
    """A SQLite store at `path` with keys `names`, ids from 1."""
    minter = idmint.connect(f"sqlite:///{path}")
    for name in names:
        minter.add_key(name, step=step, start=1)
    return minter


def test_a_thousand_keys_load_on_a_few_threads(tmp_path: Path) -> None:
    names = [f"k{i}" for i in range(1000)]
    minter = store_with_keys(tmp_path / "keys.db", names, step=5)
    pool = RefillPool(4)
    threads_before = threading.active_count()
    gens = [SegmentGenerator(minter.store, name, pool=pool) for name in names]
    ids = {gen.key: gen.next_ids(12) for gen in gens}  # 12 of 5-id ranges: several refills
    busiest = threading.active_count() - threads_before
    assert 1 <= busiest <= 4
    assert pool.stats()["threads"] <= 4
    for name in names:
        assert assert_unique(ids[name]) == 12
    for gen in gens:
        gen.close()


def test_close_while_the_refill_is_queued_returns_at_once_and_takes_nothing(
    tmp_path: Path,
) -> None:
    minter = idmint.connect(f"sqlite:///{tmp_path / 'q.db'}")
    minter.add_key("queued", step=10, start=1)
    pool = RefillPool(1)
    ran: list[str] = []
    release = threading.Event()
    pool.submit(Job("blocker", ran, hold=release))
    gen = SegmentGenerator(minter.store, "queued", SegmentOptions(wait=5), pool=pool)
    started = time.monotonic()
    assert gen.close() == []
    assert time.monotonic() - started < 0.5  # nothing was loading: nothing to wait for
    release.set()
    deadline = time.monotonic() + 5
    while pool.stats()["busy"] or pool.stats()["queued"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert minter.key("queued").max_id == 1  # the queued refill saw the close: took nothing


_DRAW = """
import json, random, sys
import idmint
from idmint import SegmentGenerator, SegmentOptions
minter = idmint.connect(sys.argv[1])
names = json.loads(sys.argv[2])
options = SegmentOptions(max_step=20, wait=30)  # uniqueness, not latency, is tested
gens = {n: SegmentGenerator(minter.store, n, options) for n in names}
rng = random.Random()
got = {n: [] for n in names}
for _ in range(3000):
    n = rng.choice(names)
    got[n] += gens[n].next_ids(rng.randint(1, 7))
print(json.dumps(got))
"""


def test_processes_drawing_many_keys_on_two_refill_threads_never_repeat(tmp_path: Path) -> None:
    names = [f"t{i}" for i in range(60)]
    url = store_with_keys(tmp_path / "shared.db", names, step=5).url
    env = {**os.environ, "IDMINT_REFILL_THREADS": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _DRAW, url, json.dumps(names)],
            stdout=subprocess.PIPE,
            env=env,
        )
        for _ in range(4)
    ]
    per_key: dict[str, list[int]] = {name: [] for name in names}
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        for name, ids in json.loads(out).items():
            per_key[name] += ids
    total = 0
    for ids in per_key.values():
        total += assert_unique(ids)
    assert total > 4 * 3000


def test_the_checker_catches_a_repeat() -> None:
    with pytest.raises(AssertionError):
        assert_unique([1, 2, 3, 2])


def test_a_waitable_lock_wakes_its_waiters_and_keeps_no_condition_after() -> None:
    lock = WaitableLock()
    woke: list[bool] = []

    def waiter() -> None:
        with lock:
            woke.append(lock.wait(5))

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while lock._waiting < 3:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with lock:
        lock.notify_all()
    for t in threads:
        t.join(5)
    assert woke == [True, True, True]
    assert lock._cond is None  # the ~1.4 KB Condition lives only while someone waits
    with lock:
        assert lock.wait(0.01) is False


def _get_all(app: App, paths: list[str]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://idmint") as http:
            return await asyncio.gather(*(http.get(p) for p in paths))

    return asyncio.run(go())


def serving(app: App, keys: int) -> App:
    """The app once started, as a server starts it: it has read every key's row."""
    app.startup()
    deadline = time.monotonic() + 10
    while len(app.service.rows) < keys:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return app


def test_requests_for_cold_keys_wait_on_the_event_loop_not_on_threads(tmp_path: Path) -> None:
    names = [f"c{i}" for i in range(150)]
    url = store_with_keys(tmp_path / "cold.db", names, step=4).url
    app = serving(App(ServerConfig(store=url, refill_threads=2, warm_keys=0)), len(names))
    paths = [f"/api/segment/get/{n}" for n in names] + [f"/v1/keys/{n}/ids?count=9" for n in names]
    answers = _get_all(app, paths)
    assert [a.status_code for a in answers] == [200] * len(paths)
    for i, name in enumerate(names):
        ids = [int(answers[i].text), *answers[len(names) + i].json()["ids"]]
        assert assert_unique(ids) == 10 and set(ids) <= set(range(1, 100)), (name, ids)
    assert app.pools["id"]._started == 0  # 300 waits, no request thread
    app.shutdown()


def test_a_slow_store_answers_503_within_the_wait_and_holds_no_thread(tmp_path: Path) -> None:
    inner = idmint.connect(f"sqlite:///{tmp_path / 'slow.db'}")
    inner.add_key("slow", step=10, start=1)
    slow = FaultyStore(inner.store)
    slow.delay = 3.0
    options = SegmentOptions(wait=0.4)
    app = serving(
        App(ServerConfig(wait=0.4, warm_keys=0), minter=Minter(slow, segment_options=options)), 1
    )
    started = time.monotonic()
    answers = _get_all(app, ["/api/segment/get/slow", "/v1/keys/slow/ids?count=5"])
    assert time.monotonic() - started < 2.0
    for answer in answers:
        assert answer.status_code == 503
        assert "gave no range within 0.4 s" in answer.text
    assert app.pools["id"]._started == 0
    app.shutdown()


class Unsure(Job):
    def refill_due(self) -> float:
        raise RuntimeError("a bug in refill_due")


def test_a_job_that_cannot_tell_when_it_is_due_runs_now() -> None:
    pool = RefillPool(1)
    ran: list[str] = []
    unsure = Unsure("unsure", ran, fails=1)  # through submit, then through the later heap
    pool.submit(unsure)
    assert unsure.done.wait(5) and ran == ["unsure", "unsure"]


def test_no_thread_idles_out_while_a_job_waits_to_run_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("idmint.strategies.refills.IDLE_SECONDS", 0.05)
    pool = RefillPool(1)
    ran: list[str] = []
    slow_retry = Job("retry", ran, fails=1)
    slow_retry.delay = 0.3  # longer than a thread may idle
    pool.submit(slow_retry)
    assert slow_retry.done.wait(5), pool.stats()
    assert ran == ["retry", "retry"]
    time.sleep(0.2)
    assert pool.stats()["threads"] == 0  # then it idles out
