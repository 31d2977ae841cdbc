"""Capacity planning: how many instances of each model, on which GPU type, in each pool
(SageServe §5-§6.4, CATO's provisioner; issue 8 item 2). docs/capacity.md has the maths.

QLM's request planner orders work for a *given* set of instances; this module decides that set.

* :func:`solve_capacity_ilp` — SageServe's hourly ILP in cvxpy (HiGHS): the change δ in instance
  count per (model, GPU type, pool) minimising GPU cost over the horizon plus a start-up penalty
  for every added instance, such that each (model, pool)'s forecast peak is covered by profiled
  capacity, within GPU limits per (GPU type, pool) and instance bounds per (model, pool). When the
  limits make the demand uncoverable it returns ``status="capped"`` with the largest coverage the
  limits allow and the shortfall per (model, pool), not an exception.
* :class:`CapacityPolicy` — one interface, ``decide(observation) -> CapacityDecision``, for
  SageServe's three ways of carrying out the plan (LT-I, LT-U, LT-UA: :class:`SageServePolicy`)
  and the baselines (:class:`ReactivePolicy`: 70 %/30 % effective-memory thresholds with a
  cooldown; :class:`CatoPolicy`: CATO's SLA-violation counter). Policies are pure: no I/O and no
  clock of their own (time is ``observation.now``), so the simulator and a live driver share
  them. :func:`create_capacity_policy` builds one by name.
* QLM's infeasibility signal (the stochastic planner's ``meta["scale_up"]``,
  :func:`scale_up_from_plan`) forces at least +1 instance of the models it names, in every policy.

Instance counts in an observation include instances still starting: a decision is the change
from what the driver has already asked for, so repeating a decision is idempotent.
"""

from __future__ import annotations

import math
import time
import warnings
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import structlog

from qlm.capacity.forecast import TokenForecast
from qlm.logging import absorb_highs_banner

log = structlog.get_logger(__name__)


class Cell(NamedTuple):
    """One decision variable's index: a model on a GPU type in a pool."""

    model: str
    gpu_type: str
    pool: str


class PoolKey(NamedTuple):
    """A (model, pool): the unit of demand, utilisation and scaling pace."""

    model: str
    pool: str


@dataclass(frozen=True)
class InstanceProfile:
    """Offline profile of one instance of ``model`` on ``gpu_type`` (SageServe's θ and start-up
    time): ``tpm`` is the input tokens per minute it sustains at its target latency."""

    model: str
    gpu_type: str
    tpm: float
    gpus: int = 1
    startup_s: float = 600.0  # SageServe: ≈ 10 min to redeploy with weights in the region

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tpm) and self.tpm > 0):
            raise ValueError(f"{self.model}/{self.gpu_type}: tpm must be a positive number")
        if self.gpus < 1 or not (math.isfinite(self.startup_s) and self.startup_s >= 0):
            raise ValueError(f"{self.model}/{self.gpu_type}: gpus ≥ 1 and startup_s ≥ 0 required")


@dataclass(frozen=True)
class CapacitySpec:
    """Everything the ILP and the step policies need besides the observation.

    ``gpu_cost_per_hour`` is α_k per GPU; an instance costs α_k × gpus per hour, and adding one
    costs σ = α_k × gpus × its start-up time on top (the GPU time spent loading, SageServe §5).
    ``gpu_limits[(gpu_type, pool)]`` caps the GPUs of that type in that pool (absent: no cap).
    ``epsilon`` is SageServe's ε: the share of its own peak each pool must cover locally; below 1
    the rest may be rerouted to other pools, and the model's total demand must be covered
    globally."""

    profiles: tuple[InstanceProfile, ...]
    gpu_cost_per_hour: Mapping[str, float]
    gpu_limits: Mapping[tuple[str, str], int] = field(default_factory=dict)
    min_instances: Mapping[PoolKey, int] = field(default_factory=dict)
    max_instances: Mapping[PoolKey, int] = field(default_factory=dict)
    default_min_instances: int = 0
    horizon_s: float = 3600.0
    epsilon: float = 1.0

    def __post_init__(self) -> None:
        seen: set[tuple[str, str]] = set()
        for p in self.profiles:
            if (p.model, p.gpu_type) in seen:
                raise ValueError(f"duplicate profile for {p.model}/{p.gpu_type}")
            seen.add((p.model, p.gpu_type))
            cost = self.gpu_cost_per_hour.get(p.gpu_type)
            if cost is None or not (math.isfinite(cost) and cost >= 0):
                raise ValueError(f"no valid gpu_cost_per_hour for GPU type {p.gpu_type!r}")
        if any(v < 0 for v in self.gpu_limits.values()):
            raise ValueError("gpu_limits must be ≥ 0")
        for k, lo in self.min_instances.items():
            hi = self.max_instances.get(k)
            if lo < 0 or (hi is not None and hi < lo):
                raise ValueError(f"bad instance bounds for {k}: min {lo}, max {hi}")
        if self.default_min_instances < 0 or self.horizon_s <= 0:
            raise ValueError("default_min_instances ≥ 0 and horizon_s > 0 required")
        if not 0 < self.epsilon <= 1:
            raise ValueError("epsilon must be in (0, 1]")

    def profile(self, model: str, gpu_type: str) -> InstanceProfile | None:
        for p in self.profiles:
            if p.model == model and p.gpu_type == gpu_type:
                return p
        return None

    def profiles_of(self, model: str) -> list[InstanceProfile]:
        return [p for p in self.profiles if p.model == model]

    def cost_per_hour(self, p: InstanceProfile) -> float:
        return float(self.gpu_cost_per_hour[p.gpu_type]) * p.gpus

    def startup_cost(self, p: InstanceProfile) -> float:
        return self.cost_per_hour(p) * p.startup_s / 3600.0

    def min_for(self, key: PoolKey) -> int:
        return int(self.min_instances.get(key, self.default_min_instances))

    def max_for(self, key: PoolKey) -> int | None:
        hi = self.max_instances.get(key)
        return None if hi is None else int(hi)


