"""The idmint HTTP server: `idmint serve`, or any ASGI/RSGI server on `create_app`."""

from .app import App, create_app
from .config import ServerConfig

__all__ = ["App", "ServerConfig", "create_app"]
