"""Throw-away three-member etcd clusters and ZooKeeper ensembles for fault-schedule tests.

Both run from the binaries the single servers use (server_etcd.ETCD; server_zookeeper's
classpath, JAVA and MAIN), every member in its own directory under one temporary directory
(data, ``server.log``, ZooKeeper's ``zoo.cfg``), on loopback only::

    with EtcdCluster() as cluster:                # or ZooKeeperEnsemble()
        url = cluster.store_url("t1")             # etcd://127.0.0.1:P1,127.0.0.1:P2,.../t1
        leader = cluster.leader()
        leader.kill()                             # SIGKILL, data kept
        leader.start()                            # rejoins with its data, same ports
        cluster.members[0].pause()                # SIGSTOP: hung, sockets open
        cluster.members[0].resume()

``addresses=("127.0.0.2", "127.0.0.3", "127.0.0.4")`` (see ``loopback_addresses``) gives each
member its own loopback address, for its client and its peer ports alike, so that a test can
drop the traffic *to* one member by address. Linux gives every loopback connection the source
address 127.0.0.1 whatever its destination, so a rule on a source address matches nothing, and
a member's own outgoing connections (to its peers' addresses) are not cut by a rule on its
address: a ``-d 127.0.0.x -j DROP`` is a one-way partition, not a full one. For a full one,
``cgroups=True`` starts every member in a cgroup (v2) of its own, which tells its packets
apart, and ``member.isolate()`` cuts it from its peers both ways, its clients left alone
(harness.Partition.isolate_member)::

    with EtcdCluster(addresses=loopback_addresses(3), cgroups=True) as cluster:
        cut = cluster.members[0].isolate()        # a minority member: no quorum, clients in
        cut.heal()

Every member is its own process group (pause/resume signal the group), watched by servers.py's
watchdog (killed if the test process dies without running atexit), and an atexit hook closes
a cluster that a test forgot. Every wait has a bound; a start that fails raises
ServerStartError with the tail of the members' logs.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import http.client
import ipaddress
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Generic, Self, TypeVar

from kazoo.client import KazooClient
from server_zookeeper import JAVA, MAIN, find_classpath

from harness import Partition
from server_cassandra import cgroup_dir
from server_etcd import ETCD
from servers import (
    LOOPBACK,
    Pausable,
    ServerStartError,
    _log_tail,
    _Watchdog,
    free_port,
    wait_until,
)

__all__ = [
    "EtcdCluster",
    "EtcdMember",
    "ZooKeeperEnsemble",
    "ZooKeeperMember",
    "loopback_addresses",
]

_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,100}")
_PORT_TAKEN = re.compile(r"address already in use", re.IGNORECASE)
_PROBE_TIMEOUT = 1.0  # one status / health / four-letter-word request


def loopback_addresses(size: int = 3, first: int = 2) -> tuple[str, ...]:
    """``size`` loopback addresses 127.0.0.FIRST, 127.0.0.FIRST+1, ...: one per member."""
    return tuple(f"127.0.0.{first + i}" for i in range(size))


def _check_name(name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"bad store name {name!r}: letters, digits, '_' and '-' only")
    return name


def _http_json(address: str, port: int, method: str, path: str, body: object = None) -> Any:
    """One request to a member's HTTP port; the JSON answer (OSError, ValueError on failure)."""
    conn = http.client.HTTPConnection(address, port, timeout=_PROBE_TIMEOUT)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        text = response.read()
        if response.status != 200:
            raise OSError(f"{method} {path}: HTTP {response.status} {text[:200]!r}")
        return json.loads(text)
    except http.client.HTTPException as exc:
        raise OSError(f"{method} {path}: {type(exc).__name__} {exc}") from None
    finally:
        conn.close()


def _four_letter_word(address: str, port: int, word: str) -> str:
    """ZooKeeper's answer to a four-letter word (OSError on failure)."""
    with socket.create_connection((address, port), timeout=_PROBE_TIMEOUT) as sock:
        sock.sendall(word.encode())
        chunks: list[bytes] = []
        while chunk := sock.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


ClusterT = TypeVar("ClusterT", bound="_Cluster[Any]")


