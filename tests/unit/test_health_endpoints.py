"""Readiness without a broker: the gateway's and the agent's /readyz say 503 while /healthz
(liveness) says 200, and /metrics renders; in process, over ASGI."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from qlm.agents.health import create_health_app
from qlm.catalog import ModelCatalog
from qlm.gateway.app import ApiKeys, GatewayClient, create_gateway_app


async def test_gateway_not_connected_is_alive_but_not_ready() -> None:
    client = GatewayClient("amqp://guest:guest@127.0.0.1:1/")  # never connected
    app = create_gateway_app(
        client, keys=ApiKeys({"sk-test-0123456789abcdef": "t"}), catalog=ModelCatalog()
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gw"
    ) as http:
        assert (await http.get("/healthz")).status_code == 200
        ready = await http.get("/readyz")
        assert ready.status_code == 503 and ready.json()["broker_connected"] is False
        await http.get("/v1/models")  # 401: no key
        text = (await http.get("/metrics")).text
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert (
        samples[
            ("qlm_gateway_requests_total", frozenset({("route", "/readyz"), ("status", "503")}))
        ]
        == 1
    )  # noqa: E501
    assert (
        samples[
            ("qlm_gateway_requests_total", frozenset({("route", "/v1/models"), ("status", "401")}))
        ]
        == 1
    )  # noqa: E501
    assert samples[("qlm_gateway_requests_waiting", frozenset())] == 0


class _Agent:
    agent_id = "a1"
    instances: dict[str, Any] = {}
    reports = {"completion": 2}
    report_retries = 0
    evictions: dict[str, int] = {}
    reconnects = 1

    class token_streams:  # noqa: N801 - stands in for the attribute
        published = 0
        messages = 0
        publish_failures = 0

    def __init__(self) -> None:
        self.is_ready = False

    def ready(self) -> bool:
        return self.is_ready


async def test_agent_health_app_follows_readiness() -> None:
    agent = _Agent()
    app = create_health_app(agent)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://agent"
    ) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok", "agent_id": "a1"}
        assert (await http.get("/readyz")).status_code == 503
        agent.is_ready = True
        assert (await http.get("/readyz")).status_code == 200
        text = (await http.get("/metrics")).text
    assert "qlm_agent_ready 1.0" in text
    assert 'qlm_agent_reports_total{kind="completion"} 2.0' in text
    assert "qlm_agent_broker_reconnects_total 1.0" in text
