"""Conformance suite: every ordering policy registered in ``planner.POLICIES`` must pass it.

What the suite holds every policy to:

* **Partition.** Every queued request is placed exactly once: in one instance's queue or in
  ``unassigned``, and ``unassigned`` only when no live instance serves its model.
* **Capacity respected.** No queue gets a request for a model its instance does not serve, and
  no draining instance gets anything. Load is spread: with identical instances and identical
  requests, no instance receives more than twice its fair share (``plan`` and ``place`` alike).
  Load-aware policies also send an arrival to the clearly less-loaded of two queues.
* **Deterministic.** The same inputs give the same plan, whatever the input order, across
  fresh policy objects (seeded policies use their default seed); so does a sequence of
  ``place`` calls.
* **No starvation.** In a drain loop (arrivals placed with ``place`` at their ``sort_key``
  position, instances taking one request a step, a full ``plan`` adopted every few steps), a
  request is dispatched within a bounded number of steps while every request carries a
  bounded SLO. (Requests without any deadline are out of scope: EDF serves them last by design.)
* **Stale keys are final.** A key ``stale_key`` moves a request to does not go stale again.
* **place agrees with plan.** Placing requests one by one and keeping each queue sorted by
  ``sort_key`` gives a valid partition too.
* **Degenerate inputs never crash**: zero instances, no serving instance, SLOs already passed,
  one huge request, one huge uniform batch, thousands of tiny requests.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.grouping import GroupingConfig
from qlm.planner import POLICIES, create_policy, simulation_policy
from qlm.planner.stochastic import QLMPolicy
from qlm.policy import CompletionObservation, Plan, PlanInstance, PlanRequest, QueuePolicy
from qlm.virtual_queue import VirtualQueue
from tests.builders import make_instance, make_plan_request

ALL = sorted(POLICIES)
# Policies whose plan is exactly "sort by sort_key, then balance": their queues must be sorted.
SORT_ORDERED = sorted({"fcfs", "edf", "round_robin", "random", "power_of_two"} & set(POLICIES))
# Policies that place without looking at queued work, by design.
LOAD_OBLIVIOUS = {"round_robin", "random"}
LOAD_AWARE = [n for n in ALL if n not in LOAD_OBLIVIOUS]


@pytest.fixture(params=ALL)
def policy(request: pytest.FixtureRequest) -> QueuePolicy:
    return create_policy(request.param)


def assert_valid_partition(plan: Plan, reqs: list[PlanRequest], insts: list[PlanInstance]) -> None:
    placed = plan.assigned_ids() + plan.unassigned
    assert sorted(placed) == sorted(r.request_id for r in reqs), "not placed exactly once"
    by_id = {r.request_id: r for r in reqs}
    inst_by_id = {i.instance_id: i for i in insts}
    assert set(plan.queues) <= set(inst_by_id)
    for iid, ids in plan.queues.items():
        for rid in ids:
            assert inst_by_id[iid].serves(by_id[rid].model), f"{rid} on {iid}"
    for rid in plan.unassigned:
        assert not any(i.serves(by_id[rid].model) for i in insts), f"{rid} left unassigned"


def place_all(
    policy: QueuePolicy, reqs: list[PlanRequest], insts: list[PlanInstance], now: float = 0.0
) -> Plan:
    """What the coordinator does per arrival: ``place`` into a queue kept sorted by sort_key."""
    queues = {i.instance_id: VirtualQueue(i.instance_id) for i in insts}
    load = dict.fromkeys(queues, 0.0)
    unassigned = []
    for r in reqs:
        target = policy.place(r, insts, load, now)
        if target is None:
            unassigned.append(r.request_id)
            continue
        queues[target].insert(r.request_id, policy.sort_key(r))
        load[target] += policy.work_tokens(r)
    return Plan(queues={k: list(q) for k, q in queues.items()}, unassigned=unassigned)


requests_strategy = st.lists(
    st.tuples(
        st.floats(0, 100, allow_nan=False),
        st.one_of(st.none(), st.floats(0, 1000, allow_nan=False)),
        st.sampled_from(["m", "n", "unknown"]),
    ),
    max_size=40,
)


def build(specs: list, n_inst: int) -> tuple[list[PlanRequest], list[PlanInstance]]:
    reqs = [
        make_plan_request(f"r{i}", arrival=a, deadline=d, model=m, seq=i)
        for i, (a, d, m) in enumerate(specs)
    ]
    insts = [
        make_instance(f"i{k}", ("m",) if k % 2 else ("m", "n"), draining=k == 3)
        for k in range(n_inst)
    ]
    return reqs, insts


# ------------------------------------------------------------------------------- partition
@pytest.mark.parametrize("name", ALL)
@settings(max_examples=60, deadline=None)
@given(specs=requests_strategy, n_inst=st.integers(0, 4), now=st.floats(0, 500))
def test_plan_is_a_partition(name: str, specs: list, n_inst: int, now: float) -> None:
    """Every request appears exactly once: in one queue, or unassigned; only on instances that
    serve its model and are not draining."""
    reqs, insts = build(specs, n_inst)
    assert_valid_partition(create_policy(name).plan(reqs, insts, now=now), reqs, insts)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=40, deadline=None)
@given(specs=requests_strategy, n_inst=st.integers(0, 4))
def test_place_then_sort_is_a_partition(name: str, specs: list, n_inst: int) -> None:
    """place agrees with plan: one-by-one placement, each queue in sort_key order, is also a
    valid partition and its queues are sorted by the policy's key."""
    policy = create_policy(name)
    reqs, insts = build(specs, n_inst)
    plan = place_all(policy, reqs, insts)
    assert_valid_partition(plan, reqs, insts)
    by_id = {r.request_id: r for r in reqs}
    for ids in plan.queues.values():
        keys = [policy.sort_key(by_id[rid]) for rid in ids]
        assert keys == sorted(keys)


