"""A message that makes the coordinator's handler fail every time: it is not looped forever.
The quorum queue's delivery limit dead-letters it (reason ``delivery_limit``), its producer gets
a ``delivery_limit`` error reply, and the coordinator keeps serving everything else."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aio_pika
import pytest

from qlm.client import QlmClient
from qlm.coordinator.service import Coordinator
from qlm.planner import create_policy
from qlm.store import Store
from qlm.topology import DEAD_LETTER_QUEUE
from qlm.types import SLO, ErrorCode, ErrorMessage, RequestMessage
from tests.builders import next_messages

pytestmark = pytest.mark.broker


def _req(rid: str) -> RequestMessage:
    return RequestMessage(
        request_id=rid,
        model="mistral-7b",
        prompt_token_ids=[1, 2, 3],
        max_tokens=4,
        slo=SLO(e2e_ms=60_000),
    )


async def test_a_message_that_always_crashes_the_handler_is_dead_lettered_and_answered(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    coord = Coordinator(
        amqp_url=isolated_amqp_url,
        policy=create_policy("edf"),
        store=store,
        shards=1,
        delivery_limit=2,
    )
    real_ingest = coord._ingest
    attempts = 0

    async def crash_on_poison(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal attempts
        if message.message_id == "poison":
            attempts += 1
            raise RuntimeError("a bug that this message triggers every time")
        await real_ingest(message)

    coord._ingest = crash_on_poison  # type: ignore[method-assign]
    await coord.start()
    try:
        async with QlmClient(isolated_amqp_url) as client:
            poison = await client.submit(_req("poison"))
            reply = await asyncio.wait_for(asyncio.shield(poison), 30)
            assert isinstance(reply, ErrorMessage), reply
            assert reply.code == ErrorCode.DELIVERY_LIMIT and reply.request_id == "poison"
            # the coordinator still takes other work (no agents: it stays queued)
            await client.submit(_req("fine"))
            for _ in range(100):
                if "fine" in coord.core.requests:
                    break
                await asyncio.sleep(0.05)
            assert "fine" in coord.core.requests
        assert attempts == 3  # delivered delivery_limit + 1 times, then dead-lettered
        async with await aio_pika.connect(isolated_amqp_url) as conn:
            ch = await conn.channel()
            dead = await ch.get_queue(DEAD_LETTER_QUEUE, ensure=False)
            (letter,) = await next_messages(dead, 1)
            assert letter.message_id == "poison"
            x_death = (letter.headers or {})["x-death"]
            assert isinstance(x_death, list) and x_death[0]["reason"] == "delivery_limit"  # type: ignore[index,call-overload]
            await letter.ack()
    finally:
        await coord.stop()
        await store.close()
