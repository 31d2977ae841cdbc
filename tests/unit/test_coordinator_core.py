"""CoordinatorCore rules, tested without a broker (the service only carries them out)."""

from __future__ import annotations

import pytest

from qlm.control import Completion, Evicted, Heartbeat
from qlm.coordinator.core import MAX_EXTRA_REPLY_TARGETS, BatchTier, CoordinatorCore, TrackState
from qlm.planner import EDFPolicy, create_policy
from qlm.policy import CompletionObservation, InstanceLSO, Plan
from tests.builders import heartbeat, make_request


def core_with(agents: dict[str, int], policy: str = "edf") -> CoordinatorCore:
    core = CoordinatorCore(create_policy(policy), heartbeat_timeout_s=3.0)
    for aid, n in agents.items():
        core.on_heartbeat(heartbeat(aid, n), now=0.0)
    return core


def admit(core: CoordinatorCore, **kw):  # type: ignore[no-untyped-def]
    req = make_request(**kw)
    tracked, outcome = core.admit(
        req,
        object(),
        reply_to="r",
        correlation_id=req.request_id,
        received_at=kw.get("submitted_at") or 0.0,
    )
    assert outcome == "new"
    return tracked


def test_dispatch_follows_edf_order_and_credit() -> None:
    core = core_with({"a": 1})
    late = admit(core, e2e_ms=50_000, submitted_at=0.0)
    early = admit(core, e2e_ms=1_000, submitted_at=1.0)
    assert core.next_dispatches(2.0) == []  # no credit yet: nothing leaves the virtual queue
    core.on_pull("a-gpu0", 1)
    [order] = core.next_dispatches(2.0)
    assert order.tracked is early and order.agent_id == "a"
    core.on_pull("a-gpu0", 5)
    assert [o.tracked for o in core.next_dispatches(2.0)] == [late]
    assert early.state == TrackState.DISPATCHED and early.attempts == 1


def test_requests_without_instances_wait_unassigned_then_get_placed() -> None:
    core = core_with({})
    t = admit(core)
    assert core.unassigned == [t.request_id]
    core.on_heartbeat(heartbeat("b"), now=1.0)
    assert core.unassigned == [] and t.instance_id == "b-gpu0"


def test_one_reply_per_request_even_with_a_late_result() -> None:
    core = core_with({"a": 1, "b": 1})
    t = admit(core)
    core.on_pull(t.instance_id, 1)
    [first] = core.next_dispatches(0.0)
    lost_agent = first.agent_id
    other = "b" if lost_agent == "a" else "a"
    moved = core.lose_agent(lost_agent, "test", now=1.0)
    assert moved == [t] and t.state == TrackState.QUEUED and t.instance_id == f"{other}-gpu0"
    core.on_pull(f"{other}-gpu0", 1)
    [second] = core.next_dispatches(1.0)
    assert second.dispatch_id != first.dispatch_id and t.attempts == 2
    # The "dead" agent was only slow: its result arrives first and is taken ...
    assert core.accept_result(t.request_id, first.dispatch_id) is t
    core.finish(t.request_id)
    # ... and the second attempt's result is ignored: no second reply.
    assert core.accept_result(t.request_id, second.dispatch_id) is None
    assert core.accept_result(t.request_id, first.dispatch_id) is None


def test_result_while_answering_is_ignored() -> None:
    core = core_with({"a": 1})
    t = admit(core)
    core.on_pull("a-gpu0", 1)
    [o] = core.next_dispatches(0.0)
    assert core.accept_result(t.request_id, o.dispatch_id) is t
    assert core.accept_result(t.request_id, o.dispatch_id) is None


def test_redelivery_swaps_handle_and_answered_redelivery_is_recognised() -> None:
    core = core_with({"a": 1})
    req = make_request()
    t, _ = core.admit(req, "h1", reply_to="r", correlation_id="c", received_at=0.0)
    t2, outcome = core.admit(
        req, "h2", reply_to="r", correlation_id="c", received_at=1.0, redelivered=True
    )
    assert outcome == "redelivered" and t2 is t and t.delivery == "h2"
    assert len(core.requests) == 1
    core.on_pull("a-gpu0", 1)
    [o] = core.next_dispatches(1.0)
    core.accept_result(req.request_id, o.dispatch_id)
    core.finish(req.request_id)
    assert core.admit(req, "h3", reply_to="r", correlation_id="c", received_at=2.0) == (
        None,
        "answered",
    )


def test_heartbeat_timeout_requeues_queued_and_inflight() -> None:
    core = core_with({"a": 1, "b": 1})
    ts = [admit(core) for _ in range(6)]
    core.on_pull("a-gpu0", 2)
    core.next_dispatches(0.0)
    core.on_heartbeat(heartbeat("b", at=5.0), now=5.0)  # only b keeps beating
    lost = core.check_liveness(5.0)
    assert [iid for iid, _ in lost] == ["a-gpu0"]
    assert core.instances["a-gpu0"].status == "lost"
    for t in ts:
        assert t.state == TrackState.QUEUED and t.instance_id == "b-gpu0"
    assert len(core.instances["b-gpu0"].queue) == 6


def test_silence_the_coordinator_could_not_hear_loses_no_instance() -> None:
    """While the coordinator's own broker connection is down no heartbeat reaches it: that
    silence is excused, and every instance has a whole timeout from the excuse to be heard."""
    core = core_with({"a": 1, "b": 1})
    timeout = core.heartbeat_timeout_s
    core.excuse_silence(2 * timeout)
    assert core.check_liveness(2 * timeout + timeout * 0.9) == []
    assert {i.status for i in core.instances.values()} == {"alive"}
    core.on_heartbeat(heartbeat("b", at=2.5 * timeout), now=2.5 * timeout)
    lost = core.check_liveness(3.1 * timeout)  # a stays silent after the excuse: lost
    assert [iid for iid, _ in lost] == ["a-gpu0"]


