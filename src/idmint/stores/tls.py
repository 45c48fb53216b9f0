"""TLS to a store, spelled the same in every engine's URL but PostgreSQL's (which keeps libpq's
`sslmode`, `sslrootcert`, `sslcert`, `sslkey`):

    ?ca=PATH        trust this CA bundle (PEM) for the server's certificate; turns TLS on
    ?cert=PATH      present this client certificate (PEM; it may hold its key too); turns TLS on
    ?key=PATH       the client certificate's key, when it is in a file of its own
    ?tls=1          TLS with the system's CAs (tls=0 with none of the above: plain)

The server's certificate is always verified, its name included (the URL's host must be in it):
there is no switch to turn that off, because a store reached without it can be anyone's.
`rediss://` keeps meaning TLS on Redis, as it always has.

Files are read when the URL is opened, so a wrong path or a key that does not match its
certificate is an InvalidArgument at once, naming the store (never a secret), not a failure at
the first connection. A handshake that fails is a StoreUnavailable whose message says why in
one line (`handshake_failure`): an unknown CA, an expired certificate, a name that does not match.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl

from .._errors import InvalidArgument

#: The URL parameters this module reads.
TLS_PARAMS = frozenset({"tls", "ca", "cert", "key"})
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class TlsSettings:
    """TLS to a store: the CA bundle to trust (None: the system's), the client certificate
    and its key (None: none presented)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def context(self, display: str) -> ssl.SSLContext:
        """A client context that verifies the server's certificate and name; InvalidArgument
        naming the store when a file cannot be read or a key does not match."""
        try:
            context = ssl.create_default_context(cafile=self.ca)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgument(
                f"store {display}: cannot use ca={self.ca}: {_reason(exc)}"
            ) from None
        if self.cert is not None:
            try:
                context.load_cert_chain(self.cert, self.key)
            except (OSError, ssl.SSLError) as exc:
                what = f"cert={self.cert}" + (f" with key={self.key}" if self.key else "")
                raise InvalidArgument(
                    f"store {display}: cannot use {what}: {_reason(exc)}"
                ) from None
        return context


def tls_settings(query: Mapping[str, str], display: str) -> TlsSettings | None:
    """The TLS a URL's query asks for (None: plain). InvalidArgument for a `key` without a
    `cert`, an empty path or a `tls` that is not a yes or a no."""

    def bad(why: str) -> InvalidArgument:
        return InvalidArgument(f"bad store URL {display!r}: {why}")

    for name in ("ca", "cert", "key"):
        if name in query and not query[name].strip():
            raise bad(f"{name}= needs a file path")
    flag = query.get("tls", "").strip().lower()
    if flag and flag not in _TRUE | _FALSE:
        raise bad(f"tls must be 1 or 0, not {query['tls']!r}")
    ca, cert, key = query.get("ca"), query.get("cert"), query.get("key")
    if key is not None and cert is None:
        raise bad("key= is the key of a client certificate: give cert= too")
    if ca is None and cert is None and flag not in _TRUE:
        return None
    if flag in _FALSE:
        raise bad("tls=0 contradicts ca= or cert=")
    return TlsSettings(ca, cert, key)


def tls_only(query_text: str, display: str) -> TlsSettings | None:
    """`tls_settings` of a URL whose query takes the TLS parameters alone (etcd://, zk://):
    InvalidArgument for any other, which would otherwise go unheeded."""
    query = dict(parse_qsl(query_text, keep_blank_values=True))
    unknown = sorted(set(query) - TLS_PARAMS)
    if unknown:
        raise InvalidArgument(
            f"bad store URL {display!r}: unknown parameter {unknown[0]!r} "
            f"(only {', '.join(sorted(TLS_PARAMS))})"
        )
    return tls_settings(query, display)


def handshake_failure(exc: BaseException) -> str | None:
    """What a failed TLS handshake means, in a line (None: `exc` is no TLS failure). Looks
    through the causes a driver wraps it in."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            return f"TLS: the server's certificate was not accepted ({current.verify_message})"
        if isinstance(current, ssl.SSLError):
            return f"TLS: the handshake failed ({_reason(current)})"
        current = current.__cause__ or current.__context__
    # A driver that keeps only the text (the Cassandra driver: "... Last error: [SSL:
    # CERTIFICATE_VERIFY_FAILED] certificate verify failed: certificate has expired (_ssl.c:1006)")
    text = str(exc)
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
        why = _VERIFY_REASON.search(text)
        return "TLS: the server's certificate was not accepted" + (
            f" ({why.group(1)})" if why else ""
        )
    return None


_VERIFY_REASON = re.compile(r"certificate verify failed: ([^()\[\]]+?) \(_ssl")


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)  # set by the ssl module, not on a bare SSLError
    if isinstance(exc, ssl.SSLError) and reason:
        return str(reason).replace("_", " ").lower()
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
