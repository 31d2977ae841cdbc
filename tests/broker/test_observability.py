"""Health and metrics of real processes: a coordinator and a sim agent as child processes,
scraped over HTTP as the kubelet and Prometheus would; the per-request log lines."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qlm.client import QlmClient
from qlm.types import SLO, RequestMessage, ResultMessage
from tests.e2e import gather_replies, running_cluster

pytestmark = [pytest.mark.broker, pytest.mark.slow]

AGENT = [{"agent_id": "obs-a", "models": ["mistral-7b"], "time_scale": 50.0}]


def families(text: str) -> dict[str, list[tuple[dict[str, str], float, str]]]:
    out: dict[str, list[tuple[dict[str, str], float, str]]] = {}
    for f in text_string_to_metric_families(text):
        out[f.name] = [(s.labels, s.value, s.name) for s in f.samples]
    return out


LATENCIES = (
    "qlm_time_to_first_token_seconds",
    "qlm_e2e_request_latency_seconds",
    "qlm_request_queue_time_seconds",
    "qlm_request_time_per_output_token_seconds",
)


def completions_counted(
    fams: dict[str, list[tuple[dict[str, str], float, str]]], name: str
) -> float:
    return sum(v for _, v, n in fams.get(name, []) if n.endswith("_count"))


async def test_agent_and_coordinator_health_metrics_and_request_log(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    # the default planner (qlm): its solver must not write to stdout either
    async with running_cluster(isolated_amqp_url, tmp_path, AGENT, policy="qlm") as cluster:
        agent_url = cluster.agent_health["obs-a"]
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(agent_url + "/healthz")).status_code == 200
            ready = await http.get(agent_url + "/readyz")
            assert ready.status_code == 200 and ready.json()["agent_id"] == "obs-a"
            assert (await http.get(cluster.admin_url + "/readyz")).status_code == 200
            assert (await http.get(cluster.admin_url + "/healthz")).status_code == 200

            reqs = [
                RequestMessage(
                    request_id=f"obs-{i}",
                    model="mistral-7b",
                    prompt=f"hello {i}",
                    max_tokens=8,
                    tenant="acme",
                    slo=SLO(e2e_ms=30_000, slo_class="chat"),
                )
                for i in range(5)
            ]
            async with QlmClient(isolated_amqp_url) as client:
                replies = await gather_replies([await client.submit(r) for r in reqs], 60)
            assert all(isinstance(r, ResultMessage) for r in replies)

            agent_text = (await http.get(agent_url + "/metrics")).text
            # the coordinator's instance gauges follow heartbeats on its liveness tick, and it
            # records a request's latencies when it consumes the completion report, which may
            # come after the producer already holds the reply
            deadline = asyncio.get_running_loop().time() + 15
            while True:
                coord = await http.get(cluster.admin_url + "/metrics")
                if "qlm_instance_num_requests_running{" in coord.text and all(
                    completions_counted(families(coord.text), name) == 5 for name in LATENCIES
                ):
                    break
                assert asyncio.get_running_loop().time() < deadline, coord.text
                await asyncio.sleep(0.2)
        a = families(agent_text)
        assert a["qlm_agent_ready"][0][1] == 1.0
        assert sum(v for _, v, n in a["qlm_agent_dispatches"] if n.endswith("_total")) == 5
        assert (
            sum(v for lbl, v, n in a["qlm_agent_reports"] if lbl.get("kind") == "completion") == 5
        )
        assert {lbl["instance_id"] for lbl, _, _ in a["qlm_agent_num_requests_running"]} == {
            "obs-a-gpu0"
        }
        c = families(coord.text)
        ttft = [
            (lbl, v) for lbl, v, n in c["qlm_time_to_first_token_seconds"] if n.endswith("_count")
        ]
        assert ttft == [({"model_name": "mistral-7b", "slo_class": "chat", "tenant": "acme"}, 5)]
        for name in LATENCIES:
            assert completions_counted(c, name) == 5, name
        assert {lbl["instance_id"] for lbl, _, _ in c["qlm_instance_num_requests_running"]} == {
            "obs-a-gpu0"
        }
        for fam in (*a.values(), *c.values()):
            for lbl, _, _ in fam:
                assert "instance" not in lbl
        log_text = cluster.logs("coordinator")
    lines = [json.loads(x) for x in log_text.splitlines() if x.startswith("{")]
    outcomes = [x for x in lines if x.get("event") == "request_outcome"]
    assert sorted(x["request_id"] for x in outcomes) == [f"obs-{i}" for i in range(5)]
    for x in outcomes:
        assert x["outcome"] == "answered" and x["met"] is True
        assert x["tenant"] == "acme" and x["model"] == "mistral-7b" and x["slo_class"] == "chat"
        assert x["instance_id"] == "obs-a-gpu0" and x["latency_s"] > 0
    # stdout and stderr of the coordinator are JSON lines only (no solver banner, no print)
    assert all(x.startswith("{") for x in log_text.splitlines() if x.strip()), log_text[:2000]
