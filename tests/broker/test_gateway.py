"""``qlm gateway`` end to end: the official ``openai`` client against the gateway (uvicorn on a
free port), which publishes to a real broker, served by a real coordinator and a real sim agent.

One cluster and one gateway serve the whole module (starting a cluster takes seconds); each
test uses its own request ids, so tests do not see each other's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import typer
from openai import AsyncOpenAI
from typer.testing import CliRunner

from qlm.admin import serve_admin
from qlm.catalog import ModelCatalog
from qlm.gateway.app import (
    ApiKeys,
    GatewayClient,
    GatewayServer,
    GatewaySettings,
    create_gateway_app,
    serve_gateway,
)
from qlm.gateway.command import register
from qlm.store import Store
from qlm.tooling import localbroker
from qlm.tooling.demo import LocalCluster
from tests.e2e import running_cluster

KEY = "sk-qlm-test-alpha-0123456789"
BLOCKED_KEY = "sk-qlm-test-blocked-0123456789"
TENANT = "alpha"
BLOCKED_TENANT = "blocked"  # its coordinator limit is 0: every request of it is `overloaded`
MODEL = "mistral-7b"
# One sim engine, 5x faster than the modelled A100: a few tokens take milliseconds, a thousand
# take seconds (long enough to disconnect from, or to time out on).
AGENT = {"agent_id": "gw", "models": [MODEL], "time_scale": 5.0}
LONG = 1024  # output tokens of a request that runs for a couple of seconds


@dataclass
class Stack:
    cluster: LocalCluster
    gateway: GatewayServer
    amqp_url: str

    def openai(self, key: str = KEY) -> AsyncOpenAI:
        # No retries: a 429 or 5xx must reach the test, not be retried away.
        return AsyncOpenAI(base_url=self.gateway.url + "/v1", api_key=key, max_retries=0)

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.gateway.url, timeout=30)


@pytest.fixture(scope="module")
def module_amqp_url(amqp_url: str) -> Iterator[str]:
    with localbroker.isolated_vhost(amqp_url) as url:
        yield url


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(
    module_amqp_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    keys = ApiKeys({KEY: TENANT, BLOCKED_KEY: BLOCKED_TENANT})
    with pytest.MonkeyPatch.context() as mp:
        # Read by the coordinator process at start (LocalCluster passes the environment on).
        mp.setenv("QLM_TENANT_LIMITS", json.dumps({BLOCKED_TENANT: 0}))
        cm = running_cluster(module_amqp_url, tmp_path_factory.mktemp("gw"), [AGENT])
        cluster = await cm.__aenter__()
    try:
        gateway = await serve_gateway(
            module_amqp_url,
            keys=keys,
            catalog=ModelCatalog(),
            settings=GatewaySettings(default_slo_ms=30_000, timeout_s=60),
            host="127.0.0.1",
            port=0,
        )
        try:
            yield Stack(cluster, gateway, module_amqp_url)
        finally:
            await gateway.stop()
    finally:
        await cm.__aexit__(None, None, None)


async def _record(
    database_url: str, request_id: str, *, status: str | None = None
) -> dict[str, Any]:
    """The coordinator's store row of a request, once it is there (and in ``status``): the
    store is written asynchronously, so a reply can come before its row."""
    deadline = time.monotonic() + 30
    store = await Store.open(database_url)
    try:
        while True:
            record = await store.get_request(request_id)
            if record is not None and status in (None, record["status"]):
                return record
            assert time.monotonic() < deadline, (request_id, record)
            await asyncio.sleep(0.1)
    finally:
        await store.close()


# --- success paths ---------------------------------------------------------------------------


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_models_lists_what_live_agents_serve(stack: Stack) -> None:
    async with stack.openai() as api:
        models = await api.models.list()
        # the agent serves mistral-7b only; the catalog's other models are not listed
        assert [m.id for m in models.data] == [MODEL]
        card = models.data[0]
        assert card.object == "model" and (card.model_extra or {})["max_model_len"] == 8192
        assert (await api.models.retrieve(MODEL)).id == MODEL
        for absent in ("gpt-4o", "vicuna-13b"):  # unknown; in the catalog but not served
            with pytest.raises(openai.NotFoundError) as err:
                await api.models.retrieve(absent)
            assert err.value.code == "model_not_found"
        assert "not served by any live agent" in err.value.message


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_unserved_model_is_404_at_once(stack: Stack) -> None:
    started = time.monotonic()
    async with stack.openai() as api:
        with pytest.raises(openai.NotFoundError) as err:
            await api.chat.completions.create(
                model="vicuna-13b", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    assert time.monotonic() - started < 5  # not the gateway's timeout: the coordinator's reply
    assert err.value.code == "model_not_found" and err.value.param == "model"
    assert "no live agent serves model 'vicuna-13b'" in err.value.message


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_a_bare_app_without_announcements_lists_the_catalog(stack: Stack) -> None:
    client = GatewayClient(stack.amqp_url)
    await client.connect()
    app = create_gateway_app(client, keys=ApiKeys({KEY: TENANT}), catalog=ModelCatalog())
    server = await serve_admin(app, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.port}/v1"
        async with AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as api:
            models = await api.models.list()
        assert sorted(m.id for m in models.data) == ModelCatalog().names()
    finally:
        await server.stop()
        await client.close()


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_completion_is_answered_from_the_queue_with_usage_and_tenant(stack: Stack) -> None:
    async with stack.openai() as api:
        resp = await api.completions.create(model=MODEL, prompt="Hello there", max_tokens=5)
    assert resp.object == "text_completion" and resp.model == MODEL
    choice = resp.choices[0]
    # The sim generates exactly max_tokens tokens and renders them as "t<id>" words.
    assert len(choice.text.split()) == 5 and choice.finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 5
    assert resp.usage.prompt_tokens == 3  # ceil(len("Hello there") / 4), qlm's estimate
    assert resp.usage.total_tokens == 8
    qlm = (resp.model_extra or {})["qlm"]
    assert resp.id == "cmpl-" + qlm["request_id"] and qlm["instance_id"] == "gw-gpu0"
    record = await _record(stack.cluster.database_url, qlm["request_id"])
    assert record["tenant"] == TENANT  # the API key's tenant reached the coordinator
    assert record["max_tokens"] == 5
    # no SLO in the call: the gateway's default (30 s end to end, set by the fixture)
    assert record["deadline"] - record["submitted_at"] == pytest.approx(30.0, abs=1e-3)
    assert record["ttft_deadline"] is None


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_token_id_prompt_counts_exactly(stack: Stack) -> None:
    async with stack.openai() as api:
        resp = await api.completions.create(model=MODEL, prompt=[5, 6, 7, 8, 9, 10], max_tokens=2)
    assert resp.usage is not None and resp.usage.prompt_tokens == 6


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_chat_with_slo_from_header_and_body(stack: Stack) -> None:
    async with stack.openai() as api:
        resp = await api.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi!"}]},
            ],
            max_completion_tokens=4,
            extra_headers={
                "x-qlm-slo-ms": "12000",
                "x-qlm-slo-class": "header-class",
                "x-qlm-tbt-ms": "5000",
            },
            extra_body={"qlm_ttft_ms": 800, "qlm_slo_class": "interactive", "qlm_priority": 3},
        )
    assert resp.object == "chat.completion"
    msg = resp.choices[0].message
    assert msg.role == "assistant" and len((msg.content or "").split()) == 4
    assert resp.usage is not None and resp.usage.completion_tokens == 4
    rid = (resp.model_extra or {})["qlm"]["request_id"]
    record = await _record(stack.cluster.database_url, rid)
    assert record["deadline"] - record["submitted_at"] == pytest.approx(12.0, abs=1e-3)
    assert record["ttft_deadline"] - record["submitted_at"] == pytest.approx(0.8, abs=1e-3)
    assert record["slo_class"] == "interactive"  # the body field wins over the header
    assert record["priority"] == 3
    qlm_info = (resp.model_extra or {})["qlm"]
    assert qlm_info["tbt_ms"] is not None and qlm_info["slo_met"]  # 4 tokens, 5 s apart at most


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_priority_and_openai_service_tier_map_to_qlm(stack: Stack) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    cases: list[tuple[dict[str, object], int, str | None, float]] = [
        ({"priority": -5}, 5, None, 30.0),  # vLLM: lower is earlier; qlm: higher is
        ({"priority": -50}, 9, None, 30.0),  # clamped to qlm's 0-9
        ({"priority": 7}, 0, None, 30.0),  # deferred in vLLM: qlm's lowest, 0
        ({"priority": -5, "qlm_priority": 2}, 2, None, 30.0),  # qlm's own field wins
        ({"service_tier": "auto"}, 0, "interactive", 30.0),
        ({"service_tier": "default", "qlm_slo_class": "mine"}, 0, "mine", 30.0),
        ({"service_tier": "flex"}, 0, "batch", 86_400.0),  # a long deadline: the batch tier
        ({"service_tier": "flex", "qlm_slo_ms": 90_000}, 0, "batch", 90.0),
    ]
    async with stack.openai() as api:
        for extra, priority, slo_class, deadline_s in cases:
            resp = await api.chat.completions.create(**chat, extra_body=extra)
            rid = (resp.model_extra or {})["qlm"]["request_id"]
            record = await _record(stack.cluster.database_url, rid)
            assert (record["priority"], record["slo_class"]) == (priority, slo_class), extra
            assert record["deadline"] - record["submitted_at"] == pytest.approx(deadline_s), extra
    auth = {"Authorization": f"Bearer {KEY}"}
    async with stack.http() as http:
        for bad, param in (
            ({"service_tier": "scale"}, "service_tier"),
            ({"service_tier": "priority"}, "service_tier"),
            ({"priority": "high"}, "priority"),
            ({"priority": 2**40}, "priority"),
        ):
            r = await http.post("/v1/chat/completions", json={**chat, **bad}, headers=auth)
            assert r.status_code == 400, (bad, r.text)
            error = _assert_openai_error(r.json())
            assert error["param"] == param, error
        r = await http.post(
            "/v1/chat/completions", json={**chat, "service_tier": "scale"}, headers=auth
        )
        assert "'scale' is not supported by qlm (send auto, default, flex" in r.text


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_streaming_chat_sends_the_text_as_chunks_then_done(stack: Stack) -> None:
    async with stack.openai() as api:
        stream = await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count to six."}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    text = "".join(content)
    assert len(text.split()) == 6
    assert any(content)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-gw-")


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_streaming_completion_wire_format(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    async with (
        stack.http() as http,
        http.stream(
            "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = (await resp.aread()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {p["object"] for p in payloads} == {"text_completion"}
    assert len("".join(p["choices"][0]["text"] for p in payloads).split()) == 3
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


async def _sse_events(resp: httpx.Response) -> list[tuple[float, str]]:
    """(arrival time, data) of each SSE event as it is read off the wire."""
    events: list[tuple[float, str]] = []
    async for line in resp.aiter_lines():
        if line.startswith("data: "):
            events.append((time.monotonic(), line.removeprefix("data: ")))
    return events


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_streaming_sends_tokens_as_they_are_generated(stack: Stack) -> None:
    body = {
        "model": MODEL,
        "prompt": "long",
        "max_tokens": LONG,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        stack.http() as http,
        http.stream(
            "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as resp,
    ):
        started = time.monotonic()
        assert resp.status_code == 200
        events = await _sse_events(resp)
    assert events[-1][1] == "[DONE]"
    payloads = [(at, json.loads(data)) for at, data in events[:-1]]
    texts = [(at, p["choices"][0]["text"]) for at, p in payloads if p["choices"]]
    with_text = [at for at, text in texts if text]
    total = events[-1][0] - started
    # the answer takes seconds; its first tokens came in well before the end, and the rest
    # in many chunks along the way, not in one burst
    assert total > 1.0, total
    assert with_text[0] - started < total / 4, (with_text[0] - started, total)
    assert len(with_text) > 20, len(with_text)
    assert with_text[len(with_text) // 2] - started < total * 0.75
    text = "".join(t for _, t in texts)
    assert len(text.split()) == LONG
    assert payloads[-2][1]["choices"][0]["finish_reason"] == "length"
    assert not any(p["choices"][0]["finish_reason"] for _, p in payloads[:-2])
    # include_usage: a last chunk with the usage and no choices
    usage_chunk = payloads[-1][1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == LONG


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_streaming_chat_without_include_usage_has_no_usage_chunk(stack: Stack) -> None:
    async with stack.openai() as api:
        stream = await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=40,
            stream=True,
        )
        chunks = [c async for c in stream]
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len(text.split()) == 40
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_streaming_error_before_the_first_token_is_an_http_error(stack: Stack) -> None:
    async with stack.openai(key=BLOCKED_KEY) as api:
        with pytest.raises(openai.RateLimitError) as err:
            await api.completions.create(model=MODEL, prompt="x", max_tokens=5, stream=True)
    assert err.value.status_code == 429 and err.value.code == "overloaded"
    assert stack.gateway.client.outstanding() == 0


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_client_leaving_mid_stream_cancels_the_request(stack: Stack) -> None:
    client = stack.gateway.client
    body = {"model": MODEL, "prompt": "long", "max_tokens": LONG, "stream": True}
    async with (
        stack.http() as http,
        http.stream(
            "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as resp,
    ):
        rid = resp.headers["x-qlm-request-id"]
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                break  # the stream began: leave
    record = await _record(stack.cluster.database_url, rid, status="cancelled")
    assert record["error_code"] == "cancelled"
    deadline = time.monotonic() + 5
    while rid in client.outstanding_ids():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_concurrent_calls_each_get_their_own_answer(stack: Stack) -> None:
    sizes = [1 + i % 7 for i in range(40)]
    async with stack.openai() as api:
        replies = await asyncio.gather(
            *(
                api.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"#{i}"}], max_tokens=n
                )
                for i, n in enumerate(sizes)
            )
        )
    assert [r.usage.completion_tokens for r in replies if r.usage] == sizes
    assert len({r.id for r in replies}) == len(sizes)
    assert stack.gateway.client.outstanding() == 0


# --- errors ----------------------------------------------------------------------------------


def _assert_openai_error(body: dict[str, object]) -> dict[str, object]:
    error = body["error"]
    assert isinstance(error, dict)
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_missing_or_wrong_api_key_is_401(stack: Stack) -> None:
    async with stack.openai(key="sk-qlm-not-a-key-000000000") as api:
        with pytest.raises(openai.AuthenticationError) as err:
            await api.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    async with stack.http() as http:
        for headers in ({}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer"}):
            r = await http.post("/v1/chat/completions", json={}, headers=headers)
            assert r.status_code == 401, headers
            assert r.headers["www-authenticate"].startswith("Bearer")
            _assert_openai_error(r.json())
        r = await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}x"})
        assert r.status_code == 401


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_malformed_requests_are_400_with_openai_bodies(stack: Stack) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    bad: list[tuple[str, object, str | None]] = [
        ("/v1/chat/completions", b"{not json", None),
        ("/v1/chat/completions", b"", None),
        ("/v1/chat/completions", {"messages": chat["messages"]}, "model"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
        ("/v1/chat/completions", {**chat, "n": 2}, "n"),
        ("/v1/chat/completions", {**chat, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {**chat, "temperature": 3}, "temperature"),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {**chat, "max_tokens": 3, "max_completion_tokens": 4}, None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, "echo"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "robot", "content": "x"}]}, None),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "qlm_slo_ms": -5}, "qlm_slo_ms"),
    ]
    async with stack.http() as http:
        for path, body, param in bad:
            if isinstance(body, bytes):
                r = await http.post(path, content=body, headers=auth)
            else:
                r = await http.post(path, json=body, headers=auth)
            assert r.status_code == 400, (path, body, r.text)
            error = _assert_openai_error(r.json())
            assert error["type"] == "invalid_request_error"
            if param is not None:
                assert error["param"] == param, (body, error)
        r = await http.post(
            "/v1/completions", json={**chat, "prompt": "x"}, headers=auth | {"x-qlm-slo-ms": "soon"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-qlm-slo-ms"
        big = {"model": MODEL, "prompt": "x" * 1_100_000}
        r = await http.post("/v1/completions", json=big, headers=auth)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    async with stack.openai() as api:
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3
            )
        assert err.value.param == "n" and "not supported" in err.value.message
        # Checked by the coordinator, not the gateway: its error reply becomes the same 400.
        with pytest.raises(openai.BadRequestError) as err:
            await api.completions.create(model=MODEL, prompt="x", max_tokens=5000)
    assert err.value.code == "max_tokens_out_of_range"


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_unknown_model_is_404(stack: Stack) -> None:
    async with stack.openai() as api:
        with pytest.raises(openai.NotFoundError) as err:
            await api.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
            )
    assert err.value.code == "model_not_found"
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "model"
    async with stack.http() as http:
        r = await http.get("/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404
    _assert_openai_error(r.json())


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_overloaded_tenant_gets_429_with_retry_after(stack: Stack) -> None:
    async with stack.openai(key=BLOCKED_KEY) as api:
        with pytest.raises(openai.RateLimitError) as err:
            await api.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert err.value.status_code == 429 and err.value.code == "overloaded"
    assert err.value.response.headers["retry-after"] == "1"
    assert "blocked" in err.value.message
    # Another tenant is served meanwhile.
    async with stack.openai() as api:
        ok = await api.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert ok.usage is not None and ok.usage.completion_tokens == 1


# --- disconnects and timeouts ----------------------------------------------------------------


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_client_disconnect_cancels_the_request_and_its_reply_is_dropped(stack: Stack) -> None:
    client = stack.gateway.client
    assert client.outstanding() == 0
    body = {"model": MODEL, "prompt": "long", "max_tokens": LONG}
    async with stack.http() as http:
        call = asyncio.create_task(
            http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        )
        deadline = time.monotonic() + 10
        while client.outstanding() == 0:  # published and waiting
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        (rid,) = client.outstanding_ids()
        call.cancel()  # closes the connection: the client is gone
        with pytest.raises(asyncio.CancelledError):
            await call
    deadline = time.monotonic() + 1.0  # the request itself runs for ~2 s more
    while client.outstanding():
        assert time.monotonic() < deadline, "the gateway kept waiting for a gone client"
        await asyncio.sleep(0.01)
    # It stopped waiting because the client left, not because the answer came, and it
    # cancelled the request: the running attempt is stopped and answered "cancelled", once.
    record = await _record(stack.cluster.database_url, rid, status="cancelled")
    assert record["error_code"] == "cancelled"
    await asyncio.sleep(0.3)  # the reply reaches the gateway's queue
    assert not client.unexpected and rid not in client.reply_counts


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_timeout_mid_stream_is_an_error_event_and_cancels(stack: Stack) -> None:
    impatient = GatewayClient(stack.amqp_url)
    await impatient.connect()
    app = create_gateway_app(
        impatient,
        keys=ApiKeys({KEY: TENANT}),
        catalog=ModelCatalog(),
        settings=GatewaySettings(timeout_s=0.8),
    )
    server = await serve_admin(app, "127.0.0.1", 0)
    body = {"model": MODEL, "prompt": "long", "max_tokens": LONG, "stream": True}
    try:
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as http,
            http.stream(
                "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
            ) as resp,
        ):
            assert resp.status_code == 200  # the stream began before the timeout
            rid = resp.headers["x-qlm-request-id"]
            events = [data for _, data in await _sse_events(resp)]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "timeout" and error["type"] == "timeout_error"
        assert any(json.loads(e).get("choices") for e in events[:-2])  # tokens came first
        record = await _record(stack.cluster.database_url, rid, status="cancelled")
        assert record["error_code"] == "cancelled"
        assert impatient.outstanding() == 0
    finally:
        await server.stop()
        await impatient.close()


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_no_reply_within_the_timeout_is_504(stack: Stack) -> None:
    impatient = GatewayClient(stack.amqp_url)
    await impatient.connect()
    app = create_gateway_app(
        impatient,
        keys=ApiKeys({KEY: TENANT}),
        catalog=ModelCatalog(),
        settings=GatewaySettings(timeout_s=0.3),
    )
    server = await serve_admin(app, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.port}/v1"
        async with AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as api:
            with pytest.raises(openai.APIStatusError) as err:
                await api.completions.create(model=MODEL, prompt="x", max_tokens=LONG)
        assert err.value.status_code == 504 and err.value.code == "timeout"
        assert impatient.outstanding() == 0
    finally:
        await server.stop()
        await impatient.close()


# --- pieces without a broker -----------------------------------------------------------------


def test_api_keys_map_to_tenants_and_bad_keys_are_refused_without_echoing_them() -> None:
    keys = ApiKeys({KEY: "a", BLOCKED_KEY: ""})
    assert keys.tenant_for(KEY) == "a"
    assert keys.tenant_for(BLOCKED_KEY) == ""
    assert keys.tenant_for(KEY[:-1]) is None and keys.tenant_for("") is None
    for bad in ({}, {"tiny-k3y": "a"}, {"sk-has a space-0123456789": "a"}):
        with pytest.raises(ValueError) as err:
            ApiKeys(bad)
        for key in bad:
            assert key not in str(err.value)
    settings = GatewaySettings(api_keys=json.dumps({KEY: "a"}))  # type: ignore[arg-type]
    assert KEY not in repr(settings)
    assert ApiKeys.from_settings(settings).tenant_for(KEY) == "a"
    with pytest.raises(ValueError, match="not JSON") as err:
        ApiKeys.from_settings(GatewaySettings(api_keys=KEY + "{"))  # type: ignore[arg-type]
    assert KEY not in str(err.value)


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_a_tenant_past_its_rate_limit_gets_429_with_openai_s_headers(
    stack: Stack,
) -> None:
    """QLM_GATEWAY_TENANT_RATE_LIMITS: each answer carries OpenAI's x-ratelimit-* headers; the
    call past the limit gets a 429 rate_limit_exceeded with Retry-After (refused before its
    body is read); another tenant, without a limit, is not counted."""
    gateway = await serve_gateway(
        stack.amqp_url,
        keys=ApiKeys({KEY: TENANT, BLOCKED_KEY: BLOCKED_TENANT}),
        catalog=ModelCatalog(),
        settings=GatewaySettings(
            default_slo_ms=30_000, timeout_s=60, tenant_rate_limits={TENANT: 2}
        ),
        host="127.0.0.1",
        port=0,
    )
    auth = {"Authorization": f"Bearer {KEY}"}
    call = {"model": MODEL, "prompt": "Hello there", "max_tokens": 3}
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            answered = [await http.post("/v1/completions", headers=auth, json=call) for _ in "ab"]
            assert [r.status_code for r in answered] == [200, 200]
            assert [r.headers["x-ratelimit-remaining-requests"] for r in answered] == ["1", "0"]
            assert answered[0].headers["x-ratelimit-limit-requests"] == "2"
            refused = await http.post("/v1/completions", headers=auth, json=call)
            assert refused.status_code == 429
            error = refused.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
            assert "2 requests per minute" in error["message"]
            assert refused.headers["Retry-After"] == "30"  # one request at 2 a minute
            assert refused.headers["x-ratelimit-remaining-requests"] == "0"
            # the other tenant has no limit: its calls pass the limiter (the empty body's 400)
            other = {"Authorization": f"Bearer {BLOCKED_KEY}"}
            for _ in range(3):
                r = await http.post("/v1/completions", headers=other, content=b"{}")
                assert r.status_code == 400 and "x-ratelimit-limit-requests" not in r.headers
    finally:
        await gateway.stop()
    # the buckets are each gateway's: the module's gateway, with no limit, serves the tenant
    async with stack.openai() as api:
        resp = await api.completions.create(model=MODEL, prompt="Hello there", max_tokens=2)
        assert resp.choices[0].finish_reason in ("length", "stop")


@pytest.mark.broker
async def test_keys_rotate_through_the_key_file_without_a_restart(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    """A served gateway reads QLM_GATEWAY_API_KEYS_FILE again when it changes: a new key is
    let in and a retired one refused within the check interval; a broken file keeps the keys
    in use; reload_keys() (SIGHUP in `qlm gateway`) reads it at once."""
    new_key = "sk-qlm-test-rotated-0123456789"
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({KEY: TENANT}))

    async def serve(reload_s: float) -> GatewayServer:
        settings = GatewaySettings(api_keys_file=path, api_keys_reload_s=reload_s)
        return await serve_gateway(
            isolated_amqp_url,
            keys=ApiKeys.from_settings(settings),
            catalog=ModelCatalog(),
            settings=settings,
            host="127.0.0.1",
            port=0,
        )

    async def status(http: httpx.AsyncClient, key: str) -> int:
        # the key is checked first: 401, else the empty body's 400 (nothing waits)
        auth = {"Authorization": f"Bearer {key}"}
        return (await http.post("/v1/completions", headers=auth, content=b"{}")).status_code

    async def until(http: httpx.AsyncClient, key: str, accepted: bool) -> None:
        deadline = time.monotonic() + 5
        while (await status(http, key) != 401) != accepted:
            assert time.monotonic() < deadline, (key, accepted)
            await asyncio.sleep(0.05)

    gateway = await serve(0.1)
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
            assert await status(http, KEY) != 401 and await status(http, new_key) == 401
            path.write_text(json.dumps({KEY: TENANT, new_key: TENANT}))  # the overlap
            await until(http, new_key, accepted=True)
            path.write_text(json.dumps({new_key: TENANT}))  # the old one retired
            await until(http, KEY, accepted=False)
            path.write_text("{")  # half written: the keys in use stay
            await asyncio.sleep(0.3)
            assert await status(http, new_key) != 401
    finally:
        await gateway.stop()
    # QLM_GATEWAY_API_KEYS_RELOAD_S=0: read again only when told (SIGHUP)
    path.write_text(json.dumps({KEY: TENANT}))
    gateway = await serve(0)
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
            path.write_text(json.dumps({new_key: TENANT}))
            await asyncio.sleep(0.3)
            assert await status(http, KEY) != 401  # not read again by itself
            assert gateway.reload_keys() and not gateway.reload_keys()
            assert await status(http, KEY) == 401 and await status(http, new_key) != 401
    finally:
        await gateway.stop()


@pytest.mark.broker
async def test_a_gateway_process_reads_its_key_file_again_on_sighup(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    """`qlm gateway` as its own process, the key file checked only on a signal
    (QLM_GATEWAY_API_KEYS_RELOAD_S=0): a new key is refused until `kill -HUP`, then let in."""
    import os
    import signal
    import socket
    import sys

    new_key = "sk-qlm-test-hup-0123456789"
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({KEY: TENANT}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "QLM_AMQP_URL": isolated_amqp_url,
        "QLM_GATEWAY_API_KEYS_FILE": str(path),
        "QLM_GATEWAY_API_KEYS_RELOAD_S": "0",
        "QLM_GATEWAY_PORT": str(port),
    }
    env.pop("QLM_GATEWAY_API_KEYS", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "qlm.cli",
        "gateway",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get("/healthz")).status_code == 200:
                        break
                assert proc.returncode is None and time.monotonic() < deadline
                await asyncio.sleep(0.1)

            async def refused(key: str) -> bool:
                # the key is checked first: 401, else the empty body's 400 (no coordinator
                # needed, nothing waits)
                auth = {"Authorization": f"Bearer {key}"}
                resp = await http.post("/v1/completions", headers=auth, content=b"{}")
                return resp.status_code == 401

            assert await refused(new_key)
            path.write_text(json.dumps({new_key: TENANT}))
            await asyncio.sleep(0.5)
            assert await refused(new_key)  # not read again by itself
            os.kill(proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + 10
            while await refused(new_key):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert await refused(KEY) and proc.returncode is None  # still serving
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=30)


def test_gateway_command_refuses_to_start_without_usable_keys(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cli = typer.Typer()
    register(cli)
    cli.command("noop")(lambda: None)  # two commands: `gateway` is then a subcommand by name
    monkeypatch.delenv("QLM_GATEWAY_API_KEYS", raising=False)
    out = CliRunner().invoke(cli, ["gateway"])
    assert out.exit_code == 2 and "no API keys" in out.output
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({KEY: "a"})[:-1])  # cut short: not JSON
    monkeypatch.setenv("QLM_GATEWAY_API_KEYS_FILE", str(keys_file))
    out = CliRunner().invoke(cli, ["gateway"])
    assert out.exit_code == 2 and "QLM_GATEWAY_API_KEYS_FILE: not JSON" in out.output
    assert KEY not in out.output
    monkeypatch.setenv("QLM_GATEWAY_PORT", "70000")
    out = CliRunner().invoke(cli, ["gateway"])
    assert out.exit_code == 2 and "QLM_GATEWAY_PORT" in out.output


# --- health and metrics ----------------------------------------------------------------------


@pytest.mark.asyncio(loop_scope="module")
async def test_readyz_and_metrics_count_calls_by_route_and_status_and_stream_ttft(
    stack: Stack,
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def scrape(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    async with stack.http() as http:
        assert (await http.get("/healthz")).status_code == 200
        ready = await http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["broker_connected"] is True
        before = scrape((await http.get("/metrics")).text)
        api = stack.openai()
        await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        chunks = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        async for _ in chunks:
            pass
        await http.get("/nope")  # any other path is one bounded label
        resp = await http.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    after = scrape(resp.text)

    def grew(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    route = {"route": "/v1/chat/completions", "status": "200"}
    assert grew("qlm_gateway_requests_total", **route) == 2
    assert grew("qlm_gateway_requests_total", route="other", status="404") == 1
    assert grew("qlm_gateway_request_duration_seconds_count", route="/v1/chat/completions") == 2
    assert grew("qlm_gateway_time_to_first_token_seconds_count", model_name=MODEL) == 1
    assert ("qlm_gateway_requests_waiting", frozenset()) in after
    assert not any("instance" in dict(labels) for _, labels in after)
