"""A streamed request whose agent is lost resumes after the tokens its producer received (the
coordinator's stream tap, CoordinatorCore.on_streamed), not from scratch: a sampled answer
run again would contradict what the producer already shows."""

from __future__ import annotations

from qlm.control import Completion
from qlm.coordinator.core import CoordinatorCore, TrackState
from tests.builders import heartbeat, make_completion
from tests.unit.test_coordinator_core import _dispatched, _evicted, core_with, report_of


def streaming_core(**kw):  # type: ignore[no-untyped-def]
    core = core_with({"a": 1, "b": 1})
    t, order = _dispatched(core, stream=True, **kw)
    return core, t, order


def test_a_lost_attempt_resumes_after_what_its_producer_received() -> None:
    core, t, order = streaming_core(prompt_len=16, max_tokens=10)
    assert core.on_streamed(t.request_id, 0, [11, 12], attempt=1)
    assert core.on_streamed(t.request_id, 2, [13], attempt=1)
    moved = core.lose_agent(order.agent_id, "connection_closed", now=5.0)
    assert moved == [t] and t.state == TrackState.QUEUED
    assert t.resume_token_ids == [11, 12, 13] and t.first_token_at == 5.0
    assert core.stream_resumes == 1
    assert (t.plan_view.prompt_tokens, t.plan_view.max_tokens) == (19, 7)
    other = next(iid for iid in core.instances if iid != order.instance_id)
    core.on_pull(other, 1)
    [again] = core.next_dispatches(6.0)
    assert again.tracked is t and t.attempts == 2 and t.resume_token_ids == [11, 12, 13]


def test_the_producer_s_rule_decides_what_counts_as_received() -> None:
    core, t, order = streaming_core(max_tokens=10)
    rid = t.request_id
    # a chunk past a gap is held, as the producer holds it, until the gap fills
    assert core.on_streamed(rid, 2, [3, 4], attempt=1)
    assert core.on_streamed(rid, 0, [1, 2], attempt=1)
    # a repeated or overlapping chunk adds only its new tail
    assert core.on_streamed(rid, 3, [4, 5], attempt=1)
    core.lose_agent(order.agent_id, "goodbye", now=1.0)
    assert t.resume_token_ids == [1, 2, 3, 4, 5]


def test_chunks_that_arrive_after_the_loss_count_at_the_next_dispatch() -> None:
    core, t, order = streaming_core(max_tokens=10)
    core.on_streamed(t.request_id, 0, [1], attempt=1)
    core.lose_agent(order.agent_id, "connection_closed", now=1.0)
    assert t.resume_token_ids == [1]
    core.on_streamed(t.request_id, 1, [2, 3], attempt=1)  # routed before the loss, read after
    other = next(iid for iid in core.instances if iid != order.instance_id)
    core.on_pull(other, 1)
    [again] = core.next_dispatches(2.0)
    assert t.resume_token_ids == [1, 2, 3] and t.plan_view.max_tokens == 7
    assert core.stream_resumes == 1  # one lost attempt, counted once


def test_an_eviction_report_stays_the_resume_point_when_it_has_more() -> None:
    core, t, order = streaming_core(max_tokens=10)
    core.on_streamed(t.request_id, 0, [1, 2], attempt=1)
    core.on_evicted(_evicted(order, [1, 2, 3, 4]), now=1.0)
    assert t.resume_token_ids == [1, 2, 3, 4]
    core.on_pull(t.instance_id, 1)
    core.next_dispatches(2.0)
    assert t.resume_token_ids == [1, 2, 3, 4]  # the shorter stream does not shorten it


def test_at_least_one_token_is_left_to_generate() -> None:
    core, t, order = streaming_core(max_tokens=4)
    core.on_streamed(t.request_id, 0, [1, 2, 3, 4], attempt=1)
    core.lose_agent(order.agent_id, "connection_closed", now=1.0)
    assert t.resume_token_ids == [1, 2, 3] and t.plan_view.max_tokens == 1


def test_chunks_that_cannot_be_the_producer_s_are_not_taken() -> None:
    core, t, order = streaming_core(max_tokens=4)
    # a request not tracked: kept for its redelivery (a takeover), not a tracked stream
    assert core.on_streamed("nobody", 0, [1], attempt=1)
    assert core.untracked_streams["nobody"].token_ids == [1]
    assert not core.on_streamed(t.request_id, 2, [1, 2, 3], attempt=1)  # beyond max_tokens
    plain, plain_order = _dispatched(core, max_tokens=4)
    assert not core.on_streamed(plain.request_id, 0, [1], attempt=1)  # it does not stream
    assert core.accept_result(t.request_id, order.dispatch_id) is t
    assert not core.on_streamed(t.request_id, 0, [1], attempt=1)  # being answered
    assert t.streamed is None and plain.streamed is None


def test_a_stream_that_contradicts_the_resume_point_leaves_it_alone() -> None:
    core, t, order = streaming_core(max_tokens=10)
    core.on_evicted(_evicted(order, [7, 8]), now=1.0)
    core.on_streamed(t.request_id, 0, [1, 2, 3], attempt=1)  # not what the engine reported
    core.on_pull(t.instance_id, 1)
    [again] = core.next_dispatches(2.0)
    moved = core.lose_agent(again.agent_id, "connection_closed", now=3.0)
    assert moved == [t] and t.resume_token_ids == [7, 8]


def test_a_lost_request_without_a_stream_starts_again_as_before() -> None:
    core = core_with({"a": 1, "b": 1})
    t, order = _dispatched(core, max_tokens=10)
    assert isinstance(core, CoordinatorCore)
    core.lose_agent(order.agent_id, "connection_closed", now=1.0)
    assert t.resume_token_ids == [] and t.plan_view.max_tokens == 10
    assert core.stream_resumes == 0


