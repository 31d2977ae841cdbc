"""The shipped Grafana dashboard and Prometheus alert rules: valid JSON / YAML, and every
metric named in every PromQL expression exists in a registry a qlm process creates (or is
Prometheus's own ``up``). A renamed metric fails here, not on an operator's empty panel."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.unit.test_metrics_docs import registries

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "docker" / "grafana" / "qlm-dashboard.json"
ALERTS = REPO / "docker" / "prometheus" / "alerts.yml"
PROMETHEUS = REPO / "docker" / "prometheus.yml"

# PromQL words that are not metric names (functions are recognised by the "(" after them)
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset", "le", "inf", "nan",
}  # fmt: skip
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def known_names() -> set[str]:
    names = {"up"}
    for defs in registries().values():
        for d in defs:
            names.update(d.sample_names())
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers outside strings, label matchers,
    range/subquery brackets and by/without/on/ignoring/group_* label lists, not followed by
    "(" (a function or aggregation) and not a keyword or a number's exponent."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, regexes)
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # [5m], [$__rate_interval], subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e, flags=re.I)
    e = re.sub(r"\$\w+", " ", e)  # Grafana variables
    e = re.sub(r"\b\d+(\.\d+)?([eE][+-]?\d+)?\b", " ", e)  # numbers
    out = set()
    for m in _IDENT.finditer(e):
        word = m.group(0)
        rest = e[m.end() :].lstrip()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue
        out.add(word)
    return out


def test_the_extractor() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, model_name) (rate(qlm_x_bucket{model_name=~"a|b"}'
        "[$__rate_interval]))) / on (job) group_left up > 1e3 and sum(qlm_y) > 0"
    )
    assert metric_names(expr) == {"qlm_x_bucket", "up", "qlm_y"}


def _dashboard_exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            # "expr": a panel's query; "definition": a template variable's
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            else:
                yield from _dashboard_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _dashboard_exprs(item)


def _label_values(expr: str) -> str:
    """label_values(metric, label) -> metric (a Grafana template query)."""
    m = re.fullmatch(r"\s*label_values\(\s*([^,]+),\s*\w+\s*\)\s*", expr)
    return m.group(1) if m else expr


def test_dashboard_is_valid_and_names_only_existing_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["panels"]
    exprs = [_label_values(e) for e in _dashboard_exprs(dash)]
    assert len(exprs) >= 20
    known = known_names()
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        assert names <= known, f"unknown metrics {sorted(names - known)} in {expr!r}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]


def _alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_alert_rules_are_valid_and_name_only_existing_metrics() -> None:
    rules = _alert_rules()
    assert len(rules) >= 8
    known = known_names()
    names_seen = set()
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"Qlm[A-Za-z0-9]+", rule["alert"]), rule["alert"]
        assert rule["alert"] not in names_seen
        names_seen.add(rule["alert"])
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"]
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s"))
        names = metric_names(rule["expr"])
        assert names and names <= known, (rule["alert"], sorted(names - known))


def test_prometheus_config_loads_the_rules() -> None:
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    assert "alerts.yml" in cfg["rule_files"]
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    mounted = {c["target"] for c in compose["services"]["prometheus"]["configs"]}
    assert "/etc/prometheus/alerts.yml" in mounted
    assert compose["configs"]["prometheus_alerts"]["file"] == "./prometheus/alerts.yml"
