"""The shipped Grafana dashboard and alert rules fill from a real run.

A coordinator (the default ``qlm`` planner, the live autoscaler in dry run) and one sim agent
as child processes, the gateway in this process, all on a private vhost of the real broker.
Traffic: a burst through the Python client that waits for a replan (the agent paused), a
streamed request, and two calls through the gateway (one streamed). Then every process's
``/metrics`` is scraped as Prometheus would, and every series selector of every dashboard
query and alert expression must select at least one series in the scrape of the process whose
registry defines that metric (matchers on the labels Prometheus adds itself, ``job`` and
``instance``, aside). What a healthy run cannot fill is named below, with the reason; an entry
there that the run does fill fails too, so the lists stay true.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qlm.catalog import ModelCatalog
from qlm.client import QlmClient
from qlm.gateway.app import ApiKeys, GatewaySettings, serve_gateway
from qlm.tooling.demo import LocalCluster
from qlm.types import SLO, RequestMessage, ResultMessage
from tests.dashboards import Query, Selector, alert_queries, dashboard_queries, selectors
from tests.e2e import gather_replies, running_cluster
from tests.unit.test_metrics_docs import registries

pytestmark = pytest.mark.broker

MODEL = "mistral-7b"
KEY = "sk-qlm-dash-0123456789abcdef"
BURST = 24
AGENT = {"agent_id": "dash", "models": [MODEL], "time_scale": 50.0}
CAPACITY_SPEC = """
pool: west
gpu_cost_per_hour: {A100-80GB: 3.67}
profiles:
  - {model: mistral-7b, gpu_type: A100-80GB, tpm: 400000, gpus: 1, startup_s: 120}
