"""The no-queue-manager baseline: vLLM behind a load balancer.

What a platform team runs today without qlm: every request is handed to an engine the moment
it arrives, to the instance serving its model with the fewest requests in flight (a
least-outstanding-requests balancer, as llm-d's and most gateways' default), and the engine
decides the rest: its FCFS waiting queue, admission as the KV cache allows, preemption by
recompute under KV pressure (vLLM V1). Nothing waits in a virtual queue, so there is no order
to plan and no SLO is looked at.

Choose it to measure what a queue manager adds; never to serve.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qlm.policy import PlanInstance, PlanRequest, QueuePolicy


class VLLMDirectPolicy(QueuePolicy):
    name = "vllm"
    dispatch_at_arrival = True

    def sort_key(self, request: PlanRequest) -> tuple[Any, ...]:
        return (request.arrival_time, request.seq)

    def choose_instance(
        self,
        request: PlanRequest,
        instances: Sequence[PlanInstance],
        load: Mapping[str, float],
    ) -> PlanInstance | None:
        """Fewest requests in flight among the instances serving the model. Queued work
        comes first only so that a whole plan (a membership change) still spreads: with
        dispatch at arrival nothing stays queued, and the balancer sees in-flight counts."""
        eligible = [i for i in instances if i.serves(request.model)]
        if not eligible:
            return None
        return min(eligible, key=lambda i: (load.get(i.instance_id, 0.0), i.running, i.instance_id))
