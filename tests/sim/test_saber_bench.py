"""The SABER benchmark's machinery: per-column engine settings (a static max-num-seqs cap,
SABER's admission) on the same workload, SABER's Algorithm 1 in the simulator, its USL f(L)
profiled on the simulated engine, and the target check."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from qlm.admission import OutputBudget, PullAdmission, SLOAdmissionGate, USLSpeedModel
from qlm.engine_model import get_profile
from qlm.planner import create_policy
from qlm.tooling.simulator.cluster import ClusterSimulator, InstanceSpec, LSOSwitches, SimConfig
from qlm.tooling.simulator.presets import PRESETS
from qlm.tooling.simulator.runner import (
    PolicyVariant,
    expand_variants,
    instance_specs,
    run_scenario,
    saber_output_budgets,
    scenario_requests,
    sim_config,
)
from qlm.tooling.simulator.saber import fit_decode_speed, fit_engine_speed, task_mean_outputs
from qlm.tooling.simulator.scenario import ScenarioError, ScenarioSpec
from qlm.tooling.simulator.targets import check_saber
from qlm.tooling.simulator.workload import SimRequest

MODEL = "mistral-7b"


def _factory(name: str, overrides: Any) -> Any:
    return create_policy(name, **overrides)


def _short_spec(duration: float = 60.0) -> Any:
    return PRESETS["saber"].spec().model_copy(update={"duration_s": duration})


# ---------------------------------------------------------------------------- the gate itself
def test_saber_check_admits_only_when_the_predicted_speed_meets_both_needs() -> None:
    f = USLSpeedModel(lam=100.0, sigma=0.5, kappa=0.0)  # f(1)=100, f(2)=66.7, f(3)=50
    gate = SLOAdmissionGate(f)
    assert gate.admits_in_time(0, 90.0, 0.0)  # alone: 100 >= 90
    assert not gate.admits_in_time(1, 70.0, 0.0)  # f(2) = 66.7 < 70: the candidate would miss
    assert not gate.admits_in_time(1, 10.0, 80.0)  # a running request needs 80 > f(2)
    assert gate.admits_in_time(2, 50.0, 50.0)  # f(3) = 50 meets both exactly
    assert gate.best_effort(101.0) and not gate.best_effort(100.0)
    # unlike qlm's gate, SABER's check never passes a hopeless request (it is demoted instead)
    assert gate.admits(0, 500.0, 0.0) and not gate.admits_in_time(0, 500.0, 0.0)


def _req(rid: str, t: float, output: int, slo: float) -> SimRequest:
    return SimRequest(rid, MODEL, t, 16, output, output, "c", slo, None, "s")


def _saber_sim(
    requests: list[SimRequest], f: USLSpeedModel, budgets: dict[str, OutputBudget] | None = None
) -> ClusterSimulator:
    config = SimConfig(
        lso=LSOSwitches(slo_pull=True),
        pull_gate="saber",
        speed_models={"i0": {MODEL: f}},
        output_budgets=budgets or {},
        drain_s=120.0,
    )
    spec = InstanceSpec("i0", "A100-80GB", (MODEL,))
    return ClusterSimulator([spec], create_policy("fcfs"), requests, config)


def test_demoted_requests_run_only_once_the_high_priority_queue_is_empty() -> None:
    f = USLSpeedModel(lam=100.0, sigma=0.5, kappa=0.0)
    reqs = [
        _req("fast", 0.0, 90, 1.0),  # needs 90 tok/s: admitted alone, freezes the floor at 90
        _req("held", 0.01, 100, 20.0),  # needs 5, but f(2) = 66.7 < 90: waits in the HPQ
        _req("hopeless", 0.02, 1000, 2.0),  # needs 500 > f(1): demoted to the LPQ
    ]
    sim = _saber_sim(reqs, f)
    result = sim.run()
    jobs = sim.jobs
    assert sim.demoted == 1 and result.demoted == 1
    assert all(j.finished_s is not None for j in jobs.values())
    fast, held, hopeless = jobs["fast"], jobs["held"], jobs["hopeless"]
    assert held.started_s is not None and fast.finished_s is not None
    assert held.started_s >= fast.finished_s  # denied while "fast" ran (the floor)
    assert hopeless.started_s is not None and hopeless.started_s >= held.started_s


def test_a_demoted_request_is_served_at_once_when_nothing_else_waits() -> None:
    f = USLSpeedModel(lam=100.0, sigma=0.5, kappa=0.0)
    sim = _saber_sim([_req("hopeless", 0.0, 1000, 2.0)], f)
    sim.run()
    job = sim.jobs["hopeless"]
    assert sim.demoted == 1 and job.started_s == 0.0 and job.finished_s is not None


def test_requests_become_hopeless_while_they_wait_and_are_demoted_then() -> None:
    f = USLSpeedModel(lam=100.0, sigma=0.5, kappa=0.0)
    reqs = [
        _req("long", 0.0, 400, 5.0),  # needs 80: alone; holds the floor about 4 s
        _req("short", 0.01, 50, 1.5),  # needs 34, f(2) = 66.7 < 80: waits; hopeless at ~1 s
    ]
    sim = _saber_sim(reqs, f)
    sim.run()
    long_, short = sim.jobs["long"], sim.jobs["short"]
    assert sim.demoted == 1
    assert short.started_s is not None and long_.finished_s is not None
    assert short.started_s >= long_.finished_s - 1e-9


def test_demoted_requests_wait_for_requests_in_time_still_in_the_virtual_queue() -> None:
    # the agent holds one dispatched request at a time (window 1), so the requests in time
    # wait in the coordinator's virtual queue, not in the agent: an empty held window is not
    # SABER's empty high-priority queue
    f = USLSpeedModel(lam=100.0, sigma=0.5, kappa=0.0)  # f(1)=100, f(2)=66.7, f(3)=50
    reqs = [
        _req("hopeless", 0.0, 1000, 2.0),  # needs 500 > f(1): demoted
        _req("a", 0.0, 120, 2.0),  # needs 60: f(2) = 66.7 meets it, f(3) = 50 does not
        _req("b", 0.0, 60, 2.0),  # needs 30
    ]
    config = SimConfig(
        lso=LSOSwitches(slo_pull=True),
        pull_gate="saber",
        speed_models={"i0": {MODEL: f}},
        saber_window=1,
        drain_s=120.0,
    )
    spec = InstanceSpec("i0", "A100-80GB", (MODEL,))
    sim = ClusterSimulator([spec], create_policy("fcfs"), reqs, config)
    sim.run()
    jobs = sim.jobs
    assert sim.demoted == 1
    assert all(j.finished_s is not None for j in jobs.values())
    # "a" and "b" start at once, together; the demoted request only once they are in
    assert jobs["a"].started_s == 0.0 and jobs["b"].started_s == 0.0
    a_in, b_in = (jobs[r].finished_s for r in ("a", "b"))
    assert a_in is not None and a_in <= 2.0 and b_in is not None and b_in <= 2.0


def test_the_best_effort_tier_waits_until_the_coordinator_leaves_credit_unused() -> None:
    gate = SLOAdmissionGate(USLSpeedModel(lam=100.0, sigma=0.5, kappa=0.0))
    adm: PullAdmission[tuple[str, float]] = PullAdmission(
        gate, need=lambda r, now: r[1], key=lambda r: r[0], window=1, strict=True
    )
    engine: list[str] = []
    adm.granted(adm.credit_wanted(8))
    adm.on_dispatch(("late", 500.0), engine.append)  # the credit is used: more may follow
    adm.admit(lambda: 8, lambda r: engine.append(r[0]), 0.0)
    assert engine == [] and [r[0] for r in adm.best_effort] == ["late"]
    adm.granted(adm.credit_wanted(8))  # granted, and nothing comes: no request in time waits
    assert adm.in_time_queue_empty()
    adm.admit(lambda: 8, lambda r: engine.append(r[0]), 0.0)
    assert engine == ["late"] and adm.frozen == {"late": 0.0}


def test_a_task_mean_budget_keeps_a_capped_short_answer_in_time() -> None:
    # a client's cap of 1,000 tokens on a 50-token answer due in 2 s: read as its cap it needs
    # 500 tok/s > f(1) and is demoted on arrival; read as its task's mean (50) it needs 25
    f = USLSpeedModel(lam=100.0, sigma=0.5, kappa=0.0)
    capped = [SimRequest("r", MODEL, 0.0, 16, 50, 1000, "c", 2.0, None, "s")]
    assert _saber_sim(capped, f).run().demoted == 1
    sim = _saber_sim(capped, f, {MODEL: OutputBudget({"c": 50.0})})
    result = sim.run()
    assert result.demoted == 0 and sim.jobs["r"].finished_s is not None
    assert sim.jobs["r"].finished_s <= 2.0


def test_task_means_are_profiled_per_class_from_the_workload() -> None:
    reqs = [
        SimRequest(f"q{k}", MODEL, 0.0, 8, 10 + k, 128, "qna", 1.0, None, "q") for k in range(4)
    ]
    reqs += [SimRequest("g0", MODEL, 0.0, 8, 300, 1024, "gen", 8.0, None, "g")]
    reqs += [SimRequest("o0", "other", 0.0, 8, 7, 64, "qna", 1.0, None, "o")]
    assert task_mean_outputs(reqs, MODEL) == {"gen": 300.0, "qna": 11.5}
    budgets = saber_output_budgets([InstanceSpec("i0", "A100-80GB", (MODEL,))], reqs)
    assert set(budgets) == {MODEL} and budgets[MODEL].expected["qna"] == 11.5
    with pytest.raises(ValueError, match="no request"):
        task_mean_outputs(reqs, "absent")


def test_the_saber_gate_needs_a_speed_model() -> None:
    config = SimConfig(lso=LSOSwitches(slo_pull=True), pull_gate="saber")
    spec = InstanceSpec("i0", "A100-80GB", (MODEL,))
    with pytest.raises(ValueError, match="needs f\\(L\\)"):
        ClusterSimulator([spec], create_policy("fcfs"), [_req("a", 0.0, 10, 1.0)], config)


# ---------------------------------------------------------------------------- f(L) profiling
def test_decode_sweep_fits_the_engine_speed() -> None:
    profile = get_profile("A100-80GB", MODEL)
    fit = fit_decode_speed(profile, "A100-80GB", MODEL, [(200, 100), (600, 300)], levels=[1, 4, 16])
    assert fit.setting == (400, 200) and {n for n, _ in fit.points} == {1, 4, 16}
    # batch 1: the decode speed is one token per decode iteration
    alone = 1.0 / profile.decode_iteration_time(1, 500)
    assert fit.usl.lam == pytest.approx(alone, rel=0.1)
    assert fit.usl(16) < fit.usl(4) < fit.usl(1)
    # within a level, requests that finish their prefill first see the others' prefill
    # chunks between their tokens: the spread the R² measures
    assert fit.usl.r_squared is not None and fit.usl.r_squared <= 1.0


def test_open_loop_profiling_sees_load_grow_with_the_rate() -> None:
    profile = get_profile("A100-80GB", MODEL)
    fit = fit_engine_speed(
        profile, "A100-80GB", MODEL, [(300, 150)], rates=(0.5, 8.0, 40.0), requests_per_rate=60
    )
    assert len(fit.points) == 180 and fit.method == "e2e"
    assert max(n for n, _ in fit.points) > 8  # overload fills the engine
    assert fit.usl(32) < fit.usl(1)


# ---------------------------------------------------------------------------- columns and caps
def test_a_static_cap_bounds_every_engine_batch() -> None:
    _, spec = _short_spec().sweep_points()[-1]  # the highest rate
    policy = create_policy("fcfs")

    instances = [replace(i, max_num_seqs=4) for i in instance_specs(spec)]
    sim = ClusterSimulator(
        instances, policy, scenario_requests(spec), sim_config(spec, "fcfs", policy)
    )
    seen: list[int] = []
    for inst in sim.instances.values():
        assert inst.max_batch == 4
        plan = inst.engine.plan

        def watched(inst: Any = inst, plan: Any = plan) -> Any:
            out = plan()
            seen.append(len(inst.running))
            return out

        inst.engine.plan = watched  # type: ignore[method-assign]
    result = sim.run()
    assert result.metrics()["completed"] > 0 and seen and max(seen) == 4  # reached, never passed


def _file_scenario(**extra: Any) -> dict[str, Any]:
    return {
        "name": "cap",
        "duration_s": 30,
        "pools": [{"gpu": "A100-80GB", "count": 1, "models": [MODEL], "max_num_seqs": 8}],
        "streams": [
            {
                "name": "s",
                "models": [MODEL],
                "slo_class": "c",
                "e2e_slo_s": 5.0,
                "arrival": {"process": "poisson", "rate_rps": 4.0},
                "lengths": {"source": "fixed", "prompt_tokens": 64, "output_tokens": 64},
            }
        ],
        "policies": ["fcfs"],
        **extra,
    }


def test_caps_and_variants_are_scenario_file_settings() -> None:
    spec = ScenarioSpec.model_validate(
        _file_scenario(
            variants=[
                {"name": "mns=2", "policy": "fcfs", "max_num_seqs": 2},
                {"name": "saber", "policy": "fcfs", "admission": "saber"},
            ]
        )
    )
    assert [i.max_num_seqs for i in instance_specs(spec)] == [8]  # the pool's cap
    columns = expand_variants(spec, [PolicyVariant("fcfs", "fcfs")])
    assert [(c.label, c.max_num_seqs, c.slo_pull, c.pull_gate) for c in columns] == [
        ("mns=2", 2, None, None),
        ("saber", None, True, "saber"),
    ]
    summary = run_scenario(spec, _factory)
    assert list(summary["policies"]) == ["mns=2", "saber"]
    fit = summary["speed_models"]["saber"][""]["A100-80GB-0"][MODEL]
    assert fit["method"] == "decode" and fit["lam"] > 0 and "r_squared" in fit


@pytest.mark.parametrize(
    ("variants", "message"),
    [
        ([{"name": "x", "policy": "edf"}], "variants.0.policy"),
        ([{"name": "x", "policy": "fcfs"}, {"name": "x", "policy": "fcfs"}], "variants.1.name"),
        ([{"name": "x", "policy": "fcfs", "admission": "maybe"}], "variants.0.admission"),
        ([{"name": "x", "policy": "fcfs", "max_num_seqs": 0}], "variants.0.max_num_seqs"),
    ],
)
def test_bad_variants_are_named(variants: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        ScenarioSpec.model_validate(_file_scenario(variants=variants))


def test_the_preset_runs_its_columns_side_by_side_reproducibly() -> None:
    spec = _short_spec(30.0)
    first = run_scenario(spec, _factory)
    second = run_scenario(spec, _factory)
    names = [f"mns={n}" for n in (4, 8, 16, 32, 64, 128, 256)]
    assert list(first["policies"]) == [*names, "saber", "saber-e2e", "saber-cap", "qlm-gate"]
    for name, entry in first["policies"].items():
        assert entry["slo_attainment"] == second["policies"][name]["slo_attainment"]
        assert len(entry["slo_attainment"]) == len(first["sweep"]["values"])
    assert first["speed_models"] == second["speed_models"]
    [[mean_fit]] = [per.values() for per in first["speed_models"]["saber"]["2"].values()]
    [[cap_fit]] = [per.values() for per in first["speed_models"]["saber-cap"]["2"].values()]
    assert set(mean_fit["expected_output_tokens"]) == {
        "qna",
        "summary",
        "generation",
        "translation",
    }
    assert "expected_output_tokens" not in cap_fit  # taken at max_tokens
    assert "demoted" in first["policies"]["saber"] and "demoted" not in first["policies"]["mns=8"]


def test_the_target_compares_saber_with_the_best_static_cap() -> None:
    spec = _short_spec()
    variants = [
        PolicyVariant("mns=8", "fcfs", max_num_seqs=8),
        PolicyVariant("mns=256", "fcfs", max_num_seqs=256),
        PolicyVariant("saber", "fcfs", slo_pull=True, pull_gate="saber"),
    ]
    summary = run_scenario(spec, _factory, variants=variants)
    assert set(summary["policies"]) == {"mns=8", "mns=256", "saber"}
    att = {p: summary["policies"][p]["slo_attainment"] for p in summary["policies"]}
    assert att["mns=8"] != att["mns=256"]  # the cap changes what the same workload gets
    checks = check_saber(summary)
    rates = [float(v) for v in summary["sweep"]["variants"]]
    assert len(checks) == sum(1 for r in rates if r >= 5)
    for (_target, measured, met), k in zip(
        checks, [k for k, r in enumerate(rates) if r >= 5], strict=True
    ):
        best = max(att["mns=8"][k], att["mns=256"][k])
        assert met == (att["saber"][k] >= best - 1e-9) and "saber" in measured