min_instances: 1
max_instances: {mistral-7b: 2}
"""
# Labels Prometheus sets on every series it scrapes (the target's); no qlm metric has them.
TARGET_LABELS = frozenset({"job", "instance"})

# Metrics with no series at all after a healthy run, and why.
NO_SERIES: dict[str, str] = {
    # a series per reason, made by the first requeue (an instance lost, a dispatch that
    # failed, an eviction); nothing is requeued here
    "qlm_requeued_total": "no request is requeued in a healthy run",
}
# Selectors (query title, selector as written) whose label matchers pick series a healthy run
# does not make, and why. The metric itself must have series.
UNMATCHED: dict[tuple[str, str], str] = {
    ("QlmGatewayServerErrors", 'qlm_gateway_requests_total{status=~"5.."}'): (
        "no gateway call fails with 5xx in a healthy run"
    ),
}

Scrape = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value)


def exporter(name: str) -> str | None:
    """The process whose registry defines the sample ``name`` (None: Prometheus's own)."""
    for process, defs in registries().items():
        if any(name in d.sample_names() for d in defs):
            return process
    return None


def parse_scrape(text: str) -> Scrape:
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def written(s: Selector) -> str:
    return s.name + (
        "{" + ",".join(f'{k}{op}"{v}"' for k, op, v in s.matchers) + "}" if s.matchers else ""
    )


def gaps(queries: list[Query], scrapes: dict[str, Scrape]) -> list[str]:
    """What the scrapes leave empty, not counting the allow-listed entries."""
    out = []
    for q in queries:
        for s in selectors(q.promql):
            process = exporter(s.name)
            if process is None:
                assert s.name == "up", f"{q.where}: {s.name} is exported by no qlm process"
                continue  # Prometheus's own series, not a process's
            series = scrapes[process].get(s.name, [])
            if not series and s.name not in NO_SERIES:
                out.append(f"{q.where}: {process} exports no series of {s.name}")
            matched = any(s.matches(labels, ignore=TARGET_LABELS) for labels, _ in series)
            if series and not matched and (q.where, written(s)) not in UNMATCHED:
                out.append(f"{q.where}: no {process} series matches {written(s)}")
    return out


@pytest.fixture
async def gateway_url(isolated_amqp_url: str) -> AsyncIterator[str]:
    gateway = await serve_gateway(
        isolated_amqp_url,
        keys=ApiKeys({KEY: "acme"}),
        catalog=ModelCatalog(),
        settings=GatewaySettings(default_slo_ms=30_000, timeout_s=60),
        host="127.0.0.1",
        port=0,
    )
    try:
        yield gateway.url
    finally:
        await gateway.stop()


def _request(i: int) -> RequestMessage:
    return RequestMessage(
        request_id=f"dash-{i}",
        model=MODEL,
        prompt=f"hello {i}",
        max_tokens=8,
        tenant="acme",
        slo=SLO(e2e_ms=30_000, slo_class="chat"),
    )


async def _scrape(http: httpx.AsyncClient, url: str) -> Scrape:
    return parse_scrape((await http.get(url + "/metrics")).text)


async def _traffic(cluster: LocalCluster, gateway_url: str) -> None:
    amqp_url = cluster.amqp_url
    agent = cluster.agents["dash"]
    async with QlmClient(amqp_url) as client, httpx.AsyncClient(timeout=10) as http:
        # A burst the agent cannot take at once: paused (SIGSTOP, as a host stalled for a
        # moment), it pulls nothing, so the burst waits in the virtual queue and the planner
        # replans it (the plan and scale-up panels). Resumed once a plan is made, well inside
        # the heartbeat timeout.
        agent.send_signal(signal.SIGSTOP)
        try:
            futures = await asyncio.gather(*(client.submit(_request(i)) for i in range(BURST)))
            deadline = time.monotonic() + 10
            while not await _replans(http, cluster.admin_url):
                assert time.monotonic() < deadline, "no replan of the queued burst"
                await asyncio.sleep(0.1)
        finally:
            agent.send_signal(signal.SIGCONT)
        replies = await gather_replies(list(futures), 60)
        assert all(isinstance(r, ResultMessage) for r in replies), replies
        pieces = [p async for p in client.stream(_request(BURST), timeout=60)]
        assert pieces[-1].result is not None and len(pieces) > 1
    headers = {"Authorization": f"Bearer {KEY}"}
    call = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(base_url=gateway_url, headers=headers, timeout=60) as http:
        answered = await http.post("/v1/chat/completions", json=call)
        assert answered.status_code == 200, answered.text
        async with http.stream("POST", "/v1/chat/completions", json={**call, "stream": True}) as r:
            assert r.status_code == 200
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 2


async def _replans(http: httpx.AsyncClient, admin_url: str) -> float:
    return sum(v for _, v in (await _scrape(http, admin_url)).get("qlm_replans_total", []))


async def test_every_dashboard_panel_and_alert_rule_has_series_after_a_real_run(
    isolated_amqp_url: str, gateway_url: str, tmp_path: Path
) -> None:
    spec = tmp_path / "capacity.yaml"
    spec.write_text(CAPACITY_SPEC)
    env = {
        # no command: the autoscaler runs dry (decisions logged and exported, nothing applied)
        "QLM_AUTOSCALE_POLICY": "reactive",
        "QLM_CAPACITY_SPEC": str(spec),
        "QLM_AUTOSCALE_INTERVAL_S": "0.5",
        # the agent's pause must not make its instance lost (that would requeue the burst)
        "QLM_HEARTBEAT_TIMEOUT_S": "20",
    }
    queries = dashboard_queries() + alert_queries()
    async with running_cluster(
        isolated_amqp_url, tmp_path, [AGENT], policy="qlm", extra_env=env
    ) as cluster:
        await _traffic(cluster, gateway_url)
        targets = {
            "Coordinator": cluster.admin_url,
            "Agent": cluster.agent_health["dash"],
            "Gateway": gateway_url,
        }
        # Gauges fed by heartbeats and autoscaler ticks follow within a second or two.
        deadline = time.monotonic() + 20
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                scrapes = {p: await _scrape(http, url) for p, url in targets.items()}
                missing = gaps(queries, scrapes)
                if not missing or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
    assert not missing, "panels or alerts with nothing to show:\n" + "\n".join(missing)
    # the plan panels show a real replan, and the scale-up advice reads 0 (enough A100s)
    coordinator = scrapes["Coordinator"]
    assert coordinator["qlm_replans_total"][0][1] > 0
    assert coordinator["qlm_scale_up_recommended_instances"] == [({"gpu_type": "A100-80GB"}, 0.0)]
    for name, why in NO_SERIES.items():
        assert not scrapes[exporter(name) or ""].get(name), f"{name} has series now ({why})"
    for (where, sel), why in UNMATCHED.items():
        [s] = [s for q in queries if q.where == where for s in selectors(q.promql)
               if written(s) == sel]  # fmt: skip
        series = scrapes[exporter(s.name) or ""].get(s.name, [])
        assert series, f"{sel}: the metric itself has no series"
        assert not any(s.matches(lbl, ignore=TARGET_LABELS) for lbl, _ in series), (sel, why)
