"""Largest service-gain density first: what it prefers, and the best-effort reserve. (It also
passes the conformance suite every registered policy must pass.)"""

from __future__ import annotations

import pytest

from qlm.planner import create_policy
from qlm.planner.gain_density import GainDensityPolicy
from qlm.policy import CompletionObservation, PlanInstance, PlanRequest


def req(
    rid: str,
    *,
    prompt: int = 100,
    max_tokens: int = 200,
    e2e: float | None = 20.0,
    ttft: float | None = None,
    at: float = 0.0,
    seq: int = 0,
) -> PlanRequest:
    return PlanRequest(
        request_id=rid,
        model="mistral-7b",
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        arrival_time=at,
        deadline=None if e2e is None else at + e2e,
        ttft_deadline=None if ttft is None else at + ttft,
        seq=seq,
    )


INSTANCE = PlanInstance("i0", ("mistral-7b",), "A100-80GB", 100_000, 256)


def order(policy: GainDensityPolicy, requests: list[PlanRequest], now: float) -> list[str]:
    return policy.plan(requests, [INSTANCE], now).queues["i0"]


def test_short_requests_go_first_when_both_can_make_it() -> None:
    p = GainDensityPolicy()
    short, long = req("short", max_tokens=50), req("long", max_tokens=2000)
    assert order(p, [long, short], now=0.0) == ["short", "long"]


def test_a_request_that_can_only_be_very_late_waits_behind_one_that_can_be_saved() -> None:
    p = GainDensityPolicy()
    # same shape; the first has waited 60 s of its 20 s SLO already: worth a quarter or less
    doomed = req("doomed", at=-60.0, seq=0)
    savable = req("savable", at=-1.0, seq=1)
    assert order(p, [doomed, savable], now=0.0) == ["savable", "doomed"]
    assert p.density(doomed, 0.0) < p.density(savable, 0.0) / 3


def test_learned_output_lengths_change_the_estimate() -> None:
    p = GainDensityPolicy()
    r = req("r", max_tokens=1000)
    assert p.expected_output(r) == 500  # nothing observed yet: half the budget
    for _ in range(10):
        p.observe_completion(CompletionObservation("mistral-7b", None, 40))
    assert p.expected_output(r) == 40


def test_best_effort_requests_get_their_reserved_share_of_positions() -> None:
    p = GainDensityPolicy(best_effort_share=0.1)
    urgent = [req(f"u{i}", at=0.0, seq=i) for i in range(27)]
    best_effort = [req(f"b{i}", e2e=None, at=-100.0 + i, seq=100 + i) for i in range(5)]
    queue = order(p, urgent + best_effort, now=0.0)
    assert len(queue) == 32
    positions = [k for k, rid in enumerate(queue) if rid.startswith("b")]
    assert positions[:3] == [9, 19, 29]  # every 10th, oldest first ...
    assert [queue[k] for k in positions] == [f"b{i}" for i in range(5)]  # ... then the rest


def test_no_reserve_puts_best_effort_last() -> None:
    p = GainDensityPolicy(best_effort_share=0.0)
    queue = order(p, [req("b", e2e=None, seq=0), req("u", seq=1)], now=0.0)
    assert queue == ["u", "b"]


def test_registered_and_validated() -> None:
    assert isinstance(create_policy("gain_density"), GainDensityPolicy)
    with pytest.raises(ValueError):
        GainDensityPolicy(best_effort_share=1.0)
    with pytest.raises(ValueError):
        GainDensityPolicy(alpha=0)


def test_the_mixed_scenario_checks_issue_17s_targets_for_the_default_policy() -> None:
    from qlm.tooling.simulator.presets import PRESETS
    from qlm.tooling.simulator.targets import check_mixed

    spec = PRESETS["mixed"].spec()
    assert {s.slo_class for s in spec.streams} == {"streaming", "throughput", "collective"}
    summary = {
        "sweep": {"values": [1, 2], "variants": ["6", "18"]},
        "policies": {
            "qlm": {
                "service_gain": [10.0, 13.0],
                "goodput_rps": [1.0, 4.0],
                "throughput_rps": [5.0, 9.7],
            },
            "gain_density": {
                "service_gain": [10.0, 12.0],
                "goodput_rps": [1.0, 3.5],
                "throughput_rps": [5.0, 9.8],
            },
            "fcfs": {
                "service_gain": [10.0, 10.0],
                "goodput_rps": [1.0, 1.0],
                "throughput_rps": [5.0, 10.0],
            },
        },
    }
    checks = check_mixed(summary)
    assert len(checks) == 3  # only the overload point (18 req/s)
    assert all(ok for _, _, ok in checks)
    summary["policies"]["gain_density"]["goodput_rps"][1] = 4.1  # a baseline's goodput wins
    assert [ok for _, _, ok in check_mixed(summary)] == [True, False, True]
    summary["policies"]["qlm"]["service_gain"][1] = 12.9  # 1.29x fcfs
    assert [ok for _, _, ok in check_mixed(summary)][0] is False
