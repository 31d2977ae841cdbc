"""Fidelity: the simulator against the product it runs.

The same 60 s trace, with the same seed, is served (a) live: the real broker, a coordinator and
a ``sim`` agent as processes, a producer publishing each request at its arrival time; and (b) by
the cluster simulator, which drives the same coordinator core, pull rules and engine scheduler
on a simulated clock. What differs is only what the simulator leaves out: broker hops, the
agent's 20 ms pull loop and heartbeat delays, event-loop jitter. Per-request SLO outcomes must
agree for at least 95 % of the requests and attainment within 2 points (issue 16).

The trace overloads one A100 (18 req/s for 60 s, about 1.1x what it serves) with two SLO
classes, so that about a quarter of the requests miss: agreement is not won by meeting
everything.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from qlm.client import QlmClient
from qlm.planner import create_policy
from qlm.tooling.simulator.cluster import ClusterSimulator, InstanceSpec, SimConfig
from qlm.tooling.simulator.workload import SimRequest
from qlm.types import SLO, RequestMessage, ResultMessage
from tests.e2e import gather_replies, running_cluster

pytestmark = [pytest.mark.broker, pytest.mark.slow]

MODEL = "mistral-7b"
GPU = "A100-80GB"
DURATION_S = 60.0
RATE_RPS = 18.0
CLASSES = [(6.0, "chat"), (30.0, "batch")]  # (end-to-end SLO s, class)


def parity_trace(seed: int) -> list[SimRequest]:
    """Poisson arrivals; prompt 64-1024 and output 32-384 tokens. The live sim engine
    generates exactly max_tokens, so the output is max_tokens in both runs."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(RATE_RPS)
        if t > DURATION_S:
            return out
        prompt, output = rng.randint(64, 1024), rng.randint(32, 384)
        slo, cls = rng.choice(CLASSES)
        out.append(
            SimRequest(f"par-{len(out)}", MODEL, t, prompt, output, output, cls, slo, None, "p")
        )


def simulated(trace: list[SimRequest], policy: str) -> dict[str, bool]:
    spec = InstanceSpec("par-gpu0", GPU, (MODEL,))
    sim = ClusterSimulator([spec], create_policy(policy, budget_clock="work"), trace, SimConfig())
    return {o.request_id: o.met for o in sim.run().outcomes}


async def served_live(
    trace: list[SimRequest], policy: str, amqp_url: str, tmp_path: Path
) -> dict[str, bool]:
    rng = random.Random(1)
    messages = {
        r.request_id: RequestMessage(
            request_id=r.request_id,
            model=MODEL,
            prompt_token_ids=[rng.randrange(32_000) for _ in range(r.prompt_tokens)],
            max_tokens=r.max_tokens,
            slo=SLO(e2e_ms=round(r.e2e_slo_s * 1000), slo_class=r.slo_class),
        )
        for r in trace
    }
    agents = [{"agent_id": "par", "models": [MODEL], "gpu_type": GPU, "time_scale": 1.0}]
    async with (
        running_cluster(amqp_url, tmp_path, agents, policy=policy) as _,
        QlmClient(amqp_url) as client,
    ):
        futures: list[asyncio.Future[object]] = []
        start = time.time() + 1.0
        for r in trace:
            await asyncio.sleep(max(0.0, start + r.arrival_s - time.time()))
            # submitted at its trace time: deadlines count from there, as in the simulator
            sub = client.submit(messages[r.request_id], submitted_at=start + r.arrival_s)
            futures.append(asyncio.ensure_future(sub))
        replies = await gather_replies(list(await asyncio.gather(*futures)), timeout=120)
    met = {}
    for reply in replies:
        assert isinstance(reply, ResultMessage), reply
        met[reply.request_id] = reply.slo.met
    return met


@pytest.mark.parametrize("policy", ["qlm"])  # the default; fcfs measured too (0.997)
async def test_live_and_simulated_runs_of_one_trace_agree(
    policy: str, isolated_amqp_url: str, tmp_path: Path
) -> None:
    trace = parity_trace(seed=0)
    sim = simulated(trace, policy)
    live = await served_live(trace, policy, isolated_amqp_url, tmp_path)
    assert set(live) == set(sim) == {r.request_id for r in trace}
    n = len(trace)
    agree = sum(live[rid] == sim[rid] for rid in sim) / n
    live_att, sim_att = sum(live.values()) / n, sum(sim.values()) / n
    print(f"{policy}: {n} requests, agreement {agree:.3f}, live {live_att:.3f} sim {sim_att:.3f}")
    assert 0.5 < sim_att < 0.95  # the trace overloads: some miss, most meet
    assert agree >= 0.95
    assert abs(live_att - sim_att) <= 0.02