def test_drain_moves_queue_and_stops_dispatch() -> None:
    core = core_with({"a": 1, "b": 1})
    for _ in range(10):
        admit(core)
    queued_on_a = len(core.instances["a-gpu0"].queue)
    assert queued_on_a > 0
    assert core.drain("a-gpu0", now=1.0) == queued_on_a
    assert len(core.instances["a-gpu0"].queue) == 0
    assert len(core.instances["b-gpu0"].queue) == 10
    core.on_pull("a-gpu0", 5)
    assert all(o.instance_id == "b-gpu0" for o in core.next_dispatches(1.0))
    assert admit(core).instance_id == "b-gpu0"


def _engine(agent: str, ok: bool, owed: int = 0, at: float = 0.0) -> Heartbeat:
    hb = heartbeat(agent, at=at)
    hb.instances[0].engine_ok = ok
    hb.instances[0].credit_outstanding = owed
    hb.instances[0].dispatches_received = 0
    return hb


def test_an_engine_that_stops_answering_is_drained_until_it_answers_again() -> None:
    """An http agent's `vllm serve` died: the agent lives and says so in its heartbeats. Work
    waiting for that instance would wait for nothing (its agent pulls nothing meanwhile)."""
    core = core_with({"a": 1, "b": 1})
    for _ in range(10):
        admit(core)
    a = core.instances["a-gpu0"]
    assert len(a.queue) > 0
    core.on_heartbeat(_engine("a", ok=False, at=1.0), now=1.0)
    assert a.status == "draining" and a.engine_down and len(a.queue) == 0
    assert len(core.instances["b-gpu0"].queue) == 10
    assert admit(core).instance_id == "b-gpu0"
    # its model is still served (a restarting server): requests wait, are not refused
    assert "mistral-7b" in core.served_models()
    core.on_heartbeat(_engine("a", ok=False, at=1.5), now=1.5)  # still down: nothing moves
    assert a.status == "draining" and len(core.instances["b-gpu0"].queue) == 11
    core.on_heartbeat(_engine("a", ok=True, owed=2, at=2.0), now=2.0)
    assert a.status == "alive" and not a.engine_down
    assert a.credit == 2  # the agent's credit, reconciled as it came back
    assert admit(core, submitted_at=2.0).instance_id == "a-gpu0"  # placed there again
    assert [o.instance_id for o in core.next_dispatches(2.0)] == ["a-gpu0"]


def test_an_operator_drain_outlasts_the_engine_coming_back() -> None:
    core = core_with({"a": 1, "b": 1})
    core.on_heartbeat(_engine("a", ok=False, at=1.0), now=1.0)
    core.drain("a-gpu0", now=1.2)
    core.on_heartbeat(_engine("a", ok=True, at=2.0), now=2.0)
    assert core.instances["a-gpu0"].status == "draining"
    assert "mistral-7b" in core.served_models()  # b serves it
    core.on_heartbeat(_engine("b", ok=False, at=2.0), now=2.0)
    assert core.served_models() == {"mistral-7b": [core.instances["b-gpu0"]]}


def test_replan_keeps_every_request_once_in_policy_order() -> None:
    core = core_with({"a": 2}, policy="fcfs")
    ts = [admit(core, submitted_at=float(10 - i)) for i in range(8)]
    core.policy = create_policy("edf")
    plan = core.replan(now=20.0)
    assert sorted(plan.assigned_ids()) == sorted(t.request_id for t in ts)
    for inst in core.instances.values():
        ids = list(inst.queue)
        deadlines = [core.requests[r].plan_view.deadline for r in ids]
        assert deadlines == sorted(deadlines)


def test_credit_from_heartbeat_survives_a_coordinator_restart() -> None:
    core = core_with({})
    hb = heartbeat("a")
    hb.instances[0].credit_outstanding = 3
    core.on_heartbeat(hb, now=0.0)
    for _ in range(5):
        admit(core)
    assert len(core.next_dispatches(0.0)) == 3


def _hb(owed: int, received: int | None):  # type: ignore[no-untyped-def]
    hb = heartbeat("a")
    hb.instances[0].credit_outstanding = owed
    hb.instances[0].dispatches_received = received
    return hb


def test_credit_lost_with_a_broker_node_is_restored_from_the_next_heartbeat() -> None:
    core = core_with({})
    core.on_heartbeat(_hb(0, 0), now=0.0)
    for _ in range(10):
        admit(core)
    core.on_pull("a-gpu0", 2)
    assert len(core.next_dispatches(0.0)) == 2  # sent, not yet received by the agent
    # The agent granted 4 more in a pull that died with a node; its heartbeat says it has 4
    # outstanding (6 granted, 2 received)...
    core.on_heartbeat(_hb(4, 2), now=0.5)
    # ... so the coordinator holds 4 and dispatches them: no stall.
    assert len(core.next_dispatches(0.5)) == 4


def test_a_restarted_agent_is_recognised_by_its_incarnation() -> None:
    """A heartbeat of the dead agent process registers the instance (245 dispatches received);
    the restarted process, same agent and instance ids, counts from 0. Without the
    incarnation that reads as 245 dispatches in transit: no credit held, a stall."""
    core = core_with({})
    old = _hb(0, 245)
    old.incarnation = "dead"
    core.on_heartbeat(old, now=0.0)
    for _ in range(10):
        admit(core)
    new = _hb(8, 0)
    new.incarnation = "restarted"
    core.on_heartbeat(new, now=0.5)
    assert len(core.next_dispatches(0.5)) == 8
    # the same process again: counts keep their meaning (4 sent, none received yet)
    again = _hb(8, 0)
    again.incarnation = "restarted"
    core.on_heartbeat(again, now=1.0)
    assert core.instances["a-gpu0"].credit == 0


