"""Fork safety: a child process must never serve what its parent holds.

gunicorn --preload, celery's prefork pool and multiprocessing's fork start method all copy a
process with its generators in it: the parent's buffered ranges, its worker lease, its store
connections. If the child kept them, both processes would hand out the same ids (and talk over
one database socket). So every object that holds such things registers here, and the child
drops them before it uses the object again:

- `os.register_at_fork(after_in_child=...)` runs right after every fork made through Python
  (os.fork, multiprocessing, gunicorn, celery, uWSGI's post-fork hook);
- a pid check on every slow path catches a fork that bypassed those hooks (a C extension
  calling fork() itself) before the next store call or range switch.

What a child drops it never gives back or releases: the parent still serves those ranges and
holds that lease. Connections are dropped without closing them (closing a PostgreSQL connection
sends a goodbye on the parent's socket); they are kept referenced so no finaliser closes them.
"""

from __future__ import annotations

import abc
import os
import random
import threading
import weakref
from typing import Any

_watched: weakref.WeakSet[ForkAware] = weakref.WeakSet()
_watched_lock = threading.Lock()
_orphans: list[Any] = []  # the parent's connections, never used nor closed by a child


class ForkAware(abc.ABC):
    """A base for objects that must start afresh in a forked child: they call `_watch_fork()`
    when made, `_check_fork()` on slow paths, and implement `_after_fork()`."""

    __slots__ = ("__weakref__", "_pid")  # subclasses may use slots (the WeakSet needs weakrefs)
    _pid: int

    def _watch_fork(self) -> None:
        self._pid = os.getpid()
        with _watched_lock:
            _watched.add(self)

    def _check_fork(self) -> bool:
        """Reset the object if this is a child of the process that made it; True if it was."""
        pid = os.getpid()
        if self._pid == pid:
            return False
        self._pid = pid
        self._after_fork()
        return True

    @abc.abstractmethod
    def _after_fork(self) -> None:
        """Drop what belongs to the parent: buffered ids, leases, connections, locks (another
        thread of the parent may have held them at the fork; only the forking thread lives on)."""


def orphan(resource: Any) -> None:
    """Keep a parent's connection alive and unused in a child (see the module docstring)."""
    if resource is not None:
        _orphans.append(resource)


def _after_fork_in_child() -> None:
    global _watched_lock
    _watched_lock = threading.Lock()  # the parent's lock may have been held at the fork
    for obj in list(_watched):
        obj._check_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def private_random() -> random.Random:
    """A random generator of our own (the application's `random` sequence stays its own),
    reseeded in every forked child: a copied state would make forked workers draw the same
    back-off waits and stripes, colliding in lockstep."""
    rng = random.Random()
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=rng.seed)
    return rng
