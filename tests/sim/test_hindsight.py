"""The hindsight bound (qlm/tooling/simulator/hindsight.py): an upper bound on SLO attainment that
no
policy may beat, solved to optimality on a relaxation of the simulated cluster."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.engine_model import get_profile
from qlm.planner import create_policy, simulation_policy
from qlm.tooling.simulator.cluster import ClusterSimulator, InstanceSpec, SimConfig
from qlm.tooling.simulator.hindsight import EngineCosts, hindsight_bound, pools_of
from qlm.tooling.simulator.report import aggregate_seeds, markdown_table, render_console_table
from qlm.tooling.simulator.runner import run_scenario
from qlm.tooling.simulator.scenario import ScenarioSpec
from qlm.tooling.simulator.workload import SimRequest

A100 = "A100-80GB"
PROFILES = [(A100, "mistral-7b", None), ("A10", "vicuna-13b", None), ("H100-80GB", "mistral-7b", 2)]


def request(
    k: int,
    arrival: float = 0.0,
    prompt: int = 500,
    output: int = 100,
    *,
    e2e: float | None = 60.0,
    ttft: float | None = None,
    tbt: float | None = None,
) -> SimRequest:
    return SimRequest(
        request_id=f"r{k}",
        model="mistral-7b",
        arrival_s=arrival,
        prompt_tokens=prompt,
        output_tokens=output,
        max_tokens=4096,
        slo_class="interactive",
        e2e_slo_s=e2e,
        ttft_slo_s=ttft,
        stream="test",
        tbt_slo_s=tbt,
    )


def solo_latency(prompt: int, output: int, gpu: str = A100) -> float:
    profile = get_profile(gpu, "mistral-7b")
    return profile.prefill_time(prompt) + profile.decode_segment_time(1, prompt + 1, output - 1)


# ------------------------------------------------------------------------ the engine's costs


@pytest.mark.parametrize(("gpu", "model", "tp"), PROFILES)
def test_solo_latency_is_the_engine_models(gpu: str, model: str, tp: int | None) -> None:
    profile = get_profile(gpu, model, tp=tp)
    costs = EngineCosts.of(profile)
    rng = np.random.default_rng(0)
    prompt, output = rng.integers(1, 3000, 100), rng.integers(1, 1000, 100)
    mine = costs.solo_prefill(prompt) + costs.solo_decode(prompt, output)
    want = [
        profile.prefill_time(int(p)) + profile.decode_segment_time(1, int(p) + 1, int(o) - 1)
        for p, o in zip(prompt, output, strict=True)
    ]
    assert mine == pytest.approx(want, rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(
    profile_at=st.sampled_from(PROFILES),
    chunks=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 2048)), max_size=3),
    contexts=st.lists(st.integers(2, 8000), max_size=256),
)
def test_token_shares_never_exceed_the_iteration(
    profile_at: tuple[str, str, int | None],
    chunks: list[tuple[int, int]],
    contexts: list[int],
) -> None:
    """The bound's premise: whatever an iteration holds (prefill chunks of any sequence, up to
    max_num_seqs decoding sequences), its duration is at least the sum of its tokens' compute
    shares and at least the sum of their memory shares."""
    gpu, model, tp = profile_at
    profile = get_profile(gpu, model, tp=tp)
    costs = EngineCosts.of(profile)
    if not chunks and not contexts:
        return
    compute = memory = 0.0
    for done, new in chunks:  # positions done+1 .. done+new of a prompt
        c1, m1 = costs.prefill_work(np.array([done + new]))
        c0, m0 = costs.prefill_work(np.array([done]))
        compute += float(c1[0] - c0[0])
        memory += float(m1[0] - m0[0])
    for ctx in contexts:  # one decode step at context ctx: prompt ctx - 1, its second token
        c, m = costs.decode_work(np.array([ctx - 1]), np.array([2]))
        compute += float(c[0])
        memory += float(m[0])
    seconds = profile.iteration_time(
        sum(n for _, n in chunks),
        len(contexts),
        sum(contexts),
        prefill_attention_pairs=sum(n * done + n * (n + 1) / 2 for done, n in chunks),
    )
    assert compute <= seconds * (1 + 1e-12)
    assert memory <= seconds * (1 + 1e-12)


def test_the_envelope_is_no_slower_than_any_engine() -> None:
    a = EngineCosts.of(get_profile(A100, "vicuna-13b"))
    b = EngineCosts.of(get_profile("A10", "vicuna-13b"))
    env = EngineCosts.envelope([a, b])
    prompt, output = np.array([10, 900, 3000]), np.array([1, 50, 700])
    for c in (a, b):
        assert np.all(env.solo_prefill(prompt) <= c.solo_prefill(prompt))
        assert np.all(env.solo_decode(prompt, output) <= c.solo_decode(prompt, output))
        for mine, theirs in zip(
            env.decode_work(prompt, output), c.decode_work(prompt, output), strict=True
        ):
            assert np.all(mine <= theirs)


# ----------------------------------------------------------------------- hand-made workloads


def serial_instance() -> list[InstanceSpec]:
    """One A100 that decodes one sequence at a time: requests cannot share iterations."""
    return [InstanceSpec("i0", A100, ("mistral-7b",), max_num_seqs=1)]


def test_three_requests_of_which_only_two_fit() -> None:
    """Three equal requests at t = 0 on a serial engine with 2.5 solo latencies to go: any
    scheduler meets two. The program's optimum is fractional (about 2.5); the bound is 2."""
    solo = solo_latency(1, 200)
    reqs = [request(k, prompt=1, output=200, e2e=2.5 * solo) for k in range(3)]
    bound = hindsight_bound(reqs, pools_of(serial_instance()))
    assert bound.met == 2
    assert 2.0 < bound.lp_value < 3.0
    assert bound.solo_infeasible == 0
    sim = ClusterSimulator(serial_instance(), create_policy("fcfs"), reqs, SimConfig()).run()
    assert sum(o.met for o in sim.outcomes) == 2  # a real schedule reaches it here
    # with room for all three, all three
    roomy = [request(k, prompt=1, output=200, e2e=3.2 * solo) for k in range(3)]
    assert hindsight_bound(roomy, pools_of(serial_instance())).met == 3


