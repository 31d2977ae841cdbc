"""``qlm bench planner`` end to end on a tiny case, plus the properties of its synthetic queues."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qlm.cli import app
from qlm.planner import POLICIES, create_policy
from qlm.tooling.bench_planner import (
    NOW,
    build_instances,
    build_queue,
    live_core,
    run_cases,
    run_policy_case,
    select_cases,
    service_estimate_s,
)

CASE_KEYS = {
    "queued",
    "instances",
    "slo",
    "replan_s_p50",
    "replan_s_p95",
    "predicted_slo_attainment",
    "edf_predicted_slo_attainment",
    "peak_rss_mb",
}


def test_cli_tiny_case_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "planner",
            "--queued", "200",
            "--instances", "2",
            "--slo", "tight",
            "--repeats", "2",
            "--policies", "qlm,edf,fcfs,shepherd,no-such-policy",
            "--json", str(out),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "policy" in result.output and "edf" in result.output
    doc = json.loads(out.read_text())
    [case] = doc["cases"]
    assert set(case) >= CASE_KEYS
    assert (case["queued"], case["instances"], case["slo"]) == (200, 2, "tight")
    per = case["policies"]
    assert per["no-such-policy"]["skipped"]
    for name in ("edf", "fcfs", "shepherd"):
        r = per[name]
        assert len(r["replan_s"]) == 2
        assert 0 < r["replan_s_p50"] <= r["replan_s_p95"]
        assert 0.0 <= r["predicted_slo_attainment"] <= 1.0
        assert r["peak_rss_mb"] >= r["base_rss_mb"] > 10
        assert r["unassigned"] == 0
    assert case["edf_predicted_slo_attainment"] == per["edf"]["predicted_slo_attainment"]
    if "qlm" in POLICIES:
        assert case["primary_policy"] == "qlm"
        assert case["predicted_slo_attainment"] == per["qlm"]["predicted_slo_attainment"]
        assert case["peak_rss_mb"] == per["qlm"]["peak_rss_mb"]
    else:
        assert case["primary_policy"] is None and case["replan_s_p50"] is None
        assert doc["notes"]


def test_cli_rejects_an_unknown_slo() -> None:
    result = CliRunner().invoke(app, ["bench", "planner", "--slo", "medium"])
    assert result.exit_code != 0


def test_grid_and_selection() -> None:
    assert len(select_cases(None, None, None)) == 12
    assert select_cases(1000, None, "loose") == [(1000, 8, "loose"), (1000, 32, "loose")]


def test_queue_is_deterministic_and_uses_both_models() -> None:
    a = build_queue(500, 8, "tight", seed=1)
    assert a == build_queue(500, 8, "tight", seed=1)
    assert a != build_queue(500, 8, "tight", seed=2)
    assert {r.model for r in a} == {"mistral-7b", "vicuna-13b"}
    assert {r.slo_class for r in a} == {"interactive", "batch"}
    for r in a:
        if r.slo_class == "interactive":
            assert r.deadline == pytest.approx(
                r.arrival_time + 3.0 * service_estimate_s(r.model, r.prompt_tokens, r.max_tokens)
            )


def test_instances_mix_gpus_and_models() -> None:
    insts = build_instances(8)
    assert {i.gpu_type for i in insts} == {"A100-80GB", "H100-80GB"}
    assert sum(1 for i in insts if len(i.models) == 2) == 4
    assert all(i.kv_capacity_tokens > 0 and i.max_batch_size > 0 for i in insts)


def test_tight_slos_are_harder_than_loose_ones() -> None:
    doc = run_cases([(1000, 8, "tight"), (1000, 8, "loose")], ["edf"], repeats=1, isolate=False)
    tight, loose = (c["edf_predicted_slo_attainment"] for c in doc["cases"])
    assert tight < loose


def test_live_core_holds_the_backlog_as_the_coordinator_would() -> None:
    reqs = build_queue(300, 4, "tight")
    insts = build_instances(4)
    core = live_core(reqs, insts, create_policy("edf"))
    views, live = core.begin_plan()
    core.abort_plan(NOW)
    assert [i.instance_id for i in live] == [i.instance_id for i in insts]
    assert [(i.models, i.gpu_type, i.active_model) for i in live] == [
        (i.models, i.gpu_type, i.active_model) for i in insts
    ]
    by_id = {r.request_id: r for r in views}
    assert set(by_id) == {r.request_id for r in reqs}  # every request queued, none dispatched
    for r in reqs:
        v = by_id[r.request_id]
        assert (v.model, v.prompt_tokens, v.max_tokens, v.slo_class) == (
            r.model,
            r.prompt_tokens,
            r.max_tokens,
            r.slo_class,
        )
        assert v.arrival_time == r.arrival_time
        assert v.deadline is not None and r.deadline is not None
        assert abs(v.deadline - r.deadline) <= 0.0005 + 1e-6  # its SLO in whole ms


def test_live_replans_time_the_coordinators_three_phases() -> None:
    r = run_policy_case(300, 4, "tight", "qlm", 2, live=True)
    assert len(r["replan_s"]) == len(r["live_phases_s"]) == 2
    for total, phases in zip(r["replan_s"], r["live_phases_s"], strict=True):
        assert set(phases) == {"begin_plan", "plan", "adopt_plan"}
        assert sum(phases.values()) == pytest.approx(total, abs=1e-3)
    assert r["unassigned"] == 0 and 0.0 < r["predicted_slo_attainment"] <= 1.0
    assert "live_phases_s" not in run_policy_case(300, 4, "tight", "edf", 1)
