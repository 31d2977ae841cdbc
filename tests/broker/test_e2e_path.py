"""The durable request path end to end: real broker, real coordinator and agent processes."""

from __future__ import annotations

import asyncio
import random
import signal
from collections import Counter
from pathlib import Path

import pytest

from qlm.client import QlmClient
from qlm.types import SLO, RequestMessage, ResultMessage
from tests.e2e import gather_replies, running_cluster, store_counts, store_record

pytestmark = [pytest.mark.broker, pytest.mark.slow]

TWO_AGENTS = [
    {"agent_id": "e2e-a", "models": ["mistral-7b", "vicuna-13b"], "time_scale": 20.0},
    {"agent_id": "e2e-b", "models": ["mistral-7b", "vicuna-13b"], "time_scale": 20.0},
]


def requests(
    n: int,
    prefix: str,
    seed: int = 0,
    max_out: int = 64,
    models: tuple[str, ...] = ("mistral-7b", "vicuna-13b"),
) -> list[RequestMessage]:
    rng = random.Random(seed)
    return [
        RequestMessage(
            request_id=f"{prefix}-{i}",
            model=rng.choice(models),
            prompt_token_ids=[rng.randrange(32000) for _ in range(rng.randint(8, 256))],
            max_tokens=rng.randint(1, max_out),
            slo=SLO(e2e_ms=rng.choice([5_000, 60_000]), slo_class=rng.choice(["chat", "batch"])),
        )
        for i in range(n)
    ]