IlpStatus = Literal["optimal", "feasible", "capped", "infeasible", "error"]


@dataclass(frozen=True)
class IlpResult:
    """The ILP's answer. ``feasible``: the time limit stopped the search; the targets are the
    best allocation found (it covers the demand; its cost may be above the optimum).
    ``capped``: the limits cannot cover the demand (or the forced scale-up); the targets are
    the allocation that leaves the least relative shortfall, at least cost; ``shortfall_tpm``
    says what is missing per (model, pool) (and per model under the pool ``"*"`` when ε < 1).
    ``infeasible``/``error``: the bounds contradict each other, or the solver failed; the targets
    are then the current counts (no change)."""

    status: IlpStatus
    targets: dict[Cell, int]
    deltas: dict[Cell, int]
    shortfall_tpm: dict[PoolKey, float]
    unmet_scale_up: dict[PoolKey, int]
    holding_cost: float  # of the target allocation over the horizon
    startup_cost: float  # of the instances added
    solve_s: float
    message: str = ""

    @property
    def objective(self) -> float:
        return self.holding_cost + self.startup_cost

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "targets": {"/".join(c): n for c, n in self.targets.items()},
            "deltas": {"/".join(c): n for c, n in self.deltas.items() if n},
            "shortfall_tpm": {"/".join(k): v for k, v in self.shortfall_tpm.items()},
            "unmet_scale_up": {"/".join(k): v for k, v in self.unmet_scale_up.items()},
            "holding_cost": self.holding_cost,
            "startup_cost": self.startup_cost,
            "solve_s": self.solve_s,
            "message": self.message,
        }


def _silence_highs_banner() -> None:
    """highspy prints a copyright banner on stdout (the C++ stream, not ``sys.stdout``) when the
    first solver object of a process is built; ``log_to_console`` cannot stop it. It would break
    a command's JSON on stdout: qlm.logging builds the first object with fd 1 captured and logs
    the banner as a structured line instead."""
    absorb_highs_banner()


def _validate_counts(current: Mapping[Cell, int], spec: CapacitySpec) -> None:
    for c, n in current.items():
        if int(n) != n or n < 0:
            raise ValueError(f"instance count for {c} must be a non-negative integer, got {n!r}")
        if n and spec.profile(c.model, c.gpu_type) is None:
            raise ValueError(f"instances of {c.model} on {c.gpu_type} but no profile for it")


