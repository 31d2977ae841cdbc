"""Live eviction, with and without: one sim GPU (batch cap 8), 16 long batch requests, then 12
urgent chat requests that would miss behind them. Run from the repository root:

    .venv/bin/python examples/live_eviction.py --eviction on
    .venv/bin/python examples/live_eviction.py --eviction off

It starts a private broker (or uses QLM_AMQP_URL), an in-process coordinator with the qlm
planner and an agent with a real-time sim engine, and prints how many SLOs were met, how many
requests were evicted and resumed, and whether any reply was doubled.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

from qlm.agents.agent import Agent
from qlm.agents.sim import SimEngine
from qlm.client import QlmClient
from qlm.coordinator.core import LSOSettings
from qlm.coordinator.service import Coordinator
from qlm.planner import create_policy
from qlm.store import Store
from qlm.tooling import localbroker
from qlm.types import SLO, RequestMessage, ResultMessage

MODEL = "mistral-7b"


async def run(url: str, eviction: bool) -> None:
    workdir = tempfile.mkdtemp(prefix="qlm-eviction-")
    store = await Store.open(f"sqlite+aiosqlite:///{workdir}/qlm.db")
    coord = Coordinator(
        amqp_url=url,
        policy=create_policy("qlm"),
        store=store,
        shards=1,
        lso=LSOSettings(eviction=eviction),
    )
    await coord.start()
    engine = SimEngine("A100-80GB", [MODEL], time_scale=1.0, seed=1, max_batch_size=8)
    agent = Agent(url, [engine], agent_id="example", heartbeat_interval_s=0.2)
    await agent.start()
    started = time.monotonic()
    try:
        async with QlmClient(url) as client:
            while "example-gpu0" not in coord.core.instances:  # noqa: ASYNC110 - polls state
                await asyncio.sleep(0.05)
            futures = []
            for i in range(16):
                req = RequestMessage(
                    request_id=f"batch{i}",
                    model=MODEL,
                    prompt_token_ids=list(range(500)),
                    max_tokens=3000,
                    slo=SLO(e2e_ms=3_600_000, slo_class="batch"),
                )
                futures.append(await client.submit(req))
            await asyncio.sleep(2)
            for i in range(12):
                req = RequestMessage(
                    request_id=f"chat{i}",
                    model=MODEL,
                    prompt_token_ids=list(range(100)),
                    max_tokens=50,
                    slo=SLO(e2e_ms=6_000, slo_class="chat"),
                )
                futures.append(await client.submit(req))
            replies = await asyncio.wait_for(asyncio.gather(*futures), 600)
            await asyncio.sleep(0.5)
            results = [r for r in replies if isinstance(r, ResultMessage)]
            met = sum(r.slo.met for r in results)
            chat_met = sum(r.slo.met for r in results if r.request_id.startswith("chat"))
            print(
                f"eviction={'on' if eviction else 'off'}: SLO met {met}/{len(replies)} "
                f"(chat {chat_met}/12), evicted+resumed {agent.evicted}, "
                f"duplicate replies {client.duplicate_count()}, "
                f"wall {time.monotonic() - started:.0f} s"
            )
    finally:
        await agent.stop()
        await coord.stop()
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eviction", choices=["on", "off"], default="on")
    args = parser.parse_args()
    url = os.environ.get("QLM_AMQP_URL")
    if url:
        asyncio.run(run(url, args.eviction == "on"))
        return
    with localbroker.session_broker() as url:
        asyncio.run(run(url, args.eviction == "on"))


if __name__ == "__main__":
    main()