def test_dispatches_in_transit_are_not_counted_as_credit_again() -> None:
    core = core_with({})
    core.on_heartbeat(_hb(0, 0), now=0.0)
    for _ in range(10):
        admit(core)
    core.on_pull("a-gpu0", 3)
    assert len(core.next_dispatches(0.0)) == 3
    # The heartbeat was sent before any of the 3 dispatches arrived: 3 outstanding, 0
    # received. All 3 are in transit, so nothing is owed to the agent.
    core.on_heartbeat(_hb(3, 0), now=0.5)
    assert core.next_dispatches(0.5) == []
    # A dispatch that died with the agent's queue: the agent never gets it and keeps the
    # credit outstanding; the coordinator lost the agent meanwhile (its queue was deleted)
    # and re-registers it from the agent's count.
    core.on_heartbeat(_hb(1, 2), now=1.0)  # 2 arrived, 1 never will
    assert core.next_dispatches(1.0) == []  # still counted as in transit: not credit yet
    core.lose_agent("a", "connection_closed", now=1.5)
    core.on_heartbeat(_hb(1, 2), now=2.0)
    assert len(core.next_dispatches(2.0)) == 1


def test_an_older_agent_without_counts_is_not_reconciled() -> None:
    core = core_with({})
    core.on_heartbeat(_hb(0, None), now=0.0)
    admit(core)
    core.on_heartbeat(_hb(5, None), now=0.5)  # credit_outstanding alone is not trusted
    assert core.next_dispatches(0.5) == []


def test_duplicate_publish_rides_along_and_is_answered_once_per_producer() -> None:
    core = core_with({"a": 1})
    req = make_request()
    t, _ = core.admit(req, "h1", reply_to="q1", correlation_id="c1", received_at=0.0)
    same, outcome = core.admit(req, "h2", reply_to="q2", correlation_id="c2", received_at=1.0)
    again, _ = core.admit(req, "h3", reply_to="q1", correlation_id="c1", received_at=2.0)
    assert outcome == "duplicate" and same is t and again is t
    # the copies are not held (the service acks them at once); only new reply routes kept
    assert t.delivery == "h1" and t.duplicates == [("q2", "c2")] and t.duplicate_copies == 2
    # Not run twice: one queue entry ...
    assert sum(len(i.queue) for i in core.instances.values()) == 1
    # ... and one reply per distinct producer.
    assert t.reply_targets() == [("q1", "c1"), ("q2", "c2")]


def test_a_flood_of_copies_keeps_a_bounded_number_of_reply_routes() -> None:
    core = core_with({"a": 1})
    req = make_request()
    t, _ = core.admit(req, "h0", reply_to="q0", correlation_id="c", received_at=0.0)
    for i in range(1000):
        core.admit(req, f"h{i}", reply_to=f"q{i}", correlation_id="c", received_at=1.0)
    assert t.duplicate_copies == 1000
    assert len(t.reply_targets()) == 1 + MAX_EXTRA_REPLY_TARGETS
    assert sum(len(i.queue) for i in core.instances.values()) == 1


def test_the_same_id_from_another_tenant_is_a_conflict_not_a_copy() -> None:
    core = core_with({"a": 1})
    t, _ = core.admit(
        make_request(tenant="t1", request_id="same"),
        "h1",
        reply_to="q",
        correlation_id="c",
        received_at=0.0,
    )
    other, outcome = core.admit(
        make_request(tenant="t2", request_id="same"),
        "h2",
        reply_to="evil",
        correlation_id="c",
        received_at=1.0,
    )
    assert outcome == "conflict" and other is t and t.duplicates == []


def test_a_cancel_is_honoured_only_from_the_request_s_tenant() -> None:
    core = core_with({"a": 1})
    t, _ = core.admit(
        make_request(tenant="t1"), "h1", reply_to="q", correlation_id="c", received_at=0.0
    )
    assert core.cancel(t.request_id, "t2")[0] == "refused"
    assert t.state == TrackState.QUEUED
    assert core.cancel(t.request_id, "t1")[0] == "cancelled"


def test_an_early_cancel_from_another_tenant_does_not_cancel_the_request() -> None:
    core = core_with({"a": 1})
    req = make_request(tenant="victim")
    assert core.cancel(req.request_id, "attacker")[0] == "unknown"
    _, outcome = core.admit(req, "h", reply_to="q", correlation_id="c", received_at=0.0)
    assert outcome == "new"
    other = make_request(tenant="owner")
    assert core.cancel(other.request_id, "owner")[0] == "unknown"
    _, outcome = core.admit(other, "h2", reply_to="q", correlation_id="c", received_at=0.0)
    assert outcome == "cancelled"


# ---------------------------------------------------------------- evictions and LSO orders
def _dispatched(core: CoordinatorCore, **kw):  # type: ignore[no-untyped-def]
    t = admit(core, **kw)
    core.on_pull(t.instance_id, 1)
    [order] = core.next_dispatches(0.0)
    return t, order


def report_of(order, ids: list[int]) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The fields an agent's report on ``order`` carries, with output ``ids``."""
    return {
        "agent_id": order.agent_id,
        "instance_id": order.instance_id,
        "dispatch_id": order.dispatch_id,
        "request_id": order.tracked.request_id,
        "output_token_ids": ids,
    }


def _evicted(order, ids: list[int]):  # type: ignore[no-untyped-def]
    return Evicted(**report_of(order, ids))  # type: ignore[arg-type]


def test_evicted_request_is_requeued_to_resume_after_its_output() -> None:
    core = core_with({"a": 1})
    t, order = _dispatched(core, prompt_len=16, max_tokens=10)
    assert core.on_evicted(_evicted(order, [5, 6, 7]), now=1.0) is t
    assert t.state == TrackState.QUEUED and t.resume_token_ids == [5, 6, 7]
    assert t.evictions == 1 and t.first_token_at == 1.0
    # the planner sees what is left: a longer prompt, fewer tokens to generate
    assert (t.plan_view.prompt_tokens, t.plan_view.max_tokens) == (19, 7)
    assert t.request_id not in core.instances["a-gpu0"].running
    core.on_pull("a-gpu0", 1)
    [again] = core.next_dispatches(2.0)
    assert again.tracked is t and again.dispatch_id != order.dispatch_id and t.attempts == 2
    # a stale report for the old attempt changes nothing
    assert core.on_evicted(_evicted(order, [5, 6, 7, 8]), now=3.0) is None
    assert t.state == TrackState.DISPATCHED and t.resume_token_ids == [5, 6, 7]