def solve_capacity_ilp(
    spec: CapacitySpec,
    demand_tpm: Mapping[PoolKey, float],
    current: Mapping[Cell, int],
    *,
    scale_up: Mapping[PoolKey, int] | None = None,
    time_limit_s: float = 10.0,
    mip_rel_gap: float = 1e-3,
) -> IlpResult:
    """SageServe's ILP for one planning horizon (formulation in docs/capacity.md).

    ``demand_tpm[(model, pool)]`` is the forecast peak plus buffer (ρ); absent means 0.
    ``scale_up[(model, pool)] = m`` requires at least ``m`` more instances of that model in
    that pool than now (QLM's infeasibility signal). The search stops within ``mip_rel_gap``
    of the optimum, relative to the whole cost (0.1 %: well under one instance-hour in any
    plan of more than a few instances), or at ``time_limit_s`` (then ``status="feasible"``
    with the best allocation found; a capped problem solves up to three times). Malformed
    input raises ValueError; everything else (uncoverable demand, solver trouble) is reported
    in the result.
    """
    forced = {k: int(v) for k, v in (scale_up or {}).items() if v > 0}
    _validate_counts(current, spec)
    for k, v in demand_tpm.items():
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"demand for {k} must be a finite rate ≥ 0, got {v!r}")
    models = sorted(
        {k.model for k in demand_tpm}
        | {k.model for k, lo in spec.min_instances.items() if lo > 0}
        | {c.model for c, n in current.items() if n}
        | {k.model for k in forced}
    )
    for m in models:
        if not spec.profiles_of(m):
            raise ValueError(f"no instance profile for model {m!r}")
    pools = sorted(
        {k.pool for k in demand_tpm}
        | {c.pool for c in current}
        | {k.pool for k in forced}
        | {k.pool for k, lo in spec.min_instances.items() if lo > 0}
        | {p for _, p in spec.gpu_limits}
    )
    cells = [Cell(p.model, p.gpu_type, pool) for p in spec.profiles for pool in pools]
    cells = [c for c in cells if c.model in models]
    keys = [PoolKey(m, pool) for m in models for pool in pools]
    t0 = time.perf_counter()
    n_now = {c: int(current.get(c, 0)) for c in cells}
    if not cells:
        return IlpResult("optimal", {}, {}, {}, {}, 0.0, 0.0, 0.0, "nothing to plan")

    import cvxpy as cp  # heavy import, paid only by processes that plan capacity

    _silence_highs_banner()
    C, K = len(cells), len(keys)
    kidx = {k: i for i, k in enumerate(keys)}
    prof = [spec.profile(c.model, c.gpu_type) for c in cells]
    theta = np.array([p.tpm for p in prof if p is not None])
    gpus = np.array([p.gpus for p in prof if p is not None], dtype=float)
    hold = np.array([spec.cost_per_hour(p) for p in prof if p is not None]) * spec.horizon_s / 3600
    start = np.array([spec.startup_cost(p) for p in prof if p is not None])
    n = np.array([n_now[c] for c in cells], dtype=float)
    member = np.zeros((K, C))  # member[k, c] = 1 when cell c belongs to (model, pool) k
    for j, c in enumerate(cells):
        member[kidx[PoolKey(c.model, c.pool)], j] = 1.0
    rho = np.array([float(demand_tpm.get(k, 0.0)) for k in keys])
    lo = np.array([spec.min_for(k) for k in keys], dtype=float)
    hi = [spec.max_for(k) for k in keys]
    need = np.array([forced.get(k, 0) for k in keys], dtype=float)
    per_model = {m: [kidx[PoolKey(m, p)] for p in pools] for m in models}
    # an upper bound on additions keeps the branch-and-bound box finite; more than this is
    # never optimal: it covers the model's whole demand alone, plus the bounds and the signal
    model_total = {m: float(rho[per_model[m]].sum()) for m in models}
    ub = np.array(
        [
            math.ceil(model_total[c.model] / theta[j])
            + lo[kidx[PoolKey(c.model, c.pool)]]
            + need[kidx[PoolKey(c.model, c.pool)]]
            + 1
            for j, c in enumerate(cells)
        ]
    )
    gpu_rows = []
    for (g, pool), limit in sorted(spec.gpu_limits.items()):
        row = np.array(
            [gpus[j] if (c.gpu_type == g and c.pool == pool) else 0.0 for j, c in enumerate(cells)]
        )
        if row.any():
            gpu_rows.append((row, float(limit)))

    # the target count is the integer variable; the additions δ⁺ = max(0, cnt − n) are a
    # continuous epigraph (exact at the optimum because σ ≥ 0). Half the integer variables of
    # an integer δ⁺/δ⁻ split, and no fractional add-and-remove pairs for the LP to exploit
    cnt = cp.Variable(C, integer=True)
    up = cp.Variable(C)

    def constraints(cover_slack: Any, model_slack: Any, force_slack: Any) -> list[Any]:
        cons = [cnt >= 0, cnt <= n + ub, up >= 0, up >= cnt - n]
        cap = (member * theta) @ cnt
        cons.append(cap + cover_slack >= spec.epsilon * rho)
        if spec.epsilon < 1:
            for i, m in enumerate(models):
                rows = per_model[m]
                cons.append(cp.sum(cap[rows]) + model_slack[i] >= rho[rows].sum())
        inst = member @ cnt
        cons.append(inst >= lo)
        for i, h in enumerate(hi):
            if h is not None:
                cons.append(inst[i] <= h)
        forced_rows = np.flatnonzero(need > 0)
        if forced_rows.size:  # only where QLM asked: elsewhere the count may go down
            cons.append(
                inst[forced_rows] + force_slack[forced_rows] >= (member @ n + need)[forced_rows]
            )
        for row, limit in gpu_rows:
            cons.append(row @ cnt <= limit)
        return cons

    cost = hold @ cnt + start @ up
    # cvxpy hands HiGHS the objective without its constant part (the cost of the instances
    # kept), so HiGHS's relative gap is relative to the cost of the *change*, near zero when
    # little changes: it then never closes. The gap is made relative to the whole cost here,
    # as an absolute gap: mip_rel_gap × (cost of what runs + cheapest cover of the demand).
    cheapest = {
        m: min(hold[j] / theta[j] for j, c in enumerate(cells) if c.model == m) for m in models
    }
    scale = float(hold @ n) + sum(cheapest[m] * model_total[m] for m in models)
    opts: dict[str, Any] = {
        "time_limit": float(time_limit_s),
        "mip_rel_gap": float(mip_rel_gap),
        "mip_abs_gap": max(float(mip_rel_gap) * scale, 1e-9),
    }

    def solve(problem: Any) -> str:
        with warnings.catch_warnings():
            # cvxpy warns "solution may be inaccurate" on a time-out; the status says so
            warnings.simplefilter("ignore", UserWarning)
            try:
                problem.solve(solver="HIGHS", **opts)
            except cp.error.SolverError as exc:
                log.warning("capacity_ilp_solver_error", error=str(exc))
                return "solver_error"
        status = str(problem.status)
        if status == "user_limit" and cnt.value is not None:
            return "time_limit"  # an incumbent exists: usable, not proven optimal
        return status

    def unchanged(status: IlpStatus, msg: str) -> IlpResult:
        tg = {c: n_now[c] for c in cells}
        return IlpResult(
            status, tg, {c: 0 for c in cells}, {}, {}, float(hold @ n), 0.0,
            time.perf_counter() - t0, msg,
        )  # fmt: skip

    zeros_k, zeros_m = np.zeros(K), np.zeros(len(models))
    # valid cuts for the strict problem: a (model, pool) needs at least as many instances as
    # its demand takes on its fastest GPU type, rounded up. They cost nothing to state and
    # lift the LP bound, which otherwise accepts fractional instances in every (model, pool)
    # and leaves HiGHS branching for seconds when GPU limits couple the models
    theta_max = np.array([max(p.tpm for p in spec.profiles_of(k.model)) for k in keys])
    min_count = np.ceil(spec.epsilon * rho / theta_max - 1e-9)
    cuts = [member @ cnt >= min_count]
    if spec.epsilon < 1:
        for m in models:
            rows = per_model[m]
            cuts.append(
                cp.sum((member @ cnt)[rows])
                >= math.ceil(rho[rows].sum() / theta_max[rows[0]] - 1e-9)
            )
    strict = cp.Problem(cp.Minimize(cost), [*constraints(zeros_k, zeros_m, zeros_k), *cuts])
    status = solve(strict)
    if status in ("optimal", "optimal_inaccurate", "time_limit"):
        result_status: IlpStatus = "optimal" if status == "optimal" else "feasible"
        msg = {
            "optimal": "",
            "optimal_inaccurate": "solver reported optimal_inaccurate",
            "time_limit": f"time limit {time_limit_s:g} s: best allocation found, not optimal",
        }[status]
        s_force = np.zeros(K)
    elif status == "infeasible":
        # phase A: the least relative shortfall the limits allow; phase B: its cheapest allocation
        model_scale = np.array([max(model_total[m], 1.0) for m in models])
        s_cov_v = cp.Variable(K, nonneg=True)
        s_mod_v = cp.Variable(len(models), nonneg=True)
        s_force_v = cp.Variable(K, nonneg=True)
        short = (
            cp.sum(cp.multiply(1.0 / np.maximum(rho, 1.0), s_cov_v))
            + cp.sum(cp.multiply(1.0 / model_scale, s_mod_v))
            + cp.sum(s_force_v)
        )
        relaxed = constraints(s_cov_v, s_mod_v, s_force_v)
        phase_a = cp.Problem(cp.Minimize(short), relaxed)
        if solve(phase_a) not in ("optimal", "optimal_inaccurate", "time_limit"):
            return unchanged(
                "infeasible", "the instance bounds contradict the GPU limits; nothing changed"
            )
        best_short = float(phase_a.value)
        phase_b = cp.Problem(cp.Minimize(cost), [*relaxed, short <= best_short * (1 + 1e-6) + 1e-9])
        if solve(phase_b) not in ("optimal", "optimal_inaccurate", "time_limit"):
            return unchanged("error", "the capped re-solve failed; nothing changed")
        result_status = "capped"
        msg = "capacity cap reached: the limits cannot cover the demand (or the scale-up)"
        s_force = np.asarray(s_force_v.value, dtype=float)
    else:
        log.warning("capacity_ilp_failed", status=status)
        return unchanged("error", f"solver status {status}; nothing changed")

    target = np.rint(np.asarray(cnt.value, dtype=float)).astype(int)
    up_v = np.maximum(target - n.astype(int), 0)
    targets = {c: int(target[j]) for j, c in enumerate(cells)}
    deltas = {c: int(target[j] - n[j]) for j, c in enumerate(cells)}
    # the shortfall as the allocation shows it (slack variables can be loose): per (model,
    # pool) against its local share ε·ρ, and with ε < 1 per model against its total under
    # the pool name "*"
    shortfall: dict[PoolKey, float] = {}
    if result_status == "capped":
        covered = (member * theta) @ target
        for i, k in enumerate(keys):
            if spec.epsilon * rho[i] - covered[i] > 1e-6:
                shortfall[k] = float(spec.epsilon * rho[i] - covered[i])
        if spec.epsilon < 1:
            for m in models:
                rows = per_model[m]
                gap = float(rho[rows].sum() - covered[rows].sum())
                if gap > 1e-6:
                    shortfall[PoolKey(m, "*")] = gap
    unmet = {k: int(round(s_force[i])) for i, k in enumerate(keys) if s_force[i] > 0.5}
    return IlpResult(
        status=result_status,
        targets=targets,
        deltas=deltas,
        shortfall_tpm=shortfall,
        unmet_scale_up=unmet,
        holding_cost=float(hold @ target),
        startup_cost=float(start @ up_v),
        solve_s=time.perf_counter() - t0,
        message=msg,
    )


