"""The ``coding`` scenario (CATO's four coding tasks) and its power-of-two baseline, on
scaled-down runs: the preset, the router, the SLA calibration and the target check."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from qlm.planner import POLICIES, PowerOfTwoPolicy, create_policy
from qlm.planner.stochastic import QLMPolicy
from qlm.policy import QueuePolicy
from qlm.tooling.simulator.presets import (
    CODING_CALIBRATION_RPS,
    CODING_RATES,
    CODING_TASKS,
    PRESETS,
    coding,
    coding_calibration,
)
from qlm.tooling.simulator.runner import PolicyVariant, run_scenario
from qlm.tooling.simulator.scenario import ScenarioSpec
from qlm.tooling.simulator.targets import evaluate
from tests.builders import make_instance, make_plan_request

TASK_KINDS = {
    "completion": "ttft",
    "generation": "ttft",
    "translation": "e2e",
    "summarisation": "e2e",
}


def factory(name: str, overrides: Mapping[str, Any]) -> QueuePolicy:
    """As ``qlm bench sim`` builds policies: qlm budgets work, not wall time (reproducible)."""
    if name == "qlm":
        return QLMPolicy(budget_clock="work", **overrides)
    return create_policy(name)


# ----------------------------------------------------------------------------- the preset
def test_the_preset_validates_and_sweeps_the_paper_rates() -> None:
    spec = PRESETS["coding"].spec()
    assert spec.sweep is not None
    assert spec.sweep.variants == [f"{r:g}" for r in CODING_RATES]
    assert CODING_RATES[0] == 0.67 and CODING_RATES[-1] == 3.33
    assert CODING_CALIBRATION_RPS in CODING_RATES
    assert {"qlm", "round_robin", "power_of_two"} <= set(spec.policies)
    assert all(p in POLICIES for p in spec.policies)
    for rate, (_, point) in zip(CODING_RATES, spec.sweep_points(), strict=True):
        total = sum(s.arrival.rate_rps or 0.0 for s in point.streams)
        assert total == pytest.approx(rate)
        assert all(s.arrival.process == "poisson" for s in point.streams)


def test_the_four_task_types_carry_their_slo_kinds_and_pattern_1_shares() -> None:
    spec = PRESETS["coding"].spec()
    streams = {s.name: s for s in spec.streams}
    assert set(streams) == set(TASK_KINDS)
    for name, kind in TASK_KINDS.items():
        stream = streams[name]
        assert stream.slo_class == name
        if kind == "ttft":
            assert stream.ttft_slo_s is not None and stream.e2e_slo_s is None
        else:
            assert stream.e2e_slo_s is not None and stream.ttft_slo_s is None
    shares = {t.name: t.share for t in CODING_TASKS}
    assert shares == {
        "completion": 0.4,
        "generation": 0.4,
        "translation": 0.1,
        "summarisation": 0.1,
    }
    # token shapes (CATO Fig. 2): completion and summarisation short out, the others long out
    caps = {t.name: t.lengths["max_output_tokens"] for t in CODING_TASKS}
    assert caps["completion"] <= 10 and caps["summarisation"] <= 30
    assert caps["generation"] >= 400 and caps["translation"] >= 400


def test_the_fixed_slas_are_the_mean_at_1_67_rps_under_power_of_two() -> None:
    """CATO's calibration rule, re-run: the constants must follow the cluster and lengths."""
    measured = coding_calibration(factory)
    assert set(measured) == set(TASK_KINDS)
    for task in CODING_TASKS:
        assert round(measured[task.name], 2) == pytest.approx(task.sla_s), task.name


# ---------------------------------------------------------------------------- power-of-two
def _cluster() -> list:
    return [
        make_instance("a"),
        make_instance("b"),
        make_instance("c", draining=True),
        make_instance("d", ("other",)),
        make_instance("e"),
        make_instance("f"),
    ]


def test_power_of_two_is_deterministic_for_a_seed_and_only_picks_eligible_instances() -> None:
    insts = _cluster()
    eligible = {"a", "b", "e", "f"}
    reqs = [make_plan_request(f"r{i}", arrival=i, deadline=None, seq=i) for i in range(200)]
    load = {i.instance_id: float(k * 7 % 5) for k, i in enumerate(insts)}

    def picks(seed: int) -> list[str | None]:
        policy = PowerOfTwoPolicy(seed)
        return [policy.place(r, insts, load, now=0.0) for r in reqs]

    first = picks(3)
    assert first == picks(3)
    assert set(first) <= eligible
    assert first != picks(4)  # the seed changes the samples
    order = PowerOfTwoPolicy(3).plan(list(reversed(reqs)), list(reversed(insts)), now=0.0)
    assert order.queues == PowerOfTwoPolicy(3).plan(reqs, insts, now=0.0).queues
    assert {iid for iid, q in order.queues.items() if q} <= eligible