def test_eviction_that_lost_the_race_with_the_completion_is_ignored() -> None:
    core = core_with({"a": 1})
    t, order = _dispatched(core)
    assert core.accept_result(t.request_id, order.dispatch_id) is t
    assert core.on_evicted(_evicted(order, [1, 2]), now=1.0) is None
    assert t.state == TrackState.ANSWERING


def test_resume_keeps_one_token_to_generate_and_never_shrinks() -> None:
    core = core_with({"a": 1})
    t, order = _dispatched(core, max_tokens=4)
    core.on_evicted(_evicted(order, [1, 2, 3, 4]), now=1.0)
    assert t.resume_token_ids == [1, 2, 3]  # max_tokens - 1: the engine needs >= 1 to generate
    core.on_pull("a-gpu0", 1)
    [again] = core.next_dispatches(1.0)
    # an engine that failed before reporting anything hands back less: the prefix stays
    core.on_evicted(_evicted(again, []), now=2.0)
    assert t.resume_token_ids == [1, 2, 3]


def _plan_with_lso(core: CoordinatorCore, decision: InstanceLSO) -> Plan:
    return Plan(plan_id="p", policy="test", queues={}, lso={"a-gpu0": decision})


def test_lso_orders_evict_later_deadlines_for_an_at_risk_head_group() -> None:
    from qlm.coordinator.core import LSOSettings

    core = core_with({"a": 1})
    core.lso = LSOSettings(eviction=True)  # off by default
    relaxed, r_order = _dispatched(core, e2e_ms=600_000)
    urgent_running, _ = _dispatched(core, e2e_ms=1_000)
    head = admit(core, e2e_ms=5_000)
    entry = InstanceLSO(
        active_model="mistral-7b",
        preempt_running=True,
        head_requests=(head.request_id,),
        preemption_mode="swap",
    )
    models, evictions = core.lso_orders(_plan_with_lso(core, entry))
    # only the running request due after the head group goes; swap falls back to evict
    # because the instance does not report kv_offload
    assert [(e.tracked, e.mode) for e in evictions] == [(relaxed, "evict")]
    assert evictions[0].dispatch_id == r_order.dispatch_id
    assert models and models[0].states == {"mistral-7b": "active"}
    # the same plan again: nothing is sent twice
    assert core.lso_orders(_plan_with_lso(core, entry)) == ([], [])
    assert urgent_running.evict_requested is None


def test_lso_orders_respect_settings_and_model_state_changes() -> None:
    from qlm.coordinator.core import LSOSettings

    core = core_with({"a": 1}, policy="edf")
    core.lso = LSOSettings(eviction=False, warm_start=True)
    _dispatched(core, e2e_ms=600_000)
    head = admit(core, e2e_ms=1_000)
    entry = InstanceLSO(
        active_model="mistral-7b",
        warm_models=("llama-70b",),  # not served here: dropped
        preempt_running=True,
        head_requests=(head.request_id,),
    )
    models, evictions = core.lso_orders(_plan_with_lso(core, entry))
    assert evictions == [] and [m.states for m in models] == [{"mistral-7b": "active"}]


def test_takeover_adopts_work_the_agents_are_running() -> None:
    """A new coordinator gets the old one's unacked requests redelivered; the ones an agent
    reports running are marked running there, not dispatched again."""
    from qlm.coordinator.core import ADOPTED_DISPATCH

    core = core_with({"a": 1})
    requeued, order = _dispatched(core)  # this coordinator's own attempt, then evicted
    core.on_evicted(_evicted(order, [1]), now=1.0)
    running = admit(core)
    waiting = admit(core)
    hb = heartbeat("a")
    hb.instances[0].in_flight = [running.request_id, requeued.request_id, "unknown"]
    core.on_heartbeat(hb, now=2.0)
    assert running.state == TrackState.DISPATCHED and running.dispatch_id == ADOPTED_DISPATCH
    assert core.instances["a-gpu0"].running[running.request_id] == ADOPTED_DISPATCH
    assert running.request_id not in list(core.instances["a-gpu0"].queue)
    assert waiting.state == TrackState.QUEUED  # not reported running: dispatched as usual
    assert requeued.state == TrackState.QUEUED  # ours, evicted: a stale report is not adoption
    # its result, whatever dispatch id the old coordinator gave it, is the one answered
    assert core.accept_result(running.request_id, "old-coordinators-id") is running


def test_a_redelivery_waits_for_the_agents_reports_before_it_is_dispatched() -> None:
    """A broker redelivery of a request this coordinator does not track (a takeover) may be
    running on an agent: adopted if one reports it, never dispatched a second time (a
    streamed one would get two engines' tokens). It is parked for a heartbeat timeout from
    its own arrival (the broker redelivers within the prefetch, so some arrive late), then
    dispatched if nobody runs it."""
    core = CoordinatorCore(create_policy("edf"), heartbeat_timeout_s=3.0)
    core.on_heartbeat(heartbeat("b"), now=0.1)  # b reports first and has credit
    core.on_pull("b-gpu0", 8)

    def redelivered(rid: str, at: float):  # type: ignore[no-untyped-def]
        req = make_request(request_id=rid, stream=True)
        tracked, outcome = core.admit(
            req, object(), reply_to="r", correlation_id=rid, received_at=at, redelivered=True
        )
        assert outcome == "new"
        return tracked

    running_on_a, nowhere = redelivered("on-a", 0.5), redelivered("nowhere", 0.5)
    assert core.next_dispatches(0.6) == []  # parked: not dispatched to b
    assert [r.request_id for r in core.plan_inputs()[0]] == []
    core.on_heartbeat(heartbeat("a", in_flight=("on-a",)), now=1.0)  # a reports it running
    assert running_on_a.state == TrackState.DISPATCHED and running_on_a.instance_id == "a-gpu0"
    late = redelivered("late", 3.0)  # redelivered later (prefetch): parked from its arrival
    core.on_heartbeat(heartbeat("b"), now=2.0)
    assert core.next_dispatches(2.0) == [] and nowhere.state == TrackState.QUEUED
    core.on_heartbeat(heartbeat("b"), now=3.6)  # nowhere's timeout passed, late's has not
    assert [o.tracked for o in core.next_dispatches(3.6)] == [nowhere]
    core.on_heartbeat(heartbeat("a", in_flight=("late",)), now=4.0)
    assert late.state == TrackState.DISPATCHED and late.instance_id == "a-gpu0"
    assert core.parked == {}
    # a plain arrival (not a redelivery) is never parked
    fresh = admit(core)
    assert fresh.instance_id is not None


