"""Hostile input over the real broker (issue 20): every message a producer can craft gets one
coded error reply on its first delivery (or is served), never a handler exception retried up to
the delivery limit, and never a dropped coordinator connection.

AMQP properties that are not UTF-8 cannot be sent with aio-pika (pamqp encodes strictly), so
:class:`RawPublisher` speaks just enough AMQP 0-9-1 over a socket to publish arbitrary property
bytes: the content header frame is built by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import pamqp.encode
import pamqp.frame
import pytest
from aio_pika.abc import AbstractIncomingMessage

from qlm import amqp as qlm_amqp
from qlm.admin import create_admin_app, serve_admin
from qlm.agents.agent import Agent
from qlm.agents.sim import SimEngine
from qlm.catalog import ModelCatalog
from qlm.client import QlmClient
from qlm.coordinator.core import AdmissionLimits, CoordinatorCore
from qlm.coordinator.service import Coordinator
from qlm.coordinator.validation import RAW_PROPERTIES_HEADER
from qlm.gateway.app import ApiKeys, GatewaySettings, serve_gateway
from qlm.metrics import CoordinatorMetrics
from qlm.planner import create_policy
from qlm.store import Store
from qlm.tooling.chaos.rawamqp import RawPublisher, raw_table
from qlm.topology import DEAD_LETTER_QUEUE, REASON_HEADER, REASON_TEXT_HEADER, STREAM_TAP_QUEUE
from qlm.types import SLO, ErrorCode, ErrorMessage, RequestMessage, ResultMessage
from tests.unit.test_admin_api import MemoryBackend

MODEL = "mistral-7b"


# ----------------------------------------------------------------------------- raw publishing
# RawPublisher, raw_table, content_header_frame: qlm/tooling/chaos/rawamqp.py (shared with qlm
# chaos)


# ----------------------------------------------------------------------------- a live cluster


def request_body(rid: str, **fields: Any) -> bytes:
    doc: dict[str, Any] = {
        "request_id": rid,
        "model": MODEL,
        "prompt_token_ids": [1, 2, 3],
        "max_tokens": 4,
        "slo": {"e2e_ms": 60_000},
    }
    doc.update(fields)
    return json.dumps(doc).encode()


@dataclass
class Replies:
    """Every reply delivered to one reply queue, by correlation id."""

    queue: str
    by_cid: dict[str | None, list[dict[str, Any]]] = field(
        default_factory=lambda: defaultdict(list)
    )

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        self.by_cid[message.correlation_id].append(json.loads(message.body))
        await message.ack()

    async def wait(self, cid: str, timeout: float = 15.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.by_cid.get(cid):
            assert time.monotonic() < deadline, f"no reply for {cid}"
            await asyncio.sleep(0.02)
        return self.by_cid[cid][0]


@dataclass
class Live:
    coord: Coordinator
    url: str
    replies: Replies
    reconnects: list[float]
    ingest_calls: dict[str, int]
    handler_errors: list[str]

    def assert_connection_kept(self) -> None:
        assert not self.reconnects, "the coordinator's connection dropped and reconnected"
        assert self.coord._conn is not None and not self.coord._conn.is_closed
        alive = [i.status for i in self.coord.core.instances.values()]
        assert alive and all(s == "alive" for s in alive), alive


@contextlib.asynccontextmanager
async def live_cluster(
    url: str, tmp_path: Path, *, with_agent: bool = True, **coord_kw: Any
) -> AsyncIterator[Live]:
    """An in-process coordinator (one shard) and sim agent, and a reply queue to publish to."""
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    coord = Coordinator(
        amqp_url=url, policy=create_policy("edf"), store=store, shards=1, **coord_kw
    )
    calls: dict[str, int] = defaultdict(int)
    errors: list[str] = []
    real_ingest = coord._ingest

    async def counting(message: AbstractIncomingMessage) -> None:
        calls[qlm_amqp.escape_raw(message.correlation_id or "")] += 1
        try:
            await real_ingest(message)
        except Exception as exc:
            errors.append(repr(exc)[:300])
            raise

    coord._ingest = counting  # type: ignore[method-assign]
    await coord.start()
    reconnects: list[float] = []
    assert coord._conn is not None
    coord._conn.reconnect_callbacks.add(lambda *_: reconnects.append(time.monotonic()))
    agent = None
    if with_agent:
        engine = SimEngine("A100-80GB", [MODEL], time_scale=200.0, seed=1)
        agent = Agent(url, [engine], agent_id="hostile", heartbeat_interval_s=0.2)
        await agent.start()
    conn = await aio_pika.connect(url)
    try:
        ch = await conn.channel()
        q = await ch.declare_queue(f"qlm.reply.hostile-{uuid.uuid4().hex}", exclusive=True)
        replies = Replies(q.name)
        await q.consume(replies.on_message)
        deadline = time.monotonic() + 15
        while with_agent and not coord.core.instances:
            assert time.monotonic() < deadline, "the agent never registered"
            await asyncio.sleep(0.05)
        yield Live(coord, url, replies, reconnects, calls, errors)
    finally:
        await conn.close()
        if agent is not None:
            await agent.stop()
        await coord.stop()
        await store.close()


async def assert_served_once(live: Live, rid: str) -> None:
    """A valid request published now is answered with a result, exactly once."""
    async with QlmClient(live.url) as client:
        reply = await client.request(
            RequestMessage(
                request_id=rid,
                model=MODEL,
                prompt_token_ids=[1, 2, 3],
                max_tokens=4,
                slo=SLO(e2e_ms=60_000),
            ),
            timeout=20,
        )
        await asyncio.sleep(0.3)  # a second reply, if any, would come now
        assert isinstance(reply, ResultMessage), reply
        assert client.reply_counts.get(rid) == 1 and not client.duplicates


def read_dead_letters_without_qlm(url: str) -> list[dict[str, Any]]:
    """Every message in qlm.dead, read by a plain aio-pika in another process (no qlm import,
    so pamqp decodes strictly): what an operator's tool would see."""
    script = """
import asyncio, json, sys
import aio_pika
async def main():
    out = []
    async with await aio_pika.connect(sys.argv[1]) as conn:
        ch = await conn.channel()
        q = await ch.get_queue(sys.argv[2], ensure=False)
        while (m := await q.get(fail=False, timeout=5)) is not None:
            out.append({"message_id": m.message_id, "correlation_id": m.correlation_id,
                        "reply_to": m.reply_to, "content_type": m.content_type,
                        "headers": m.headers, "body": m.body.decode("utf-8", "replace")})
            await m.ack()
    text = lambda v: v.decode("latin-1") if isinstance(v, (bytes, bytearray)) else str(v)
    print(json.dumps(out, default=text))
asyncio.run(main())
"""
    done = subprocess.run(
        [sys.executable, "-c", script, url, DEAD_LETTER_QUEUE],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return list(json.loads(done.stdout))


# ----------------------------------------------------------------------------- 1. properties


def test_the_tolerant_decoding_patch_is_installed() -> None:
    """qlm.amqp patched pamqp at import; an upgrade of another shape would warn and skip it."""
    import pamqp.decode

    assert qlm_amqp.install_tolerant_decoding()
    _, value = pamqp.decode.short_str(b"\x03a\xffb")
    assert qlm_amqp.has_raw_bytes(value) and qlm_amqp.escape_raw(value) == "a\\xffb"
    assert value.encode("utf-8", "surrogateescape") == b"a\xffb"
    assert pamqp.decode.short_str(b"\x02ok") == (3, "ok")  # valid text: as before
    _, table = pamqp.decode.field_table(raw_table({b"k\xfe": 1, "fine": {b"\xff": "x"}}))
    assert [qlm_amqp.escape_raw(k) for k in table] == ["k\\xfe", "fine"]
    assert pamqp.decode.timestamp(struct.pack(">Q", 2**63)) == (8, None)


BAD = b"\xff\xfe-not-utf8"
PROPERTY_CASES = ["message_id", "correlation_id", "content_type", "type", "app_id", "header_key"]


@pytest.mark.broker
async def test_properties_that_are_not_utf8_are_refused_without_dropping_the_connection(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    async with live_cluster(isolated_amqp_url, tmp_path) as live:
        async with RawPublisher(isolated_amqp_url) as raw:
            for case in PROPERTY_CASES:
                rid = f"bad-{case}"
                props: dict[str, Any] = {
                    "content_type": "application/json",
                    "message_id": rid,
                    "correlation_id": rid,
                    "reply_to": live.replies.queue,
                    "delivery_mode": 2,
                    "headers": {"x-trace": "t-1"},
                }
                if case == "header_key":
                    props["headers"] = {b"x-\xffkey": "v", "x-trace": b"raw\xffvalue"}
                else:
                    props[case] = BAD
                await raw.publish(request_body(rid), props, routing_key=rid)
            # reply_to itself broken: no reply can be sent, only the dead letter
            await raw.publish(
                request_body("bad-reply_to"),
                {"message_id": "bad-reply_to", "correlation_id": "x", "reply_to": BAD},
                routing_key="bad-reply_to",
            )
            # hostile bytes that are not refused: a routing key, an out-of-range timestamp
            await raw.publish(
                request_body("rk-ok"),
                {"correlation_id": "rk-ok", "reply_to": live.replies.queue},
                routing_key=b"rk\xff\xfe",
            )
            await raw.publish(
                request_body("ts-ok"),
                {"correlation_id": "ts-ok", "reply_to": live.replies.queue, "timestamp": 2**63},
                routing_key="ts-ok",
            )
        for case in PROPERTY_CASES:
            rid = f"bad-{case}"
            # a broken correlation_id is not echoed: the reply carries the request id instead
            reply = ErrorMessage.model_validate(await live.replies.wait(rid))
            assert reply.code == ErrorCode.INVALID_PROPERTY, (case, reply)
            assert reply.request_id == rid, case  # from message_id, else from the body
            assert reply.details is not None
            raw_props = reply.details["properties"]
            if case == "header_key":
                assert raw_props == {"header_keys": ["x-\\xffkey"]}
            else:
                assert raw_props == {case: "\\xff\\xfe-not-utf8"}, case
        for cid in ("rk-ok", "ts-ok"):
            assert ResultMessage.model_validate(await live.replies.wait(cid)).request_id == cid
        await assert_served_once(live, "valid-after")
        live.assert_connection_kept()
        assert not live.handler_errors, live.handler_errors
        # each was handled once: refused on its first delivery, never retried
        assert all(n == 1 for n in live.ingest_calls.values()), dict(live.ingest_calls)
        assert all(len(v) == 1 for v in live.replies.by_cid.values())
        await live.coord.store.flush()
        row = await live.coord.store.get_request("bad-reply_to")
        assert row is not None and row["error_code"] == "invalid_property"

    letters = {
        json.loads(d["body"])["request_id"]: d
        for d in read_dead_letters_without_qlm(isolated_amqp_url)
    }
    assert set(letters) == {f"bad-{c}" for c in PROPERTY_CASES} | {"bad-reply_to"}
    for case in [*PROPERTY_CASES, "reply_to"]:
        letter = letters[f"bad-{case}"]
        headers = letter["headers"]
        assert headers[REASON_HEADER] == "invalid_property"
        assert "not valid UTF-8" in headers[REASON_TEXT_HEADER]
        kept = headers[RAW_PROPERTIES_HEADER]
        if case == "header_key":
            assert kept == {"header_keys": ["x-\\xffkey"]}
            assert headers["x-\\xffkey"] == "v"  # renamed, value kept
            assert headers["x-trace"] == "raw\xffvalue"  # bytes kept exactly (latin-1 here)
        else:
            assert kept == {case: "\\xff\\xfe-not-utf8"}
            # left out of the copy (aio-pika gives a message without one a fresh message_id)
            assert "not-utf8" not in str(letter.get(case)), (case, letter.get(case))
    assert letters["bad-message_id"]["correlation_id"] == "bad-message_id"
    assert letters["bad-correlation_id"]["message_id"] == "bad-correlation_id"


# ----------------------------------------------------------------------------- 2-4. bodies


def _deep(depth: int) -> bytes:
    return b'{"request_id": "deep", "x": ' + b"[" * depth + b"]" * depth + b"}"


# 4. integers no float holds, in every numeric field
BIG_FIELDS: dict[str, dict[str, Any]] = {
    "e2e": {"slo": {"e2e_ms": 10**400}},
    "ttft": {"slo": {"ttft_ms": 10**400}},
    "tbt": {"slo": {"e2e_ms": 1000, "tbt_ms": 10**400}},
    "task": {"task": {"task_id": "t", "task_slo_ms": 10**400}},
    "remaining": {"task": {"task_id": "t", "task_slo_ms": 1, "remaining_ms": 10**400}},
    "program": {
        "stage": {
            "program_id": "p",
            "app_type": "a",
            "stage_id": "s",
            "program_slo_ms": 10**400,
        }
    },
    "max_tokens": {"max_tokens": 10**400},
    "token_id": {"prompt_token_ids": [10**400]},
    "seed": {"sampling": {"seed": 10**400}},
    "top_k": {"sampling": {"top_k": 10**400}},
    "priority": {"priority": 10**400},
    "step": {"task": {"task_id": "t", "step": 10**400}},
    "started": {"task": {"task_id": "t", "task_started_at": 10**400}},
}


HOSTILE_BODIES: dict[str, tuple[bytes, ErrorCode]] = {
    # 2. parser-level failures: an immediate coded error
    "deep-json": (_deep(10_000), ErrorCode.INVALID_JSON),
    "huge-int": (
        b'{"request_id": "huge-int", "max_tokens": ' + b"9" * 5000 + b"}",
        ErrorCode.INVALID_JSON,
    ),
    "surrogate-prompt": (
        request_body("surrogate-prompt", prompt_token_ids=None, prompt="hi \ud800 there"),
        ErrorCode.INVALID_JSON,
    ),
    "surrogate-messages": (
        request_body(
            "surrogate-messages",
            prompt_token_ids=None,
            messages=[{"role": "user", "content": "\udfff"}],
        ),
        ErrorCode.INVALID_JSON,
    ),
    # 3. submitted_at
    **{
        f"submitted-{name}": (
            request_body(f"submitted-{name}", submitted_at=value),
            ErrorCode.SCHEMA_VIOLATION,
        )
        for name, value in (("nan", float("nan")), ("inf", float("inf")), ("-inf", -float("inf")))
    },
    "submitted-future": (
        request_body("submitted-future", submitted_at=time.time() + 3600),
        ErrorCode.SUBMITTED_IN_FUTURE,
    ),
    # 4. integers no float holds
    **{
        f"big-{name}": (request_body(f"big-{name}", **fields), ErrorCode.SCHEMA_VIOLATION)
        for name, fields in BIG_FIELDS.items()
    },
}


@pytest.mark.broker
async def test_hostile_bodies_get_one_coded_error_on_their_first_delivery(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    async with live_cluster(isolated_amqp_url, tmp_path) as live:
        async with QlmClient(isolated_amqp_url) as client:
            futures = {
                name: await client.publish_raw(body, correlation_id=name)
                for name, (body, _) in HOSTILE_BODIES.items()
            }
            for name, fut in futures.items():
                reply = await asyncio.wait_for(fut, 15)
                assert isinstance(reply, ErrorMessage), (name, reply)
                assert reply.code == HOSTILE_BODIES[name][1], (name, reply)
            # a submitted_at within the clock-skew allowance is served, and its e2e_ms is
            # measured from it (so never negative with met: true)
            ahead = await client.publish_raw(
                request_body("skew-ok", submitted_at=time.time() + 5), correlation_id="skew-ok"
            )
            served = await asyncio.wait_for(ahead, 20)
            assert isinstance(served, ResultMessage), served
            await asyncio.sleep(0.3)
            assert not client.duplicates
        assert all(live.ingest_calls[name] == 1 for name in HOSTILE_BODIES), live.ingest_calls
        assert not live.handler_errors, live.handler_errors
        # nothing was tracked or counted for any of them
        assert not live.coord.core.requests and not live.coord.core.tenant_counts
        await assert_served_once(live, "valid-after-bodies")
        live.assert_connection_kept()


async def test_bad_messages_on_the_stream_tap_are_dropped_and_a_barrier_still_passes(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    """The coordinator's stream tap (qlm.streams.tap) takes only token messages: anything else
    that reaches it (a trusted agent's bug) is counted and dropped, chunks for requests it
    does not track change nothing, and its loss barrier still comes back behind them."""
    async with live_cluster(isolated_amqp_url, tmp_path) as live:
        conn = await aio_pika.connect(isolated_amqp_url)
        try:
            ch = await conn.channel()
            bodies = [
                b"not json",
                b'{"type": "tokens"}',
                b'{"type": "result", "request_id": "x"}',
                json.dumps(
                    {"type": "tokens", "request_id": "nobody", "offset": 0, "token_ids": [1]}
                ).encode(),
                b"x" * (live.coord.max_body_bytes + 1),
            ]
            for body in bodies:
                await ch.default_exchange.publish(
                    aio_pika.Message(body, type="tokens"), routing_key=STREAM_TAP_QUEUE
                )
        finally:
            await conn.close()
        assert await live.coord._tap_barrier(5.0), "the barrier did not come back"
        assert live.coord.tap_messages == len(bodies)
        assert live.coord.tap_rejected == len(bodies) - 1  # all but the chunk for nobody
        await assert_served_once(live, "valid-after-tap")
        live.assert_connection_kept()


# ----------------------------------------------------------------------------- 5. admission


def test_a_failure_in_admission_releases_the_tenant_count() -> None:
    core = CoordinatorCore(create_policy("edf"), limits=AdmissionLimits(max_queued_per_tenant=1))
    # past validation (model_construct): deadline arithmetic on a 400-digit SLO overflows
    broken = RequestMessage.model_construct(
        request_id="overflow",
        model=MODEL,
        prompt_token_ids=[1, 2],
        max_tokens=4,
        slo=SLO.model_construct(e2e_ms=10**400, ttft_ms=None, tbt_ms=None, slo_class=None),
        tenant="t",
        submitted_at=None,
        task=None,
        stage=None,
        priority=0,
    )
    with pytest.raises(OverflowError):
        core.admit(broken, object(), reply_to=None, correlation_id=None, received_at=time.time())
    assert core.tenant_counts == {} and "overflow" not in core.requests

    def crash(*_: Any) -> Any:
        raise RuntimeError("placement failed")

    ok = RequestMessage(
        request_id="placed",
        model=MODEL,
        prompt_token_ids=[1],
        max_tokens=4,
        slo=SLO(e2e_ms=1000),
        tenant="t",
    )
    real_place = core.policy.place
    core.policy.place = crash  # type: ignore[method-assign,assignment]
    with pytest.raises(RuntimeError):
        core.admit(ok, object(), reply_to=None, correlation_id=None, received_at=time.time())
    assert core.tenant_counts == {} and "placed" not in core.requests
    assert not core.unassigned
    # the tenant's one slot is free: the same request (its redelivery) is admitted afresh
    core.policy.place = real_place  # type: ignore[method-assign]
    tracked, outcome = core.admit(
        ok,
        object(),
        reply_to=None,
        correlation_id=None,
        received_at=time.time(),
        redelivered=True,
    )
    assert outcome == "new" and tracked is not None and core.tenant_counts == {"t": 1}


# ----------------------------------------------------------------------------- 6. forged headers


@pytest.mark.broker
async def test_a_forged_delivery_count_never_makes_a_second_reply(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    """A producer sets x-delivery-count (and x-death, x-qlm-*) itself. The handler fails once
    (a transient fault): on its first delivery that must not count as the last one, or the
    producer gets a delivery_limit error and then, on the redelivery, its real answer."""
    async with live_cluster(isolated_amqp_url, tmp_path, delivery_limit=2) as live:
        seen: list[tuple[bool, Any]] = []
        counting = live.coord._ingest

        async def flaky(message: AbstractIncomingMessage) -> None:
            if message.correlation_id == "forged":
                seen.append(
                    (bool(message.redelivered), (message.headers or {}).get("x-delivery-count"))
                )
                if len(seen) == 1:
                    raise RuntimeError("a transient fault")
            await counting(message)

        live.coord._ingest = flaky  # type: ignore[method-assign]
        forged = {
            "x-delivery-count": 99,
            "x-death": [{"reason": "delivery_limit", "count": 99}],
            "x-qlm-error-code": "forged",
        }
        async with QlmClient(isolated_amqp_url) as client:
            fut = await client.publish_raw(
                request_body("forged"), correlation_id="forged", headers=forged
            )
            reply = await asyncio.wait_for(fut, 20)
            await asyncio.sleep(1.0)  # a second reply, if any, would come now
            assert isinstance(reply, ResultMessage), reply
            assert client.reply_counts.get("forged") == 1 and not client.duplicates
            # the broker replaced the forged count on the redelivery with its own
            assert seen[:2] == [(False, 99), (True, 1)], seen
            # at that count (half the limit of 2) the coordinator refreshed the delivery: its
            # own copy, a first delivery without the forged count (qlm/coordinator/refresh.py)
            assert all(s == (False, None) for s in seen[2:]), seen
            # and on a refused message, the forged headers do not reach the dead letter
            bad = await client.publish_raw(b"{}", correlation_id="forged-bad", headers=forged)
            assert (await asyncio.wait_for(bad, 10)).code == ErrorCode.SCHEMA_VIOLATION  # type: ignore[union-attr]
        live.assert_connection_kept()
    letters = read_dead_letters_without_qlm(isolated_amqp_url)
    assert len(letters) == 1
    headers = letters[0]["headers"]
    assert headers[REASON_HEADER] == "schema_violation"
    # the broker's own count (if it sets one on qlm.dead), never the forged 99
    assert "x-death" not in headers and headers.get("x-delivery-count", 0) != 99


# ----------------------------------------------------------------------------- 7. admin token


async def test_admin_token_must_match_to_the_byte_inside_the_header_value() -> None:
    token = "s3cret-token-0123456789"
    app = create_admin_app(MemoryBackend(), token=token, metrics=CoordinatorMetrics())
    server = await serve_admin(app, "127.0.0.1", 0)
    try:
        for value, status in [
            (f"Bearer {token}", 200),
            # whitespace around a field value is not part of it (RFC 9110 section 5.5): the
            # HTTP server drops it, so this is the token itself
            (f"Bearer {token} ", 200),
            (f"Bearer {token}\t", 200),
            (f"Bearer  {token}", 401),
            (f"Bearer\t{token}", 401),
            (f"Bearer {token} x", 401),
            (f"Bearer {token}x", 403),
            (f"Bearer {token[:-1]}", 403),
        ]:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(
                b"GET /v1/instances HTTP/1.1\r\nHost: admin\r\nAuthorization: "
                + value.encode()
                + b"\r\nConnection: close\r\n\r\n"
            )
            status_line = (await reader.readline()).decode()
            writer.close()
            assert status_line.split()[1] == str(status), (value, status_line)
        # a value that does reach the API with whitespace in it (no HTTP parser in between)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://admin") as http:
            r = await http.get("/v1/instances", headers={"Authorization": f"Bearer {token} "})
            assert r.status_code == 401
    finally:
        await server.stop()


# ----------------------------------------------------------------------------- 4. gateway


@pytest.mark.broker
async def test_gateway_refuses_oversized_slo_headers_and_null_content_with_400(
    isolated_amqp_url: str,
) -> None:
    key = "sk-qlm-hostile-0123456789"
    gateway = await serve_gateway(
        isolated_amqp_url,
        keys=ApiKeys({key: "t"}),
        catalog=ModelCatalog(),
        settings=GatewaySettings(timeout_s=5),
        host="127.0.0.1",
        port=0,
    )
    try:
        auth = {"Authorization": f"Bearer {key}"}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            for header, value in [
                ("x-qlm-slo-ms", "9" * 401),
                ("x-qlm-ttft-ms", "1" + "0" * 400),
                ("x-qlm-tbt-ms", "9" * 5000),
                ("x-qlm-slo-ms", str(31 * 24 * 3_600_000)),  # beyond 30 days
                ("x-qlm-slo-ms", "\u0663"),  # an Arabic-Indic digit: int() takes it
                ("x-qlm-priority", "9" * 401),
            ]:
                sent = [(k.encode(), v.encode()) for k, v in {**auth, header: value}.items()]
                r = await http.post("/v1/chat/completions", json=chat, headers=sent)
                assert r.status_code == 400, (header, value[:20], r.status_code, r.text)
                assert r.json()["error"]["type"] == "invalid_request_error", r.text
            for message in (
                {"role": "user", "content": None},
                {"role": "assistant"},
            ):
                body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}, message]}
                r = await http.post("/v1/chat/completions", json=body, headers=auth)
                assert r.status_code == 400, (message, r.status_code, r.text)
                assert "content" in r.text
    finally:
        await gateway.stop()


# ----------------------------------------------------------------------------- helpers' own check


def test_raw_table_helper_matches_pamqp_for_valid_input() -> None:
    items: dict[str | bytes, Any] = {"a": 1, "b": "text", "c": {"d": True}}
    assert raw_table(items) == pamqp.encode.field_table({"a": 1, "b": "text", "c": {"d": True}})
