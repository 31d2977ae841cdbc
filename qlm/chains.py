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
    own = submitted + slo.e2e_ms / 1000 if slo.e2e_ms else None
    ttft = submitted + slo.ttft_ms / 1000 if slo.ttft_ms else None
    task = request.task
    if task is None or task.task_slo_ms is None:
        return CallDeadlines(own, ttft, request.priority, judged_deadline=own)
    started = task.task_started_at if task.task_started_at is not None else submitted
    task_deadline = started + task.task_slo_ms / 1000
    derived = task_deadline - (task.remaining_ms or 0) / 1000
    deadline = derived if own is None else min(own, derived)
    if deadline > submitted:
        return CallDeadlines(deadline, ttft, request.priority, task_deadline, False, deadline)
    if rule == "promote":
        return CallDeadlines(deadline, ttft, PROMOTED_PRIORITY, task_deadline, True, deadline)
    return CallDeadlines(None, None, request.priority, task_deadline, True, deadline)


def is_last_step(request: RequestMessage) -> bool:
    """The call that ends its task: nothing expected after it."""
    return request.task is not None and not request.task.remaining_ms