def _redelivered(core: CoordinatorCore, rid: str, at: float, **kw):  # type: ignore[no-untyped-def]
    req = make_request(request_id=rid, **kw)
    tracked, outcome = core.admit(
        req, object(), reply_to="r", correlation_id=rid, received_at=at, redelivered=True
    )
    assert outcome == "new"
    return tracked


def test_a_takeover_resyncs_the_streams_agents_run_and_keeps_them_for_redeliveries() -> None:
    """A coordinator that took over learns from an instance's first heartbeat what it runs:
    the agent is asked, once, what the streams among it have sent (the tap's chunks went to
    the coordinator that died). Those prefixes can come before the redeliveries, so chunks
    of requests not tracked are kept and become a request's stream when it is redelivered;
    one that nobody runs any more (its agent lost meanwhile) resumes after them."""
    core = CoordinatorCore(create_policy("edf"), heartbeat_timeout_s=3.0)
    hb = heartbeat("a", 2)
    hb.instances[0].in_flight = ["s1", "p1"]
    core.on_heartbeat(hb, now=0.0)
    orders = core.take_stream_resyncs()
    assert [(o.instance_id, o.agent_id, o.request_ids) for o in orders] == [
        ("a-gpu0", "a", ["s1", "p1"])
    ]  # a-gpu1 runs nothing: nothing to ask
    core.on_heartbeat(hb, now=0.5)
    assert core.take_stream_resyncs() == []  # asked once, at registration
    # the agent's answer comes before the redelivery: kept, then the request's stream
    assert core.on_streamed("s1", 0, [5, 6, 7], attempt=1)
    s1 = _redelivered(core, "s1", 1.0, stream=True)
    assert s1.streamed is not None and s1.streamed.token_ids == [5, 6, 7]
    core.on_heartbeat(hb, now=1.2)
    assert s1.state == TrackState.DISPATCHED  # adopted: it runs on a-gpu0
    # s2 streamed on an agent lost before its redelivery came: nobody reports it, so once
    # parked it goes on after what its producer has
    assert core.on_streamed("s2", 0, [1, 2, 3, 4], attempt=1)
    s2 = _redelivered(core, "s2", 1.5, stream=True, max_tokens=8)
    core.on_pull("a-gpu1", 1)
    core.on_heartbeat(hb, now=4.6)
    assert s2.resume_token_ids == [1, 2, 3, 4] and s2.plan_view.max_tokens == 4
    [order] = core.next_dispatches(4.6)
    assert order.tracked is s2
    assert core.stream_resumes == 1
    # an answered request's late chunks are not kept
    core.answered["done"] = 0.0
    assert not core.on_streamed("done", 0, [1], attempt=1)
    assert "done" not in core.untracked_streams


# ---- batch tier (SageServe's queue manager) ---------------------------------------------------


def batch_core(**tier: object) -> CoordinatorCore:
    core = CoordinatorCore(create_policy("edf"), batch=BatchTier(**tier))  # type: ignore[arg-type]
    core.on_heartbeat(loaded("a", 0.9), now=0.0)  # busy: releases nothing
    return core


def loaded(agent: str, emu: float, at: float = 0.0) -> Heartbeat:
    hb = heartbeat(agent, 1, at=at)
    status = hb.instances[0]
    used = int(emu * status.info.kv_capacity_tokens)
    return hb.model_copy(update={"instances": [status.model_copy(update={"kv_used_tokens": used})]})


def test_a_request_with_hours_to_its_deadline_is_held_out_of_the_virtual_queues() -> None:
    core = batch_core()
    batch = admit(core, e2e_ms=2 * 3600_000, submitted_at=0.0)
    chat = admit(core, e2e_ms=10_000, submitted_at=0.0)
    ttft = admit(core, e2e_ms=2 * 3600_000, ttft_ms=5_000, submitted_at=0.0)
    assert batch.state == TrackState.HELD and batch.instance_id is None
    assert chat.state == ttft.state == TrackState.QUEUED  # a TTFT target is interactive
    assert core.held_count == 1 and core.state_counts()["held"] == 1
    assert batch.request_id not in core.instances["a-gpu0"].queue
    assert batch.promote_at == 2 * 3600 * 10 / 24
    # a replan orders what is queued, not what is held
    plan = core.replan(1.0)
    assert batch.request_id not in plan.assigned_ids() and batch.state == TrackState.HELD


def test_spare_capacity_releases_one_or_two_held_requests_earliest_promotion_first() -> None:
    core = batch_core()
    later = admit(core, e2e_ms=20 * 3600_000, submitted_at=0.0)
    sooner = [admit(core, e2e_ms=3 * 3600_000, submitted_at=0.0) for _ in range(3)]
    assert core.held_count == 4
    core.on_heartbeat(loaded("a", 0.65, at=1.0), now=1.0)  # above 60 %: nothing
    assert core.held_count == 4
    core.on_heartbeat(loaded("a", 0.55, at=2.0), now=2.0)  # below 60 %: one
    assert [t.state for t in sooner] == [TrackState.QUEUED, TrackState.HELD, TrackState.HELD]
    core.on_heartbeat(loaded("a", 0.2, at=3.0), now=3.0)  # below 50 %: two
    assert all(t.state == TrackState.QUEUED for t in sooner)
    assert later.state == TrackState.HELD and core.held_count == 1
    assert all(t.instance_id == "a-gpu0" for t in sooner)
    core.on_pull("a-gpu0", 10)
    assert {o.tracked.request_id for o in core.next_dispatches(3.0)} == {
        t.request_id for t in sooner
    }


