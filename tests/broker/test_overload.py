"""Overload control: beyond the admission limits a new request gets an explicit `overloaded`
error reply (and a dead-letter copy, a store row, a metric), never a silent drop; redeliveries
and duplicates of tracked requests, and work an engine already runs after a takeover, are never
shed; room comes back as requests are answered."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aio_pika
import pytest

from qlm.agents.agent import Agent
from qlm.agents.sim import SimEngine
from qlm.client import QlmClient
from qlm.config import Settings
from qlm.coordinator.core import AdmissionLimits, CoordinatorCore
from qlm.coordinator.service import Coordinator
from qlm.planner import create_policy
from qlm.store import Store
from qlm.topology import DEAD_LETTER_QUEUE, REASON_HEADER, REASON_TEXT_HEADER
from qlm.types import SLO, ErrorCode, ErrorMessage, RequestMessage, ResultMessage
from tests.builders import heartbeat, next_messages, wait_until


def _req(rid: str, tenant: str | None = None) -> RequestMessage:
    return RequestMessage(
        request_id=rid,
        model="mistral-7b",
        prompt_token_ids=[1, 2, 3],
        max_tokens=4,
        slo=SLO(e2e_ms=60_000),
        tenant=tenant,
    )


def _admit(
    core: CoordinatorCore, req: RequestMessage, redelivered: bool = False, held: bool = False
) -> str:
    _, outcome = core.admit(
        req,
        object(),
        reply_to="r",
        correlation_id=req.request_id,
        received_at=0.0,
        redelivered=redelivered,
        result_held=held,
    )
    return outcome


def test_global_and_tenant_limits_in_the_core() -> None:
    core = CoordinatorCore(
        create_policy("edf"),
        limits=AdmissionLimits(max_queued=4, max_queued_per_tenant=2, tenant_limits={"big": 3}),
    )
    assert [_admit(core, _req(f"a{i}", "a")) for i in range(3)] == ["new", "new", "overloaded"]
    shed = core.last_shed
    assert shed is not None and (shed.limit, shed.tenant, shed.queued, shed.max_queued) == (
        "tenant",
        "a",
        2,
        2,
    )
    assert "tenant 'a' has 2 requests queued or running (limit 2)" in shed.message()
    assert "a2" not in core.requests and core.tenant_counts["a"] == 2  # not tracked, not counted
    assert _admit(core, _req("b0", "big")) == "new"
    assert _admit(core, _req("b1", "big")) == "new"  # tenant "big" may hold 3 ...
    assert _admit(core, _req("n0")) == "overloaded"  # ... but the global limit of 4 binds
    shed = core.last_shed
    assert shed is not None and shed.details() == {
        "limit": "global",
        "tenant": "",  # no tenant: the default tenant ""
        "queued": 4,
        "max_queued": 4,
    }
    # a redelivery or a duplicate of a tracked request is not new load
    assert _admit(core, _req("a0", "a"), redelivered=True) == "redelivered"
    assert _admit(core, _req("a1", "a")) == "duplicate"
    core.finish("a0")  # answered: room again, for its tenant and overall
    assert core.tenant_counts["a"] == 1
    assert _admit(core, _req("a0", "a")) == "answered"  # a late copy of it: no second reply
    assert _admit(core, _req("a2", "a")) == "new"  # the refused id, retried: admitted now
    assert len(core.requests) == 4


def test_a_tenant_limit_of_zero_refuses_that_tenant_only() -> None:
    core = CoordinatorCore(
        create_policy("edf"), limits=AdmissionLimits(tenant_limits={"blocked": 0})
    )
    assert _admit(core, _req("x", "blocked")) == "overloaded"
    assert [_admit(core, _req(f"o{i}", "other")) for i in range(50)] == ["new"] * 50
    assert _admit(core, _req("d")) == "new"


def test_work_already_running_or_done_after_a_takeover_is_never_shed() -> None:
    """A standby that took over gets the old coordinator's requests redelivered. One an agent
    reports running, or whose result it already holds, is admitted even beyond the limit (it
    counts, so new requests wait for room); any other is new load here and may be shed."""
    core = CoordinatorCore(create_policy("edf"), limits=AdmissionLimits(max_queued=1))
    hb = heartbeat("a")
    hb.instances[0].in_flight = ["running"]
    core.on_heartbeat(hb, now=0.0)
    assert _admit(core, _req("first")) == "new"
    assert _admit(core, _req("running")) == "overloaded"  # not a redelivery: new load
    assert _admit(core, _req("running"), redelivered=True) == "new"
    assert _admit(core, _req("done"), redelivered=True, held=True) == "new"
    assert _admit(core, _req("other"), redelivered=True) == "overloaded"
    assert _admit(core, _req("fresh")) == "overloaded"
    assert len(core.requests) == 3 and core.tenant_counts[""] == 3
    for rid in ("first", "running", "done"):
        core.finish(rid)
    assert core.tenant_counts == {} and _admit(core, _req("fresh")) == "new"


def test_limits_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QLM_MAX_QUEUED", "1000")
    monkeypatch.setenv("QLM_MAX_QUEUED_PER_TENANT", "100")
    monkeypatch.setenv("QLM_TENANT_LIMITS", '{"batch": 500, "blocked": 0}')
    s = Settings()
    assert (s.max_queued, s.max_queued_per_tenant) == (1000, 100)
    assert s.tenant_limits == {"batch": 500, "blocked": 0}
    monkeypatch.setenv("QLM_TENANT_LIMITS", '{"batch": -1}')
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        Settings()
    monkeypatch.setenv("QLM_TENANT_LIMITS", "{}")
    monkeypatch.setenv("QLM_MAX_QUEUED", "0")
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        Settings()


@pytest.mark.broker
async def test_requests_beyond_the_limit_get_an_overloaded_reply_and_a_dead_letter(
    isolated_amqp_url: str,
    tmp_path: Path,
) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    coord = Coordinator(
        amqp_url=isolated_amqp_url,
        policy=create_policy("edf"),
        store=store,
        shards=1,
        limits=AdmissionLimits(max_queued=3, max_queued_per_tenant=2),
    )
    await coord.start()  # no agents: what is admitted stays queued
    try:
        async with QlmClient(isolated_amqp_url) as client:
            kept = [await client.submit(_req(f"t{i}", "t")) for i in range(2)]
            shed_tenant = await client.submit(_req("t2", "t"))
            kept.append(await client.submit(_req("u0", "u")))
            shed_global = await client.submit(_req("u1", "u"))
            expected = {
                "t2": {"limit": "tenant", "tenant": "t", "queued": 2, "max_queued": 2},
                "u1": {"limit": "global", "tenant": "u", "queued": 3, "max_queued": 3},
            }
            texts = {}
            for fut, rid in ((shed_tenant, "t2"), (shed_global, "u1")):
                reply = await asyncio.wait_for(asyncio.shield(fut), 10)
                assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.OVERLOADED
                assert reply.request_id == rid and reply.details == expected[rid]
                texts[rid] = reply.message
            assert texts["t2"] == (
                "overloaded: tenant 't' has 2 requests queued or running (limit 2); retry later"
            )
            assert texts["u1"] == "overloaded: 3 requests queued or running (limit 3); retry later"
            # a copy of a kept request published again is not new load: never shed
            await client.submit(_req("t0", "t"))
            # (same reply route: acked at once and counted, nothing held or added)
            await wait_until(lambda: coord.core.requests["t0"].duplicate_copies == 1)
            assert coord.core.requests["t0"].duplicates == []
            assert not any(f.done() for f in kept)  # the admitted ones wait, unanswered
            assert len(coord.core.requests) == 3
            metrics = coord.metrics.render()[0].decode()
            assert 'qlm_shed_requests_total{limit="tenant"} 1.0' in metrics
            assert 'qlm_shed_requests_total{limit="global"} 1.0' in metrics
            assert 'qlm_requests_total{outcome="rejected"} 2.0' in metrics
        conn = await aio_pika.connect(isolated_amqp_url)
        async with conn:
            ch = await conn.channel()
            dead = await ch.get_queue(DEAD_LETTER_QUEUE, ensure=False)
            letters = {}
            for msg in await next_messages(dead, 2):
                headers = msg.headers or {}
                letters[msg.message_id] = (
                    headers.get(REASON_HEADER),
                    headers.get(REASON_TEXT_HEADER),
                )
                assert RequestMessage.model_validate_json(msg.body).request_id == msg.message_id
                await msg.ack()
            assert letters["t2"][0] == letters["u1"][0] == "overloaded"
            assert "limit 2" in str(letters["t2"][1]) and "limit 3" in str(letters["u1"][1])
        await store.flush()
        row = await store.get_request("t2")
        assert row is not None and (row["status"], row["error_code"]) == ("rejected", "overloaded")
        assert row["history"][-1]["detail"]["limit"] == "tenant"
        assert await store.get_request("t0") is not None
    finally:
        await coord.stop()
        await store.close()


@pytest.mark.broker
async def test_room_comes_back_as_requests_are_answered(
    isolated_amqp_url: str,
    tmp_path: Path,
) -> None:
    """Full, a request is refused; an agent then answers the admitted ones, and the refused
    request, retried under the same id, is admitted and answered."""
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    coord = Coordinator(
        amqp_url=isolated_amqp_url,
        policy=create_policy("edf"),
        store=store,
        shards=1,
        limits=AdmissionLimits(max_queued=2),
    )
    await coord.start()
    engine = SimEngine("A100-80GB", ["mistral-7b"], time_scale=200.0, seed=1)
    agent = Agent(isolated_amqp_url, [engine], agent_id="ovl", heartbeat_interval_s=0.2)
    try:
        async with QlmClient(isolated_amqp_url) as client:
            kept = [await client.submit(_req(f"k{i}")) for i in range(2)]
            refused = await asyncio.wait_for(await client.submit(_req("late")), 10)
            assert isinstance(refused, ErrorMessage) and refused.code == ErrorCode.OVERLOADED
            await agent.start()
            for fut in kept:
                assert isinstance(await asyncio.wait_for(fut, 20), ResultMessage)
            await wait_until(lambda: not coord.core.requests)
        async with QlmClient(isolated_amqp_url) as retry_client:  # a fresh producer retries
            again = await retry_client.request(_req("late"), timeout=20)
            assert isinstance(again, ResultMessage) and again.request_id == "late"
        metrics = coord.metrics.render()[0].decode()
        assert 'qlm_shed_requests_total{limit="global"} 1.0' in metrics
        await store.flush()
        row = await store.get_request("late")
        assert row is not None and row["status"] == "completed"
        assert [h["status"] for h in row["history"]][0] == "rejected"
    finally:
        await agent.stop()
        await coord.stop()
        await store.close()
