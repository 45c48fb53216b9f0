"""A static worker id from config, fenced by a local state file.

Leaf's local fallback keeps the worker id in a file but no time: after a restart with the clock
stepped back it repeats ids. Here the file keeps the horizon (the highest timestamp this worker
may issue), written and fsynced before the generator uses it, and an exclusive lock on the file
keeps two processes on one host from using the worker id at once.

Where there is a lease store, a static worker id is claimed there as well (`StateFileLeases`):
the store reserves it, refuses a second holder anywhere, and never leases it to others; the
file adds this host's own record of the horizon, which survives a store that loses its data.
Alone, the file cannot see another host configured with the same worker id.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from dataclasses import replace
from pathlib import Path
from typing import IO

from .._errors import InvalidArgument, LeaseLost, StoreUnavailable, WorkerInUse
from .._fork import ForkAware
from .base import Lease, LeaseStore, StoreIdentity, WorkerInfo, check_claim


class StaticLeaseStore(ForkAware):
    """One fixed worker id; its lease never expires while the process holds the file lock."""

    def __init__(self, worker_id: int, state: str | Path) -> None:
        if isinstance(worker_id, bool) or not isinstance(worker_id, int) or worker_id < 0:
            raise InvalidArgument(f"worker id must be an integer >= 0, not {worker_id!r}")
        self.worker_id = worker_id
        self.path = Path(state)
        self.display_url = f"static://{worker_id}?state={self.path}"
        self._file: IO[str] | None = None
        self._owner = ""
        self._watch_fork()

    def _after_fork(self) -> None:
        # The lock belongs to the open file the parent holds; closing our copy leaves it to
        # the parent (flock is released only when every copy is closed, or explicitly).
        if self._file is not None:
            self._file.close()
        self._file, self._owner = None, ""

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
        worker_id: int | None = None,
    ) -> Lease:
        self._check_fork()
        check_claim(self.worker_id, workers)
        if worker_id is not None and worker_id != self.worker_id:
            raise InvalidArgument(
                f"state file {self.path} is for worker id {self.worker_id}, not {worker_id}"
            )
        if self._file is not None:
            raise WorkerInUse(namespace, self.worker_id, "this process", None)
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            handle = lock.open("a")
        except OSError as exc:
            raise StoreUnavailable(f"cannot open {lock}: {exc}") from exc
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise WorkerInUse(
                namespace, self.worker_id, f"another process (lock {lock})", None
            ) from None
        try:
            floor = self._read_horizon()
            horizon = max(floor, horizon_ms)
            self._write_horizon(horizon)
        except BaseException:
            handle.close()
            raise
        self._file, self._owner = handle, uuid.uuid4().hex
        return Lease(namespace, self.worker_id, self._owner, floor, horizon, ttl, static=True)

    def renew(self, lease: Lease, horizon_ms: int) -> Lease:
        if lease.owner != self._owner or self._file is None:
            raise LeaseLost(f"static worker {self.worker_id} was released")
        horizon = max(self._read_horizon(), horizon_ms)
        self._write_horizon(horizon)
        return replace(lease, horizon_ms=horizon)

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
        return [WorkerInfo(namespace, self.worker_id, owner, "local", None, horizon, static=True)]

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        return False  # a state file is one static worker id by definition

    def identity(self) -> StoreIdentity | None:
        return None

    def close(self) -> None:
        pass


class StateFileLeases:
    """A static worker id claimed in a lease store and a state file (see the module doc).
    Acquire takes the file's lock first (two processes of one host are told apart without a
    round trip), then the store's claim; the floor is the higher of the two horizons, and
    every horizon move is written to both."""

    def __init__(self, store: LeaseStore, state: StaticLeaseStore) -> None:
        self.store, self.state = store, state
        self.display_url = f"{store.display_url} + state {state.path}"
        self._local: dict[str, Lease] = {}  # the store lease's owner -> the file's lease

    def acquire(
        self,
        namespace: str,
        *,
        workers: int,
        ttl: float,
        horizon_ms: int,
        now_ms: int | None = None,
        worker_id: int | None = None,
    ) -> Lease:
        local = self.state.acquire(
            namespace, workers=workers, ttl=ttl, horizon_ms=horizon_ms, worker_id=worker_id
        )
        try:
            lease = self.store.acquire(
                namespace,
                workers=workers,
                ttl=ttl,
                horizon_ms=max(horizon_ms, local.horizon_ms),
                now_ms=now_ms,
                worker_id=self.state.worker_id,
            )
        except BaseException:
            self.state.release(local)
            raise
        self._local[lease.owner] = local
        return replace(lease, floor_ms=max(lease.floor_ms, local.floor_ms))

    def renew(self, lease: Lease, horizon_ms: int) -> Lease:
        try:
            renewed = self.store.renew(lease, horizon_ms)
        except LeaseLost:
            # The holder takes a new lease next: free the file for it (its horizon stays).
            local = self._local.pop(lease.owner, None)
            if local is not None:
                self.state.release(local)
            raise
        local = self._local.get(lease.owner)
        if local is not None:
            self._local[lease.owner] = self.state.renew(local, renewed.horizon_ms)
        return renewed

    def release(self, lease: Lease, issued_ms: int | None = None) -> None:
        local = self._local.pop(lease.owner, None)
        try:
            self.store.release(lease, issued_ms)
        finally:
            if local is not None:
                self.state.release(local, issued_ms)

    def holders(self, namespace: str) -> list[WorkerInfo]:
        return self.store.holders(namespace)

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        return self.store.unreserve(namespace, worker_id)

    def identity(self) -> StoreIdentity | None:
        return self.store.identity()

    def close(self) -> None:
        self.store.close()
