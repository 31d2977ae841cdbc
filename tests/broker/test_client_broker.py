"""QlmClient against a real RabbitMQ: confirms, shard routing, AMQP properties, reply matching.

No coordinator runs here: the tests read the shard queues themselves and publish replies the
way the coordinator does (default exchange, routing key = reply_to, correlation id echoed).
The end-to-end tests with a real coordinator are in test_e2e_*.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from qlm.client import QlmClient, StreamError, replay
from qlm.tooling.report import Report
from qlm.topology import shard_queue
from qlm.types import (
    SLO,
    BatchedChunk,
    ErrorCode,
    ErrorMessage,
    RequestMessage,
    ResultMessage,
    SLOOutcome,
    Timestamps,
    TokenBatch,
    TokenChunk,
    Usage,
)

pytestmark = pytest.mark.broker

SHARDS = 2


def make_request(rid: str, **kw: object) -> RequestMessage:
    fields: dict[str, object] = {
        "request_id": rid,
        "model": "mistral-7b",
        "prompt_token_ids": [1, 2, 3],
        "max_tokens": 2,
        "slo": SLO(e2e_ms=10_000, slo_class="chat"),
    }
    fields.update(kw)
    return RequestMessage.model_validate(fields)


def result_for(req: RequestMessage, *, instance: str = "test-gpu0") -> ResultMessage:
    now = time.time()
    submitted = req.submitted_at or now
    return ResultMessage(
        request_id=req.request_id,
        model=req.model,
        output_text="ab",
        output_token_ids=[7, 8],
        finish_reason="length",
        usage=Usage(prompt_tokens=req.prompt_tokens(), completion_tokens=2),
        timestamps=Timestamps(
            submitted=submitted, queued=submitted, started=now, first_token=now, finished=now
        ),
        slo=SLOOutcome(met=True, e2e_met=True, e2e_ms=(now - submitted) * 1000),
        instance_id=instance,
        attempts=1,
    )


@pytest.fixture
async def channel(isolated_amqp_url: str) -> AsyncIterator[AbstractChannel]:
    conn = await aio_pika.connect(isolated_amqp_url)
    async with conn:
        yield await conn.channel()


async def shard_counts(channel: AbstractChannel) -> list[int]:
    """Messages ready in each shard queue now (what the broker has stored)."""
    counts = []
    for i in range(SHARDS):
        q = await channel.declare_queue(shard_queue(i), passive=True)
        assert q.declaration_result.message_count is not None
        counts.append(q.declaration_result.message_count)
    return counts


async def take_from_shards(
    channel: AbstractChannel, n: int, within: float = 5.0
) -> dict[int, list[AbstractIncomingMessage]]:
    """Consume ``n`` messages from the shards (single-active-consumer quorum queues do not
    support basic.get), and tell which shard each came from."""
    found: dict[int, list[AbstractIncomingMessage]] = {i: [] for i in range(SHARDS)}
    consumers = []
    for i in range(SHARDS):
        q = await channel.declare_queue(shard_queue(i), passive=True)

        async def on_message(m: AbstractIncomingMessage, shard: int = i) -> None:
            found[shard].append(m)
            await m.ack()

        consumers.append((q, await q.consume(on_message)))
    await wait_until(lambda: sum(map(len, found.values())) >= n, within)
    for q, tag in consumers:
        await q.cancel(tag)
    return found


def only_message(found: dict[int, list[AbstractIncomingMessage]]) -> AbstractIncomingMessage:
    (m,) = [m for ms in found.values() for m in ms]
    return m


async def send_reply(
    channel: AbstractChannel, reply: ResultMessage | ErrorMessage, *, reply_to: str, cid: str
) -> None:
    await channel.default_exchange.publish(
        aio_pika.Message(
            reply.model_dump_json().encode(),
            content_type="application/json",
            correlation_id=cid,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        ),
        routing_key=reply_to,
    )


async def wait_until(cond: Callable[[], object], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_confirmed_submit_lands_on_one_shard_with_protocol_properties(
    isolated_amqp_url: str, channel: AbstractChannel
) -> None:
    async with QlmClient(isolated_amqp_url) as client:
        await client.ensure_topology(SHARDS)
        req = make_request("props-1")
        fut = await client.submit(req, submitted_at=1_700_000_000.5)
        # submit returned: the broker confirmed, so the message is stored in a shard right now.
        assert sorted(await shard_counts(channel)) == [0, 1]
        m = only_message(await take_from_shards(channel, 1))
        assert m.content_type == "application/json"
        assert m.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert m.message_id == "props-1"
        assert m.correlation_id == "props-1"
        assert m.reply_to == client.reply_queue_name
        assert m.routing_key == "props-1"
        sent = RequestMessage.model_validate_json(m.body)
        assert sent == req.model_copy(update={"submitted_at": 1_700_000_000.5})
        assert not fut.done()
        assert client.outstanding() == 1


async def test_request_ids_spread_over_the_shards_and_each_arrives_once(
    isolated_amqp_url: str, channel: AbstractChannel
) -> None:
    async with QlmClient(isolated_amqp_url) as client:
        await client.ensure_topology(SHARDS)
        ids = [f"spread-{i}" for i in range(200)]
        await asyncio.gather(*(client.submit(make_request(rid)) for rid in ids))
        assert sum(await shard_counts(channel)) == len(ids)
        shards = await take_from_shards(channel, len(ids))
    per_shard = {i: [m.correlation_id or "" for m in ms] for i, ms in shards.items()}
    assert sorted(sum(per_shard.values(), [])) == sorted(ids)
    # Consistent hashing with equal weights: neither shard is starved (expected 100 each).
    assert all(len(v) >= 60 for v in per_shard.values()), {i: len(v) for i, v in per_shard.items()}


async def test_resubmitting_an_id_shares_the_future_and_hits_the_same_shard(
    isolated_amqp_url: str, channel: AbstractChannel
) -> None:
    async with QlmClient(isolated_amqp_url) as client:
        await client.ensure_topology(SHARDS)
        first = await client.submit(make_request("again-1"))
        second = await client.submit(make_request("again-1"))
        assert first is second and client.outstanding() == 1
        # The consistent-hash exchange sends a request id to the same shard every time.
        assert sorted(await shard_counts(channel)) == [0, 2]


async def test_reply_resolves_the_future_and_a_second_reply_is_a_duplicate(
    isolated_amqp_url: str, channel: AbstractChannel
) -> None:
    # A durable reply queue this time, so the test can look into it after the client is gone.
    async with QlmClient(isolated_amqp_url, reply_queue="test.replies") as client:
        await client.ensure_topology(SHARDS)
        req = make_request("dup-1")
        fut = await client.submit(req)
        m = only_message(await take_from_shards(channel, 1))
        assert m.reply_to is not None and m.correlation_id is not None
        first = result_for(req, instance="first")
        await send_reply(channel, first, reply_to=m.reply_to, cid=m.correlation_id)
        assert await asyncio.wait_for(fut, 5) == first
        assert client.outstanding() == 0 and client.duplicates == {}

        second = result_for(req, instance="second")
        await send_reply(channel, second, reply_to=m.reply_to, cid=m.correlation_id)
        await wait_until(lambda: client.duplicates)
        assert client.duplicates == {"dup-1": [second]}
        assert fut.result() == first  # never overwritten
        assert client.reply_counts["dup-1"] == 2
    # Both replies were acked: had they not been, closing would have returned them to the queue.
    q = await channel.declare_queue("test.replies", passive=True)
    assert q.declaration_result.message_count == 0


async def test_raw_publish_is_matched_by_correlation_id_and_unknown_replies_are_kept_apart(
    isolated_amqp_url: str, channel: AbstractChannel
) -> None:
    async with QlmClient(isolated_amqp_url) as client:
        await client.ensure_topology(SHARDS)
        fut = await client.publish_raw(
            b"{not json", content_type="text/plain", correlation_id="raw-1", headers={"x-t": 1}
        )
        m = only_message(await take_from_shards(channel, 1))
        assert (m.body, m.content_type, m.correlation_id) == (b"{not json", "text/plain", "raw-1")
        assert m.headers == {"x-t": 1}
        error = ErrorMessage(request_id=None, code=ErrorCode.INVALID_JSON, message="bad")
        assert m.reply_to is not None
        await send_reply(channel, error, reply_to=m.reply_to, cid="raw-1")
        assert await asyncio.wait_for(fut, 5) == error

        await send_reply(channel, error, reply_to=m.reply_to, cid="never-sent")
        await wait_until(lambda: client.unexpected)
        assert client.duplicates == {} and client.reply_counts["never-sent"] == 0


async def test_request_times_out_but_a_late_reply_still_resolves_it(
    isolated_amqp_url: str, channel: AbstractChannel
) -> None:
    async with QlmClient(isolated_amqp_url) as client:
        await client.ensure_topology(SHARDS)
        req = make_request("late-1")
        with pytest.raises(TimeoutError):
            await client.request(req, timeout=0.2)
        assert client.outstanding_ids() == {"late-1"}
        m = only_message(await take_from_shards(channel, 1))
        assert m.reply_to is not None
        await send_reply(channel, result_for(req), reply_to=m.reply_to, cid="late-1")
        await wait_until(lambda: client.outstanding() == 0)
        assert client.duplicates == {}


async def test_submit_fails_loudly_without_a_topology(isolated_amqp_url: str) -> None:
    async with QlmClient(isolated_amqp_url) as client:
        # No qlm.ingress exchange in this fresh vhost: the broker refuses the publish.
        with pytest.raises(aio_pika.exceptions.AMQPError):
            await client.submit(make_request("nowhere-1"))
        assert client.outstanding() == 0


async def _responder(
    url: str, *, skip: set[str], twice: set[str], stop: asyncio.Event
) -> dict[str, float]:
    """A stand-in for the coordinator: answers every request from the shards once (or twice,
    or never) and notes when each arrived."""
    arrived: dict[str, float] = {}
    conn = await aio_pika.connect(url)
    async with conn:
        ch = await conn.channel()

        async def on_message(m: AbstractIncomingMessage) -> None:
            req = RequestMessage.model_validate_json(m.body)
            arrived[req.request_id] = time.time()
            assert m.reply_to is not None and m.correlation_id is not None
            for _ in range(0 if req.request_id in skip else 2 if req.request_id in twice else 1):
                await send_reply(ch, result_for(req), reply_to=m.reply_to, cid=m.correlation_id)
            await m.ack()

        for i in range(SHARDS):
            q = await ch.declare_queue(shard_queue(i), passive=True)
            await q.consume(on_message)
        await stop.wait()
    return arrived


async def test_replay_keeps_the_schedule_and_counts_duplicates_and_lost(
    isolated_amqp_url: str,
) -> None:
    timed = [(i * 0.05, make_request(f"rp-{i}")) for i in range(20)]
    async with QlmClient(isolated_amqp_url) as client:
        await client.ensure_topology(SHARDS)
        stop = asyncio.Event()
        responder = asyncio.create_task(
            _responder(isolated_amqp_url, skip={"rp-3"}, twice={"rp-5", "rp-7"}, stop=stop)
        )
        await asyncio.sleep(0.2)  # let it start consuming
        result = await replay(client, timed, speedup=2.0, timeout=1.0)
        stop.set()
        arrived = await responder
    assert (result.sent, result.replies, result.errors, result.lost) == (20, 19, 0, 1)
    assert result.publish_failures == 0
    assert result.duplicates == 2 and set(client.duplicates) == {"rp-5", "rp-7"}
    by_id = dict((req.request_id, reply) for req, reply in result.results)
    assert by_id["rp-3"] is None and isinstance(by_id["rp-4"], ResultMessage)
    # Publishing followed the trace at 2x: request i went out about i * 25 ms after the first.
    sent = [result.sent_at[f"rp-{i}"] - result.sent_at["rp-0"] for i in range(20)]
    for i, offset in enumerate(sent):
        assert abs(offset - i * 0.025) < 0.1, (i, offset)
    assert result.max_send_lag_s < 0.1
    # submitted_at was stamped at send time, so deadlines count from the trace's arrival.
    for i in range(20):
        assert arrived[f"rp-{i}"] >= result.sent_at[f"rp-{i}"] - 0.001
    report = Report.from_replay(result)
    assert report.to_json()["lost"] == 1 and report.completed == 19


async def send_chunk(
    channel: AbstractChannel,
    chunk: TokenChunk | TokenBatch | bytes,
    *,
    reply_to: str,
    cid: str | None,
) -> None:
    """Publish a token chunk (or a batch) the way an agent does: transient, type "tokens"."""
    body = chunk if isinstance(chunk, bytes) else chunk.model_dump_json().encode()
    await channel.default_exchange.publish(
        aio_pika.Message(body, content_type="application/json", correlation_id=cid, type="tokens"),
        routing_key=reply_to,
    )


async def test_stream_drops_stray_duplicated_and_reordered_chunks(
    isolated_amqp_url: str, channel: AbstractChannel
) -> None:
    async with QlmClient(isolated_amqp_url) as client:
        await client.ensure_topology(SHARDS)
        req = make_request("st-1", max_tokens=6, stream=False)
        stream = await client.open_stream(req)
        m = only_message(await take_from_shards(channel, 1))
        assert RequestMessage.model_validate_json(m.body).stream  # it asked to stream
        assert m.reply_to is not None and m.correlation_id is not None
        to = {"reply_to": m.reply_to, "cid": m.correlation_id}
        ids = [11, 12, 13, 14, 15, 16]

        def chunk(start: int, end: int, rid: str = "st-1") -> TokenChunk:
            text = "".join(f"<{t}>" for t in ids[start:end])
            return TokenChunk(
                request_id=rid, offset=start, token_ids=ids[start:end], text=text, attempt=1
            )

        # chunks nobody waits for, and broken ones: dropped, never replies
        await send_chunk(channel, chunk(0, 2, "nobody"), reply_to=m.reply_to, cid="nobody")
        await send_chunk(channel, chunk(0, 2, "other"), **to)  # another request's id
        await send_chunk(channel, b"{not json", **to)
        await send_chunk(channel, chunk(2, 4), **to)  # out of order: held
        await send_chunk(channel, chunk(0, 2), **to)
        await send_chunk(channel, chunk(0, 2), **to)  # duplicate
        await send_chunk(channel, chunk(1, 3), **to)  # overlap, nothing new
        got = [await stream.next(5), await stream.next(5)]
        assert [(p.offset, p.token_ids, p.text) for p in got] == [
            (0, [11, 12], "<11><12>"),
            (2, [13, 14], "<13><14>"),
        ]
        assert client.stray_chunks == 3
        result = result_for(req).model_copy(
            update={"output_token_ids": ids, "output_text": "".join(f"<{t}>" for t in ids)}
        )
        await send_reply(channel, result, **to)
        last = await stream.next(5)
        assert last is not None and last.result == result
        assert (last.offset, last.token_ids, last.text) == (4, [15, 16], "<15><16>")
        assert await stream.next(5) is None
        # a chunk after the result: the stream is closed, it is dropped
        await send_chunk(channel, chunk(4, 6), **to)
        await wait_until(lambda: client.stray_chunks == 4)
        assert client.unexpected == [] and client.duplicates == {}
        assert client.reply_counts["st-1"] == 1


async def test_streams_sharing_a_reply_queue_take_their_chunks_from_batches(
    isolated_amqp_url: str, channel: AbstractChannel
) -> None:
    async with QlmClient(isolated_amqp_url) as client:
        await client.ensure_topology(SHARDS)
        reqs = [make_request(rid, max_tokens=4) for rid in ("sb-a", "sb-b")]
        streams = [await client.open_stream(r) for r in reqs]
        found = [m for ms in (await take_from_shards(channel, 2)).values() for m in ms]
        assert {m.reply_to for m in found} == {client.reply_queue_name}  # one queue for both
        queue = client.reply_queue_name
        ids = {"sb-a": [1, 2, 3, 4], "sb-b": [5, 6, 7, 8]}

        def entry(rid: str, start: int, end: int, cid: str | None = None) -> BatchedChunk:
            return BatchedChunk(
                correlation_id=cid or rid,
                request_id=rid,
                offset=start,
                token_ids=ids[rid][start:end],
                text="".join(f"<{t}>" for t in ids[rid][start:end]),
                attempt=1,
            )

        # one message, both requests interleaved; the AMQP correlation id names neither
        batch = TokenBatch(
            chunks=[
                entry("sb-a", 0, 1),
                entry("sb-b", 0, 2),
                entry("sb-a", 1, 2),
                entry("sb-a", 0, 1, cid="nobody"),  # no such stream: stray
                entry("sb-a", 2, 3, cid="sb-b"),  # sb-b's route, sb-a's tokens: stray
            ]
        )
        await send_chunk(channel, batch, reply_to=queue, cid=None)
        # the old single-chunk shape, as a lone chunk is sent, still reaches its stream
        one = entry("sb-b", 2, 3)
        single = TokenChunk(**one.model_dump(exclude={"correlation_id"}))
        await send_chunk(channel, single, reply_to=queue, cid="sb-b")
        a, b = streams
        first = await a.next(5)
        assert first is not None and (first.offset, first.token_ids, first.text) == (0, [1], "<1>")
        # its second chunk came in the same message: ready without waiting, and then nothing
        ready = a.next_ready()
        assert ready is not None and (ready.offset, ready.token_ids, ready.text) == (1, [2], "<2>")
        assert a.next_ready() is None
        assert [(p.offset, p.token_ids, p.text) for p in (await b.next(5), await b.next(5))] == [
            (0, [5, 6], "<5><6>"),
            (2, [7], "<7>"),
        ]
        assert client.stray_chunks == 2
        for req, stream in zip(reqs, streams, strict=True):
            rid = req.request_id
            text = "".join(f"<{t}>" for t in ids[rid])
            result = result_for(req).model_copy(
                update={"output_token_ids": ids[rid], "output_text": text}
            )
            await send_reply(channel, result, reply_to=queue, cid=rid)
            last = await stream.next(5)
            assert last is not None and last.result == result
            assert last.offset == (2 if rid == "sb-a" else 3)  # the rest, from the result
            assert await stream.next(5) is None
        assert client.unexpected == [] and client.duplicates == {}
        assert dict(client.reply_counts) == {"sb-a": 1, "sb-b": 1}


async def test_stream_raises_on_an_error_reply(
    isolated_amqp_url: str, channel: AbstractChannel
) -> None:
    async with QlmClient(isolated_amqp_url) as client:
        await client.ensure_topology(SHARDS)
        req = make_request("st-err")
        pieces = client.stream(req, timeout=10)
        first = asyncio.ensure_future(anext(pieces))
        m = only_message(await take_from_shards(channel, 1))
        assert m.reply_to is not None and m.correlation_id is not None
        error = ErrorMessage(request_id="st-err", code=ErrorCode.OVERLOADED, message="full")
        await send_reply(channel, error, reply_to=m.reply_to, cid=m.correlation_id)
        with pytest.raises(StreamError) as raised:
            await first
        assert raised.value.error == error
