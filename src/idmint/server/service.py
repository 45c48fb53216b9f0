"""What every route that hands out segment ids shares, idmint's own (id_routes.py) and the
peers' (dropin.py): the keys' rows as last read (their batch caps), the names found to be no
key, the keys' generators, the HTTP id budget, and the three ways to take ids: drawn from a
generator (`take_ids`), a whole range (`allocate`), or a key's row (`key_row`)."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable

from .._errors import DatacenterRetired, Exhausted, IdmintError, KeyNotFound
from .._minter import Minter
from ..aio import draw
from ..ids import BATCH_CAP_MAX, BATCH_CAP_STEPS, Allocation, Key, check_stripe
from ..strategies.refills import allocate_any
from ..strategies.segment import SegmentGenerator
from .config import ServerConfig
from .http import HttpError, bearer_is
from .metrics_sources import Counters
from .pools import Pool
from .tokens import Token, TokenTable, implicit_tokens

#: `IdService.bearers` with a tokens file: not empty (the id routes need a token), and no
#: header equals it ("Bearer " and a secret never has parentheses first).
PER_KEY = ("(per-key tokens)",)
NEGATIVE_CACHE_SECONDS = 1.0
BATCH_CAP_HEADER = "idmint-batch-cap"
SECONDS_A_DAY = 86_400
#: Above this many ids a second a budget never binds: no bucket is kept.
UNLIMITED_RATE = 1e9
#: Seconds of the budget a full bucket holds (a burst after a quiet while).
BURST_SECONDS = 3600.0


class OverBudget(Exception):
    """A request the key's budget cannot pay for now."""

    def __init__(self, key: Key, rate: float, days: float, retry_after: float) -> None:
        super().__init__(
            f"key {key.name!r} hands out at most {rate:,.0f} ids/s over HTTP per server process "
            f"(its {key.last_id - key.first_id + 1:,} ids would last {days:g} days at that rate; "
            f"--id-budget-days, IDMINT_ID_BUDGET_DAYS); try again in {retry_after:.0f} s"
        )
        self.retry_after = retry_after


class _Bucket:
    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.level, self.stamp = capacity, time.monotonic()


class KeyRetired(Exhausted):
    """The 410 of a retired key (`idmint keys retire`), said as it is: the store refuses its
    ranges as exhausted ("every id up to its maximum is used"), which a retired key's ids are
    not. Still an Exhausted: the same status and `idmint-last-id` header."""

    def __init__(self, key: str, last_id: int | None) -> None:
        IdmintError.__init__(
            self,
            f"key {key!r} is retired (idmint keys retire): it hands out no id again, and its "
            "unused ids are never reused",
        )
        self.key, self.last_id, self.stripe, self.stripes = key, last_id, None, None


class IdBudget:
    """How fast a key's ids may go out over HTTP: a budget per key and server process, for
    every key this process serves (event-loop use only: no lock).

    Without a client token the id routes are open to anyone, and a bounded key (a 32-bit key
    has about 2.1 billion ids) would be burnt for good by a few seconds of large requests. So
    each key gets a token bucket of ids: it refills at the key's whole id space over `days` (a
    32-bit key over 30 days: 829 ids/s), holds an hour of that (about 3 million ids of a 32-bit
    key: bursts, backfills) or one full batch, whichever is more, and a request it cannot pay
    for is refused with 429 and Retry-After. A 64-bit key's budget is beyond any request rate,
    so it gets no bucket and the hot path pays one comparison.
    """

    def __init__(self, days: float) -> None:
        self.days = days  # 0: no budget
        self._buckets: dict[str, _Bucket | None] = {}

    def rate(self, key: Key) -> float:
        """The key's budget in ids a second (infinite with no budget)."""
        if not self.days:
            return math.inf
        return (key.last_id - key.first_id + 1) / (self.days * SECONDS_A_DAY)

    def charge(self, key: Key, ids: int) -> None:
        """Take `ids` from the key's budget, or raise OverBudget (nothing taken)."""
        bucket = self._buckets[key.name] if key.name in self._buckets else self._make(key)
        if bucket is None:
            return
        now = time.monotonic()
        bucket.level = min(bucket.capacity, bucket.level + (now - bucket.stamp) * bucket.rate)
        bucket.stamp = now
        if ids > bucket.level:
            wait = (ids - bucket.level) / bucket.rate
            raise OverBudget(key, bucket.rate, self.days, max(1.0, math.ceil(wait)))
        bucket.level -= ids

    def refund(self, key: Key, ids: int) -> None:
        """Give back ids charged for a request answered without them (the hot paths' empty
        buffer: the routed path charges them again)."""
        bucket = self._buckets.get(key.name)
        if bucket is not None:
            bucket.level = min(bucket.capacity, bucket.level + ids)

    def _make(self, key: Key) -> _Bucket | None:
        rate = self.rate(key)
        made = None
        # A retired key (first id past its maximum) has no ids to pace: no bucket, or its
        # rate of 0 (or less, striped) would divide by zero once the burst is spent.
        if 0 < rate < UNLIMITED_RATE:
            made = _Bucket(rate, max(rate * BURST_SECONDS, float(key.batch_cap)))
        if len(self._buckets) > 1_000_000:  # made-up names never get here: rows exist
            self._buckets.clear()
        self._buckets[key.name] = made
        return made


