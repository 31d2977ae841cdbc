"""The ``rct`` scenario, shrunk to seconds: the estimates made at dispatch (the target's figure),
the plans' estimates beside them, and the paper's static queue (a burst, planned once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from qlm.planner import simulation_policy
from qlm.tooling.simulator.presets import PRESETS, load_preset
from qlm.tooling.simulator.report import write_outputs
from qlm.tooling.simulator.runner import PolicyVariant, run_scenario, scenario_requests
from qlm.tooling.simulator.scenario import ScenarioSpec
from qlm.tooling.simulator.targets import evaluate

# more than the two engines take in before the first tick (a batch of about 180 each)
BURST = {"interactive": 300, "batch": 450}


def small_rct() -> ScenarioSpec:
    """45 s of the 12 req/s point (its queues build from about 30 s) and, for the static
    queue, a burst of 750 requests."""
    data = load_preset("rct").model_dump(mode="json", exclude_none=True)
    data["duration_s"] = 45.0
    assert data["sweep"]["variants"] == ["12 req/s", "static queue"]
    for stream in data["sweep"]["values"][1]:
        assert stream["arrival"]["process"] == "burst"
        stream["arrival"]["count"] = BURST[stream["name"]]
    return ScenarioSpec.model_validate(data)


@pytest.fixture(scope="module")
def summary() -> dict[str, Any]:
    preset = PRESETS["rct"]
    assert preset.record_estimates
    variant = PolicyVariant("qlm", "qlm", preset.policy_overrides["qlm"])
    out = run_scenario(small_rct(), simulation_policy, variants=[variant], record_estimates=True)
    out["targets"] = preset.targets
    evaluate(out)
    return out


def test_the_static_queue_is_a_burst_of_the_same_two_streams_at_t_0() -> None:
    (_, dynamic), (_, static) = small_rct().sweep_points()
    burst = scenario_requests(static)
    assert len(burst) == sum(BURST.values())
    assert {r.arrival_s for r in burst} == {0.0}
    assert {r.stream for r in burst} == {s.name for s in dynamic.streams}
    assert [(s.e2e_slo_s, s.max_tokens) for s in static.streams] == [
        (s.e2e_slo_s, s.max_tokens) for s in dynamic.streams
    ]


def test_every_served_request_has_its_estimate_at_dispatch_and_the_target_judges_it(
    summary: dict[str, Any],
) -> None:
    qlm = summary["policies"]["qlm"]
    head = summary["scatter"]
    assert (head["point"], head["estimate"]) == ("12 req/s", "dispatch")
    assert len(head["x"]) == qlm["completed"][0] > 200
    assert [c["target"] for c in summary["checks"]] == [
        "R^2 >= 0.95, estimated at dispatch vs simulated completion time"
    ]
    assert summary["checks"][0]["measured"].startswith(f"R^2 = {head['r2']:.3f} over ")


def test_the_static_queue_is_planned_once_and_reported_beside_the_target(
    summary: dict[str, Any],
) -> None:
    by_name = {sc["name"]: sc for sc in summary["scatters"]}
    assert list(by_name) == ["plan 12 req/s", "dispatch static queue", "plan static queue"]
    replans = summary["policies"]["qlm"]["replans"][1]
    # the first plan as soon as 2 requests per instance wait (the engines' first credit is
    # spent), then the one at the first tick over the rest; no arrival after it, so no other
    assert replans == 2
    n = sum(BURST.values())
    assert len(by_name["dispatch static queue"]["x"]) == n
    # the engines take their first requests before the plan: those have no plan estimate
    assert n // 2 < len(by_name["plan static queue"]["x"]) < n
    assert all(x >= 0 for x in by_name["plan static queue"]["x"])


def test_the_report_lists_and_plots_every_estimate(summary: dict[str, Any], tmp_path: Path) -> None:
    paths = write_outputs(summary, tmp_path, None)
    names = {p.name for p in paths}
    assert {
        "scatter.png",
        "scatter-plan_12_req_s.png",
        "scatter-dispatch_static_queue.png",
        "scatter-plan_static_queue.png",
    } <= names
    text = (tmp_path / "results.md").read_text()
    for sc in [summary["scatter"], *summary["scatters"]]:
        assert f"- {sc['title']}: R² = {sc['r2']:.3f} over {len(sc['x']):,} requests" in text
