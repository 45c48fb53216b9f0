"""MariaDB in high availability, the issue 30 rows on MariaDB, on real semi-synchronous
replication (tests/replicated.py: a primary, and a replica that follows it by GTID):

- the replica's SQL thread behind (a transaction on the replica holds the key's row, as a
  batch would), the primary killed -9. Semi-sync acknowledged idmint's commits when the
  replica received them, not when it applied them: they wait in its relay log. Promoted as
  failover managers do (the relay log applied first) it lacks nothing; promoted the old way
  (STOP SLAVE; RESET SLAVE ALL) it lacks them all, and past a small gap ids repeat. A server
  stopped half-way (relay log not applied) is refused; after RESET SLAVE ALL nothing shows;
- the replica's link down when processes connect, back 3 s later: nothing is served until it
  is back, on a store that has waited for the replica (its requirement) and on a brand-new one
  (semi-sync fell back), where on main writes went on unwaited;
- the promoted primary alone: refused for the store's requirement, with the message that
  names `idmint replicas --set`, not a semi-sync one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pymysql
import pytest

import idmint
from idmint import KeyNotFound, Range, StoreUnavailable

from harness import duplicates
from replicated import binlog_dumps, mariadb_pair, promote, sql, wait_applied
from servers import LOOPBACK, MariaDBServer, wait_until

KEY = "k"
STEP = 10
GAP = 50  # the fence's gap: below the ids a discarded relay log holds, so they show


def counter(server: MariaDBServer, database: str) -> int:
    """The key's counter as the server has it: every id at or above it is not covered."""
    rows = sql(server, f"SELECT max_id FROM {database}.idmint_keys WHERE name = '{KEY}'")
    return int(str(rows[0][0]))


def ids(ranges: list[Range]) -> list[int]:
    return [i for r in ranges for i in r]


@contextlib.contextmanager
def holding_the_key(replica: MariaDBServer, database: str) -> Iterator[Callable[[], None]]:
    """A transaction on the replica holding the key's row, as a long batch would: the SQL
    thread waits for it with every later change of the key, while the IO thread goes on
    receiving (and acknowledging) them. Yields the release. The SQL thread's lock waits end
    after 1 s and are retried: a STOP SLAVE waits for the one in progress."""
    sql(
        replica,
        "SET GLOBAL innodb_lock_wait_timeout = 1",
        "STOP SLAVE SQL_THREAD",  # a thread takes the setting when it starts
        "START SLAVE SQL_THREAD",
    )
    # Not in autocommit mode: the SELECT opens the transaction that holds the row.
    holder = pymysql.connect(host=LOOPBACK, port=replica.port, user="root", database=database)
    try:
        with holder.cursor() as cur:
            cur.execute(f"SELECT max_id FROM idmint_keys WHERE name = '{KEY}' FOR UPDATE")
        yield holder.rollback
    finally:
        holder.close()


@pytest.mark.parametrize("apply_relay_log", [True, False], ids=["managers-way", "old-way"])
def test_a_promotion_applies_the_relay_log_first(apply_relay_log: bool) -> None:
    """Twenty ranges acknowledged by semi-sync while the replica's SQL thread waits behind a
    lock, then the primary killed -9. The managers' way (stop the IO thread, MASTER_GTID_WAIT
    for what it received, RESET SLAVE ALL) waits for the lock to go (the batch ending) and
    leaves no id above the promoted counter: none repeats. The old way throws the 200 ids'
    commits away with the relay log: they are above the promoted counter, covered only by the
    gap, and past a gap of 50 they are handed out again (the checker sees it). Stopped half-way
    (STOP SLAVE alone) the server is refused: its relay log is not applied."""
    with mariadb_pair(semi_sync=True) as (primary, replica):
        url = primary.create_database("ids")
        with idmint.connect(url, timeout=3) as minter:
            minter.add_key(KEY, step=STEP)
            served = [minter.ranges.allocate(KEY).range]
        wait_applied(replica, str(sql(primary, "SELECT @@gtid_binlog_pos")[0][0]), 10)
        with holding_the_key(replica, "ids") as release:
            with idmint.connect(url, timeout=3) as minter:
                served += [minter.ranges.allocate(KEY).range for _ in range(20)]
            assert counter(replica, "ids") == served[0].stop  # received, not applied
            primary.kill()
            if apply_relay_log:
                batch_ends = threading.Timer(1.0, release)  # while promote waits for it
                batch_ends.start()
                try:
                    promote(replica)
                finally:
                    batch_ends.join()
            else:
                sql(replica, "STOP SLAVE")
                with (
                    idmint.connect(replica.url("ids"), timeout=3) as minter,
                    pytest.raises(StoreUnavailable, match="before the relay log was applied"),
                ):
                    minter.ranges.allocate(KEY)
                promote(replica, apply_relay_log=False)
        top = counter(replica, "ids")
        above = [i for i in ids(served) if i >= top]
        alone = f"{replica.url('ids')}?fewer_replicas=1&failover_gap={GAP}"
        with idmint.connect(alone, timeout=3) as minter:
            served += [minter.ranges.allocate(KEY).range for _ in range(20)]
    repeated = duplicates(ids(served))
    if apply_relay_log:
        assert (above, repeated) == ([], [])
    else:
        assert len(above) == 20 * STEP, above[:10]
        assert len(repeated) == 20 * STEP - GAP and set(repeated) <= set(above), repeated[:10]


