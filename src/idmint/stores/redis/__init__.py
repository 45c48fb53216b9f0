"""Worker-id leases and compare-and-set cells (hence segment keys, see over_cas/ranges.py) on Redis:
`redis://[[user]:password@]host[:port][/db][?prefix=STR]`, or on the primary Redis Sentinel
names: `redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/SERVICE[/db][?...]`
(the hosts are the Sentinels, port 26379 by default; SERVICE the name they monitor the primary
by; the user and password are the Redis servers', `sentinel_username` and `sentinel_password`
the Sentinels' own). Every new connection asks the Sentinels where the primary is, so the store
follows a failover; the guard (failover.py) fences it as on any replicated Redis.

TLS (stores/tls.py, one spelling for every engine): `?ca=PATH` (the CA that signed the server's
certificate), `?cert=PATH&key=PATH` (a client certificate, for `tls-auth-clients`), `?tls=1`
(the system's CAs); any of them turns TLS on, as `rediss://` does (with the system's CAs unless
`ca=` says otherwise). Behind Sentinels the same settings hold for the Sentinels and the
servers. The server's certificate and name are always verified. What idmint's ACL user needs
is docs/stores.md's "Redis: locked down" (acl.py: the rule, and what a refusal means).

Leases: per (namespace, worker id) two keys, both under the URL's prefix (default "idmint"):

    {prefix}:w:{namespace}:{id}   the live lease: the owner string, with a server-side TTL (PX),
                                  so expiry is judged by Redis's clock and nobody else's
    {prefix}:h:{namespace}:{id}   a hash with no TTL: `horizon` (outlives leases; only moves
                                  up, except that `release(issued_ms=)` may bring it down to
                                  what was really issued), `host` of the last holder, and
                                  `owner`, the last holder's owner string ("" once released)

Every multi-step operation is one Lua script, so it is atomic on the server. The scripts
build key names from their arguments (acquire does not know beforehand which id it will
take), which is fine on a single Redis or a replicated one, but not on Redis Cluster.

Cells: `{prefix}:c:{key}` and the index `{prefix}:cells` (see RedisCasStore). The store's
identity, `{prefix}:meta`, is one for both.

Durability is the server's: with `appendonly yes` and `appendfsync always` a recorded horizon
and a swapped cell survive a crash; with weaker settings a crash can lose the last horizon
raise (caught at the next renewal) or the last swaps (ids handed out again: see docs/stores.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from ..._errors import DriverMissing, InvalidArgument
from ...ids import is_digits
from .._urls import ENCODE_HINT, misplaced_at, scrub
from ..engine import Engine
from ..over_cas.ranges import CasRangeStore
from ..replication import (
    FAILOVER_GAP_PARAMETER,
    FEWER_REPLICAS,
    UNSAFE_REPLICATION,
    failover_gap,
)
from ..tls import TLS_PARAMS, TlsSettings, tls_settings
from .cas import RedisCasStore, RedisErrors
from .cas import weak_persistence as weak_persistence  # its public path, kept
from .leases import RedisLeaseStore
from .quorum import RedisQuorumNode

DEFAULT_PREFIX = "idmint"
DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
#: The Sentinels' own credentials (`requirepass`, or an ACL user, on the Sentinels).
SENTINEL_PARAMETERS = ("sentinel_username", "sentinel_password")
_SENTINEL_FORM = "redis+sentinel://host1:26379,host2:26379/SERVICE[/db]"
_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")


def _sentinels(
    parts: SplitResult, bad: Callable[[str], InvalidArgument]
) -> tuple[list[tuple[str, int]], str, str]:
    """A redis+sentinel:// URL's Sentinels (host, port), the service name and the database."""
    hostlist = parts.netloc.rpartition("@")[2]
    if not hostlist:
        raise bad(f"it names no Sentinel ({_SENTINEL_FORM})")
    sentinels = []
    for item in hostlist.split(","):
        host, port = item, ""
        if item.startswith("["):  # [IPv6]:port
            end = item.find("]")
            host, port = item[: end + 1], item[end + 2 :]
            if end < 0 or item[end + 1 : end + 2] not in ("", ":"):
                host = item  # not [IPv6] nor [IPv6]:port: refused below
        elif ":" in item:
            host, _, port = item.rpartition(":")
        if not _HOST.fullmatch(host):
            raise bad(f"{item!r} is not a Sentinel's host[:port] ({_SENTINEL_FORM})")
        if (port or item.endswith(":")) and not (is_digits(port) and 0 < int(port) < 65536):
            raise bad(f"port {port!r} is not a number from 1 to 65535")
        sentinels.append((host.strip("[]"), int(port) if port else DEFAULT_SENTINEL_PORT))
    path = [unquote(piece) for piece in parts.path.split("/")[1:]]
    if not path or not path[0]:
        raise bad(f"it names no Sentinel service, the primary's name ({_SENTINEL_FORM})")
    if len(path) > 2 or (len(path) == 2 and not path[1]):
        raise bad(f"the path must be /SERVICE or /SERVICE/db ({_SENTINEL_FORM})")
    service = path[0]
    if not service.isprintable() or any(c.isspace() for c in service):
        raise bad(f"the service name {service!r} holds a blank or a control character")
    return sentinels, service, path[1] if len(path) == 2 else "0"


