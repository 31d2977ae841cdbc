"""An arrival during a replan, through real parts: coordinator and agent (sim engine) on the
real broker in one process, a plan that takes seconds in its worker thread. An arrival that
would start at once (a free batch slot, credit, nothing queued) starts before the plan is in;
the plan then goes on as computed, and every request is answered once."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from qlm.agents.agent import Agent
from qlm.agents.sim import SimEngine
from qlm.client import QlmClient
from qlm.coordinator.service import Coordinator
from qlm.planner import EDFPolicy
from qlm.store import Store
from qlm.types import SLO, RequestMessage, ResultMessage
from tests.builders import wait_until

MODEL = "mistral-7b"


class _SlowPlanEDF(EDFPolicy):
    """EDF whose plans take ``plan_s`` in the worker thread, and say when they ran."""

    def __init__(self, plan_s: float) -> None:
        super().__init__()
        self.plan_s = plan_s
        self.planning = threading.Event()
        self.spans: list[tuple[float, float]] = []

    def plan(self, requests, instances, now):  # type: ignore[no-untyped-def]
        start = time.time()
        self.planning.set()
        time.sleep(self.plan_s)
        plan = super().plan(requests, instances, now)
        self.spans.append((start, time.time()))
        self.planning.clear()
        return plan


def _request(rid: str) -> RequestMessage:
    return RequestMessage(
        request_id=rid,
        model=MODEL,
        prompt_token_ids=list(range(16)),
        max_tokens=4,
        slo=SLO(e2e_ms=60_000),
    )


@pytest.mark.broker
async def test_an_arrival_starts_while_a_slow_plan_is_computed(
    isolated_amqp_url: str, tmp_path: Any
) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    policy = _SlowPlanEDF(plan_s=5.0)
    coord = Coordinator(amqp_url=isolated_amqp_url, policy=policy, store=store, shards=1)
    await coord.start()
    engine = SimEngine("A100-80GB", [MODEL], time_scale=1.0, seed=1)
    agent = Agent(isolated_amqp_url, [engine], agent_id="fp", heartbeat_interval_s=0.2)
    await agent.start()
    try:
        async with QlmClient(isolated_amqp_url) as client:
            await wait_until(
                lambda: (
                    (inst := coord.core.instances.get("fp-gpu0")) is not None
                    and inst.last_status is not None
                    and inst.last_status.active_model == MODEL
                    and inst.credit > 0
                )
            )
            replan = asyncio.create_task(coord.replan())
            await wait_until(policy.planning.is_set)
            reply = await asyncio.wait_for(await client.submit(_request("during")), 20)
            assert isinstance(reply, ResultMessage)
            assert not replan.done()  # answered while the plan was still being computed
            await replan
            assert reply.timestamps.started is not None
            assert reply.timestamps.started < policy.spans[-1][1]
            assert reply.timestamps.started - reply.timestamps.queued < 1.0
            after = await asyncio.wait_for(await client.submit(_request("after")), 20)
            assert isinstance(after, ResultMessage)
            assert client.duplicate_count() == 0
            started = coord.metrics.registry.get_sample_value(
                "qlm_plan_arrivals_total", {"outcome": "started"}
            )
            assert started is not None and started >= 1.0  # "during", and what replans follow
    finally:
        await agent.stop()
        await coord.stop()
        await store.close()
