"""A static worker id from config, fenced by a local state file.

Leaf's local fallback keeps the worker id in a file but no time: after a restart with the clock
stepped back it repeats ids. Here the file keeps the horizon (the highest timestamp this worker
may issue), written and fsynced before the generator uses it, and an exclusive lock on the file
keeps two processes on one host from using the worker id at once. Another host configured with
the same worker id is the operator's mistake, and nothing local can see it.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from pathlib import Path
from typing import IO

from .._errors import InvalidArgument, LeaseLost, StoreUnavailable, WorkersExhausted
from .base import Lease, WorkerInfo


class StaticLeaseStore:
    """One fixed worker id; its lease never expires while the process holds the file lock."""

    def __init__(self, worker_id: int, state: str | Path) -> None:
        if isinstance(worker_id, bool) or not isinstance(worker_id, int) or worker_id < 0:
            raise InvalidArgument(f"worker id must be an integer >= 0, not {worker_id!r}")
        self.worker_id = worker_id
        self.path = Path(state)
        self.display_url = f"static://{worker_id}?state={self.path}"
        self._file: IO[str] | None = None
        self._owner = ""

    def _read_horizon(self) -> int:
        try:
            return int(json.loads(self.path.read_text() or "{}").get("horizon_ms", 0))
        except FileNotFoundError:
            return 0
        except (ValueError, OSError) as exc:
            raise StoreUnavailable(f"cannot read worker state {self.path}: {exc}") from exc

    def _write_horizon(self, horizon_ms: int) -> None:
        """Atomically and durably: a power cut leaves the old or the new horizon, never none."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with tmp.open("w") as f:
                json.dump({"worker_id": self.worker_id, "horizon_ms": horizon_ms}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise StoreUnavailable(f"cannot write worker state {self.path}: {exc}") from exc

    def acquire(
        self,
        namespace: str,
        *,
        workers: int,
        ttl: float,
        horizon_ms: int,
        now_ms: int | None = None,  # one worker id: nothing to prefer
    ) -> Lease:
        if self.worker_id >= workers:
            raise InvalidArgument(
                f"worker id {self.worker_id} does not fit: the layout has {workers} worker ids"
            )
        if self._file is not None:
            raise WorkersExhausted(namespace, 1)
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            handle = lock.open("a")
        except OSError as exc:
            raise StoreUnavailable(f"cannot open {lock}: {exc}") from exc
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise InvalidArgument(
                f"static worker {self.worker_id} is in use by another process ({lock})"
            ) from None
        floor = self._read_horizon()
        horizon = max(floor, horizon_ms)
        self._write_horizon(horizon)
        self._file, self._owner = handle, uuid.uuid4().hex
        return Lease(namespace, self.worker_id, self._owner, floor, horizon, ttl)

    def renew(self, lease: Lease, horizon_ms: int) -> Lease:
        if lease.owner != self._owner or self._file is None:
            raise LeaseLost(f"static worker {self.worker_id} was released")
        horizon = max(self._read_horizon(), horizon_ms)
        self._write_horizon(horizon)
        return Lease(
            lease.namespace, lease.worker_id, lease.owner, lease.floor_ms, horizon, lease.ttl
        )

    def release(self, lease: Lease, issued_ms: int | None = None) -> None:
        if lease.owner != self._owner or self._file is None:
            return
        if issued_ms is not None:
            self._write_horizon(max(lease.floor_ms, issued_ms))
        self._file.close()  # drops the lock
        self._file, self._owner = None, ""

    def holders(self, namespace: str) -> list[WorkerInfo]:
        horizon = self._read_horizon()
        owner = self._owner if self._file else ""
        return [WorkerInfo(namespace, self.worker_id, owner, "local", None, horizon)]

    def close(self) -> None:
        pass