class _Member(Pausable, Generic[ClusterT]):
    """One member's process: kill/stop/start, pause/resume, its ports and log."""

    kind: ClassVar[str] = "member"

    def __init__(self, cluster: ClusterT, index: int, address: str) -> None:
        self.cluster = cluster
        self.index = index
        self.id = index + 1  # ZooKeeper's myid; etcd's --name is "m{id}"
        self.name = f"m{self.id}"
        self.address = address
        self.dir = cluster.base_dir / self.name
        self.dir.mkdir()
        self.log_path = self.dir / "server.log"
        self.paused = False
        #: its own cgroup (v2 path), set by a cluster made with cgroups=True: see isolate()
        self.cgroup: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog: _Watchdog | None = None
        self._argv: list[str] = []
        self._log_offset = 0
        self.pick_ports()

    # ---- hooks ----------------------------------------------------------

    def pick_ports(self) -> None:
        self.port = free_port()

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str] | None:
        return None

    @property
    def peer_ports(self) -> tuple[int, ...]:
        """The ports it listens on for its peers (on its address)."""
        raise NotImplementedError

    def serving(self) -> bool:
        """One probe: the member is up and part of a cluster that has a leader."""
        raise NotImplementedError

    # ---- lifecycle -------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``address:port`` of the client port."""
        return f"{self.address}:{self.port}"

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def is_running(self) -> bool:
        return self.pid is not None

    def start(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """(Re)start with the same ports and data. With ``wait``, return once the member
        serves (it has rejoined a cluster with a leader: this needs a quorum of running
        members), within ``timeout`` (the cluster's startup_timeout); else right away."""
        if self.is_running:
            return
        self.spawn()
        if wait:
            self.wait_serving(self.cluster.startup_timeout if timeout is None else timeout)

    def spawn(self) -> None:
        if self._proc is not None:
            self.kill()
        self._argv = self._command()
        if self.cgroup is not None:  # its packets can be told apart (isolate())
            procs = cgroup_dir(self.cgroup) / "cgroup.procs"
            self._argv = ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *self._argv]
        with self.log_path.open("ab") as log:
            self._log_offset = log.tell()
            proc = subprocess.Popen(
                self._argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                env=self._env(),
                start_new_session=True,
            )
        self._proc = proc
        self.paused = False
        try:
            self._watchdog = _Watchdog(proc.pid, self.dir)
        except BaseException:
            self.kill()
            raise

    def wait_serving(self, timeout: float) -> None:
        """Wait until `serving()`; ServerStartError (member killed) if not within timeout."""
        try:
            wait_until(self._serving_or_exited, timeout, f"{self}", interval=0.1)
        except (TimeoutError, ServerStartError) as exc:
            message = self.failure(exc)
            self.kill()
            raise ServerStartError(message) from None

    def _serving_or_exited(self) -> bool:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            code = None if proc is None else proc.returncode
            raise ServerStartError(f"{self} exited (code {code})")
        return self.serving()

    def failure(self, why: object, lines: int = 40) -> str:
        tail = _log_tail(self.log_path, self._log_offset, lines)
        return f"{self}: {why}\ncommand: {' '.join(self._argv)}\n--- {self.log_path} ---\n{tail}"

    def port_was_taken(self) -> bool:
        return bool(_PORT_TAKEN.search(_log_tail(self.log_path, self._log_offset, 400)))

    def kill(self) -> None:
        """SIGKILL the member's process group (a crash); the data stays for start()."""
        self._end(signal.SIGKILL, 20.0)

    def stop(self) -> None:
        """SIGTERM (a clean shutdown), SIGKILL if it has not exited 20 s later."""
        self._end(signal.SIGTERM, 20.0)

    def _end(self, sig: signal.Signals, timeout: float) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)  # a paused member cannot act on SIGTERM
                    os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        self.paused = False
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.disarm()

    def isolate(self, partition: Partition | None = None) -> Partition:
        """Cut it off from its peers, both ways, while clients still reach it (a member of a
        minority keeps its clients and has no quorum); the Partition (``partition``, or a
        new one) whose heal() ends the cut. Needs a cluster made with cgroups=True."""
        if self.cgroup is None:
            raise ValueError(f"{self}: isolate() needs a cluster made with cgroups=True")
        others = [p for m in self.cluster.members if m is not self for p in m.peer_ports]
        cut = partition if partition is not None else Partition()
        # a connmark of its own (its cluster's, random, and its index): clusters of runs at
        # once, and members cut at once, mark their connections apart
        mark = self.cluster.mark + self.index
        cut.isolate_member(self.cgroup, self.address, self.peer_ports, others, mark)
        return cut

    def pause(self) -> None:
        """SIGSTOP: a hung member whose sockets stay open."""
        if self.is_running:
            self.paused = True
            super().pause()

    def resume(self) -> None:
        self.paused = False
        super().resume()

    def __repr__(self) -> str:
        state = "paused" if self.paused else "running" if self.is_running else "down"
        return f"<{self.kind} {self.name} {self.endpoint} {state}>"


