"""examples/producer.sh, the bash + curl producer, against a real RabbitMQ management API.

The test plays the coordinator's part (read the shard, answer on reply_to with the correlation
id echoed), so it checks the script's whole exchange: declare, publish, poll, print, clean up.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import aio_pika
import httpx
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from qlm.tooling import localbroker
from qlm.topology import declare_topology, shard_queue
from qlm.types import (
    SLO,
    ErrorCode,
    ErrorMessage,
    RequestMessage,
    ResultMessage,
    SLOOutcome,
    Timestamps,
    Usage,
)

pytestmark = [
    pytest.mark.broker,
    pytest.mark.skipif(
        not (shutil.which("curl") and shutil.which("jq")), reason="needs curl and jq"
    ),
]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "producer.sh"
SHARDS = 2


def management(amqp_url: str) -> tuple[str, str]:
    """(management URL with the AMQP credentials in it, vhost) for ``amqp_url``."""
    parts = urlsplit(amqp_url)
    base = urlsplit(localbroker.management_url(amqp_url))
    user, password = unquote(parts.username or "guest"), unquote(parts.password or "guest")
    url = base._replace(netloc=f"{user}:{password}@{base.netloc}").geturl()
    return url, unquote(parts.path[1:]) or "/"


async def run_producer(
    amqp_url: str, *args: str, timeout_s: float = 20
) -> asyncio.subprocess.Process:
    url, vhost = management(amqp_url)
    env = {
        **os.environ,
        "QLM_MGMT_URL": url,
        "QLM_VHOST": vhost,
        "QLM_TIMEOUT_S": str(timeout_s),
        "QLM_POLL_S": "0.05",
    }
    return await asyncio.create_subprocess_exec(
        str(SCRIPT),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


@pytest.fixture
async def channel(isolated_amqp_url: str) -> AsyncIterator[AbstractChannel]:
    conn = await aio_pika.connect(isolated_amqp_url)
    async with conn:
        ch = await conn.channel()
        await declare_topology(ch, SHARDS)
        yield ch


async def next_request(channel: AbstractChannel, within: float = 20.0) -> AbstractIncomingMessage:
    got: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
    consumers = []
    for i in range(SHARDS):
        q = await channel.declare_queue(shard_queue(i), passive=True)
        consumers.append((q, await q.consume(got.put, no_ack=True)))
    try:
        return await asyncio.wait_for(got.get(), within)
    finally:
        for q, tag in consumers:
            await q.cancel(tag)


def request_file(tmp_path: Path, rid: str) -> Path:
    req = RequestMessage(
        request_id=rid,
        model="mistral-7b",
        prompt='Quote "this" \\ and a newline\nplease',
        max_tokens=8,
        slo=SLO(e2e_ms=30_000, slo_class="interactive"),
    )
    path = tmp_path / f"{rid}.json"
    path.write_text(req.model_dump_json(indent=2))
    return path


async def answer(channel: AbstractChannel, m: AbstractIncomingMessage, reply: object) -> None:
    assert m.reply_to is not None
    body = reply.model_dump_json().encode()  # type: ignore[attr-defined]
    await channel.default_exchange.publish(
        aio_pika.Message(body, content_type="application/json", correlation_id=m.correlation_id),
        routing_key=m.reply_to,
    )


async def test_publishes_with_protocol_properties_and_prints_the_result(
    isolated_amqp_url: str, channel: AbstractChannel, tmp_path: Path
) -> None:
    path = request_file(tmp_path, "sh-1")
    proc = await run_producer(isolated_amqp_url, str(path))
    m = await next_request(channel)
    assert m.content_type == "application/json"
    assert m.content_encoding == "utf-8"
    assert m.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert (m.message_id, m.correlation_id, m.routing_key) == ("sh-1", "sh-1", "sh-1")
    assert m.reply_to == "qlm.reply.sh.sh-1"
    assert RequestMessage.model_validate_json(m.body) == RequestMessage.model_validate_json(
        path.read_text()
    )
    now = time.time()
    result = ResultMessage(
        request_id="sh-1",
        model="mistral-7b",
        output_text="Hello there, from the queue",
        output_token_ids=[1, 2, 3],
        finish_reason="stop",
        usage=Usage(prompt_tokens=9, completion_tokens=3),
        timestamps=Timestamps(submitted=now, queued=now, finished=now),
        slo=SLOOutcome(met=True),
        instance_id="test-gpu0",
        attempts=1,
    )
    await answer(channel, m, result)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, stderr.decode()
    assert ResultMessage.model_validate(json.loads(stdout)) == result
    # The script deleted its reply queue on the way out.
    url, vhost = management(isolated_amqp_url)
    async with httpx.AsyncClient() as http:
        r = await http.get(f"{url.rstrip('/')}/api/queues/{vhost.replace('/', '%2F')}/{m.reply_to}")
    assert r.status_code == 404


async def test_error_reply_exits_3_and_other_correlation_ids_are_ignored(
    isolated_amqp_url: str, channel: AbstractChannel, tmp_path: Path
) -> None:
    proc = await run_producer(isolated_amqp_url, str(request_file(tmp_path, "sh-2")))
    m = await next_request(channel)
    error = ErrorMessage(request_id="sh-2", code=ErrorCode.UNKNOWN_MODEL, message="no such model")
    stray = ErrorMessage(request_id="other", code=ErrorCode.INTERNAL_ERROR, message="not yours")
    assert m.reply_to is not None
    await channel.default_exchange.publish(
        aio_pika.Message(stray.model_dump_json().encode(), correlation_id="other"),
        routing_key=m.reply_to,
    )
    await answer(channel, m, error)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 3, stderr.decode()
    assert ErrorMessage.model_validate(json.loads(stdout)) == error
    assert "ignoring a reply for correlation id 'other'" in stderr.decode()


async def test_no_reply_times_out_with_4_and_the_request_stays_queued(
    isolated_amqp_url: str, channel: AbstractChannel
) -> None:
    proc = await run_producer(isolated_amqp_url, timeout_s=1)  # the built-in sample request
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 4, stderr.decode()
    assert stdout == b""
    m = await next_request(channel)
    sample = RequestMessage.model_validate_json(m.body)
    assert m.correlation_id == sample.request_id and sample.model == "mistral-7b"


async def test_fails_without_the_ingress_exchange(isolated_amqp_url: str, tmp_path: Path) -> None:
    proc = await run_producer(isolated_amqp_url, str(request_file(tmp_path, "sh-3")))
    _, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1
    assert "publish failed" in stderr.decode()
