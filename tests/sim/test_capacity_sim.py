"""Capacity policies in the simulator's loop (issue 8): instances that join after their start-up
time and drain when released, the simulator driver, the diurnal day built from the Azure trace,
and ``qlm bench sim --scenario capacity``."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from qlm.capacity.forecast import trailing_mean
from qlm.cli import app
from qlm.planner import create_policy
from qlm.planner.capacity.policies import Cell, PoolKey
from qlm.tooling.capacity.autoscaling import InstanceTemplate, SimulatorDriver, parse_cell
from qlm.tooling.capacity.diurnal import DiurnalLoad, diurnal_requests, history_tpm
from qlm.tooling.capacity.sim import (
    CapacityLoop,
    capacity_preset,
    profile_instance_rps,
    run_capacity_scenario,
)
from qlm.tooling.simulator.cluster import ClusterSimulator, InstanceSpec, SimConfig
from qlm.tooling.simulator.workload import SimRequest

A100 = "A100-80GB"
MODEL = "llama-2-70b"


def request(k: int, arrival: float, output: int = 200) -> SimRequest:
    return SimRequest(
        request_id=f"r{k}",
        model=MODEL,
        arrival_s=arrival,
        prompt_tokens=400,
        output_tokens=output,
        max_tokens=output,
        slo_class="interactive",
        e2e_slo_s=60.0,
        ttft_slo_s=None,
        stream="s",
    )


class Script:
    """A controller that runs scripted actions at given simulated times."""

    def __init__(self, actions: list[tuple[float, object]]) -> None:
        self.interval_s = 1.0
        self.actions = sorted(actions, key=lambda a: a[0])

    def on_tick(self, sim: ClusterSimulator) -> None:
        while self.actions and self.actions[0][0] <= sim.now:
            _, action = self.actions.pop(0)
            action(sim)  # type: ignore[operator]


def cluster(reqs: list[SimRequest], actions: list[tuple[float, object]]) -> ClusterSimulator:
    return ClusterSimulator(
        [InstanceSpec("i0", A100, (MODEL,))],
        create_policy("fcfs"),
        reqs,
        SimConfig(drain_s=600),
        controller=Script(actions),
    )


def test_an_added_instance_joins_after_its_startup_and_is_paid_from_the_request() -> None:
    reqs = [request(k, 0.5 * k) for k in range(400)]
    sim = cluster(reqs, [(10.0, lambda s: s.add_instance(InstanceSpec("i1", A100, (MODEL,)), 50))])
    result = sim.run()
    life = sim.lives["i1"]
    assert life.requested_s == pytest.approx(10.0, abs=1.0)
    assert life.ready_s == pytest.approx(life.requested_s + 50)
    # it served part of the load, and nothing started on it before it was ready
    served = [j for j in sim.jobs.values() if j.instance_id == "i1"]
    assert served and min(j.started_s for j in served) >= life.ready_s  # type: ignore[type-var]
    m = result.metrics()
    assert m["completed"] == m["requests"] == 400
    end = result.sim_end_s
    assert m["instance_hours"] == pytest.approx((end + end - life.requested_s) / 3600, abs=1e-3)
    assert m["scaling_waste_hours"] == pytest.approx(50 / 3600, abs=1e-3)
    assert m["instances_started"] == 1 and m["peak_instances"] == 2


def test_a_released_instance_drains_its_running_work_and_its_queue_moves() -> None:
    # two instances; a burst, then i0 is released while busy: what runs there finishes there,
    # what waited in its virtual queue is served by i1; nothing is lost or served twice
    reqs = [request(k, 0.05 * k, output=400) for k in range(300)]
    sim = ClusterSimulator(
        [InstanceSpec("i0", A100, (MODEL,)), InstanceSpec("i1", A100, (MODEL,))],
        create_policy("fcfs"),
        reqs,
        SimConfig(drain_s=900),
        controller=Script([(5.0, lambda s: s.release_instance("i0"))]),
    )
    result = sim.run()
    life = sim.lives["i0"]
    assert life.released_s == pytest.approx(5.0, abs=1.0)
    assert life.retired_s is not None and life.retired_s > life.released_s
    assert "i0" in sim.retired and "i0" not in sim.instances
    on_i0 = [j for j in sim.jobs.values() if j.instance_id == "i0"]
    assert on_i0 and all(j.started_s <= life.released_s for j in on_i0)  # type: ignore[operator]
    assert all(j.finished_s is not None for j in sim.jobs.values())
    m = result.metrics()
    assert m["completed"] == m["requests"] == 300
    assert m["instances_released"] == 1


def test_releasing_a_starting_instance_cancels_it() -> None:
    reqs = [request(k, 1.0 * k) for k in range(50)]
    sim = cluster(
        reqs,
        [
            (1.0, lambda s: s.add_instance(InstanceSpec("i1", A100, (MODEL,)), 600)),
            (20.0, lambda s: s.release_instance("i1")),
        ],
    )
    result = sim.run()
    life = sim.lives["i1"]
    assert life.ready_s is None and life.retired_s == pytest.approx(life.released_s)
    assert result.metrics()["scaling_waste_hours"] == pytest.approx(19 / 3600, abs=2e-3)
    with pytest.raises(ValueError, match="no instance"):
        sim.release_instance("i1")
    with pytest.raises(ValueError, match="already used"):
        sim.add_instance(InstanceSpec("i1", A100, (MODEL,)), 1)


def test_the_last_instance_released_leaves_requests_queued_until_a_new_one_joins() -> None:
    reqs = [request(k, 0.2 * k) for k in range(100)]
    sim = cluster(
        reqs,
        [
            (2.0, lambda s: s.add_instance(InstanceSpec("i1", A100, (MODEL,)), 30)),
            (3.0, lambda s: s.release_instance("i0")),
        ],
    )
    m = sim.run().metrics()
    assert m["completed"] == m["requests"] == 100
    assert all(j.instance_id in ("i0", "i1") for j in sim.jobs.values())


def driver_for(sim: ClusterSimulator) -> SimulatorDriver:
    cell = f"{MODEL}/{A100}/p"
    template = InstanceTemplate(InstanceSpec("t", A100, (MODEL,)), startup_s=600, warm_start_s=60)
    return SimulatorDriver(sim, {cell: template}, owned={cell: ["i0"]})


def test_the_simulator_driver_applies_decisions_with_cold_and_warm_starts() -> None:
    cell = f"{MODEL}/{A100}/p"
    log: list[str] = []

    def step(delta: int) -> object:
        def act(s: ClusterSimulator) -> None:
            out = drivers[0].apply_now({"deltas": {cell: delta}})
            log.append(out.detail)

        return act

    reqs = [request(k, 2.0 * k) for k in range(1500)]
    sim = cluster(reqs, [(10, step(+1)), (700, step(-1)), (800, step(+1))])
    drivers = [driver_for(sim)]
    sim.run()
    d = drivers[0]
    assert d.cold_starts == 1 and d.warm_starts == 1
    first, second = (sim.lives[i] for i in sorted(sim.lives) if i != "i0")
    assert first.ready_s == pytest.approx(first.requested_s + 600)
    assert second.ready_s == pytest.approx(second.requested_s + 60)  # reclaimed a spare
    assert log == ["applied in the simulator"] * 3


def test_a_decision_naming_an_unknown_cell_changes_nothing() -> None:
    sim = cluster([request(0, 0.0)], [])
    d = driver_for(sim)
    out = d.apply_now({"deltas": {f"{MODEL}/{A100}/p": 1, "other/H100/p": 1}})
    assert not out.applied and "no instance template" in out.detail
    assert sim.starting() == [] and d.failed == 1
    out = d.apply_now({"deltas": {"no-slashes": 1}})
    assert not out.applied and "model/gpu_type/pool" in out.detail
    assert parse_cell("org/model/A100/p") == ("org/model", "A100", "p")


def test_the_diurnal_day_follows_its_curve_and_keeps_the_trace_lengths() -> None:
    load = DiurnalLoad(model=MODEL, peak_rps=4.0, trough_ratio=0.25, peak_hour=14.0)
    reqs = diurnal_requests([load], hours=24, seed=3)
    t = np.array([r.arrival_s for r in reqs])
    assert np.all(np.diff(t) >= 0) and t.min() >= 0 and t.max() < 24 * 3600
    per_hour = np.bincount((t // 3600).astype(int), minlength=24) / 3600.0
    expected = load.rate(np.arange(24) * 3600.0 + 1800.0)
    # the trace is bursty: hourly counts follow the curve within 25 %
    assert np.all(np.abs(per_hour / expected - 1) < 0.25)
    assert per_hour[14] > 3 * per_hour[2]
    again = diurnal_requests([load], hours=24, seed=3)
    assert [r.arrival_s for r in again[:50]] == list(t[:50])
    h = history_tpm(load, seed=3)
    assert h.shape == (60,) and h.min() > 0
    with pytest.raises(ValueError):
        DiurnalLoad(model=MODEL, peak_rps=0)
    with pytest.raises(ValueError):
        DiurnalLoad(model=MODEL, peak_rps=1, trough_ratio=0)


def test_trailing_mean() -> None:
    x = np.array([1.0, 3.0, 5.0, 7.0])
    assert trailing_mean(x, 2).tolist() == [1.0, 2.0, 4.0, 6.0]
    assert trailing_mean(x, 1) is x


def test_profiling_finds_the_rate_one_instance_serves_at_the_slo() -> None:
    load = DiurnalLoad(model="llama-2-70b", peak_rps=1.0, e2e_slo_s=60.0)
    template = InstanceSpec("t", A100, ("llama-2-70b",))
    rps = profile_instance_rps(template, load, create_policy, minutes=10)
    assert 0.5 < rps < 2.0


@pytest.mark.parametrize("name", ["reactive", "cato", "lt-i", "lt-u", "lt-ua"])
def test_every_capacity_policy_runs_a_short_day_without_losing_a_request(name: str) -> None:
    scenario = capacity_preset(hours=0.75, peak_rps=3.0)
    summary = run_capacity_scenario(scenario, create_policy, policies=[name])
    m = summary["policies"][name]
    assert m["completed"] == m["requests"] == summary["requests"] > 500
    assert m["instance_hours"] > 0 and m["slo_attainment"] is not None
    assert m["p95_latency_s"] is not None
    assert summary["timelines"][name]


def test_the_loop_scales_out_under_a_load_one_instance_cannot_carry() -> None:
    # reactive from one instance into the 2.5 req/s peak (one instance serves ≈ 1 req/s)
    base = capacity_preset(hours=0.5, peak_rps=2.5)
    peak = dataclasses.replace(base.loads[0], start_hour=14.0)
    scenario = dataclasses.replace(base, loads=(peak,), initial_instances=1)
    summary = run_capacity_scenario(scenario, create_policy, policies=["reactive"])
    m = summary["policies"]["reactive"]
    assert m["peak_instances"] >= 3 and m["instances_started"] >= 2
    assert m["completed"] == m["requests"]


def test_the_loop_forecasts_each_hour_for_the_lt_policies() -> None:
    from qlm.planner.capacity.policies import CapacitySpec, InstanceProfile, create_capacity_policy

    cell = Cell("llama-2-70b", A100, "p")
    spec = CapacitySpec(
        profiles=(InstanceProfile("llama-2-70b", A100, 70_000.0, 2),),
        gpu_cost_per_hour={A100: 3.0},
    )
    template = InstanceTemplate(InstanceSpec("t", A100, ("llama-2-70b",)), 600)
    loop = CapacityLoop(
        create_capacity_policy("lt-ua", spec),
        {cell: template},
        forecast=True,
        history={PoolKey("llama-2-70b", "p"): np.full(60, 100_000.0)},
    )
    load = DiurnalLoad(model="llama-2-70b", peak_rps=1.5, trough_ratio=1.0, e2e_slo_s=60)
    reqs = diurnal_requests([load], hours=1.2)
    sim = ClusterSimulator(
        [InstanceSpec("a", A100, ("llama-2-70b",)), InstanceSpec("b", A100, ("llama-2-70b",))],
        create_policy("fcfs"),
        reqs,
        SimConfig(drain_s=600),
        controller=loop,
    )
    loop.attach(sim, {f"llama-2-70b/{A100}/p": ["a", "b"]})
    sim.run()
    assert loop._forecast_hour == 1  # forecast at t = 0 (from the history) and at 1 h
    assert loop.forecast_s > 0


def test_bench_sim_capacity_cli_writes_the_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "cap.json"
    result = CliRunner().invoke(
        app,
        [
            "bench", "sim", "--scenario", "capacity", "--hours", "0.5", "--peak-rps", "2",
            "--policies", "reactive,lt-ua", "--json", str(out), "--out", str(tmp_path / "d"),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["scenario"] == "capacity"
    for name in ("reactive", "lt-ua"):
        for key in ("instance_hours", "p95_latency_s", "slo_attainment", "scaling_waste_hours"):
            assert key in data["policies"][name]
    assert {c["target"] for c in data["checks"]}
    assert (tmp_path / "d" / "results.md").exists() and (tmp_path / "d" / "instances.png").exists()
    bad = CliRunner().invoke(app, ["bench", "sim", "--scenario", "capacity", "--policies", "fcfs"])
    assert bad.exit_code == 2 and "unknown capacity policies" in bad.output


def test_lt_ua_is_compared_with_reactive_tuned_to_its_attainment() -> None:
    from qlm.tooling.capacity.sim import capacity_checks, reactive_up

    assert reactive_up("reactive@0.5") == 0.5
    assert reactive_up("reactive") is None and reactive_up("reactive@x") is None
    assert reactive_up("cato@0.5") is None and reactive_up("reactive@1.5") is None

    def col(att: float, hours: float) -> dict[str, float]:
        return {"slo_attainment": att, "instance_hours": hours, "p95_latency_s": 10.0}

    results = {
        "lt-ua": col(0.95, 100.0),
        "reactive": col(0.60, 90.0),  # cheaper, but misses far more
        "reactive@0.5": col(0.94, 110.0),
        "reactive@0.3": col(0.96, 140.0),  # the cheapest that reaches LT-UA's 95 %
    }
    equal = capacity_checks(results)[-1]
    assert "tuned to its SLO attainment" in equal["target"]
    assert equal["met"] and "28.6 % fewer" in equal["measured"]
    results["reactive@0.3"] = col(0.96, 120.0)
    assert not capacity_checks(results)[-1]["met"]  # 16.7 % fewer only
    # no threshold reaches it: as far as the ones tried go, LT-UA wins, and the check says so
    del results["reactive@0.3"]
    assert "no reactive threshold tried" in capacity_checks(results)[-1]["measured"]