MemberT = TypeVar("MemberT", bound=_Member[Any])


class _Cluster(Generic[MemberT]):
    """Members started together; leader(), store_url(), close()."""

    kind: ClassVar[str] = "cluster"
    scheme: ClassVar[str] = ""

    def __init__(
        self,
        size: int,
        addresses: Sequence[str] | None,
        startup_timeout: float,
        cgroups: bool = False,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, not {size}")
        addresses = tuple(addresses) if addresses is not None else (LOOPBACK,) * size
        if len(addresses) != size:
            raise ValueError(f"{size} members but {len(addresses)} addresses")
        for address in addresses:
            if not ipaddress.ip_address(address).is_loopback:
                raise ValueError(f"{address} is not a loopback address")
        self.startup_timeout = startup_timeout
        self.base_dir = Path(tempfile.mkdtemp(prefix=f"idmint-{self.scheme}-cluster-"))
        self.formed = False  # the first start() succeeded: restarts join an existing cluster
        self.members: list[MemberT] = [
            self._member(i, address) for i, address in enumerate(addresses)
        ]
        self._closed = False
        atexit.register(self.close)
        self.mark = random.randrange(1, 2**24) << 4  # see _Member.isolate
        if cgroups:
            for member in self.members:
                member.cgroup = f"idmint-test-{self.base_dir.name}-{member.name}"
                cgroup_dir(member.cgroup).mkdir()

    def _member(self, index: int, address: str) -> MemberT:
        raise NotImplementedError

    def _write_check(self) -> bool:
        """One attempt at a write through the cluster."""
        raise NotImplementedError

    def _leader_probe(self, member: MemberT) -> int | None:
        """The term in which `member` says it leads, or None (not leading, no answer)."""
        raise NotImplementedError

    def start(self) -> None:
        """Start every member and return once all serve, there is a leader and a write has
        gone through. Before the first success, a port lost to another process (a race
        free_port cannot rule out) is retried twice with fresh ports."""
        if self.formed:
            for member in self.members:
                member.start(wait=False)
            self.wait_ready()
            return
        for attempt in range(1, 4):
            try:
                self._start_all()
                self.formed = True
                return
            except ServerStartError:
                taken = any(m.port_was_taken() for m in self.members)
                if attempt == 3 or not taken:
                    raise
                for member in self.members:
                    shutil.rmtree(member.dir, ignore_errors=True)
                    member.dir.mkdir()
                    member.pick_ports()

    def _start_all(self) -> None:
        try:
            for member in self.members:
                member.spawn()
            self.wait_ready()
        except BaseException:
            for member in self.members:
                member.kill()
            raise

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every running, unpaused member serves and a write goes through;
        ServerStartError with the members' log tails otherwise."""
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        try:
            for member in self.members:
                if member.is_running and not member.paused:
                    left = max(deadline - time.monotonic(), 0.1)
                    wait_until(member._serving_or_exited, left, f"{member}", interval=0.1)
            left = max(deadline - time.monotonic(), 0.1)
            wait_until(self._write_check, left, f"a write through {self.kind}", interval=0.1)
        except (TimeoutError, ServerStartError) as exc:
            tails = "\n".join(m.failure("", lines=20) for m in self.members)
            raise ServerStartError(f"{self.kind} not ready: {exc}\n{tails}") from None

    def leader(self, timeout: float = 30.0) -> MemberT:
        """The member that leads now (of those running and not paused; the one with the
        highest term if two think they lead), waiting up to ``timeout`` for an election."""
        found: list[MemberT] = []

        def probe() -> bool:
            terms = [
                (term, m)
                for m in self.members
                if m.is_running and not m.paused and (term := self._leader_probe(m)) is not None
            ]
            if terms:
                found.append(max(terms, key=lambda tm: tm[0])[1])
            return bool(terms)

        wait_until(probe, timeout, f"a leader in {self.kind}", interval=0.05)
        return found[-1]

    def followers(self, timeout: float = 30.0) -> list[MemberT]:
        """The members other than the leader (see leader())."""
        leader = self.leader(timeout)
        return [m for m in self.members if m is not leader]

    def store_url(self, name: str, members: Sequence[MemberT] | None = None) -> str:
        """A URL naming every member's client endpoint (or those of ``members``, in that
        order), with the key prefix / chroot ``name``: one store per name."""
        endpoints = ",".join(m.endpoint for m in (members or self.members))
        return f"{self.scheme}://{endpoints}/{_check_name(name)}"

    def close(self) -> None:
        """Kill every member and remove the directory; safe to repeat."""
        if self._closed:
            return
        self._closed = True
        try:
            for member in self.members:
                member.kill()
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            atexit.unregister(self.close)
            for member in self.members:
                if member.cgroup is not None:  # empty once its processes are gone
                    with contextlib.suppress(OSError):
                        cgroup_dir(member.cgroup).rmdir()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.members}>"


