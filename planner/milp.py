"""The group-level planning model (QLM §7, eqs. 6-13) and its solvers.

:class:`GroupProblem` holds, per request group ``i`` and instance ``g``, the *deterministic
equivalents* of the chance-constrained times (see ``docs/planner.md``):

* ``dur[i, g]`` — how long the group holds instance ``g`` (occupancy, eq. 2's tokens / Θ), at
  its Δ-quantile ``μ + z_Δ σ``;
* ``own[i, g]`` — when the group's last member finishes, counted from the group's start
  (eq. 5's max over members), at its Δ-quantile;
* ``switch[g, m]`` — loading model ``m`` on ``g`` (warm from CPU or cold from disk).

A queue's slot ``j`` then completes at ``C_j = base + Σ_{k<j} dur_k + Σ_{k≤j} switch_k + own_j``
(eq. 10). Summing Δ-quantiles bounds the Δ-quantile of the sum from above (σ of a sum ≤ sum
of σ's), so ``C_j ≤ slo`` here implies the chance constraint P(C ≤ slo) ≥ Δ of eq. 12 under
the normal model: a safe, linear deterministic equivalent.

The objective maximises the requests of groups that meet their SLO (weights = group sizes),
minus a small tardiness term (eq. 13's expected penalty) that orders what cannot be met.

Solvers: :func:`greedy_assign` (EDF over groups with model affinity and swap costs, the
incumbent), :func:`solve_slots` (the slot MILP in cvxpy/HiGHS, for one queue's head or a whole
small problem), :func:`solve_exact` (the full MILP, the yardstick for small cases). Every MILP
answer is decoded, checked to be a valid assignment and re-evaluated with
:func:`evaluate_queues`; a time-limited solve without a primal solution is discarded.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import structlog

from qlm.logging import absorb_highs_banner

log = structlog.get_logger(__name__)

TARDINESS_WEIGHT = 1e-3  # per second of lateness, per group: far below one met request
SWITCH_WEIGHT = 1e-3  # per model switch: among equally good plans, fewer switches (affinity)
# Under a work budget (the simulator) a solver stops at a node limit, the same search on any
# machine; its wall-clock limit, this many times the live one, is only a safety net
WORK_SAFETY_FACTOR = 10.0


@dataclass
class GroupProblem:
    weight: np.ndarray  # (G,) requests per group
    deadline: np.ndarray  # (G,) seconds from now (np.inf: no SLO)
    model: np.ndarray  # (G,) model index
    dur: np.ndarray  # (G, I) Δ-quantile occupancy
    own: np.ndarray  # (G, I) Δ-quantile own completion from the group's start
    eligible: np.ndarray  # (G, I) bool
    base: np.ndarray  # (I,) when each queue can start (work already running)
    init_model: np.ndarray  # (I,) model index active at the start, -1: unknown (no switch)
    switch: np.ndarray  # (I, M) seconds to switch to each model
    priority: np.ndarray | None = None  # (G,) groups placed first (starving), bool
    # (G,) requests per group when ``weight`` is not a count (objective = service-gain)
    size: np.ndarray | None = None

    @property
    def requests(self) -> np.ndarray:
        return self.weight if self.size is None else self.size

    @property
    def n_groups(self) -> int:
        return len(self.weight)

    @property
    def n_instances(self) -> int:
        return len(self.base)

    def with_clones(self, template: int, count: int) -> GroupProblem:
        """The same problem with ``count`` idle copies of instance ``template`` added."""
        rep = np.full(count, template)
        return GroupProblem(
            self.weight,
            self.deadline,
            self.model,
            np.hstack([self.dur, self.dur[:, rep]]),
            np.hstack([self.own, self.own[:, rep]]),
            np.hstack([self.eligible, self.eligible[:, rep]]),
            np.concatenate([self.base, np.zeros(count)]),
            np.concatenate([self.init_model, np.full(count, -1)]),
            np.vstack([self.switch, self.switch[rep]]),
            self.priority,
            self.size,
        )


@dataclass
class QueueEval:
    met_weight: float
    tardiness: float
    completion: np.ndarray  # (G,) per group, np.nan if unplaced
    switches: int = 0

    @property
    def score(self) -> float:
        return self.met_weight - TARDINESS_WEIGHT * self.tardiness - SWITCH_WEIGHT * self.switches


def count_switches(p: GroupProblem, g: int, order: Sequence[int]) -> int:
    current, n = int(p.init_model[g]), 0
    for i in order:
        m = int(p.model[i])
        n += current != -1 and m != current
        current = m
    return n


def queue_times(
    p: GroupProblem, g: int, order: Sequence[int], start: float | None = None
) -> np.ndarray:
    """Completion (deterministic equivalent) of each group in ``order`` on instance ``g``."""
    t = p.base[g] if start is None else start
    current = int(p.init_model[g])
    out = np.empty(len(order))
    for k, i in enumerate(order):
        m = int(p.model[i])
        if current != -1 and m != current:
            t += p.switch[g, m]
        current = m
        out[k] = t + p.own[i, g]
        t += p.dur[i, g]
    return out


def evaluate_queues(p: GroupProblem, queues: Sequence[Sequence[int]]) -> QueueEval:
    completion = np.full(p.n_groups, np.nan)
    for g, order in enumerate(queues):
        if len(order):
            completion[list(order)] = queue_times(p, g, order)
    placed = ~np.isnan(completion)
    met = placed & (completion <= p.deadline)
    late = np.where(placed, np.maximum(np.nan_to_num(completion) - p.deadline, 0.0), 0.0)
    late = np.where(np.isfinite(late), late, 0.0)
    switches = sum(count_switches(p, g, q) for g, q in enumerate(queues))
    return QueueEval(float(p.weight[met].sum()), float(late.sum()), completion, switches)


@functools.cache
def _orders(k: int) -> np.ndarray:
    """Every order of ``k`` positions, (k!, k), in ``itertools.permutations`` order."""
    orders = list(itertools.permutations(range(k)))
    return np.array(orders, dtype=np.int64).reshape(len(orders), k)


def head_order_scores(
    p: GroupProblem, g: int, queue: Sequence[int], head: int
) -> tuple[np.ndarray, np.ndarray]:
    """Every order of ``queue``'s first ``head`` groups on instance ``g``, the rest kept as it
    is: (the queues, one row each in ``itertools.permutations`` order of the head; the score
    of each, :func:`evaluate_queues` of that one queue).

    The scores are :func:`evaluate_queues`'s to the bit: the completions accumulate along each
    row as :func:`queue_times` does (a column at a time, every row at once), and each row's
    met weight and tardiness are summed over the same elements in the same order, so a
    choice between equal scores is the one a loop over the orders would make."""
    q = np.asarray(queue, dtype=np.int64)
    h = min(head, len(q))
    orders = _orders(h)
    rows = np.concatenate((q[:h][orders], np.broadcast_to(q[h:], (len(orders), len(q) - h))), 1)
    P, n = rows.shape
    models = p.model[rows].astype(np.int64)
    done = np.empty((P, n))
    t = np.full(P, p.base[g], dtype=np.float64)
    current = np.full(P, int(p.init_model[g]), dtype=np.int64)
    switch_g = p.switch[g]
    for k in range(n):
        m = models[:, k]
        ev = (current != -1) & (m != current)
        t = np.where(ev, t + switch_g[m], t)
        done[:, k] = t + p.own[rows[:, k], g]
        t = t + p.dur[rows[:, k], g]
        current = m
    # evaluate_queues's sums: over the groups in index order (met: the met ones only;
    # tardiness: every group, unplaced ones 0)
    placed = np.sort(q)
    completion = np.take_along_axis(done, np.argsort(rows, axis=1, kind="stable"), 1)
    dl, w = p.deadline[placed], p.weight[placed]
    met = completion <= dl
    late = np.maximum(np.nan_to_num(completion) - dl, 0.0)
    late_full = np.zeros((P, p.n_groups))
    late_full[:, placed] = np.where(np.isfinite(late), late, 0.0)
    init = int(p.init_model[g])
    switches = (models[:, 1:] != models[:, :-1]).sum(axis=1)
    if n and init != -1:
        switches += models[:, 0] != init
    scores = np.empty(P)
    for r in range(P):
        scores[r] = (
            float(w[met[r]].sum())
            - TARDINESS_WEIGHT * float(late_full[r].sum())
            - SWITCH_WEIGHT * int(switches[r])
        )
    return rows, scores


def greedy_assign(p: GroupProblem, *, defer_hopeless: bool = True) -> list[list[int]]:
    """EDF over groups with model affinity: each group, in deadline order, goes to the eligible
    queue where it would complete earliest (its switch cost included, so a queue already on
    its model is preferred). With ``defer_hopeless``, a group that cannot meet its SLO on any
    queue waits until every group that can has been placed (it would only delay them); starving
    groups (``priority``) go first regardless."""
    G, n_inst = p.n_groups, p.n_instances
    queues: list[list[int]] = [[] for _ in range(n_inst)]
    if G == 0 or n_inst == 0:
        return queues
    t_end = p.base.astype(np.float64).copy()
    current = p.init_model.astype(np.int64).copy()
    prio = p.priority if p.priority is not None else np.zeros(G, bool)
    order = np.lexsort((np.arange(G), p.deadline, ~prio))
    cols = np.arange(n_inst)
    deferred: list[int] = []

    def completion(i: int) -> np.ndarray:
        m = int(p.model[i])
        sw = np.where((current != -1) & (current != m), p.switch[cols, m], 0.0)
        return np.where(p.eligible[i], t_end + sw + p.own[i], np.inf)

    def put(i: int, c: np.ndarray) -> None:
        g = int(np.argmin(c))
        m = int(p.model[i])
        if current[g] != -1 and current[g] != m:
            t_end[g] += p.switch[g, m]
        current[g] = m
        t_end[g] += p.dur[i, g]
        queues[g].append(i)

    for i in order:
        i = int(i)
        if not p.eligible[i].any():
            continue
        c = completion(i)
        if defer_hopeless and not prio[i] and not (c <= p.deadline[i]).any():
            deferred.append(i)
            continue
        if not prio[i]:
            # among queues where it meets its SLO take the earliest; np.argmin breaks ties by index
            c = np.where(c <= p.deadline[i], c, np.inf) if (c <= p.deadline[i]).any() else c
        put(i, c)
    for i in deferred:
        put(i, completion(i))
    return queues


# ------------------------------------------------------------------------------- the MILP
@dataclass
class MilpResult:
    queues: list[list[int]] | None  # None: no verified primal solution
    status: str
    solve_s: float
    objective: float | None = None


def budget_limits(
    budget_clock: str, time_limit_s: float, node_limit: int, left: float = math.inf
) -> tuple[float, int | None]:
    """A solve's (time limit, node limit): live, the time limit (at most ``left``, the
    budget left); under a work budget the node limit, the time limit only a safety net."""
    if budget_clock == "work":
        return WORK_SAFETY_FACTOR * time_limit_s, node_limit
    return min(time_limit_s, left), None


def solver_kwargs(solver: str, time_limit: float, node_limit: int | None) -> dict[str, object]:
    if solver == "SCIP":
        params: dict[str, object] = {"limits/time": time_limit}
        if node_limit is not None:
            params["limits/nodes"] = node_limit
        return {"scip_params": params}
    out: dict[str, object] = {"time_limit": time_limit}
    if node_limit is not None:
        out["mip_max_nodes"] = node_limit
    return out


def solve_slots(
    p: GroupProblem,
    groups: Sequence[int],
    instances: Sequence[int],
    slots: int,
    *,
    start: Sequence[float] | None = None,
    init_model: Sequence[int] | None = None,
    time_limit: float = 1.0,
    node_limit: int | None = None,
    solver: str = "HIGHS",
) -> MilpResult:
    """The slot formulation (eqs. 6-12 with the deterministic equivalent): place ``groups`` in
    ``slots`` positions of each of ``instances``. ``start``/``init_model`` override each queue's
    start time and loaded model (the rolling horizon solves a queue's head after a fixed
    prefix). ``node_limit`` also stops the branch and bound after that many nodes: a limit
    of work, not of seconds, so the answer is the same on any machine. Returns verified
    queues (group indices in order) or ``None``."""
    import cvxpy as cp

    t0 = time.perf_counter()
    gi, ins = list(groups), list(instances)
    n, q = len(gi), len(ins)
    if n == 0:
        return MilpResult([[] for _ in ins], "empty", 0.0, 0.0)
    if n > q * slots:
        raise ValueError("more groups than slots")
    models = sorted({int(p.model[i]) for i in gi})
    mpos = {m: k for k, m in enumerate(models)}
    base = np.array([p.base[g] for g in ins] if start is None else list(start), dtype=float)
    init = list(p.init_model[ins]) if init_model is None else list(init_model)
    # Ineligible (group, instance) pairs hold inf; x is fixed to 0 there, but the solver
    # rejects inf coefficients outright, so they become 0 in the model.
    dur = p.dur[np.ix_(gi, ins)]
    own = p.own[np.ix_(gi, ins)]
    elig = p.eligible[np.ix_(gi, ins)]
    dl = p.deadline[gi]
    w = p.weight[gi].astype(float)
    dur = np.where(elig, dur, 0.0)
    own = np.where(elig, own, 0.0)
    finite_dur = dur
    max_sw = float(p.switch[np.ix_(ins, models)].max()) if models else 0.0
    horizon = base.max() + finite_dur.max(axis=1).sum() + n * max_sw + np.where(elig, own, 0).max()
    big_m = float(horizon - min(dl.min(), 0.0) + 1.0) if np.isfinite(dl).any() else horizon + 1.0
    dl_c = np.where(np.isfinite(dl), dl, big_m)  # no SLO: always met

    K = q * slots
    x = cp.Variable((n, K), boolean=True)
    z = cp.Variable((n, K), boolean=True)
    sw = cp.Variable((len(models), K), nonneg=True)
    tard = cp.Variable(K, nonneg=True)
    cons = [cp.sum(x, axis=1) == 1, z <= x]
    # ineligible slots are forbidden outright
    forbid = np.repeat(~elig, slots, axis=1)
    if forbid.any():
        cons.append(x[forbid] == 0)
    model_of = np.zeros((len(models), n))
    for r, i in enumerate(gi):
        model_of[mpos[int(p.model[i])], r] = 1.0
    occ = cp.sum(x, axis=0)
    cons.append(occ <= 1)
    y = model_of @ x  # (M, K): model in each slot
    completions = []
    for a, g in enumerate(ins):
        ks = list(range(a * slots, (a + 1) * slots))
        sw_cost = np.array([p.switch[g, m] for m in models])
        for j, k in enumerate(ks):
            if j > 0:
                cons.append(occ[k] <= occ[ks[j - 1]])
                cons.append(sw[:, k] >= y[:, k] - y[:, ks[j - 1]])
            elif init[a] != -1:
                prev = np.array([1.0 if m == init[a] else 0.0 for m in models])
                cons.append(sw[:, k] >= y[:, k] - prev)
        step = dur[:, a] @ x[:, ks] + sw_cost @ sw[:, ks]  # (slots,) time each slot uses
        cum = cp.cumsum(step)
        c = base[a] + cum + (own[:, a] - dur[:, a]) @ x[:, ks]
        completions.append(c)
        for j, k in enumerate(ks):
            cons.append(c[j] <= dl_c + big_m * (1 - z[:, k]))
            cons.append(tard[k] >= c[j] - dl_c @ x[:, k] - big_m * (1 - occ[k]))
    objective = cp.Maximize(
        w @ cp.sum(z, axis=1) - TARDINESS_WEIGHT * cp.sum(tard) - SWITCH_WEIGHT * cp.sum(sw)
    )
    prob = cp.Problem(objective, cons)
    status = "error"
    absorb_highs_banner()  # its banner into a log line, not onto stdout
    try:
        with warnings.catch_warnings():
            # "solution may be inaccurate" at a time limit: we verify the answer ourselves
            warnings.simplefilter("ignore", UserWarning)
            prob.solve(solver=solver, **solver_kwargs(solver, time_limit, node_limit))
        status = str(prob.status)
    except Exception as exc:  # SolverError without an incumbent (SCIPY/SCIP), numeric trouble
        log.info("milp_solver_failed", error=str(exc)[:200])
        return MilpResult(None, "solver_error", time.perf_counter() - t0)
    extra = getattr(prob.solver_stats, "extra_stats", None)
    primal = _primal_status(extra)
    if x.value is None or primal is False:
        return MilpResult(None, f"{status}:no_primal", time.perf_counter() - t0)
    queues = _decode(x.value, gi, q, slots, elig)
    if queues is None:  # e.g. the bogus all-zero "solution" at a time limit
        return MilpResult(None, f"{status}:infeasible_decode", time.perf_counter() - t0)
    return MilpResult(queues, status, time.perf_counter() - t0, prob.value)


def _primal_status(extra: object) -> bool | None:
    """True/False when HiGHS says whether it holds a feasible primal solution (2 = feasible);
    None when the solver gives no such field (then :func:`_decode` checks feasibility)."""
    status = None
    if extra is not None:
        status = getattr(extra, "primal_solution_status", None)
        if status is None and isinstance(extra, dict):
            status = extra.get("primal_solution_status")
        if status is None:
            info = getattr(extra, "getInfo", None)
            if callable(info):
                status = getattr(info(), "primal_solution_status", None)
    if status is None:
        return None
    return int(status) == 2


def _decode(
    xv: np.ndarray, gi: list[int], q: int, slots: int, elig: np.ndarray
) -> list[list[int]] | None:
    xr = np.rint(np.asarray(xv))
    if not np.allclose(xr.sum(axis=1), 1) or (xr.sum(axis=0) > 1).any():
        return None
    queues: list[list[int]] = []
    for a in range(q):
        block = xr[:, a * slots : (a + 1) * slots]
        order = []
        for j in range(slots):
            rows = np.flatnonzero(block[:, j] > 0.5)
            if len(rows):
                r = int(rows[0])
                if not elig[r, a]:
                    return None
                order.append(gi[r])
        queues.append(order)
    return queues


def solve_exact(
    p: GroupProblem, *, time_limit: float = 120.0, slots: int | None = None, solver: str = "HIGHS"
) -> MilpResult:
    """The whole problem as one MILP: the yardstick for small cases (≤ ~20 groups). Slots per
    queue default to the group count (any queue may hold everything)."""
    L = p.n_groups if slots is None else slots
    return solve_slots(
        p,
        range(p.n_groups),
        range(p.n_instances),
        max(L, math.ceil(p.n_groups / max(p.n_instances, 1))),
        time_limit=time_limit,
        solver=solver,
    )
