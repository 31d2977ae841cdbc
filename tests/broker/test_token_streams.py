"""Per-token streams on the durable path (``stream: true``), end to end: a real coordinator and
real sim agent processes on a private vhost. Tokens reach the producer before the result,
each exactly once and in order, also when the agent running a request is SIGKILLed mid-stream
and the request finishes on another agent. And the agent's publisher alone, on a real broker:
one message per reply queue per flush, a request's first tokens at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import pytest
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

from qlm import amqp as qlm_amqp
from qlm.agents.engine import TokenDelta
from qlm.agents.sim import VOCAB_SIZE, _mix64
from qlm.agents.token_streams import TokenStreams
from qlm.client import QlmClient, StreamPiece
from qlm.control import Dispatch, ReplyRoute
from qlm.streaming import decode_token_message
from qlm.tooling.demo import LocalCluster
from qlm.topology import STREAM_END_HEADER, declare_topology
from qlm.types import SLO, RequestMessage, ResultMessage
from tests.builders import wait_until
from tests.e2e import running_cluster

pytestmark = [pytest.mark.broker]

MODEL = "mistral-7b"


def streamed_request(rid: str, max_tokens: int) -> RequestMessage:
    return RequestMessage(
        request_id=rid,
        model=MODEL,
        prompt_token_ids=list(range(1, 33)),
        max_tokens=max_tokens,
        slo=SLO(e2e_ms=300_000),
        stream=True,
    )


def sim_tokens(rid: str, n: int, engine_seed: int = 0) -> list[int]:
    """What a sim engine generates for this request, uninterrupted (agents/sim.py: token i is
    a function of the engine seed, the request id and i alone)."""
    seed = zlib.crc32(f"{engine_seed}:{rid}:None".encode())
    return [_mix64(seed, i) % VOCAB_SIZE for i in range(n)]


Run = tuple[list[tuple[float, StreamPiece]], ResultMessage]


async def collect(client: QlmClient, req: RequestMessage, timeout: float) -> Run:
    pieces: list[tuple[float, StreamPiece]] = []
    async for piece in client.stream(req, timeout=timeout):
        pieces.append((time.monotonic(), piece))
    result = pieces[-1][1].result
    assert isinstance(result, ResultMessage)
    return pieces, result


@contextlib.asynccontextmanager
async def streams_under_way(
    amqp_url: str, tmp_path: Path, agents: list[dict[str, Any]], prefix: str, n: int, m: int
) -> AsyncIterator[tuple[LocalCluster, QlmClient, list[asyncio.Task[Run]]]]:
    """A cluster of ``agents`` and ``n`` streamed requests of ``m`` tokens collected in the
    background, yielded once both agents stream them."""
    async with (
        running_cluster(amqp_url, tmp_path, agents) as cluster,
        QlmClient(amqp_url) as client,
    ):
        tasks = [
            asyncio.create_task(collect(client, streamed_request(f"{prefix}-{i}", m), 240))
            for i in range(n)
        ]
        await asyncio.sleep(1.5)
        assert not any(t.done() for t in tasks)
        yield cluster, client, tasks


def check_exactly_once(pieces: list[StreamPiece], result: ResultMessage) -> None:
    """Offsets contiguous from 0, every output token once, text and ids equal to the result."""
    at = 0
    for p in pieces:
        assert p.offset == at, (p.offset, at)
        at += len(p.token_ids)
    assert [t for p in pieces for t in p.token_ids] == result.output_token_ids
    assert "".join(p.text for p in pieces) == result.output_text


async def test_tokens_stream_before_the_result_each_once_in_order(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    agents = [{"agent_id": "ts", "models": [MODEL], "time_scale": 1.0}]
    async with (
        running_cluster(isolated_amqp_url, tmp_path, agents),
        QlmClient(isolated_amqp_url) as client,
        QlmClient(isolated_amqp_url) as plain_client,
    ):
        runs = await asyncio.gather(
            *(collect(client, streamed_request(f"ts-{i}", 200), 120) for i in range(8))
        )
        # a request that does not ask to stream gets no chunks, only its result
        plain = await plain_client.request(
            streamed_request("ts-plain", 50).model_copy(update={"stream": False}), 60
        )
        assert isinstance(plain, ResultMessage)
        assert plain_client.stray_chunks == 0
        # a stream's last chunk leaves its agent once the completion is confirmed, so the
        # reply may overtake it (then it is dropped as stray: the reply carries its tokens)
        assert client.stray_chunks <= 8
        assert client.duplicate_count() == 0
        # the 8 streams share this client's reply queue: the agent sent their chunks
        # together, several to a message (one message per chunk would make these equal)
        assert client.token_chunks >= 3 * client.token_messages, (
            client.token_chunks,
            client.token_messages,
        )
    for i, (timed, result) in enumerate(runs):
        pieces = [p for _, p in timed]
        check_exactly_once(pieces, result)
        assert result.output_token_ids == sim_tokens(f"ts-{i}", 200)
        # streamed: many pieces, and most tokens came well before the result did
        assert len(pieces) > 10, len(pieces)
        from_chunks = sum(len(p.token_ids) for p in pieces[:-1])
        assert from_chunks >= 150, from_chunks
        first_at, end_at = timed[0][0], timed[-1][0]
        assert end_at - first_at > 0.5, "tokens arrived as a burst at the end"


async def test_agent_killed_mid_stream_no_token_repeated_or_missing(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    # real-time engines: 300 tokens take a few seconds, so the kill lands mid-stream. The two
    # engines draw different tokens for the same request (engine seeds 0 and 1), as sampling
    # without a seed does on two GPUs: a request run again from scratch would contradict
    # the tokens its producer already has.
    agents = [
        {"agent_id": "ts-a", "models": [MODEL], "time_scale": 1.0},
        {"agent_id": "ts-b", "models": [MODEL], "time_scale": 1.0, "extra_args": ["--seed", "1"]},
    ]
    n, max_tokens = 16, 300
    async with streams_under_way(isolated_amqp_url, tmp_path, agents, "kill", n, max_tokens) as (
        cluster,
        client,
        tasks,
    ):
        cluster.kill_agent("ts-a", signal.SIGKILL)
        runs = await asyncio.gather(*tasks)
        await asyncio.sleep(0.5)
        assert client.duplicate_count() == 0
        resumes = await stream_resumes_counted(cluster.admin_url)
    retried = 0
    for i, (timed, result) in enumerate(runs):
        pieces = [p for _, p in timed]
        # what the producer was streamed is the answer, token for token
        check_exactly_once(pieces, result)
        out = result.output_token_ids
        on_a, on_b = sim_tokens(f"kill-{i}", max_tokens), sim_tokens(f"kill-{i}", max_tokens, 1)
        if out in (on_a, on_b):
            continue  # it ran on one engine only (its stream equals that engine's answer)
        # moved from the killed agent (a) to b: b resumed after the tokens the producer had
        # from a. Started again instead, the answer would be b's whole one, and the stream
        # (a's first tokens, then b's) would not equal it: check_exactly_once fails above.
        resumed = next(j for j in range(max_tokens) if out[j] != on_a[j])
        assert resumed > 0 and out[resumed:] == on_b[resumed:], (i, resumed)
        assert result.attempts > 1
        retried += 1
        # and the moved stream went on from b's chunks, not from the result at the end
        assert sum(len(p.token_ids) for p in pieces[:-1]) >= max_tokens - 50
    assert retried > 0, "the killed agent had streams in flight; they must have moved"
    assert resumes == retried, (resumes, retried)


async def test_agent_hung_mid_stream_and_woken_does_not_contradict_the_streams(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    # a (fast) is SIGSTOPped mid-stream, declared lost after the 2 s heartbeat timeout, its
    # requests resume on b (four times slower, other tokens: engine seed 1) after what was
    # streamed; then a wakes and its engine goes on with the old attempts, overtaking b.
    # Its chunks and its (late) results must not reach the producers: the streams fence
    # themselves, and a late result that contradicts the stream is refused; the coordinator
    # stops those old attempts once a's heartbeats report them again.
    slow_b = {"agent_id": "th-b", "models": [MODEL], "time_scale": 0.25}
    agents = [{"agent_id": "th-a", "models": [MODEL], "time_scale": 1.0}, slow_b]
    slow_b["extra_args"] = ["--seed", "1"]
    async with streams_under_way(isolated_amqp_url, tmp_path, agents, "hang", 16, 300) as (
        cluster,
        client,
        tasks,
    ):
        cluster.kill_agent("th-a", signal.SIGSTOP)
        await asyncio.sleep(3.5)  # declared lost after 2 s; b resumes its requests
        cluster.kill_agent("th-a", signal.SIGCONT)
        runs = await asyncio.gather(*tasks)
        assert client.duplicate_count() == 0
        fenced = "token_streams_fenced" in cluster.logs("th-a")
        # and the coordinator stopped those old attempts (their requests run on b)
        await wait_until(lambda: "stale_attempt_stopped" in cluster.logs("coordinator"))
    moved = 0
    for timed, result in runs:
        check_exactly_once([p for _, p in timed], result)  # the stream is the answer
        moved += result.attempts > 1
    assert moved > 0, "the hung agent had streams in flight; they must have moved"
    assert fenced, "the woken agent must have dropped the streams of its old attempts"


async def test_a_stream_moved_after_a_coordinator_takeover_goes_on_after_its_tokens(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    # The active coordinator is SIGKILLed mid-stream and the standby takes over: the tap's
    # chunks the dead one had read are gone with it. Then agent a is SIGKILLed too, and its
    # requests resume on b, whose engine draws other tokens (seed 1). They must resume after
    # what their producers have, which the standby asked a for when it adopted them
    # (StreamResync): from scratch, b's answer would contradict a's first tokens.
    agents = [
        {"agent_id": "tk-a", "models": [MODEL], "time_scale": 0.5},
        {"agent_id": "tk-b", "models": [MODEL], "time_scale": 1.0, "extra_args": ["--seed", "1"]},
    ]
    n, max_tokens = 16, 900
    async with (
        running_cluster(isolated_amqp_url, tmp_path, agents) as cluster,
        QlmClient(isolated_amqp_url) as client,
    ):
        cluster.start_standby()
        await asyncio.sleep(2.0)  # the standby connects and waits behind the active consumer
        tasks = [
            asyncio.create_task(collect(client, streamed_request(f"tk-{i}", max_tokens), 240))
            for i in range(n)
        ]
        await asyncio.sleep(1.5)
        assert cluster.coordinator is not None and not any(t.done() for t in tasks)
        cluster.coordinator.send_signal(signal.SIGKILL)
        cluster.coordinator.wait(timeout=10)
        await wait_until(lambda: "stream_resync_sent" in cluster.logs("coordinator-standby"))
        await wait_until(lambda: "streams_resynced" in cluster.logs("tk-a"))
        await asyncio.sleep(0.3)  # the prefixes reach the standby's tap
        assert not all(t.done() for t in tasks)
        cluster.kill_agent("tk-a", signal.SIGKILL)
        runs = await asyncio.gather(*tasks)
        await asyncio.sleep(0.5)
        assert client.duplicate_count() == 0
    retried = 0
    for i, (timed, result) in enumerate(runs):
        check_exactly_once([p for _, p in timed], result)  # the stream is the answer
        out = result.output_token_ids
        on_a, on_b = sim_tokens(f"tk-{i}", max_tokens), sim_tokens(f"tk-{i}", max_tokens, 1)
        if out in (on_a, on_b):
            continue  # it ran on one engine only
        resumed = next(j for j in range(max_tokens) if out[j] != on_a[j])
        assert resumed > 0 and out[resumed:] == on_b[resumed:], (i, resumed)
        retried += 1
    assert retried > 0, "the killed agent had streams in flight; they must have moved"


async def stream_resumes_counted(admin_url: str) -> float:
    """The coordinator's qlm_stream_resumes_total, once its liveness tick has counted them."""
    async with httpx.AsyncClient(timeout=10) as http:
        deadline = time.monotonic() + 10
        while True:
            text = (await http.get(admin_url + "/metrics")).text
            found = [
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("qlm_stream_resumes_total ")
            ]
            if (found and found[0] > 0) or time.monotonic() > deadline:
                return found[0] if found else 0.0
            await asyncio.sleep(0.2)


