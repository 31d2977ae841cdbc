"""Completion judgement: whether a finished call met its SLO, on plain numbers (seconds).

The one set of rules for the live coordinator (``Coordinator._complete``) and the simulator
(``ClusterSimulator._result``), so that a published figure judges a request exactly as a
producer's reply does. Everything here works on plain numbers of one clock (unix seconds live,
virtual seconds in the simulator); the comparisons are spans against budgets (``finished -
submitted <= budget``), the form the simulator's figures were always computed in.
"""

from __future__ import annotations

from qlm.types import SLOOutcome


def first_token_time(reported: float | None, earlier: float | None) -> float | None:
    """When the call's first token came, across its attempts: the earliest. An attempt that
    was evicted after producing tokens already streamed the first token to the producer; the
    attempt that finishes it reports its own, later one (``reported``)."""
    if earlier is None:
        return reported
    if reported is None:
        return earlier
    return min(reported, earlier)


def task_met(task_started_at: float, finished_at: float, task_slo_s: float | None) -> bool:
    """Whether a task (a chain, or a program of calls) met its SLA: its last call finished
    within ``task_slo_s`` of the task's start. A task without an SLA always meets it."""
    return task_slo_s is None or finished_at - task_started_at <= task_slo_s


def slo_outcome(
    submitted_at: float,
    first_token_at: float | None,
    finished_at: float,
    output_tokens: int = 0,
    *,
    e2e_slo_s: float | None = None,
    ttft_slo_s: float | None = None,
    tbt_slo_s: float | None = None,
    judged_deadline: float | None = None,
    task_started_at: float | None = None,
    task_slo_s: float | None = None,
) -> SLOOutcome:
    """The SLO outcome of a finished call.

    * end to end: within ``e2e_slo_s`` of submission; a call whose deadline is derived (a step
      of a task chain, a call of a collective stage: ``CallDeadlines.judged_deadline``) is
      judged against that deadline instead of its own SLO;
    * time to first token: ``first_token_at`` (the earliest across attempts, see
      :func:`first_token_time`) within ``ttft_slo_s``; no first token is a miss;
    * time between tokens (streaming): the mean gap after the first token, stalls from
      evictions included, at most ``tbt_slo_s``; not judged for a single token;
    * the task: given ``task_started_at`` (only for the call that ends its task), whether the
      whole task met ``task_slo_s`` (:func:`task_met`).

    ``met`` is every judged part met."""
    e2e_s = finished_at - submitted_at
    budget = e2e_slo_s if judged_deadline is None else judged_deadline - submitted_at
    e2e_met = None if budget is None else e2e_s <= budget
    ttft_s = None if first_token_at is None else first_token_at - submitted_at
    ttft_met = None
    if ttft_slo_s is not None:
        ttft_met = ttft_s is not None and ttft_s <= ttft_slo_s
    tbt_s = tbt_met = None
    if first_token_at is not None and output_tokens > 1:
        tbt_s = (finished_at - first_token_at) / (output_tokens - 1)
        if tbt_slo_s is not None:
            tbt_met = tbt_s <= tbt_slo_s
    judged_task = None
    if task_started_at is not None and task_slo_s is not None:
        judged_task = task_met(task_started_at, finished_at, task_slo_s)
    return SLOOutcome(
        met=all(x for x in (e2e_met, ttft_met, tbt_met) if x is not None),
        e2e_met=e2e_met,
        ttft_met=ttft_met,
        e2e_ms=e2e_s * 1000,
        ttft_ms=None if ttft_s is None else ttft_s * 1000,
        tbt_met=tbt_met,
        tbt_ms=None if tbt_s is None else tbt_s * 1000,
        task_met=judged_task,
    )