def test_a_held_request_is_promoted_when_its_deadline_nears() -> None:
    core = batch_core()
    day = admit(core, e2e_ms=24 * 3600_000, submitted_at=0.0)
    assert core.promote_due(10 * 3600 - 1) == []
    assert core.promote_due(10 * 3600) == [day]  # SageServe: 10 h of a 24 h deadline
    assert day.state == TrackState.QUEUED and day.instance_id == "a-gpu0"
    assert core.held_count == 0 and core.promote_due(20 * 3600) == []


def test_a_result_for_a_held_request_is_accepted_once() -> None:
    # after a takeover an engine may report a result for a request still held here
    core = batch_core()
    held = admit(core, e2e_ms=5 * 3600_000, submitted_at=0.0)
    got = core.accept_result(held.request_id, "old-dispatch")
    assert got is held and held.state == TrackState.ANSWERING and core.held_count == 0
    assert core.promote_due(10 * 3600) == []  # its heap entry is skipped
    assert core.accept_result(held.request_id, "old-dispatch") is None


def test_the_batch_tier_can_be_turned_off_and_rejects_bad_settings() -> None:
    core = CoordinatorCore(create_policy("edf"))  # default: off
    core.on_heartbeat(heartbeat("a", 1), now=0.0)
    assert admit(core, e2e_ms=24 * 3600_000, submitted_at=0.0).state == TrackState.QUEUED
    for bad in ({"min_slack_s": 0}, {"release_below": 0.4}, {"promote_after": 1.5}):
        with pytest.raises(ValueError):
            BatchTier(**bad)  # type: ignore[arg-type]


# ---- cancels ----------------------------------------------------------------------------------


def test_cancelling_a_queued_or_held_request_takes_it_out_at_once() -> None:
    core = CoordinatorCore(create_policy("edf"), batch=BatchTier())
    core.on_heartbeat(loaded("a", 0.9), now=0.0)
    queued = admit(core, e2e_ms=10_000, submitted_at=0.0)
    held = admit(core, e2e_ms=5 * 3600_000, submitted_at=0.0)
    for t in (queued, held):
        outcome, tracked, order = core.cancel(t.request_id)
        assert (outcome, tracked, order) == ("cancelled", t, None)
        assert t.state == TrackState.ANSWERING
    assert len(core.instances["a-gpu0"].queue) == 0 and core.held_count == 0
    core.on_pull("a-gpu0", 5)
    assert core.next_dispatches(1.0) == []


def test_cancelling_a_running_request_evicts_it_and_its_report_ends_it() -> None:
    core = core_with({"a": 1})
    t = admit(core, e2e_ms=10_000, submitted_at=0.0)
    core.on_pull("a-gpu0", 1)
    [dispatch] = core.next_dispatches(0.5)
    outcome, tracked, order = core.cancel(t.request_id)
    assert outcome == "stopping" and tracked is t and order is not None
    assert (order.instance_id, order.dispatch_id, order.mode) == ("a-gpu0", t.dispatch_id, "evict")
    assert core.cancel(t.request_id)[0] == "answered"  # a second cancel sends nothing more
    ended = core.on_evicted(
        Evicted(
            agent_id="a",
            instance_id="a-gpu0",
            request_id=t.request_id,
            dispatch_id=dispatch.dispatch_id,
            output_token_ids=[1, 2],
            reason="evict:plan",
        ),
        now=1.0,
    )
    assert ended is t and t.state == TrackState.ANSWERING  # answered "cancelled", not requeued
    assert t.request_id not in core.instances["a-gpu0"].running
    assert len(core.instances["a-gpu0"].queue) == 0


def test_a_result_that_beats_the_cancel_is_the_one_reply() -> None:
    core = core_with({"a": 1})
    t = admit(core, e2e_ms=10_000, submitted_at=0.0)
    core.on_pull("a-gpu0", 1)
    [dispatch] = core.next_dispatches(0.5)
    core.cancel(t.request_id)
    assert core.accept_result(t.request_id, dispatch.dispatch_id) is t  # completion first
    core.finish(t.request_id)
    assert core.cancel(t.request_id)[0] == "answered"


def test_a_cancel_that_comes_first_answers_its_request_on_arrival() -> None:
    core = core_with({"a": 1})
    assert core.cancel("early")[0] == "unknown"
    req = make_request(request_id="early")
    got = core.admit(req, object(), reply_to="r", correlation_id="early", received_at=1.0)
    assert got == (None, "cancelled") and "early" not in core.requests


def test_a_dispatch_this_side_failed_to_publish_goes_back_and_keeps_the_instance() -> None:
    core = core_with({"a": 1})
    t, order = _dispatched(core)
    inst = core.instances[order.instance_id]
    assert inst.credit == 0 and t.attempts == 1
    assert core.undo_dispatch(order, 1.0)
    assert t.state == TrackState.QUEUED and inst.status == "alive"
    assert inst.credit == 1 and t.attempts == 0 and t.request_id not in inst.running
    [again] = core.next_dispatches(1.0)  # dispatched again, with the credit it got back
    assert again.tracked is t and again.dispatch_id != order.dispatch_id
    # undoing the same order again changes nothing
    assert not core.undo_dispatch(order, 2.0)
    assert t.state == TrackState.DISPATCHED and inst.credit == 0