def _parse(url: str, display: str) -> dict[str, Any]:
    """Connection arguments and the key prefix from a redis:// or rediss:// URL; or from a
    redis+sentinel:// or rediss+sentinel:// URL: `sentinels`, `service` and `sentinel` (the
    Sentinels' connection arguments) in place of `host` and `port`."""

    def bad(reason: str) -> InvalidArgument:
        # urlsplit's reasons quote what it made of the URL: maybe pieces of a password
        return InvalidArgument(f"bad store URL {display!r}: {scrub(reason, url)}")

    if misplaced_at(url):
        raise bad(ENCODE_HINT)
    scheme = url.partition("://")[0].lower()
    sentinel = scheme.endswith("+sentinel")
    try:
        parts = urlsplit(url)
        port = DEFAULT_SENTINEL_PORT if sentinel else parts.port or DEFAULT_PORT
    except ValueError as exc:
        raise bad(str(exc)) from None
    endpoint: dict[str, Any]
    if sentinel:
        sentinels, service, db = _sentinels(parts, bad)
        endpoint = {"sentinels": sentinels, "service": service}
    elif not parts.hostname:
        raise bad("it names no host")
    else:
        endpoint = {"host": parts.hostname, "port": port}
        db = parts.path.strip("/") or "0"
    if not is_digits(db):
        raise bad(f"the database must be a number, not {db!r}")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    known: tuple[str, ...] = (
        "prefix",
        "unsafe",
        UNSAFE_REPLICATION,
        FEWER_REPLICAS,
        FAILOVER_GAP_PARAMETER,
    )
    known += SENTINEL_PARAMETERS if sentinel else ()
    known += tuple(sorted(TLS_PARAMS))
    unknown = set(query) - set(known)
    if unknown:
        raise bad(f"unknown parameter {sorted(unknown)[0]!r} (only {', '.join(known)})")
    flags = {}
    for flag in ("unsafe", UNSAFE_REPLICATION, FEWER_REPLICAS):
        value = query.get(flag, "0").lower()
        if value not in ("0", "1", "true", "false", "yes", "no"):
            raise bad(f"{flag} must be 1 or 0, not {value!r}")
        flags[flag] = value in ("1", "true", "yes")
    prefix = query.get("prefix", DEFAULT_PREFIX)
    if not prefix:
        raise bad("the prefix is empty")
    tls = tls_settings(query, display)
    if tls is None and scheme in ("rediss", "rediss+sentinel"):
        tls = TlsSettings()  # rediss:// as it always was: the system's CAs
    ssl = _ssl_arguments(tls, display)
    if sentinel:
        endpoint["sentinel"] = {
            "username": query.get("sentinel_username") or None,
            "password": query.get("sentinel_password"),  # parse_qsl decoded both
            **ssl,
        }
    return {
        **endpoint,
        "db": int(db),
        # urlsplit leaves them percent-encoded, as the URL must write "/ ? # @ :" in them
        "username": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password is not None else None,
        **ssl,
        "prefix": prefix,
        "unsafe": flags["unsafe"],
        UNSAFE_REPLICATION: flags[UNSAFE_REPLICATION],
        FEWER_REPLICAS: flags[FEWER_REPLICAS],
        "gap": failover_gap(query.get(FAILOVER_GAP_PARAMETER), display),
    }


def _ssl_arguments(tls: TlsSettings | None, display: str) -> dict[str, Any]:
    """redis-py's TLS arguments for `tls` (None: plain). The files are read here, once, so a
    wrong path or a key that does not match its certificate fails when the URL is opened
    (InvalidArgument naming the store), not at the first connection."""
    if tls is None:
        return {"ssl": False}
    tls.context(display)  # only to check the files: redis-py builds its own from the paths
    return {
        "ssl": True,
        "ssl_ca_certs": tls.ca,  # None: the system's
        "ssl_certfile": tls.cert,
        "ssl_keyfile": tls.key,
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": True,
    }


def _driver() -> Any:
    """The redis module, or DriverMissing naming the extra to install."""
    try:
        import redis
    except ImportError:
        raise DriverMissing(
            "redis:// stores need the redis driver: pip install 'idmint[redis]'"
        ) from None
    return redis


