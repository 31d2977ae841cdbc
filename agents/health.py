"""The agent's health port: ``GET /healthz``, ``/readyz`` and ``/metrics`` (docs/metrics.md).

The agent has no other HTTP surface, so this is a small app of its own, served in the agent's
event loop by the same embedded uvicorn as the coordinator's admin API. It binds 0.0.0.0:9400 by
default (``qlm agent --health-port``, ``QLM_AGENT_HEALTH_PORT``; 0 turns it off) because the
kubelet's probes and Prometheus come from outside the pod; it shows no request contents, only
counts, and takes no input.

The metrics are read from the agent when Prometheus scrapes (a custom collector), so the hot
path counts plain integers and nothing here can slow a dispatch down; a series for an instance
or model that went away is simply not produced again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from qlm.admin import AdminServer, serve_admin
from qlm.metrics import MetricDef

DEFAULT_HEALTH_PORT = 9400


class _AgentLike(Protocol):  # qlm.agents.agent.Agent, without importing its broker code here
    agent_id: str
    instances: dict[str, Any]
    reports: dict[str, int]
    report_retries: int
    evictions: dict[str, int]
    reconnects: int
    token_streams: Any

    def ready(self) -> bool: ...


_INSTANCE = ("instance_id", "model_name")
# Every family the collector yields: name (as PromQL uses it), type, labels, HELP.
AGENT_METRICS: tuple[MetricDef, ...] = (
    MetricDef("qlm_agent_ready", "gauge", (), "1 when the agent is connected and its engines run"),
    MetricDef(
        "qlm_agent_num_requests_running",
        "gauge",
        _INSTANCE,
        "Requests running in the engine (model_name: its active model)",
    ),
    MetricDef(
        "qlm_agent_num_requests_waiting",
        "gauge",
        _INSTANCE,
        "Requests waiting inside the engine (model_name: its active model)",
    ),
    MetricDef(
        "qlm_agent_kv_cache_usage_perc",
        "gauge",
        _INSTANCE,
        "KV-cache usage of the engine, 1 means 100 percent (model_name: its active model)",
    ),
    MetricDef(
        "qlm_agent_generation_tokens_per_second",
        "gauge",
        _INSTANCE,
        "Output tokens per second the engine generates now (model_name: its active model)",
    ),
    MetricDef(
        "qlm_agent_credit_outstanding",
        "gauge",
        ("instance_id",),
        "Credit granted to the coordinator (Pull) and not yet used by a dispatch",
    ),
    MetricDef(
        "qlm_agent_dispatches_total",
        "counter",
        ("instance_id",),
        "Dispatches received from the coordinator",
    ),
    MetricDef(
        "qlm_agent_evictions_total",
        "counter",
        ("mode",),
        "Running requests stopped on the coordinator's order, by mode (evict | swap)",
    ),
    MetricDef(
        "qlm_agent_reports_total",
        "counter",
        ("kind",),
        "Results published to the coordinator with a confirm, by kind "
        "(completion | failure | evicted)",
    ),
    MetricDef(
        "qlm_agent_report_retries_total",
        "counter",
        (),
        "Result publishes that failed and were tried again",
    ),
    MetricDef(
        "qlm_agent_token_chunks_published_total",
        "counter",
        (),
        "Token chunks of streamed requests published to their producers",
    ),
    MetricDef(
        "qlm_agent_token_messages_published_total",
        "counter",
        (),
        "AMQP messages the token chunks went out in (one per reply queue per flush)",
    ),
    MetricDef(
        "qlm_agent_token_chunks_failed_total",
        "counter",
        (),
        "Token chunks dropped: their publish failed or the outbox was full (best effort)",
    ),
    MetricDef(
        "qlm_agent_broker_reconnects_total",
        "counter",
        (),
        "Broker connections restored after a loss",
    ),
)
_DEFS = {d.name: d for d in AGENT_METRICS}


def _gauge(name: str) -> GaugeMetricFamily:
    d = _DEFS[name]
    return GaugeMetricFamily(d.name, d.help, labels=d.labels)


def _counter(name: str) -> CounterMetricFamily:
    d = _DEFS[name]
    return CounterMetricFamily(d.name.removesuffix("_total"), d.help, labels=d.labels)


class AgentCollector(Collector):
    """Reads an agent's engines and counters at scrape time."""

    def __init__(self, agent: _AgentLike) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Any]:
        a = self.agent
        ready = _gauge("qlm_agent_ready")
        ready.add_metric([], 1.0 if a.ready() else 0.0)
        yield ready
        running = _gauge("qlm_agent_num_requests_running")
        waiting = _gauge("qlm_agent_num_requests_waiting")
        kv = _gauge("qlm_agent_kv_cache_usage_perc")
        tps = _gauge("qlm_agent_generation_tokens_per_second")
        credit = _gauge("qlm_agent_credit_outstanding")
        dispatches = _counter("qlm_agent_dispatches_total")
        for iid, inst in a.instances.items():
            s = inst.engine.stats()
            labels = [iid, s.active_model or ""]
            running.add_metric(labels, s.running)
            waiting.add_metric(labels, s.waiting)
            cap = s.kv_capacity_tokens
            kv.add_metric(labels, min(1.0, s.kv_used_tokens / cap) if cap > 0 else 0.0)
            tps.add_metric(labels, s.tokens_per_s)
            credit.add_metric([iid], inst.admission.owed)
            dispatches.add_metric([iid], inst.admission.received)
        yield from (running, waiting, kv, tps, credit, dispatches)
        evictions = _counter("qlm_agent_evictions_total")
        for mode in sorted({"evict", "swap", *a.evictions}):
            evictions.add_metric([mode], a.evictions.get(mode, 0))
        yield evictions
        reports = _counter("qlm_agent_reports_total")
        for kind, n in sorted(a.reports.items()):
            reports.add_metric([kind], n)
        yield reports
        for name, value in (
            ("qlm_agent_report_retries_total", a.report_retries),
            ("qlm_agent_token_chunks_published_total", a.token_streams.published),
            ("qlm_agent_token_messages_published_total", a.token_streams.messages),
            ("qlm_agent_token_chunks_failed_total", a.token_streams.publish_failures),
            ("qlm_agent_broker_reconnects_total", a.reconnects),
        ):
            c = _counter(name)
            c.add_metric([], value)
            yield c


class AgentMetrics:
    """The agent's registry (private, like the coordinator's)."""

    def __init__(self, agent: _AgentLike) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(AgentCollector(agent))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def definitions(self) -> list[MetricDef]:
        return sorted(AGENT_METRICS, key=lambda d: d.name)


def create_health_app(agent: _AgentLike, metrics: AgentMetrics | None = None) -> FastAPI:
    m = metrics or AgentMetrics(agent)
    app = FastAPI(title="qlm agent", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        # Liveness: the event loop answers. A lost broker is reconnected by the agent itself.
        return JSONResponse({"status": "ok", "agent_id": agent.agent_id})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ready = agent.ready()
        return JSONResponse(
            {"status": "ok" if ready else "not_ready", "agent_id": agent.agent_id},
            status_code=200 if ready else 503,
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        # On the loop on purpose (not the threadpool): the collector reads the agent's state,
        # which the loop alone changes.
        body, content_type = m.render()
        return Response(content=body, media_type=content_type)

    return app


async def serve_health(agent: _AgentLike, host: str, port: int) -> AdminServer:
    """Serve the health app on ``host:port`` (0: any free port) in the current loop."""
    return await serve_admin(create_health_app(agent), host, port)
