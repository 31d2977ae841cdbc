"""Load-balancing baselines: round-robin, (seeded) random placement and power-of-two choices,
FCFS inside a queue.

All ignore SLOs; round-robin and random also ignore queued work (the "no policy" end of the
comparison), power-of-two looks at the queues of two sampled instances only (Ray Serve's
router, CATO's strongest baseline). None needs more than O(instances) per placement.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qlm.policy import Plan, PlanInstance, PlanRequest, QueuePolicy, token_rate

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
    keeps_state = "one cursor per model (place advances it)"

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


class PowerOfTwoPolicy(_FCFSOrder):
    """Ray Serve's power-of-two-choices router: two distinct eligible instances sampled at
    random, the request goes to the one with less queued work, FCFS inside each queue.

    Queued work is counted in seconds of the instance's token throughput for the model (the
    ``load`` the caller keeps, in tokens, over :func:`qlm.policy.token_rate`), then the number
    of running requests breaks ties: the simulated agents pull while their engine has room, so
    queues are often empty and the running count is then Ray Serve's "ongoing requests".

    The two samples come from a generator seeded with ``"<seed>:<request_id>"``: reproducible
    under a seed, independent of call order and of the order instances are listed in, and the
    same in ``place`` and ``plan``. ``plan`` walks requests in FCFS order and counts the work
    it has assigned so far, as a replay of ``place`` over empty queues would.
    """

    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def candidates(self, request: PlanRequest, eligible: list[PlanInstance]) -> list[PlanInstance]:
        """The two instances (all of them when there are at most two) a request chooses from."""
        if len(eligible) <= 2:
            return eligible
        # str seeds are hashed with SHA-512 by random.Random: well mixed even for ids that
        # differ in one digit, unlike a CRC taken modulo a small instance count
        rng = random.Random(f"{self.seed}:{request.request_id}")
        first, second = rng.sample(range(len(eligible)), 2)
        return [eligible[first], eligible[second]]

    def _less_loaded(self, load: Mapping[str, float]) -> Picker:
        def pick(request: PlanRequest, eligible: list[PlanInstance]) -> str:
            best = min(
                self.candidates(request, eligible),
                key=lambda i: (
                    load.get(i.instance_id, 0.0) / token_rate(i.gpu_type, request.model),
                    i.running,
                    i.instance_id,
                ),
            )
            return best.instance_id

        return pick

    def plan(
        self, requests: Sequence[PlanRequest], instances: Sequence[PlanInstance], now: float
    ) -> Plan:
        assigned: dict[str, float] = {i.instance_id: 0.0 for i in instances}
        choose = self._less_loaded(assigned)

        def pick_and_count(request: PlanRequest, eligible: list[PlanInstance]) -> str:
            target = choose(request, eligible)
            assigned[target] += self.work_tokens(request)
            return target

        return self._plan_with(pick_and_count, requests, instances)

    def place(
        self,
        request: PlanRequest,
        instances: Sequence[PlanInstance],
        load: Mapping[str, float],
        now: float,
    ) -> str | None:
        return self._place_with(self._less_loaded(load), request, instances)