# ---------------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class CapacityObservation:
    """What a policy sees at one decision time. ``instances`` counts every instance asked for,
    starting ones included. ``utilisation`` is SageServe's effective memory utilisation (KV
    memory used / memory left after weights) per (model, pool), in [0, 1]. ``observed_tpm`` is
    the interactive input rate of the last minute (LT-UA). ``sla_violations`` are CATO-counted
    violations since the previous observation (:func:`cato_counts_violation`), and
    ``idle_instances`` the instances serving nothing now (CATO). ``scale_up`` is QLM's
    infeasibility signal (:func:`scale_up_from_plan`)."""

    now: float
    instances: Mapping[Cell, int]
    utilisation: Mapping[PoolKey, float] = field(default_factory=dict)
    observed_tpm: Mapping[PoolKey, float] = field(default_factory=dict)
    forecasts: Mapping[PoolKey, TokenForecast] = field(default_factory=dict)
    sla_violations: Mapping[PoolKey, int] = field(default_factory=dict)
    idle_instances: Mapping[PoolKey, int] = field(default_factory=dict)
    scale_up: Mapping[PoolKey, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not math.isfinite(self.now):
            raise ValueError("now must be finite")
        for k, u in self.utilisation.items():
            if not (math.isfinite(u) and u >= 0):
                raise ValueError(f"utilisation of {k} must be a finite value ≥ 0, got {u!r}")
        for k, v in self.observed_tpm.items():
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"observed_tpm of {k} must be a finite rate ≥ 0, got {v!r}")
        for name, mp in (("sla_violations", self.sla_violations), ("idle", self.idle_instances)):
            if any(v < 0 for v in mp.values()):
                raise ValueError(f"{name} counts must be ≥ 0")

    def pool_keys(self) -> set[PoolKey]:
        return (
            {PoolKey(c.model, c.pool) for c in self.instances}
            | set(self.utilisation)
            | set(self.forecasts)
            | set(self.sla_violations)
            | set(self.scale_up)
        )

    def to_dict(self) -> dict[str, Any]:
        def flat(mp: Mapping[Any, Any]) -> dict[str, Any]:
            return {"/".join(k): v for k, v in mp.items()}

        return {
            "now": self.now,
            "instances": flat(self.instances),
            "utilisation": flat(self.utilisation),
            "observed_tpm": flat(self.observed_tpm),
            "forecast_target_tpm": {"/".join(k): f.target_tpm for k, f in self.forecasts.items()},
            "sla_violations": flat(self.sla_violations),
            "idle_instances": flat(self.idle_instances),
            "scale_up": flat(self.scale_up),
        }


