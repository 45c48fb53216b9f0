"""Start the server: granian (RSGI) when installed, uvicorn (ASGI) as the fallback."""

from __future__ import annotations

import logging
import os

from .._errors import InvalidArgument
from ..stores import open_store
from .config import ServerConfig

TARGET = "idmint.server.app:create_app"


def serve(config: ServerConfig) -> None:
    """Run until SIGTERM or SIGINT; then /readyz turns 503, in-flight requests finish and unused
    tails go back to the store."""
    store = open_store(config.store, timeout=config.timeout)  # a bad URL fails here, once
    try:
        store.init()  # and so does an unreachable store, before any worker starts
    finally:
        store.close()
    # Workers are separate processes that build their app from the environment.
    os.environ.update(config.to_env())
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        from granian import Granian
        from granian.constants import HTTPModes, Interfaces
    except ImportError:
        _serve_uvicorn(config)
        return
    Granian(
        TARGET,
        address=config.host,
        port=config.port,
        interface=Interfaces.RSGI,
        workers=config.workers,
        http=HTTPModes(config.http),
        factory=True,
        log_access=False,
    ).serve()


def _serve_uvicorn(config: ServerConfig) -> None:
    try:
        import uvicorn  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise InvalidArgument(
            "idmint serve needs granian (or uvicorn): pip install granian"
        ) from exc
    uvicorn.run(
        TARGET,
        factory=True,
        host=config.host,
        port=config.port,
        workers=config.workers,
        log_level="info",
        access_log=False,
    )
