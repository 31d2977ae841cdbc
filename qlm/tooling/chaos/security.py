"""Chaos scenarios from the outside attack on exactly-once and hostile input (issue 20):
the lone coordinator killed and restarted (no standby), and hostile AMQP messages published
into a loaded fleet. Both count lost and duplicated replies like every other scenario."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import aio_pika
import httpx

from qlm.tooling.chaos.rawamqp import RawPublisher
from qlm.tooling.chaos.scenarios import (
    ChaosSettings,
    Scenario,
    ScenarioResult,
    _agents,
    _fault_point,
    _fleet,
    _result,
)
from qlm.tooling.chaos.workload import ChaosLoad
from qlm.topology import DEAD_LETTER_QUEUE

RESTART_AFTER_S = 10.0  # how long the lone coordinator stays dead
RESTART_TARGET_S = 30.0  # from the restart to the admin API answering again


async def coordinator_restart(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    """SIGKILL the only coordinator (no standby) with thousands of requests in flight; start a
    new one on the same store 10 s later. Results left in the control queue and requests the
    broker redelivers meet the durable answer record: nothing is answered twice."""
    assert amqp_url is not None
    started = time.monotonic()
    name = "coordinator-restart"
    async with (
        _fleet(amqp_url, s.workdir / name, _agents(1, 2, s.time_scale), s) as fleet,
        ChaosLoad(amqp_url, f"{name}-{os.getpid()}", s.requests, max_tokens=s.max_tokens) as load,
    ):
        await load.publish()
        in_flight = await _fault_point(load)
        assert fleet.coordinator is not None
        fault_at = time.time()
        fleet.coordinator.send_signal(signal.SIGKILL)
        fleet.coordinator.wait(timeout=10)
        await asyncio.sleep(RESTART_AFTER_S)
        fleet.coordinator = fleet._spawn("coordinator-restarted", ["coordinator"])
        t0 = time.monotonic()
        back = None
        async with httpx.AsyncClient(timeout=2) as http:
            while time.monotonic() - t0 < 60:
                try:
                    r = await http.get(f"{fleet.admin_url}/healthz")
                    if r.json().get("active"):
                        back = time.monotonic() - t0
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(0.1)
        notes = [f"coordinator down {RESTART_AFTER_S:g} s, no standby"]
        if back is None:
            notes.append("the restarted coordinator never became active within 60 s")
        await load.wait_all(s.reply_timeout_s)
        logs = fleet.logs("coordinator-restarted")
        again = logs.count("answered_from_record")
        leftovers = logs.count("result_for_answered_request_dropped") + logs.count(
            "duplicate_result_ignored"
        )
        notes.append(
            f"{again} redelivered requests answered from the record, {leftovers} leftover "
            "results dropped"
        )
        return _result(name, load, in_flight, back, RESTART_TARGET_S, started, notes, fault_at)


BAD_BYTES = b"\xff\xfe-not-utf8"


def hostile_messages(prefix: str) -> list[tuple[bytes, dict[str, Any], bytes, bool]]:
    """(body, AMQP properties, routing key) of every kind of hostile message the outside
    attack used: properties that are not UTF-8 (each string property and a header key),
    forged broker and qlm headers, bodies the parser must refuse at once, numbers beyond any
    float, non-finite and future timestamps, a lone surrogate. Each carries a reply route and
    says whether it must be refused (dead-lettered) or served: a valid request with forged
    broker and qlm headers is served, once, with the headers ignored."""

    def body(rid: str, **fields: Any) -> bytes:
        doc: dict[str, Any] = {
            "request_id": rid,
            "model": "mistral-7b",
            "prompt_token_ids": [1, 2, 3],
            "max_tokens": 4,
            "slo": {"e2e_ms": 600_000},
        }
        doc.update(fields)
        return json.dumps(doc).encode()

    reply = f"qlm.reply.chaos.{prefix}-hostile"
    out: list[tuple[bytes, dict[str, Any], bytes, bool]] = []
    for prop in ("message_id", "correlation_id", "content_type", "type", "app_id", "reply_to"):
        rid = f"{prefix}-prop-{prop}"
        props: dict[str, Any] = {"reply_to": reply, "correlation_id": rid, prop: BAD_BYTES}
        out.append((body(rid), props, rid.encode(), True))
    rid = f"{prefix}-header-key"
    out.append((body(rid), {"reply_to": reply, "headers": {BAD_BYTES: b"v"}}, rid.encode(), True))
    bodies = {
        "deep": b"[" * 10_000 + b"]" * 10_000,
        "bigint": b'{"request_id": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        "surrogate": body("x", prompt="\ud800", prompt_token_ids=None).replace(
            b'"prompt_token_ids": null, ', b""
        ),
        "nan": body("x", submitted_at=float("nan")),
        "inf": body("x", submitted_at=float("inf")),
        "future": body("x", submitted_at=4_000_000_000.0),
        "huge-slo": body("x").replace(b'"e2e_ms": 600000', b'"e2e_ms": 1' + b"0" * 400),
        "qlm-queue-reply": body("x"),
    }
    for kind, raw in bodies.items():
        rid = f"{prefix}-body-{kind}"
        raw = raw.replace(b'"request_id": "x"', f'"request_id": "{rid}"'.encode())
        props = {"reply_to": reply, "correlation_id": rid, "content_type": b"application/json"}
        if kind == "qlm-queue-reply":
            props["reply_to"] = b"qlm.control.coordinator"
        out.append((raw, props, rid.encode(), True))
    rid = f"{prefix}-forged-headers"
    forged = {b"x-delivery-count": 99, b"x-qlm-reply-id": b"forged", b"x-death": [b"x"]}
    props = {"reply_to": reply, "correlation_id": rid, "headers": forged}
    out.append((body(rid), props, rid.encode(), False))
    return out


async def hostile_properties(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    """Under load, publish every kind of hostile message the outside attack found, several
    times each, through a raw AMQP client that sends property bytes as given. The valid load
    must see 0 lost and 0 duplicates; the coordinator must never lose its broker connection
    (its log shows no reconnect); each hostile message ends in the dead-letter queue once."""
    assert amqp_url is not None
    started = time.monotonic()
    name = "hostile-properties"
    rounds = 10
    async with (
        _fleet(amqp_url, s.workdir / name, _agents(2, 1, s.time_scale), s) as fleet,
        ChaosLoad(amqp_url, f"{name}-{os.getpid()}", s.requests, max_tokens=s.max_tokens) as load,
    ):
        assert load.client is not None
        await load.publish()
        in_flight = await _fault_point(load)
        fault_at = time.time()
        hostile = refused = 0
        async with RawPublisher(amqp_url) as raw:
            for r in range(rounds):
                for body, props, key, refuse in hostile_messages(f"{load.prefix}-r{r}"):
                    await raw.publish(body, props, routing_key=key)
                    hostile += 1
                    refused += refuse
        await load.wait_all(s.reply_timeout_s)
        notes = [f"{hostile} hostile messages published during the run"]
        log_text = fleet.logs("coordinator")
        reconnects = log_text.count("amqp_connection_lost")
        failures = log_text.count("handler_failed")
        notes.append(f"coordinator: {failures} handler failures, {reconnects} reconnect lines")
        dead = await _dead_letter_count(amqp_url)
        notes.append(f"{dead} dead letters ({refused} hostile messages must be refused)")
        result = _result(name, load, in_flight, None, None, started, notes, fault_at)
        if failures or reconnects or dead != refused:
            result.error = (
                f"under hostile input the coordinator failed a handler {failures} times, "
                f"logged {reconnects} lost connections and dead-lettered {dead} of {refused}"
            )
        return result


async def _dead_letter_count(amqp_url: str) -> int:
    """Messages waiting in qlm.dead (refused input, each with its reason)."""
    conn = await aio_pika.connect(amqp_url.split(",")[0])
    async with conn:
        channel = await conn.channel()
        queue = await channel.declare_queue(DEAD_LETTER_QUEUE, passive=True)
        return int(queue.declaration_result.message_count or 0)


SECURITY_SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "coordinator-restart",
            coordinator_restart,
            True,
            False,
            "the lone coordinator SIGKILLed, restarted 10 s later (no standby)",
        ),
        Scenario(
            "hostile-properties",
            hostile_properties,
            True,  # make test runs it from tests/broker/test_chaos_security.py
            False,
            "hostile AMQP messages (bytes that are not UTF-8, parser bombs) under load",
        ),
    ]
}