async def test_500_requests_one_reply_each_and_the_store_agrees(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    reqs = requests(500, "p")
    async with running_cluster(isolated_amqp_url, tmp_path, TWO_AGENTS) as cluster:
        async with QlmClient(isolated_amqp_url) as client:
            futures = [await client.submit(r) for r in reqs]
            replies = await gather_replies(futures, timeout=180)
            await asyncio.sleep(0.5)  # a duplicate, if any, would arrive now
            assert not client.duplicates
        db = cluster.database_url
    assert len(replies) == 500
    by_id = {r.request_id: r for r in reqs}
    for reply in replies:
        assert isinstance(reply, ResultMessage), reply
        req = by_id[reply.request_id]
        assert reply.model == req.model
        assert len(reply.output_token_ids) == req.max_tokens  # the sim ignores EOS
        assert reply.usage.prompt_tokens == len(req.prompt_token_ids or [])
        t = reply.timestamps
        assert t.queued <= (t.started or 0) <= (t.first_token or 0) <= (t.finished or 0)
        assert reply.instance_id in {"e2e-a-gpu0", "e2e-b-gpu0"}
    assert {r.request_id for r in replies} == set(by_id)
    served = Counter(r.instance_id for r in replies)
    assert len(served) == 2, f"load balancing used one instance only: {served}"
    counts = await store_counts(db)
    assert counts.get("completed") == 500, counts


async def test_sigkill_one_of_two_agents_mid_run_still_one_reply_each(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    # Real-time engines with one model each, so that a second in, both hold running batches.
    slow = [dict(a, time_scale=1.0, models=["mistral-7b"]) for a in TWO_AGENTS]
    reqs = requests(300, "k", seed=1, max_out=150, models=("mistral-7b",))
    async with running_cluster(isolated_amqp_url, tmp_path, slow) as cluster:
        async with QlmClient(isolated_amqp_url) as client:
            futures = [await client.submit(r) for r in reqs]
            await asyncio.sleep(1.0)  # work is now running on both agents
            done_before = sum(f.done() for f in futures)
            cluster.kill_agent("e2e-a", signal.SIGKILL)
            replies = await gather_replies(futures, timeout=240)
            await asyncio.sleep(1.0)
            duplicates = dict(client.duplicates)
        db = cluster.database_url
    assert done_before < len(reqs), "the kill must happen mid-run"
    assert duplicates == {}
    assert sorted(r.request_id for r in replies) == sorted(r.request_id for r in reqs)
    assert all(isinstance(r, ResultMessage) for r in replies)
    retried = [r for r in replies if r.attempts > 1]
    assert retried, "the killed agent had requests in flight; they must have been retried"
    assert all(r.instance_id == "e2e-b-gpu0" for r in retried)
    counts = await store_counts(db)
    assert counts.get("completed") == 300, counts
    # The broker's event exchange told the coordinator the moment the agent's connection
    # closed; it did not have to wait for the heartbeat timeout.
    history = (await store_record(db, retried[0].request_id))["history"]
    reasons = [(h.get("detail") or {}).get("reason") for h in history if h["status"] == "requeued"]
    assert reasons == ["connection_closed"], history


@pytest.mark.postgres
async def test_coordinator_on_postgresql(
    isolated_amqp_url: str, isolated_postgres_url: str, tmp_path: Path
) -> None:
    reqs = requests(100, "pg", seed=2)
    async with (
        running_cluster(
            isolated_amqp_url, tmp_path, TWO_AGENTS, database_url=isolated_postgres_url
        ),
        QlmClient(isolated_amqp_url) as client,
    ):
        replies = await gather_replies([await client.submit(r) for r in reqs], timeout=120)
    assert sorted(r.request_id for r in replies) == sorted(r.request_id for r in reqs)
    counts = await store_counts(isolated_postgres_url)
    assert counts.get("completed") == 100, counts


async def test_qlm_policy_serves_everything_and_replans(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    """The stochastic planner behind the live coordinator: every request answered once, and
    an operator replan uses it (plan summary with the planner's feasibility and LSO output)."""
    reqs = requests(300, "q", seed=3)
    async with running_cluster(isolated_amqp_url, tmp_path, TWO_AGENTS, policy="qlm") as cluster:
        async with QlmClient(isolated_amqp_url) as client:
            futures = [await client.submit(r) for r in reqs]
            plan = (await cluster.admin("POST", "/v1/replan")).json()
            replies = await gather_replies(futures, timeout=180)
            await asyncio.sleep(0.5)
            assert not client.duplicates
        summary = (await cluster.admin("GET", "/v1/plan")).json()
    assert plan["policy"] == "qlm"
    assert summary["policy"] == "qlm" and summary["feasible"] is not None
    assert summary["lso"] is not None
    assert sorted(r.request_id for r in replies) == sorted(r.request_id for r in reqs)
    assert all(isinstance(r, ResultMessage) for r in replies)


async def test_a_producer_whose_reply_queue_is_gone_is_served_once(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    """The reply is published without `mandatory`: a vanished reply queue loses the reply,
    and the request is still settled once - never returned, failed and run again."""
    import aio_pika

    from qlm.topology import INGRESS_EXCHANGE

    agents = [dict(TWO_AGENTS[0], models=["mistral-7b"])]
    req = requests(1, "gone", models=("mistral-7b",))[0]
    async with running_cluster(isolated_amqp_url, tmp_path, agents) as cluster:
        async with await aio_pika.connect(isolated_amqp_url) as conn:
            ch = await conn.channel(publisher_confirms=True)
            ingress = await ch.get_exchange(INGRESS_EXCHANGE, ensure=True)
            await ingress.publish(
                aio_pika.Message(
                    req.model_dump_json().encode(),
                    content_type="application/json",
                    message_id=req.request_id,
                    correlation_id=req.request_id,
                    reply_to="qlm.reply.nobody-listens",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=req.request_id,
            )
        db = cluster.database_url
        record: dict[str, object] = {}
        for _ in range(100):
            await asyncio.sleep(0.2)
            record = await store_record(db, req.request_id)
            if record.get("status") == "completed":
                break
        await asyncio.sleep(1.0)  # a second run, if any, would show by now
        record = await store_record(db, req.request_id)
        log = cluster.logs("coordinator")
    assert record["status"] == "completed", record
    assert record["attempts"] == 1, record
    assert "reply_failed" not in log
