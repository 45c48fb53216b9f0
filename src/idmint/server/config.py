"""One ServerConfig, read from flags, IDMINT_* environment variables and an idmint.toml file.

Precedence: command-line flag, then environment, then the file's [server] table, then the
default. `idmint serve` writes the resolved config back into the environment, which is how
granian's worker processes (each builds its own app) receive it.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from .._errors import InvalidArgument, did_you_mean
from ..ids import check_key_name
from ..layout import layout_named
from ..stores import DEFAULT_STORE_URL, DEFAULT_TIMEOUT
from ..strategies.datacenter_cells import check_dc_name
from ..strategies.quorum_nodes import _NEXT_URL, split_nodes
from ..strategies.refills import DEFAULT_THREADS, check_threads

ENV_PREFIX = "IDMINT_"
#: IDMINT_<NAME>_FILE: the setting read from a file (setting_from_file).
FILE_SUFFIX = "_FILE"
#: Keys with series of their own at most: each is 14 series in every worker's metrics files,
#: kept for the server's life, and about 0.5 ms of every scrape per worker (prometheus-client's
#: multiprocess collection: 3,000 keys took 1.4 s).
MAX_METRICS_KEYS = 1000
#: What --http takes: HTTP/1.1, 1.1 and 2, or 2 only.
HTTP_VERSIONS = ("auto", "1", "2")
#: What --log-format takes: text for people, one JSON object a line for log collectors (run.py).
LOG_FORMATS = ("text", "json")
#: The key of a field's metadata that holds its Flag.
FLAG = "flag"

T = TypeVar("T")


def env_variable(name: str) -> str:
    """The environment variable of setting `name`: IDMINT_<NAME>."""
    return ENV_PREFIX + name.upper()


@dataclass(frozen=True)
class Flag:
    """A setting's option of `idmint serve` (the CLI builds the option from this, so a setting's
    flag, help and variable are written here only). Its type follows the field's: a bool is a
    switch, an int an integer, a float a finite number, a str TEXT or one of `choices`."""

    #: The help; "{default}" stands for the field's default, "{env}" for its variable.
    help: str
    #: The option's declaration; empty: --<name with dashes>.
    opts: str = ""
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    #: Whether the option reads IDMINT_<NAME> itself. `--unsafe-nodes` does not (nor
    #: `--replicated-nodes`): the same option of `idmint next` must be typed, never switched on
    #: by the environment (serve still reads IDMINT_UNSAFE_NODES, as every setting, through
    #: ServerConfig.env_values).
    env: bool = True

    def describe(self, name: str, default: object) -> str:
        """The help of setting `name`, its default and variable filled in."""
        shown: object = default
        if isinstance(default, bool):
            shown = "on" if default else "off"
        elif isinstance(default, float):
            shown = f"{default:g}"  # 10, not 10.0
        return self.help.format(default=shown, env=env_variable(name))


def flagged(default: T, help: str, **flag: Any) -> T:
    """A field with this default that is also an option of `idmint serve`: `help` and `flag`
    are its Flag's."""
    result: T = field(default=default, metadata={FLAG: Flag(help, **flag)})
    return result