def test_a_failed_dispatch_returns_its_credit_even_when_its_request_was_answered_meanwhile() -> (
    None
):
    """After a broker leader's kill: a request requeued from an agent that reconnected is sent
    to it again, the publish fails on the coordinator's broken channel, and meanwhile the
    first attempt's result answers it. The agent never saw the dispatch, so its credit is
    still granted and the dispatch not received; the coordinator must hold that credit again.
    Before the fix eight such failures per instance (the engine's whole want) left both
    engines of an agent owed eight credits, never pulling again, two requests queued for them
    unanswered for minutes."""
    core = core_with({})
    core.on_heartbeat(_hb(0, 0), now=0.0)
    first = admit(core, request_id="first")
    core.on_pull("a-gpu0", 1)
    [order] = core.next_dispatches(0.0)
    assert core.accept_result(first.request_id, "an-earlier-attempt") is first
    core.finish(first.request_id)
    assert not core.undo_dispatch(order, 0.5)  # nothing to requeue...
    inst = core.instances["a-gpu0"]
    assert inst.credit == 1 and inst.dispatches_sent == 0  # ... but the credit is back
    # the agent agrees (1 owed, none received): nothing to reconcile, and the next request
    # goes out
    core.on_heartbeat(_hb(1, 0), now=1.0)
    admit(core, request_id="next")
    [again] = core.next_dispatches(1.0)
    assert again.tracked.request_id == "next"


def test_a_failed_dispatch_to_an_instance_registered_again_leaves_the_new_count_alone() -> None:
    core = core_with({})
    core.on_heartbeat(_hb(0, 0), now=0.0)
    admit(core)
    core.on_pull("a-gpu0", 1)
    [order] = core.next_dispatches(0.0)
    core.lose_instance("a-gpu0", "goodbye", 0.1)  # the agent reconnected: a new session
    core.on_heartbeat(_hb(1, 0), now=0.2)  # it registers again, owing the same credit
    fresh = core.instances["a-gpu0"]
    assert fresh is not order.counted_on and fresh.credit == 1
    core.next_dispatches(0.2)  # the requeued request goes to it
    core.undo_dispatch(order, 0.3)  # the old session's publish fails only now
    assert fresh.credit == 0 and fresh.dispatches_sent == 1


class _CountingEDF(EDFPolicy):
    """EDF that records which of its methods the core calls (the test is about when)."""

    def __init__(self) -> None:
        self.places = 0
        self.observed: list[int] = []

    def place(self, request, instances, load, now):  # type: ignore[no-untyped-def]
        self.places += 1
        return super().place(request, instances, load, now)

    def observe_completion(self, obs: CompletionObservation) -> None:
        self.observed.append(obs.output_tokens)


def test_a_plan_computed_elsewhere_leaves_the_policy_alone_until_adopted() -> None:
    policy = _CountingEDF()
    core = CoordinatorCore(policy, heartbeat_timeout_s=3.0)
    core.on_heartbeat(heartbeat("a", 1), now=0.0)
    running = admit(core, e2e_ms=60_000)
    queued = admit(core, e2e_ms=60_000)
    core.on_pull("a-gpu0", 1)
    [order] = core.next_dispatches(0.0)  # the first in EDF order (same deadline: seq)
    requests, instances = core.begin_plan()
    assert {r.request_id for r in requests} == {queued.request_id}
    with pytest.raises(RuntimeError):
        core.begin_plan()  # one at a time
    places = policy.places
    # meanwhile: an arrival waits unassigned, a result is judged but not yet learned from
    late = admit(core, e2e_ms=1_000)
    assert late.instance_id is None and core.unassigned == [late.request_id]
    done = core.complete(
        Completion(
            agent_id="a",
            instance_id="a-gpu0",
            dispatch_id=order.dispatch_id,
            request_id=order.tracked.request_id,
            output_token_ids=[1, 2, 3],
            output_text="",
            finish_reason="length",
            prompt_tokens=8,
            started_at=0.0,
            first_token_at=0.1,
            finished_at=0.2,
        )
    )
    assert done is not None and policy.observed == [] and policy.places == places
    plan = policy.plan(requests, instances, 1.0)  # what the worker thread computes
    core.adopt_plan(plan, now=1.0)
    assert not core.planning and policy.observed == [3]
    assert late.instance_id == "a-gpu0" and queued.instance_id == "a-gpu0"
    # EDF: the urgent arrival goes ahead of the plan's request once placed
    assert list(core.instances["a-gpu0"].queue) == [late.request_id, queued.request_id]
    assert running.request_id == order.tracked.request_id


def _serving(status_update: dict[str, object], n: int = 2) -> Heartbeat:
    """``n`` instances with mistral-7b active, each status updated with ``status_update``."""
    hb = heartbeat("a", n)
    update = {"active_model": "mistral-7b", **status_update}
    return hb.model_copy(update={"instances": [s.model_copy(update=update) for s in hb.instances]})


def test_an_arrival_during_a_plan_starts_at_once_where_a_batch_slot_is_free() -> None:
    """While a plan is computed elsewhere an arrival that would start at once (an instance of
    its model with credit, a free batch slot and nothing queued) is sent there without the
    policy; one that would wait is placed by the policy once the plan is in."""
    policy = _CountingEDF()
    core = CoordinatorCore(policy, heartbeat_timeout_s=3.0)
    core.on_heartbeat(_serving({}), now=0.0)
    core.on_pull("a-gpu1", 1)
    requests, instances = core.begin_plan()
    places = policy.places
    now_ = admit(core, e2e_ms=60_000)
    assert now_.instance_id == "a-gpu1" and core.unassigned == []
    later = admit(core, e2e_ms=1_000)  # a-gpu0 has no credit, a-gpu1 holds one queued
    assert later.instance_id is None and core.unassigned == [later.request_id]
    [order] = core.next_dispatches(0.1)
    assert order.tracked is now_ and order.instance_id == "a-gpu1"
    assert policy.places == places
    core.adopt_plan(policy.plan(requests, instances, 0.2), now=0.2)
    assert policy.places == places + 1 and later.instance_id is not None
    assert now_.state == TrackState.DISPATCHED and core.unassigned == []
    assert core.plan_arrivals == {"started": 1, "waited": 1}


