"""deploy/prometheus: the rules load, every alert is unit-tested both ways, every alert has
its runbook, and the rules name only metrics relayd exports."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.conftest import DEPLOY, ROOT, known_series
from tests.deploy.promql import metric_names

RULES = DEPLOY / "prometheus" / "relayd.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "relayd.rules.test.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
OBSERVE = ROOT / "docs" / "observe.md"
MIN_ALERTS = 8


def _rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [rule for rule in _rules() if "alert" in rule]


def recorded() -> frozenset[str]:
    """The recording rules' names."""
    return frozenset(rule["record"] for rule in _rules() if "record" in rule)


def _promtool(promtool: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_promtool_check_rules(promtool: Path) -> None:
    """`promtool check rules` accepts the file."""
    result = _promtool(promtool, "check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_rules(promtool: Path) -> None:
    """`promtool test rules` passes every unit test of the alerts."""
    result = _promtool(promtool, "test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    """At least 8 alerts; each has a test expecting it and a test expecting silence."""
    names = {alert["alert"] for alert in _alerts()}
    assert len(names) >= MIN_ALERTS
    fired: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    assert names - fired == set(), "never tested firing"
    assert names - silent == set(), "never tested silent"
    assert (fired | silent) <= names, "tests of alerts that do not exist"


def test_every_alert_has_summary_description_and_a_runbook_section() -> None:
    """runbook_url is docs/runbook.md#<alert in lower case>, and that section exists
    in docs/runbook.md."""
    sections = set(re.findall(r"^## (\w+)$", RUNBOOK.read_text(), flags=re.M))
    for alert in _alerts():
        name = alert["alert"]
        annotations = alert["annotations"]
        assert annotations["summary"], name
        assert annotations["description"], name
        assert annotations["runbook_url"] == f"docs/runbook.md#{name.lower()}"
        assert name in sections, f"no '## {name}' in docs/runbook.md"
        assert alert["labels"]["severity"] in ("warning", "critical"), name
    assert sections == {alert["alert"] for alert in _alerts()}, "runbook sections without alert"


# The figures an expression turns on: a comparison with a number, and a range.
_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)\s*(\d+(?:\.\d+)?)")
_RANGE = re.compile(r"\[\d+[smhdw]\]")


def _figures(text: str) -> set[str]:
    comparisons = {f"{op} {number}" for op, number in _COMPARISON.findall(text)}
    return comparisons | set(_RANGE.findall(text))


def test_what_to_alert_on_quotes_the_shipped_rules() -> None:
    """The table under "What to alert on" in docs/observe.md has one row per shipped
    alert, with its severity, its `for` and, in code spans, exactly the thresholds and
    ranges of its expression: a tuned rule without its docs (or docs quoting example
    thresholds the file does not ship) fails here."""
    text = OBSERVE.read_text()
    section = text[text.index("**What to alert on") :]
    section = section[: section.index("\n\n", section.index("| alert |"))]
    rows = {}
    for line in section.splitlines():
        match = re.match(
            r"\| \[`(\w+)`\]\(runbook\.md#(\w+)\) \| (\w+) \| (.*) \| ([\w ]+) \|$", line
        )
        if match:
            name, anchor, severity, fires, duration = match.groups()
            assert anchor == name.lower(), name
            rows[name] = (severity, _figures(" ".join(re.findall(r"`([^`]*)`", fires))), duration)
    shipped = {
        alert["alert"]: (
            alert["labels"]["severity"],
            _figures(alert["expr"]),
            alert.get("for", "at once"),
        )
        for alert in _alerts()
    }
    assert rows == shipped


def test_rules_name_only_relayd_metrics() -> None:
    """Every metric an expression selects is one relayd exports, or a recording rule."""
    names = recorded()
    for rule in _rules():
        unknown = {n for n in metric_names(rule["expr"]) if not known_series(n, names)}
        assert not unknown, f"{rule.get('alert') or rule.get('record')}: {unknown}"


def test_metric_name_extraction() -> None:
    """The extraction the name check relies on finds metrics, not functions or labels."""
    expression = (
        'sum by (job, le) (rate(relayd_x_bucket{job="relayd", outcome=~"a|b"}[5m])) > 0 '
        "and on (job) relayd:paused:max == 1 unless absent(up{job='relayd'}) "
        "or time() - max(relayd_y)"
    )
    assert metric_names(expression) == {"relayd_x_bucket", "relayd:paused:max", "up", "relayd_y"}
