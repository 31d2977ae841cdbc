"""Bad input through the real broker, and the admin API of a live coordinator."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aio_pika
import httpx
import pytest

from qlm.client import QlmClient
from qlm.topology import DEAD_LETTER_QUEUE, REASON_HEADER
from qlm.types import SLO, ErrorMessage, RequestMessage, ResultMessage
from tests.e2e import gather_replies, running_cluster

pytestmark = [pytest.mark.broker, pytest.mark.slow]

ONE_AGENT = [{"agent_id": "h-a", "models": ["mistral-7b"], "time_scale": 50.0}]

GOOD = {
    "request_id": "x",
    "model": "mistral-7b",
    "prompt": "hi",
    "max_tokens": 4,
    "slo": {"e2e_ms": 5000},
}


def body(rid: str, **over: object) -> bytes:
    d = {**GOOD, "request_id": rid, **over}
    return json.dumps({k: v for k, v in d.items() if v is not None}).encode()


HOSTILE = [
    ("invalid_json", b'{"request_id": "bad-json", ', "application/json"),
    ("invalid_encoding", b"\xff\xfe\xfa not utf-8", "application/json"),
    ("schema_violation", body("bad-missing", model=None), "application/json"),
    ("schema_violation", body("bad-type", max_tokens="lots"), "application/json"),
    ("unknown_model", body("bad-model", model="gpt-17"), "application/json"),
    ("schema_violation", body("bad-max0", max_tokens=0), "application/json"),  # ge=1
    ("max_tokens_out_of_range", body("bad-maxbig", max_tokens=100_000), "application/json"),
    ("prompt_too_long", body("bad-long", prompt="word " * 20_000), "application/json"),
    ("body_too_large", b'{"pad": "' + b"a" * (10 * 1024 * 1024) + b'"}', "application/json"),
    ("invalid_content_type", body("bad-ctype"), "text/plain"),
]


async def test_every_bad_input_gets_a_coded_reply_and_a_dead_letter(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    async with running_cluster(isolated_amqp_url, tmp_path, ONE_AGENT) as cluster:
        async with QlmClient(isolated_amqp_url) as client:
            futures = []
            for i, (_, raw, ctype) in enumerate(HOSTILE):
                futures.append(
                    await client.publish_raw(raw, content_type=ctype, correlation_id=f"hostile-{i}")
                )
            replies = await gather_replies(futures, timeout=60)
            # The coordinator is still up and serves a good request afterwards.
            good = RequestMessage(
                request_id="after-hostile",
                model="mistral-7b",
                prompt="hi",
                max_tokens=3,
                slo=SLO(e2e_ms=10_000),
            )
            result = await client.request(good, timeout=60)
        assert cluster.coordinator is not None and cluster.coordinator.poll() is None
    assert isinstance(result, ResultMessage)
    for (expected, _, _), reply in zip(HOSTILE, replies, strict=True):
        assert isinstance(reply, ErrorMessage), reply
        assert reply.code.value == expected, reply
        assert reply.message
    conn = await aio_pika.connect(isolated_amqp_url)
    async with conn:
        ch = await conn.channel()
        dead = await ch.declare_queue(DEAD_LETTER_QUEUE, passive=True)
        reasons = []
        while (m := await dead.get(fail=False, no_ack=True)) is not None:
            reasons.append((m.headers or {}).get(REASON_HEADER))
    assert len(reasons) == len(HOSTILE)
    assert all(reasons)


async def test_admin_api_auth_replan_and_drain(isolated_amqp_url: str, tmp_path: Path) -> None:
    # Slow engines so that work piles up in the virtual queues.
    agents = [
        {"agent_id": "d-a", "models": ["mistral-7b"], "time_scale": 0.5},
        {"agent_id": "d-b", "models": ["mistral-7b"], "time_scale": 0.5},
    ]
    async with running_cluster(isolated_amqp_url, tmp_path, agents) as cluster:
        health = (await cluster.admin("GET", "/healthz")).json()
        assert health == {
            "status": "ok",
            "broker_connected": True,
            "store_ok": True,
            "active": True,
        }, health
        r = await cluster.admin("GET", "/v1/instances", token="wrong")
        assert r.status_code == 403
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{cluster.admin_url}/v1/instances/d-a-gpu0/drain")
            assert r.status_code == 401
            r = await http.post(
                f"{cluster.admin_url}/v1/replan", headers={"Authorization": "Bearer nope"}
            )
            assert r.status_code == 403
        inst = {i["instance_id"]: i for i in (await cluster.admin("GET", "/v1/instances")).json()}
        assert inst["d-a-gpu0"]["status"] == "alive", "unauthorised drain changed state"

        async with QlmClient(isolated_amqp_url) as client:
            for i in range(400):
                await client.submit(
                    RequestMessage(
                        request_id=f"d-{i}",
                        model="mistral-7b",
                        prompt_token_ids=list(range(512)),
                        max_tokens=1000,
                        slo=SLO(e2e_ms=600_000),
                    )
                )
            # wait until both virtual queues hold work
            for _ in range(100):
                queues = {
                    q["instance_id"]: q for q in (await cluster.admin("GET", "/v1/queues")).json()
                }
                if len(queues.get("d-a-gpu0", {}).get("requests", [])) > 5:
                    break
                await asyncio.sleep(0.1)
            queued_a = len(queues["d-a-gpu0"]["requests"])
            queued_b = len(queues["d-b-gpu0"]["requests"])
            assert queued_a > 5

            plan = (await cluster.admin("POST", "/v1/replan")).json()
            assert plan["plan_id"] and plan["n_requests"] >= queued_a
            latest = (await cluster.admin("GET", "/v1/plan")).json()
            assert latest["plan_id"] == plan["plan_id"] and latest["policy"] == "edf"

            r = await cluster.admin("POST", "/v1/instances/d-a-gpu0/drain")
            assert r.status_code == 200, r.text
            assert r.json()["moved"] > 0
            queues = {
                q["instance_id"]: q for q in (await cluster.admin("GET", "/v1/queues")).json()
            }
            assert queues["d-a-gpu0"]["requests"] == []
            assert len(queues["d-b-gpu0"]["requests"]) >= queued_b
            inst = {
                i["instance_id"]: i for i in (await cluster.admin("GET", "/v1/instances")).json()
            }
            assert inst["d-a-gpu0"]["status"] == "draining"
            r = await cluster.admin("POST", "/v1/instances/nope/drain")
            assert r.status_code == 404
            detail = await cluster.admin("GET", "/v1/requests/d-399")
            assert detail.status_code == 200 and detail.json()
