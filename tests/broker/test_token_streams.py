"""Per-token streams on the durable path (``stream: true``), end to end: a real coordinator and
real sim agent processes on a private vhost. Tokens reach the producer before the result,
each exactly once and in order, also when the agent running a request is SIGKILLed mid-stream
and the request finishes on another agent.
"""

from __future__ import annotations

import asyncio
import signal
import time
import zlib
from pathlib import Path

import pytest

from qlm.agents.sim import VOCAB_SIZE, _mix64
from qlm.client import QlmClient, StreamPiece
from qlm.types import SLO, RequestMessage, ResultMessage
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


async def collect(
    client: QlmClient, req: RequestMessage, timeout: float
) -> tuple[list[tuple[float, StreamPiece]], ResultMessage]:
    pieces: list[tuple[float, StreamPiece]] = []
    async for piece in client.stream(req, timeout=timeout):
        pieces.append((time.monotonic(), piece))
    result = pieces[-1][1].result
    assert isinstance(result, ResultMessage)
    return pieces, result


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
    ):
        runs = await asyncio.gather(
            *(collect(client, streamed_request(f"ts-{i}", 200), 120) for i in range(8))
        )
        # a request that does not ask to stream gets no chunks, only its result
        plain = await client.request(
            streamed_request("ts-plain", 50).model_copy(update={"stream": False}), 60
        )
        assert isinstance(plain, ResultMessage)
        assert client.stray_chunks == 0
        assert client.duplicate_count() == 0
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
    # real-time engines: 300 tokens take a few seconds, so the kill lands mid-stream
    agents = [
        {"agent_id": "ts-a", "models": [MODEL], "time_scale": 1.0},
        {"agent_id": "ts-b", "models": [MODEL], "time_scale": 1.0},
    ]
    n, max_tokens = 16, 300
    async with (
        running_cluster(isolated_amqp_url, tmp_path, agents) as cluster,
        QlmClient(isolated_amqp_url) as client,
    ):
        tasks = [
            asyncio.create_task(collect(client, streamed_request(f"kill-{i}", max_tokens), 240))
            for i in range(n)
        ]
        await asyncio.sleep(1.5)  # both agents stream
        assert not any(t.done() for t in tasks)
        cluster.kill_agent("ts-a", signal.SIGKILL)
        runs = await asyncio.gather(*tasks)
        await asyncio.sleep(0.5)
        assert client.duplicate_count() == 0
    retried = 0
    for i, (timed, result) in enumerate(runs):
        pieces = [p for _, p in timed]
        check_exactly_once(pieces, result)
        assert result.output_token_ids == sim_tokens(f"kill-{i}", max_tokens)
        retried += result.attempts > 1
        # the moved streams went on from the new agent's chunks (the new attempt re-sent the
        # tokens already delivered; they were dropped), not from the result at the end
        assert sum(len(p.token_ids) for p in pieces[:-1]) >= max_tokens - 50
    assert retried > 0, "the killed agent had streams in flight; they must have moved"
