"""The live autoscaler: a capacity policy in the running coordinator's loop.

Every ``interval_s`` the loop observes the coordinator (instances per cell from the agents'
heartbeats, effective memory utilisation, input tokens per minute, SLO misses, idle instances, the
request planner's scale-up signal), forecasts the next hour at each hour boundary for the
forecast-driven policies, asks the policy for a decision and, when it changes something, hands the
decision's JSON to a driver (:mod:`qlm.capacity.drivers`: a dry run by default, or the operator's
program). Decisions with their inputs are kept for ``GET /v1/capacity`` and counted in the metrics.
The same :class:`~qlm.planner.capacity.policies.CapacityPolicy` objects run in the simulator's loop
(:mod:`qlm.tooling.capacity.sim`).

Instances an applied decision started are not in the heartbeats until their agent registers
(minutes): until then they count as *pending* in the observation, so a policy does not ask
for them again every cooldown. A pending addition ends when a new instance of its cell
registers or after twice the profiled start-up time; a pending removal when an instance of the
cell leaves or after ``removal_grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import structlog
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qlm.capacity.drivers import AutoscalerDriver, DryRunDriver
from qlm.capacity.forecast import TokenForecast, forecast_next_hour, trailing_mean
from qlm.planner.capacity.policies import (
    CapacityDecision,
    CapacityObservation,
    CapacityPolicy,
    CapacitySpec,
    Cell,
    InstanceProfile,
    PoolKey,
    scale_up_from_plan,
)

log = structlog.get_logger(__name__)


# ---------------------------------------------------------------------------- the spec file


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _ProfileEntry(_Strict):
    model: str = Field(min_length=1)
    gpu_type: str = Field(min_length=1)
    tpm: float = Field(gt=0, description="input tokens per minute one instance sustains")
    gpus: int = Field(default=1, ge=1)
    startup_s: float = Field(default=600.0, ge=0)


class CapacitySpecFile(_Strict):
    """``QLM_CAPACITY_SPEC``: what the live autoscaler plans with (docs/capacity.md)."""

    pool: str = Field(default="default", min_length=1)
    gpu_cost_per_hour: dict[str, float] = Field(min_length=1)
    profiles: list[_ProfileEntry] = Field(min_length=1)
    min_instances: int = Field(default=1, ge=0)
    max_instances: dict[str, int] = Field(default_factory=dict, description="per model")
    gpu_limits: dict[str, int] = Field(default_factory=dict, description="GPUs per type")

    def to_spec(self) -> CapacitySpec:
        return CapacitySpec(
            profiles=tuple(
                InstanceProfile(p.model, p.gpu_type, p.tpm, p.gpus, p.startup_s)
                for p in self.profiles
            ),
            gpu_cost_per_hour=dict(self.gpu_cost_per_hour),
            gpu_limits={(g, self.pool): n for g, n in self.gpu_limits.items()},
            default_min_instances=self.min_instances,
            max_instances={PoolKey(m, self.pool): n for m, n in self.max_instances.items()},
        )


def load_capacity_spec(path: str | Path) -> tuple[CapacitySpec, str]:
    """Read a capacity spec file (YAML or JSON); a clear ``ValueError`` for every problem."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the capacity spec: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML/JSON: {exc}") from exc
    try:
        parsed = CapacitySpecFile.model_validate(data)
        return parsed.to_spec(), parsed.pool
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"{path}: {problems}") from None
    except ValueError as exc:  # CapacitySpec's own checks (a price missing for a GPU type, …)
        raise ValueError(f"{path}: {exc}") from None


# ---------------------------------------------------------------------------- the loop


