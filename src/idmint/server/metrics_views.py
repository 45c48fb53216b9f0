"""One view of every worker, for /v1/stats: each worker's own part written next to its
metrics files (WorkerViews), and the parts of all workers combined into one (combine_views).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any

from ..ids import is_digits

# -- one view of every worker, for /v1/stats -------------------------------------------------
#
# /metrics combines the workers by prometheus-client's rules, but the dashboard shows more than
# numbers: each generator's ranges, each quorum node's last error, a datacenter key retired.
# So each worker also writes its own part of /v1/stats (a "view") next to its metrics files,
# once a RATE_WINDOW on its sampling thread, and whichever worker answers reads the others'
# and combines them: every answer then shows every worker, the same whichever answers. Ranges
# are each worker's own, so they stay one row per worker (nothing is made up by adding them);
# what the workers share (a quorum node, a datacenter's cell, a store's counts) is combined by
# the rules below. Cost, measured with the default 100 keys: a 62 KB file per worker written
# once a second (2.8 ms), and 0.5 ms per other worker to read and combine on each /v1/stats.

VIEW_PREFIX = "idmint_view_"  # not *.db: prometheus-client's collector reads only those
#: A view not written again for this long is left out: its worker writes one every RATE_WINDOW
#: and removes it when it stops gracefully, so it is a hung worker's, or a killed one's whose
#: pid runs another process.
VIEW_STALE = 10.0


class WorkerViews:
    """This worker's view written to the multiprocess directory, and the other workers' read
    from it; does nothing without a directory (one worker: its own view is the whole)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._closed = False

    def _file(self, pid: int) -> str:
        assert self.path is not None
        return os.path.join(self.path, f"{VIEW_PREFIX}{pid}.json")

    def publish(self, view: dict[str, Any]) -> None:
        """Replace this worker's view (atomically: a reader sees the old one or the new)."""
        if self.path is None:
            return
        body = json.dumps(view, separators=(",", ":"))
        with self._lock:
            if self._closed:  # after remove(): a view written now would outlive the worker
                return
            own = self._file(os.getpid())
            with open(own + ".tmp", "w", encoding="utf-8") as out:
                out.write(body)
            os.replace(own + ".tmp", own)

    def others(self) -> list[dict[str, Any]]:
        """The other live workers' views (not this one's: the caller has it fresh)."""
        if self.path is None:
            return []
        now, found = time.time(), []
        try:
            entries = list(os.scandir(self.path))
        except OSError:  # the directory goes when the server exits
            return []
        for entry in entries:
            if not entry.name.startswith(VIEW_PREFIX) or not entry.name.endswith(".json"):
                continue
            pid = entry.name[len(VIEW_PREFIX) : -len(".json")]
            if not is_digits(pid) or int(pid) == os.getpid() or not _running(int(pid)):
                continue  # this worker's (the caller has it fresh), or a killed worker's
            try:
                if now - entry.stat().st_mtime > VIEW_STALE:
                    continue
                with open(entry.path, encoding="utf-8") as view:
                    found.append(json.load(view))
            except (OSError, ValueError):  # removed meanwhile: its worker stopped
                continue
        return found

    def remove(self) -> None:
        """This worker stops: its view goes (its counters stay in the totals)."""
        with self._lock:
            self._closed = True
            if self.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._file(os.getpid()))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: not ours, but running
        return True
    return True


def combine_views(views: list[dict[str, Any]]) -> dict[str, Any]:
    """Every worker's view as one: keys, snowflake, cas, datacenter, quorum, replication, and
    the workers' pids and first start. The same whatever order the views come in."""
    views = sorted(views, key=lambda v: int(v["pid"]))
    return {
        "pids": [v["pid"] for v in views],
        "started": min(float(v["started"]) for v in views),
        "keys": _combine_keys(views),
        "snowflake": _combine_snowflake([v["snowflake"] for v in views if v["snowflake"]]),
        "cas": _sum_fields([v["cas"] for v in views if v["cas"]]),
        "datacenter": _combine_datacenter([v["datacenter"] for v in views if v["datacenter"]]),
        "quorum": _combine_quorum([q for v in views for q in v["quorum"] or []]),
        "replication": _combine_replication([v["replication"] for v in views if v["replication"]]),
    }