class Taker(threading.Thread):
    """A process's allocations from a store (its own connection, made when it starts): one
    range after another straight from the store, the key made first if missing, each answer
    kept with when it came."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.served: list[tuple[float, Range]] = []
        self.refused: list[str] = []
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        with idmint.connect(self.url, timeout=3) as minter:
            while not self.done.is_set():
                try:
                    try:
                        taken = minter.ranges.allocate(KEY).range
                    except KeyNotFound:
                        minter.add_key(KEY, step=STEP)
                        continue
                    self.served.append((time.monotonic(), taken))
                except StoreUnavailable as exc:
                    self.refused.append(str(exc))
                    time.sleep(0.05)

    def stop(self) -> list[Range]:
        self.done.set()
        self.join(10)
        assert not self.is_alive()
        return [taken for _, taken in self.served]


def link_down_at_connect(primary: MariaDBServer, replica: MariaDBServer) -> dict[str, list[Range]]:
    """Processes connecting to two stores while the replica's link is down, back 3 s later:
    `waited` has waited for the replica (its requirement is 1), `new` is brand new (0). Every
    range each served, checked to come after the link was back, by database."""
    waited, brand_new = primary.create_database("waited"), primary.create_database("new")
    with idmint.connect(waited, timeout=3) as minter:
        minter.add_key(KEY, step=STEP)
        before = minter.ranges.allocate(KEY).range
    sql(replica, "STOP SLAVE IO_THREAD")  # the link down
    wait_until(lambda: binlog_dumps(primary) == 0, 10, "the replica to leave")
    takers = {"waited": Taker(waited), "new": Taker(brand_new)}
    time.sleep(3)
    back = time.monotonic()
    sql(replica, "START SLAVE IO_THREAD")
    wait_until(lambda: all(t.served for t in takers.values()), 20, "both stores to serve again")
    served = {database: taker.stop() for database, taker in takers.items()}
    assert all(at >= back for t in takers.values() for at, _ in t.served)
    assert any("the store has waited for 1" in why for why in takers["waited"].refused)
    assert any("fallen back to asynchronous" in why for why in takers["new"].refused)
    served["waited"].insert(0, before)
    return served


def alone(promoted: MariaDBServer, database: str) -> list[Range]:
    """A promoted primary with semi-sync on and no replica: refused for the requirement, then
    (lowered) for the commits semi-sync answers without a replica, then (semi-sync off)
    serving. Also on a connection made while semi-sync was off, once it is on. What it served."""
    sql(
        promoted,
        "SET GLOBAL rpl_semi_sync_master_timeout = 1000",
        "SET GLOBAL rpl_semi_sync_master_enabled = ON",
    )
    url = promoted.url(database)
    with idmint.connect(url, timeout=3) as minter:
        with pytest.raises(StoreUnavailable) as below:
            minter.ranges.allocate(KEY)
        refused = str(below.value)
        assert "the store has waited for 1" in refused and "idmint replicas --set" in refused
        # Not semi-sync's refusals: "until the replicas acknowledge again" (fallen back with
        # replicas connected), "not used" (a commit no replica acknowledged).
        assert "acknowledge again" not in refused and "not used" not in refused
        assert minter.set_required_replicas(0) == 1
        with pytest.raises(StoreUnavailable, match="rpl_semi_sync_master_enabled=OFF"):
            minter.ranges.allocate(KEY)
        sql(promoted, "SET GLOBAL rpl_semi_sync_master_enabled = OFF")
        served = [minter.ranges.allocate(KEY).range]  # the same connection: it sees the change
    with idmint.connect(url, timeout=3) as minter:
        served.append(minter.ranges.allocate(KEY).range)  # connected with semi-sync off
        sql(promoted, "SET GLOBAL rpl_semi_sync_master_enabled = ON")
        with pytest.raises(StoreUnavailable, match="fallen back to asynchronous"):
            minter.ranges.allocate(KEY)
    return served


def test_the_link_down_at_connect_and_the_promoted_primary_alone() -> None:
    """The replica's link down when processes connect, back 3 s later. A store that has
    waited for the replica refuses every write for its requirement; a brand-new one, whose
    requirement is still 0, refuses every commit semi-sync answered without the replica (it
    fell back to asynchronous). Both serve again once the link is back; the primary killed -9
    and the replica promoted, no id they served is above the promoted counters (on main: 15,644
    and 20,999, covered only by the gap). The promoted primary alone (semi-sync on, as on every
    server of a symmetric set-up) is refused for the requirement, with the message naming
    `idmint replicas --set`; lowered, a commit no replica acknowledged is still refused while
    semi-sync is on; off, it serves, and no id repeats."""
    with mariadb_pair(semi_sync=True) as (primary, replica):
        served = link_down_at_connect(primary, replica)
        primary.kill()
        promote(replica)
        for database, ranges in served.items():
            top = counter(replica, database)
            assert [i for i in ids(ranges) if i >= top] == [], database
        after = alone(replica, "waited")
    assert not duplicates(ids(served["waited"] + after))
