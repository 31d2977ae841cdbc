"""``qlm bench ingest``: how fast the coordinator takes requests off the broker, and how much
latency the queue manager adds between broker delivery and engine start.

Phase 1 (ingest): a backlog of N valid requests is published first; an in-process coordinator
is then started and timed from its first delivery until all N sit in virtual queues (every
delivery parsed, validated, tracked, recorded in the store and placed by the policy).

Phase 2 (added latency): a coordinator and one sim agent (separate processes, two simulated
H100s in real time: at the default 300 req/s of short requests they have spare capacity, so
no request waits for an engine and what is measured is the queue manager itself) serve requests
arriving at a fixed rate; per request, ``started - queued`` (engine start minus the moment the
coordinator received the delivery, both wall clock on this host) is the latency qlm adds.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from qlm.types import SLO, RequestMessage


def _request(i: int, prefix: str) -> RequestMessage:
    return RequestMessage(
        request_id=f"{prefix}-{i}",
        model="mistral-7b",
        prompt_token_ids=[(i * 7 + k) % 32000 for k in range(64)],
        max_tokens=4,
        slo=SLO(e2e_ms=60_000, slo_class="bench"),
    )


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q * 100)) if xs else float("nan")


async def _publish_backlog(amqp_url: str, n: int, shards: int) -> float:
    from qlm.client import QlmClient

    t0 = time.perf_counter()
    async with QlmClient(amqp_url) as client:
        await client.ensure_topology(shards)
        batch = 500
        for start in range(0, n, batch):
            await asyncio.gather(
                *(client.submit(_request(i, "ingest")) for i in range(start, min(n, start + batch)))
            )
    return n / (time.perf_counter() - t0)


async def ingest_phase(amqp_url: str, n: int, shards: int, policy: str) -> dict[str, Any]:
    from qlm.coordinator.service import Coordinator
    from qlm.planner import create_policy
    from qlm.store import Store

    publish_rate = await _publish_backlog(amqp_url, n, shards)
    with tempfile.TemporaryDirectory() as tmp:
        store = await Store.open(f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}")
        coord = Coordinator(
            amqp_url=amqp_url, policy=create_policy(policy), store=store, shards=shards
        )
        await coord.start()
        t_start = time.time()
        while coord.ingested < n and time.time() - t_start < 300:  # noqa: ASYNC110
            await asyncio.sleep(0.005)  # polling a counter: 5 ms resolution is plenty here
        # from the first delivery (consuming starts inside start()) to the last one placed
        elapsed = time.time() - (coord.received_at_first or t_start)
        ingested = coord.ingested
        await coord.stop()
        await store.close()
    return {
        "requests": n,
        "ingested": ingested,
        "shards": shards,
        "publish_rate_rps": round(publish_rate, 1),
        "ingest_rate_rps": round(ingested / elapsed, 1),
        "seconds": round(elapsed, 2),
    }


async def latency_phase(
    amqp_url: str, n: int, rate: float, shards: int, policy: str
) -> dict[str, Any]:
    from qlm.client import QlmClient
    from qlm.tooling.demo import LocalCluster
    from qlm.types import ResultMessage

    cluster = LocalCluster(
        amqp_url,
        policy=policy,
        shards=shards,
        agents=[
            {
                "agent_id": "bench",
                "gpu_type": "H100-80GB",
                "models": ["mistral-7b"],
                "gpus": 2,
                "time_scale": 1.0,
            }
        ],
    )
    try:
        await cluster.start()
        added: list[float] = []
        async with QlmClient(amqp_url) as client:
            futures = []
            t0 = time.perf_counter()
            for i in range(n):
                delay = t0 + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                futures.append(await client.submit(_request(i, "lat")))
            replies = await asyncio.wait_for(asyncio.gather(*futures), timeout=120)
        for r in replies:
            if isinstance(r, ResultMessage) and r.timestamps.started is not None:
                added.append(r.timestamps.started - r.timestamps.queued)
        return {
            "requests": n,
            "rate_rps": rate,
            "replies": len(replies),
            "added_latency_ms": {
                "p50": round(_pct(added, 0.5) * 1000, 2),
                "p99": round(_pct(added, 0.99) * 1000, 2),
                "mean": round(statistics.fmean(added) * 1000, 2) if added else None,
            },
        }
    finally:
        cluster.stop()


async def run_ingest_bench(
    *,
    requests: int,
    rate: float,
    latency_requests: int,
    shards: int,
    policies: list[str],
    progress: bool = False,
) -> dict[str, Any]:
    """``progress``: a bar of the phases finished (two per policy) on stderr, on a terminal."""
    from qlm.tooling.localbroker import ensure_broker, isolated_vhost
    from qlm.tooling.progress import counting

    base = ensure_broker()
    out: dict[str, Any] = {}
    done = 0
    async with counting("phases", 2 * len(policies), lambda: done, enabled=progress):
        for policy in policies:
            # Each phase on a fresh vhost: nothing left over from earlier runs or left behind.
            with isolated_vhost(base, prefix="qlm-bench") as url:
                ingest = await ingest_phase(url, requests, shards, policy)
            done += 1
            with isolated_vhost(base, prefix="qlm-bench") as url:
                latency = await latency_phase(url, latency_requests, rate, shards, policy)
            done += 1
            out[policy] = {"ingest": ingest, "dispatch": latency}
    return out