@dataclass(frozen=True)
class CapacityDecision:
    """A policy's answer, carrying its inputs (for the admin API and metrics). ``deltas`` holds
    only non-zero changes; ``targets`` the counts once they are applied. ``reasons`` says, per
    (model, pool) that was considered, why it changed or not."""

    policy: str
    now: float
    deltas: dict[Cell, int]
    targets: dict[Cell, int]
    reasons: dict[PoolKey, str]
    observation: CapacityObservation
    plan: IlpResult | None = None

    @property
    def changed(self) -> bool:
        return any(self.deltas.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "now": self.now,
            "deltas": {"/".join(c): d for c, d in self.deltas.items()},
            "targets": {"/".join(c): n for c, n in self.targets.items()},
            "reasons": {"/".join(k): r for k, r in self.reasons.items()},
            "observation": self.observation.to_dict(),
            "plan": None if self.plan is None else self.plan.to_dict(),
        }


class _Counts:
    """Working instance counts while a decision is built, with the GPU limits, instance bounds
    and scale-up floors a step must respect."""

    def __init__(
        self,
        spec: CapacitySpec,
        instances: Mapping[Cell, int],
        floors: Mapping[PoolKey, int] | None = None,
    ) -> None:
        self.spec = spec
        self.start = {c: int(n) for c, n in instances.items()}
        self.now = dict(self.start)
        self.floors = dict(floors or {})

    def floor(self, key: PoolKey) -> int:
        return max(self.spec.min_for(key), self.floors.get(key, 0))

    def total(self, key: PoolKey) -> int:
        return sum(n for c, n in self.now.items() if (c.model, c.pool) == key)

    def gpus_used(self, gpu_type: str, pool: str) -> int:
        used = 0
        for c, n in self.now.items():
            p = self.spec.profile(c.model, c.gpu_type)
            if p is not None and c.gpu_type == gpu_type and c.pool == pool:
                used += n * p.gpus
        return used

    def room(self, cell: Cell) -> bool:
        p = self.spec.profile(cell.model, cell.gpu_type)
        if p is None:
            return False
        hi = self.spec.max_for(PoolKey(cell.model, cell.pool))
        if hi is not None and self.total(PoolKey(cell.model, cell.pool)) >= hi:
            return False
        limit = self.spec.gpu_limits.get((cell.gpu_type, cell.pool))
        return limit is None or self.gpus_used(cell.gpu_type, cell.pool) + p.gpus <= limit

    def cells(self, key: PoolKey) -> list[Cell]:
        """The model's cells in the pool, cheapest per token first."""
        ps = sorted(
            self.spec.profiles_of(key.model),
            key=lambda p: (self.spec.cost_per_hour(p) / p.tpm, p.gpu_type),
        )
        return [Cell(key.model, p.gpu_type, key.pool) for p in ps]

    def step_up(self, key: PoolKey, prefer: list[Cell] | None = None) -> Cell | None:
        for c in (prefer or []) + self.cells(key):
            if self.room(c):
                self.now[c] = self.now.get(c, 0) + 1
                return c
        return None

    def step_down(self, key: PoolKey, prefer: list[Cell] | None = None) -> Cell | None:
        if self.total(key) - 1 < self.floor(key):
            return None
        for c in (prefer or []) + list(reversed(self.cells(key))):
            if self.now.get(c, 0) > 0:
                self.now[c] -= 1
                return c
        return None

    def deltas(self) -> dict[Cell, int]:
        out = {}
        for c in set(self.now) | set(self.start):
            d = self.now.get(c, 0) - self.start.get(c, 0)
            if d:
                out[c] = d
        return out


class CapacityPolicy(ABC):
    """Decides instance-count changes from one observation. Implementations keep only their own
    pacing state (cooldowns, counters, the plan in force) and never do I/O.

    Every policy honours QLM's scale-up signal the same way: when ``observation.scale_up`` asks
    for ``m`` more instances of a (model, pool) and the policy's own decision adds fewer, steps
    are added (cheapest GPU type with room) up to ``m``; the signal is then ignored for that
    (model, pool) for ``scale_up_hold_s`` — the new instances take minutes to start, and the
    request planner, which sees only live instances, keeps asking meanwhile.
    """

    name: str = ""

    def __init__(self, spec: CapacitySpec, *, scale_up_hold_s: float = 600.0) -> None:
        self.spec = spec
        self.scale_up_hold_s = scale_up_hold_s
        self._scale_up_until: dict[PoolKey, float] = {}
        # after a signal is honoured, the count it reached is a floor for the hold: a policy's
        # own logic (LT-I's plan from before the signal, a low utilisation) must not undo it
        self._floors: dict[PoolKey, tuple[int, float]] = {}

    def decide(self, observation: CapacityObservation) -> CapacityDecision:
        _validate_counts(observation.instances, self.spec)
        floors = {k: f for k, (f, until) in self._floors.items() if observation.now < until}
        counts = _Counts(self.spec, observation.instances, floors)
        reasons: dict[PoolKey, str] = {}
        plan = self._decide(observation, counts, reasons)
        self._apply_scale_up(observation, counts, reasons)
        deltas = counts.deltas()
        targets = {c: n for c, n in counts.now.items()}
        if deltas:
            log.info(
                "capacity_decision",
                policy=self.name,
                deltas={"/".join(c): d for c, d in deltas.items()},
            )
        return CapacityDecision(
            self.name, observation.now, deltas, targets, reasons, observation, plan
        )

    @abstractmethod
    def _decide(
        self, obs: CapacityObservation, counts: _Counts, reasons: dict[PoolKey, str]
    ) -> IlpResult | None:
        """Apply this policy's steps to ``counts`` and note a reason per (model, pool)."""

    def _apply_scale_up(
        self, obs: CapacityObservation, counts: _Counts, reasons: dict[PoolKey, str]
    ) -> None:
        for key, m in sorted(obs.scale_up.items()):
            if m <= 0 or obs.now < self._scale_up_until.get(key, -math.inf):
                continue
            added = counts.total(key) - sum(
                n for c, n in counts.start.items() if (c.model, c.pool) == key
            )
            got = 0
            while added + got < m and counts.step_up(key) is not None:
                got += 1
            if added + got < m:
                reasons[key] = f"QLM scale-up asked +{m}: capacity cap reached after +{added + got}"
            elif got:
                reasons[key] = f"QLM scale-up signal: +{got}"
            self._scale_up_until[key] = obs.now + self.scale_up_hold_s
            self._floors[key] = (counts.total(key), obs.now + self.scale_up_hold_s)


