"""The one exception hierarchy of idmint.

    IdmintError
     ├── InvalidArgument        bad input: key name, count, option, store URL (a ValueError)
     │    └── DriverMissing      the store's driver is not installed: names the extra to install
     ├── KeyNotFound            the key is not in the store (also LookupError)
     │    └── WrongKind          the name is a key of another kind (asked as segment, is quorum)
     ├── KeyExists              `add` of a key that is already there
     │    └── NameTaken          `add` of a name that is a key of another kind
     ├── Exhausted              a bounded key has no ids left
     │    └── DatacenterRetired  the datacenter gave its reservation back: it takes no more ids
     ├── StoreUnavailable       the store cannot be reached or did not answer in time; transient
     │    ├── CounterWentBack    a key's counter moved below ids this process took: data lost
     │    ├── RunwaySpent        a datacenter used up its reservation and the global store is
     │    │                      out of reach (a partition): it serves again when that heals
     │    ├── LostReservations   a datacenter's cell and the global one disagree (data lost): it
     │    │                      takes no reservation until `idmint dc reset`
     │    └── QuorumUnavailable  no majority of a quorum key's nodes accepted a round in time
     ├── WorkersExhausted       every worker id of a namespace is leased
     ├── WorkerInUse            a static worker id is held by another live process
     ├── LeaseLost              a snowflake generator's worker lease lapsed: it stopped issuing
     ├── ClockMovedBackwards    the clock stepped back further than the generator waits out
     └── Closed                 the generator or minter was closed

Every message says what happened and, where there is one, what to do about it. Messages are
single lines so the CLI and the server can pass them on to a user unchanged.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable


def did_you_mean(name: str, names: Iterable[str], show: Callable[[str], str] = str) -> str:
    """The names close to a mistyped one, as " (did you mean X?)" (each as `show` writes
    it), else "": for messages."""
    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(map(show, close))}?)" if close else ""


class IdmintError(Exception):
    """Base class of every error idmint raises on purpose."""


class InvalidArgument(IdmintError, ValueError):
    """An argument is out of range or malformed; nothing was changed."""


class DriverMissing(InvalidArgument):
    """The Python driver for a store URL's scheme is not installed."""


class KeyNotFound(IdmintError, LookupError):
    """The key does not exist in the store."""

    def __init__(self, key: str, message: str | None = None) -> None:
        super().__init__(
            message or f"key {key!r} not found; create it with `idmint keys add {key}`"
        )
        self.key = key

    def again(self) -> KeyNotFound:
        """A new exception like this one (a stored error raised anew in another thread)."""
        return KeyNotFound(self.key, str(self))


class WrongKind(KeyNotFound):
    """The key was asked for as one kind (a segment key, say) and the name is a key of another
    kind (a datacenter or quorum key): a name is one key of one kind per store. The message says
    how to ask for the key it is."""

    def __init__(self, key: str, kind: str, wanted: str, message: str) -> None:
        super().__init__(key, message)
        self.kind, self.wanted = kind, wanted

    def again(self) -> WrongKind:
        return WrongKind(self.key, self.kind, self.wanted, str(self))


class KeyExists(IdmintError):
    """A key with this name already exists."""

    def __init__(self, key: str, message: str | None = None) -> None:
        super().__init__(message or f"key {key!r} already exists")
        self.key = key


class NameTaken(KeyExists):
    """A key was to be made under a name that is a key of another kind: never a second key
    under one name (its ids would repeat the first's). Not an "exists, fine" for --exist-ok."""

    def __init__(self, key: str, kind: str, message: str) -> None:
        super().__init__(key, message)
        self.kind = kind


class Exhausted(IdmintError):
    """A bounded key has handed out every id up to its maximum (or, with `stripe`, one stripe
    of a striped key has: its generator moves to another stripe)."""

    def __init__(
        self,
        key: str,
        last_id: int | None = None,
        *,
        stripe: int | None = None,
        stripes: int | None = None,
    ) -> None:
        up_to = f" up to its maximum {last_id}" if last_id is not None else ""
        which = f"stripe {stripe} of key {key!r}" if stripe is not None else f"key {key!r}"
        super().__init__(f"{which} is exhausted: every id{up_to} is used")
        self.key = key
        self.last_id = last_id
        self.stripe = stripe
        self.stripes = stripes  # with `stripe`: how many the key has


