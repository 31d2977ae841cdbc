"""Baseline ordering policies: FCFS and EDF (the paper's comparison points, §8)."""

from __future__ import annotations

from typing import Any

from qlm.policy import PlanRequest, QueuePolicy


class FCFSPolicy(QueuePolicy):
    """First come, first served: the order vLLM itself applies. Ignores SLOs entirely."""

    name = "fcfs"

    def sort_key(self, request: PlanRequest) -> tuple[Any, ...]:
        return (request.arrival_time, request.seq)


class EDFPolicy(QueuePolicy):
    """Earliest deadline first over the tighter of the e2e and TTFT deadlines; requests without
    a deadline go last, in arrival order."""

    name = "edf"

    def sort_key(self, request: PlanRequest) -> tuple[Any, ...]:
        return (request.effective_deadline, request.arrival_time, request.seq)
