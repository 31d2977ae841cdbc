"""The batch tier on a live coordinator over the real broker: a request with hours to its
deadline is held, then released to an instance that reports spare capacity, and answered once;
with the tier off it is served at once like any other."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from qlm.client import QlmClient
from qlm.types import SLO, RequestMessage, ResultMessage
from tests.e2e import running_cluster

pytestmark = [pytest.mark.broker, pytest.mark.slow]

AGENTS = [{"agent_id": "bt-a", "models": ["mistral-7b"], "time_scale": 50.0}]


@pytest.mark.parametrize("tier", ["on", "off"])
async def test_a_batch_request_is_held_then_served_on_spare_capacity(
    isolated_amqp_url: str, tmp_path: Path, tier: str
) -> None:
    env = {"QLM_BATCH_TIER": "true" if tier == "on" else "false"}
    async with running_cluster(isolated_amqp_url, tmp_path, AGENTS, extra_env=env) as cluster:
        async with QlmClient(isolated_amqp_url) as client:
            batch = [
                RequestMessage(
                    request_id=f"bt-{tier}-{k}",
                    model="mistral-7b",
                    prompt="summarise the repository",
                    max_tokens=8,
                    slo=SLO(e2e_ms=6 * 3600_000, slo_class="batch"),
                )
                for k in range(5)
            ]
            futures = [await client.submit(r) for r in batch]
            replies = await asyncio.wait_for(asyncio.gather(*futures), timeout=60)
        log = cluster.logs("coordinator")
    assert all(isinstance(r, ResultMessage) and r.slo and r.slo.met for r in replies)
    assert sorted(r.request_id for r in replies) == sorted(r.request_id for r in batch)
    released = log.count('"batch_released"') + log.count("batch_released ")
    assert (released >= 5) if tier == "on" else (released == 0)
