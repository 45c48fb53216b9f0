"""Integer primary keys from an idmint key, as a SQLAlchemy column default.

    from idmint.integrations.sqlalchemy import idmint_default

    class Order(Base):
        __tablename__ = "orders"
        id: Mapped[int] = mapped_column(
            BigInteger, primary_key=True, default=idmint_default("order", "postgresql://app@db/app")
        )

SQLAlchemy calls a Python-side default once per row, while it builds the INSERT: ORM adds,
`add_all`, ORM bulk inserts (`session.execute(insert(Order), [...])`) and Core inserts, one
row or many. The id comes from the generator's memory; the store is asked only when both of
its buffered ranges are spent, and then:

- a sync Session waits in the flush (up to the generator's `wait`, 1 s by default), as a
  driver call would;
- an AsyncSession's flush runs in a greenlet on the event loop's thread, where waiting would
  stall the loop: the wait runs on a thread and the greenlet awaits it through the async
  driver's connection (`AdaptedConnection.run_async`), so the loop goes on.

A store that gives nothing within `wait` fails the INSERT with idmint's StoreUnavailable, an
unknown key with KeyNotFound; nothing is written.
"""

from __future__ import annotations

import asyncio

from sqlalchemy.engine import AdaptedConnection
from sqlalchemy.engine.interfaces import ExecutionContext

from .._minter import Minter
from . import LazyGenerator

__all__ = ["IdmintDefault", "idmint_default"]


class IdmintDefault(LazyGenerator):
    """A column default drawing ids from key `key` (see idmint_default)."""

    __slots__ = ()

    def __call__(self, context: ExecutionContext) -> int:
        # SQLAlchemy passes the execution context to a default taking one argument.
        gen = self.get()
        i = gen.try_next_id()
        if i is not None:
            return i
        if not context.dialect.is_async:
            return gen.next_id()
        driver = context.root_connection.connection.dbapi_connection
        if not isinstance(driver, AdaptedConnection):  # every async dialect adapts its driver
            raise TypeError(f"async dialect {context.dialect.name} without an adapted driver")
        # We are in SQLAlchemy's greenlet on the loop's thread: hand the wait to a thread and
        # switch back to the loop until it ends (what the async driver does for each query).
        return driver.run_async(lambda _: asyncio.to_thread(gen.next_id))


def idmint_default(key: str, store: Minter | str | None = None) -> IdmintDefault:
    """A column default giving each new row the next id of idmint key `key`.

    `store` is a Minter (the caller closes it), or a store URL opened in each process on the
    first id it needs (None: $IDMINT_STORE, then sqlite:///./idmint.db, as idmint.connect()).
    The key must exist (`idmint keys add KEY`): an unknown one fails the INSERT with KeyNotFound.
    """
    return IdmintDefault(key, store)