def test_a_stream_whose_end_was_streamed_is_not_resumed_after_it() -> None:
    # the engine finished it and its producer may hold the whole answer (an agent streams an
    # end only once its result is confirmed; the coordinator has not consumed it yet):
    # resuming after the end would generate past it, so it waits from its last resume point
    core, t, order = streaming_core(max_tokens=10)
    core.on_streamed(t.request_id, 0, [1, 2, 3], attempt=1)
    core.on_stream_end(t.request_id)
    core.on_stream_end("nobody")  # a request it does not track: nothing
    core.lose_agent(order.agent_id, "connection_closed", now=1.0)
    assert t.resume_token_ids == [] and core.stream_resumes == 0


def _completion(order, ids: list[int]) -> Completion:  # type: ignore[no-untyped-def]
    return make_completion(**report_of(order, ids))


def _lost_and_resumed(core: CoordinatorCore, t, order):  # type: ignore[no-untyped-def]
    """The agent was declared lost after streaming [1, 2]; the request resumed elsewhere."""
    core.on_streamed(t.request_id, 0, [1, 2], attempt=1)
    core.lose_agent(order.agent_id, "heartbeat_timeout", now=1.0)
    other = next(iid for iid in core.instances if iid != order.instance_id)
    core.on_pull(other, 1)
    [again] = core.next_dispatches(2.0)
    return again


def test_a_late_result_that_contradicts_the_stream_is_refused() -> None:
    # the old agent woke and finished its attempt after the new one had streamed other tokens
    core, t, order = streaming_core(max_tokens=10)
    again = _lost_and_resumed(core, t, order)
    core.on_streamed(t.request_id, 2, [7, 8], attempt=2)
    assert core.complete(_completion(order, [1, 2, 3, 4])) is None
    assert t.state == TrackState.DISPATCHED and core.late_results_refused == 1
    # the attempt that replaced it answers, and its result is the stream
    done = core.complete(_completion(again, [1, 2, 7, 8, 9]))
    assert done is not None and done[0] is t and t.state == TrackState.ANSWERING


def test_a_late_result_that_agrees_with_the_stream_is_taken() -> None:
    # the new attempt streamed nothing new yet: the producer holds a prefix of the late result
    core, t, order = streaming_core(max_tokens=10)
    _lost_and_resumed(core, t, order)
    done = core.complete(_completion(order, [1, 2, 3, 4]))
    assert done is not None and t.state == TrackState.ANSWERING
    assert core.late_results_refused == 0


def test_the_current_attempt_s_result_is_always_taken() -> None:
    # nothing else would answer it: a mismatch with the stream is logged by the producer's
    # reassembler, not turned into a request that never ends
    core, t, order = streaming_core(max_tokens=10)
    core.on_streamed(t.request_id, 0, [1, 2], attempt=1)
    done = core.complete(_completion(order, [5, 6]))
    assert done is not None and core.late_results_refused == 0


def test_a_woken_agent_s_replaced_streamed_attempt_is_stopped() -> None:
    # the agent was declared lost and its streamed request runs on b; when a comes back still
    # running the old attempt (its stream fenced, its result refused), that attempt is stopped
    core, t, order = streaming_core(max_tokens=10)
    again = _lost_and_resumed(core, t, order)
    core.on_heartbeat(heartbeat(order.agent_id, in_flight=(t.request_id,)), now=3.0)
    [stale] = core.take_stale_attempts()
    assert (stale.instance_id, stale.request_id, stale.dispatch_id) == (
        order.instance_id,
        t.request_id,
        order.dispatch_id,
    )
    assert again.instance_id != order.instance_id and t.dispatch_id == again.dispatch_id
    core.on_heartbeat(heartbeat(order.agent_id, in_flight=(t.request_id,)), now=3.5)
    assert core.take_stale_attempts() == [] and core.stale_attempts_stopped == 1  # once


def test_a_replaced_attempt_without_a_stream_runs_on_until_its_request_is_answered() -> None:
    core = core_with({"a": 1, "b": 1})
    t, order = _dispatched(core, max_tokens=10)
    core.lose_agent(order.agent_id, "heartbeat_timeout", now=1.0)
    back = heartbeat(order.agent_id, in_flight=(t.request_id,))
    core.on_heartbeat(back, now=2.0)  # back before it ran again: nothing to stop
    assert core.take_stale_attempts() == []
    core.on_pull(next(iid for iid in core.instances if iid != order.instance_id), 1)
    [again] = core.next_dispatches(2.5)
    core.on_heartbeat(back, now=3.0)
    assert core.take_stale_attempts() == []  # both run: the first result answers, as before
    assert core.complete(_completion(again, [1, 2])) is not None
    core.on_heartbeat(back, now=3.5)  # answered: what still runs of it is waste
    [stale] = core.take_stale_attempts()
    assert (stale.request_id, stale.dispatch_id) == (t.request_id, order.dispatch_id)


def test_an_attempt_the_woken_agent_no_longer_runs_is_forgotten() -> None:
    core, t, order = streaming_core(max_tokens=10)
    core.lose_agent(order.agent_id, "heartbeat_timeout", now=1.0)
    assert core.instances[order.instance_id].orphans == {t.request_id: order.dispatch_id}
    core.on_heartbeat(heartbeat(order.agent_id), now=2.0)
    assert not core.instances[order.instance_id].orphans
    assert core.take_stale_attempts() == []
