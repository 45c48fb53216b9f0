"""Ids inside Python apps, on the test PostgreSQL: the asyncio API (idmint.AsyncSegment), the
SQLAlchemy column default (sync Session and AsyncSession over psycopg's async driver) and the
Django field (makemigrations, migrate, save, bulk_create). The idmint store and the apps'
tables share one database. A refill is made to wait for the store by holding the key's row
lock from another connection, so the allocation's UPDATE blocks in PostgreSQL itself."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import re
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import BigInteger, Column, MetaData, String, Table, create_engine, insert, select
from sqlalchemy.exc import StatementError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import idmint
from idmint.integrations import close_shared
from idmint.integrations.sqlalchemy import idmint_default

from servers import PostgresServer

#: How long a test holds a key's row lock: the refill waits at least this long.
HOLD = 0.6
#: The heartbeat's period; a beat later than LATE means the loop was blocked (a blocked
#: loop misses beats for all of HOLD).
BEAT = 0.005
LATE = HOLD / 2

#: Keys of this module: name -> first id (each test draws from its own keys).
KEYS = {
    "aio_stuck": 1_000,
    "aio_control": 2_000,
    "aio_many": 3_000,
    "sa_order": 10_000,
    "sa_stuck": 20_000,
    "sa_fork": 30_000,
    "dj_ticket": 40_000,
    "dj_number": 50_000,
}


@pytest.fixture(scope="module")
def pg_db(postgres: PostgresServer) -> Iterator[str]:
    """One database for the module, its keys made (small steps: refills come often)."""
    url = postgres.create_database(f"integrations_{os.getpid()}")
    with idmint.connect(url) as minter:
        for name, start in KEYS.items():
            minter.add_key(name, step=10, start=start)
    yield url
    close_shared()


@contextlib.contextmanager
def row_locked(url: str, key: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """Hold key `key`'s row lock until the connection commits: the store's allocation of a
    range (an UPDATE of that row) waits in PostgreSQL meanwhile."""
    with psycopg.connect(url) as conn:
        locked = conn.execute(
            "SELECT name FROM idmint_keys WHERE name = %s FOR UPDATE", (key,)
        ).fetchall()
        assert locked == [(key,)]
        yield conn


class Heartbeat:
    """A coroutine beating every BEAT seconds on the running loop: the longest gap between
    beats is how long the loop was kept from running it."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._task = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(BEAT)
            now = time.monotonic()
            self.gaps.append(now - last)
            last = now

    async def stop(self) -> float:
        """Stop, and return the longest gap."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        return max(self.gaps)


def _wide_wait() -> idmint.SegmentOptions:
    # The row lock is held for HOLD; a loaded CI machine must not turn that into a timeout.
    return idmint.SegmentOptions(wait=5.0)


# -- the asyncio API ----------------------------------------------------------------------------


def test_awaiting_an_id_while_the_store_blocks_keeps_the_loop_running(pg_db: str) -> None:
    with (
        idmint.connect(pg_db, segment_options=_wide_wait()) as minter,
        row_locked(pg_db, "aio_stuck") as lock,
    ):

        async def main() -> tuple[int, float]:
            heart = Heartbeat()
            orders = minter.async_segment("aio_stuck")  # its first refill waits for the lock
            assert isinstance(orders, idmint.AsyncSegment)
            waiting = asyncio.create_task(orders.next_id())
            await asyncio.sleep(HOLD)
            assert not waiting.done(), f"the id did not wait for the row lock: {waiting}"
            lock.commit()
            first = await asyncio.wait_for(waiting, 5)
            return first, await heart.stop()

        first, longest = asyncio.run(main())
    assert first == KEYS["aio_stuck"]
    assert longest < LATE, f"the loop stalled {longest:.3f} s while the refill waited"


def test_a_blocking_next_id_on_the_loop_stalls_it(pg_db: str) -> None:
    """The negative control of the test above: the heartbeat does see a blocked loop."""
    with (
        idmint.connect(pg_db, segment_options=_wide_wait()) as minter,
        row_locked(pg_db, "aio_control") as lock,
    ):

        async def main() -> tuple[int, float]:
            heart = Heartbeat()
            await asyncio.sleep(0.05)
            # Released from another thread: the loop cannot do it while it is blocked.
            threading.Timer(HOLD, lock.commit).start()
            first = minter.segment("aio_control").next_id()  # waits on the loop's thread
            await asyncio.sleep(0.05)
            return first, await heart.stop()

        first, longest = asyncio.run(main())
    assert first == KEYS["aio_control"]
    assert longest >= HOLD * 0.9, f"the heartbeat missed a {HOLD} s stall: {longest:.3f} s"


def test_many_awaiters_get_distinct_ids(pg_db: str) -> None:
    with (
        idmint.connect(pg_db, segment_options=_wide_wait()) as minter,
        row_locked(pg_db, "aio_many") as lock,
    ):

        async def main() -> list[int]:
            orders = minter.async_segment("aio_many")
            singles = [asyncio.create_task(orders.next_id()) for _ in range(300)]
            batches = [asyncio.create_task(orders.next_ids(7)) for _ in range(30)]
            await asyncio.sleep(HOLD / 2)
            assert not any(t.done() for t in singles + batches)
            lock.commit()
            ids = list(await asyncio.gather(*singles))
            for batch in await asyncio.gather(*batches):
                assert batch == sorted(batch)
                ids += batch
            return ids

        ids = asyncio.run(main())
        key = minter.key("aio_many")
    assert len(ids) == len(set(ids)) == 300 + 30 * 7
    assert key.first_id <= min(ids) and max(ids) < key.max_id


def test_awaiting_an_unknown_key_raises_key_not_found(pg_db: str) -> None:
    with (
        idmint.connect(pg_db) as minter,
        pytest.raises(idmint.KeyNotFound, match="no_such_key"),
    ):
        asyncio.run(minter.async_segment("no_such_key").next_id())


# -- SQLAlchemy ---------------------------------------------------------------------------------


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    # The store from $IDMINT_STORE, opened on the first id (see the sa fixture).
    id: Mapped[int] = mapped_column(
        BigInteger, primary_key=True, default=idmint_default("sa_order")
    )
    item: Mapped[str] = mapped_column(String(40))


@pytest.fixture
def sa(pg_db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The SQLAlchemy URL of the test database (psycopg 3: sync, and async through
    create_async_engine), the orders table made, and $IDMINT_STORE naming the same database."""
    monkeypatch.setenv("IDMINT_STORE", pg_db)
    url = pg_db.replace("postgresql://", "postgresql+psycopg://", 1)
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    engine.dispose()
    yield url
    close_shared()  # opened under this test's $IDMINT_STORE: not the next test's


