"""The request-level EDF walk scans a model's few candidate instances and keeps many sorted by
start; either way it must choose exactly what scanning every candidate chooses: the lowest
(misses, start, position)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import qlm.planner.stochastic as stochastic
from qlm.planner.stochastic import QLMPolicy
from qlm.tooling.bench_planner import NOW, build_instances, build_queue


def _scan_every_candidate(
    policy: QLMPolicy, tab: Any, priced: Any, walkable: np.ndarray, best_lst: np.ndarray
) -> Any:
    """The rule written out: every candidate's start computed for every request."""
    w = policy._walker(tab, priced)
    idx = np.flatnonzero(walkable)
    order = idx[np.lexsort((priced.seq[idx], best_lst[idx], ~tab.prio[idx]))]
    served: dict[int, list[int]] = {}
    for k in order.tolist():
        m = w.model[k]
        cands = served.setdefault(m, tab.served(k))
        best: tuple[bool, float, int] | None = None
        for pos, g in enumerate(cands):
            lane = w.lanes[g]
            switch = 0.0 if lane.model in (-1, m) else w.switch[g][m]
            start = lane.t if lane.model in (-1, m) else max(lane.t, lane.run_end) + switch
            key = (start + w.z * lane.sd > w.lst[g][k], start, pos)
            if best is None or key < best:
                best = key
        # a request that misses everywhere goes where it starts first, unless that is never
        if best is not None and not (best[0] and best[1] == math.inf):
            w.step(cands[best[2]], k)
    return w.result()


class _Checked(QLMPolicy):
    """Runs both walks on every input the planner gives and keeps the pairs."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.pairs: list[tuple[Any, Any]] = []

    def _walk_edf(self, tab: Any, priced: Any, walkable: np.ndarray, best_lst: np.ndarray) -> Any:
        fast = super()._walk_edf(tab, priced, walkable, best_lst)
        self.pairs.append((fast, _scan_every_candidate(self, tab, priced, walkable, best_lst)))
        return fast


def _same(a: Any, b: Any) -> bool:
    return (
        [(lane.kept, lane.later, lane.switches) for lane in a.lanes]
        == [(lane.kept, lane.later, lane.switches) for lane in b.lanes]
        and a.tail == b.tail
        and a.met == b.met
        and math.isclose(a.worth, b.worth, rel_tol=0, abs_tol=0)
        and a.makespan == b.makespan
    )


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    slo=st.sampled_from(["tight", "loose"]),
    n_inst=st.sampled_from([2, 4, 8, 16]),
    scan_up_to=st.sampled_from([0, stochastic.SCAN_LANES_UP_TO]),
    queued=st.integers(20, 300),
    running=st.lists(st.integers(0, 300), min_size=16, max_size=16),
)
def test_sorted_candidates_choose_what_scanning_every_candidate_chooses(
    seed: int, slo: str, n_inst: int, scan_up_to: int, queued: int, running: list[int]
) -> None:
    # busy instances (a full batch delays the first slot; models loaded or not) give lanes
    # different starts and switches, and the eviction probe walks a second time
    insts = [
        replace(i, running=running[g], active_model=i.models[-1] if running[g] else None)
        for g, i in enumerate(build_instances(n_inst))
    ]
    policy = _Checked(budget_clock="work")
    reqs = build_queue(queued, n_inst, slo, seed)
    default, stochastic.SCAN_LANES_UP_TO = stochastic.SCAN_LANES_UP_TO, scan_up_to
    try:
        policy.plan(reqs, insts, NOW)
        policy.plan(reqs[: queued // 2], insts, NOW + 1.0)
    finally:
        stochastic.SCAN_LANES_UP_TO = default
    assert policy.pairs
    for fast, scanned in policy.pairs:
        assert _same(fast, scanned)
