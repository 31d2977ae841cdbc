"""Task chains (CATO) and SLO classes: a call's deadline from its task's SLA, the late-task
rules, and - over the real broker with a real coordinator and agent - TTFT-only requests, chain
steps and late tasks answered with the targets each met."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from qlm.chains import PROMOTED_PRIORITY, call_deadlines, is_last_step
from qlm.client import QlmClient
from qlm.coordinator.core import CoordinatorCore
from qlm.planner import create_policy
from qlm.types import SLO, ErrorMessage, RequestMessage, ResultMessage, TaskInfo
from tests.builders import heartbeat
from tests.e2e import running_cluster

NOW = 1_000.0


def call(
    rid: str = "c",
    *,
    e2e_ms: int | None = 60_000,
    ttft_ms: int | None = None,
    tbt_ms: int | None = None,
    task: TaskInfo | None = None,
    max_tokens: int = 16,
) -> RequestMessage:
    return RequestMessage(
        request_id=rid,
        model="mistral-7b",
        prompt_token_ids=list(range(1, 33)),
        max_tokens=max_tokens,
        slo=SLO(e2e_ms=e2e_ms, ttft_ms=ttft_ms, tbt_ms=tbt_ms),
        task=task,
    )


# ---------------------------------------------------------------------------- deadlines


def test_a_lone_call_keeps_its_own_slo() -> None:
    due = call_deadlines(call(e2e_ms=5_000, ttft_ms=1_000), NOW)
    assert (due.deadline, due.ttft_deadline, due.task_deadline) == (NOW + 5, NOW + 1, None)


def test_a_chain_step_must_leave_time_for_the_steps_after_it() -> None:
    task = TaskInfo(task_id="t", step=1, task_slo_ms=30_000, task_started_at=NOW - 10,
                    remaining_ms=8_000)  # fmt: skip
    due = call_deadlines(call(e2e_ms=None, ttft_ms=2_000, task=task), NOW)
    assert due.task_deadline == NOW + 20
    assert due.deadline == NOW + 12  # task end less the 8 s the later steps need
    assert due.ttft_deadline == NOW + 2 and not due.late
    # its own end-to-end SLO, when earlier, wins
    assert call_deadlines(call(e2e_ms=5_000, task=task), NOW).deadline == NOW + 5


def test_a_step_without_a_task_sla_keeps_its_own_slo() -> None:
    due = call_deadlines(call(e2e_ms=7_000, task=TaskInfo(task_id="t", remaining_ms=0)), NOW)
    assert due.deadline == NOW + 7 and due.task_deadline is None


def test_late_tasks_are_promoted_or_demoted_by_the_rule() -> None:
    task = TaskInfo(task_id="t", task_slo_ms=10_000, task_started_at=NOW - 60, remaining_ms=0)
    promoted = call_deadlines(call(task=task), NOW, "promote")
    assert promoted.late and promoted.priority == PROMOTED_PRIORITY
    assert promoted.deadline == NOW - 50  # passed: earliest of all, served first by EDF
    demoted = call_deadlines(call(task=task), NOW, "demote")
    assert demoted.late and demoted.deadline is None and demoted.ttft_deadline is None
    assert demoted.judged_deadline == NOW - 50  # still judged against it
    assert is_last_step(call(task=task)) and not is_last_step(call())


def test_edf_serves_a_chain_step_by_its_derived_deadline() -> None:
    core = CoordinatorCore(create_policy("edf"), heartbeat_timeout_s=3.0)
    core.on_heartbeat(heartbeat("a"), now=NOW)
    lone = call("lone", e2e_ms=20_000)  # due at +20 s
    # a roomy 60 s own SLO, but its task must end in 15 s with 5 s of steps after it: +10 s
    chain = TaskInfo(task_id="t", task_slo_ms=15_000, task_started_at=NOW, remaining_ms=5_000)
    step = call("step", e2e_ms=60_000, task=chain)
    for r in (lone, step):
        core.admit(r, object(), reply_to="q", correlation_id=r.request_id, received_at=NOW)
    core.on_pull("a-gpu0", 2)
    assert [o.tracked.request_id for o in core.next_dispatches(NOW)] == ["step", "lone"]


def test_streaming_requests_are_judged_on_their_mean_time_between_tokens() -> None:
    from qlm.control import Completion

    core = CoordinatorCore(create_policy("edf"), heartbeat_timeout_s=3.0)
    r = call("s", e2e_ms=None, ttft_ms=2_000, tbt_ms=100)
    t, _ = core.admit(r, object(), reply_to="q", correlation_id="s", received_at=NOW)
    assert t is not None

    def judge(first: float, finished: float, tokens: int) -> Any:
        c = Completion(
            agent_id="a",
            instance_id="i",
            dispatch_id="d",
            request_id="s",
            output_token_ids=list(range(tokens)),
            output_text="",
            finish_reason="stop",
            prompt_tokens=1,
            started_at=NOW,
            first_token_at=first,
            finished_at=finished,
        )
        return core.judge_completion(t, c)

    # first token after 1 s, then 11 more over 0.55 s: 50 ms apart
    first, ok = judge(NOW + 1.0, NOW + 1.55, 12)
    assert first == NOW + 1.0
    assert ok.met and ok.ttft_met and ok.tbt_met and ok.tbt_ms == pytest.approx(50.0)
    # a 2-s stall mid-stream (an eviction) makes the mean 232 ms: missed
    _, slow = judge(NOW + 1.0, NOW + 3.55, 12)
    assert slow.ttft_met and slow.tbt_met is False and not slow.met
    assert judge(NOW + 1.0, NOW + 1.0, 1)[1].tbt_met is None
    # an evicted attempt streamed the first token at 0.5 s: it counts, not the resumed one's
    t.first_token_at = NOW + 0.5
    first, resumed = judge(NOW + 2.5, NOW + 3.05, 12)
    assert first == NOW + 0.5 and resumed.ttft_ms == pytest.approx(500.0)


def test_one_slo_judgement_on_plain_numbers() -> None:
    """The rules the live coordinator and the simulator share (qlm/coordinator/outcome.py)."""
    from qlm.coordinator.outcome import first_token_time, slo_outcome, task_met

    assert first_token_time(None, None) is None
    assert first_token_time(3.0, None) == 3.0 and first_token_time(None, 2.0) == 2.0
    assert first_token_time(3.0, 2.0) == 2.0
    on_time = slo_outcome(0.0, 0.2, 1.0, 5, e2e_slo_s=1.0, ttft_slo_s=0.2)
    assert on_time.met and on_time.e2e_met and on_time.ttft_met and on_time.tbt_met is None
    assert slo_outcome(0.0, None, 1.0, 0, ttft_slo_s=5.0).ttft_met is False
    # a chain step: judged against its derived deadline, not its own (looser) SLO
    step = slo_outcome(0.0, 0.1, 1.5, 3, e2e_slo_s=10.0, judged_deadline=1.0)
    assert step.e2e_met is False and not step.met and step.task_met is None
    last = slo_outcome(5.0, 5.1, 6.0, 3, e2e_slo_s=10.0, task_started_at=0.0, task_slo_s=5.5)
    assert last.met and last.task_met is False
    assert task_met(0.0, 9.0, None) and task_met(0.0, 2.0, 2.0) and not task_met(0.0, 2.1, 2.0)


# ---------------------------------------------------------------------------- end to end


@pytest.mark.broker
@pytest.mark.slow
async def test_ttft_classes_and_chains_end_to_end(isolated_amqp_url: str, tmp_path: Path) -> None:
    agents = [{"agent_id": "ch-a", "models": ["mistral-7b"], "time_scale": 20.0}]
    now = time.time()
    reqs = {
        "ttft": call("ttft", e2e_ms=None, ttft_ms=30_000, tbt_ms=10_000),
        "step0": call(
            "step0",
            e2e_ms=None,
            ttft_ms=30_000,
            task=TaskInfo(
                task_id="t1", step=0, task_slo_ms=120_000, task_started_at=now, remaining_ms=60_000
            ),  # fmt: skip
        ),
        "step1": call(
            "step1",
            task=TaskInfo(
                task_id="t1", step=1, task_slo_ms=120_000, task_started_at=now, remaining_ms=0
            ),  # fmt: skip
        ),
        "late": call(
            "late",
            task=TaskInfo(
                task_id="t2", step=3, task_slo_ms=10_000, task_started_at=now - 60, remaining_ms=0
            ),  # fmt: skip
        ),
    }
    async with running_cluster(isolated_amqp_url, tmp_path, agents, policy="edf") as cluster:
        async with QlmClient(isolated_amqp_url) as client:
            futures = {k: await client.submit(r) for k, r in reqs.items()}
            doc = call("bad").model_dump(mode="json", exclude_none=True)
            doc["slo"] = {"e2e_ms": 1_000, "ttft_ms": 5_000}  # first token due after the last
            bad = await client.publish_raw(json.dumps(doc).encode(), correlation_id="bad")
            replies = {k: await asyncio.wait_for(f, 60) for k, f in futures.items()}
            bad_reply = await asyncio.wait_for(bad, 60)
        coordinator_log = cluster.logs("coordinator")
    for reply in replies.values():
        assert isinstance(reply, ResultMessage)
    ttft = replies["ttft"].slo
    assert ttft.met and ttft.ttft_met and ttft.e2e_met is None and ttft.task_met is None
    assert ttft.tbt_met and ttft.tbt_ms is not None and ttft.tbt_ms > 0
    assert replies["step0"].slo.e2e_met and replies["step0"].slo.task_met is None
    assert replies["step1"].slo.task_met is True  # the last step ends the task in time
    late = replies["late"].slo
    assert late.e2e_met is False and late.task_met is False and not late.met
    assert "late_task_call" in coordinator_log
    assert isinstance(bad_reply, ErrorMessage) and bad_reply.code == "schema_violation"
    assert "ttft_ms is longer" in bad_reply.message