def _assert_from_key(store: str, key: str, ids: list[int]) -> None:
    with idmint.connect(store) as minter:
        row = minter.key(key)
    assert len(ids) == len(set(ids))
    assert row.first_id <= min(ids) and max(ids) < row.max_id


def test_sqlalchemy_session_fills_primary_keys(pg_db: str, sa: str) -> None:
    engine = create_engine(sa)
    with Session(engine) as session:
        one = Order(item="one")
        session.add(one)
        session.flush()
        assert one.id == KEYS["sa_order"]
        several = [Order(item=f"all-{i}") for i in range(5)]
        session.add_all(several)
        # An ORM bulk insert: the default runs per row, one INSERT for many rows.
        session.execute(insert(Order), [{"item": f"bulk-{i}"} for i in range(200)])
        session.commit()
        assert [o.id for o in several] == sorted(o.id for o in several)
    orders = Base.metadata.tables["orders"]  # Core, without the ORM
    with engine.begin() as conn:
        conn.execute(insert(orders), [{"item": f"core-{i}"} for i in range(50)])
        conn.execute(insert(orders).values(item="core-one"))
        ids = list(conn.scalars(select(Order.id).where(~Order.item.like("async-%"))))
    engine.dispose()
    assert len(ids) == 1 + 5 + 200 + 50 + 1
    _assert_from_key(pg_db, "sa_order", ids)


def test_sqlalchemy_async_session_fills_primary_keys(pg_db: str, sa: str) -> None:
    async def main() -> list[int]:
        engine = create_async_engine(sa)
        async with AsyncSession(engine) as session:
            one = Order(item="async-one")
            session.add(one)
            session.add_all([Order(item=f"async-all-{i}") for i in range(5)])
            await session.flush()
            assert one.id is not None
            await session.execute(insert(Order), [{"item": f"async-bulk-{i}"} for i in range(200)])
            await session.commit()
            ids = list(await session.scalars(select(Order.id).where(Order.item.like("async-%"))))
        await engine.dispose()
        return ids

    ids = asyncio.run(main())
    assert len(ids) == 1 + 5 + 200
    _assert_from_key(pg_db, "sa_order", ids)