@pytest.mark.parametrize("name", SORT_ORDERED)
@settings(max_examples=60, deadline=None)
@given(specs=requests_strategy)
def test_queue_order_follows_sort_key(name: str, specs: list) -> None:
    policy = create_policy(name)
    reqs = [
        make_plan_request(f"r{i}", arrival=a, deadline=d, seq=i)
        for i, (a, d, _) in enumerate(specs)
    ]
    plan = policy.plan(reqs, [make_instance("i0")], now=0.0)
    by_id = {r.request_id: r for r in reqs}
    keys = [policy.sort_key(by_id[rid]) for rid in plan.queues["i0"]]
    assert keys == sorted(keys)


# -------------------------------------------------------------------------------- capacity
def test_place_returns_none_without_a_serving_instance(policy: QueuePolicy) -> None:
    r = make_plan_request("r", arrival=0, deadline=1, model="x")
    assert policy.place(r, [make_instance("i0")], {"i0": 0.0}, now=0.0) is None
    assert policy.place(r, [], {}, now=0.0) is None


@pytest.mark.parametrize("name", LOAD_AWARE)
def test_place_balances_load(name: str) -> None:
    r = make_plan_request("r", arrival=0, deadline=1)
    insts = [make_instance("i0"), make_instance("i1")]
    assert create_policy(name).place(r, insts, {"i0": 5000.0, "i1": 10.0}, now=0.0) == "i1"


def test_place_skips_draining(policy: QueuePolicy) -> None:
    r = make_plan_request("r", arrival=0, deadline=1)
    insts = [make_instance("i0", draining=True), make_instance("i1")]
    for _ in range(4):  # stateful policies (round-robin) must skip it on every turn
        assert policy.place(r, insts, {"i0": 0.0, "i1": 1e9}, now=0.0) == "i1"


def test_model_restricted_instances_get_only_their_model(policy: QueuePolicy) -> None:
    reqs = [
        make_plan_request(f"r{i}", arrival=i, deadline=50 + i, model="mn"[i % 2], seq=i)
        for i in range(60)
    ]
    insts = [make_instance("only-m", ("m",)), make_instance("only-n", ("n",))]
    for plan in (policy.plan(reqs, insts, 0.0), place_all(policy, reqs, insts)):
        assert_valid_partition(plan, reqs, insts)
        assert len(plan.queues["only-m"]) == len(plan.queues["only-n"]) == 30


