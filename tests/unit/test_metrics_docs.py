"""docs/metrics.md lists every metric each process creates, with its type, labels and HELP
verbatim; no metric anywhere has a label called ``instance`` (Prometheus's target label)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qlm.agents.health import AgentMetrics
from qlm.metrics import CoordinatorMetrics, GatewayMetrics, MetricDef

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
_CELL = re.compile(r"(?<!\\)\|")


class _NoAgent:
    agent_id = "a"
    instances: dict[str, object] = {}
    reports: dict[str, int] = {}
    report_retries = 0
    evictions: dict[str, int] = {}
    reconnects = 0
    token_streams = None

    def ready(self) -> bool:
        return False


def registries() -> dict[str, list[MetricDef]]:
    return {
        "Coordinator": CoordinatorMetrics().definitions(),
        "Agent": AgentMetrics(_NoAgent()).definitions(),
        "Gateway": GatewayMetrics().definitions(),
    }


def documented() -> dict[str, list[MetricDef]]:
    """The tables under the ``### Coordinator|Agent|Gateway`` headings."""
    out: dict[str, list[MetricDef]] = {}
    section = None
    for line in DOC.read_text().splitlines():
        if line.startswith("### "):
            section = line[4:].strip()
            continue
        if section is None or not line.startswith("| `"):
            continue
        cells = [c.strip().replace("\\|", "|") for c in _CELL.split(line)[1:-1]]
        name, kind, labels, help_ = cells
        out.setdefault(section, []).append(
            MetricDef(
                name.strip("`"),
                kind,
                tuple(x.strip().strip("`") for x in labels.split(",")) if labels != "-" else (),
                help_,
            )
        )
    return out


@pytest.mark.parametrize("process", ["Coordinator", "Agent", "Gateway"])
def test_docs_table_is_the_registry(process: str) -> None:
    code = {d.name: d for d in registries()[process]}
    docs = {d.name: d for d in documented().get(process, [])}
    assert sorted(docs) == sorted(code), "docs/metrics.md and the code list other metrics"
    for name, d in code.items():
        assert docs[name] == d, f"{name}: docs/metrics.md says {docs[name]}, the code {d}"


def test_no_metric_has_an_instance_label() -> None:
    for process, defs in registries().items():
        for d in defs:
            assert "instance" not in d.labels, (process, d.name)
            assert d.help and not d.help[0].islower(), (process, d.name)


def test_agent_collector_yields_exactly_its_definitions() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from qlm.agents.health import AGENT_METRICS

    class Streams:
        published = 3
        messages = 2
        publish_failures = 1

    agent = _NoAgent()
    agent.token_streams = Streams()
    body, _ = AgentMetrics(agent).render()
    names = set()
    for f in text_string_to_metric_families(body.decode()):
        names.add(f.name + ("_total" if f.type == "counter" else ""))
        assert f.documentation == next(
            d.help
            for d in AGENT_METRICS
            if d.name.removesuffix("_total") == f.name or d.name == f.name
        )
    assert names == {d.name for d in AGENT_METRICS}