stuck_rows = Table(
    "stuck_rows",
    MetaData(),
    Column("id", BigInteger, primary_key=True, default=idmint_default("sa_stuck")),
    Column("item", String(40)),
)


def test_sqlalchemy_async_flush_waits_for_the_store_off_the_loop(pg_db: str, sa: str) -> None:
    """The generator is made by the flush's first row, whose refill then waits for the row
    lock: the INSERT waits for its id without blocking the loop."""

    async def main() -> tuple[list[int], float]:
        engine = create_async_engine(sa)
        async with engine.begin() as conn:
            await conn.run_sync(stuck_rows.metadata.create_all)
        with row_locked(pg_db, "sa_stuck") as lock:
            heart = Heartbeat()
            async with AsyncSession(engine) as session:
                insert_rows = session.execute(
                    insert(stuck_rows), [{"item": f"stuck-{i}"} for i in range(30)]
                )
                inserting = asyncio.create_task(insert_rows)
                await asyncio.sleep(HOLD)
                assert not inserting.done(), f"the insert did not wait for the lock: {inserting}"
                lock.commit()
                await asyncio.wait_for(inserting, 5)
                await session.commit()
                ids = list(await session.scalars(select(stuck_rows.c.id)))
        await engine.dispose()
        return ids, await heart.stop()

    ids, longest = asyncio.run(main())
    assert longest < LATE, f"the loop stalled {longest:.3f} s while the flush waited"
    assert sorted(ids) == list(range(KEYS["sa_stuck"], KEYS["sa_stuck"] + 30))


def test_sqlalchemy_unknown_key_fails_the_insert_with_key_not_found(pg_db: str, sa: str) -> None:
    table = Table(
        "orphans",
        MetaData(),
        Column("id", BigInteger, primary_key=True, default=idmint_default("no_such_key", pg_db)),
    )
    engine = create_engine(sa)
    table.create(engine)
    # SQLAlchemy wraps whatever a default raises in a StatementError, which names it first
    # and keeps it as `orig`.
    with (
        pytest.raises(
            StatementError, match=r"^\(idmint._errors.KeyNotFound\) key 'no_such_key'"
        ) as info,
        engine.begin() as conn,
    ):
        conn.execute(insert(table))
    assert isinstance(info.value.orig, idmint.KeyNotFound)
    with pytest.raises(StatementError) as info, Session(engine) as session:
        session.execute(insert(table), [{}, {}])  # the ORM's bulk path: the same
    assert isinstance(info.value.orig, idmint.KeyNotFound)
    with engine.connect() as conn:
        assert conn.scalars(select(table.c.id)).all() == []
    engine.dispose()
    with pytest.raises(idmint.InvalidArgument, match="bad key name"):
        idmint_default("no spaces")
    with pytest.raises(TypeError, match="store is a Minter or a store URL"):
        idmint_default("order", 5)  # type: ignore[arg-type]


def test_sqlalchemy_default_in_a_forked_child(pg_db: str, sa: str) -> None:
    """A process forked after the parent took ids (gunicorn --preload) takes its own range:
    the child's rows and the parent's never collide."""
    table = Table(
        "forked",
        MetaData(),
        Column("id", BigInteger, primary_key=True, default=idmint_default("sa_fork", pg_db)),
        Column("pid", BigInteger),
    )
    engine = create_engine(sa)
    table.create(engine)
    with engine.begin() as conn:
        conn.execute(insert(table).values(pid=os.getpid()))
    pid = os.fork()
    if pid == 0:  # the child: its own connections, its own ids
        code = 1
        try:
            engine.dispose(close=False)
            with engine.begin() as conn:
                conn.execute(insert(table), [{"pid": os.getpid()}] * 5)
            code = 0
        finally:
            os._exit(code)
    with engine.begin() as conn:
        conn.execute(insert(table), [{"pid": os.getpid()}] * 5)
    assert os.waitpid(pid, 0)[1] == 0, "the child could not insert its rows"
    with engine.connect() as conn:
        rows = conn.execute(select(table.c.id, table.c.pid)).all()
    engine.dispose()
    assert len(rows) == 11 and len({r.id for r in rows}) == 11
    assert {r.pid for r in rows} == {os.getpid(), pid}


# -- Django ---------------------------------------------------------------------------------------

