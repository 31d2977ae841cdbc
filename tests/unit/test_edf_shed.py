"""EDF with a latency-SLO admitter (``edf-shed``): ordering, demotion, shedding, affinity."""

from __future__ import annotations

import pytest

from qlm.planner import create_policy
from qlm.planner.edf_shed import EDFShedConfig, EDFShedPolicy
from qlm.policy import CompletionObservation, PlanInstance, PlanRequest
from tests.builders import make_instance, make_plan_request

OUT = 200  # every observed completion: 200 output tokens (~2 s of decode on an A100)


def trained(**overrides: object) -> EDFShedPolicy:
    policy = EDFShedPolicy(**overrides)  # type: ignore[arg-type]
    for _ in range(policy.config.min_history):
        policy.observe_completion(
            CompletionObservation("m", None, OUT, prompt_tokens=10, max_tokens=OUT)
        )
    return policy


def test_registered_and_configurable() -> None:
    assert isinstance(create_policy("edf-shed"), EDFShedPolicy)
    assert EDFShedPolicy(on_miss="shed").config.on_miss == "shed"
    with pytest.raises(ValueError):
        EDFShedConfig(on_miss="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        EDFShedConfig(length_quantile=1.0)


def test_without_history_it_is_edf() -> None:
    """No length model yet: nothing is demoted, even a request already past its deadline."""
    reqs = [
        make_plan_request("late", arrival=0, deadline=50, seq=1),
        make_plan_request("passed", arrival=0, deadline=1, seq=2),
        make_plan_request("early", arrival=0, deadline=20, seq=3),
    ]
    plan = EDFShedPolicy().plan(reqs, [make_instance("i0")], now=10.0)
    assert plan.queues["i0"] == ["passed", "early", "late"]
    assert plan.meta["demoted"] == 0


def test_hopeless_request_is_demoted_behind_feasible_work() -> None:
    """A request that cannot decode its predicted 200 tokens by its deadline goes to the
    best-effort tail, behind a later-deadline request that can still make it."""
    policy = trained()
    hopeless = make_plan_request("hopeless", arrival=0, deadline=100.3, seq=1)
    feasible = make_plan_request("feasible", arrival=0, deadline=160, seq=2)
    plan = policy.plan([feasible, hopeless], [make_instance("i0")], now=100.0)
    assert plan.queues["i0"] == ["feasible", "hopeless"]
    assert plan.meta["demoted"] == 1
    assert policy.sort_key(hopeless)[0] is True and policy.sort_key(feasible)[0] is False
    assert policy.sort_key(feasible) < policy.sort_key(hopeless)


def test_deep_queue_demotes_what_waits_too_long() -> None:
    """Many requests due at the same time: the head of the EDF order is feasible, the rest
    would wait past the deadline and go to the tail, still in EDF order."""
    policy = trained()
    reqs = [
        make_plan_request(f"r{i:03d}", arrival=0, deadline=5 + i * 1e-3, seq=i) for i in range(400)
    ]
    plan = policy.plan(reqs, [make_instance("i0")], now=0.0)
    queue = plan.queues["i0"]
    demoted = [rid for rid in queue if policy.sort_key(reqs[int(rid[1:])])[0]]
    assert 0 < len(demoted) < len(reqs)
    assert plan.meta["demoted"] == len(demoted)
    kept = queue[: len(queue) - len(demoted)]
    assert kept == sorted(kept) and demoted == sorted(demoted)
    assert kept[0] == "r000" and queue[-len(demoted) :] == demoted


def test_demoted_work_is_served_only_after_feasible_work() -> None:
    policy = trained()
    reqs = [
        make_plan_request("hopeless-1", arrival=0, deadline=0.2, seq=1),
        make_plan_request("ok-late", arrival=0, deadline=500, seq=2),
        make_plan_request("hopeless-2", arrival=0, deadline=0.1, seq=3),
        make_plan_request("ok-early", arrival=0, deadline=100, seq=4),
    ]
    plan = policy.plan(reqs, [make_instance("i0")], now=0.0)
    assert plan.queues["i0"] == ["ok-early", "ok-late", "hopeless-2", "hopeless-1"]


def test_shed_mode_drops_what_would_miss() -> None:
    policy = trained(on_miss="shed")
    reqs = [
        make_plan_request("hopeless", arrival=0, deadline=0.2, seq=1),
        make_plan_request("ok", arrival=0, deadline=100, seq=2),
    ]
    plan = policy.plan(reqs, [make_instance("i0")], now=0.0)
    assert plan.queues["i0"] == ["ok"]
    assert plan.unassigned == ["hopeless"] and plan.meta["shed"] == ["hopeless"]
    arrival = make_plan_request("hopeless-arrival", arrival=0, deadline=0.2, seq=3)
    assert policy.place(arrival, [make_instance("i0")], {"i0": 0.0}, now=0.0) is None


def test_place_demotes_a_hopeless_arrival_only() -> None:
    policy = trained()
    inst = [make_instance("i0")]
    hopeless = make_plan_request("hopeless", arrival=0, deadline=0.3, seq=1)
    ok = make_plan_request("ok", arrival=0, deadline=60, seq=2)
    assert policy.place(hopeless, inst, {"i0": 0.0}, now=0.0) == "i0"
    assert policy.place(ok, inst, {"i0": 0.0}, now=0.0) == "i0"
    assert policy.sort_key(hopeless)[0] is True and policy.sort_key(ok)[0] is False
    # the same request behind a long queue of earlier-deadline work is predicted to miss
    busy = make_plan_request("busy", arrival=0, deadline=60, seq=3)
    assert policy.place(busy, inst, {"i0": 5e6}, now=0.0) == "i0"
    assert policy.sort_key(busy)[0] is True


def test_ttft_deadline_counts() -> None:
    policy = trained()
    r = PlanRequest("r", "m", 10, OUT, 0.0, 100.0, 1e-4, seq=1)
    plan = policy.plan([r], [make_instance("i0")], now=0.0)
    assert plan.meta["demoted"] == 1


def test_length_estimate_ignores_max_tokens_unless_asked() -> None:
    """max_tokens is the true output in the simulator's scenarios: the estimate must not use
    it (unless use_max_tokens, for clients whose max_tokens is a real cap)."""
    small = make_plan_request("small", arrival=0, deadline=10, out=10)
    big = make_plan_request("big", arrival=0, deadline=10, out=100_000)
    policy = trained()
    assert policy.work_tokens(small) == policy.work_tokens(big) == 10 + OUT
    capped = trained(use_max_tokens=True)
    assert capped.work_tokens(small) == 10 + 10
    assert capped.work_tokens(big) == 10 + OUT


def test_work_is_fixed_at_first_sight() -> None:
    """The caller adds work_tokens at placement and subtracts it at dispatch: it must not
    change in between, even as the length model learns."""
    policy = trained()
    r = make_plan_request("r", arrival=0, deadline=10)
    before = policy.work_tokens(r)
    for _ in range(200):
        policy.observe_completion(CompletionObservation("m", None, 4000, prompt_tokens=10))
    assert policy.work_tokens(r) == before
    policy.plan([], [make_instance("i0")], now=0.0)
    policy.plan([], [make_instance("i0")], now=1.0)  # two plans without it: forgotten
    assert policy.work_tokens(r) != before


def mk(iid: str, active: str | None, models: tuple[str, ...] = ("m", "n")) -> PlanInstance:
    return PlanInstance(iid, models, "A100-80GB", 100_000, 256, active_model=active)


def test_model_affinity_in_placement() -> None:
    policy = trained()
    r = make_plan_request("r", arrival=0, deadline=600, model="n")
    insts = [mk("a", "m"), mk("b", "n")]
    assert policy.place(r, insts, {"a": 0.0, "b": 0.0}, now=0.0) == "b"
    # a little more queued work does not outweigh a model switch ...
    assert policy.place(r, insts, {"a": 0.0, "b": 500.0}, now=0.0) == "b"
    # ... a lot does
    assert policy.place(r, insts, {"a": 0.0, "b": 5e6}, now=0.0) == "a"
    # without affinity, the less loaded instance wins
    free = EDFShedPolicy(affinity=False)
    assert free.place(r, insts, {"a": 0.0, "b": 500.0}, now=0.0) == "a"


def test_plan_keeps_models_together() -> None:
    """Interleaved deadlines of two models on two instances, each running one: EDF with
    affinity keeps each model on the instance already running it."""
    policy = trained()
    reqs = [
        make_plan_request(f"r{i}", arrival=0, deadline=100 + i, model="mn"[i % 2], seq=i)
        for i in range(20)
    ]
    plan = policy.plan(reqs, [mk("a", "m"), mk("b", "n")], now=0.0)
    by_id = {r.request_id: r for r in reqs}
    assert {by_id[rid].model for rid in plan.queues["a"]} == {"m"}
    assert {by_id[rid].model for rid in plan.queues["b"]} == {"n"}
