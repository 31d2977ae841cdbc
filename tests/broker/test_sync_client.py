"""The blocking client against a live coordinator: a completion without a request id, a
submitted future, and a cancel."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from qlm.client import new_request
from qlm.sync_client import SyncQlmClient
from qlm.types import ErrorCode, ErrorMessage, ResultMessage
from tests.e2e import running_cluster

pytestmark = [pytest.mark.broker, pytest.mark.slow]

AGENT = [{"agent_id": "sync", "models": ["mistral-7b"], "time_scale": 50.0}]
HOLD = {"QLM_BATCH_RELEASE_BELOW": "0", "QLM_BATCH_RELEASE_TWO_BELOW": "0"}


async def test_sync_client_completes_submits_and_cancels(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    async with running_cluster(isolated_amqp_url, tmp_path, AGENT, extra_env=HOLD):

        def use() -> tuple[object, object, object]:
            with SyncQlmClient(isolated_amqp_url) as client:
                done = client.complete("mistral-7b", "hello", max_tokens=4, timeout=30)
                fut = client.submit(new_request("mistral-7b", "hi", max_tokens=4))
                held_req = new_request("mistral-7b", "later", e2e_ms=5 * 3600_000)
                held = client.submit(held_req)
                client.cancel(held_req.request_id, "not needed")
                return done, fut.result(30), held.result(30)

        # in a thread: this test's own loop must stay free for the cluster fixture
        done, submitted, held = await asyncio.to_thread(use)
    assert isinstance(done, ResultMessage) and done.request_id.startswith("req-")
    assert isinstance(submitted, ResultMessage)
    assert isinstance(held, ErrorMessage) and held.code == ErrorCode.CANCELLED