DJANGO_MODELS = """
from django.db import models

from idmint.integrations.django import IdmintDefault, IdmintField


class Ticket(models.Model):
    id = IdmintField(key="dj_ticket")
    title = models.CharField(max_length=40)
    # Another column numbered by a key: a plain default, called when the instance is made.
    number = models.BigIntegerField(default=IdmintDefault("dj_number"), unique=True)


class Orphan(models.Model):
    id = IdmintField(key="no_such_key")
"""


@pytest.fixture(scope="module")
def django_app(pg_db: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Django set up on the test database with one app, idmint_djapp, in a temporary folder
    (its migrations folder empty): the app's folder."""
    import django
    from django.conf import settings
    from django.db import connections

    root = tmp_path_factory.mktemp("django")
    app = root / "idmint_djapp"
    (app / "migrations").mkdir(parents=True)
    (app / "__init__.py").write_text("")
    (app / "migrations" / "__init__.py").write_text("")
    (app / "models.py").write_text(textwrap.dedent(DJANGO_MODELS))
    sys.path.insert(0, str(root))
    db = psycopg.conninfo.conninfo_to_dict(pg_db)
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": db["dbname"],
                "USER": db["user"],
                "HOST": db["host"],
                "PORT": db["port"],
            }
        },
        INSTALLED_APPS=["idmint_djapp"],
        IDMINT_STORE=pg_db,
        USE_TZ=True,
    )
    django.setup()
    yield app
    connections.close_all()
    sys.path.remove(str(root))


def test_django_field_migrates_and_fills_ids(pg_db: str, django_app: Path) -> None:
    from django.core.management import call_command
    from django.forms import modelform_factory

    call_command("makemigrations", "idmint_djapp", verbosity=0)
    migration = (django_app / "migrations" / "0001_initial.py").read_text()
    # The field and the default by their import paths, with the key's name: nothing a
    # migration cannot import, no store URL.
    assert "import idmint.integrations.django" in migration
    fields = re.findall(r"idmint\.integrations\.django\.IdmintField\((.*?)\)", migration)
    assert sorted(fields) == [
        f"key='{key}', primary_key=True, serialize=False" for key in ("dj_ticket", "no_such_key")
    ]
    assert "default=idmint.integrations.django.IdmintDefault('dj_number')" in migration
    assert "postgresql://" not in migration
    initial = importlib.import_module("idmint_djapp.migrations.0001_initial")
    assert {op.name for op in initial.Migration.operations} == {"Orphan", "Ticket"}
    call_command("migrate", "idmint_djapp", verbosity=0)
    # The field deconstructs the same way again: no spurious AlterField (SystemExit if any).
    call_command("makemigrations", "idmint_djapp", check=True, dry_run=True, verbosity=0)

    from idmint_djapp.models import Orphan, Ticket  # type: ignore[import-not-found]

    ticket = Ticket(title="one")
    assert ticket.pk is None  # as an AutoField's: no id taken for an unsaved object
    ticket.full_clean()  # and no error for it
    assert list(modelform_factory(Ticket, fields="__all__")().fields) == ["title", "number"]
    ticket.save()
    assert ticket.pk == KEYS["dj_ticket"]
    made = Ticket.objects.create(title="two")
    bulk = Ticket.objects.bulk_create([Ticket(title=f"bulk-{i}") for i in range(100)])
    assert made.pk == ticket.pk + 1 and all(t.pk is not None for t in bulk)
    ids = list(Ticket.objects.values_list("id", flat=True))
    assert sorted(ids) == sorted([ticket.pk, made.pk] + [t.pk for t in bulk])
    assert len(ids) == 102
    _assert_from_key(pg_db, "dj_ticket", ids)
    _assert_from_key(pg_db, "dj_number", list(Ticket.objects.values_list("number", flat=True)))

    with pytest.raises(idmint.KeyNotFound, match="no_such_key"):
        Orphan().save()
    assert Orphan.objects.count() == 0


def test_django_field_refuses_bad_arguments(django_app: Path) -> None:
    from idmint.integrations.django import IdmintDefault, IdmintField

    with pytest.raises(idmint.InvalidArgument, match="bad key name"):
        IdmintField(key="no spaces")
    with pytest.raises(idmint.InvalidArgument, match="takes no default"):
        IdmintField(key="order", default=1)
    with pytest.raises(idmint.InvalidArgument, match="is a primary key"):
        IdmintField(key="order", primary_key=False)
    with pytest.raises(idmint.InvalidArgument, match="IDMINT_NOWHERE"):
        IdmintDefault("order", setting="IDMINT_NOWHERE")()