# --------------------------------------------------------------------------
# etcd
# --------------------------------------------------------------------------


class EtcdMember(_Member["EtcdCluster"]):
    """One etcd member: client port ``port``, peer port ``peer_port``, on ``address``."""

    kind = "etcd member"

    def pick_ports(self) -> None:
        self.port, self.peer_port = free_port(), free_port()

    @property
    def peer_url(self) -> str:
        return f"http://{self.address}:{self.peer_port}"

    @property
    def peer_ports(self) -> tuple[int, ...]:
        return (self.peer_port,)

    def _command(self) -> list[str]:
        cluster = self.cluster
        state = "existing" if cluster.formed else "new"
        initial = ",".join(f"{m.name}={m.peer_url}" for m in cluster.members)
        client = f"http://{self.address}:{self.port}"
        return [
            ETCD,
            f"--name={self.name}",
            f"--data-dir={self.dir / 'data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={initial}",
            f"--initial-cluster-state={state}",
            f"--initial-cluster-token={cluster.token}",
            f"--heartbeat-interval={cluster.heartbeat_ms}",
            f"--election-timeout={cluster.election_ms}",
            "--logger=zap",
            "--log-outputs=stderr",
        ]

    def _env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}

    def serving(self) -> bool:
        """/health: true once the member knows a leader and a linearizable read went through."""
        try:
            answer = _http_json(self.address, self.port, "GET", "/health")
        except (OSError, ValueError):
            return False
        return isinstance(answer, dict) and answer.get("health") == "true"

    def status(self) -> dict[str, Any]:
        """/v3/maintenance/status (ids and terms are decimal strings); OSError, ValueError."""
        answer: dict[str, Any] = _http_json(
            self.address, self.port, "POST", "/v3/maintenance/status", {}
        )
        return answer


class EtcdCluster(_Cluster[EtcdMember]):
    """``size`` etcd members (3 by default) on loopback, fast elections (heartbeat 50 ms,
    election timeout 500 ms). ``store_url(name)``: ``etcd://A1:P1,A2:P2,A3:P3/name``."""

    kind = "etcd cluster"
    scheme = "etcd"

    def __init__(
        self,
        size: int = 3,
        *,
        addresses: Sequence[str] | None = None,
        startup_timeout: float = 60.0,
        heartbeat_ms: int = 50,
        election_ms: int = 500,
        cgroups: bool = False,
    ) -> None:
        if not Path(ETCD).is_file():
            raise ServerStartError(f"etcd not found at {ETCD} (set IDMINT_ETCD)")
        self.heartbeat_ms, self.election_ms = heartbeat_ms, election_ms
        self.token = f"idmint-{uuid.uuid4().hex[:12]}"
        super().__init__(size, addresses, startup_timeout, cgroups)

    def _member(self, index: int, address: str) -> EtcdMember:
        return EtcdMember(self, index, address)

    def _write_check(self) -> bool:
        body = {
            "key": base64.b64encode(b"__cluster_ready").decode(),
            "value": base64.b64encode(self.token.encode()).decode(),
        }
        for member in self.members:
            if member.is_running and not member.paused:
                with contextlib.suppress(OSError, ValueError):
                    _http_json(member.address, member.port, "POST", "/v3/kv/put", body)
                    return True
        return False

    def _leader_probe(self, member: EtcdMember) -> int | None:
        try:
            status = member.status()
            if status["leader"] == status["header"]["member_id"]:
                return int(status.get("raftTerm", 0))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None


