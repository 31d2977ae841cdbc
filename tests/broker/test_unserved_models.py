"""Requests for a catalog model no live agent serves: refused `model_not_served` at once, or
after the scale-from-zero hold; never in the grace after the coordinator becomes active (its
agents have not all sent a heartbeat yet). The coordinator also announces what is served on
``qlm.models`` for the gateways, each model with the context its engines accept."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aio_pika
import httpx
import pytest

import qlm.gateway.app as gateway_app
from qlm.agents.agent import Agent
from qlm.agents.http import HttpEngine, HttpSettings
from qlm.agents.sim import SimEngine
from qlm.catalog import ModelCatalog
from qlm.client import QlmClient
from qlm.control import ServedModels
from qlm.coordinator.service import Coordinator
from qlm.gateway.app import ApiKeys, serve_gateway
from qlm.gateway.served import ServedModelsWatcher
from qlm.planner import create_policy
from qlm.store import Store
from qlm.topology import DEAD_LETTER_QUEUE, REASON_HEADER
from qlm.types import SLO, ErrorCode, ErrorMessage, RequestMessage, ResultMessage
from tests.models_server import models_server

pytestmark = pytest.mark.broker


def _req(rid: str, model: str = "mistral-7b") -> RequestMessage:
    return RequestMessage(
        request_id=rid,
        model=model,
        prompt_token_ids=[1, 2, 3],
        max_tokens=2,
        slo=SLO(e2e_ms=60_000),
    )


async def _coordinator(url: str, tmp_path: Path, hold: float | None, grace: float) -> Coordinator:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    coord = Coordinator(
        amqp_url=url,
        policy=create_policy("edf"),
        store=store,
        shards=1,
        liveness_interval_s=0.1,
        unserved_model_hold_s=hold,
        unserved_model_grace_s=grace,
    )
    await coord.start()
    return coord


async def _stop(coord: Coordinator, *agents: Agent) -> None:
    for agent in agents:
        await agent.stop()
    await coord.stop()
    await coord.store.close()


def _agent(url: str, aid: str, models: list[str]) -> Agent:
    engine = SimEngine("A100-80GB", models, time_scale=200.0, seed=1)
    return Agent(url, [engine], agent_id=aid, heartbeat_interval_s=0.1)


async def test_unserved_model_is_refused_at_once_served_one_is_answered(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    coord = await _coordinator(isolated_amqp_url, tmp_path, hold=0.0, grace=0.0)
    agent = _agent(isolated_amqp_url, "us", ["mistral-7b"])
    await agent.start()
    try:
        async with QlmClient(isolated_amqp_url) as client:
            ok = await client.request(_req("served"), timeout=20)
            assert isinstance(ok, ResultMessage)
            started = time.monotonic()
            refused = await client.request(_req("unserved", "vicuna-13b"), timeout=20)
            assert time.monotonic() - started < 2.0  # not held: answered on arrival
        assert isinstance(refused, ErrorMessage) and refused.code == ErrorCode.MODEL_NOT_SERVED
        assert "no live agent serves model 'vicuna-13b'" in refused.message
        assert "served now: mistral-7b" in refused.message
        assert refused.details == {"model": "vicuna-13b", "served": ["mistral-7b"]}
        # a model outside the catalog is still `unknown_model`, checked first
        async with QlmClient(isolated_amqp_url) as client:
            unknown = await client.request(_req("unknown", "gpt-17"), timeout=20)
        assert isinstance(unknown, ErrorMessage) and unknown.code == ErrorCode.UNKNOWN_MODEL
        conn = await aio_pika.connect(isolated_amqp_url)
        async with conn:
            dead = await (await conn.channel()).get_queue(DEAD_LETTER_QUEUE, ensure=False)
            codes = set()
            while (m := await dead.get(fail=False, no_ack=True)) is not None:
                codes.add((m.headers or {}).get(REASON_HEADER))
        assert "model_not_served" in codes
        await coord.store.flush()
        row = await coord.store.get_request("unserved")
        assert row is not None and (row["status"], row["error_code"]) == (
            "rejected",
            "model_not_served",
        )
    finally:
        await _stop(coord, agent)


async def test_grace_after_becoming_active_lets_agents_register_first(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    coord = await _coordinator(isolated_amqp_url, tmp_path, hold=0.0, grace=3.0)
    agent = _agent(isolated_amqp_url, "gr", ["mistral-7b"])
    try:
        async with QlmClient(isolated_amqp_url) as client:
            # the first delivery makes the coordinator active: its grace runs from here
            early = await client.submit(_req("early"))
            never = await client.submit(_req("never", "vicuna-13b"))
            await asyncio.sleep(0.3)
            assert not early.done() and not never.done()  # in the grace: waiting, not refused
            await agent.start()  # registers within the grace
            assert isinstance(await asyncio.wait_for(early, 20), ResultMessage)
            refused = await asyncio.wait_for(never, 5)  # refused once the grace is over
            assert isinstance(refused, ErrorMessage)
            assert refused.code == ErrorCode.MODEL_NOT_SERVED
            # the reply goes out first, then its delivery is acked and the request dropped
            for _ in range(100):
                if not coord.core.requests and not coord._held_unserved:
                    break
                await asyncio.sleep(0.05)
            assert not coord.core.requests and not coord._held_unserved
    finally:
        await _stop(coord, agent)


async def test_hold_waits_for_an_agent_to_come_up_then_refuses(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    coord = await _coordinator(isolated_amqp_url, tmp_path, hold=3.0, grace=0.0)
    agent = _agent(isolated_amqp_url, "sz", ["vicuna-13b"])
    try:
        async with QlmClient(isolated_amqp_url) as client:
            scaled = await client.submit(_req("scaled", "vicuna-13b"))
            started = time.monotonic()
            timed_out = await client.submit(_req("timed-out"))
            await asyncio.sleep(0.3)
            # the scale-from-zero: within the hold (3 s leave a loaded host time to start an agent)
            await agent.start()
            assert isinstance(await asyncio.wait_for(scaled, 20), ResultMessage)
            refused = await asyncio.wait_for(timed_out, 5)
            held = time.monotonic() - started
        assert isinstance(refused, ErrorMessage) and refused.code == ErrorCode.MODEL_NOT_SERVED
        assert "within 3 s" in refused.message
        assert 2.9 <= held < 8.0, held
        await coord.store.flush()
        row = await coord.store.get_request("timed-out")
        assert row is not None and row["error_code"] == "model_not_served"
    finally:
        await _stop(coord, agent)


async def test_no_rule_without_a_hold_setting(isolated_amqp_url: str, tmp_path: Path) -> None:
    """The library default (None): requests for unserved models wait in the queue."""
    coord = await _coordinator(isolated_amqp_url, tmp_path, hold=None, grace=0.0)
    try:
        async with QlmClient(isolated_amqp_url) as client:
            fut = await client.submit(_req("waits", "vicuna-13b"))
            await asyncio.sleep(0.5)
            assert not fut.done() and "waits" in coord.core.requests
    finally:
        await _stop(coord)


async def test_served_models_are_announced_to_gateways(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    watcher = ServedModelsWatcher(isolated_amqp_url)
    await watcher.start()
    coord = await _coordinator(isolated_amqp_url, tmp_path, hold=0.0, grace=0.2)
    a = _agent(isolated_amqp_url, "an-a", ["mistral-7b", "vicuna-13b"])
    b = _agent(isolated_amqp_url, "an-b", ["mistral-7b"])
    try:
        assert await watcher.wait(0.5) is None  # idle and no agents: not active, no list
        await a.start()
        await b.start()

        async def listed(expected: dict[str, int]) -> ServedModels:
            deadline = time.monotonic() + 10
            while True:
                served = await watcher.wait(1.0)
                if served is not None and {m.id: m.instances for m in served.models} == expected:
                    return served
                assert time.monotonic() < deadline, served
                await asyncio.sleep(0.05)

        served = await listed({"mistral-7b": 2, "vicuna-13b": 1})
        lens = {m.id: m.max_model_len for m in served.models}
        assert lens == {"mistral-7b": 8192, "vicuna-13b": 4096}  # the catalog's max_context
        await a.stop()  # graceful: its instance leaves, vicuna-13b is served no more
        await listed({"mistral-7b": 1})
    finally:
        await watcher.close()
        await _stop(coord, b)


async def test_a_request_goes_to_an_engine_whose_context_takes_it_or_is_refused(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    """Engines of one model started with different contexts (sim agents run with
    --max-model-len 3000 and 5000; an http agent whose server says 100,000 for another model):
    the announced max_model_len is the largest they take, never above the catalog's
    max_context; requests between the two contexts are served, each by the engine that takes
    it and never first sent to the other (which would fail it); one beyond every engine's is
    refused `prompt_too_long` at admission, with the limit, rather than sent to an engine that
    would refuse it. When the longer engine leaves, the limit is the shorter one's."""

    watcher = ServedModelsWatcher(isolated_amqp_url)
    await watcher.start()
    coord = await _coordinator(isolated_amqp_url, tmp_path, hold=0.0, grace=0.2)

    def sim(aid: str, models: list[str], context: int) -> Agent:
        engine = SimEngine("A100-80GB", models, time_scale=200.0, seed=1, max_model_len=context)
        return Agent(isolated_amqp_url, [engine], agent_id=aid, heartbeat_interval_s=0.1)

    with models_server([{"id": "vicuna-13b", "max_model_len": 100_000}]) as long:
        agents = [
            sim("ml-sim", ["mistral-7b", "vicuna-13b"], 5000),
            sim("ml-short", ["mistral-7b"], 3000),
            Agent(
                isolated_amqp_url,
                [HttpEngine("vicuna-13b", long, HttpSettings(start_timeout_s=5))],
                agent_id="ml-long",
                engine_name="http",
                heartbeat_interval_s=0.1,
            ),
        ]
        try:
            for agent in agents:
                await agent.start()

            async def listed(expected: dict[str, tuple[int, int]]) -> None:
                deadline = time.monotonic() + 10
                while True:
                    served = await watcher.wait(1.0)
                    got = (
                        {m.id: (m.max_model_len, m.instances) for m in served.models}
                        if served is not None
                        else None
                    )
                    if got == expected:
                        return
                    assert time.monotonic() < deadline, got
                    await asyncio.sleep(0.05)

            # mistral-7b: ml-sim's 5000 (ml-short takes 3000, the catalog 8192); vicuna-13b:
            # the catalog's 4096 (ml-sim takes its own 4096, the server would take 100,000,
            # the coordinator refuses beyond 4096)
            await listed({"mistral-7b": (5000, 2), "vicuna-13b": (4096, 2)})
            between = _req("between").model_copy(
                update={"prompt_token_ids": [7] * 2990, "max_tokens": 20}
            )
            beyond = between.model_copy(
                update={"request_id": "beyond", "prompt_token_ids": [7] * 4990}
            )
            async with QlmClient(isolated_amqp_url) as client:
                # 3010 tokens: beyond ml-short (its engine would fail them), within ml-sim's
                # 5000; several at once, which a load balance would spread over both
                done = await asyncio.gather(
                    *(
                        client.request(
                            between.model_copy(update={"request_id": f"between-{k}"}), timeout=20
                        )
                        for k in range(6)
                    )
                )
                for reply in done:
                    assert isinstance(reply, ResultMessage), reply
                    assert reply.instance_id.startswith("ml-sim"), reply.instance_id
                # and only there: never sent first to ml-short
                await coord.store.flush()
                for k in range(6):
                    row = await coord.store.get_request(f"between-{k}")
                    assert row is not None and row["attempts"] == 1, row
                started = time.monotonic()
                refused = await client.request(beyond, timeout=20)
                assert time.monotonic() - started < 2.0  # said on arrival, not by an engine
                assert isinstance(refused, ErrorMessage), refused
                assert refused.code == ErrorCode.PROMPT_TOO_LONG
                assert "(5000: the largest --max-model-len" in refused.message
                assert refused.details == {
                    "max_model_len": 5000,
                    "prompt_tokens": 4990,
                    "max_tokens": 20,
                }
            # recorded after the error reply's confirm and the ack: it may trail the reply
            deadline = time.monotonic() + 10
            while True:
                await coord.store.flush()
                row = await coord.store.get_request("beyond")
                if row is not None or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert row is not None and row["error_code"] == "prompt_too_long"
            await agents[0].stop()  # the longer engine leaves: ml-short's 3000
            await listed({"mistral-7b": (3000, 1), "vicuna-13b": (4096, 1)})
            again = between.model_copy(update={"request_id": "between-again"})
            assert coord._beyond_engine_context(again) is not None
            fits = between.model_copy(update={"request_id": "fits", "prompt_token_ids": [7] * 2980})
            assert coord._beyond_engine_context(fits) is None  # 3000 tokens in all fit
        finally:
            await watcher.close()
            await _stop(coord, agents[1], agents[2])


