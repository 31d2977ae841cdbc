"""SHEPHERD-style baseline: an ILP over fixed-size batches, without continuous batching.

The QLM paper (§8) compares against SHEPHERD (Zhang et al., NSDI 2023) configured with dynamic
batching and an ILP for ordering and placement, noting that its formulation "assumes fixed
batches with deterministic execution times" and so cannot use continuous batching. This module
is our reading of that baseline, behind the one :class:`~qlm.policy.QueuePolicy` interface.

Assumptions (ours, stated because the paper gives no formulation):

* **Batches.** Per model, queued requests in earliest-deadline order are cut into batches of a
  fixed size ``B = min(batch_size, smallest max_batch_size of the instances serving the
  model)``. A batch's deadline is its members' earliest; its weight is its size.
* **Execution time** of a batch on an instance is deterministic and *static* (no continuous
  batching): one prefill of all its prompts, then as many decode iterations as its longest
  output, at the batch's size (from :mod:`qlm.engine_model`). Model switches are not modelled.
* **ILP** (a parallel-machine "maximise on-time jobs" program): binary ``y[b, i]`` = batch ``b``
  runs on instance ``i`` and is on time. On-time batches on an instance run in deadline order,
  so ``sum_{b' <= b} p[b', i] y[b', i] <= d_b - now + M (1 - y[b, i])`` for every ``b``; each
  batch is on time on at most one instance; only instances that serve its model. Objective:
  requests in on-time batches. Only the first ``ilp_batches`` batches in deadline order (the
  head) go to the ILP, solved by HiGHS through cvxpy under ``time_limit_s``; the tail is placed
  greedily after them. The ILP answer is used only if HiGHS reports a primal solution
  (``primal_solution_status == 2``), it re-checks as feasible, and it is no worse than the
  greedy head; otherwise the greedy answer stands.
* **Greedy** (the incumbent and the fallback): batches in deadline order, each to the eligible
  instance finishing it earliest; a batch that cannot make its deadline anywhere is late.
* **Queue order** per instance: on-time batches in deadline order, then late ones (deadline
  order), then deadline-less ones. Members keep their EDF order inside a batch.
* **No starvation.** Requests that have waited longer than ``max_wait_s`` go first, oldest
  first, so overload cannot keep a late request at the back forever.
* **Determinism.** Instances enter the ILP in id order and HiGHS is deterministic for a given
  model, so a replan is reproducible whenever the solver finishes inside ``time_limit_s``
  (small heads do); a solve cut off by the clock may differ between runs. The simulator
  builds the policy with ``budget_clock="work"``: the ILP's search then stops after
  ``node_limit`` branch-and-bound nodes instead (the clock limit stays, ten times longer, as a
  safety net only), so a published run reproduces on any machine. On this project's
  development machine the solves the clock cut off had explored 79-258 nodes in their 0.5 s;
  most solve at the root node.
* ``place`` (one arrival) is the EDF key into the least-loaded eligible queue: O(instances).

The virtual queue only carries an order; the batch boundaries are reported in ``Plan.meta``
(the executor still batches continuously, so this baseline models SHEPHERD's *planning*).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from qlm.logging import absorb_highs_banner
from qlm.planner.evaluate import profile_for
from qlm.planner.milp import budget_limits, solver_kwargs
from qlm.policy import Plan, PlanInstance, PlanRequest, QueuePolicy

log = structlog.get_logger(__name__)

PRIMAL_FEASIBLE = 2  # HighsInfo.primal_solution_status for a feasible primal point


@dataclass
class _Batch:
    model: str
    members: list[PlanRequest]
    deadline_rel: float  # seconds from now; inf when no member has a deadline
    times: dict[str, float] = field(default_factory=dict)  # instance_id -> seconds

    @property
    def weight(self) -> int:
        return len(self.members)


def static_batch_time(instance: PlanInstance, model: str, members: Sequence[PlanRequest]) -> float:
    """Seconds to run ``members`` as one fixed batch: prefill all, then decode to the longest."""
    profile = profile_for(instance.gpu_type, model)
    n = len(members)
    prompts = [r.prompt_tokens for r in members]
    longest = max(r.max_tokens for r in members)
    ctx = max(1, round(sum(prompts) / n + longest / 2))
    return profile.prefill_time(max(sum(prompts), 1)) + longest * profile.decode_iteration_time(
        n, ctx
    )


class SHEPHERDPolicy(QueuePolicy):
    """Fixed-size batches placed and ordered by a time-limited ILP (see the module docstring)."""

    name = "shepherd"
    keeps_state = "when it last planned and the arrivals since (wants_replan reads them)"

    def __init__(
        self,
        batch_size: int = 16,
        ilp_batches: int = 32,
        time_limit_s: float = 0.5,
        max_wait_s: float = 600.0,
        replan_every_s: float = 5.0,
        budget_clock: str = "wall",
        node_limit: int = 200,
    ) -> None:
        if batch_size < 1 or ilp_batches < 0 or time_limit_s <= 0 or max_wait_s <= 0:
            raise ValueError("batch_size >= 1, ilp_batches >= 0, time limits > 0 required")
        if budget_clock not in ("wall", "work") or node_limit < 1:
            raise ValueError("budget_clock is 'wall' or 'work', node_limit >= 1")
        self.batch_size = batch_size
        self.static_batch_size = batch_size
        self.ilp_batches = ilp_batches
        self.time_limit_s = time_limit_s
        # "work": the ILP stops at node_limit nodes, the same search on any machine (module
        # docstring, Determinism)
        self.budget_clock = budget_clock
        self.node_limit = node_limit
        self.max_wait_s = max_wait_s
        # SHEPHERD plans periodically (its batches are formed from what queued since): ask for
        # a replan once the last one is this old and requests arrived since.
        self.replan_every_s = replan_every_s
        self._planned_at: float | None = None
        self._arrivals_since_plan = 0
        # Import the solver stack once, when the policy is built (coordinator start), so the
        # first replan does not pay ~1 s of imports.
        import cvxpy  # noqa: F401

    def sort_key(self, request: PlanRequest) -> tuple[Any, ...]:
        return (request.effective_deadline, request.arrival_time, request.seq)

    def wants_replan(self, now: float) -> bool:
        if not self._arrivals_since_plan:
            return False
        return self._planned_at is None or now - self._planned_at >= self.replan_every_s

    def place(
        self,
        request: PlanRequest,
        instances: Sequence[PlanInstance],
        load: Mapping[str, float],
        now: float,
    ) -> str | None:
        self._arrivals_since_plan += 1
        return super().place(request, instances, load, now)

    # ------------------------------------------------------------------ plan
    def plan(
        self, requests: Sequence[PlanRequest], instances: Sequence[PlanInstance], now: float
    ) -> Plan:
        self._planned_at, self._arrivals_since_plan = now, 0
        queues: dict[str, list[str]] = {i.instance_id: [] for i in instances}
        unassigned: list[str] = []
        starving: list[PlanRequest] = []
        by_model: dict[str, list[PlanRequest]] = {}
        for req in sorted(requests, key=lambda r: (self.sort_key(r), r.request_id)):
            if now - req.arrival_time > self.max_wait_s:
                starving.append(req)
            else:
                by_model.setdefault(req.model, []).append(req)
        eligible = {
            m: sorted((i for i in instances if i.serves(m)), key=lambda i: i.instance_id)
            for m in {r.model for r in requests}
        }
        # Starving requests lead, oldest first, on their least-loaded eligible queue.
        starving.sort(key=lambda r: (r.arrival_time, r.seq, r.request_id))
        head_count: dict[str, int] = dict.fromkeys(queues, 0)
        for req in starving:
            options = eligible[req.model]
            if not options:
                unassigned.append(req.request_id)
                continue
            target = min(options, key=lambda i: (head_count[i.instance_id], i.instance_id))
            queues[target.instance_id].append(req.request_id)
            head_count[target.instance_id] += 1

        batches: list[_Batch] = []
        for model, reqs in by_model.items():
            options = eligible[model]
            if not options:
                unassigned.extend(r.request_id for r in reqs)
                continue
            size = max(1, min(self.batch_size, min(i.max_batch_size for i in options)))
            for k in range(0, len(reqs), size):
                members = reqs[k : k + size]
                deadline = min(r.effective_deadline for r in members)
                b = _Batch(model, members, deadline - now)
                b.times = {i.instance_id: static_batch_time(i, model, members) for i in options}
                batches.append(b)
        batches.sort(key=lambda b: (b.deadline_rel, self.sort_key(b.members[0])))
        timed = [b for b in batches if math.isfinite(b.deadline_rel)]
        untimed = [b for b in batches if not math.isfinite(b.deadline_rel)]

        finish = dict.fromkeys(queues, 0.0)
        on_time: dict[str, list[_Batch]] = {iid: [] for iid in queues}
        late: list[_Batch] = []
        head, tail = timed[: self.ilp_batches], timed[self.ilp_batches :]
        greedy_head = self._greedy(head, dict(finish))
        solver = "greedy"
        chosen = greedy_head
        if len(head) > 1:
            ilp = self._solve_ilp(head, sorted(queues))
            if ilp is not None and self._weight(ilp) >= self._weight(greedy_head):
                chosen, solver = ilp, "highs"
        for b, iid in zip(head, chosen, strict=True):
            if iid is None:
                late.append(b)
            else:
                on_time[iid].append(b)
                finish[iid] += b.times[iid]
        for b, iid in zip(tail, self._greedy(tail, finish), strict=True):
            if iid is None:
                late.append(b)
            else:
                on_time[iid].append(b)  # _greedy already advanced finish[iid]
        # Late and deadline-less batches go where they finish earliest, after the on-time ones.
        for b in late + untimed:
            iid = min(b.times, key=lambda k: (finish[k] + b.times[k], k))
            finish[iid] += b.times[iid]
            on_time[iid].append(b)
        for iid, blist in on_time.items():
            queues[iid].extend(r.request_id for b in blist for r in b.members)
        return Plan(
            queues=queues,
            unassigned=unassigned,
            policy=self.name,
            meta={
                "solver": solver,
                "batches": len(batches),
                "ilp_batches": len(head),
                "late_batches": len(late),
                "batch_sizes": {iid: [b.weight for b in bl] for iid, bl in on_time.items()},
            },
        )

    @staticmethod
    def _weight(assignment: Sequence[str | None]) -> int:
        return sum(1 for a in assignment if a is not None)

    @staticmethod
    def _greedy(batches: Sequence[_Batch], finish: dict[str, float]) -> list[str | None]:
        """Deadline order, each to the instance finishing it earliest; None = late anywhere.
        Advances ``finish`` for the on-time ones."""
        out: list[str | None] = []
        for b in batches:
            iid = min(b.times, key=lambda k: (finish[k] + b.times[k], k))
            if finish[iid] + b.times[iid] <= b.deadline_rel:
                finish[iid] += b.times[iid]
                out.append(iid)
            else:
                out.append(None)
        return out

    def _solve_ilp(
        self, head: Sequence[_Batch], instance_ids: list[str]
    ) -> list[str | None] | None:
        """The ILP of the module docstring on the head batches; None if no trusted solution."""
        import cvxpy as cp  # already loaded by __init__; kept local so importing planner is cheap

        n, m = len(head), len(instance_ids)
        col = {iid: k for k, iid in enumerate(instance_ids)}
        p = np.zeros((n, m))
        mask = np.zeros((n, m))
        for b_idx, b in enumerate(head):
            for iid, t in b.times.items():
                p[b_idx, col[iid]] = t
                mask[b_idx, col[iid]] = 1.0
        slack = np.array([b.deadline_rel for b in head])
        weight = np.array([b.weight for b in head], dtype=float)
        y = cp.Variable((n, m), boolean=True)
        lower = np.tril(np.ones((n, n)))
        cons = [cp.sum(y, axis=1) <= 1, y <= mask]
        for k in range(m):
            if not mask[:, k].any():
                continue
            big_m = p[:, k].sum() + max(0.0, -slack.min())
            cons.append(lower @ cp.multiply(p[:, k], y[:, k]) <= slack + big_m * (1 - y[:, k]))
        # Among equal request counts, prefer the smaller busiest-instance load (a tie-breaker
        # below one request's worth, so load spreads instead of piling onto one instance).
        busiest = cp.Variable(nonneg=True)
        cons.append(cp.sum(cp.multiply(p, y), axis=0) <= busiest)
        tie = 0.5 / max(p.sum(), 1e-9)
        prob = cp.Problem(cp.Maximize(weight @ cp.sum(y, axis=1) - tie * busiest), cons)
        absorb_highs_banner()  # its banner into a log line, not onto stdout
        try:
            with warnings.catch_warnings():
                # cvxpy warns "may be inaccurate" at the time limit; the status check decides.
                warnings.simplefilter("ignore", UserWarning)
                prob.solve(solver=cp.HIGHS, **self._limits())
        except (cp.error.SolverError, ValueError) as e:
            log.warning("shepherd_ilp_failed", error=str(e))
            return None
        info = getattr(prob.solver_stats, "extra_stats", None)
        status = getattr(info, "primal_solution_status", None)
        if y.value is None or status != PRIMAL_FEASIBLE:
            log.info("shepherd_ilp_no_incumbent", status=prob.status, primal=status)
            return None
        chosen_mat = np.rint(y.value) * mask
        out: list[str | None] = []
        for b_idx in range(n):
            ks = np.flatnonzero(chosen_mat[b_idx])
            out.append(instance_ids[int(ks[0])] if len(ks) else None)
        return out if self._feasible(head, out) else None

    def _limits(self) -> dict[str, object]:
        return solver_kwargs(
            "HIGHS", *budget_limits(self.budget_clock, self.time_limit_s, self.node_limit)
        )

    @staticmethod
    def _feasible(head: Sequence[_Batch], assignment: Sequence[str | None]) -> bool:
        """Re-check an ILP answer: every on-time batch really meets its deadline in order."""
        finish: dict[str, float] = {}
        for b, iid in zip(head, assignment, strict=True):
            if iid is None:
                continue
            if iid not in b.times:
                return False
            finish[iid] = finish.get(iid, 0.0) + b.times[iid]
            if finish[iid] > b.deadline_rel + 1e-6:
                return False
        return True