def test_load_is_spread_over_identical_instances(policy: QueuePolicy) -> None:
    n, m = 400, 4
    reqs = [make_plan_request(f"r{i}", arrival=i, deadline=1e6, seq=i) for i in range(n)]
    insts = [make_instance(f"i{k}") for k in range(m)]
    fair = n / m
    for plan in (policy.plan(reqs, insts, 0.0), place_all(policy, reqs, insts)):
        sizes = [len(q) for q in plan.queues.values()]
        assert sum(sizes) == n
        assert max(sizes) <= 2 * fair, sizes


# ---------------------------------------------------------------------------- determinism
def test_plan_is_deterministic(policy: QueuePolicy) -> None:
    name = policy.name
    reqs = [
        make_plan_request(f"r{i}", arrival=i % 3, deadline=10 - i % 4, seq=i) for i in range(30)
    ]
    insts = [make_instance("i0"), make_instance("i1")]
    a = create_policy(name).plan(reqs, insts, now=0.0)
    b = create_policy(name).plan(list(reversed(reqs)), list(reversed(insts)), now=0.0)
    c = policy.plan(reqs, insts, now=0.0)
    assert a.queues == b.queues == c.queues
    assert a.unassigned == b.unassigned


def test_place_sequence_is_deterministic(policy: QueuePolicy) -> None:
    rng = random.Random(7)
    reqs = [
        make_plan_request(f"r{i}", arrival=i, deadline=i + rng.uniform(1, 50), seq=i)
        for i in range(100)
    ]
    insts = [make_instance(f"i{k}") for k in range(3)]
    a = place_all(create_policy(policy.name), reqs, insts)
    b = place_all(create_policy(policy.name), reqs, insts)
    assert a.queues == b.queues


# ----------------------------------------------------------------------------- starvation
def test_no_request_starves_under_bounded_slos(policy: QueuePolicy) -> None:
    """A request with the loosest SLO, followed by a steady stream of tighter-SLO arrivals, is
    still dispatched within a bounded number of steps (EDF's guarantee: once the clock passes
    its deadline, every new arrival sorts after it)."""
    rng = random.Random(3)
    insts = [make_instance("i0"), make_instance("i1")]
    queues = {i.instance_id: VirtualQueue(i.instance_id) for i in insts}
    load = dict.fromkeys(queues, 0.0)
    known: dict[str, PlanRequest] = {}

    def arrive(r: PlanRequest, now: float) -> None:
        known[r.request_id] = r
        target = policy.place(r, insts, load, now)
        assert target is not None
        queues[target].insert(r.request_id, policy.sort_key(r))
        load[target] += policy.work_tokens(r)

    max_slo, steps, seq = 40.0, 400, 0
    arrive(make_plan_request("victim", arrival=0.0, deadline=max_slo, seq=seq), 0.0)
    dispatched_at: dict[str, int] = {}
    for t in range(1, steps):
        for _ in range(2):  # arrivals match the service rate: the backlog random-walks
            seq += 1
            slo = rng.uniform(1.0, max_slo)
            arrive(make_plan_request(f"a{seq}", arrival=t, deadline=t + slo, seq=seq), float(t))
        if t % 7 == 0:  # a full replan, adopted the way the coordinator adopts it
            plan = policy.plan(list(known.values()), insts, float(t))
            for iid, ids in plan.queues.items():
                queues[iid].replace([(rid, policy.sort_key(known[rid])) for rid in ids])
                load[iid] = sum(policy.work_tokens(known[rid]) for rid in ids)
        for iid, q in queues.items():
            if len(q) and rng.random() < 0.98:
                rid = q.pop(lambda r, k, i=iid, t=t: policy.stale_key(known[r], k, i, float(t)))
                load[iid] -= policy.work_tokens(known.pop(rid))
                dispatched_at[rid] = t
        if "victim" in dispatched_at:
            break
    assert "victim" in dispatched_at, f"victim still queued after {steps} steps"
    assert dispatched_at["victim"] <= steps // 2


