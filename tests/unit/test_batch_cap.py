"""The batch cap LSO (``InstanceLSO.max_in_engine``): the planner's choice, the core's orders
and the pull rule that carries it out (qlm/admission.py), on builders and no broker."""

from __future__ import annotations

import dataclasses

from qlm.admission import PullAdmission
from qlm.coordinator.core import CoordinatorCore, LSOSettings
from qlm.planner import create_policy
from qlm.planner.stochastic import CAP_HOLD_S, CAP_MIN, LOAD_WINDOW_S, RECENT_S, QLMPolicy
from qlm.policy import InstanceLSO, Plan, PlanInstance, PlanRequest
from tests.builders import heartbeat

A100 = "A100-80GB"
MODEL = "mistral-7b"
NOW = 1_000.0
# The default floor (0.98 of the full batch's throughput) allows caps only a little below the
# full batch, which these small queues do not need; the tests of what a cap does price the
# trade a lower floor allows.
FLOOR = 0.9


def _inst(iid: str = "i0", cap: int | None = None) -> PlanInstance:
    return PlanInstance(iid, (MODEL,), A100, 400_000, 256, max_in_engine=cap)


def _req(
    rid: str, slo_s: float, out: int, *, ttft_s: float | None = None, seq: int = 0
) -> PlanRequest:
    return PlanRequest(
        rid,
        MODEL,
        600,
        out,
        NOW,
        NOW + slo_s,
        None if ttft_s is None else NOW + ttft_s,
        seq=seq,
    )


# ---------------------------------------------------------------- the pull rule
def test_credit_stays_within_the_cap() -> None:
    agent: PullAdmission[str] = PullAdmission(None, need=lambda r, t: 0.0, key=str, cap=10)
    assert agent.credit_wanted(8, in_engine=5) == 5
    agent.granted(3)  # owed, not yet dispatched: counts against the cap
    assert agent.credit_wanted(8, in_engine=5) == 2
    assert agent.credit_wanted(8, in_engine=7) == 0
    agent.cap = None  # lifted: what the engine wants, less what is owed
    assert agent.credit_wanted(8, in_engine=7) == 5


# ---------------------------------------------------------------- the core's orders
def _plan(cap: int | None) -> Plan:
    return Plan(queues={"a-gpu0": []}, lso={"a-gpu0": InstanceLSO(max_in_engine=cap)})


def test_a_cap_is_sent_when_it_changes_and_again_to_a_restarted_agent() -> None:
    core = CoordinatorCore(create_policy("edf"))
    hb = heartbeat("a")
    core.on_heartbeat(hb.model_copy(update={"incarnation": "p1"}), 0.0)
    assert core.cap_orders(_plan(None)) == []  # nothing to lift
    (order,) = core.cap_orders(_plan(64))
    assert (order.instance_id, order.agent_id, order.max_in_engine) == ("a-gpu0", "a", 64)
    assert core.cap_orders(_plan(64)) == []
    (order,) = core.cap_orders(_plan(None))
    assert order.max_in_engine is None
    core.cap_orders(_plan(32))
    # a new agent process under the same id starts without a cap: sent again
    core.on_heartbeat(hb.model_copy(update={"incarnation": "p2"}), 1.0)
    (order,) = core.cap_orders(_plan(32))
    assert order.max_in_engine == 32


def test_a_new_coordinator_lifts_the_cap_an_agent_still_applies() -> None:
    """A coordinator that took over learns the agent's cap from its heartbeat: a plan
    without a cap lifts it (it would otherwise stay, since nothing was 'sent')."""
    core = CoordinatorCore(create_policy("edf"))
    hb = heartbeat("a")
    hb.instances[0].max_in_engine = 48
    core.on_heartbeat(hb, 0.0)
    (order,) = core.cap_orders(_plan(None))
    assert order.max_in_engine is None
    assert core.cap_orders(_plan(48)) != []  # and a plan that wants it back says so


def test_no_cap_orders_with_the_lso_off_but_a_cap_from_before_is_lifted() -> None:
    core = CoordinatorCore(create_policy("edf"), lso=LSOSettings(batch_cap=False))
    core.on_heartbeat(heartbeat("a"), 0.0)
    assert core.cap_orders(_plan(64)) == []
    hb = heartbeat("b")
    hb.instances[0].max_in_engine = 32  # set by a coordinator that had the LSO on
    core.on_heartbeat(hb, 0.0)
    (order,) = core.cap_orders(_plan(64))
    assert (order.instance_id, order.max_in_engine) == ("b-gpu0", None)
    assert core.cap_orders(_plan(64)) == []