async def test_a_server_restarted_with_another_context_is_listed_with_it(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    """An http agent's `vllm serve` restarted with another --max-model-len: once it answers
    again the agent reports the new context with its heartbeats, and the coordinator lists
    it (and places by it) without the agent being restarted."""
    watcher = ServedModelsWatcher(isolated_amqp_url)
    await watcher.start()
    coord = await _coordinator(isolated_amqp_url, tmp_path, hold=0.0, grace=0.2)
    cards = [{"id": "mistral-7b", "object": "model", "max_model_len": 3000}]
    state = {"down": False}
    with models_server(cards, metrics=True, state=state) as url:
        settings = HttpSettings(start_timeout_s=5, metrics_interval_s=0.05)
        agent = Agent(
            isolated_amqp_url,
            [HttpEngine("mistral-7b", url, settings)],
            agent_id="ml-restart",
            engine_name="http",
            heartbeat_interval_s=0.1,
        )
        await agent.start()
        try:

            async def listed(context: int) -> None:
                deadline = time.monotonic() + 10
                while True:
                    served = await watcher.wait(1.0)
                    got = {m.id: m.max_model_len for m in served.models} if served else None
                    if got == {"mistral-7b": context}:
                        return
                    assert time.monotonic() < deadline, got
                    await asyncio.sleep(0.05)

            await listed(3000)
            state["down"] = True
            await asyncio.sleep(0.5)
            cards[0] = {"id": "mistral-7b", "object": "model", "max_model_len": 6000}
            state["down"] = False
            await listed(6000)
            long_req = _req("long").model_copy(
                update={"prompt_token_ids": [7] * 4000, "max_tokens": 20}
            )
            assert coord._beyond_engine_context(long_req) is None
        finally:
            await watcher.close()
            await _stop(coord, agent)


async def test_gateway_without_a_coordinator_answers_503_on_models(
    isolated_amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gateway_app, "_SERVED_WAIT_S", 0.2)
    key = "sk-qlm-test-models-0123456789"
    # the gateway's client needs the topology (its ingress exchange): declare it once
    async with QlmClient(isolated_amqp_url) as setup:
        await setup.ensure_topology(1)
    gateway = await serve_gateway(
        isolated_amqp_url, keys=ApiKeys({key: "t"}), catalog=ModelCatalog(), port=0
    )
    try:
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            r = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "service_unavailable"
            assert gateway.served is not None
            gateway.served.update(
                ServedModels.model_validate(
                    {
                        "sent_at": time.time(),
                        "valid_s": 5,
                        "models": [{"id": "m", "max_model_len": 77, "instances": 1}],
                    }
                )
            )
            r = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.json()["data"] == [
                {"id": "m", "object": "model", "created": 0, "owned_by": "qlm", "max_model_len": 77}
            ]
    finally:
        await gateway.stop()
