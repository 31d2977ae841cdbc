"""The simulator's autoscaler driver: capacity decisions carried out in a simulated cluster.

A decision (``CapacityDecision.to_dict()``, the same JSON the command driver hands an operator's
program) changes instance counts per cell ``"model/gpu_type/pool"``. Here a +1 asks
:meth:`ClusterSimulator.add_instance` for an instance built from the cell's template, which
joins after the template's start-up time (paid for from the decision on); a −1 releases one of
the cell's instances: the newest still starting (cancelled, nothing more to pay), otherwise the
live one with the least work (it stops taking requests, its queue is placed on the others, and
it retires once what it runs has finished).

Start-up is *warm* or *cold*, as in SageServe: an instance released after it was ready is
donated to a spare (spot) pool with its weights still loaded, and a later +1 of the same cell
reclaims it in ``warm_start_s`` (SageServe: ≈ 1 min median); without a spare, a +1 pays the
cold ``startup_s`` (≈ 10 min to provision and load). Spares are not paid for (spot users
pay), and stay available for the whole run - an optimistic assumption all policies share.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import structlog

from qlm.capacity.drivers import AutoscalerDriver, DriverOutcome
from qlm.tooling.simulator.cluster import ClusterSimulator, InstanceSpec

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class InstanceTemplate:
    """How the simulator starts an instance of one cell: its engine (``spec``; the id is
    replaced), its cold start-up time in seconds (provisioning plus loading the weights) and
    its warm one (reclaiming a spare that still holds the weights)."""

    spec: InstanceSpec
    startup_s: float
    warm_start_s: float = 60.0


def parse_cell(key: str) -> tuple[str, str, str]:
    """``"model/gpu_type/pool"`` → its parts (a model name may itself contain ``/``)."""
    parts = key.rsplit("/", 2)
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"a cell is 'model/gpu_type/pool', got {key!r}")
    return parts[0], parts[1], parts[2]


class SimulatorDriver(AutoscalerDriver):
    """Applies decisions to a :class:`ClusterSimulator` at its current simulated time."""

    def __init__(
        self,
        sim: ClusterSimulator,
        templates: Mapping[str, InstanceTemplate],
        *,
        owned: Mapping[str, list[str]] | None = None,
        history: int = 100,
    ) -> None:
        super().__init__(history)
        self.sim = sim
        self.templates = dict(templates)
        # cell -> its instance ids (starting or live, not released), oldest first
        self.cells: dict[str, list[str]] = {c: list(ids) for c, ids in (owned or {}).items()}
        self._ids = itertools.count()
        self.spares: dict[str, int] = {}  # cell -> released instances still holding the model
        self._warm: set[str] = set()  # instances started from a spare
        self.decisions = 0
        self.failed = 0
        self.warm_starts = 0
        self.cold_starts = 0

    def counts(self) -> dict[str, int]:
        return {c: len(ids) for c, ids in self.cells.items() if ids}

    def apply_now(self, decision: Mapping[str, Any]) -> DriverOutcome:
        """Carry ``decision`` out at once; a cell without a template fails the whole decision
        before anything changes (a decision is applied whole or not at all)."""
        self.decisions += 1
        decision_id = str(decision.get("id") or f"sim-{self.decisions}")
        try:
            deltas = {c: int(d) for c, d in dict(decision.get("deltas") or {}).items()}
            for cell in deltas:
                parse_cell(cell)
                if cell not in self.templates:
                    raise ValueError(f"no instance template for {cell}")
        except (TypeError, ValueError) as exc:
            self.failed += 1
            log.error("sim_decision_rejected", decision_id=decision_id, error=str(exc))
            outcome = DriverOutcome(decision_id, False, False, str(exc), 0.0, self.sim.now)
            self.recent.append((dict(decision), outcome))
            return outcome
        started = time.perf_counter()
        for cell, delta in sorted(deltas.items()):
            for _ in range(delta):
                self._add(cell)
            for _ in range(-delta):
                self._release(cell)
        outcome = DriverOutcome(
            decision_id,
            True,
            False,
            "applied in the simulator",
            time.perf_counter() - started,
            self.sim.now,
        )
        self.recent.append((dict(decision), outcome))
        return outcome

    async def _apply(self, decision_id: str, decision: Mapping[str, Any]) -> DriverOutcome:
        return self.apply_now({**decision, "id": decision_id})

    def _add(self, cell: str) -> None:
        template = self.templates[cell]
        model, gpu, pool = parse_cell(cell)
        iid = f"{pool}-{gpu}-{model}-{next(self._ids)}".replace("/", "_")
        if self.spares.get(cell, 0) > 0:
            self.spares[cell] -= 1
            self._warm.add(iid)
            self.warm_starts += 1
            delay = template.warm_start_s
        else:
            self.cold_starts += 1
            delay = template.startup_s
        self.sim.add_instance(replace(template.spec, instance_id=iid), delay)
        self.cells.setdefault(cell, []).append(iid)

    def _release(self, cell: str) -> None:
        ids = self.cells.get(cell) or []
        if not ids:
            return  # nothing of that cell runs: the decision asked for less than nothing
        starting = set(self.sim.starting())
        waiting = [i for i in ids if i in starting]
        if waiting:
            victim = waiting[-1]  # the newest: the least start-up already paid
        else:

            def work(iid: str) -> int:
                inst = self.sim.instances[iid]
                return len(inst.running) + len(inst.waiting) + len(self.sim.queues[iid])

            victim = min((i for i in ids if i in self.sim.instances), key=work)
        ids.remove(victim)
        ready = victim not in starting
        self.sim.release_instance(victim)
        if ready or victim in self._warm:  # its weights are loaded (or the spare it took)
            self.spares[cell] = self.spares.get(cell, 0) + 1