def _combine_keys(views: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per key and worker that has a generator for it (with its pid); a key no
    worker serves yet, once (pid None: its row as the first worker has it). Keys in the order
    first met, each one's workers by pid."""
    met: dict[str, list[dict[str, Any]]] = {}
    for view in views:
        for key in view["keys"]:
            met.setdefault(key["name"], []).append(key | {"pid": view["pid"]})
    shown = []
    for seen in met.values():
        shown += [k for k in seen if k["generator"] is not None] or [seen[0] | {"pid": None}]
    return shown


def _sum_fields(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Counts of each worker, added up (a store's compare-and-sets, a datacenter's calls)."""
    if not parts:
        return None
    return {name: sum(part[name] for part in parts) for name in parts[0]}


def _combine_snowflake(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Each worker leases its own worker id: all of them, the lease nearest to lapsing, the
    clock furthest off the store's, the rollbacks and renewals of all."""
    if not parts:
        return None
    deadlines = [p["lease_deadline_s"] for p in parts if p["lease_deadline_s"] is not None]
    clock = max(parts, key=lambda p: abs(p["clock_offset_ms"] or 0.0))
    return parts[0] | {
        "worker_id": min(p["worker_id"] for p in parts),
        "worker_ids": sorted(p["worker_id"] for p in parts),
        "lease_deadline_s": min(deadlines, default=None),
        "clock_offset_ms": clock["clock_offset_ms"],
        "clock_offset_error_ms": clock["clock_offset_error_ms"],
        "rollbacks": sum(p["rollbacks"] for p in parts),
        "renewals": sum(p["renewals"] for p in parts),
        "runway_years": min(p["runway_years"] for p in parts),
    }


def _combine_datacenter(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A datacenter's cell of a key is one, which each worker saw when it last wrote or read
    it: the most advanced sight of it (most grants applied, then the highest next id; retired
    first on a tie, as retiring moves nothing forward) is the newest. The global level: the
    latest change any worker saw (a worker that needs no reservation does not call it, and
    would show a partition long healed). The level's calls: every worker's."""
    if not parts:
        return None
    cells: dict[str, list[dict[str, Any]]] = {}
    for part in parts:
        for cell in part["keys"]:
            cells.setdefault(cell["key"], []).append(cell)
    newest = [
        max(seen, key=lambda c: (c["grants"], c["next_id"] or 0, c["retired"]))
        for _, seen in sorted(cells.items())
    ]
    asked = [p["global"] for p in parts if p["global"]["reachable"] is not None]
    level = max(asked, key=lambda g: g["since"] or 0.0, default=parts[0]["global"])
    return {
        "dc": parts[0]["dc"],
        "global": level,
        "counts": _sum_fields([p["counts"] for p in parts]),
        "keys": newest,
    }


def _combine_quorum(parts: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Each quorum key any worker served: every worker's counts added up, and each node as
    idmint_quorum_node_up has it: down if its last call failed in any worker (up only if it
    answered in every worker that called it), its highest counter and latest answer."""
    if not parts:
        return None
    by_key: dict[str, list[dict[str, Any]]] = {}
    for part in parts:
        by_key.setdefault(part["key"], []).append(part)
    shown = []
    for name, stats in sorted(by_key.items()):
        nodes: dict[str, list[dict[str, Any]]] = {}
        for part in stats:
            for node in part["nodes"]:
                nodes.setdefault(node["url"], []).append(node)
        shown.append(
            stats[0]
            | {
                field_: sum(p[field_] for p in stats)
                for field_ in ("ids", "rounds", "retries", "burnt", "requests", "failures")
            }
            | {
                "key": name,
                "largest_batch": max(p["largest_batch"] for p in stats),
                "last_error": next((p["last_error"] for p in stats if p["last_error"]), None),
                "closed": any(p["closed"] for p in stats),
                "workers": len(stats),
                "nodes": [_combine_node(seen) for seen in nodes.values()],
            }
        )
    return shown


def _combine_node(seen: list[dict[str, Any]]) -> dict[str, Any]:
    ups = [n["up"] for n in seen if n["up"] is not None]
    down = next((n for n in seen if n["up"] is False), None)
    answered = [n["last_ok_at"] for n in seen if n["last_ok_at"] is not None]
    return seen[0] | {
        "up": None if not ups else all(ups),
        "counter": max(n["counter"] for n in seen),
        "last_error": down["last_error"] if down else None,
        "last_ok_at": max(answered, default=None),
        "in_flight": any(n["in_flight"] for n in seen),
        "refused": next((n["refused"] for n in seen if n["refused"]), None),
    }


def _combine_replication(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Every worker reads the same store's replication: the first state read; a failover is
    one however many workers fenced it."""
    if not parts:
        return None
    fenced = [p["last_failover"] for p in parts if p["last_failover"]]
    return {
        "state": next((p["state"] for p in parts if p["state"]), None),
        "failovers": max(p["failovers"] for p in parts),
        "last_failover": max(fenced, key=lambda f: f["at"], default=None),
    }
