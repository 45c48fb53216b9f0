"""Compare-and-set cells in one JSON file, changed under an exclusive flock: the toy engine's
one primitive (idmint.stores.base.CasStore)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from idmint import StoreUnavailable
from idmint.stores.base import StoreIdentity

#: The file: {"identity": {"id", "created_ms"} (once made), "cells": {key: [value, version]}}
State = dict[str, Any]


class DirectoryCells:
    """A CasStore on `directory`/cells.json. Every call takes the lock file's flock (each on
    its own open file, so threads of one process exclude each other too), waiting at most
    `timeout` seconds; a write replaces the file atomically and fsyncs it and the directory."""

    def __init__(self, directory: str, display_url: str, *, timeout: float) -> None:
        self.display_url = display_url
        self._dir = Path(directory)
        self._timeout = timeout

    @contextlib.contextmanager
    def _locked(self) -> Iterator[State]:
        self._dir.mkdir(parents=True, exist_ok=True)
        with open(self._dir / "lock", "a+b") as lock:
            deadline = time.monotonic() + self._timeout
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StoreUnavailable(
                            f"store {self.display_url}: locked for over {self._timeout:g} s"
                        ) from None
                    time.sleep(0.001)
            path = self._dir / "cells.json"
            yield json.loads(path.read_text()) if path.exists() else {"cells": {}}

    def _save(self, state: State) -> None:
        """Called under the lock: the new state, durable before the call returns."""
        temporary = self._dir / "cells.json.new"
        with open(temporary, "w") as out:
            json.dump(state, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self._dir / "cells.json")
        directory = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def init(self) -> None:
        self.identity()

    def read(self, key: str) -> tuple[str, int] | None:
        with self._locked() as state:
            cell = state["cells"].get(key)
            return None if cell is None else (cell[0], cell[1])

    def create(self, key: str, value: str) -> bool:
        with self._locked() as state:
            if key in state["cells"]:
                return False
            state["cells"][key] = [value, 1]
            self._save(state)
            return True

    def swap(self, key: str, version: int, value: str) -> bool:
        with self._locked() as state:
            cell = state["cells"].get(key)
            if cell is None or cell[1] != version:
                return False
            state["cells"][key] = [value, version + 1]
            self._save(state)
            return True

    def scan(self, prefix: str) -> list[tuple[str, str]]:
        with self._locked() as state:
            return sorted((k, c[0]) for k, c in state["cells"].items() if k.startswith(prefix))

    def identity(self) -> StoreIdentity | None:
        """Made with the store's first use; a wiped directory is a new store."""
        with self._locked() as state:
            made = state.get("identity")
            if made is None:
                made = {"id": uuid.uuid4().hex, "created_ms": time.time_ns() // 1_000_000}
                state["identity"] = made
                self._save(state)
            return StoreIdentity(made["id"], made["created_ms"])

    def close(self) -> None:
        pass  # nothing stays open between calls
