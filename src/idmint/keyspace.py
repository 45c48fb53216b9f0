"""One namespace of key names per store: a name is one key of one kind.

Each kind keeps its keys in its own place: segment keys in the store's ranges (a row or a cell
per key), datacenter keys in the global compare-and-set cells (`dc/NAME`), quorum keys' counters
on their nodes. None of those places knows the others, so two kinds could each make `order` and
hand out the same ids. Hence a claim: every key made through a Minter first claims its name in
one compare-and-set cell of the store, `kind/NAME`, that records which kind the name is (and, for
a quorum key, its bounds: its counters live on the nodes, its definition here). The claim is a
`create`, so of two admins making `order` at once as different kinds, one is refused. Keys made
before claims existed are found where their kind keeps them (`_unclaimed_kind`).

A name asked for as the wrong kind is refused with WrongKind, which says what the key is and how
to ask for it, never with a hint that would make a second key.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ._errors import IdmintError, KeyExists, KeyNotFound, NameTaken, StoreUnavailable, WrongKind
from .ids import Allocation, Key, Range
from .stores.base import CasStore, RangeStore, StoreIdentity

SEGMENT = "segment"
DATACENTER = "datacenter"
QUORUM = "quorum"

CLAIM_PREFIX = "kind/"
#: Where a datacenter key's global cell lives (strategies/datacenter_cells.py's global_cell).
_DATACENTER_CELL = "dc/"


def how_to_use(name: str, kind: str) -> str:
    """How a key of `kind` is asked for, for messages."""
    if kind == DATACENTER:
        return (
            f"ask for it through a datacenter: `idmint next {name} --dc DC`, or a server "
            "started with --dc DC"
        )
    if kind == QUORUM:
        return (
            f"ask for it from its nodes: `idmint next {name} --quorum URLS`, or GET "
            f"/v1/quorum/{name}/ids on a server started with --quorum URLS"
        )
    return (
        f"ask for it without --dc or --quorum: `idmint next {name}`, or GET /v1/keys/{name}/ids "
        "on a server started without --dc"
    )


def how_to_make(name: str, kind: str) -> str:
    """The command that makes a key of `kind`."""
    command = {DATACENTER: "dc add", QUORUM: "quorum add"}.get(kind, "keys add")
    return f"`idmint {command} {name}`"


@dataclass(frozen=True)
class QuorumKey:
    """A quorum key as an admin made it: the bounds of its ids (its counters are on its nodes)."""

    name: str
    start: int
    max: int
    description: str = ""
    created_ms: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kind": QUORUM,
            "start": self.start,
            "max": self.max,
            "description": self.description,
            "created_ms": self.created_ms,
        }


class KeySpace:
    """The names of one store's keys, whatever their kind (see the module doc): claims,
    lookups, and the quorum keys' definitions. Thread-safe (every call is the cells')."""

    def __init__(self, cas: CasStore, ranges: RangeStore) -> None:
        self.cas = cas
        self.ranges = ranges  # where segment keys made before claims existed are found

    @property
    def display_url(self) -> str:
        return self.cas.display_url

    def _read(self, name: str) -> dict[str, object] | None:
        got = self.cas.read(f"{CLAIM_PREFIX}{name}")
        return None if got is None else dict(json.loads(got[0]))

    def kind_of(self, name: str) -> str | None:
        """The kind of key `name` is, None if it is no key."""
        claim = self._read(name)
        if claim is not None:
            return str(claim["kind"])
        return self._unclaimed_kind(name)

    def _unclaimed_kind(self, name: str) -> str | None:
        """The kind of a key made before claims existed (found where its kind keeps it)."""
        try:
            self.ranges.get_key(name)
            return SEGMENT
        except KeyNotFound:
            pass
        if self.cas.read(f"{_DATACENTER_CELL}{name}") is not None:
            return DATACENTER
        return None

    def claim(self, name: str, kind: str, **settings: object) -> tuple[dict[str, object], bool]:
        """Claim `name` for a key of `kind` (with `settings` recorded beside it): the claim as
        stored and whether this call made it. An earlier claim of the same kind stands (its
        maker may have crashed before making the key: making it again is then allowed).
        Raises NameTaken when the name is another kind's."""
        other = self._unclaimed_kind(name)
        if other is not None and other != kind:
            raise self.taken(name, other)
        claim: dict[str, object] = {"kind": kind, "made_ms": int(time.time() * 1000), **settings}
        if self.cas.create(f"{CLAIM_PREFIX}{name}", json.dumps(claim, sort_keys=True)):
            return claim, True
        stored = self._read(name)
        if stored is None:  # a create refused and then gone: claims are never deleted
            raise StoreUnavailable(
                f"the claim of key name {name!r} in {self.display_url} was there and then not"
            )
        if stored["kind"] != kind:
            raise self.taken(name, str(stored["kind"]))
        return stored, False

    def taken(self, name: str, kind: str) -> NameTaken:
        return NameTaken(
            name,
            kind,
            f"key {name!r} already exists as a {kind} key in {self.display_url}; a name is one "
            f"key of one kind: {how_to_use(name, kind)}, or pick another name",
        )

    def missing(self, name: str, wanted: str) -> KeyNotFound:
        """The error for key `name` not found as a `wanted` key: WrongKind when the name is
        another kind's, else KeyNotFound naming the store and how to make the key. Never
        raises: a store that does not answer here gives the plain error."""
        try:
            kind = self.kind_of(name)
        except (IdmintError, OSError):
            kind = None
        if kind is not None and kind != wanted:
            return WrongKind(
                name,
                kind,
                wanted,
                f"key {name!r} is a {kind} key, not a {wanted} key: {how_to_use(name, kind)}",
            )
        return KeyNotFound(
            name,
            f"key {name!r} not found in {self.display_url}; create it with "
            f"{how_to_make(name, wanted)}",
        )

    # -- quorum keys: their definitions live in their claims ---------------------------------

    def add_quorum_key(
        self, name: str, *, start: int, max: int, description: str = "", exist_ok: bool = False
    ) -> QuorumKey:
        """Make quorum key `name` with ids in [start, max]. Raises KeyExists if it exists
        (with `exist_ok`, only if it exists with other bounds)."""
        claim, made = self.claim(
            name,
            QUORUM,
            start=start,
            max=max,
            description=description,
            created_ms=int(time.time() * 1000),
        )
        key = _quorum_key(name, claim)
        if not made and (not exist_ok or (key.start, key.max) != (start, max)):
            raise KeyExists(
                name,
                f"quorum key {name!r} already exists in {self.display_url} with ids "
                f"{key.start}..{key.max}",
            )
        return key

    def quorum_key(self, name: str) -> QuorumKey:
        """Quorum key `name` as its admin made it. Raises WrongKind or KeyNotFound."""
        claim = self._read(name)
        if claim is None or claim["kind"] != QUORUM:
            raise self.missing(name, QUORUM)
        return _quorum_key(name, claim)

    def quorum_keys(self) -> list[QuorumKey]:
        """Every quorum key, sorted by name."""
        found = []
        for cell, value in self.cas.scan(CLAIM_PREFIX):
            claim = json.loads(value)
            if claim.get("kind") == QUORUM:
                found.append(_quorum_key(cell[len(CLAIM_PREFIX) :], claim))
        return sorted(found, key=lambda k: k.name)


