"""``qlm bench planner-exact``: the planner's group plan against the exact MILP on small cases.

The issue's bar: on cases small enough to solve exactly (≤ 20 groups), the planner's plan
predicts at most 2 % fewer requests meeting their SLO than a 120 s exact MILP
(:func:`qlm.planner.milp.solve_exact`). A benchmark, not a test
(``tests/unit/test_planner.py`` holds a small, fast version of the same comparison).

**Problems** (:func:`synthetic_problem`, seeded). ``n_groups`` request groups of two models
over ``n_queues`` instances:

* instances alternate a reference speed (1.0) and a faster one (1.6, an H100 next to an
  A100); with three or more, instance 0 serves only model 0 and instance 1 only model 1 (as in
  ``qlm bench planner``), the others serve both; instance ``g`` starts on model ``g % 2``,
  after ``U(0, 2)`` s of running work; a model switch costs 4 s;
* a group holds 4-48 requests; it occupies the instance ``size × U(0.2, 0.6) s / speed``
  (``dur``) and its last member finishes ``U(0.6, 0.9) × dur`` after the group starts;
* tight SLOs: each group's deadline is ``U(0.2, 1.0) × (total occupancy at reference speed /
  n_queues)`` from now, so some groups must miss and the order matters.

**Pipeline** ("ours"): what :meth:`qlm.planner.stochastic.QLMPolicy.plan` runs on its group
problem — :func:`qlm.planner.milp.greedy_assign`, then ``QLMPolicy.improve_groups`` (iterated local
search, then the rolling-horizon head MILP) under the policy's own time budget
(``QLMConfig.time_budget_s``). Both plans are scored by :func:`qlm.planner.milp.evaluate_queues`:
``met`` is the predicted number of requests meeting their SLO (the gap is measured on it),
``score`` adds the tardiness and switch tie-breakers both solvers optimise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from qlm.planner.milp import GroupProblem, evaluate_queues, greedy_assign, solve_exact
from qlm.planner.stochastic import QLMPolicy

log = structlog.get_logger(__name__)

# (groups, queues, seed): 10, 15 and 20 groups over 2-4 queues; about 10 minutes in all here
DEFAULT_CASES: tuple[tuple[int, int, int], ...] = (
    (10, 2, 0),
    (10, 2, 1),
    (10, 3, 1),
    (15, 3, 0),
    (15, 3, 1),
    (15, 4, 1),
    (20, 3, 0),
    (20, 4, 0),
    (20, 4, 1),
)
FAST_SPEED = 1.6
SWITCH_S = 4.0
WITHIN = 0.02  # the bar: at most 2 % below the exact optimum


def synthetic_problem(n_groups: int, n_queues: int, seed: int) -> GroupProblem:
    """A seeded, tight small group problem (see the module docstring)."""
    if n_groups < 1 or n_queues < 1:
        raise ValueError("n_groups and n_queues must be >= 1")
    rng = np.random.default_rng([seed, n_groups, n_queues])
    models = 2
    speed = np.where(np.arange(n_queues) % 2 == 1, FAST_SPEED, 1.0)
    weight = rng.integers(4, 49, n_groups).astype(float)
    model = rng.integers(0, models, n_groups)
    work = weight * rng.uniform(0.2, 0.6, n_groups)  # seconds at reference speed
    dur = work[:, None] / speed[None, :]
    own = dur * rng.uniform(0.6, 0.9, n_groups)[:, None]
    serves = np.ones((n_queues, models), bool)
    if n_queues >= 3:
        serves[0, 1] = False
        serves[1, 0] = False
    eligible = serves[:, model].T
    deadline = rng.uniform(0.2, 1.0, n_groups) * work.sum() / n_queues
    return GroupProblem(
        weight=weight,
        deadline=deadline,
        model=model,
        dur=np.where(eligible, dur, np.inf),
        own=np.where(eligible, own, np.inf),
        eligible=eligible,
        base=rng.uniform(0.0, 2.0, n_queues),
        init_model=np.arange(n_queues) % models,
        switch=np.full((n_queues, models), SWITCH_S),
    )


def milp_ready(p: GroupProblem) -> GroupProblem:
    """``p`` with finite ``dur``/``own`` where a group may not run (the planner, like
    :func:`synthetic_problem`, marks those pairs ``inf``): the MILP forbids those slots anyway,
    but cvxpy rejects a constraint matrix holding inf (``inf * 0``), and ``solve_exact`` would
    return ``solver_error``. Greedy and local search never read those entries."""
    return replace(p, dur=np.where(p.eligible, p.dur, 0.0), own=np.where(p.eligible, p.own, 0.0))


@dataclass
class ExactComparison:
    groups: int
    queues: int
    seed: int
    requests: int
    greedy_met: float
    ours_met: float
    ours_score: float
    ours_s: float
    exact_met: float | None
    exact_score: float | None
    exact_status: str
    exact_optimal: bool
    exact_s: float

    @property
    def gap_pct(self) -> float | None:
        """How far below the exact plan ours is, in % of the exact plan's met requests
        (negative: ours is better, possible only when the exact solve hit its time limit)."""
        if self.exact_met is None or self.exact_met <= 0:
            return None
        return 100.0 * (self.exact_met - self.ours_met) / self.exact_met

    @property
    def within_bar(self) -> bool | None:
        if self.exact_met is None:
            return None
        return self.ours_met >= (1 - WITHIN) * self.exact_met - 1e-9

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.update(gap_pct=self.gap_pct, within_2pct=self.within_bar)
        return d


def compare_case(
    n_groups: int, n_queues: int, seed: int, *, time_limit: float = 120.0
) -> ExactComparison:
    p = synthetic_problem(n_groups, n_queues, seed)
    pol = QLMPolicy()
    t0 = time.perf_counter()
    incumbent = greedy_assign(p)
    ours, _ = pol.improve_groups(p, incumbent, t0 + pol.config.time_budget_s)
    ours_s = time.perf_counter() - t0
    ours_eval = evaluate_queues(p, ours)
    exact = solve_exact(milp_ready(p), time_limit=time_limit)
    exact_eval = evaluate_queues(p, exact.queues) if exact.queues is not None else None
    return ExactComparison(
        groups=n_groups,
        queues=n_queues,
        seed=seed,
        requests=int(p.requests.sum()),
        greedy_met=evaluate_queues(p, incumbent).met_weight,
        ours_met=ours_eval.met_weight,
        ours_score=round(ours_eval.score, 4),
        ours_s=round(ours_s, 3),
        exact_met=exact_eval.met_weight if exact_eval else None,
        exact_score=round(exact_eval.score, 4) if exact_eval else None,
        exact_status=exact.status,
        exact_optimal=exact.status == "optimal",  # cvxpy: HiGHS proved optimality
        exact_s=round(exact.solve_s, 1),
    )


HEADER = (
    f"{'groups':>6} {'queues':>6} {'seed':>4} {'reqs':>5} {'greedy':>6} {'ours':>6} "
    f"{'ours s':>6} {'exact':>6} {'exact s':>7} {'optimal':>7} {'gap %':>6} {'≤2%':>4}"
)


def format_row(c: ExactComparison) -> str:
    gap = f"{c.gap_pct:6.2f}" if c.gap_pct is not None else f"{'-':>6}"
    exact = f"{c.exact_met:6.0f}" if c.exact_met is not None else f"{'-':>6}"
    ok = {True: "yes", False: "NO", None: "-"}[c.within_bar]
    return (
        f"{c.groups:>6} {c.queues:>6} {c.seed:>4} {c.requests:>5} {c.greedy_met:>6.0f} "
        f"{c.ours_met:>6.0f} {c.ours_s:>6.2f} {exact} {c.exact_s:>7.1f} "
        f"{str(c.exact_optimal):>7} {gap} {ok:>4}"
    )


def run_exact_check(
    cases: Iterable[tuple[int, int, int]] = DEFAULT_CASES,
    *,
    time_limit: float = 120.0,
    json_path: Path | None = None,
    echo: Any = print,
) -> dict[str, Any]:
    """What ``qlm bench planner-exact`` runs: one row per (groups, queues, seed)."""
    echo(HEADER)
    rows: list[ExactComparison] = []
    for g, q, s in cases:
        if g > 20:
            log.warning("exact_check_large_case", groups=g, note="the bar is for <= 20 groups")
        row = compare_case(g, q, s, time_limit=time_limit)
        echo(format_row(row))
        rows.append(row)
    doc = {
        "benchmark": "planner-exact",
        "time_limit_s": time_limit,
        "within": WITHIN,
        "cases": [r.as_dict() for r in rows],
    }
    if json_path is not None:
        json_path.write_text(json.dumps(doc, indent=2))
    return doc


def parse_cases(spec: str) -> list[tuple[int, int, int]]:
    """``"10x2s0,20x4s1"`` -> ``[(10, 2, 0), (20, 4, 1)]`` (groups x queues s seed)."""
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        try:
            g, rest = part.split("x")
            q, s = rest.split("s")
            out.append((int(g), int(q), int(s)))
        except ValueError:
            raise ValueError(
                f"bad case {part!r}: expected GROUPSxQUEUESsSEED, e.g. 15x3s0"
            ) from None
    return out


def default_cases_spec(cases: Sequence[tuple[int, int, int]] = DEFAULT_CASES) -> str:
    return ",".join(f"{g}x{q}s{s}" for g, q, s in cases)
