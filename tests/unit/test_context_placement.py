"""Engines of one model with different contexts (--max-model-len per pool): the coordinator
core sends a request only to an engine that takes its prompt + max_tokens, whatever the
policy, through every path a request reaches a queue by (arrival, plan, a plan computed
elsewhere, held work released, a drain, an engine that came back shorter)."""

from __future__ import annotations

import pytest

from qlm.control import Heartbeat
from qlm.coordinator.core import BatchTier, CoordinatorCore, TrackState
from qlm.planner import POLICIES, create_policy
from tests.builders import heartbeat, make_request

SHORT, LONG = 3000, 8192


def _beat(agent: str, context: int, n: int = 2, at: float = 0.0, used: float = 0.0) -> Heartbeat:
    hb = heartbeat(agent, n, at=at, max_model_len={"mistral-7b": context})
    return hb.model_copy(
        update={
            "instances": [
                s.model_copy(update={"kv_used_tokens": int(used * s.info.kv_capacity_tokens)})
                for s in hb.instances
            ]
        }
    )


def _core(policy: str = "edf", **kw: object) -> CoordinatorCore:
    core = CoordinatorCore(create_policy(policy), heartbeat_timeout_s=3.0, **kw)  # type: ignore[arg-type]
    core.on_heartbeat(_beat("short", SHORT), now=0.0)
    core.on_heartbeat(_beat("long", LONG), now=0.0)
    return core


def _admit(core: CoordinatorCore, prompt: int, at: float = 0.0, e2e_ms: int = 60_000):  # type: ignore[no-untyped-def]
    req = make_request(prompt_len=prompt, max_tokens=100, e2e_ms=e2e_ms, submitted_at=at)
    tracked, outcome = core.admit(
        req, object(), reply_to="r", correlation_id=req.request_id, received_at=at
    )
    assert outcome == "new"
    return tracked


def _on_long(core: CoordinatorCore, tracked) -> bool:  # type: ignore[no-untyped-def]
    iid = tracked.instance_id
    return iid is not None and iid.startswith("long-")


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_places_a_long_request_only_where_its_context_fits(policy: str) -> None:
    core = _core(policy)
    long = [_admit(core, 4000, at=0.01 * k) for k in range(12)]
    short = [_admit(core, 500, at=0.01 * k) for k in range(12)]
    assert all(_on_long(core, t) for t in long)  # on arrival (place)
    core.replan(1.0)  # a whole plan, adopted
    assert all(_on_long(core, t) for t in long)
    assert all(t.state == TrackState.QUEUED for t in long + short)
    for iid in core.instances:
        core.on_pull(iid, 100)
    orders = core.next_dispatches(1.0)
    assert len(orders) == 24  # nothing lost or left behind
    for order in orders:
        fits = order.tracked.plan_view.prompt_tokens + 100 <= SHORT
        assert fits or order.instance_id.startswith("long-"), order.instance_id


def _serving(agent: str, context: int) -> Heartbeat:
    """Both instances running the model with a free slot: an arrival during a plan starts at
    once on one of them (CoordinatorCore._free_slot) where its context fits."""
    hb = _beat(agent, context)
    return hb.model_copy(
        update={
            "instances": [s.model_copy(update={"active_model": "mistral-7b"}) for s in hb.instances]
        }
    )


def test_an_arrival_during_a_plan_starts_at_once_only_where_its_context_fits() -> None:
    core = _core()
    core.on_heartbeat(_serving("short", SHORT), now=0.1)
    core.on_heartbeat(_serving("long", LONG), now=0.1)
    for iid in core.instances:
        core.on_pull(iid, 4)
    core.begin_plan()
    short = _admit(core, 500, at=0.5)
    long = _admit(core, 4000, at=0.5)
    assert short.instance_id is not None and long.instance_id is not None  # both at once
    assert _on_long(core, long)
    core.abort_plan(1.0)
    assert _on_long(core, long)


def test_a_plan_computed_elsewhere_and_an_arrival_meanwhile_keep_to_the_context() -> None:
    core = _core()
    core.begin_plan()
    meanwhile = _admit(core, 4000, at=0.5)  # placed when the plan is adopted
    plan = core.policy.plan(*core.plan_inputs(), 1.0)
    # a plan that puts the long request on a short engine (a policy that knows nothing of
    # contexts could): the core places it again, where it fits
    short_iid = next(i for i in core.instances if i.startswith("short-"))
    queues = {iid: [] for iid in core.instances}
    queues[short_iid] = [meanwhile.request_id]
    core.adopt_plan(type(plan)(queues=queues, unassigned=[], policy=plan.policy), 1.0)
    assert _on_long(core, meanwhile) and meanwhile.state == TrackState.QUEUED


def test_one_no_live_engine_takes_waits_unassigned_until_one_does() -> None:
    core = _core()
    long = _admit(core, 4000)
    short = _admit(core, 500)
    moved = core.lose_agent("long", "test", now=1.0)
    assert {t.request_id for t in moved} >= {long.request_id}
    assert long.instance_id is None and core.unassigned == [long.request_id]
    assert short.instance_id is not None and short.instance_id.startswith("short-")
    core.on_heartbeat(_beat("long", LONG, at=2.0), now=2.0)  # back: placed there
    assert _on_long(core, long) and core.unassigned == []


def test_a_drained_long_engine_hands_its_long_work_to_another_long_one_or_none() -> None:
    core = _core()
    long = [_admit(core, 4000, at=0.01 * k) for k in range(6)]
    core.drain("long-gpu0", 1.0)
    assert all(t.instance_id == "long-gpu1" for t in long)
    core.drain("long-gpu1", 2.0)
    assert all(t.instance_id is None for t in long)
    assert sorted(core.unassigned) == sorted(t.request_id for t in long)
    assert core.undrain("long-gpu0", 3.0) == "alive"  # placed at once, not at the next plan
    assert all(t.instance_id == "long-gpu0" for t in long) and core.unassigned == []


def test_an_engine_back_with_a_shorter_context_sends_its_long_work_elsewhere() -> None:
    core = _core()
    long = _admit(core, 4000)
    first = long.instance_id
    assert first is not None and first.startswith("long-")
    agent = first.split("-")[0]
    # the same instances, now saying 3000 (a server restarted with another --max-model-len)
    core.on_heartbeat(_beat(agent, SHORT, at=1.0), now=1.0)
    core.on_pull(first, 1)
    assert core.next_dispatches(1.5, first) == []  # not sent where the engine would refuse it
    assert long.state == TrackState.QUEUED and long.instance_id is None  # none takes it now


def test_held_work_is_released_only_to_an_engine_that_takes_it() -> None:
    core = CoordinatorCore(create_policy("edf"), heartbeat_timeout_s=3.0, batch=BatchTier())
    core.on_heartbeat(_beat("short", SHORT, used=0.9), now=0.0)
    core.on_heartbeat(_beat("long", LONG, used=0.9), now=0.0)  # busy: nothing released
    held = _admit(core, 4000, e2e_ms=3 * 3600_000)
    assert held.state == TrackState.HELD
    core.on_heartbeat(_beat("short", SHORT, at=1.0, used=0.1), now=1.0)  # room, too short
    assert held.state == TrackState.HELD and core.held_count == 1
    core.on_heartbeat(_beat("long", LONG, at=2.0, used=0.1), now=2.0)
    assert held.state == TrackState.QUEUED and _on_long(core, held)