class DatacenterRetired(Exhausted):
    """A datacenter of a datacenter key was retired (its unused reservation went back to the
    key): it hands out no more ids until it is reopened."""

    def __init__(self, key: str, dc: str) -> None:
        IdmintError.__init__(
            self,
            f"datacenter {dc!r} of key {key!r} is retired: it gave its reservation back and "
            f"takes no more ids (reopen it with `idmint dc reopen {key} --dc {dc}`)",
        )
        self.key, self.dc = key, dc
        self.last_id, self.stripe, self.stripes = None, None, None


class StoreUnavailable(IdmintError):
    """The store could not be reached, failed, or did not answer within the bound."""


class CounterWentBack(StoreUnavailable):
    """The store handed out a range below one this process already took for the key: it lost
    data (restored from a backup, wiped and re-created). The generator stops for good."""

    def __init__(self, key: str, start: int, taken_up_to: int) -> None:
        super().__init__(
            f"the store's counter for key {key!r} went back: it handed out {start}, below "
            f"{taken_up_to} which this process already took; it lost data (restored from a "
            f"backup, or wiped), so its ids may repeat. Raise the key above every id handed out "
            f"(idmint keys raise {key} --to N) and restart"
        )
        self.key, self.start, self.taken_up_to = key, start, taken_up_to


class RunwaySpent(StoreUnavailable):
    """A datacenter handed out its whole reservation of a key (and the range it preloaded) and
    could not get another from the global store: it is cut off (a partition) or the global store
    is down. Transient: the datacenter serves again once the global store answers."""

    def __init__(self, key: str, dc: str, reason: str) -> None:
        super().__init__(
            f"datacenter {dc!r} has handed out its whole reservation of key {key!r} and cannot "
            f"get another from the global store: {reason} (it serves again once the global "
            "store answers; give it a longer runway: idmint dc set KEY --runway)"
        )
        self.key, self.dc, self.reason = key, dc, reason


class LostReservations(StoreUnavailable):
    """A datacenter's cell and the global cell disagree in a way only lost data explains (a
    store restored from an older copy or wiped, or the key made again): the datacenter stops
    taking reservations until an operator resets it (`idmint dc reset`)."""


class QuorumUnavailable(StoreUnavailable):
    """No majority of a quorum key's nodes accepted a round before the deadline: too many nodes
    are down or out of reach, or callers contended past it. Nothing was handed out; transient."""


class WorkersExhausted(IdmintError):
    """Every worker id of a namespace is held by a live lease."""

    def __init__(self, namespace: str, workers: int) -> None:
        super().__init__(
            f"all {workers} worker ids of namespace {namespace!r} are taken: wait for a lease "
            "to expire, release one, or use a layout with more worker bits"
        )
        self.namespace = namespace
        self.workers = workers


class WorkerInUse(IdmintError):
    """A static worker id was claimed while another process holds it."""

    def __init__(self, namespace: str, worker_id: int, holder: str, expires_in: float | None):
        until = f" for {expires_in:.1f} s more" if expires_in is not None else ""
        who = holder or "another process"
        super().__init__(
            f"worker id {worker_id} of namespace {namespace!r} is held by {who}{until}: "
            "a static worker id has one holder at a time; give each process its own"
        )
        self.namespace, self.worker_id, self.holder = namespace, worker_id, holder


class LeaseLost(IdmintError):
    """The worker lease could not be renewed in time (or another process holds it now): the
    generator stops issuing until it has a lease again."""


class ClockMovedBackwards(IdmintError):
    """The wall clock is behind the last timestamp issued by more than the generator waits."""

    def __init__(self, behind_ms: float) -> None:
        super().__init__(
            f"the clock moved back {behind_ms:.0f} ms: refusing to issue ids until it catches up"
        )
        self.behind_ms = behind_ms


class Closed(IdmintError):
    """The generator or minter was closed; open a new one."""
