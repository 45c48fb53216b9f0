"""Per-key access: the tokens file of `idmint serve --tokens FILE` (docs/server.md, "Tokens").

    [tokens.orders]
    secret = "..."                  # or secret_sha256 = "<64 hex digits>"
    keys = ["order*", "invoice"]    # key names or fnmatch patterns ("*": every key)
    admin = false                   # key admin over HTTP, on those keys (default false)
    ids = true                      # take ids of those keys (default true)

Every comparison with a secret takes the same time whatever the secret, two ways:

- The id routes' hot check is per key: each key name maps to the tokens that may take its ids
  (worked out by glob matching on the first request for that name, kept until the next reload).
  Up to SMALL of them, the header is compared with each one's `Bearer <secret>` by
  hmac.compare_digest, every one compared: the cheapest check there is for the usual one or two.
- Past SMALL (and for a `secret_sha256` token, whose secret the server never sees), the presented
  secret is hashed with SHA-256 and its digest looked up in a set. The lookup's time depends on
  the digest, which an attacker cannot steer towards a stored one (that would take a SHA-256
  preimage), so it tells nothing about any secret, and it costs the same with 5 tokens or 5,000;
  but hashing costs more than a comparison or two (hashlib's set-up mostly).

Who a request is (401 or 403, the audit line's name) is always the digest lookup.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, NamedTuple

from .._errors import InvalidArgument, did_you_mean

log = logging.getLogger("idmint.server")

#: A token's name: what the audit lines and the refusals say (never the secret).
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: A key pattern: a key name's characters and fnmatch's.
PATTERN = re.compile(r"[A-Za-z0-9._:*?\[\]!-]{1,128}")
HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
#: The shortest secret the file takes: 16 characters of a random hex string are 64 bits.
MIN_SECRET = 16
FIELDS = ("secret", "secret_sha256", "keys", "ids", "admin")
#: Key names whose access is remembered at most (made-up names would grow it without end:
#: past this it starts over, costing one glob match per name again).
CACHE_MAX = 100_000
BEARER = "Bearer "
#: Tokens of a key compared one by one at most; more: by digest (see above).
SMALL = 4
_sha256 = hashlib.sha256
#: The attribute of an audit log record that holds its fields (run.JsonFormatter adds them to
#: the JSON line).
AUDIT_FIELDS = "audit"
#: A SIGHUP a worker got before its event loop's handler was there (run.py's main-process
#: handler, inherited over fork, notes it): the handler reloads once it is installed.
_pending_reload = False


def note_pending_reload() -> None:
    global _pending_reload
    _pending_reload = True


def take_pending_reload() -> bool:
    global _pending_reload
    pending, _pending_reload = _pending_reload, False
    return pending


def digest(secret: str) -> bytes:
    return _sha256(secret.encode("utf-8", "backslashreplace")).digest()


@dataclass(frozen=True)
class Token:
    """Who may do what: a token of the file, an implicit one (`--token`, `--client-token`),
    or the loopback clients of `--admin-loopback`."""

    name: str
    digest: bytes = field(repr=False)
    keys: tuple[str, ...] = ("*",)
    ids: bool = True
    admin: bool = False
    #: b"Bearer <secret>", what the hot paths compare a header with; None for a token given
    #: by its digest (secret_sha256).
    header: bytes | None = field(default=None, repr=False)

    def covers(self, key: str) -> bool:
        return any(fnmatchcase(key, pattern) for pattern in self.keys)

    def not_admin_of(self, key: str) -> str:
        """The 403's reason for key admin on a key this token does not cover."""
        return f"token {self.name!r} may not administer key {key!r} (not in its keys)"


#: The principal of token-less admin from a loopback client (--admin-loopback).
LOOPBACK = Token("(loopback)", b"", ids=False, admin=True)
#: The names the implicit tokens have: a file's names cannot start with '-'.
ADMIN_TOKEN, CLIENT_TOKEN = "--token", "--client-token"


def implicit_tokens(token: str, client_token: str) -> list[Token]:
    """The settings' tokens as entries: the admin token may do everything, the client token
    take ids of every key, as without a tokens file."""
    found = []
    if token:
        found.append(Token(ADMIN_TOKEN, digest(token), admin=True, header=_header(token)))
    if client_token:
        found.append(Token(CLIENT_TOKEN, digest(client_token), header=_header(client_token)))
    return found


def _header(secret: str) -> bytes:
    return (BEARER + secret).encode("utf-8", "backslashreplace")


class Takers(NamedTuple):
    """The tokens that may take ids of one key, as the checks want them."""

    #: `Bearer <secret>` of each, compared one by one (SMALL at most).
    headers: tuple[bytes, ...]
    #: The digests of the rest.
    digests: frozenset[bytes]
    names: frozenset[str]


def parse_tokens(text: str, source: str) -> list[Token]:
    """The tokens of a tokens file's text; InvalidArgument naming `source` and what is wrong
    (never a secret: TOML's own messages give a line and column, not the text)."""

    def bad(why: str) -> InvalidArgument:
        return InvalidArgument(f"bad tokens file {source}: {why}")

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise bad(str(exc)) from None
    unknown = sorted(set(data) - {"tokens"})
    if unknown:
        raise bad(f"unknown top-level keys {', '.join(unknown)}: put each token in [tokens.NAME]")
    table = data.get("tokens", {})
    if not isinstance(table, dict):
        raise bad("tokens must be tables: [tokens.NAME]")
    found: list[Token] = []
    for name, entry in table.items():
        if not NAME.fullmatch(name):
            raise bad(
                f"bad token name {name!r}: 1 to 64 of A-Z a-z 0-9 . _ -, not starting with . _ -"
            )
        if not isinstance(entry, dict):
            raise bad(f"tokens.{name} must be a table")
        found.append(_entry(name, entry, bad))
    return found


