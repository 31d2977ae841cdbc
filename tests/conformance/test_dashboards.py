"""The shipped Grafana dashboard and Prometheus alert rules, checked as ``promtool check rules``
would without it (no promtool here): valid JSON / YAML, every PromQL expression parses and
type-checks (promql-parser: function names, argument counts and types), every rule has the
fields an operator needs, and every metric an expression selects exists in a registry a qlm
process creates (or is Prometheus's own ``up``). A renamed metric fails here, not on an
operator's empty panel; tests/broker/test_dashboard_fills.py checks that a real run fills them."""

from __future__ import annotations

import re

import promql_parser
import pytest
import yaml

from tests.dashboards import (
    PROMETHEUS,
    REPO,
    Selector,
    alert_queries,
    alert_rules,
    dashboard,
    dashboard_queries,
    interpolate,
    selectors,
)
from tests.unit.test_metrics_docs import registries


def known_names() -> set[str]:
    names = {"up"}
    for defs in registries().values():
        for d in defs:
            names.update(d.sample_names())
    return names


def test_the_parser_rejects_what_promtool_would() -> None:
    # the checks below mean something only if a broken expression fails to parse
    for broken in (
        "rate(qlm_requests_total)",  # rate() of an instant vector
        "histogram_quantile(0.95)",  # an argument missing
        "sum by (le) (rate(qlm_x_bucket[5m])",  # unclosed
        "qlm_requests_total > ",
        "rate(qlm_requests_total[5x])",  # a bad duration
        "qlm_slo_total and 1",  # a set operator on a scalar
        "no_such_function(qlm_requests_total)",
    ):
        with pytest.raises(ValueError):
            selectors(broken)
    with pytest.raises(KeyError):
        interpolate("rate(x[$__rate_interval]) * $undeclared")
    got = selectors(
        'histogram_quantile(0.95, sum by (le, model_name) (rate(qlm_x_bucket{model_name=~"a|b"}'
        "[5m]))) / on (job) group_left up > 1e3 and sum(qlm_y) > 0"
    )
    assert got == [
        Selector("qlm_x_bucket", (("model_name", "=~", "a|b"),)),
        Selector("up", ()),
        Selector("qlm_y", ()),
    ]


def test_selector_matching_follows_promql() -> None:
    s = Selector("m", (("a", "=", "x"), ("b", "=~", "y|z"), ("c", "!=", "1"), ("d", "!~", "q.*")))
    assert s.matches({"a": "x", "b": "z", "c": "2", "d": "r"})
    assert not s.matches({"a": "x", "b": "yz", "c": "2"})  # regexes are anchored
    assert not s.matches({"a": "x", "b": "y", "c": "1"})
    assert not s.matches({"a": "x", "b": "y", "d": "qq"})
    assert Selector("m", (("a", "=", ""),)).matches({})  # an absent label is the empty one
    assert s.matches({"b": "y"}, ignore=frozenset({"a", "c", "d"}))
    assert not s.matches({"b": "x"}, ignore=frozenset({"a", "c", "d"}))


def test_dashboard_is_valid_and_every_query_parses_and_names_existing_metrics() -> None:
    dash = dashboard()
    assert dash["uid"] and dash["title"] and dash["panels"]
    queries = dashboard_queries()
    assert len(queries) >= 20
    known = known_names()
    for q in queries:
        try:
            sels = selectors(q.promql)
        except ValueError as exc:
            pytest.fail(f"{q.where}: {q.promql!r} does not parse: {exc}")
        assert sels, q
        names = {s.name for s in sels}
        assert None not in names, f"{q.where}: a selector without a metric name"
        assert names <= known, f"{q.where}: unknown metrics {sorted(names - known)}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]


def test_alert_rules_have_what_an_operator_needs() -> None:
    rules = alert_rules()
    assert len(rules) >= 8
    names_seen = set()
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"Qlm[A-Za-z0-9]+", rule["alert"]), rule["alert"]
        assert rule["alert"] not in names_seen
        names_seen.add(rule["alert"])
        # Every rule here watches a state or a rate, none a one-off event: without `for` a
        # single evaluation would page (and flap with the next one).
        assert "for" in rule, (rule["alert"], "needs a `for`")
        assert promql_parser.parse_duration(rule["for"]).total_seconds() > 0, rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_alert_expressions_parse_and_name_existing_metrics() -> None:
    known = known_names()
    for q in alert_queries():
        try:
            sels = selectors(q.promql)
        except ValueError as exc:
            pytest.fail(f"{q.where}: {q.promql!r} does not parse: {exc}")
        names = {s.name for s in sels}
        assert names and None not in names, q
        assert names <= known, (q.where, sorted(names - known))


def test_prometheus_config_loads_the_rules() -> None:
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    assert "alerts.yml" in cfg["rule_files"]
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    mounted = {c["target"] for c in compose["services"]["prometheus"]["configs"]}
    assert "/etc/prometheus/alerts.yml" in mounted
    assert compose["configs"]["prometheus_alerts"]["file"] == "./prometheus/alerts.yml"
