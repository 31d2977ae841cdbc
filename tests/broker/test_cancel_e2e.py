"""Cancelling requests through the real broker (protocol ``cancel`` message): a held request,
a running one, a cancel that comes before its request, and one that comes after the reply.
Every request gets exactly one reply."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from qlm.client import QlmClient
from qlm.store import Store
from qlm.types import SLO, ErrorCode, ErrorMessage, RequestMessage, ResultMessage
from tests.e2e import running_cluster, store_record

pytestmark = [pytest.mark.broker, pytest.mark.slow]

MODEL = "mistral-7b"
# a slow engine (time scale 5) so a 1,024-token request runs for seconds; the batch tier keeps
# long-deadline requests held (never released on spare capacity)
AGENTS = [{"agent_id": "cx", "models": [MODEL], "time_scale": 5.0}]
ENV = {"QLM_BATCH_RELEASE_BELOW": "0", "QLM_BATCH_RELEASE_TWO_BELOW": "0"}


def req(rid: str, max_tokens: int = 8, e2e_ms: int = 120_000) -> RequestMessage:
    return RequestMessage(
        request_id=rid, model=MODEL, prompt="hello", max_tokens=max_tokens, slo=SLO(e2e_ms=e2e_ms)
    )


async def status_of(database_url: str, request_id: str) -> str | None:
    store = await Store.open(database_url)
    try:
        record = await store.get_request(request_id)  # written asynchronously: may be None
    finally:
        await store.close()
    return None if record is None else str(record["status"])


async def test_cancels_end_held_running_and_early_requests_with_one_reply(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    async with running_cluster(isolated_amqp_url, tmp_path, AGENTS, extra_env=ENV) as cluster:
        db = cluster.database_url
        async with QlmClient(isolated_amqp_url) as client:
            held = await client.submit(req("cx-held", e2e_ms=5 * 3600_000))
            running = await client.submit(req("cx-run", max_tokens=1024))
            # running: wait until the agent has it
            deadline = time.monotonic() + 20
            while await status_of(db, "cx-run") != "dispatched":
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await client.cancel("cx-held", "changed my mind")
            await client.cancel("cx-run")
            # a cancel that comes first: its request is answered without running
            await client.cancel("cx-early")
            early = await client.submit(req("cx-early"))
            replies = await asyncio.wait_for(asyncio.gather(held, running, early), timeout=30)
            # after the reply a cancel changes nothing
            done = await client.request(req("cx-done"), timeout=30)
            await client.cancel("cx-done")
            await asyncio.sleep(1.0)
            counts = dict(client.reply_counts)
        for reply in replies:
            assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.CANCELLED, reply
        assert "changed my mind" in replies[0].message  # type: ignore[union-attr]
        assert isinstance(done, ResultMessage)
        assert all(counts[r] == 1 for r in ("cx-held", "cx-run", "cx-early", "cx-done")), counts
        for rid in ("cx-held", "cx-run"):
            record = await store_record(db, rid)
            assert record["status"] == "cancelled" and record["error_code"] == "cancelled"
        assert (await store_record(db, "cx-done"))["status"] == "completed"
        metrics = (await cluster.admin("GET", "/metrics")).text
        assert 'qlm_requests_total{outcome="cancelled"} 3.0' in metrics
