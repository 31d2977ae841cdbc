"""Overload control: beyond the admission limits a new request gets an explicit `overloaded`
error reply (and a dead-letter copy), never a silent drop; redeliveries and duplicates of
tracked requests are never shed; room comes back as requests are answered."""

from __future__ import annotations

import asyncio

import aio_pika
import pytest

from planner import create_policy
from qlm.client import QlmClient
from qlm.coordinator.core import AdmissionLimits, CoordinatorCore
from qlm.coordinator.service import Coordinator
from qlm.store import Store
from qlm.topology import DEAD_LETTER_QUEUE, REASON_HEADER
from qlm.types import SLO, ErrorCode, ErrorMessage, RequestMessage


def _req(rid: str, tenant: str | None = None) -> RequestMessage:
    return RequestMessage(
        request_id=rid,
        model="mistral-7b",
        prompt_token_ids=[1, 2, 3],
        max_tokens=4,
        slo=SLO(e2e_ms=60_000),
        tenant=tenant,
    )


def _admit(core: CoordinatorCore, req: RequestMessage, redelivered: bool = False) -> str:
    _, outcome = core.admit(
        req,
        object(),
        reply_to="r",
        correlation_id=req.request_id,
        received_at=0.0,
        redelivered=redelivered,
    )
    return outcome


def test_global_and_tenant_limits_in_the_core() -> None:
    core = CoordinatorCore(
        create_policy("edf"),
        limits=AdmissionLimits(max_queued=4, max_queued_per_tenant=2, tenant_limits={"big": 3}),
    )
    assert [_admit(core, _req(f"a{i}", "a")) for i in range(3)] == ["new", "new", "overloaded"]
    assert core.last_shed[0] == "tenant" and "'a'" in core.last_shed[1]
    assert "limit 2" in core.last_shed[1]
    assert _admit(core, _req("b0", "big")) == "new"
    assert _admit(core, _req("b1", "big")) == "new"  # tenant "big" may hold 3 ...
    assert _admit(core, _req("n0")) == "overloaded"  # ... but the global limit of 4 binds
    assert core.last_shed[0] == "global"
    # a redelivery or a duplicate of a tracked request is not new load
    assert _admit(core, _req("a0", "a"), redelivered=True) == "redelivered"
    assert _admit(core, _req("a1", "a")) == "duplicate"
    core.finish("a0")  # answered: room again, for its tenant and overall
    assert core.tenant_counts["a"] == 1
    assert _admit(core, _req("a2", "a")) == "new"


@pytest.mark.broker
async def test_requests_beyond_the_limit_get_an_overloaded_reply_and_a_dead_letter(
    isolated_amqp_url: str,
    tmp_path,  # type: ignore[no-untyped-def]
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
            for fut, limit in ((shed_tenant, "tenant"), (shed_global, "global")):
                reply = await asyncio.wait_for(asyncio.shield(fut), 10)
                assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.OVERLOADED
                assert reply.details == {"limit": limit} and "retry later" in reply.message
            assert not any(f.done() for f in kept)  # the admitted ones wait, unanswered
            assert len(coord.core.requests) == 3
            metrics = coord.metrics.render()[0].decode()
            assert 'qlm_shed_requests_total{limit="tenant"} 1.0' in metrics
            assert 'qlm_shed_requests_total{limit="global"} 1.0' in metrics
        conn = await aio_pika.connect(isolated_amqp_url)
        async with conn:
            ch = await conn.channel()
            dead = await ch.get_queue(DEAD_LETTER_QUEUE, ensure=False)
            reasons = []
            for _ in range(2):
                msg = await dead.get(timeout=5, fail=True)
                assert msg is not None
                reasons.append((msg.headers or {}).get(REASON_HEADER))
                await msg.ack()
            assert reasons == ["overloaded", "overloaded"]
    finally:
        await coord.stop()
        await store.close()
