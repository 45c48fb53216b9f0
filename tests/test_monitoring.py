"""The monitoring kit: the alert rules (deploy/prometheus/alerts.yml) pass `promtool check
rules` and their unit tests (alerts_test.yml) pass `promtool test rules`, which fails a wrong
expectation; every alert has a case where it fires and one where it does not; every metric an
alert, a test series or a dashboard panel reads is one idmint exports (names taken from
idmint.server.metrics_sources, so a renamed metric fails here); every runbook link lands on a
section of docs/monitoring.md. promtool missing is a failure, never a skip: CI installs it
(.ci/install)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

from idmint.server.metrics_sources import COUNTER, SPECS

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "idmint.json"
MONITORING = ROOT / "docs" / "monitoring.md"
RUNBOOK = "https://github.com/idmint/idmint/blob/main/docs/monitoring.md#"
SEVERITIES = {"page", "ticket"}
#: Series Prometheus makes itself: the target alerts read `up`.
PROMETHEUS_OWN = {"up"}
#: What the alerts must watch (issue 21): each of these is read by some alert.
WATCHED = {
    "idmint_key_remaining",
    "idmint_dc_runway_seconds",
    "idmint_dc_global_up",
    "idmint_dc_runway_spent_total",
    "idmint_keys_store_errors",
    "idmint_http_errors_total",
    "idmint_snowflake_lease_deadline_seconds",
    "idmint_snowflake_clock_offset_seconds",
    "idmint_snowflake_clock_offset_error_seconds",
    "idmint_quorum_node_up",
    "idmint_store_failovers_total",
    "idmint_store_replicas",
    "idmint_store_replicas_waited",
    "idmint_store_replicas_required",
    "up",
}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, (
        "promtool is not installed: the monitoring tests need it (.ci/install installs Debian's "
        "prometheus package, which has it)"
    )
    return subprocess.run(
        [binary, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def said(done: subprocess.CompletedProcess[str]) -> str:
    return f"promtool exited {done.returncode}:\n{done.stdout}{done.stderr}"


def exported() -> set[str]:
    """The series names idmint's /metrics carries, from the module's spec table, as
    prometheus-client writes them: a counter's samples are `<name>_total` whether or not the
    spec's name ends so (its `_created` samples the module drops), a gauge's its name. No spec is
    a histogram or a summary, so no `_bucket`, `_sum` or `_count` name exists."""
    names: set[str] = set()
    for spec in SPECS:
        kind = CounterMetricFamily if spec.kind == COUNTER else GaugeMetricFamily
        family = kind(spec.name, spec.help, labels=list(spec.labels))
        family.add_metric(["x"] * len(spec.labels), 1.0)
        names.update(sample.name for sample in family.samples)
    return names


# PromQL, as far as finding the metric names of an expression goes: strings, label matchers,
# ranges and label lists out; then a name followed by "(" is a function or an aggregation.
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
WORD = re.compile(r"(?<![\w$.])[A-Za-z_:][\w:]*")
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS |= {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    assert "__name__" not in expr, f"a selector by __name__ hides its metrics: {expr}"
    text = STRINGS.sub('""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = LABEL_LISTS.sub(" ", text)
    names = set()
    for found in WORD.finditer(text):
        if found.group().lower() in KEYWORDS or text[found.end() :].lstrip().startswith("("):
            continue
        names.add(found.group())
    return names


def unknown(names: set[str]) -> set[str]:
    return names - exported() - PROMETHEUS_OWN


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return groups


def alerts() -> dict[str, dict[str, Any]]:
    rules = [rule for group in rule_groups() for rule in group["rules"]]
    assert all("alert" in rule for rule in rules), "alerts.yml holds alerts only"
    names = [rule["alert"] for rule in rules]
    assert len(set(names)) == len(names), f"an alert name twice: {names}"
    return {rule["alert"]: rule for rule in rules}


def rule_tests() -> dict[str, Any]:
    tests: dict[str, Any] = yaml.safe_load(RULE_TESTS.read_text())
    return tests


def cases(tests: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for group in tests["tests"]:
        yield from group.get("alert_rule_test", [])


# --- promtool -------------------------------------------------------------------------------


def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert done.returncode == 0, said(done)
    assert f"SUCCESS: {len(alerts())} rules found" in done.stdout, said(done)


def test_promtool_passes_the_unit_tests() -> None:
    done = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, said(done)


def test_promtool_fails_wrong_expectations_and_a_broken_rule(tmp_path: Path) -> None:
    """The negative control: every case turned around (a firing case expecting nothing, a quiet
    one expecting an alert) fails, each one reported; and a rule that does not parse fails the
    check. So the two tests above can fail."""
    shutil.copy(RULES, tmp_path / RULES.name)
    tests = rule_tests()
    for case in cases(tests):
        case["exp_alerts"] = [] if case.get("exp_alerts") else [{"exp_labels": {"severity": "x"}}]
    (tmp_path / "wrong.yml").write_text(yaml.safe_dump(tests))
    done = promtool("test", "rules", "wrong.yml", cwd=tmp_path)
    assert done.returncode != 0, said(done)
    failed = Counter(re.findall(r"alertname: (\w+), time:", done.stdout + done.stderr))
    assert failed == Counter(case["alertname"] for case in cases(tests)), said(done)

    groups = rule_groups()
    groups[0]["rules"][0]["expr"] = "rate(idmint_ids_issued_total[5m]"
    (tmp_path / "broken.yml").write_text(yaml.safe_dump({"groups": groups}))
    done = promtool("check", "rules", "broken.yml", cwd=tmp_path)
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr, said(done)


# --- the rules and their tests --------------------------------------------------------------


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    fires: Counter[str] = Counter()
    quiet: Counter[str] = Counter()
    for case in cases(rule_tests()):
        (fires if case.get("exp_alerts") else quiet)[case["alertname"]] += 1
    names = set(alerts())
    assert set(fires) | set(quiet) <= names, "a test of an alert alerts.yml does not have"
    assert not names - set(fires), f"never seen firing: {sorted(names - set(fires))}"
    assert not names - set(quiet), f"never seen quiet: {sorted(names - set(quiet))}"


def test_alerts_and_their_tests_read_only_metrics_idmint_exports() -> None:
    read: set[str] = set()
    for name, rule in alerts().items():
        names = metric_names(rule["expr"])
        assert names, f"{name}: no metric found in {rule['expr']}"
        assert not unknown(names), f"{name} reads {sorted(unknown(names))}: not in /metrics"
        read |= names
    assert not WATCHED - read, f"no alert watches {sorted(WATCHED - read)}"
    # A quiet case must be quiet because of its values, not because a series is misspelled.
    series = {
        item["series"].partition("{")[0].strip()
        for group in rule_tests()["tests"]
        for item in group["input_series"]
    }
    assert not unknown(series), f"alerts_test.yml feeds {sorted(unknown(series))}"


def test_every_alert_says_how_bad_what_and_where_to_read_more() -> None:
    slugs = doc_anchors()
    assert f"| {len(alerts())} Prometheus alerting rules," in MONITORING.read_text()
    for name, rule in alerts().items():
        assert rule.get("labels", {}).get("severity") in SEVERITIES, name
        notes = rule.get("annotations", {})
        assert set(notes) == {"summary", "description", "runbook"}, f"{name}: {sorted(notes)}"
        assert notes["runbook"] == RUNBOOK + name.lower(), f"{name}: {notes['runbook']}"
        assert name.lower() in slugs, f"docs/monitoring.md has no section {name}"


def doc_anchors() -> set[str]:
    """The anchors GitHub makes of docs/monitoring.md's headings (outside code blocks)."""
    anchors, fenced = set(), False
    for line in MONITORING.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6}\s+(.*)", line)):
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