def _entry(name: str, entry: dict[str, Any], bad: Callable[[str], InvalidArgument]) -> Token:
    where = f"tokens.{name}"
    unknown = sorted(set(entry) - set(FIELDS))
    if unknown:
        extra = unknown[0]
        raise bad(f"{where}: unknown field {extra}{did_you_mean(extra, FIELDS)}")
    secret, hashed = entry.get("secret"), entry.get("secret_sha256")
    if (secret is None) == (hashed is None):
        raise bad(f"{where}: give secret or secret_sha256 (one of them)")
    if secret is not None:
        # The same rules as --token's (a header carries it), and a length a guess cannot reach.
        if not (
            isinstance(secret, str)
            and secret.isascii()
            and secret.isprintable()
            and secret == secret.strip()
            and len(secret) >= MIN_SECRET
        ):
            raise bad(
                f"{where}: secret must be printable ASCII, at least {MIN_SECRET} characters, "
                "without leading or trailing spaces (openssl rand -hex 32 makes one)"
            )
        key_digest, header = digest(secret), _header(secret)
    else:
        if not isinstance(hashed, str) or not HEX_DIGEST.fullmatch(hashed):
            raise bad(f"{where}: secret_sha256 must be 64 hex digits (sha256sum of the secret)")
        key_digest, header = bytes.fromhex(hashed.lower()), None
    keys = entry.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise bad(f'{where}: keys must be a list of key names or patterns ("*": every key)')
    for pattern in keys:
        if not PATTERN.fullmatch(pattern):
            raise bad(
                f"{where}: bad key pattern {pattern!r}: a key name's characters "
                "(A-Z a-z 0-9 . _ : -) and * ? [ ] !"
            )
    flags = {}
    for flag, default in (("ids", True), ("admin", False)):
        value = entry.get(flag, default)
        if not isinstance(value, bool):
            raise bad(f"{where}: {flag} must be true or false")
        flags[flag] = value
    return Token(name, key_digest, tuple(keys), flags["ids"], flags["admin"], header)


def read_tokens(path: str, implicit: list[Token]) -> list[Token]:
    """The file's tokens and the implicit ones; InvalidArgument in one line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise InvalidArgument(f"cannot read tokens file {path}: {reason}") from None
    tokens = [*implicit, *parse_tokens(text, path)]
    seen: dict[bytes, str] = {}
    for token in tokens:
        other = seen.setdefault(token.digest, token.name)
        if other != token.name:
            # Which one a request is could not be told apart: its keys, its audit name.
            raise InvalidArgument(
                f"bad tokens file {path}: {other} and {token.name} have the same secret"
            )
    return tokens


class TokenTable:
    """The tokens a server takes, reloaded from its file in place (`reload`). Used on the event
    loop only: a reload runs there too (a signal handler of the loop), so a request sees the
    old table or the new one, never half of each."""

    def __init__(self, path: str, implicit: list[Token]) -> None:
        self.path = path
        self._implicit = implicit
        self._install(read_tokens(path, implicit))

    def _install(self, tokens: list[Token]) -> None:
        self.tokens = tokens
        self._by_digest = {t.digest: t for t in tokens}
        #: key name (None: the snowflake routes, which have no key) -> who may take its ids.
        self._takers: dict[str | None, Takers] = {}

    def reload(self) -> bool:
        """Read the file again; a bad one keeps the tokens as they are and logs one line."""
        try:
            tokens = read_tokens(self.path, self._implicit)
        except InvalidArgument as exc:
            log.error("tokens not reloaded, the previous ones stay: %s", exc)
            return False
        self._install(tokens)
        log.info(
            "tokens reloaded from %s: %d (%s)",
            self.path,
            len(tokens),
            ", ".join(t.name for t in tokens) or "none",
        )
        return True

    def takers(self, key: str | None) -> Takers:
        """The tokens that may take ids of `key` (None: of the snowflake routes, which any
        token with ids = true may use)."""
        found = self._takers.get(key)
        if found is None:
            tokens = [t for t in self.tokens if t.ids and (key is None or t.covers(key))]
            plain = [t.header for t in tokens if t.header is not None]
            if len(plain) <= SMALL:
                rest = frozenset(t.digest for t in tokens if t.header is None)
                found = Takers(tuple(plain), rest, frozenset(t.name for t in tokens))
            else:
                every = frozenset(t.digest for t in tokens)
                found = Takers((), every, frozenset(t.name for t in tokens))
            if len(self._takers) >= CACHE_MAX:
                self._takers.clear()
            self._takers[key] = found
        return found

    def may_take(self, key: str | None, authorization: str | None) -> bool:
        """The hot paths' check: an `Authorization: Bearer <secret>` header, spelt exactly so,
        that may take ids of `key`. Any other spelling is False here, and the routed path
        (identify) answers it."""
        if authorization is None:
            return False
        allowed = self._takers.get(key) or self.takers(key)
        given = authorization.encode("utf-8", "backslashreplace")
        found = False
        for header in allowed.headers:  # every one compared, in constant time
            found |= hmac.compare_digest(given, header)
        if not found and allowed.digests and authorization.startswith(BEARER):
            found = _sha256(given[7:]).digest() in allowed.digests
        return found

    def identify(self, authorization: str | None) -> Token | None:
        """The token an Authorization header carries as a bearer token, or None."""
        scheme, _, value = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.identify_secret(value.strip())

    def identify_secret(self, secret: str) -> Token | None:
        """The token whose secret this is (tinyid's `token=`), or None."""
        return self._by_digest.get(digest(secret)) if secret else None