# --------------------------------------------------------------------------
# ZooKeeper
# --------------------------------------------------------------------------


class ZooKeeperMember(_Member["ZooKeeperEnsemble"]):
    """One ZooKeeper server (myid ``id``): client ``port``, ``peer_port`` (followers to the
    leader) and ``election_port``, all on ``address``."""

    kind = "zookeeper member"

    def pick_ports(self) -> None:
        self.port, self.peer_port, self.election_port = free_port(), free_port(), free_port()

    @property
    def peer_ports(self) -> tuple[int, ...]:
        return (self.peer_port, self.election_port)

    def _write_config(self) -> Path:
        cluster = self.cluster
        data_dir = self.dir / "data"
        data_dir.mkdir(exist_ok=True)
        (data_dir / "myid").write_text(f"{self.id}\n")
        settings: dict[str, object] = {
            "tickTime": cluster.tick_ms,
            "initLimit": 10,
            "syncLimit": 5,
            "dataDir": data_dir,
            "clientPort": self.port,
            "clientPortAddress": self.address,
            "admin.enableServer": "false",
            "4lw.commands.whitelist": "srvr,ruok,mntr,stat",
            "minSessionTimeout": 2 * cluster.tick_ms,
            "maxSessionTimeout": 20000,
        }
        for m in cluster.members:
            settings[f"server.{m.id}"] = f"{m.address}:{m.peer_port}:{m.election_port}"
        cfg = self.dir / "zoo.cfg"
        cfg.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        return cfg

    def _command(self) -> list[str]:
        return [
            JAVA,
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",  # less JIT work: quicker starts on a busy machine
            "-cp",
            self.cluster.classpath,
            MAIN,
            str(self._write_config()),
        ]

    def srvr(self) -> str:
        """The ``srvr`` four-letter word's answer; OSError if none."""
        return _four_letter_word(self.address, self.port, "srvr")

    def mode(self) -> str | None:
        """The srvr Mode: leader, follower (standalone, observer); None if not serving."""
        try:
            match = re.search(r"^Mode: (\w+)", self.srvr(), re.MULTILINE)
        except OSError:
            return None
        return match.group(1) if match else None

    def serving(self) -> bool:
        return self.mode() in ("leader", "follower")


class ZooKeeperEnsemble(_Cluster[ZooKeeperMember]):
    """``size`` ZooKeeper servers (3 by default) in quorum mode on loopback, tickTime 200 ms.
    ``store_url(name)``: ``zk://A1:P1,A2:P2,A3:P3/name`` (chroot /name)."""

    kind = "zookeeper ensemble"
    scheme = "zk"

    def __init__(
        self,
        size: int = 3,
        *,
        addresses: Sequence[str] | None = None,
        startup_timeout: float = 60.0,
        tick_ms: int = 200,
        cgroups: bool = False,
    ) -> None:
        self.classpath = find_classpath()
        self.tick_ms = tick_ms
        self._check_ids = itertools.count()
        super().__init__(size, addresses, startup_timeout, cgroups)

    def _member(self, index: int, address: str) -> ZooKeeperMember:
        return ZooKeeperMember(self, index, address)

    def _write_check(self) -> bool:
        hosts = ",".join(m.endpoint for m in self.members if m.is_running and not m.paused)
        client = KazooClient(hosts=hosts, timeout=4.0)
        try:
            client.start(timeout=2.0)
            client.create(f"/cluster-ready-{next(self._check_ids)}", ephemeral=True)
            return True
        except Exception:
            return False
        finally:
            with contextlib.suppress(Exception):
                client.stop()
                client.close()

    def _leader_probe(self, member: ZooKeeperMember) -> int | None:
        # srvr reports no election epoch; the Zxid's high 32 bits are the leader's epoch.
        try:
            answer = member.srvr()
        except OSError:
            return None
        if not re.search(r"^Mode: leader", answer, re.MULTILINE):
            return None
        zxid = re.search(r"^Zxid: 0x([0-9a-fA-F]+)", answer, re.MULTILINE)
        return int(zxid.group(1), 16) >> 32 if zxid else 0