def test_the_plan_view_carries_the_cap_the_agent_reports() -> None:
    core = CoordinatorCore(create_policy("edf"))
    hb = heartbeat("a")
    hb.instances[0].max_in_engine = 48
    core.on_heartbeat(hb, 0.0)
    assert core.instances["a-gpu0"].plan_view().max_in_engine == 48


# ---------------------------------------------------------------- the planner
def _cap(pol: QLMPolicy, reqs: list[PlanRequest], insts: list[PlanInstance]) -> int | None:
    plan = pol.plan(reqs, insts, NOW)
    return plan.lso[insts[0].instance_id].max_in_engine


def test_latency_bound_work_gets_a_smaller_batch() -> None:
    """400 tokens in 20 s: at the full batch (~80 ms a token with its prefills) the decode
    alone takes longer than the SLO; in a smaller batch it meets. The sure batch work beside it
    keeps its deadlines at the capped speed, so the instance is capped."""
    pol = QLMPolicy(cap_throughput_min=FLOOR)
    reqs = [_req(f"chat{k}", 20.0, 400, seq=k) for k in range(4)]
    reqs += [_req(f"batch{k}", 600.0, 200, seq=10 + k) for k in range(20)]
    cap = _cap(pol, reqs, [_inst()])
    full = pol._hw(_inst(), MODEL, *pol._ctx[MODEL]).batch
    assert cap is not None and CAP_MIN <= cap < full


def test_a_cap_is_lifted_once_its_reason_lapses_without_a_replan() -> None:
    """No plan after the latency-bound work was served (a drain without arrivals): once
    CAP_HOLD_S has passed the policy names the capped instance, once, and the core orders its
    cap lifted; no replan is asked for."""
    core = CoordinatorCore(QLMPolicy())
    core.on_heartbeat(heartbeat("a"), NOW)
    iid = "a-gpu0"
    assert [o.max_in_engine for o in core.cap_orders(_plan(48))] == [48]
    pol = core.policy
    assert isinstance(pol, QLMPolicy)
    pol._cap_lapse = {iid: NOW + CAP_HOLD_S}
    assert core.lapsed_cap_orders(NOW + 1.0) == []  # its reason is fresh
    later = NOW + CAP_HOLD_S + 1.0
    orders = core.lapsed_cap_orders(later)
    assert [(o.instance_id, o.max_in_engine) for o in orders] == [(iid, None)]
    assert core.lapsed_cap_orders(later + 1.0) == []  # lifted once
    assert not pol.wants_replan(later)


def test_the_planner_names_the_instances_it_capped_and_when_their_caps_lapse() -> None:
    pol = QLMPolicy(cap_throughput_min=FLOOR)
    reqs = [_req(f"chat{k}", 20.0, 400, seq=k) for k in range(4)]
    batch = [_req(f"batch{k}", 600.0, 200, seq=10 + k) for k in range(20)]
    assert _cap(pol, reqs + batch, [_inst()]) is not None
    assert pol.lapsed_caps(NOW + CAP_HOLD_S - 1.0) == []
    assert pol.lapsed_caps(NOW + CAP_HOLD_S + 1.0) == ["i0"]
    assert pol.lapsed_caps(NOW + CAP_HOLD_S + 2.0) == []
    # a plan within the hold keeps the cap and its lapse; a later one sets none, leaving
    # nothing to lapse
    assert _cap(pol, batch, [_inst()]) is not None
    assert pol.lapsed_caps(NOW + CAP_HOLD_S + 1.0) == ["i0"]
    later = NOW + CAP_HOLD_S + 1.0
    assert pol.plan(batch, [_inst()], later).lso["i0"].max_in_engine is None
    assert pol.lapsed_caps(later + 10 * CAP_HOLD_S) == []