def dispatch(rid: str, routes: list[tuple[str, str | None]]) -> Dispatch:
    now = time.time()
    return Dispatch(
        dispatch_id=f"{rid}-d1",
        instance_id="gpu0",
        attempt=1,
        request=streamed_request(rid, 16),
        submitted_at=now,
        queued_at=now,
        dispatched_at=now,
        reply_routes=[ReplyRoute(reply_to=q, correlation_id=c) for q, c in routes],
    )


async def next_message(queue: AbstractQueue, timeout: float = 5.0) -> AbstractIncomingMessage:
    deadline = time.monotonic() + timeout
    while (m := await queue.get(no_ack=True, fail=False)) is None:
        assert time.monotonic() < deadline, f"nothing on {queue.name} in {timeout} s"
        await asyncio.sleep(0.005)
    return m


def contents(m: AbstractIncomingMessage) -> list[tuple[str, str, int, list[int]]]:
    """(correlation id, request id, offset, token ids) of each chunk in a message."""
    assert m.type == "tokens" and m.delivery_mode == aio_pika.DeliveryMode.NOT_PERSISTENT
    return [
        (cid, c.request_id, c.offset, c.token_ids)
        for cid, c in decode_token_message(m.body, m.correlation_id)
    ]


async def test_agent_sends_one_message_per_reply_queue_per_flush_first_tokens_at_once(
    isolated_amqp_url: str,
) -> None:
    interval = 1.0  # long, so that a chunk that waited for the flush is told from one that did not
    conn = await qlm_amqp.connect(isolated_amqp_url, name="test-token-streams")
    streams = TokenStreams(flush_interval_s=interval)
    try:
        channel = await conn.channel()
        gateway = await channel.declare_queue("gw", exclusive=True)  # three requests share it
        other = await channel.declare_queue("other", exclusive=True)  # a second route of "a"
        await streams.start(conn)
        streams.open(dispatch("a", [("gw", "cid-a"), ("other", "cid-a2")]))
        streams.open(dispatch("b", [("gw", "cid-b")]))
        streams.open(dispatch("c", [("gw", None)]))  # published without a correlation id

        # a's first token: out at once, and alone on each queue, so the single-chunk shape
        t0 = time.monotonic()
        streams.on_delta(TokenDelta("a", 0, [10], "x"))
        m = await next_message(gateway)
        assert time.monotonic() - t0 < interval / 2, "a first token waited for the flush"
        assert m.correlation_id == "cid-a"
        assert json_type(m) == "tokens" and contents(m) == [("cid-a", "a", 0, [10])]
        assert contents(await next_message(other)) == [("cid-a2", "a", 0, [10])]

        # b's and c's first tokens come with more of a's: one flush at once, one message per
        # queue, the first chunks ahead, each chunk naming its own route
        t0 = time.monotonic()
        streams.on_delta(TokenDelta("a", 1, [11], "y"))
        streams.on_delta(TokenDelta("b", 0, [20], "p"))
        streams.on_delta(TokenDelta("c", 0, [30], "q"))
        streams.on_delta(TokenDelta("a", 2, [12], "z"))  # follows on: the same chunk
        m = await next_message(gateway)
        assert time.monotonic() - t0 < interval / 2, "first tokens waited for the flush"
        assert m.correlation_id is None and json_type(m) == "tokens_batch"
        assert contents(m) == [
            ("cid-b", "b", 0, [20]),
            ("c", "c", 0, [30]),  # no correlation id: its request id routes it
            ("cid-a", "a", 1, [11, 12]),
        ]
        assert contents(await next_message(other)) == [("cid-a2", "a", 1, [11, 12])]

        # later tokens wait for the flush, then go out together
        t0 = time.monotonic()
        streams.on_delta(TokenDelta("b", 1, [21], "r"))
        streams.on_delta(TokenDelta("a", 3, [13], "w"))
        streams.on_delta(TokenDelta("a", 5, [15], "v"))  # a gap: a chunk of its own
        m = await next_message(gateway)
        assert time.monotonic() - t0 >= interval * 0.9, "later tokens did not wait to batch"
        assert contents(m) == [
            ("cid-a", "a", 3, [13]),  # cut when the gap came
            ("cid-a", "a", 5, [15]),  # the rest cut at the flush, a request's in order
            ("cid-b", "b", 1, [21]),
        ]
        assert contents(await next_message(other)) == [
            ("cid-a2", "a", 3, [13]),
            ("cid-a2", "a", 5, [15]),
        ]
        assert await gateway.get(no_ack=True, fail=False) is None
        assert (streams.published, streams.messages, streams.publish_failures) == (11, 6, 0)
    finally:
        await streams.stop()
        await conn.close()


