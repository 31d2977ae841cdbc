"""The shipped Grafana dashboard and Prometheus alert rules as PromQL: every query, parsed with
promql-parser (Python bindings of a Rust PromQL parser), and the series selectors in it. Shared
by the static checks (tests/conformance/test_dashboards.py) and the run that fills every panel
(tests/broker/test_dashboard_fills.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import yaml

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "docker" / "grafana" / "qlm-dashboard.json"
ALERTS = REPO / "docker" / "prometheus" / "alerts.yml"
PROMETHEUS = REPO / "docker" / "prometheus.yml"

# What Grafana puts in place of its variables before a query reaches Prometheus: an interval
# for the built-in ones, the "All" value (allValue ".*") for the dashboard's own. A variable
# not listed here fails the parse, so a new one is added here on purpose.
GRAFANA_VARIABLES = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
    "model": ".*",
}
_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
_LABEL_VALUES = re.compile(r"\s*label_values\(\s*(.+),\s*\w+\s*\)\s*")


@dataclass(frozen=True)
class Query:
    where: str  # the panel's or the rule's title, for messages
    promql: str  # as Prometheus receives it: variables replaced


@dataclass(frozen=True)
class Selector:
    """One series selector: a metric name and its label matchers (name, op, value), op one
    of = != =~ !~."""

    name: str
    matchers: tuple[tuple[str, str, str], ...]

    def matches(self, labels: dict[str, str], *, ignore: frozenset[str] = frozenset()) -> bool:
        """Whether a series with ``labels`` is selected (matchers on ``ignore`` skipped)."""
        for label, op, value in self.matchers:
            if label in ignore:
                continue
            have = labels.get(label, "")
            ok = (
                have == value
                if op in ("=", "!=")
                else re.fullmatch(value, have) is not None  # PromQL regexes are anchored
            )
            if ok != (op in ("=", "=~")):
                return False
        return True


def interpolate(expr: str) -> str:
    """``expr`` with Grafana's variables replaced as Grafana would (KeyError: unknown)."""
    return _VARIABLE.sub(lambda m: GRAFANA_VARIABLES[m.group(1) or m.group(2)], expr)


def _dashboard_exprs(node: Any, title: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        title = str(node.get("title") or node.get("name") or title)
        for key, value in node.items():
            # "expr": a panel's query; "definition": a template variable's
            if key in ("expr", "definition") and isinstance(value, str):
                yield title, value
            else:
                yield from _dashboard_exprs(value, title)
    elif isinstance(node, list):
        for item in node:
            yield from _dashboard_exprs(item, title)


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def dashboard_queries() -> list[Query]:
    """Every panel query and template-variable query of the dashboard; a variable's
    ``label_values(metric, label)`` (Grafana's, not PromQL) counts as its metric selector."""
    out = []
    for title, expr in _dashboard_exprs(dashboard()):
        m = _LABEL_VALUES.fullmatch(expr)
        out.append(Query(title, interpolate(m.group(1) if m else expr)))
    return out


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alert_queries() -> list[Query]:
    return [Query(rule["alert"], rule["expr"]) for rule in alert_rules()]


def selectors(promql: str) -> list[Selector]:
    """The series selectors of an expression (ValueError: it does not parse)."""
    found: list[Selector] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = tuple(
                (m.name, _OPS[repr(m.op)], m.value)
                for m in node.matchers.matchers
                if m.name != "__name__"
            )
            found.append(Selector(node.name, matchers))

    promql_parser.walk(promql_parser.parse(promql), visit)
    return found


# MatchOp values are not hashable: keyed by their repr ("MatchOp.Re")
_OPS = {"MatchOp.Equal": "=", "MatchOp.NotEqual": "!=", "MatchOp.Re": "=~", "MatchOp.NotRe": "!~"}