LtMode = Literal["LT-I", "LT-U", "LT-UA"]


class SageServePolicy(CapacityPolicy):
    """SageServe's forecast-aware scaling (§6.4). At the start of every ``plan_interval_s``
    period it solves the ILP for the forecasts' targets (peak + buffer) and then carries out the
    plan in one of three modes:

    * **LT-I** — at once: every decision returns the full remaining difference to the plan;
    * **LT-U** — paced by effective memory utilisation: one instance out while it is above
      ``up_threshold`` and the count is below the plan's, one in while it is below
      ``down_threshold`` and the count is above; ``cooldown_s`` between steps per (model, pool);
    * **LT-UA** — LT-U, and in the last ``correction_window_s`` of the period the plan's count is
      no longer a hard stop: with the count at the plan's, keep scaling out (still on a high
      utilisation) while the observed rate is ≥ ``burst_ratio`` × the forecast for this minute,
      and keep scaling in (on a low utilisation) while it is ≤ ``lull_ratio`` × the forecast.
      [interp] the paper keeps the memory thresholds as the trigger and uses the traffic ratio to
      lift the target, which is how this reads "switch from memory-based to traffic-based".

    A (model, pool) with instances but no forecast keeps its current capacity (its demand is
    set to what it has), rather than being scaled to zero by a missing input.
    """

    def __init__(
        self,
        spec: CapacitySpec,
        mode: LtMode = "LT-UA",
        *,
        plan_interval_s: float = 3600.0,
        up_threshold: float = 0.7,
        down_threshold: float = 0.3,
        cooldown_s: float = 15.0,
        correction_window_s: float = 1200.0,
        burst_ratio: float = 5.0,
        lull_ratio: float = 0.5,
        ilp_time_limit_s: float = 10.0,
        scale_up_hold_s: float = 600.0,
    ) -> None:
        super().__init__(spec, scale_up_hold_s=scale_up_hold_s)
        if mode not in ("LT-I", "LT-U", "LT-UA"):
            raise ValueError(f"unknown SageServe mode {mode!r}")
        if not 0 <= down_threshold < up_threshold:
            raise ValueError("need 0 ≤ down_threshold < up_threshold")
        self.mode: LtMode = mode
        self.name = mode.lower()
        self.plan_interval_s = plan_interval_s
        self.up_threshold = up_threshold
        self.down_threshold = down_threshold
        self.cooldown_s = cooldown_s
        self.correction_window_s = correction_window_s
        self.burst_ratio = burst_ratio
        self.lull_ratio = lull_ratio
        self.ilp_time_limit_s = ilp_time_limit_s
        self._period: int | None = None
        self._plan: IlpResult | None = None
        self._planned_at = -math.inf
        self.retry_s = 60.0
        self._last_step: dict[PoolKey, float] = {}

    @property
    def plan(self) -> IlpResult | None:
        return self._plan

    def _replan(self, obs: CapacityObservation) -> IlpResult:
        demand: dict[PoolKey, float] = {}
        for key in obs.pool_keys():
            f = obs.forecasts.get(key)
            if f is not None:
                demand[key] = f.target_tpm
            else:
                demand[key] = sum(
                    n * p.tpm
                    for c, n in obs.instances.items()
                    if (c.model, c.pool) == key and (p := self.spec.profile(c.model, c.gpu_type))
                )
        plan = solve_capacity_ilp(
            self.spec,
            demand,
            obs.instances,
            scale_up=obs.scale_up,
            time_limit_s=self.ilp_time_limit_s,
        )
        log.info(
            "capacity_plan",
            policy=self.name,
            status=plan.status,
            solve_s=round(plan.solve_s, 3),
            message=plan.message,
        )
        # the plan includes the signal's step; LT-U/LT-UA would still wait for a utilisation
        # breach to take it, so the common signal handling (CapacityPolicy) takes it at once
        return plan

    def _decide(
        self, obs: CapacityObservation, counts: _Counts, reasons: dict[PoolKey, str]
    ) -> IlpResult | None:
        period = int(math.floor(obs.now / self.plan_interval_s))
        failed = self._plan is not None and self._plan.status in ("infeasible", "error")
        if (
            period != self._period
            or self._plan is None
            # a failed plan is retried after a minute, not left standing for the hour
            or (failed and obs.now - self._planned_at >= self.retry_s)
        ):
            self._plan = self._replan(obs)
            self._period = period
            self._planned_at = obs.now
        plan = self._plan
        if plan.status in ("infeasible", "error"):
            for key in obs.pool_keys():
                reasons[key] = f"no plan ({plan.status}): {plan.message}"
            return plan
        keys = sorted(obs.pool_keys() | {PoolKey(c.model, c.pool) for c in plan.targets})
        period_end = (period + 1) * self.plan_interval_s
        in_correction = obs.now >= period_end - self.correction_window_s
        for key in keys:
            want = {c: n for c, n in plan.targets.items() if (c.model, c.pool) == key}
            target = sum(want.values())
            if self.mode == "LT-I":
                below_floor = target < counts.floor(key)
                for c, n in want.items():
                    # under a scale-up floor only the plan's additions are applied
                    counts.now[c] = max(n, counts.now.get(c, 0)) if below_floor else n
                reasons[key] = f"LT-I: plan count {target}" + (
                    f"; held at ≥ {counts.floor(key)} (QLM scale-up)" if below_floor else ""
                )
                continue
            self._paced_step(obs, counts, reasons, key, want, target, in_correction)
        if plan.status == "capped":
            for key, short in plan.shortfall_tpm.items():
                reasons[key] = (
                    reasons.get(key, "") + f"; capacity cap reached ({short:.0f} tpm short)"
                )
        return plan

    def _paced_step(
        self,
        obs: CapacityObservation,
        counts: _Counts,
        reasons: dict[PoolKey, str],
        key: PoolKey,
        want: dict[Cell, int],
        target: int,
        in_correction: bool,
    ) -> None:
        u = obs.utilisation.get(key)
        cur = counts.total(key)
        if u is None:
            reasons[key] = f"{self.mode}: no utilisation reported; holding {cur} (plan {target})"
            return
        if obs.now - self._last_step.get(key, -math.inf) < self.cooldown_s:
            reasons[key] = f"{self.mode}: cooldown"
            return
        deficit = sorted(
            (c for c in want if want[c] > counts.now.get(c, 0)),
            key=lambda c: -(want[c] - counts.now.get(c, 0)),
        )
        surplus = sorted(
            (c for c in counts.now if (c.model, c.pool) == key and counts.now[c] > want.get(c, 0)),
            key=lambda c: -(counts.now[c] - want.get(c, 0)),
        )
        stepped: Cell | None = None
        why = f"{self.mode}: utilisation {u:.2f}, count {cur}, plan {target}"
        if u > self.up_threshold and cur < target:
            stepped = counts.step_up(key, deficit)
            why += "; +1 towards plan" if stepped else "; capacity cap reached"
        elif u < self.down_threshold and cur > target:
            stepped = counts.step_down(key, surplus)
            why += "; -1 towards plan" if stepped else "; at minimum"
        elif self.mode == "LT-UA" and in_correction:
            f = obs.forecasts.get(key)
            seen = obs.observed_tpm.get(key)
            if f is not None and seen is not None:
                pred = f.predicted_tpm(obs.now)
                ratio = math.inf if pred <= 0 and seen > 0 else (seen / pred if pred > 0 else 1.0)
                if u > self.up_threshold and cur >= target and ratio >= self.burst_ratio:
                    stepped = counts.step_up(key)
                    why += f"; observed/forecast {ratio:.1f} ≥ {self.burst_ratio:g}: +1 past plan"
                elif u < self.down_threshold and cur <= target and ratio <= self.lull_ratio:
                    stepped = counts.step_down(key)
                    why += f"; observed/forecast {ratio:.2f} ≤ {self.lull_ratio:g}: -1 past plan"
        if stepped is not None:
            self._last_step[key] = obs.now
        reasons[key] = why