async def test_every_token_message_reaches_the_tap_and_the_end_waits_for_the_result(
    isolated_amqp_url: str,
) -> None:
    """The coordinator's copy: the same publish routes each token message to the reply queue
    and to qlm.streams.tap (BCC, stripped on delivery), and the message with a request's last
    tokens names it in its end header, on both copies, once the agent's report for it is
    confirmed (it is held until then)."""
    conn = await qlm_amqp.connect(isolated_amqp_url, name="test-token-tap")
    streams = TokenStreams(flush_interval_s=0.01)
    try:
        channel = await conn.channel()
        topology = await declare_topology(channel, shards=1)
        tap = topology.stream_tap
        gateway = await channel.declare_queue("gw-tap", exclusive=True)
        await streams.start(conn)
        streams.open(dispatch("a", [("gw-tap", "cid-a")]))
        streams.on_delta(TokenDelta("a", 0, [1, 2], "x"))
        first, first_tap = await next_message(gateway), await next_message(tap)
        assert contents(first) == contents(first_tap) == [("cid-a", "a", 0, [1, 2])]
        for m in (first, first_tap):
            assert STREAM_END_HEADER not in (m.headers or {})
            assert "BCC" not in (m.headers or {})
        # a's last tokens wait for its result to be safe (the agent's confirmed report)
        streams.on_delta(TokenDelta("a", 2, [3], "y", final=True))
        streams.close("a")
        await asyncio.sleep(0.2)
        assert await gateway.get(no_ack=True, fail=False) is None
        assert await tap.get(no_ack=True, fail=False) is None
        streams.release("a", final=True)
        last, last_tap = await next_message(gateway), await next_message(tap)
        assert contents(last) == contents(last_tap) == [("cid-a", "a", 2, [3])]
        for m in (last, last_tap):
            ended = [
                x.decode() if isinstance(x, bytes) else x for x in m.headers[STREAM_END_HEADER]
            ]
            assert ended == ["a"]

        # an attempt evicted as it ended: its last tokens go out, not as the stream's end
        streams.open(dispatch("b", [("gw-tap", "cid-b")]))
        streams.on_delta(TokenDelta("b", 0, [7, 8], "z", final=True))
        streams.close("b")
        streams.release("b", final=False)
        for m in (await next_message(gateway), await next_message(tap)):
            assert contents(m) == [("cid-b", "b", 0, [7, 8])]
            assert STREAM_END_HEADER not in (m.headers or {})
        streams.release("b", final=True)  # nothing held any more: nothing sent
        await asyncio.sleep(0.1)
        assert await gateway.get(no_ack=True, fail=False) is None
    finally:
        await streams.stop()
        await conn.close()