@dataclass(frozen=True)
class ServerConfig:
    store: str = DEFAULT_STORE_URL
    host: str = flagged("127.0.0.1", "Address to listen on [default: {default}].")
    port: int = flagged(8080, "Port [default: {default}].")
    workers: int = flagged(1, "Worker processes [default: {default}].")
    token: str = flagged(
        "",
        "Bearer token for key admin over HTTP; without one, admin over HTTP is refused.",
    )
    client_token: str = flagged(
        "",
        "Bearer token the routes that hand out ids need (the admin token works there too); "
        "without one, they are open.",
    )
    admin_loopback: bool = flagged(
        False,
        "Allow key admin without the token from loopback clients. Not behind a reverse "
        "proxy on the same host: there every client is loopback.",
    )
    #: Per-key tokens (tokens.py); the two tokens above join them as implicit entries.
    tokens: str = flagged(
        "",
        "A TOML file of tokens, each limited to some keys and to taking ids and/or key "
        "admin; reloaded on SIGHUP. The id routes then all need a token (env {env}).",
        metavar="FILE",
    )
    #: TLS served by granian itself, for a site with no proxy in front.
    tls_cert: str = flagged(
        "", "Serve HTTPS: the certificate chain (PEM), with --tls-key (env {env}).", metavar="FILE"
    )
    tls_key: str = flagged(
        "", "The private key (PEM, not encrypted) of --tls-cert (env {env}).", metavar="FILE"
    )
    timeout: float = DEFAULT_TIMEOUT
    #: How long a request waits for a range when nothing is buffered (seconds).
    wait: float = 1.0
    max_step: int = 1_000_000
    preload_at: float = 0.1
    #: In-flight requests finish, unused ids go back to the store if it answers in time.
    shutdown_timeout: float = flagged(
        10.0, "Seconds from SIGTERM to exit, whatever the store does [default: {default}]."
    )
    #: SO_REUSEPORT.
    reuse_port: bool = flagged(
        False,
        "Share the port with other processes; without it, a port another process listens "
        "on is refused.",
    )
    #: "1" (1.1), "auto" (1.1 and 2) or "2". HTTP/1.1 is the default because only there does
    #: granian time out a connection that sends nothing (header_timeout); in auto mode it waits
    #: for the first bytes without a bound.
    http: str = flagged(
        "1",
        "HTTP versions to speak [default: {default}; auto and 2 do not time out silent "
        "connections].",
        choices=HTTP_VERSIONS,
    )
    #: granian's backpressure; more wait in the backlog.
    max_connections: int = flagged(
        4096,
        "Connections each worker holds at once, idle ones included [default: {default}].",
    )
    backlog: int = flagged(
        1024,
        "Connections the kernel queues before a worker takes them [default: {default}].",
    )
    #: Including the wait for the first byte and, on HTTP/1.1, a kept-alive connection's idle
    #: time between requests.
    header_timeout: float = flagged(
        10.0,
        "Seconds a connection has to send a request's headers; idle kept-alive connections "
        "close then too [default: {default}].",
    )
    keep_alive: bool = flagged(
        True, "HTTP/1.1 keep-alive [default: {default}].", opts="--keep-alive/--no-keep-alive"
    )
    refill_threads: int = flagged(
        DEFAULT_THREADS,
        "Threads loading every key's next range, soonest dry first [default: {default}].",
    )
    #: As Leaf loads every tag at start.
    warm_keys: int = flagged(
        1000,
        "Keys that take a range at start; the rest start on first use [default: {default}].",
    )
    metrics_keys: int = flagged(
        100,
        "Keys with series of their own in /metrics and entries in /v1/stats: each worker's "
        "busiest; every key counts in the aggregates [default: {default}; 0: aggregates "
        "only].",
    )
    id_budget_days: float = flagged(
        30.0,
        "Each key's ids go out over HTTP no faster than its whole id space in this many "
        "days, per worker (a 32-bit key: 829 ids/s) [default: {default}; 0: no budget].",
    )
    log_format: str = flagged(
        "text",
        "Log lines for people, or one JSON object a line for log collectors [default: {default}].",
        choices=LOG_FORMATS,
    )
    #: The snowflake routes' layout and worker-id namespace.
    snowflake_layout: str = "twitter"
    snowflake_namespace: str = "default"
    #: Empty: segment keys. The CLI's datacenter commands take the same options.
    dc: str = flagged(
        "",
        "The datacenter this runs in, for datacenter keys (env {env}).",
        metavar="NAME",
    )
    dc_store: str = flagged(
        "",
        "The datacenter's own store, for datacenter keys (env {env}) [default on "
        "cassandra://: the same cluster at LOCAL_SERIAL].",
        metavar="URL",
    )
    #: Of /v1/quorum/{key}/ids; empty: no quorum route. `idmint next` takes the same options.
    quorum: str = flagged(
        "",
        "Node URLs of a quorum key, joined by commas (env {env}): redis://, sqlite://, "
        "postgresql://, mysql://, etcd://, zk:// servers that share nothing, an odd "
        "number, 3 or more.",
        metavar="URLS",
    )
    unsafe_nodes: bool = flagged(
        False,
        "Use quorum nodes that do not fsync every write (ids may repeat after a crash).",
        env=False,
    )
    replicated_nodes: bool = flagged(
        False,
        "Use quorum nodes that have replicas (ids may repeat after a node's failover).",
        env=False,
    )

    def __post_init__(self) -> None:
        for name, value in vars(self).items():  # NaN passes every range check below
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidArgument(
                    f"{name} ({env_variable(name)}) must be a finite number, not {value}"
                )
        self._in_range("timeout", 0.1, 600, " seconds")
        if not 0 < self.wait <= 600:
            raise InvalidArgument(
                f"wait must be above 0 and at most 600 seconds, not {self.wait:g}"
            )
        for name in ("token", "client_token"):
            _check_token(name, getattr(self, name))
        for name in PATH_SETTINGS:  # never echoed: it may be a secret put in the wrong place
            if "\n" in getattr(self, name):
                raise InvalidArgument(f"{name} ({env_variable(name)}) must be a file's path")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("tls_cert and tls_key go together: give both, or neither")
        layout_named(self.snowflake_layout)  # raises InvalidArgument naming the presets
        check_key_name(self.snowflake_namespace)
        if self.dc:
            check_dc_name(self.dc)
        elif self.dc_store:
            raise InvalidArgument("dc_store is a datacenter's store: give the datacenter (dc)")
        if self.quorum:
            split_nodes(self.quorum)
        check_threads(self.refill_threads)
        self._in_range("warm_keys", 0, 1_000_000)
        if self.log_format not in LOG_FORMATS:
            raise InvalidArgument(f"log_format must be text or json, not {self.log_format!r}")
        if self.http not in HTTP_VERSIONS:
            raise InvalidArgument(f"http must be auto, 1 or 2, not {self.http!r}")
        self._in_range("port", 1, 65535)
        self._in_range("workers", 1, 256)
        self._in_range("max_connections", 1, 1_000_000)
        self._in_range("backlog", 128, 65535)
        self._in_range("shutdown_timeout", 1, 3600, " seconds")
        self._in_range("metrics_keys", 0, MAX_METRICS_KEYS)
        if not 0 <= self.id_budget_days <= 36_500:  # NaN fails this too
            raise InvalidArgument(
                f"id_budget_days must be from 0 (no budget) to 36500, not {self.id_budget_days}"
            )
        self._in_range("header_timeout", 0.1, 60, " seconds")

    def _in_range(self, name: str, low: float, high: float, unit: str = "") -> None:
        """Refuse setting `name` outside [low, high]; a number of seconds (`unit`) shows as
        10, not 10.0."""
        value = getattr(self, name)
        if not low <= value <= high:
            shown = f"{value:g}" if unit else value
            raise InvalidArgument(f"{name} must be from {low} to {high}{unit}, not {shown}")

    def to_env(self) -> dict[str, str]:
        return {env_variable(k): str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> ServerConfig:
        """Build from loosely typed values (env strings, TOML), converting each field."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in values or values[f.name] is None:
                continue
            kind = type(getattr(cls, f.name))
            try:
                kwargs[f.name] = _flag(values[f.name]) if kind is bool else kind(values[f.name])
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(f"bad value for {f.name}: {values[f.name]!r}") from exc
        return cls(**kwargs)

    @classmethod
    def env_values(cls) -> dict[str, str]:
        """The settings IDMINT_* variables give, by field name: IDMINT_TOKEN=..., or
        IDMINT_TOKEN_FILE=/path for a secret kept in a file (see setting_from_file)."""
        values = {
            k[len(ENV_PREFIX) :].lower(): v
            for k, v in os.environ.items()
            if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX) :].lower() in SETTINGS
        }
        for name in SETTINGS:
            from_file = setting_from_file(name)
            if from_file is not None:
                values[name] = from_file
        return values

    @classmethod
    def unknown_env(cls) -> list[str]:
        """IDMINT_* variables that are no setting (a typo is otherwise ignored in silence),
        each with a close setting's variable if there is one."""
        names = SETTINGS | {"config"}
        known = names | {name + FILE_SUFFIX.lower() for name in SETTINGS}
        unknown = sorted(
            k
            for k in os.environ
            if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX) :].lower() not in known
        )
        # Compared without the prefix, which every one shares.
        return [
            variable
            + did_you_mean(variable[len(ENV_PREFIX) :].lower(), sorted(names), env_variable)
            for variable in unknown
        ]

    @classmethod
    def from_env(cls) -> ServerConfig:
        return cls.from_mapping(cls.env_values())