def check_cap(row: Key, asked: int, what: str) -> None:
    """Refuse a request for more ids than the key's batch cap, naming the cap (also in a
    header, for clients that size their requests by it)."""
    if asked <= row.batch_cap:
        return
    rule = (
        "set by an admin"
        if row.max_batch
        else f"the default: the key's step x {BATCH_CAP_STEPS}, at most {BATCH_CAP_MAX}"
    )
    raise HttpError(
        400,
        f"{what} {asked} is over key {row.name!r}'s cap of {row.batch_cap} ids per request "
        f"({rule}); ask for fewer, or have an admin change max_batch "
        f"(PATCH /v1/keys/{row.name})",
        ((BATCH_CAP_HEADER, str(row.batch_cap)),),
    )


class IdService:
    """The segment keys as the id routes see them. `minter` is called for the app's minter
    (opened on first use); store calls run on `pool`, within the config's timeout. The route
    modules take their config, minter, id pool and counters from here."""

    def __init__(self, config: ServerConfig, minter: Callable[[], Minter], pool: Pool) -> None:
        self.config = config
        self.minter = minter
        self.pool = pool
        self.counters = Counters()
        self.store_deadline = config.timeout
        #: Each key's row as last read: its batch cap.
        self.rows: dict[str, Key] = {}
        #: Each key's generator, made on first use (or at warm-up).
        self.generators: dict[str, SegmentGenerator] = {}
        # Names found to be no key (of the kind asked for), and until when that is trusted.
        self._missing: dict[str, tuple[float, KeyNotFound]] = {}
        # Ids per second each key may hand out over HTTP in this process (IdBudget).
        self._budget = IdBudget(config.id_budget_days)
        #: Bearer headers the hot path accepts as they are (any other form of a good token
        #: takes the full path, which parses the header): none, and the id routes are open,
        #: unless a client token is set (the admin token alone guards admin only).
        self.bearers = (
            tuple(f"Bearer {t}" for t in (config.client_token, config.token) if t)
            if config.client_token
            else ()
        )
        #: The tokens file's tokens (with the two above as implicit entries), or None without
        #: one: then nothing below changes from the checks above.
        self.tokens: TokenTable | None = None
        if config.tokens:
            self.tokens = TokenTable(
                config.tokens, implicit_tokens(config.token, config.client_token)
            )
            # Never a header: the id routes need a token, and which one depends on the key, so
            # every check that finds `bearers` set asks `tokens` instead.
            self.bearers = PER_KEY

    # -- who may take ids --------------------------------------------------------------------

    def accepts(self, authorization: str | None) -> bool:
        """Whether a request with this Authorization header may take ids: always when no
        client token is set; else with it or the admin token. (With a tokens file, see
        `access`.)"""
        if not self.bearers:
            return True
        tokens = (t for t in (self.config.client_token, self.config.token) if t)
        return any(bearer_is(authorization, token) for token in tokens)

    def check_access(self, key: str | None, token: Token | None, how: str) -> None:
        """With a tokens file: raise the 401 (no token of the file, `how` names how to give
        one) or the 403 (a token that may not take ids of `key`; None: the snowflake routes)
        of a request that carries `token`."""
        tokens = self.tokens
        if tokens is None:
            return
        if token is None:
            raise HttpError(
                401,
                f"this route needs a token of the tokens file ({how})",
                (("www-authenticate", 'Bearer realm="idmint"'),),
            )
        if token.name not in tokens.takers(key).names:
            what = "ids" if key is None else f"ids of key {key!r}"
            why = "ids = false" if not token.ids else "not in its keys"
            raise HttpError(403, f"token {token.name!r} may not take {what} ({why})")

    # -- keys' rows --------------------------------------------------------------------------

    async def key_row(self, key: str) -> Key:
        """The key's row as last read (the app reads every row each few seconds), or read now
        the first time; so a flood of made-up names costs one store read per name per second
        (KeyNotFound is remembered that long) and no threads."""
        row = self.rows.get(key)
        if row is not None:
            return row
        self.check_missing(key)
        try:
            row = await self.pool.run(self.store_deadline, self.minter().key, key)
        except KeyNotFound as exc:
            self.remember_missing(key, exc)
            raise
        self.rows[key] = row
        return row

    def check_missing(self, name: str) -> None:
        """Raise the KeyNotFound `name` was last answered with, while it is trusted."""
        missing = self._missing.get(name)
        if missing is not None and missing[0] > time.monotonic():
            raise missing[1].again()

    def remember_missing(self, name: str, error: KeyNotFound) -> None:
        if len(self._missing) > 10_000:
            self._missing.clear()
        self._missing[name] = (time.monotonic() + NEGATIVE_CACHE_SECONDS, error)

    def forget_missing(self, name: str) -> None:
        self._missing.pop(name, None)

    def keep_rows(self, keys: list[Key]) -> list[Key]:
        self.rows.update((k.name, k) for k in keys)
        return keys

    def keep_allocated_row(self, row: Key) -> Key:
        """Keep the row an allocation came back with when it is the key's own (stripe 0's:
        the batch cap as the store has it now); a stripe's row has no batch cap or description,
        so the key's row as last read stays. Returns the key's row."""
        if row.stripe == 0:
            self.rows[row.name] = row
            return row
        return self.rows.get(row.name) or row

    # -- taking ids --------------------------------------------------------------------------

    def charge(self, row: Key, ids: int) -> None:
        """Take `ids` from the key's HTTP budget (IdBudget), or answer 429."""
        try:
            self._budget.charge(row, ids)
        except OverBudget as exc:
            raise HttpError(429, str(exc), (("retry-after", f"{exc.retry_after:.0f}"),)) from None

    def one_now(self, key: str) -> int | None:
        """One id of a loaded key from its buffer, paid from its budget, for the routes
        answered before routing (Leaf's in App.__rsgi__, tinyid's and CosId's in
        DropIn.answer_now). None when the routed path must answer, alike only slower: the key
        not loaded, its budget spent (the router's 429, nothing drawn), its buffer empty or an
        error (the id charged is given back: the router charges it again)."""
        gen, row = self.generators.get(key), self.rows.get(key)
        if gen is None or row is None:
            return None
        try:
            self.charge(row, 1)
        except HttpError:
            return None
        try:
            i = gen.try_next_id()
        except IdmintError:
            i = None
        if i is None:
            self._budget.refund(row, 1)
        return i

    def retired_or(self, exc: Exhausted) -> Exhausted:
        """A KeyRetired for a key whose row (as last read: every few seconds) is retired; the
        store's own Exhausted otherwise. A retired striped key is retired whole, whichever
        stripe was asked for. Every route that hands ids answers with it."""
        row = self.rows.get(exc.key)
        if row is not None and row.retired and not isinstance(exc, DatacenterRetired):
            return KeyRetired(exc.key, exc.last_id)
        return exc

    async def generator(self, key: str) -> SegmentGenerator:
        """The key's generator; made only for keys that exist."""
        gen = self.generators.get(key)
        if gen is not None:
            return gen
        await self.key_row(key)
        gen = self.generators.get(key) or self.minter().segment(key)
        self.generators[key] = gen
        return gen

    async def draw(self, gen: SegmentGenerator, count: int) -> list[int]:
        """`count` ids of a key, waiting for its refills on the event loop (aio.draw), so a
        request that waits for the store holds no thread (100,000 cold keys asked at once hold
        none), for at most the server's `wait` in all. Fewer ids than asked, rather than
        losing the ones already drawn, when the store fails midway."""
        return await draw(gen, count, self.config.wait, per_range=False, partial=True)

    async def take_ids(self, key: str, count: int, what: str) -> list[int]:
        """`count` ids from the key's generator, within its batch cap (`what` names the count
        in a refusal); fewer when the store fails after some were drawn."""
        row = self.rows.get(key) or await self.key_row(key)
        if count > 1:
            check_cap(row, count, what)
        self.charge(row, count)
        return await self.draw(await self.generator(key), count)

    async def allocate(
        self, key: str, size: int | None, stripe: int | None, *, capped: bool = True
    ) -> tuple[Allocation, Key]:
        """A fresh range of the key (of `size` ids, or its step; from `stripe`, or any), and the
        key's row as it stands after it. `capped=False`: `size` may pass the key's batch cap
        (CosId's prefetch on a key that opted in: dropin.py); its budget still applies."""
        row = await self.key_row(key)
        if stripe is not None:
            check_stripe(stripe, row.stripes)
        if size is not None and capped:
            check_cap(row, size, "size")
        elif row.step > row.batch_cap:
            size = row.batch_cap  # a cap below the step bounds the default size too
        self.charge(row, size or row.step)
        # A range the store commits after the deadline is dropped: skipped, never served.
        taken = await self.pool.run(
            self.store_deadline,
            functools.partial(allocate_any, self.minter().ranges, key, size, stripe=stripe),
        )
        row = self.keep_allocated_row(taken.key)
        handed = self.counters.ranges_handed
        handed[key] = handed.get(key, 0) + len(taken.range)
        return taken, row