# --- the dashboard --------------------------------------------------------------------------


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def dashboard_queries() -> dict[str, str]:
    """Every PromQL expression of the dashboard's panels, by where it is."""
    board = json.loads(DASHBOARD.read_text())
    return {
        f"{panel['title']} {target['refId']}": target["expr"]
        for panel in panels(board["panels"])
        for target in panel.get("targets", [])
    }


def test_the_dashboard_reads_only_metrics_idmint_exports() -> None:
    board = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries()
    assert len(queries) >= 12
    read: set[str] = set()
    for where, expr in queries.items():
        names = metric_names(expr)
        assert names and not unknown(names), f"{where}: {sorted(unknown(names))} in {expr}"
        read |= names
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            found = re.fullmatch(
                r"label_values\((\w+)(?:\{.*\})?, *(\w+)\)", variable["definition"]
            )
            assert found, variable["definition"]
            assert not unknown({found.group(1)}), variable["definition"]
            assert variable["query"] == variable["definition"]
            read.add(found.group(1))
    assert len(read) >= 20, sorted(read)


def test_the_dashboard_imports_with_a_data_source_and_a_key_variable() -> None:
    board = json.loads(DASHBOARD.read_text())
    source = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["key"]["definition"].startswith("label_values(")
    assert variables["key"]["multi"] and variables["key"]["includeAll"]
    everything = list(panels(board["panels"]))
    ids = [panel["id"] for panel in everything]
    assert len(set(ids)) == len(ids), "two panels with one id"
    for panel in everything:
        box = panel["gridPos"]
        assert box["x"] + box["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == source, panel["title"]
            assert all(t["datasource"] == source for t in panel["targets"]), panel["title"]


def test_the_dashboard_queries_parse(tmp_path: Path) -> None:
    """Each panel's expression, its variables filled in, as a recording rule for promtool."""
    filled = {"$__rate_interval": "5m", "$job": "idmint", "$key": ".*"}
    rules = []
    for number, expr in enumerate(dashboard_queries().values()):
        for variable, value in filled.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard_query_{number}", "expr": expr})
    (tmp_path / "queries.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "q", "rules": rules}]})
    )
    done = promtool("check", "rules", "queries.yml", cwd=tmp_path)
    assert done.returncode == 0, said(done)


# --- the checker itself ---------------------------------------------------------------------


def test_metric_names_finds_the_metrics_and_a_renamed_one_fails() -> None:
    expr = (
        'sum by (key) (rate(idmint_ids_issued_total{key=~"a|b", job="x"}[5m] offset 1h))\n'
        "  / on (key) group_left max without (instance) (idmint_step) > bool 1e3"
    )
    assert metric_names(expr) == {"idmint_ids_issued_total", "idmint_step"}
    assert metric_names('absent(up{job=~"idmint.*"})') == {"up"}
    assert metric_names("abs(idmint_snowflake_clock_offset_seconds) - inf") == {
        "idmint_snowflake_clock_offset_seconds"
    }
    # A counter is read with its _total; a gauge has none; nothing is a histogram.
    assert unknown({"idmint_ids_issued_total", "idmint_step", "idmint_quorum_node_up"}) == set()
    renamed = {"idmint_ids_issued", "idmint_step_total", "idmint_allocation_seconds_bucket"}
    assert unknown(renamed) == renamed
    assert "idmint_dc_runway_spent_total" in exported()  # made from a loop in the spec table
