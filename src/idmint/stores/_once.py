"""Warnings given once a process, per store (a weak setting the URL accepts is worth one line
in the log, not one per call)."""

from __future__ import annotations

import threading


class Once:
    """Keys already acted on in this process."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def first(self, key: str) -> bool:
        """True the first time `key` is asked about, False ever after."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True