class LiveCapacityLoop:
    """Runs ``policy`` against a running :class:`qlm.coordinator.service.Coordinator`."""

    def __init__(
        self,
        service: Any,
        policy: CapacityPolicy,
        driver: AutoscalerDriver | None = None,
        *,
        pool: str = "default",
        interval_s: float = 15.0,
        removal_grace_s: float = 300.0,
        smoothing_min: int = 10,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.service = service
        self.policy = policy
        self.driver = driver or DryRunDriver()
        self.pool = pool
        self.interval_s = interval_s
        self.removal_grace_s = removal_grace_s
        self.smoothing_min = smoothing_min
        self.forecasting = policy.name.startswith("lt-")
        self._forecasts: dict[PoolKey, TokenForecast] = {}
        self._forecast_hour: int | None = None
        # cell -> deadlines of additions / removals applied but not seen in the heartbeats yet
        self._pending_add: dict[Cell, deque[float]] = {}
        self._pending_remove: dict[Cell, deque[float]] = {}
        self._seen: dict[Cell, set[str]] = {}
        self.last_observation: CapacityObservation | None = None
        self.last_decision: CapacityDecision | None = None
        self.errors = 0
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="qlm-autoscaler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bad tick must not end autoscaling (or serving)
                self.errors += 1
                log.exception("autoscaler_tick_failed", error=str(exc))
            await asyncio.sleep(self.interval_s)

    # ------------------------------------------------------------------ one decision
    async def tick(self, now: float | None = None) -> CapacityDecision:
        now = time.time() if now is None else now
        obs = await self.observe(now)
        # an LT policy solves the ILP at the hour (≤ its time limit): off the event loop
        decision = await asyncio.to_thread(self.policy.decide, obs)
        self.last_observation, self.last_decision = obs, decision
        metrics = getattr(self.service, "metrics", None)
        if metrics is not None:
            metrics.set_capacity(
                {tuple(c): n for c, n in decision.targets.items()},
                {tuple(k): u for k, u in obs.utilisation.items()},
            )
        if decision.changed:
            body = {**decision.to_dict(), "id": uuid.uuid4().hex}
            outcome = await self.driver.apply(body)
            kind = "dry_run" if outcome.dry_run else ("applied" if outcome.applied else "failed")
            if metrics is not None:
                metrics.observe_capacity_decision(self.policy.name, kind)
            if outcome.applied:
                self._note_pending(decision, now)
        return decision

    def _note_pending(self, decision: CapacityDecision, now: float) -> None:
        for cell, delta in decision.deltas.items():
            if delta > 0:
                profile = self.policy.spec.profile(cell.model, cell.gpu_type)
                grace = 2 * (profile.startup_s if profile is not None else 600.0)
                self._pending_add.setdefault(cell, deque()).extend([now + grace] * delta)
            else:
                self._pending_remove.setdefault(cell, deque()).extend(
                    [now + self.removal_grace_s] * -delta
                )

    # ------------------------------------------------------------------ observing
    def _cell_of(self, inst: Any) -> Cell:
        status = inst.last_status
        model = (status.active_model if status is not None else None) or inst.info.models[0]
        return Cell(model, inst.info.gpu_type, self.pool)

    async def observe(self, now: float) -> CapacityObservation:
        core = self.service.core
        telemetry = self.service.capacity
        alive = [i for i in core.instances.values() if i.status == "alive"]
        counts: dict[Cell, int] = {}
        members: dict[Cell, set[str]] = {}
        used: dict[PoolKey, float] = {}
        capacity: dict[PoolKey, float] = {}
        idle: dict[PoolKey, int] = {}
        for inst in alive:
            cell = self._cell_of(inst)
            key = PoolKey(cell.model, cell.pool)
            if self.policy.spec.profile(cell.model, cell.gpu_type) is None:
                continue  # no profile: not ours to scale (logged once per cell below)
            counts[cell] = counts.get(cell, 0) + 1
            members.setdefault(cell, set()).add(inst.instance_id)
            status = inst.last_status
            used[key] = used.get(key, 0.0) + (status.kv_used_tokens if status else 0)
            capacity[key] = capacity.get(key, 0.0) + inst.info.kv_capacity_tokens
            busy = status is not None and (status.running or status.waiting)
            if not busy and not inst.running and not len(inst.queue):
                idle[key] = idle.get(key, 0) + 1
        self._settle_pending(members, now)
        for cell, pend in self._pending_add.items():
            counts[cell] = counts.get(cell, 0) + len(pend)
        for cell, pend in self._pending_remove.items():
            counts[cell] = max(0, counts.get(cell, 0) - len(pend))
        for p in self.policy.spec.profiles:  # every profiled cell, even with none running
            counts.setdefault(Cell(p.model, p.gpu_type, self.pool), 0)
        utilisation = {k: min(1.0, used[k] / c) for k, c in capacity.items() if c > 0}
        models = {c.model for c in counts}
        observed = {PoolKey(m, self.pool): telemetry.observed_tpm(m, now) for m in models}
        misses = telemetry.take_misses()
        return CapacityObservation(
            now=now,
            instances=counts,
            utilisation=utilisation,
            observed_tpm=observed,
            forecasts=await self._forecasts_at(now, models) if self.forecasting else {},
            sla_violations={PoolKey(m, self.pool): n for m, n in misses.items() if m in models},
            idle_instances=idle,
            scale_up=scale_up_from_plan(telemetry.scale_up, self.pool),
        )

    def _settle_pending(self, members: dict[Cell, set[str]], now: float) -> None:
        for cell in set(members) | set(self._seen):
            before = self._seen.get(cell, set())
            after = members.get(cell, set())
            joined, left = len(after - before), len(before - after)
            adds = self._pending_add.get(cell)
            while adds and joined:
                adds.popleft()
                joined -= 1
            removes = self._pending_remove.get(cell)
            while removes and left:
                removes.popleft()
                left -= 1
        self._seen = {c: set(ids) for c, ids in members.items()}
        for pend in (*self._pending_add.values(), *self._pending_remove.values()):
            while pend and pend[0] <= now:
                pend.popleft()  # never showed up (or never left): stop counting it

    async def _forecasts_at(self, now: float, models: set[str]) -> dict[PoolKey, TokenForecast]:
        hour = int(math.floor(now / 3600.0))
        if hour == self._forecast_hour:
            return self._forecasts
        telemetry = self.service.capacity
        out: dict[PoolKey, TokenForecast] = {}
        for model in sorted(models):
            series = telemetry.per_minute(model, now)
            if series.size < 15:  # not enough history: no forecast, the policy holds
                continue
            out[PoolKey(model, self.pool)] = await asyncio.to_thread(
                forecast_next_hour,
                trailing_mean(series, self.smoothing_min),
                origin_s=math.floor(now / 60.0) * 60.0,
                model=model,
                pool=self.pool,
            )
        self._forecasts, self._forecast_hour = out, hour
        return out

    # ------------------------------------------------------------------ admin API
    def status(self) -> dict[str, Any]:
        obs = self.last_observation
        return {
            "policy": self.policy.name,
            "driver": "dry-run" if isinstance(self.driver, DryRunDriver) else "command",
            "dry_run": isinstance(self.driver, DryRunDriver),
            "interval_s": self.interval_s,
            "pool": self.pool,
            "errors": self.errors,
            "pending": {
                "add": {"/".join(c): len(q) for c, q in self._pending_add.items() if q},
                "remove": {"/".join(c): len(q) for c, q in self._pending_remove.items() if q},
            },
            "last_observation": None if obs is None else obs.to_dict(),
            "telemetry": self.service.capacity.snapshot(time.time()),
            "decisions": [
                {"decision": dict(d), "outcome": o.as_dict()} for d, o in self.driver.recent
            ],
        }
