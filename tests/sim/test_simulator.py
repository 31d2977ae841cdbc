"""The cluster simulator's engine and coordinator rules, against the engine performance model.

The key check of the event-driven design: jumping over whole decode runs gives the same
timeline, to float rounding, as one event per iteration."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.admission import SLOAdmissionGate, required_speed
from qlm.engine_model import get_profile
from qlm.planner import create_policy
from qlm.planner.baselines import EDFPolicy
from qlm.planner.stochastic import QLMPolicy
from qlm.policy import InstanceLSO
from qlm.tooling.simulator.cluster import ClusterSimulator, InstanceSpec, LSOSwitches, SimConfig
from qlm.tooling.simulator.instance import SimInstance, SimJob
from qlm.tooling.simulator.runner import r_squared
from qlm.tooling.simulator.workload import SimRequest

A100 = "A100-80GB"


def request(
    k: int,
    arrival: float,
    prompt: int = 500,
    output: int = 100,
    model: str = "mistral-7b",
    slo: float | None = 60.0,
    slo_class: str = "interactive",
) -> SimRequest:
    return SimRequest(
        request_id=f"r{k}",
        model=model,
        arrival_s=arrival,
        prompt_tokens=prompt,
        output_tokens=output,
        max_tokens=output,
        slo_class=slo_class,
        e2e_slo_s=slo,
        ttft_slo_s=None,
        stream="test",
    )


def random_workload(n: int, rate: float, models: list[str], seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for k in range(n):
        t += rng.expovariate(rate)
        slo_class = rng.choice(["interactive", "batch"])
        out.append(
            request(
                k,
                t,
                prompt=rng.randint(16, 3000),
                output=rng.randint(1, 600),
                model=rng.choice(models),
                slo=20.0 if slo_class == "interactive" else 300.0,
                slo_class=slo_class,
            )
        )
    return out


def instances(n: int, models: tuple[str, ...] = ("mistral-7b",), gpu: str = A100) -> list:
    return [InstanceSpec(f"i{k}", gpu, models) for k in range(n)]


def run(reqs, insts, policy="fcfs", **config):
    return ClusterSimulator(insts, create_policy(policy), reqs, SimConfig(**config)).run()


# ---------------------------------------------------------------------------- engine model
@settings(max_examples=200, deadline=None)
@given(
    gpu=st.sampled_from([A100, "A10", "H100-80GB"]),
    model=st.sampled_from(["mistral-7b", "vicuna-13b", "llama-2-70b"]),
    batch=st.integers(1, 1024),
    context_per_seq=st.integers(1, 4000),
    steps=st.integers(1, 300),
)
def test_decode_segment_time_is_the_sum_of_iterations(gpu, model, batch, context_per_seq, steps):
    profile = get_profile(gpu, model)
    context = batch * context_per_seq
    expected = sum(profile.iteration_time(0, batch, context + j * batch) for j in range(steps))
    assert profile.decode_segment_time(batch, context, steps) == pytest.approx(expected, rel=1e-9)
    half = profile.decode_segment_time(batch, context, steps) / 2
    k = profile.decode_iterations_within(batch, context, half, steps)
    assert profile.decode_segment_time(batch, context, k) <= half
    assert k == steps or profile.decode_segment_time(batch, context, k + 1) > half


def test_decode_segment_crosses_from_memory_to_compute_bound():
    # a huge batch on an H100: the first steps are memory-bound, the attention FLOPs of a
    # long context make later ones compute-bound (the split of the closed form)
    profile = get_profile("H100-80GB", "mistral-7b")
    batch, context, steps = 1024, 1024 * 100, 4000
    expected = sum(profile.iteration_time(0, batch, context + j * batch) for j in range(steps))
    assert profile.decode_segment_time(batch, context, steps) == pytest.approx(expected, rel=1e-9)


def test_variant_models_share_their_base_shape():
    base = get_profile(A100, "mistral-7b")
    variant = get_profile(A100, "mistral-7b@legal")
    assert variant.model.name == "mistral-7b@legal"
    assert variant.kv_capacity_tokens == base.kv_capacity_tokens
    assert variant.prefill_time(1000) == base.prefill_time(1000)
    with pytest.raises(KeyError, match="variant"):
        get_profile(A100, "nope@x")


# ---------------------------------------------------------------------------- one instance
def test_a_lone_request_takes_exactly_the_modelled_time():
    profile = get_profile(A100, "mistral-7b")
    prompt, output = 5000, 50  # prefilled in chunks of max_num_batched_tokens
    result = run([request(0, 1.0, prompt, output)], instances(1))
    (o,) = result.outcomes
    t, done = 1.0, 0
    chunk = profile.max_num_batched_tokens
    while done < prompt:
        n = min(chunk, prompt - done)
        t += profile.iteration_time(n, 0, 0, prefill_attention_pairs=n * done + n * (n + 1) / 2)
        done += n
    assert o.first_token_s == pytest.approx(t, rel=1e-12)
    t += profile.decode_segment_time(1, prompt + 1, output - 1)
    assert o.finished_s == pytest.approx(t, rel=1e-12)
    assert o.met


@pytest.mark.parametrize("policy", ["fcfs", "edf", "qlm", "shepherd"])
def test_jumping_over_decode_runs_matches_one_event_per_iteration(policy):
    reqs = random_workload(120, 6.0, ["mistral-7b", "vicuna-13b"], seed=3)
    insts = instances(2, ("mistral-7b", "vicuna-13b"))
    kw = {"static_batch": 16} if policy == "shepherd" else {}
    jump = run(reqs, insts, policy, **kw)
    tick = run(reqs, insts, policy, max_decode_run=1, **kw)
    assert tick.events > 5 * jump.events
    a = {o.request_id: o for o in jump.outcomes}
    for o in tick.outcomes:
        if policy in ("fcfs", "edf", "shepherd"):  # qlm replans at event times: compare totals
            assert a[o.request_id].finished_s == pytest.approx(o.finished_s, abs=1e-6)
    assert jump.metrics()["completed"] == tick.metrics()["completed"]


def test_every_request_finishes_once_with_its_tokens_and_the_kv_is_returned():
    reqs = random_workload(300, 8.0, ["mistral-7b"], seed=1)
    sim = ClusterSimulator(instances(2), create_policy("edf"), reqs, SimConfig(drain_s=3600))
    result = sim.run()
    assert result.metrics()["completed"] == 300
    assert {o.request_id for o in result.outcomes} == {r.request_id for r in reqs}
    for job in sim.jobs.values():
        assert job.generated == job.req.output_tokens
        assert job.first_token_s is not None and job.finished_s is not None
        assert job.req.arrival_s <= job.started_s <= job.first_token_s <= job.finished_s
    for inst in sim.instances.values():
        assert inst.kv_used == 0 and not inst.running and not inst.waiting


def test_kv_pressure_preempts_by_recompute_and_still_finishes_everything():
    profile = get_profile("A10", "mistral-7b")
    big = profile.kv_capacity_tokens // 6
    reqs = [request(k, 0.01 * k, prompt=big, output=2000, slo=None) for k in range(12)]
    result = run(reqs, instances(1, gpu="A10"), drain_s=10_000)
    m = result.metrics()
    assert m["completed"] == 12
    assert m["preemptions"] > 0


def test_runs_are_deterministic():
    reqs = random_workload(200, 5.0, ["mistral-7b", "vicuna-13b"], seed=7)
    insts = instances(2, ("mistral-7b", "vicuna-13b"))
    a = run(reqs, insts, "edf").outcomes
    b = run(reqs, insts, "edf").outcomes
    assert [(o.request_id, o.finished_s) for o in a] == [(o.request_id, o.finished_s) for o in b]


def test_model_switches_cost_a_disk_load_without_warm_start_and_a_host_copy_with_it():
    models = ("mistral-7b", "mistral-7b@b")
    reqs = [request(k, 0.0 + k * 1e-3, model=models[k % 2], slo=None) for k in range(6)]
    cold = run(reqs, instances(1, models))
    warm = run(reqs, instances(1, models), lso=LSOSwitches(warm_start=True))
    assert cold.metrics()["model_swaps"] == warm.metrics()["model_swaps"] == 5  # FCFS: every one
    assert cold.metrics()["cold_loads"] == 5 and warm.metrics()["cold_loads"] == 0
    p = get_profile(A100, "mistral-7b")
    gap = 5 * (p.load_time_from_disk() - p.load_time_from_cpu())
    assert cold.makespan_s - warm.makespan_s == pytest.approx(gap, rel=1e-6)


def test_static_batches_admit_nothing_until_the_whole_batch_finished():
    reqs = [request(0, 0.0, output=400, slo=None)]
    reqs += [request(k, 0.5 + k * 1e-3, output=10, slo=None) for k in range(1, 4)]
    static = {o.request_id: o for o in run(reqs, instances(1), static_batch=16).outcomes}
    cont = {o.request_id: o for o in run(reqs, instances(1)).outcomes}
    # continuous batching: the late short requests join the running one and finish first
    assert cont["r1"].finished_s < cont["r0"].finished_s
    # static: they wait for the first batch (r0 alone) to finish
    assert static["r1"].first_token_s > static["r0"].finished_s


def _instance(models=("mistral-7b",)) -> tuple[SimInstance, list]:
    events: list = []
    profiles = {m: get_profile(A100, m) for m in models}
    inst = SimInstance(
        "i0",
        A100,
        list(models),
        profiles,
        cpu_memory_bytes=1e12,
        schedule=lambda t, i, v: events.append((t, v)),
        on_finish=lambda job, t: None,
    )
    return inst, events


def _job(k: int, prompt: int = 1000, output: int = 500) -> SimJob:
    from qlm.policy import PlanRequest

    req = request(k, 0.0, prompt, output)
    view = PlanRequest(f"r{k}", "mistral-7b", prompt, output, 0.0, 60.0, None)
    return SimJob(req=req, view=view)


def _drain_events(inst, events, until_generated: int, job) -> float:
    now = 0.0
    while job.generated < until_generated:
        t, version = events.pop(0)
        if version != inst.version:
            continue
        now = t
        inst.on_event(now)
        inst.resume(now)
    return now


@pytest.mark.parametrize("mode", ["evict", "swap"])
def test_evicted_requests_keep_their_tokens_and_swap_keeps_the_kv(mode):
    inst, events = _instance()
    job = _job(0)
    inst.enqueue([job], 0.0)
    now = _drain_events(inst, events, 1, job)  # prefilled; a 499-step decode run is scheduled
    inst.evict([job], mode, now + 0.3)  # mid-run: carried out at the next iteration boundary
    t, version = events[-1]
    assert version == inst.version and t < now + 0.4
    inst.on_event(t)
    assert inst.evicted_out == [job]
    assert 10 < job.generated < 499 and job.computed == 0 and inst.kv_used == 0
    assert (job.swapped_on == "i0") is (mode == "swap")
    tokens = job.swapped_tokens
    inst.evicted_out.clear()
    inst.enqueue([job], t)
    assert (job.computed == tokens and tokens > 0) if mode == "swap" else job.computed == 0


def test_an_arrival_mid_decode_joins_at_the_next_iteration_boundary():
    inst, events = _instance()
    first = _job(0, prompt=100, output=1000)
    inst.enqueue([first], 0.0)
    now = _drain_events(inst, events, 1, first)  # prefilled; a long decode run is scheduled
    run_end = events[-1][0]
    late = _job(1, prompt=100, output=10)
    inst.enqueue([late], now + 0.05)
    cut_at, version = events[-1]
    assert version == inst.version and now + 0.05 <= cut_at < run_end
    p = inst.profile
    assert cut_at - (now + 0.05) <= p.decode_iteration_time(1, 1200) + 1e-9


# ---------------------------------------------------------------------------- policies and LSOs
def test_qlm_groups_models_and_beats_fcfs_throughput_on_a_multi_model_mix():
    models = ["mistral-7b@a", "mistral-7b@b", "mistral-7b@c"]
    reqs = random_workload(150, 3.0, models, seed=2)
    insts = instances(2, tuple(models))
    fcfs = run(reqs, insts, "fcfs").metrics()
    qlm = run(reqs, insts, "qlm", lso=LSOSwitches.all()).metrics()
    assert qlm["model_swaps"] < fcfs["model_swaps"]
    assert qlm["throughput_rps"] > fcfs["throughput_rps"]


def test_decision_delay_charges_the_planner_wall_time():
    reqs = random_workload(150, 20.0, ["mistral-7b"], seed=4)
    result = run(reqs, instances(1), "qlm", decision_delay=True, replan_interval_s=1.0)
    assert result.replans > 0
    assert result.metrics()["completed"] == 150


def test_slo_gate_rules():
    assert required_speed(100, None, 5.0) == 0.0
    assert required_speed(100, 5.0, 5.0) == float("inf")
    assert required_speed(100, 15.0, 5.0) == pytest.approx(10.0)
    gate = SLOAdmissionGate(speed=lambda n: 100.0 / n)
    assert gate.admits(0, 90.0, 0.0)  # alone it is fast enough
    assert not gate.admits(1, 60.0, 0.0)  # with two running, 50 tok/s < 60
    assert not gate.admits(1, 10.0, 60.0)  # it would slow a running request below its need
    assert gate.best_effort(150.0) and gate.admits(0, 150.0, 0.0)  # hopeless: best effort


def test_r_squared():
    assert r_squared([1, 2, 3], [1, 2, 3]) == 1.0
    assert r_squared([2, 2, 2], [1, 2, 3]) == pytest.approx(0.0)


def test_one_estimate_is_recorded_per_dispatched_request_and_changes_nothing(monkeypatch):
    """With record_estimates the simulator asks the policy once per dispatch, with the core's
    view of the instance (this request counted in ``running``), and keeps what it answered;
    without it the policy is never asked. Either way every request runs the same."""
    reqs = random_workload(150, 12.0, ["mistral-7b"], seed=5)
    asked: dict[str, list[tuple[int, float]]] = {}
    real = QLMPolicy.dispatch_estimate

    def spy(self, request, instance, now):
        t = real(self, request, instance, now)
        asked.setdefault(request.request_id, []).append((instance.running, t))
        return t

    monkeypatch.setattr(QLMPolicy, "dispatch_estimate", spy)
    plain = run(reqs, instances(2), "qlm")
    assert asked == {}
    recorded = run(reqs, instances(2), "qlm", record_estimates=True)
    assert [(o.first_token_s, o.finished_s) for o in recorded.outcomes] == [
        (o.first_token_s, o.finished_s) for o in plain.outcomes
    ]
    assert all(o.dispatch_estimated_finish_s is None for o in plain.outcomes)
    assert set(asked) == {r.request_id for r in reqs}  # every one dispatched, once
    assert all(len(calls) == 1 for calls in asked.values())
    for o in recorded.outcomes:
        ((running, t),) = asked[o.request_id]
        assert running >= 1 and o.dispatch_estimated_finish_s == t
    # the first plan comes after the first dispatches: those have no plan estimate
    assert any(o.estimated_finish_s is None for o in recorded.outcomes)


# ---------------------------------------------------------------------------- no queue manager
def _burst(n: int, prompt: int, output: int) -> list[SimRequest]:
    return [request(k, 0.001 * k, prompt=prompt, output=output) for k in range(n)]


def test_the_vllm_baseline_hands_every_request_to_an_engine_at_arrival():
    reqs = _burst(600, 3000, 1000)  # 2.4M tokens of KV: far more than two engines hold
    policy = create_policy("vllm")
    sim = ClusterSimulator(
        instances(2), policy, reqs, SimConfig(dispatch_at_arrival=policy.dispatch_at_arrival)
    )
    result = sim.run()
    assert all(j.started_s == j.req.arrival_s for j in sim.jobs.values())
    assert {j.instance_id for j in sim.jobs.values()} == {"i0", "i1"}  # least in flight
    # the engines ran out of KV and preempted by recompute, vLLM V1 style, far more often
    # than when the agents pull by engine demand (no new work while KV is 90 % used)
    fcfs = ClusterSimulator(instances(2), create_policy("fcfs"), reqs).run()
    assert result.metrics()["preemptions"] > 3 * max(1, fcfs.metrics()["preemptions"])
    assert fcfs.metrics()["completed"] == result.metrics()["completed"] == len(reqs)


class _CapEveryInstance(EDFPolicy):
    """EDF whose plans cap every engine at 8 requests (the batch cap LSO)."""

    def plan(self, requests, instances, now):  # type: ignore[no-untyped-def]
        plan = super().plan(requests, instances, now)
        plan.lso = {i.instance_id: InstanceLSO(max_in_engine=8) for i in instances}
        return plan

    def wants_replan(self, now: float) -> bool:
        return True


def test_agents_keep_at_most_the_batch_cap_in_their_engines(monkeypatch):
    peak: dict[str, int] = {}
    enqueue = SimInstance.enqueue

    def counting(self, jobs, now):  # type: ignore[no-untyped-def]
        enqueue(self, jobs, now)
        n = len(self.running) + len(self.waiting)
        peak[self.instance_id] = max(peak.get(self.instance_id, 0), n)

    monkeypatch.setattr(SimInstance, "enqueue", counting)
    reqs = _burst(200, 500, 100)
    sim = ClusterSimulator(
        instances(2), _CapEveryInstance(), reqs, SimConfig(lso=LSOSwitches(batch_cap=True))
    )
    result = sim.run()
    assert result.metrics()["completed"] == len(reqs)
    assert 0 < max(peak.values()) <= 8
    assert {i.last_status.max_in_engine for i in sim.core.instances.values()} == {8}
    # the LSO's counter: a cap set once on each agent (the same cap again is no new order)
    assert result.metrics()["batch_caps"] == 2
    # without the LSO the agents pull what the engines take
    peak.clear()
    off = ClusterSimulator(instances(2), _CapEveryInstance(), reqs, SimConfig()).run()
    assert max(peak.values()) > 8
    assert off.metrics()["batch_caps"] == 0


def test_batch_caps_meet_more_latency_bound_requests_in_overload():
    """qlm caps the batch while 20-s requests wait beside 300-s ones: they decode faster and
    more of them meet, the batch work still meets (two A100s at ~1.2x their capacity: 57 %
    against 63 % of the interactive requests here)."""
    rng = random.Random(3)
    reqs, t = [], 0.0
    for k in range(2400):
        t += rng.expovariate(18.0)
        interactive = rng.random() < 0.4
        r = request(
            k,
            t,
            prompt=rng.randint(100, 2500),
            output=min(1024, 1 + int(rng.expovariate(1 / 350))),
            slo=20.0 if interactive else 300.0,
            slo_class="interactive" if interactive else "batch",
        )
        r.max_tokens = 1024  # a client's cap, not the answer
        reqs.append(r)
    by_class = {}
    for cap in (True, False):
        result = ClusterSimulator(
            instances(2),
            # a floor below the default 0.98 (docs/planner.md, "Batch caps": the trade)
            create_policy("qlm", budget_clock="work", cap_throughput_min=0.9),
            reqs,
            SimConfig(lso=LSOSwitches(warm_start=True, batch_cap=cap)),
        ).run()
        by_class[cap] = result.metrics()["slo_attainment_by_class"]
    assert by_class[True]["interactive"] > by_class[False]["interactive"] + 0.04
    assert by_class[True]["batch"] >= by_class[False]["batch"] - 0.01