async def test_a_resync_sends_the_tap_what_each_producer_has_and_nothing_else(
    isolated_amqp_url: str,
) -> None:
    """A coordinator that took over asks for adopted streams: each open stream's prefix as
    its producer has it (the dispatch's resume tokens, then the chunks published, while they
    follow on) goes to the tap alone, as one chunk at offset 0; tokens still buffered, streams
    closed or unknown send nothing, and the producer gets no copy."""
    conn = await qlm_amqp.connect(isolated_amqp_url, name="test-token-resync")
    streams = TokenStreams(flush_interval_s=0.5)  # a buffered token stays buffered a while
    try:
        channel = await conn.channel()
        topology = await declare_topology(channel, shards=1)
        tap = topology.stream_tap
        gateway = await channel.declare_queue("gw-resync", exclusive=True)
        await streams.start(conn)
        resumed = dispatch("a", [("gw-resync", "cid-a")]).model_copy(
            update={"resume_token_ids": [1, 2, 3], "attempt": 2}
        )
        streams.open(resumed)
        streams.open(dispatch("b", [("gw-resync", "cid-b")]))
        streams.open(dispatch("c", [("gw-resync", "cid-c")]))
        for rid, offset, ids in (("a", 3, [4, 5]), ("b", 0, [9]), ("a", 5, [6])):
            streams.on_delta(TokenDelta(rid, offset, ids, "x"))
            assert contents(await next_message(gateway))[0][1:] == (rid, offset, ids)
            await next_message(tap)
        streams.on_delta(TokenDelta("a", 6, [7], "z"))  # buffered, not yet published
        streams.close("b")  # finished here: nothing to resync
        assert await streams.resync(["a", "b", "c", "unknown", "a"]) == 1
        m = await next_message(tap)
        assert m.headers is None or "BCC" not in m.headers
        assert [
            (c.request_id, c.offset, c.token_ids, c.attempt)
            for _, c in decode_token_message(m.body, m.correlation_id)
        ] == [("a", 0, [1, 2, 3, 4, 5, 6], 2)]
        await asyncio.sleep(0.1)
        assert await tap.get(no_ack=True, fail=False) is None
        assert await gateway.get(no_ack=True, fail=False) is None
    finally:
        await streams.stop()
        await conn.close()


