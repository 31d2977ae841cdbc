"""Multi-call task chains (CATO): a call's deadline derived from its task's.

An agentic task (a coding agent, a tool-using assistant) is a chain of LLM calls, and what the
user feels is the whole chain's latency. A call that carries ``task`` (docs/protocol.md) names
its task's SLA (``task_slo_ms``, counted from ``task_started_at``) and, in ``remaining_ms``, the
expected time of the steps after it (the producer's profile of its own pipeline; 0 or absent
for the last step). The call must then be done by

    call deadline = task start + task SLA - remaining_ms

(CATO splits the task SLA over the profiled step times in the same way), or by its own
``slo.e2e_ms`` if that is earlier. Its slack is that deadline minus now.

A call whose deadline has already passed when it arrives belongs to a late task. What to do
with it is a rule (``QLM_LATE_TASK_RULE``):

* ``promote`` (CATO): keep the passed deadline - earliest of all, so deadline-aware policies
  serve it first - and raise its priority, to limit the damage to the task;
* ``demote`` (SABER): drop its deadlines: it is served as best effort, after every request that
  can still make its deadline.

Either way its SLO outcome is still judged against the derived deadline. Without
``task_slo_ms`` (a chain step with no task SLA) a call keeps its own SLO: documented default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qlm.types import RequestMessage

LateTaskRule = Literal["promote", "demote"]
PROMOTED_PRIORITY = 9  # the protocol's highest


@dataclass(frozen=True)
class CallDeadlines:
    """What the planner sees for one call: absolute deadlines (unix s) and priority."""

    deadline: float | None  # end to end
    ttft_deadline: float | None
    priority: int
    task_deadline: float | None = None  # the whole task's, when the call belongs to one
    late: bool = False  # its task was already late when it arrived
    judged_deadline: float | None = None  # what its SLO outcome is judged against


def call_deadlines(
    request: RequestMessage, submitted: float, rule: LateTaskRule = "promote"
) -> CallDeadlines:
    slo = request.slo
    task = request.task
    return chain_deadlines(
        submitted,
        e2e_s=slo.e2e_ms / 1000 if slo.e2e_ms else None,
        ttft_s=slo.ttft_ms / 1000 if slo.ttft_ms else None,
        priority=request.priority,
        task_slo_s=task.task_slo_ms / 1000 if task and task.task_slo_ms else None,
        task_started_at=task.task_started_at if task else None,
        remaining_s=(task.remaining_ms or 0) / 1000 if task else 0.0,
        rule=rule,
    )


def chain_deadlines(
    submitted: float,
    *,
    e2e_s: float | None,
    ttft_s: float | None,
    priority: int = 0,
    task_slo_s: float | None = None,
    task_started_at: float | None = None,
    remaining_s: float = 0.0,
    rule: LateTaskRule = "promote",
) -> CallDeadlines:
    """:func:`call_deadlines` on plain numbers (seconds; any clock, as long as ``submitted``
    and ``task_started_at`` share it): the live coordinator and the simulator both use it."""
    own = submitted + e2e_s if e2e_s else None
    ttft = submitted + ttft_s if ttft_s else None
    if task_slo_s is None:
        return CallDeadlines(own, ttft, priority, judged_deadline=own)
    started = task_started_at if task_started_at is not None else submitted
    task_deadline = started + task_slo_s
    derived = task_deadline - remaining_s
    deadline = derived if own is None else min(own, derived)
    if deadline > submitted:
        return CallDeadlines(deadline, ttft, priority, task_deadline, False, deadline)
    if rule == "promote":
        return CallDeadlines(deadline, ttft, PROMOTED_PRIORITY, task_deadline, True, deadline)
    return CallDeadlines(None, None, priority, task_deadline, True, deadline)


def is_last_step(request: RequestMessage) -> bool:
    """The call that ends its task: nothing expected after it."""
    return request.task is not None and not request.task.remaining_ms