class ReactivePolicy(CapacityPolicy):
    """SageServe's "Unified Reactive" baseline (§4, §7.1): per (model, pool), one instance out
    when effective memory utilisation is above ``up_threshold`` (70 %), one in below
    ``down_threshold`` (30 %), at most one scaling event per ``cooldown_s`` (15 s). Out on the
    cheapest GPU type per token with room; in from the dearest."""

    name = "reactive"

    def __init__(
        self,
        spec: CapacitySpec,
        *,
        up_threshold: float = 0.7,
        down_threshold: float = 0.3,
        cooldown_s: float = 15.0,
        scale_up_hold_s: float = 600.0,
    ) -> None:
        super().__init__(spec, scale_up_hold_s=scale_up_hold_s)
        if not 0 <= down_threshold < up_threshold:
            raise ValueError("need 0 ≤ down_threshold < up_threshold")
        self.up_threshold = up_threshold
        self.down_threshold = down_threshold
        self.cooldown_s = cooldown_s
        self._last_step: dict[PoolKey, float] = {}

    def _decide(
        self, obs: CapacityObservation, counts: _Counts, reasons: dict[PoolKey, str]
    ) -> IlpResult | None:
        for key, u in sorted(obs.utilisation.items()):
            if obs.now - self._last_step.get(key, -math.inf) < self.cooldown_s:
                reasons[key] = f"reactive: utilisation {u:.2f}; cooldown"
                continue
            stepped: Cell | None = None
            why = f"reactive: utilisation {u:.2f}"
            if u > self.up_threshold:
                stepped = counts.step_up(key)
                why += "; +1" if stepped else "; capacity cap reached"
            elif u < self.down_threshold:
                stepped = counts.step_down(key)
                why += "; -1" if stepped else "; at minimum"
            if stepped is not None:
                self._last_step[key] = obs.now
            reasons[key] = why
        return None