def _quorum_key(name: str, claim: dict[str, object]) -> QuorumKey:
    def whole(field: str) -> int:
        value = claim.get(field)
        return value if isinstance(value, int) else 0

    return QuorumKey(
        name,
        start=whole("start"),
        max=whole("max"),
        description=str(claim.get("description") or ""),
        created_ms=whole("created_ms"),
    )


class KindCheckedRanges:
    """A RangeStore of one kind's keys (segment keys, or a datacenter's) that claims the name
    of every key it makes and, when a key is not found, says what the name is instead
    (KeySpace.missing). The hot path never comes here: generators call it to refill."""

    def __init__(self, store: RangeStore, space: KeySpace, kind: str) -> None:
        self.store = store
        self.space = space
        self.kind = kind
        self.display_url = store.display_url

    def _missing(self, exc: KeyNotFound) -> KeyNotFound:
        if isinstance(exc, WrongKind):
            return exc
        return self.space.missing(exc.key, self.kind)

    def init(self) -> None:
        self.store.init()

    def add_key(
        self,
        name: str,
        *,
        step: int,
        first_id: int,
        last_id: int,
        description: str = "",
        stripes: int = 1,
    ) -> Key:
        self.space.claim(name, self.kind)
        return self.store.add_key(
            name,
            step=step,
            first_id=first_id,
            last_id=last_id,
            description=description,
            stripes=stripes,
        )

    def get_key(self, name: str) -> Key:
        try:
            return self.store.get_key(name)
        except KeyNotFound as exc:
            raise self._missing(exc) from None

    def identity(self) -> StoreIdentity | None:
        return self.store.identity()

    def list_keys(self) -> list[Key]:
        return self.store.list_keys()

    def allocate(
        self, name: str, count: int | None = None, *, stripe: int | None = None
    ) -> Allocation:
        try:
            return self.store.allocate(name, count, stripe=stripe)
        except KeyNotFound as exc:
            raise self._missing(exc) from None

    def give_back(self, name: str, unused: Range) -> bool:
        return self.store.give_back(name, unused)

    def raise_floor(self, name: str, to: int) -> Key:
        try:
            return self.store.raise_floor(name, to)
        except KeyNotFound as exc:
            raise self._missing(exc) from None

    def set_max_batch(self, name: str, max_batch: int) -> Key:
        try:
            return self.store.set_max_batch(name, max_batch)
        except KeyNotFound as exc:
            raise self._missing(exc) from None

    def close(self) -> None:
        self.store.close()