def json_type(m: AbstractIncomingMessage) -> str:
    return str(json.loads(m.body)["type"])


async def test_an_agent_silent_past_the_fence_drops_the_streams_it_had(
    isolated_amqp_url: str,
) -> None:
    """Silent past the heartbeat timeout, the agent was declared lost and its requests moved:
    chunks of those old attempts, sent when it wakes, would contradict the new attempts'. Its
    streams fence themselves; later dispatches stream again."""
    fence = 0.3
    conn = await qlm_amqp.connect(isolated_amqp_url, name="test-token-fence")
    streams = TokenStreams(flush_interval_s=0.01, fence_after_s=fence)
    try:
        channel = await conn.channel()
        gateway = await channel.declare_queue("gw-fence", exclusive=True)
        await streams.start(conn)
        streams.heartbeat_sent()
        streams.open(dispatch("a", [("gw-fence", "cid-a")]))
        streams.open(dispatch("b", [("gw-fence", "cid-b")]))
        streams.on_delta(TokenDelta("a", 0, [1], "x"))
        assert contents(await next_message(gateway)) == [("cid-a", "a", 0, [1])]

        # the agent hangs (no heartbeat) past the fence, then its engine goes on: nothing of
        # a's or b's old attempts goes out, found by the publisher
        await asyncio.sleep(fence * 2)
        streams.on_delta(TokenDelta("a", 1, [2], "y"))
        streams.on_delta(TokenDelta("b", 0, [5], "p"))
        await asyncio.sleep(0.2)
        assert await gateway.get(no_ack=True, fail=False) is None
        assert streams.fenced == 2 and not streams.streaming("a")

        # a new dispatch after it streams; a gap found by the heartbeat first fences it too
        streams.heartbeat_sent()
        streams.open(dispatch("c", [("gw-fence", "cid-c")]))
        streams.on_delta(TokenDelta("c", 0, [9], "z"))
        assert contents(await next_message(gateway)) == [("cid-c", "c", 0, [9])]
        streams.heartbeat_sent(time.monotonic() + fence * 2)
        streams.on_delta(TokenDelta("c", 1, [10], "w"))
        await asyncio.sleep(0.2)
        assert await gateway.get(no_ack=True, fail=False) is None
        assert streams.fenced == 3
    finally:
        await streams.stop()
        await conn.close()