def test_an_aborted_plan_hands_an_arrival_still_queued_in_a_free_slot_to_the_policy() -> None:
    policy = _CountingEDF()
    core = CoordinatorCore(policy, heartbeat_timeout_s=3.0)
    core.on_heartbeat(_serving({}, n=1), now=0.0)
    core.on_pull("a-gpu0", 1)
    core.begin_plan()
    sent = admit(core, e2e_ms=60_000)
    assert sent.instance_id == "a-gpu0" and policy.places == 0
    core.abort_plan(now=0.1)  # before any pump: the policy places it, with its own key
    assert policy.places == 1 and list(core.instances["a-gpu0"].queue) == [sent.request_id]
    other = admit(core, e2e_ms=1_000)  # keys of one policy compare: EDF puts it first
    assert list(core.instances["a-gpu0"].queue) == [other.request_id, sent.request_id]


@pytest.mark.parametrize(
    ("status", "running", "why"),
    [
        ({"waiting": 1}, 0, "the engine's own queue holds work"),
        ({"active_model": "vicuna-13b"}, 0, "another model is active"),
        ({"active_model": None}, 0, "no model is active"),
        ({"max_in_engine": 1}, 1, "its batch cap is full"),
        ({}, 256, "every batch slot is taken"),
    ],
)
def test_an_arrival_during_a_plan_waits_where_it_would_not_start_at_once(
    status: dict[str, object], running: int, why: str
) -> None:
    core = CoordinatorCore(_CountingEDF(), heartbeat_timeout_s=3.0)
    core.on_heartbeat(_serving(status, n=1), now=0.0)
    inst = core.instances["a-gpu0"]
    inst.running.update({f"r{k}": f"d{k}" for k in range(running)})
    core.on_pull("a-gpu0", 1)
    core.begin_plan()
    arrival = admit(core, e2e_ms=60_000)
    assert arrival.instance_id is None and core.unassigned == [arrival.request_id], why
    assert core.next_dispatches(0.1) == []


def test_an_aborted_plan_hands_the_policy_back() -> None:
    policy = _CountingEDF()
    core = CoordinatorCore(policy, heartbeat_timeout_s=3.0)
    core.on_heartbeat(heartbeat("a", 1), now=0.0)
    core.begin_plan()
    waiting = admit(core)
    assert waiting.instance_id is None
    core.abort_plan(now=1.0)
    assert not core.planning and waiting.instance_id == "a-gpu0"


class _StaleAfterDeadline(EDFPolicy):
    """EDF whose keys go stale once the deadline passed: such a request moves to the back.
    A policy returning a stale key again would loop; the queue asks each request once."""

    def __init__(self, *, endless: bool = False) -> None:
        self.endless = endless
        self.asked: list[str] = []

    def stale_key(self, request, key, instance_id, now):  # type: ignore[no-untyped-def]
        self.asked.append(request.request_id)
        if key[0] == "late" and not self.endless:
            return None
        if request.deadline is not None and request.deadline < now:
            return ("late", request.seq)
        return None

    def sort_key(self, request):  # type: ignore[no-untyped-def]
        return ("due", *super().sort_key(request))


def test_a_head_whose_key_went_stale_moves_before_it_is_dispatched() -> None:
    for endless in (False, True):
        policy = _StaleAfterDeadline(endless=endless)
        core = CoordinatorCore(policy, heartbeat_timeout_s=3.0)
        core.on_heartbeat(heartbeat("a", 1), now=0.0)
        missed = admit(core, e2e_ms=1_000, submitted_at=0.0)
        fresh = admit(core, e2e_ms=50_000, submitted_at=0.0)
        core.on_pull("a-gpu0", 1)
        [order] = core.next_dispatches(5.0)
        assert order.tracked is fresh  # the missed head moved behind it
        assert policy.asked[:2] == [missed.request_id, fresh.request_id]
        core.on_pull("a-gpu0", 1)
        [order] = core.next_dispatches(6.0)
        assert order.tracked is missed and core.queue_depths() == {"a-gpu0": 0}


def test_no_stale_key_is_asked_while_a_plan_runs_elsewhere() -> None:
    """A plan computed in another thread owns the policy until it is adopted: heads are
    dispatched in their queue's order meanwhile, and asked again afterwards."""
    policy = _StaleAfterDeadline()
    core = CoordinatorCore(policy, heartbeat_timeout_s=3.0)
    core.on_heartbeat(heartbeat("a", 1), now=0.0)
    missed = admit(core, e2e_ms=1_000, submitted_at=0.0)
    fresh = admit(core, e2e_ms=50_000, submitted_at=0.0)
    core.begin_plan()
    core.on_pull("a-gpu0", 1)
    [order] = core.next_dispatches(5.0)
    assert order.tracked is missed and policy.asked == []
    core.abort_plan(5.0)
    core.on_pull("a-gpu0", 1)
    [order] = core.next_dispatches(6.0)
    assert order.tracked is fresh and policy.asked == [fresh.request_id]


def test_a_task_calls_plan_view_says_its_deadline_is_derived() -> None:
    """A call of a task chain with a task SLA gets its deadline from the task's (qlm/chains.py):
    its plan view says so, so that a policy does not take the task's slack for the call's
    (the qlm planner's class lanes); a plain request's deadline is its own."""
    from qlm.types import TaskInfo

    core = core_with({"a": 1})
    plain = admit(core)
    req = make_request(e2e_ms=100_000).model_copy(
        update={"task": TaskInfo(task_id="t", task_slo_ms=60_000, remaining_ms=20_000)}
    )
    chained, outcome = core.admit(req, object(), reply_to="r", correlation_id="c", received_at=0.0)
    assert outcome == "new"
    assert not plain.plan_view.derived_deadline
    assert chained.plan_view.derived_deadline
    assert chained.plan_view.deadline == pytest.approx(40.0)
