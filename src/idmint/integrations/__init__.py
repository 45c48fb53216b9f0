"""Primary keys from an idmint key, for ORMs: `sqlalchemy.py` (a column default) and
`django.py` (a model field). See docs/integrations.md.

Both name their store in the model, at import time, and open it on the first id a process
asks for: an app imported before fork() (gunicorn --preload) opens nothing in the parent, and
each process has its own generator. (One made before a fork would be safe too: the child drops
its parent's ranges, see _fork.py.) Generators named by a store URL share one Minter per URL and
process, which lives as long as the process; `close_shared()` gives their unused ids back.
"""

from __future__ import annotations

import threading

from .._fork import ForkAware
from .._minter import Minter, connect
from ..ids import check_key_name
from ..strategies.segment import SegmentGenerator

__all__ = ["LazyGenerator", "close_shared", "shared_minter"]


class _SharedMinters(ForkAware):
    """One Minter per store URL and process, made on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._minters: dict[str, Minter] = {}
        self._watch_fork()

    def _after_fork(self) -> None:
        # The minters reset themselves; only the lock may have been held by another thread.
        self._lock = threading.Lock()

    def get(self, url: str | None) -> Minter:
        index = url or ""  # "": connect()'s default, $IDMINT_STORE then ./idmint.db
        with self._lock:
            made = self._minters.get(index)
            if made is None:
                made = self._minters[index] = connect(url or None)
            return made

    def close(self, timeout: float) -> None:
        with self._lock:
            minters, self._minters = list(self._minters.values()), {}
        for minter in minters:
            minter.close(timeout)


_shared = _SharedMinters()


def shared_minter(url: str | None) -> Minter:
    """This process's Minter on store `url` (None: $IDMINT_STORE, then sqlite:///./idmint.db),
    made on first use and shared by every integration that names the same URL."""
    return _shared.get(url)


def close_shared(timeout: float = 2.0) -> None:
    """Close the minters made by shared_minter(), giving their unused ids back (else they are
    skipped, never reused, as when a process is killed). Later ids open them again. Not run
    at exit on its own: Python 3.12 refuses the threads closing needs from atexit."""
    _shared.close(timeout)


class LazyGenerator:
    """The segment generator of `key` on `store`: a Minter, or a store URL opened on the first
    call (`None`: idmint.connect()'s default), in each process."""

    __slots__ = ("_gen", "key", "store")

    def __init__(self, key: str, store: Minter | str | None = None) -> None:
        if not isinstance(store, Minter | str | None):
            raise TypeError(f"store is a Minter or a store URL, not {type(store).__name__}")
        self.key = check_key_name(key)  # a bad name fails where the model names it
        self.store = store
        self._gen: SegmentGenerator | None = None

    def get(self) -> SegmentGenerator:
        """The generator, made on the first call (and again after its Minter closed)."""
        gen = self._gen
        if gen is None or gen.closed:  # closed: close_shared() ran, or its Minter closed
            store = self.store
            minter = store if isinstance(store, Minter) else shared_minter(self._url())
            gen = self._gen = minter.segment(self.key)
        return gen

    def _url(self) -> str | None:
        """The store URL, read when the generator is made (subclasses read settings)."""
        return self.store if isinstance(self.store, str) else None

    def __repr__(self) -> str:  # no URL: it may hold a password
        return f"{type(self).__name__}({self.key!r})"