def test_a_stale_key_is_final(policy: QueuePolicy) -> None:
    """What ``stale_key`` moves a request to is not stale itself, however late it is asked
    (the core asks each head once per dispatch round; a key that went stale again would
    move the request on every round)."""
    insts = [make_instance("i0")]
    reqs = [
        make_plan_request(f"r{i}", arrival=0.0, deadline=d, seq=i, out=o)
        for i, (d, o) in enumerate([(5.0, 50), (30.0, 400), (60.0, 20), (None, 10)])
    ]
    plan = policy.plan(reqs, insts, now=0.0)
    for r in reqs:
        key = policy.sort_key(r)
        for now in (0.0, 10.0, 100.0, 1e6):
            new = policy.stale_key(r, key, "i0", now)
            if new is not None:
                assert policy.stale_key(r, new, "i0", now + 1e6) is None, (r.request_id, now)
                key = new
    assert plan.assigned_ids()


# ------------------------------------------------------------------------- degenerate input
def test_zero_instances_leave_everything_unassigned(policy: QueuePolicy) -> None:
    reqs = [make_plan_request(f"r{i}", arrival=0, deadline=1, seq=i) for i in range(5)]
    plan = policy.plan(reqs, [], now=0.0)
    assert sorted(plan.unassigned) == sorted(r.request_id for r in reqs)
    assert plan.assigned_ids() == []


def test_no_usable_instance(policy: QueuePolicy) -> None:
    reqs = [make_plan_request(f"r{i}", arrival=0, deadline=1, seq=i) for i in range(5)]
    insts = [make_instance("d", draining=True), make_instance("other", ("x",))]
    plan = policy.plan(reqs, insts, now=0.0)
    assert_valid_partition(plan, reqs, insts)
    assert len(plan.unassigned) == 5


def test_empty_queue(policy: QueuePolicy) -> None:
    plan = policy.plan([], [make_instance("i0")], now=0.0)
    assert plan.assigned_ids() == [] and plan.unassigned == []


def test_slo_already_passed(policy: QueuePolicy) -> None:
    reqs = [
        make_plan_request(f"r{i}", arrival=0, deadline=d, seq=i)
        for i, d in enumerate([-100.0, 0.0, 5.0, None, 1e9])
    ]
    insts = [make_instance("i0"), make_instance("i1")]
    assert_valid_partition(policy.plan(reqs, insts, now=1000.0), reqs, insts)


def test_one_huge_request_and_one_huge_batch(policy: QueuePolicy) -> None:
    huge = make_plan_request("huge", arrival=0, deadline=10, prompt=500_000, out=500_000)
    same = [make_plan_request(f"s{i}", arrival=1, deadline=30, seq=i) for i in range(3000)]
    insts = [make_instance("i0"), make_instance("i1", kv=100)]
    reqs = [huge, *same]
    assert_valid_partition(policy.plan(reqs, insts, now=0.0), reqs, insts)


def test_thousands_of_tiny_requests(policy: QueuePolicy) -> None:
    rng = random.Random(1)
    reqs = [
        PlanRequest(f"t{i}", "mn"[i % 2], rng.randint(0, 2), 1, i * 1e-3, i * 1e-3 + 1, None, seq=i)
        for i in range(5000)
    ]
    insts = [make_instance(f"i{k}", ("m", "n")) for k in range(3)]
    plan = policy.plan(reqs, insts, now=0.0)
    assert_valid_partition(plan, reqs, insts)
    assert Counter(len(q) > 0 for q in plan.queues.values())[True] >= 2