def cato_counts_violation(
    *,
    remaining_completion_s: float,
    remaining_slack_s: float,
    last_elapsed_s: float,
    node_target_s: float,
    max_exceeded_proportion: float = 0.0,
    idle_replicas: int = 0,
) -> bool:
    """CATO Algorithm 2, lines (1)-(4), for one finished LLM call: does it count as an SLA
    violation? Late work with idle replicas is not a capacity problem (the guard returns); a
    call counts when the task can no longer finish in its slack and the call overran its node
    target by at least ``max_exceeded_proportion`` (the paper's value is ambiguous: 0 counts
    any overrun)."""
    if remaining_slack_s < 0 and idle_replicas > 0:
        return False
    if remaining_completion_s <= remaining_slack_s:
        return False
    if node_target_s <= 0:
        return last_elapsed_s > 0
    return (last_elapsed_s - node_target_s) / node_target_s >= max_exceeded_proportion


class CatoPolicy(CapacityPolicy):
    """CATO's provisioner (Algorithm 2), per (model, pool): violations counted over a sliding
    ``window_s``; when the count exceeds ``max_exceeded_times`` and the idle instances, scale out
    by (count − idle), capped at the maximum (``spec.max_instances`` or ``max_replicas``), and
    reset the count. An instance idle for ``idle_timeout_s`` is removed (one per timeout, down to
    the minimum). The paper gives no idle timeout; 300 s is ours."""

    name = "cato"

    def __init__(
        self,
        spec: CapacitySpec,
        *,
        window_s: float = 60.0,
        max_exceeded_times: int = 1,
        max_replicas: int = 6,
        idle_timeout_s: float = 300.0,
        scale_up_hold_s: float = 600.0,
    ) -> None:
        super().__init__(spec, scale_up_hold_s=scale_up_hold_s)
        self.window_s = window_s
        self.max_exceeded_times = max_exceeded_times
        self.max_replicas = max_replicas
        self.idle_timeout_s = idle_timeout_s
        self._violations: dict[PoolKey, deque[tuple[float, int]]] = {}
        self._idle_since: dict[PoolKey, float] = {}

    def exceeded_times(self, key: PoolKey) -> int:
        return sum(n for _, n in self._violations.get(key, ()))

    def _decide(
        self, obs: CapacityObservation, counts: _Counts, reasons: dict[PoolKey, str]
    ) -> IlpResult | None:
        for key, n in obs.sla_violations.items():
            if n > 0:
                self._violations.setdefault(key, deque()).append((obs.now, int(n)))
        for key in sorted(obs.pool_keys() | set(self._violations)):
            window = self._violations.get(key)
            while window and window[0][0] <= obs.now - self.window_s:
                window.popleft()
            count = self.exceeded_times(key)
            idle = int(obs.idle_instances.get(key, 0))
            existing = counts.total(key)
            cap = self.spec.max_for(key)
            cap = self.max_replicas if cap is None else cap
            why = (
                f"cato: {count} violations in {self.window_s:g} s, {idle} idle, "
                f"{existing} instances"
            )
            if count > self.max_exceeded_times and count > idle:
                want = min(cap - existing, count - idle)
                got = 0
                while got < want and counts.step_up(key) is not None:
                    got += 1
                why += f"; +{got}" + ("" if got == want else " (capacity cap reached)")
                if window is not None:
                    window.clear()
            if idle > 0:
                since = self._idle_since.setdefault(key, obs.now)
                if obs.now - since >= self.idle_timeout_s and counts.step_down(key) is not None:
                    why += f"; -1 (idle ≥ {self.idle_timeout_s:g} s)"
                    self._idle_since[key] = obs.now
            else:
                self._idle_since.pop(key, None)
            reasons[key] = why
        return None


def scale_up_from_plan(meta: Mapping[str, Any], pool: str) -> dict[PoolKey, int]:
    """QLM's infeasibility signal → ``{(model, pool): 1}`` for every model the stochastic
    planner's recommendation names (``plan.meta["scale_up"]``, planner/stochastic.py
    ``_scale_up``; the whole ``plan.meta`` is accepted too). The recommendation counts GPUs of
    one type to clone a template instance; the forecast-driven policies size volume themselves,
    so the signal only guarantees one step up per named model."""
    su = meta.get("scale_up", meta)
    if not isinstance(su, Mapping) or not su.get("needed"):
        return {}
    rec = su.get("recommendation")
    if not isinstance(rec, Mapping):
        return {}
    return {PoolKey(str(m), pool): 1 for m in rec.get("models") or ()}


CAPACITY_POLICIES: dict[str, Callable[..., CapacityPolicy]] = {
    "lt-i": lambda spec, **kw: SageServePolicy(spec, "LT-I", **kw),
    "lt-u": lambda spec, **kw: SageServePolicy(spec, "LT-U", **kw),
    "lt-ua": lambda spec, **kw: SageServePolicy(spec, "LT-UA", **kw),
    "reactive": ReactivePolicy,
    "cato": CatoPolicy,
}


def create_capacity_policy(name: str, spec: CapacitySpec, **kwargs: Any) -> CapacityPolicy:
    """Build a capacity policy by name (``lt-i``, ``lt-u``, ``lt-ua``, ``reactive``, ``cato``);
    keyword arguments go to its constructor."""
    try:
        factory = CAPACITY_POLICIES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown capacity policy {name!r}; choose from {sorted(CAPACITY_POLICIES)}"
        ) from None
    return factory(spec, **kwargs)


__all__ = [
    "CAPACITY_POLICIES",
    "CapacityDecision",
    "CapacityObservation",
    "CapacityPolicy",
    "CapacitySpec",
    "CatoPolicy",
    "Cell",
    "IlpResult",
    "InstanceProfile",
    "PoolKey",
    "ReactivePolicy",
    "SageServePolicy",
    "cato_counts_violation",
    "create_capacity_policy",
    "scale_up_from_plan",
    "solve_capacity_ilp",
]