def _client(redis: Any, args: dict[str, Any], timeout: float, *, retries: int) -> Any:
    """A redis.Redis (its own connection pool) on the parsed URL's server, or on the primary
    its Sentinels name; no I/O."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    def retry(retries: int) -> Any:
        # Retries are immediate and only on a broken connection, never on a timeout:
        # `timeout` bounds each operation.
        return Retry(NoBackoff(), retries, supported_errors=(redis.exceptions.ConnectionError,))

    settings = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if "sentinels" not in args:
        return redis.Redis(**args, **settings, decode_responses=True, retry=retry(retries))
    return _sentinel_client(redis, args, settings, retry(retries), retry(1))


def _sentinel_client(
    redis: Any, args: dict[str, Any], settings: dict[str, Any], retry: Any, sentinel_retry: Any
) -> Any:
    """A redis.Redis on the primary the Sentinels name: each new connection asks them (the
    first that answers, and names a primary it does not think down) and connects there;
    one that finds a replica there (READONLY: a demoted primary) is dropped. Closing it
    closes the connections to the Sentinels too."""
    args = dict(args)
    sentinels, service = args.pop("sentinels"), args.pop("service")
    # One immediate retry on a broken connection to a Sentinel (a pooled one it dropped);
    # one that is down is skipped for the next. Never the driver's default retries, which
    # back off for seconds.
    sentinel_args = {**args.pop("sentinel"), **settings, "retry": sentinel_retry}
    manager = redis.sentinel.Sentinel(sentinels, sentinel_kwargs=sentinel_args)
    _keep_sentinel_failures(redis, manager)
    client = manager.master_for(service, **args, **settings, decode_responses=True, retry=retry)
    close = client.close

    def close_all() -> None:
        try:
            close()
        finally:
            for each in manager.sentinels:  # Sentinel.close() is newer than redis-py 5
                each.close()

    client.close = close_all
    return client


def _keep_sentinel_failures(redis: Any, manager: Any) -> None:
    """When no Sentinel names a primary, redis-py's error lists each Sentinel's client object
    and its error's class only (a TLS failure, a refused connection and a wrong password all
    read "ConnectionError"), over lines. Instead: one line, and the last Sentinel's error as
    its cause, which the store's messages read (a TLS failure says why)."""
    failures: list[BaseException] = []

    def recording(ask: Callable[[], Any]) -> Callable[[], Any]:
        def masters() -> Any:
            try:
                return ask()
            except BaseException as exc:
                failures.append(exc)
                raise

        return masters

    for sentinel in manager.sentinels:
        sentinel.sentinel_masters = recording(sentinel.sentinel_masters)
    discover = manager.discover_master

    def discover_master(service: str) -> Any:
        failures.clear()
        try:
            return discover(service)
        except redis.sentinel.MasterNotFoundError:
            count = len(manager.sentinels)
            if not failures:
                raise  # they answered, and none named a primary it thinks up: said as is
            last = " ".join(str(failures[-1]).split()) or type(failures[-1]).__name__
            raise redis.sentinel.MasterNotFoundError(
                f"no primary for {service!r}: {len(failures)} of {count} Sentinels did not "
                f"answer (the last: {last})"
            ) from failures[-1]

    manager.discover_master = discover_master


def open_redis_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The redis engine of a URL: segment keys (over CAS), worker leases and compare-and-set
    cells. The URL is checked and the driver imported here; no I/O until the first call."""
    args = _parse(url, display)
    redis = _driver()
    prefix = args.pop("prefix")
    unsafe = bool(args.pop("unsafe"))
    # Replicas each write does not wait for, writes with fewer replicas than the prefix has
    # waited for, and the fence's gap (see failover.py).
    replication = {
        "unsafe_replication": args.pop(UNSAFE_REPLICATION),
        "fewer_replicas": args.pop(FEWER_REPLICAS),
        "gap": args.pop("gap"),
    }
    # Connection errors and timeouts above all, but also a server that refuses to write
    # (READONLY replica, OOM, MISCONF): all are the store failing, not the caller.
    errors = RedisErrors(
        any=redis.exceptions.RedisError,
        broken=redis.exceptions.ConnectionError,
        timeout=redis.exceptions.TimeoutError,
    )

    def leases(_: Engine) -> RedisLeaseStore:
        # One immediate retry on a broken connection (a pooled one the server dropped, say).
        client = _client(redis, args, timeout, retries=1)
        return RedisLeaseStore(
            client, prefix, display, (errors.any,), timeout=timeout, **replication
        )

    def cas(_: Engine) -> RedisCasStore:
        # No retry inside the driver: a swap re-sent after its reply was lost would find its
        # own write and answer False for a swap that happened (see RedisCasStore._call).
        client = _client(redis, args, timeout, retries=0)
        return RedisCasStore(
            client, prefix, display, errors, timeout=timeout, unsafe=unsafe, **replication
        )

    return Engine(
        "redis",
        display,
        {
            "ranges": lambda engine: CasRangeStore(engine.cas()),
            "leases": leases,
            "cas": cas,
            "quorum": lambda engine: RedisQuorumNode(cast(RedisCasStore, engine.cas())),
        },
    )