def test_an_instance_that_serves_several_models_is_not_capped() -> None:
    """Where an instance switches models a cap slows the drain of one model's run, and the
    other models' work waits for the switch (wa-ablation: no attainment gained, 6 % less
    throughput, more switches): the same queue that caps a one-model instance caps none that
    also serves another model."""
    reqs = [_req(f"chat{k}", 20.0, 400, seq=k) for k in range(4)]
    reqs += [_req(f"batch{k}", 600.0, 200, seq=10 + k) for k in range(20)]
    assert _cap(QLMPolicy(cap_throughput_min=FLOOR), reqs, [_inst()]) is not None
    two = dataclasses.replace(_inst(), models=(MODEL, "vicuna-13b"), active_model=MODEL)
    assert _cap(QLMPolicy(cap_throughput_min=FLOOR), reqs, [two]) is None


def test_work_with_slack_to_spare_is_not_capped() -> None:
    pol = QLMPolicy()
    reqs = [_req(f"batch{k}", 600.0, 200, seq=k) for k in range(20)]
    assert _cap(pol, reqs, [_inst()]) is None


def test_no_cap_while_work_with_a_ttft_of_seconds_is_queued() -> None:
    """A capped engine makes arrivals wait for a slot to free: a 2-s TTFT cannot."""
    pol = QLMPolicy()
    reqs = [_req(f"chat{k}", 20.0, 400, seq=k) for k in range(4)]
    reqs.append(_req("stream", 600.0, 50, ttft_s=2.0, seq=9))
    assert _cap(pol, reqs, [_inst()]) is None


def test_the_cap_never_costs_more_throughput_than_allowed() -> None:
    """A floor of 1.0 allows no throughput loss at all, so no cap; a lower floor allows a
    smaller cap than a higher one, and the default (0.98) none smaller than 0.9 does."""
    reqs = [_req(f"chat{k}", 20.0, 400, seq=k) for k in range(4)]
    assert _cap(QLMPolicy(cap_throughput_min=1.0), reqs, [_inst()]) is None
    loose = _cap(QLMPolicy(cap_throughput_min=0.5), reqs, [_inst()])
    tight = _cap(QLMPolicy(cap_throughput_min=FLOOR), reqs, [_inst()])
    assert loose is not None and tight is not None and loose < tight
    default = _cap(QLMPolicy(), reqs, [_inst()])
    assert default is None or default > tight


def test_a_cap_never_tips_an_instance_into_an_overload_and_one_already_over_gets_it() -> None:
    """The sure work's load (what place() saw arrive, in instances' worth) decides only where
    the instance carries it uncapped: at 0.99 of its capacity the cap's lower throughput would
    leave it behind, so none is set; above its capacity already (wb at 16 req/s) the throughput
    floor alone bounds the cap, which is then the one an idle fleet gets."""

    def cap_at(load: float) -> int | None:
        pol = QLMPolicy(cap_throughput_min=FLOOR)
        # the decayed sums of a steady sure rate of ``load`` instances (qlm place())
        pol._sure_load = {LOAD_WINDOW_S: [load * LOAD_WINDOW_S] * 2 + [load * RECENT_S]}
        assert abs(pol._sure_rate() - load) < 1e-9
        reqs = [_req(f"chat{k}", 20.0, 400, seq=k) for k in range(4)]
        reqs += [_req(f"batch{k}", 600.0, 200, seq=10 + k) for k in range(20)]
        return _cap(pol, reqs, [_inst()])

    idle = cap_at(0.0)
    assert idle is not None
    assert cap_at(0.5) == idle
    assert cap_at(0.99) is None and cap_at(1.0) is None
    assert cap_at(1.01) == idle and cap_at(3.0) == idle


def test_the_planner_prices_an_instance_at_the_cap_its_agent_applies() -> None:
    """A capped instance serves fewer tokens a second (occupancy per token up) and decodes
    each faster (own time per token down) than the same one uncapped."""
    pol = QLMPolicy()
    busy = {"running": 100, "active_model": MODEL}
    uncapped = pol._rate(dataclasses.replace(_inst(), **busy), MODEL)  # type: ignore[arg-type]
    capped = pol._rate(dataclasses.replace(_inst(cap=CAP_MIN), **busy), MODEL)  # type: ignore[arg-type]
    assert capped.inv_tps > uncapped.inv_tps
    assert capped.token_s < uncapped.token_s


def test_batch_caps_off() -> None:
    pol = QLMPolicy(batch_cap=False)
    reqs = [_req(f"chat{k}", 20.0, 400, seq=k) for k in range(4)]
    assert _cap(pol, reqs, [_inst()]) is None
