"""Tempo's service gain: hand-checked values and the properties the metric must keep."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qlm.service_gain import decay, service_gain


def test_decay_is_one_on_time_and_divisive_when_late() -> None:
    assert decay(2.0, 1.0) == 1.0
    assert decay(2.0, 2.0) == 1.0
    assert decay(2.0, 4.0) == pytest.approx(0.5)
    assert decay(2.0, 4.0, alpha=2.0) == pytest.approx(0.25)
    assert decay(2.0, 2.1, alpha=math.inf) == 0.0  # binary goodput
    with pytest.raises(ValueError):
        decay(0.0, 1.0)


def test_end_to_end_requests_lose_gain_in_proportion_to_lateness() -> None:
    # 100 prompt + 50 output tokens: base gain 1*100 + 2*50 = 200
    on_time = service_gain(100, 50, ttft_s=1.0, e2e_s=9.0, e2e_slo_s=10.0)
    twice_late = service_gain(100, 50, ttft_s=1.0, e2e_s=20.0, e2e_slo_s=10.0)
    assert on_time == 200.0 and twice_late == pytest.approx(100.0)
    assert service_gain(100, 50, ttft_s=None, e2e_s=None, e2e_slo_s=10.0) == 0.0
    assert service_gain(100, 50, ttft_s=1.0, e2e_s=50.0) == 200.0  # no deadline: best effort


def test_streaming_requests_discount_the_prompt_by_ttft_and_tokens_by_their_due_times() -> None:
    # TTFT 4 s against 2 s: the prompt part halves. 11 tokens evenly from 4 s to 5 s, due at
    # 2 s + k * 0.1 s -> every token is late by 2 s at most: f = due / emitted
    g = service_gain(100, 11, ttft_s=4.0, e2e_s=5.0, ttft_slo_s=2.0, tbt_slo_s=0.1)
    expected_out = sum(2.0 * (2.0 + 0.1 * k) / (4.0 + 0.1 * k) for k in range(11))
    assert g == pytest.approx(50.0 + expected_out)
    # on the timeline: nothing lost
    assert service_gain(
        100, 11, ttft_s=1.0, e2e_s=2.0, ttft_slo_s=2.0, tbt_slo_s=0.1
    ) == pytest.approx(122.0)
    # no TBT SLO: the output is not discounted
    assert service_gain(100, 11, ttft_s=4.0, e2e_s=30.0, ttft_slo_s=2.0) == pytest.approx(72.0)


def test_both_deadlines_split_the_gain() -> None:
    g = service_gain(100, 50, ttft_s=4.0, e2e_s=20.0, ttft_slo_s=2.0, e2e_slo_s=10.0)
    assert g == pytest.approx(100 * 0.5 + 100 * 0.5)


latency = st.floats(0.01, 1e4, allow_nan=False)


@given(
    prompt=st.integers(0, 10_000),
    out=st.integers(0, 4_000),
    ttft=latency,
    extra=st.floats(0.0, 1e4),
    slo=st.one_of(st.none(), latency),
    ttft_slo=st.one_of(st.none(), latency),
    tbt=st.one_of(st.none(), st.floats(0.001, 1.0)),
)
def test_gain_is_between_zero_and_the_base_and_never_grows_with_lateness(
    prompt: int,
    out: int,
    ttft: float,
    extra: float,
    slo: float | None,
    ttft_slo: float | None,
    tbt: float | None,
) -> None:
    kw = {"e2e_slo_s": slo, "ttft_slo_s": ttft_slo, "tbt_slo_s": tbt}
    g = service_gain(prompt, out, ttft_s=ttft, e2e_s=ttft + extra, **kw)
    base = prompt + 2 * out
    assert -1e-9 <= g <= base + 1e-6
    later = service_gain(prompt, out, ttft_s=ttft * 2, e2e_s=(ttft + extra) * 2, **kw)
    assert later <= g + 1e-6


def test_the_simulator_reports_service_gain_per_policy() -> None:
    from qlm.planner import create_policy
    from qlm.tooling.simulator.presets import PRESETS
    from qlm.tooling.simulator.runner import PolicyVariant, simulate
    from qlm.tooling.simulator.workload import build_requests

    spec = PRESETS["wb"].spec().model_copy(update={"duration_s": 60.0})
    reqs = build_requests(spec)
    gains = {}
    for name in ("fcfs", "edf"):
        result = simulate(spec, PolicyVariant(name, name), lambda n, _o: create_policy(n), reqs)
        metrics = result.metrics()
        total = sum(o.service_gain for o in result.outcomes)
        assert metrics["service_gain"] == pytest.approx(total, abs=0.1)
        gains[name] = total
    assert all(g > 0 for g in gains.values())


def test_the_planner_maximises_service_gain_when_asked() -> None:
    """One instance serving one request at a time; a long request worth far more than three
    short ones, all due at 15 s: either the three short ones meet their SLO, or the long one
    (and one short). Attainment takes the three; service gain takes the long one first."""
    from qlm.planner.stochastic import QLMConfig, QLMPolicy
    from qlm.policy import PlanInstance, PlanRequest

    inst = [PlanInstance("a", ("mistral-7b",), "A100-80GB", 100_000, 1)]
    # 1,450 output tokens: alone it takes ~14.6 s at batch 1 (its decode priced at the context
    # it holds, ~4,700 tokens), so it can meet 15 s
    reqs = [PlanRequest("big", "mistral-7b", 4000, 1450, 0.0, 15.0, None, seq=1)]
    reqs += [
        PlanRequest(f"s{k}", "mistral-7b", 50, 40, 0.0, 15.0, None, seq=2 + k) for k in range(3)
    ]
    by_count = QLMPolicy(QLMConfig(objective="attainment")).plan(reqs, inst, 0.0)
    by_gain = QLMPolicy(QLMConfig(objective="service-gain")).plan(reqs, inst, 0.0)
    assert by_count.queues["a"][-1] == "big" and by_count.meta["predicted_met"] == 3
    assert by_gain.queues["a"][0] == "big" and by_gain.meta["objective"] == "service-gain"
    assert by_gain.meta["predicted_met"] < by_count.meta["predicted_met"]
    # in units of the mean request's gain: the long one alone is worth ≈ 3.7, the three short
    # ones together ≈ 0.2
    assert by_gain.meta["predicted_value"] > 3.5
    with pytest.raises(ValueError, match="objective"):
        QLMConfig(objective="revenue")


def test_the_live_coordinator_takes_the_objective_from_its_settings() -> None:
    from qlm.cli import _live_policy
    from qlm.config import Settings

    policy = _live_policy("qlm", Settings(planner_objective="service-gain"))
    assert policy.config.objective == "service-gain"
    assert _live_policy("qlm", Settings()).config.objective == "attainment"
    assert _live_policy("edf", Settings(planner_objective="service-gain")).name == "edf"
