"""Load-balancing baselines: round-robin and (seeded) random placement, FCFS inside a queue.

Both ignore SLOs and queued work; they are the "no policy" end of the comparison. Neither
needs more than O(instances) per placement.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qlm.policy import Plan, PlanInstance, PlanRequest, QueuePolicy

Picker = Callable[[PlanRequest, list[PlanInstance]], str]


def _eligible(request: PlanRequest, instances: Sequence[PlanInstance]) -> list[PlanInstance]:
    # Sorted by id so the choice does not depend on the order the caller lists instances in.
    return sorted((i for i in instances if i.serves(request.model)), key=lambda i: i.instance_id)


class _FCFSOrder(QueuePolicy):
    """FCFS inside each queue; subclasses only say which eligible instance a request gets."""

    def sort_key(self, request: PlanRequest) -> tuple[Any, ...]:
        return (request.arrival_time, request.seq)

    def _plan_with(
        self, pick: Picker, requests: Sequence[PlanRequest], instances: Sequence[PlanInstance]
    ) -> Plan:
        queues: dict[str, list[str]] = {i.instance_id: [] for i in instances}
        unassigned: list[str] = []
        eligible_by_model: dict[str, list[PlanInstance]] = {}
        for req in sorted(requests, key=lambda r: (self.sort_key(r), r.request_id)):
            eligible = eligible_by_model.get(req.model)
            if eligible is None:
                eligible = eligible_by_model[req.model] = _eligible(req, instances)
            if not eligible:
                unassigned.append(req.request_id)
                continue
            queues[pick(req, eligible)].append(req.request_id)
        return Plan(queues=queues, unassigned=unassigned, policy=self.name)

    @staticmethod
    def _place_with(
        pick: Picker, request: PlanRequest, instances: Sequence[PlanInstance]
    ) -> str | None:
        eligible = _eligible(request, instances)
        return pick(request, eligible) if eligible else None


class RoundRobinPolicy(_FCFSOrder):
    """Each model's requests cycle over the instances that serve it, in instance-id order.

    ``place`` keeps one cursor per model (the only state: placements are deterministic given
    the sequence of calls). ``plan`` starts fresh cursors and walks requests in FCFS order, so
    a replan is a pure function of its inputs.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor: dict[str, int] = {}

    @staticmethod
    def _cycler(cursor: dict[str, int]) -> Picker:
        def pick(request: PlanRequest, eligible: list[PlanInstance]) -> str:
            k = cursor.get(request.model, 0)
            cursor[request.model] = k + 1
            return eligible[k % len(eligible)].instance_id

        return pick

    def plan(
        self, requests: Sequence[PlanRequest], instances: Sequence[PlanInstance], now: float
    ) -> Plan:
        return self._plan_with(self._cycler({}), requests, instances)

    def place(
        self,
        request: PlanRequest,
        instances: Sequence[PlanInstance],
        load: Mapping[str, float],
        now: float,
    ) -> str | None:
        return self._place_with(self._cycler(self._cursor), request, instances)


class RandomPolicy(_FCFSOrder):
    """A uniformly random eligible instance per request, FCFS inside each queue.

    "Random" is a seeded hash of the request id (CRC-32 of ``"<seed>:<request_id>"``), so the
    choice is reproducible under a seed, stateless, independent of call order, and the same in
    ``place`` and ``plan``.
    """

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def _pick(self, request: PlanRequest, eligible: list[PlanInstance]) -> str:
        h = zlib.crc32(f"{self.seed}:{request.request_id}".encode())
        return eligible[h % len(eligible)].instance_id

    def plan(
        self, requests: Sequence[PlanRequest], instances: Sequence[PlanInstance], now: float
    ) -> Plan:
        return self._plan_with(self._pick, requests, instances)

    def place(
        self,
        request: PlanRequest,
        instances: Sequence[PlanInstance],
        load: Mapping[str, float],
        now: float,
    ) -> str | None:
        return self._place_with(self._pick, request, instances)