#: The settings that name a file: relative to the config file's directory when given there.
PATH_SETTINGS = ("tokens", "tls_cert", "tls_key")
#: Every setting's name.
SETTINGS = frozenset(f.name for f in fields(ServerConfig))
#: The settings that are options of `idmint serve`, in the order its help lists them: name ->
#: (its Flag, its default).
FLAGS: dict[str, tuple[Flag, Any]] = {
    f.name: (f.metadata[FLAG], f.default) for f in fields(ServerConfig) if FLAG in f.metadata
}


def setting_from_file(name: str) -> str | None:
    """The setting `name` read from the file IDMINT_<NAME>_FILE names, or None without that
    variable. For secrets (a token, a store URL with its password): a command line shows in
    `ps` to every user, while a file can be readable by idmint's user only (a systemd
    credential, a Kubernetes secret volume). One trailing newline is dropped, as editors
    and `echo` add one. Both IDMINT_<NAME> (not empty) and IDMINT_<NAME>_FILE set is refused,
    as which one was meant cannot be known."""
    variable = env_variable(name)
    path = os.environ.get(variable + FILE_SUFFIX)
    if path is None:
        return None
    if os.environ.get(variable):  # an empty IDMINT_<NAME> is the default, not a value
        raise InvalidArgument(f"{variable} and {variable}{FILE_SUFFIX} are both set: keep one")
    if name in PATH_SETTINGS:
        # Its value is a path already: read as a setting, a private key or the tokens would
        # become the "path", and then be shown in the error that it is no file.
        raise InvalidArgument(
            f"{variable}{FILE_SUFFIX} is not read: {variable} is a file's path already "
            f"(set {variable}=/path)"
        )
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise InvalidArgument(f"cannot read {variable}{FILE_SUFFIX}={path}: {reason}") from exc
    return text.removesuffix("\n").removesuffix("\r")