def test_windows_are_widened_never_narrowed() -> None:
    """Requests whose windows end off any bucket edge, back to back on a serial engine: each
    just fits after the one before, so a narrowed window would lose one."""
    solo = solo_latency(1, 150)
    reqs = [
        request(k, arrival=k * solo * 1.0001, prompt=1, output=150, e2e=solo * 1.0002)
        for k in range(8)
    ]
    bound = hindsight_bound(reqs, pools_of(serial_instance()))
    assert bound.met == 8
    sim = ClusterSimulator(serial_instance(), create_policy("fcfs"), reqs, SimConfig()).run()
    assert sum(o.met for o in sim.outcomes) == 8


def test_a_request_that_cannot_make_it_alone_is_never_counted() -> None:
    solo = solo_latency(2000, 300)
    first = get_profile(A100, "mistral-7b").prefill_time(2000)
    reqs = [
        request(0, prompt=2000, output=300, e2e=0.99 * solo),  # too late even alone
        request(1, prompt=2000, output=300, e2e=None, ttft=0.99 * first),  # first token late
        request(2, prompt=2000, output=300, e2e=60.0, tbt=0.5 * (solo - first) / 299),
        request(3, prompt=2000, output=300, e2e=1.01 * solo),  # fits, alone on 4 instances
    ]
    insts = [InstanceSpec(f"i{k}", A100, ("mistral-7b",)) for k in range(4)]
    bound = hindsight_bound(reqs, pools_of(insts))
    assert bound.solo_infeasible == 3
    assert bound.met == 1
    assert bound.attainment == 0.25


def test_no_deadline_counts_and_an_empty_workload() -> None:
    free = request(0, e2e=None, ttft=None)
    bound = hindsight_bound([free], pools_of(serial_instance()))
    assert (bound.met, bound.unconstrained) == (1, 1)
    empty = hindsight_bound([], pools_of(serial_instance()))
    assert empty.met == 0 and empty.attainment is None


def test_chain_calls_are_released_after_their_predecessors() -> None:
    """A two-step chain: the second call cannot be issued before the first could finish plus
    its think time, and is judged against the task deadline: with 1.5 solo latencies of task
    SLO and 0.2 of think time, the second step can never make it."""
    solo = solo_latency(500, 100)
    calls = []
    for stage in range(2):
        r = request(stage, prompt=500, output=100, e2e=None)
        r.request_id = f"p.{stage}"
        r.program_id = "p"
        r.task_slo_s = r.program_slo_s = 1.5 * solo
        r.after = ("p.0",) if stage else ()
        r.think_s = 0.2 * solo if stage else 0.0
        calls.append(r)
    bound = hindsight_bound(calls, pools_of([InstanceSpec("i0", A100, ("mistral-7b",))]))
    assert (bound.met, bound.solo_infeasible) == (1, 1)
    calls[1].task_slo_s = calls[1].program_slo_s = 2.3 * solo  # now it fits
    bound = hindsight_bound(calls, pools_of([InstanceSpec("i0", A100, ("mistral-7b",))]))
    assert bound.met == 2


