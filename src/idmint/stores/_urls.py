"""Store URLs without their secrets, for every message, log line and metric: `redact(url)` is
the URL to show; `scrub(text, url)` is a driver's message about the URL without those secrets,
nor any piece of one between "/ # ? @ : & = ;" (a driver that misread the URL shows pieces of
a password as a host, a port or a database name).

The secrets: the userinfo's password, everything between the first ":" after `scheme://` and
the URL's *last* "@" (a password may hold any character, unencoded "/ # ? @ :" too, which
urlsplit and libpq misread: cutting at the last "@" never shows any of it; a URL with "@"
further on, in its path or query, then shows less than it could, never more); and the value
of every parameter, in the query or a `key=value` connection string, whose name contains one
of SECRET_WORDS in any case (password, passwd, pwd, sslpassword, token, secret, api_key,
sslkey, auth...), running to the next "&name=" (or ";name=", or a blank and "name="), so a
"#" or "?" inside it is hidden too.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, unquote_plus

REDACTED = "***"

#: A parameter whose name contains one of these (in any case) carries a secret.
SECRET_WORDS = ("pass", "pwd", "secret", "token", "key", "auth", "cred")

_NAME = r"[^\s?&;=#/@:'\"]+"
# name=value, the name at the start or after "?", "&", ";" or a blank; the value up to the next
# such name= or the end.
_PARAM = re.compile(
    rf"(?:^|(?<=[?&;\s]))(?P<name>{_NAME})=(?P<value>.*?)(?=[&;\s]{_NAME}=|\Z)", re.DOTALL
)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*(?=://)")
_PIECE_BREAKS = re.compile(r"[/#?@:&=;,\s'\"]+")


def _is_secret(name: str) -> bool:
    name = unquote_plus(name).lower()
    return any(word in name for word in SECRET_WORDS)


def _spans(url: str) -> list[tuple[int, int]]:
    """Where the secrets of `url` are: (start, end) of the userinfo's password and of every
    secret parameter's value, read on the URL as written, merged where they touch."""
    spans = []
    head, sep, rest = url.partition("://")
    if sep:
        at, colon = rest.rfind("@"), rest.find(":")
        if 0 <= colon < at:
            offset = len(head) + len(sep)
            spans.append((offset + colon + 1, offset + at))
    spans += [m.span("value") for m in _PARAM.finditer(url) if _is_secret(m["name"])]
    merged: list[tuple[int, int]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def redact(url: str) -> str:
    """`url` with its password and secret parameters replaced by ***. Never raises.

    Both are found on the URL as written, then hidden together: a password holding
    "&token=", or a parameter's value holding "@", hides everything either reading calls
    secret."""
    try:
        shown, done = [], 0
        for start, end in _spans(url):
            shown += [url[done:start], REDACTED]
            done = end
        return "".join(shown) + url[done:]
    except Exception:  # say less rather than fail
        try:
            scheme = _SCHEME.match(url)
            return f"{scheme.group()}://{REDACTED}" if scheme else REDACTED
        except Exception:
            return REDACTED


def misplaced_at(url: str) -> bool:
    """Whether `url` has an "@" after its host (in the path, query or fragment) with a ":"
    before it: then either a password holds an unencoded "/", "?" or "#" (and urlsplit reads
    its start as the host and port), or the URL's "@" is in its path or query; there is no
    telling which."""
    _, sep, rest = url.partition("://")
    at = rest.rfind("@")
    host_end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    return bool(sep) and at > host_end and ":" in rest[:at]


#: What a URL with misplaced_at() is told.
ENCODE_HINT = (
    'percent-encode "@" in the user name, password, path and query (%40), and "/", "?", "#" '
    "in the password (%2F, %3F, %23)"
)


def secrets(url: str) -> list[str]:
    """Every string of `url` that may be a secret, longest first: the password under every
    reading of the userinfo (ending at any "@"), the values of secret parameters, and what
    redact() hides; each as written, decoded and repr()-escaped."""
    found: set[str] = set()
    _, sep, rest = url.partition("://")
    if sep:
        for at, char in enumerate(rest):
            if char == "@" and ":" in rest[:at]:
                found.add(rest[:at].split(":", 1)[1])
    found.update(m["value"] for m in _PARAM.finditer(url) if _is_secret(m["name"]))
    found.update(url[start:end] for start, end in _spans(url))
    for value in list(found):
        found.update((unquote(value), unquote_plus(value)))
    # ... and as Python's repr() shows them inside a message (urlsplit's errors, say)
    found.update([repr(value)[1:-1] for value in found])
    found.discard("")
    return sorted(found, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """`text`, a message about `url` (a driver's error, say), without any of its secrets nor
    any piece of one that stands alone (not inside a longer word). Never raises."""
    try:
        found = secrets(url)
        for secret in found:
            text = text.replace(secret, REDACTED)
        pieces = {piece for secret in found for piece in _PIECE_BREAKS.split(secret) if piece}
        for piece in sorted(pieces, key=len, reverse=True):
            alone = rf"(?<![A-Za-z0-9]){re.escape(piece)}(?![A-Za-z0-9])"
            text = re.sub(alone, REDACTED, text)
        return text
    except Exception:
        return REDACTED


def take_parameter(url: str, name: str) -> tuple[str, str | None]:
    """`url` without its query parameter `name`, and that parameter's value (None if absent):
    for idmint's own settings in a URL whose driver refuses parameters it does not know
    (libpq)."""
    found = re.search(rf"([?&]){re.escape(name)}=([^&#]*)", url)
    if found is None:
        return url, None
    head, tail = url[: found.start()], url[found.end() :]
    if found.group(1) == "?" and tail.startswith("&"):
        tail = "?" + tail[1:]  # it was the first parameter: the next one opens the query
    return head + tail, unquote(found.group(2))
