"""The server's log lines: text for people, or one JSON object a line for log collectors.

Every line, idmint's and granian's own, goes to stderr through one handler on the root logger,
in the main process and in every worker (granian applies the same dictConfig in each).

JSON fields (docs/deploy.md): `time` (UTC, ISO 8601 with milliseconds), `level`, `logger`,
`message`, `pid`, and `exception` (the traceback) when the line carries one.
"""

from __future__ import annotations

import json
import logging
import logging.config
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object a line; a message's own newlines are escaped, so a line is a record."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def log_config(log_format: str) -> dict[str, Any]:
    """A logging dictConfig for `log_format`: granian merges it over its own defaults (whose
    loggers print to stdout in their own format), so its loggers are named here and sent to
    the root handler."""
    formatter: dict[str, Any] = (
        {"()": f"{__name__}.JsonFormatter"} if log_format == "json" else {"format": TEXT_FORMAT}
    )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"idmint": formatter},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "idmint",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"handlers": ["stderr"], "level": "INFO"},
        "loggers": {
            "_granian": {"handlers": [], "propagate": True},
            "granian.access": {"handlers": [], "propagate": True},
        },
    }


def configure(log_format: str) -> None:
    logging.config.dictConfig(log_config(log_format))
