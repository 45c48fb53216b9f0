"""The idmint HTTP server: `idmint serve`, or any ASGI/RSGI server on `create_app`.

The names below load their modules when first asked for: the CLI reads `server.config` (for
`--config`, `IDMINT_STORE_FILE` and the options it builds from the settings) without loading
the app, its metrics (prometheus-client) and what else only a running server needs, which the
`server` extra installs.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import App, create_app
    from .config import ServerConfig

__all__ = ["App", "ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name in ("App", "create_app"):
        from . import app

        return getattr(app, name)
    if name == "ServerConfig":
        from .config import ServerConfig

        return ServerConfig
    raise AttributeError(f"module 'idmint.server' has no attribute {name!r}")
