"""Minter.close() on a hung store (PostgreSQL SIGSTOPped, its sockets open): it returns within
its bound and says what it could not give back, instead of waiting for the store forever."""

from __future__ import annotations

import logging
import time

import pytest

import idmint

from servers import PostgresServer


def test_close_returns_within_its_bound_on_a_hung_store(caplog: pytest.LogCaptureFixture) -> None:
    with PostgresServer() as pg:
        url = pg.create_database("hung")
        minter = idmint.connect(url)
        minter.add_key("order", step=100)
        gen = minter.segment("order")
        gen.next_ids(10)  # it holds a range whose tail it would give back
        pg.pause()
        try:
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="idmint"):
                minter.close(timeout=2.0)
            took = time.monotonic() - started
        finally:
            pg.resume()
        assert took < 4.0, f"close took {took:.1f} s"
        assert "did not answer within 2 s while closing" in caplog.text
        # Nothing it served comes again (its tail may have gone back once the store woke up).
        with idmint.connect(url) as again:
            assert min(again.segment("order").next_ids(5)) > 10