def test_power_of_two_sends_to_the_less_loaded_of_its_two_samples() -> None:
    insts = [make_instance(f"i{k}") for k in range(6)]
    policy = PowerOfTwoPolicy(0)
    seen_pairs = set()
    for k in range(100):
        req = make_plan_request(f"r{k}", arrival=k, deadline=None, seq=k)
        load = {i.instance_id: float((k * 31 + n * 17) % 11) for n, i in enumerate(insts)}
        pair = policy.candidates(req, insts)
        assert len({i.instance_id for i in pair}) == 2  # two distinct instances
        seen_pairs.add(tuple(sorted(i.instance_id for i in pair)))
        lighter = min(load[i.instance_id] for i in pair)
        target = policy.place(req, insts, load, now=0.0)
        assert target in {i.instance_id for i in pair}
        assert load[target] == lighter
    assert len(seen_pairs) > 6  # samples vary over requests, not one fixed pair


# ------------------------------------------------------------------------- a small run
@pytest.fixture(scope="module")
def small_summary() -> dict[str, Any]:
    spec = ScenarioSpec.model_validate(coding(duration_s=60.0, rates=[1.67, 3.33]))
    variants = [PolicyVariant(p, p) for p in ("qlm", "round_robin", "power_of_two")]
    summary = run_scenario(spec, factory, variants=variants)
    evaluate(summary)
    return summary


def test_a_small_run_reports_attainment_for_every_task_type(small_summary: dict) -> None:
    for policy, metrics in small_summary["policies"].items():
        by_class = metrics["slo_attainment_by_class"]
        assert set(by_class) == set(TASK_KINDS), policy
        for values in by_class.values():
            assert len(values) == 2
            assert all(v is not None and 0.0 <= v <= 1.0 for v in values)
        assert all(0.0 < u <= 1.0 for u in metrics["gpu_utilisation"])
        assert metrics["completed"] == metrics["requests"]  # the drain finishes every task


def test_the_target_check_runs_on_the_small_run(small_summary: dict) -> None:
    checks = [c["target"] for c in small_summary["checks"]]
    assert checks[:4] == [
        "3.33 req/s: qlm code-generation goodput > round_robin",
        "3.33 req/s: qlm GPU utilisation > round_robin",
        "3.33 req/s: qlm code-generation goodput > power_of_two",
        "3.33 req/s: qlm GPU utilisation > power_of_two",
    ]
    # then issue 17's at every rate run: goodput against every baseline, and the throughput
    # target against vllm where it ran
    rates = [str(v) for v in small_summary["sweep"]["variants"]]
    goodput = [f"{r} req/s: qlm SLO goodput >= every baseline's" for r in rates]
    assert [c for c in checks[4:] if "goodput" in c] == goodput
    assert all("throughput >= 1x vllm" in c for c in checks[4:] if "goodput" not in c)


# ----------------------------------------------------------------------------- the target
def _summary(gen: dict[str, list[float]], util: dict[str, list[float]]) -> dict[str, Any]:
    return {
        "scenario": "coding",
        "sweep": {"values": [[], []], "variants": ["1.67", "3.33"]},
        "policies": {
            p: {"slo_attainment_by_class": {"generation": gen[p]}, "gpu_utilisation": util[p]}
            for p in gen
        },
    }


def test_the_coding_target_compares_at_3_33_only() -> None:
    summary = _summary(
        gen={"qlm": [0.1, 0.86], "round_robin": [0.9, 0.70], "power_of_two": [0.9, 0.90]},
        util={"qlm": [0.1, 0.47], "round_robin": [0.9, 0.36], "power_of_two": [0.9, 0.47]},
    )
    evaluate(summary)
    met = {c["target"]: c["met"] for c in summary["checks"]}
    assert met == {
        "3.33 req/s: qlm code-generation goodput > round_robin": True,
        "3.33 req/s: qlm GPU utilisation > round_robin": True,
        "3.33 req/s: qlm code-generation goodput > power_of_two": False,
        "3.33 req/s: qlm GPU utilisation > power_of_two": False,  # a tie is not "above"
    }
    assert len(summary["misses"]) == 2


def test_the_coding_target_misses_when_3_33_was_not_run() -> None:
    summary = _summary(
        gen={"qlm": [0.9, 0.9], "round_robin": [0.1, 0.1], "power_of_two": [0.1, 0.1]},
        util={"qlm": [0.9, 0.9], "round_robin": [0.1, 0.1], "power_of_two": [0.1, 0.1]},
    )
    summary["sweep"]["variants"] = ["0.67", "1.67"]
    evaluate(summary)
    assert [c["met"] for c in summary["checks"]] == [False]
    assert summary["misses"][0].startswith("3.33 req/s point in the run")
