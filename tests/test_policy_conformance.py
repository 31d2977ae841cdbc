"""Conformance suite: every ordering policy registered in ``planner.POLICIES`` must pass it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import POLICIES, create_policy
from qlm.policy import QueuePolicy
from tests.builders import make_instance, make_plan_request

ALL = sorted(POLICIES)


@pytest.fixture(params=ALL)
def policy(request: pytest.FixtureRequest) -> QueuePolicy:
    return create_policy(request.param)


requests_strategy = st.lists(
    st.tuples(
        st.floats(0, 100, allow_nan=False),
        st.one_of(st.none(), st.floats(0, 1000, allow_nan=False)),
        st.sampled_from(["m", "n", "unknown"]),
    ),
    max_size=40,
)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=60, deadline=None)
@given(specs=requests_strategy, n_inst=st.integers(0, 4))
def test_plan_is_a_partition(name: str, specs: list, n_inst: int) -> None:
    """Every request appears exactly once: in one queue, or unassigned; only on instances that
    serve its model and are not draining."""
    policy = create_policy(name)
    reqs = [
        make_plan_request(f"r{i}", arrival=a, deadline=d, model=m, seq=i)
        for i, (a, d, m) in enumerate(specs)
    ]
    insts = [
        make_instance(f"i{k}", ("m",) if k % 2 else ("m", "n"), draining=k == 3)
        for k in range(n_inst)
    ]
    plan = policy.plan(reqs, insts, now=0.0)
    placed = plan.assigned_ids() + plan.unassigned
    assert sorted(placed) == sorted(r.request_id for r in reqs)
    by_id = {r.request_id: r for r in reqs}
    inst_by_id = {i.instance_id: i for i in insts}
    for iid, ids in plan.queues.items():
        for rid in ids:
            assert inst_by_id[iid].serves(by_id[rid].model)
    for rid in plan.unassigned:
        assert not any(i.serves(by_id[rid].model) for i in insts)


@pytest.mark.parametrize("name", ALL)
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


def test_place_returns_none_without_a_serving_instance(policy: QueuePolicy) -> None:
    r = make_plan_request("r", arrival=0, deadline=1, model="x")
    assert policy.place(r, [make_instance("i0")], {"i0": 0.0}, now=0.0) is None


def test_place_balances_load(policy: QueuePolicy) -> None:
    r = make_plan_request("r", arrival=0, deadline=1)
    insts = [make_instance("i0"), make_instance("i1")]
    assert policy.place(r, insts, {"i0": 5000.0, "i1": 10.0}, now=0.0) == "i1"


def test_place_skips_draining(policy: QueuePolicy) -> None:
    r = make_plan_request("r", arrival=0, deadline=1)
    insts = [make_instance("i0", draining=True), make_instance("i1")]
    assert policy.place(r, insts, {"i0": 0.0, "i1": 1e9}, now=0.0) == "i1"


def test_plan_is_deterministic(policy: QueuePolicy) -> None:
    reqs = [
        make_plan_request(f"r{i}", arrival=i % 3, deadline=10 - i % 4, seq=i) for i in range(30)
    ]
    insts = [make_instance("i0"), make_instance("i1")]
    a = policy.plan(reqs, insts, now=0.0)
    b = policy.plan(list(reversed(reqs)), insts, now=0.0)
    assert a.queues == b.queues


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
