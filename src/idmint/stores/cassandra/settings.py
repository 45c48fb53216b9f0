"""What a cassandra:// URL says (see the package's doc for its parameters): `Settings`, read by
`parse_url`, which names what is wrong."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

from ..._errors import InvalidArgument
from ...ids import is_digits
from .._urls import ENCODE_HINT, misplaced_at, scrub
from ..tls import TLS_PARAMS, TlsSettings, tls_settings

DEFAULT_PORT = 9042
DEFAULT_KEYSPACE = "idmint"
SERIALS = ("SERIAL", "LOCAL_SERIAL")
CONSISTENCIES = (
    "ONE",
    "TWO",
    "THREE",
    "QUORUM",
    "ALL",
    "LOCAL_QUORUM",
    "EACH_QUORUM",
    "LOCAL_ONE",
)
PROTOCOLS = (3, 4, 5)
_KEYSPACE = re.compile(r"[a-z][a-z0-9_]{0,47}")
_DC = re.compile(r"[A-Za-z0-9_.-]+")
_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Settings:
    """What a cassandra:// URL says."""

    hosts: tuple[str, ...]
    port: int
    keyspace: str
    serial: str
    consistency: str
    dc: str | None
    replication: dict[str, str]
    protocol: int
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    #: TLS to every node (`?ca=`, `?cert=&key=`, `?tls=1`: stores/tls.py); None: plain
    tls: TlsSettings | None = None

    def replication_cql(self) -> str:
        return "{" + ", ".join(f"'{k}': '{v}'" for k, v in self.replication.items()) + "}"


def parse_url(url: str, display: str) -> Settings:
    """The settings of a cassandra:// URL; InvalidArgument naming what is wrong."""

    def bad(reason: str) -> InvalidArgument:
        # urlsplit's reasons quote what it made of the URL: maybe pieces of a password
        return InvalidArgument(f"bad store URL {display!r}: {scrub(reason, url)}")

    if misplaced_at(url):
        raise bad(ENCODE_HINT)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise bad(str(exc)) from None
    if parts.fragment:
        raise bad("a cassandra:// URL has no #fragment")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        # urlsplit leaves them percent-encoded, as the URL must write "/ ? # @ :" in them
        username, password = unquote(user), unquote(secret) if colon else None
    if not hostlist:
        raise bad("it names no host (cassandra://host1,host2:port/keyspace)")
    hosts, ports = _hosts_and_ports(hostlist, bad)
    if len(ports) > 1:
        raise bad("every host must have the same port (the driver takes one)")
    port = ports.pop() if ports else DEFAULT_PORT
    keyspace = parts.path.strip("/") or DEFAULT_KEYSPACE
    if not _KEYSPACE.fullmatch(keyspace):
        raise bad(
            f"keyspace {keyspace!r}: lowercase letters, digits and _, starting with a letter, "
            "at most 48"
        )
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    serial, consistency, dc, protocol = _parameters(query, bad)
    return Settings(
        hosts=tuple(hosts),
        port=port,
        keyspace=keyspace,
        serial=serial,
        consistency=consistency,
        dc=dc,
        replication=_replication(query.get("replication", "1"), bad),
        protocol=int(protocol),
        username=username,
        password=password,
        tls=tls_settings(query, display),
    )


def _parameters(
    query: dict[str, str], bad: Callable[[str], InvalidArgument]
) -> tuple[str, str, str | None, str]:
    """The URL's serial and consistency levels, datacenter and protocol version, checked."""
    known = {"serial", "consistency", "dc", "replication", "protocol", *TLS_PARAMS}
    unknown = set(query) - known
    if unknown:
        raise bad(f"unknown parameter {sorted(unknown)[0]!r} (known: {', '.join(sorted(known))})")
    serial = query.get("serial", "SERIAL").upper()
    if serial not in SERIALS:
        raise bad(f"serial must be SERIAL or LOCAL_SERIAL, not {query['serial']!r}")
    default = "LOCAL_QUORUM" if serial == "LOCAL_SERIAL" else "QUORUM"
    consistency = query.get("consistency", default).upper()
    if consistency not in CONSISTENCIES:
        raise bad(
            f"consistency must be one of {', '.join(CONSISTENCIES)}, not {query['consistency']!r}"
        )
    dc = query.get("dc")
    if dc is not None and not _DC.fullmatch(dc):
        raise bad(f"dc {dc!r} is not a datacenter name")
    protocol = query.get("protocol", "3")
    if protocol not in {str(p) for p in PROTOCOLS}:
        raise bad(f"protocol must be 3, 4 or 5, not {protocol!r}")
    return serial, consistency, dc, protocol


def _hosts_and_ports(
    hostlist: str, bad: Callable[[str], InvalidArgument]
) -> tuple[list[str], set[int]]:
    hosts: list[str] = []
    ports: set[int] = set()
    for item in hostlist.split(","):
        host, port = item, ""
        if item.startswith("["):  # [IPv6]:port
            end = item.find("]")
            host, port = item[: end + 1], item[end + 2 :] if item[end + 1 : end + 2] else ""
        elif ":" in item:
            host, _, port = item.rpartition(":")
        if not _HOST.fullmatch(host):
            raise bad(f"{item!r} is not host[:port] (cassandra://host1,host2:port/keyspace)")
        if port or item.endswith(":"):
            if not is_digits(port) or not 0 < int(port) < 65536:
                raise bad(f"port {port!r} is not a number from 1 to 65535")
            ports.add(int(port))
        hosts.append(host.strip("[]"))
    return hosts, ports


def _replication(text: str, bad: Callable[[str], InvalidArgument]) -> dict[str, str]:
    """`3` -> SimpleStrategy with 3 replicas; `dc1:3,dc2:1` -> NetworkTopologyStrategy."""
    if is_digits(text) and int(text) > 0:
        return {"class": "SimpleStrategy", "replication_factor": str(int(text))}
    replication = {"class": "NetworkTopologyStrategy"}
    for item in text.split(","):
        dc, colon, count = item.partition(":")
        if not (colon and _DC.fullmatch(dc) and is_digits(count) and int(count) > 0):
            raise bad(
                f"replication {text!r}: a replica count (3), or datacenters with theirs "
                "(dc1:3,dc2:3)"
            )
        replication[dc] = str(int(count))
    return replication