# ------------------------------------------------------------------ against simulated policies


def _overloaded(**extra: Any) -> ScenarioSpec:
    """One A100 at about twice its capacity for a minute: the bound binds (below 100 %)."""
    stream = {
        "models": ["mistral-7b"],
        "arrival": {"process": "poisson", "rate_rps": 6.0},
        "lengths": {"source": "sharegpt", "max_prompt_tokens": 4096},
    }
    data: dict[str, Any] = {
        "name": "overloaded",
        "duration_s": 60,
        "pools": [{"gpu": A100, "count": 1, "models": ["mistral-7b"]}],
        "streams": [
            {**stream, "name": "chat", "slo_class": "interactive", "e2e_slo_s": 15},
            {**stream, "name": "batch", "slo_class": "batch", "e2e_slo_s": 40},
        ],
        "policies": ["fcfs", "edf", "edf-shed", "qlm"],
        "options": {"drain_s": 120},
    }
    data.update(extra)
    return ScenarioSpec.model_validate(data)


def test_no_policy_beats_the_bound_on_an_overloaded_cluster() -> None:
    summary = run_scenario(_overloaded(), simulation_policy)
    bound = summary["hindsight"]
    assert bound["requests"] == summary["policies"]["fcfs"]["requests"]
    assert bound["slo_attainment"] < 1.0  # it binds here, so the comparison means something
    for name, entry in summary["policies"].items():
        assert entry["slo_attainment"] <= bound["slo_attainment"], name
    assert bound["lp"]["solve_s"] < 5


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), rate=st.floats(2.0, 14.0))
def test_fcfs_and_edf_never_beat_the_bound(seed: int, rate: float) -> None:
    spec = _overloaded(seed=seed, policies=["fcfs", "edf"])
    spec = spec.with_value("streams.0.arrival.rate_rps", rate / 2)
    spec = spec.with_value("streams.1.arrival.rate_rps", rate / 2)
    summary = run_scenario(spec, simulation_policy)
    for entry in summary["policies"].values():
        assert entry["slo_attainment"] <= summary["hindsight"]["slo_attainment"]


def test_programs_never_beat_the_bound() -> None:
    chain = {
        "name": "agent",
        "models": ["mistral-7b"],
        "slo_class": "agent",
        "arrival": {"process": "poisson", "rate_rps": 1.0},
        "lengths": {"source": "sharegpt", "max_prompt_tokens": 512, "max_output_tokens": 256},
        "program": {"shape": "chain", "stages": [2, 4], "think_s": 1.0, "slo_s": 12},
    }
    tree = {
        **chain,
        "name": "tot",
        "slo_class": "tot",
        "program": {"shape": "tree", "stages": [2, 3], "fanout": [2, 3], "slo_s": 10},
    }
    spec = _overloaded(policies=["fcfs", "edf"])
    spec = spec.with_value("streams", [*spec.model_dump()["streams"], chain, tree])
    summary = run_scenario(spec, simulation_policy)
    for entry in summary["policies"].values():
        assert entry["slo_attainment"] <= summary["hindsight"]["slo_attainment"]


# ----------------------------------------------------------------------------------- reports


def _summary(bound: float, fcfs: float) -> dict[str, Any]:
    return {
        "scenario": "s",
        "policies": {"fcfs": {"slo_attainment": fcfs, "requests": 10, "completed": 10}},
        "hindsight": {"slo_attainment": bound, "met": round(bound * 10), "requests": 10},
    }


def test_reports_show_the_bound_beside_attainment_with_its_spread_over_seeds() -> None:
    one = _summary(0.9, 0.5)
    assert "hindsight bound (%)" in markdown_table(one)
    assert "| 50.0 | 90.0 |" in markdown_table(one)
    combined = aggregate_seeds([_summary(0.9, 0.5), _summary(0.7, 0.3)], [0, 1])
    assert combined["hindsight"]["slo_attainment"] == pytest.approx(0.8)
    assert combined["hindsight"]["sd"]["slo_attainment"] == pytest.approx(math.sqrt(0.02))
    assert combined["hindsight"]["per_seed"]["1"]["met"] == 7
    assert "80.0 ± 14.1" in render_console_table(combined)
