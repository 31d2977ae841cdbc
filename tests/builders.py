"""Tiny builders for unit tests of the coordinator core and the policies (no broker), and
the polling wait the broker tests share."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

from qlm.control import Completion, Heartbeat, InstanceInfo, InstanceStatus
from qlm.policy import PlanInstance, PlanRequest
from qlm.types import SLO, RequestMessage

_ids = itertools.count()


def make_request(
    model: str = "mistral-7b",
    *,
    e2e_ms: int | None = 10_000,
    ttft_ms: int | None = None,
    prompt_len: int = 16,
    max_tokens: int = 8,
    submitted_at: float | None = None,
    request_id: str | None = None,
    slo_class: str | None = None,
    tenant: str | None = None,
    stream: bool = False,
) -> RequestMessage:
    return RequestMessage(
        request_id=request_id or f"r{next(_ids)}",
        model=model,
        prompt_token_ids=list(range(prompt_len)),
        max_tokens=max_tokens,
        slo=SLO(e2e_ms=e2e_ms, ttft_ms=ttft_ms, slo_class=slo_class),
        submitted_at=submitted_at,
        tenant=tenant,
        stream=stream,
    )


def make_plan_request(
    rid: str,
    *,
    arrival: float,
    deadline: float | None,
    model: str = "m",
    seq: int = 0,
    prompt: int = 10,
    out: int = 10,
) -> PlanRequest:
    return PlanRequest(rid, model, prompt, out, arrival, deadline, None, seq=seq)


def make_instance(
    iid: str, models: tuple[str, ...] = ("m",), *, draining: bool = False, kv: int = 10_000
) -> PlanInstance:
    return PlanInstance(iid, models, "A100-80GB", kv, 256, draining=draining)


def heartbeat(
    agent_id: str,
    n: int = 1,
    models: tuple[str, ...] = ("mistral-7b",),
    at: float = 0.0,
    in_flight: tuple[str, ...] = (),
    max_model_len: dict[str, int] | None = None,
) -> Heartbeat:
    return Heartbeat(
        agent_id=agent_id,
        sent_at=at,
        instances=[
            InstanceStatus(
                in_flight=list(in_flight),
                info=InstanceInfo(
                    instance_id=f"{agent_id}-gpu{i}",
                    agent_id=agent_id,
                    engine="sim",
                    gpu_type="A100-80GB",
                    gpu_memory_gb=80,
                    models=list(models),
                    kv_capacity_tokens=100_000,
                    max_batch_size=256,
                    max_model_len=dict(max_model_len or {}),
                ),
            )
            for i in range(n)
        ],
    )


async def wait_until(predicate: Callable[[], object], timeout: float = 20.0) -> None:
    """Poll ``predicate`` every 20 ms until it holds; TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.02)


async def next_messages(
    queue: AbstractQueue,
    n: int,
    timeout: float = 10.0,  # noqa: ASYNC109
) -> list[AbstractIncomingMessage]:
    """The next ``n`` messages of ``queue``, unacked, waiting up to ``timeout`` s for them
    (TimeoutError after): a basic.get answers at once, empty or not, so a message published
    a moment after the test asks (a dead letter after the reply or the confirm the test
    waited for) would otherwise be missed."""
    out: list[AbstractIncomingMessage] = []
    async with asyncio.timeout(timeout):
        while len(out) < n:
            msg = await queue.get(fail=False)
            if msg is None:
                await asyncio.sleep(0.05)
                continue
            out.append(msg)
    return out


def make_completion(**overrides: Any) -> Completion:
    """An agent's Completion report; fields not given are placeholders."""
    fields: dict[str, Any] = {
        "agent_id": "a",
        "instance_id": "a-gpu0",
        "dispatch_id": "d1",
        "request_id": "r1",
        "output_token_ids": [1, 2],
        "output_text": "",
        "finish_reason": "stop",
        "prompt_tokens": 8,
        "started_at": 0.0,
        "first_token_at": 0.1,
        "finished_at": 0.2,
    }
    fields.update(overrides)
    return Completion(**fields)