# ------------------------------------------------------------------------ completion feedback
def test_observing_completions_keeps_plans_valid(policy: QueuePolicy) -> None:
    """Every policy takes the one ``CompletionObservation`` (all fields, or only the required
    ones) and still plans a valid partition afterwards."""
    for i in range(100):
        policy.observe_completion(CompletionObservation("m", None, 1 + i % 50))
        policy.observe_completion(
            CompletionObservation(
                "m", "interactive", 200, prompt_tokens=10 * i, max_tokens=512, tenant="t"
            )
        )
    reqs = [make_plan_request(f"r{i}", arrival=0, deadline=5 + i, seq=i) for i in range(20)]
    insts = [make_instance("i0"), make_instance("i1")]
    assert_valid_partition(policy.plan(reqs, insts, now=0.0), reqs, insts)


def test_completion_observation_is_frozen_and_slotted() -> None:
    obs = CompletionObservation("m", None, 3)
    assert (obs.prompt_tokens, obs.max_tokens, obs.tenant) == (None, None, None)
    assert not hasattr(obs, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        obs.output_tokens = 4  # type: ignore[misc]


# ---------------------------------------------------------------------------- baselines
def test_edf_orders_by_deadline_and_fcfs_by_arrival() -> None:
    reqs = [
        make_plan_request("late-deadline", arrival=0, deadline=100, seq=1),
        make_plan_request("early-deadline", arrival=5, deadline=10, seq=2),
        make_plan_request("no-deadline", arrival=1, deadline=None, seq=3),
    ]
    inst = [make_instance("i0")]
    assert create_policy("edf").plan(reqs, inst, 0).queues["i0"] == [
        "early-deadline",
        "late-deadline",
        "no-deadline",
    ]
    assert create_policy("fcfs").plan(reqs, inst, 0).queues["i0"] == [
        "late-deadline",
        "no-deadline",
        "early-deadline",
    ]


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        create_policy("nope")
    with pytest.raises(ValueError, match="unknown policy"):
        simulation_policy("nope", {})


def test_one_factory_live_and_simulated_differ_only_by_parameters() -> None:
    """Live: wall-clock budgets, the objective from the settings; simulated: work-clock budgets
    (reproducible plans), a scenario variant's overrides (grouping as a mapping from YAML)."""
    live = create_policy("qlm", objective="service-gain")
    assert isinstance(live, QLMPolicy)
    assert live.config.budget_clock == "wall" and live.config.objective == "service-gain"
    sim = simulation_policy("qlm", {"grouping": {"delta": 2.0}, "slo_quantile": 0.8})
    assert isinstance(sim, QLMPolicy) and sim.config.budget_clock == "work"
    assert isinstance(sim.config.grouping, GroupingConfig) and sim.config.grouping.delta == 2.0
    assert sim.config.slo_quantile == 0.8
    kept = simulation_policy("qlm", {"budget_clock": "wall"})
    assert isinstance(kept, QLMPolicy) and kept.config.budget_clock == "wall"
    # the planner's parameters mean nothing to the baselines: ignored, not an error
    assert create_policy("EDF", budget_clock="work", objective="service-gain").name == "edf"
    assert simulation_policy("fcfs", {}).name == "fcfs"


def test_the_paper_baselines_are_registered() -> None:
    assert {"fcfs", "edf", "shepherd", "round_robin", "random", "power_of_two"} <= set(POLICIES)


@pytest.mark.parametrize("name", ALL)
def test_a_policy_is_pure_or_says_what_state_it_keeps(name: str) -> None:
    """A policy with ``keeps_state == ""`` plans from its arguments alone: the same inputs give
    the same plan twice, and placing and planning do not change its sort keys. Any other
    policy must say in words what it keeps (QueuePolicy.keeps_state)."""
    policy = create_policy(name)
    if policy.keeps_state:
        assert len(policy.keeps_state.split()) >= 4, policy.keeps_state
        return
    reqs = [
        make_plan_request(f"r{i}", arrival=i, deadline=30 + 7 * (i % 5), seq=i) for i in range(40)
    ]
    insts = [make_instance("i0"), make_instance("i1")]
    keys = [policy.sort_key(r) for r in reqs]
    first = policy.plan(reqs, insts, 0.0)
    place_all(policy, reqs, insts)
    second = policy.plan(reqs, insts, 0.0)
    assert first.queues == second.queues and first.unassigned == second.unassigned
    assert [policy.sort_key(r) for r in reqs] == keys