def _flag(value: Any) -> bool:
    """A boolean from TOML (true/false) or the environment ("1", "true", "yes", "on", ...):
    bool("false") would be True."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(value)


def _check_token(name: str, token: str) -> None:
    # A bearer token travels in a header, and granian drops a header whose value is not
    # ASCII: a token with other characters could never be presented.
    if token and not (token.isascii() and token.isprintable() and token == token.strip()):
        raise InvalidArgument(
            f"{name} must be printable ASCII without leading or trailing spaces "
            "(clients send it in an HTTP header)"
        )


def read_config_file(path: Path) -> dict[str, Any]:
    """The [server] table of an idmint.toml (top-level keys are accepted too), a relative
    SQLite path in its store URLs (store, dc_store, quorum) made absolute against the file's
    own directory."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise InvalidArgument(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"bad config file {path}: {exc}") from exc
    table = data.get("server", data)
    if not isinstance(table, dict):
        raise InvalidArgument(f"bad config file {path}: [server] must be a table")
    unknown = sorted(set(table) - SETTINGS)
    if unknown:
        hints = [f"{name}{did_you_mean(name, SETTINGS)}" for name in unknown]
        raise InvalidArgument(f"bad config file {path}: unknown settings {', '.join(hints)}")
    # Resolved against the working directory, `cd /opt/idmint && idmint --config
    # /etc/idmint/idmint.toml keys add` reached another store than the server's (whose ids
    # then repeated): a path in a file means the same wherever a command runs.
    values = dict(table)
    for name in ("store", "dc_store", "quorum"):
        if isinstance(values.get(name), str) and "sqlite:///" in values[name]:
            urls = _NEXT_URL.split(values[name])
            values[name] = ",".join(_next_to(url, path) for url in urls)
    for name in PATH_SETTINGS:  # the same for the files a setting names
        if isinstance(values.get(name), str) and values[name]:
            values[name] = str(path.absolute().parent / values[name])
    return values


def _next_to(url: str, config_file: Path) -> str:
    """`url`, a relative sqlite:/// path (not :memory:) made absolute against the directory
    of `config_file`."""
    prefix = "sqlite:///"
    url = url.strip()
    file = url.removeprefix(prefix)
    if file == url or file in ("", ":memory:") or file.startswith("/"):
        return url
    return prefix + str(config_file.absolute().parent / file)
