"""The local search over group plans (QLM §7's improvement step, docs/planner.md §5).

A plan is one queue of groups per instance (:class:`~qlm.planner.milp.GroupProblem`). The
search moves one group at a time to the position of any eligible queue that raises the plan's
score most, until no move does or its budget is spent; :func:`iterated_local_search` perturbs
and descends again on small problems.

Most of the work is scoring moves, and the problems are small (a few to a few dozen groups
per queue), where a numpy call costs far more than its arithmetic. So every score is computed
in batches: all the positions of a queue at once (:func:`_insertion_scores_rows`), every
group of the other queues into one queue at once (:func:`_into_queue`), and every way to
take a group out of a queue and put it back at once (:func:`_removal_scores`). A queue's
batches are kept from one sweep to the next while the queue is unchanged (a move changes two
queues), and the descents of one iterated local search share them (:class:`_Seen`): they keep
coming back to the queues of the best plan. The batches compute each score with the same
floating-point operations, in the same order, as scoring that one queue alone, so the search
takes the same moves as one that scores each candidate queue in turn
(tests/unit/test_planner.py checks this to the bit).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from qlm.planner.milp import (
    SWITCH_WEIGHT,
    TARDINESS_WEIGHT,
    GroupProblem,
    count_switches,
    evaluate_queues,
    queue_times,
)

# Perturbation rounds in a row without a better plan after which the iterated local search
# stops, before its round limit or budget. On the simulator's scenarios (seed 0, ten of them)
# every improvement came within 18 stalled rounds of the one before, while the rounds after
# that took most of the planner's time on small problems: a replan of 50 requests ran 40
# rounds (a median of 65 ms) to keep the plan it had found in the first few
# (docs/planner.md, section 5).
ILS_STALL_ROUNDS = 20

# Cells (row, position, queued group) scored in one numpy pass: at most this many at once
# (8 MB per temporary). Rows beyond it are scored in chunks; a row's scores do not depend on
# the chunk it is in.
MANY_CELLS = 1 << 20

_K = TypeVar("_K")
_V = TypeVar("_V")


class WorkClock:
    """A deterministic stand-in for ``time.perf_counter``: every reading advances it by ``tick``
    seconds, so a time budget becomes a fixed amount of work. The cluster simulator plans with
    it, which makes its runs reproducible on any machine (live, the wall clock is used)."""

    def __init__(self, tick: float = 1e-4) -> None:
        self.tick = tick
        self.now = 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _queue_score(p: GroupProblem, g: int, order: Sequence[int]) -> float:
    """The score of one queue: requests met, less tardiness and switches (the objective)."""
    if not order:
        return 0.0
    c = queue_times(p, g, order)
    idx = list(order)
    dl = p.deadline[idx]
    met = float(p.weight[idx][c <= dl].sum())
    late = np.maximum(c - dl, 0.0)
    return (
        met
        - TARDINESS_WEIGHT * float(late[np.isfinite(late)].sum())
        - SWITCH_WEIGHT * count_switches(p, g, order)
    )


@dataclass(frozen=True)
class _QueueTerms:
    """What :func:`_insertion_scores_rows` needs of ``rows`` queues of ``n`` groups on one
    instance whatever group goes in (one row per queue; a single queue is one row)."""

    n: int
    rows: int
    models: np.ndarray  # (rows, n) each group's model
    prev: np.ndarray  # (rows, n + 1) the model before each position (init_model first)
    sw_ev: np.ndarray  # (rows, n) a switch into each group
    sw_cost: np.ndarray  # (rows, n) its cost
    start: np.ndarray  # (rows, n + 1) when each position starts
    done: np.ndarray  # (rows, n) each group's completion
    dl: np.ndarray  # (rows, n) deadlines
    w: np.ndarray  # (rows, n) weights
    pre_met: np.ndarray  # (rows, n + 1) met weight of the groups before each position
    pre_late: np.ndarray  # (rows, n + 1) their tardiness
    after: np.ndarray  # (n + 1, n) group j is at or after position k
    events: np.ndarray  # (rows, 1) switch events of each queue as it is

    def take(self, a: int, b: int) -> _QueueTerms:
        """Rows ``a`` to ``b`` (all of them when there is one)."""
        if self.rows == 1:
            return self
        return _QueueTerms(
            self.n,
            len(self.models[a:b]),
            self.models[a:b],
            self.prev[a:b],
            self.sw_ev[a:b],
            self.sw_cost[a:b],
            self.start[a:b],
            self.done[a:b],
            self.dl[a:b],
            self.w[a:b],
            self.pre_met[a:b],
            self.pre_late[a:b],
            self.after,
            self.events[a:b],
        )


def _queue_terms_rows(p: GroupProblem, g: int, idx: np.ndarray) -> _QueueTerms:
    """The terms of each row of ``idx`` (rows, n): a queue of groups on instance ``g``."""
    rows, n = idx.shape
    models = p.model[idx].astype(np.int64)
    prev = np.concatenate((np.full((rows, 1), int(p.init_model[g]), dtype=np.int64), models), 1)
    switch_g = p.switch[g]
    # switch events and costs of the queue as it is, into each of its groups
    sw_ev = (prev[:, :n] != -1) & (prev[:, :n] != models)
    sw_cost = np.where(sw_ev, switch_g[models], 0.0)
    dur, own = p.dur[idx, g], p.own[idx, g]
    zero = np.zeros((rows, 1))
    start = p.base[g] + np.concatenate((zero, np.cumsum(sw_cost + dur, axis=1)), 1)
    done = start[:, :n] + sw_cost + own
    dl, w = p.deadline[idx], p.weight[idx]
    met0 = np.where(done <= dl, w, 0.0)
    late0 = np.maximum(done - dl, 0.0)
    late0 = np.where(np.isfinite(late0), late0, 0.0)
    pre_met = np.concatenate((zero, np.cumsum(met0, axis=1)), 1)
    pre_late = np.concatenate((zero, np.cumsum(late0, axis=1)), 1)
    after = np.arange(n)[None, :] >= np.arange(n + 1)[:, None]
    events = sw_ev.sum(axis=1, keepdims=True)
    return _QueueTerms(
        n, rows, models, prev, sw_ev, sw_cost, start, done, dl, w, pre_met, pre_late, after, events
    )


def _queue_terms(p: GroupProblem, g: int, target: Sequence[int]) -> _QueueTerms:
    """The terms of one queue (one row)."""
    return _queue_terms_rows(p, g, np.asarray(target, dtype=np.int64).reshape(1, len(target)))


def _insertion_scores_rows(
    p: GroupProblem, g: int, q: _QueueTerms, groups: np.ndarray
) -> np.ndarray:
    """The score of the queue with group ``groups[r]`` inserted at each position ``k`` of
    0..n, one row per group (B, n + 1): into row ``r`` of ``q``, or into its one queue.

    One vectorised pass: the groups before ``k`` keep their completions; the ones from ``k``
    on shift by the same amount, the group's own switch and occupancy plus the change of the
    switch into the group at ``k`` (its predecessor's model is now the inserted group's)."""
    n = q.n
    out = np.empty((len(groups), n + 1))
    step = max(1, MANY_CELLS // ((n + 1) * max(n, 1)))
    switch_g = p.switch[g]
    for a in range(0, len(groups), step):
        ii = groups[a : a + step]
        t = q.take(a, a + step)
        mi = p.model[ii].astype(np.int64)[:, None]  # (B, 1)
        # i at each position: its switch from the model before, then the change of the next
        # switch (its predecessor's model is now i's)
        i_ev = (t.prev != -1) & (t.prev != mi)  # (B, n+1)
        i_sw = np.where(i_ev, switch_g[mi], 0.0)
        nxt_cost = np.zeros((len(ii), n + 1))
        other = t.models != mi  # (B, n)
        if n:
            nxt_cost[:, :n] = np.where(other, switch_g[t.models], 0.0) - t.sw_cost
        # what every group from the position on moves, and i's own completion there
        shift = i_sw + p.dur[ii, g][:, None] + nxt_cost
        c_i = t.start + i_sw + p.own[ii, g][:, None]
        # met weight and tardiness of the unchanged prefix, then of the shifted suffix
        shifted = t.done[:, None, :] + shift[:, :, None]  # (B, n+1, n)
        dl = t.dl[:, None, :]
        suf_met = np.where(t.after & (shifted <= dl), t.w[:, None, :], 0.0).sum(axis=2)
        late = np.maximum(shifted - dl, 0.0)
        suf_late = np.where(t.after & np.isfinite(late), late, 0.0).sum(axis=2)
        di = p.deadline[ii][:, None]
        met_i = np.where(c_i <= di, p.weight[ii].astype(np.float64)[:, None], 0.0)
        late_i = np.maximum(c_i - di, 0.0)
        late_i = np.where(np.isfinite(late_i), late_i, 0.0)
        # switch events: the queue's, less the one into the group at the position (replaced
        # by the one from i into it), plus i's own
        events = t.events + i_ev.astype(np.int64)
        if n:
            events[:, :n] += other.astype(np.int64) - t.sw_ev.astype(np.int64)
        met = t.pre_met + suf_met + met_i
        tard = t.pre_late + suf_late + late_i
        out[a : a + step] = met - TARDINESS_WEIGHT * tard - SWITCH_WEIGHT * events
    return out


def _insertion_scores_many(
    p: GroupProblem, g: int, q: _QueueTerms, groups: np.ndarray
) -> np.ndarray:
    """Each of ``groups`` inserted at every position of the one queue whose terms are ``q``."""
    return _insertion_scores_rows(p, g, q, groups)


def _insertion_scores(p: GroupProblem, g: int, target: Sequence[int], i: int) -> np.ndarray:
    """``_queue_score(p, g, target[:k] + [i] + target[k:])`` for every ``k`` in
    0..len(target) (up to rounding: the sums are taken in another order)."""
    terms = _queue_terms(p, g, target)
    return _insertion_scores_rows(p, g, terms, np.array([i], dtype=np.int64))[0]


def _into_queue(
    p: GroupProblem, g: int, queues: list[list[int]]
) -> tuple[dict[int, int], np.ndarray]:
    """Every group of the other queues that ``g`` serves, scored at every position of ``g``'s
    queue: (the row of each group, the scores)."""
    groups = [i for h, q in enumerate(queues) if h != g for i in q if p.eligible[i, g]]
    table = _insertion_scores_many(
        p, g, _queue_terms(p, g, queues[g]), np.asarray(groups, dtype=np.int64)
    )
    return {i: r for r, i in enumerate(groups)}, table


def _rest_scores(p: GroupProblem, g: int, rests: np.ndarray) -> np.ndarray:
    """:func:`_queue_score` of each row of ``rests`` (rows, n), with its arithmetic: the
    completions accumulate along the queue as :func:`queue_times` does (one column at a time
    for every row), then each row's sums are taken over its own met and late groups."""
    rows, n = rests.shape
    if n == 0:
        return np.zeros(rows)
    switch_g = p.switch[g]
    models = p.model[rests].astype(np.int64)
    own, dur, dl = p.own[rests, g], p.dur[rests, g], p.deadline[rests]
    done = np.empty((rows, n))
    t = np.full(rows, float(p.base[g]))
    current = np.full(rows, int(p.init_model[g]), dtype=np.int64)
    switches = np.zeros(rows, dtype=np.int64)
    for j in range(n):
        m = models[:, j]
        ev = (current != -1) & (m != current)
        t = np.where(ev, t + switch_g[m], t)
        switches += ev
        done[:, j] = t + own[:, j]
        t = t + dur[:, j]
        current = m
    met_mask = done <= dl
    late = np.maximum(done - dl, 0.0)
    finite = np.isfinite(late)
    weight = p.weight[rests]
    out = np.empty(rows)
    for r in range(rows):
        met = float(weight[r][met_mask[r]].sum())
        tard = float(late[r][finite[r]].sum())
        out[r] = met - TARDINESS_WEIGHT * tard - SWITCH_WEIGHT * int(switches[r])
    return out


@dataclass(frozen=True)
class _Removals:
    """Every way to take one group out of a queue: the score of the queue left (one per
    position) and of putting the group back at each position of it (one row per position)."""

    rest: np.ndarray  # (n,)
    back: np.ndarray  # (n, n)


def _removal_scores(p: GroupProblem, g: int, queue: Sequence[int]) -> _Removals:
    n = len(queue)
    idx = np.asarray(queue, dtype=np.int64)
    rests = np.broadcast_to(idx, (n, n))[~np.eye(n, dtype=bool)].reshape(n, n - 1)
    back = _insertion_scores_rows(p, g, _queue_terms_rows(p, g, rests), idx)
    return _Removals(_rest_scores(p, g, rests), back)


class _Seen:
    """Scores of queues already seen by the descents of one iterated local search, keyed by
    (instance, the queue's groups in order). The descents keep coming back to the same
    queues (the best plan's, most rounds): its batches are computed once. A queue's
    batches depend on nothing but the queue (``_into_queue``'s candidates are every group
    of the other queues, i.e. every placed group not in it), so a stored one is what
    computing it again would give, to the bit, and the search takes the same moves."""

    def __init__(self) -> None:
        self.score: dict[tuple[int, tuple[int, ...]], float] = {}
        self.removals: dict[tuple[int, tuple[int, ...]], _Removals] = {}
        self.into: dict[tuple[int, tuple[int, ...]], tuple[dict[int, int], np.ndarray]] = {}

    def queue_score(self, p: GroupProblem, g: int, q: list[int]) -> float:
        return _kept(self.score, (g, tuple(q)), lambda: _queue_score(p, g, q))

    def removal_scores(self, p: GroupProblem, g: int, q: list[int]) -> _Removals:
        return _kept(self.removals, (g, tuple(q)), lambda: _removal_scores(p, g, q))

    def into_queue(
        self, p: GroupProblem, g: int, queues: list[list[int]]
    ) -> tuple[dict[int, int], np.ndarray]:
        return _kept(self.into, (g, tuple(queues[g])), lambda: _into_queue(p, g, queues))


def _kept(table: dict[_K, _V], key: _K, compute: Callable[[], _V]) -> _V:
    """``table[key]``, computed and kept the first time."""
    got = table.get(key)
    if got is None:
        got = table[key] = compute()
    return got


def local_search(
    p: GroupProblem,
    queues: list[list[int]],
    *,
    deadline_s: float,
    max_groups: int = 400,
    clock: Callable[[], float] = time.perf_counter,
    seen: _Seen | None = None,
) -> list[list[int]]:
    """Best-improvement relocation: move one group to any position of any eligible queue while
    that raises the score; stops at a local optimum or at ``deadline_s`` (read on ``clock``).

    The clock is read once per (group, destination): reading it once per group let a long
    queue run far past the budget (a :class:`WorkClock` then bounded nothing: wa's replans
    took 11 s of work each). The scores behind those readings are computed in batches per
    queue (module docstring), which changes what a reading costs, not what the search does."""
    if p.n_groups > max_groups:
        return queues
    seen = _Seen() if seen is None else seen
    queues = [list(q) for q in queues]
    scores = [seen.queue_score(p, g, q) for g, q in enumerate(queues)]
    # per queue, kept while it is unchanged: its groups taken out and put back, and the
    # groups of the other queues put in (the set of those does not change while it does not)
    removals: dict[int, _Removals] = {}
    into: dict[int, tuple[dict[int, int], np.ndarray]] = {}
    destinations = [np.flatnonzero(row).tolist() for row in p.eligible]
    improved = True
    out_of_time = False
    while improved and not out_of_time and clock() < deadline_s:
        improved = False
        best: tuple[float, int, int, int, int] | None = None
        for src, q in enumerate(queues):
            if not q:
                continue
            out = removals.get(src)
            if out is None:
                out = removals[src] = seen.removal_scores(p, src, q)
            for pos, i in enumerate(q):
                for dst in destinations[i]:
                    if clock() > deadline_s:
                        out_of_time = True
                        break
                    if dst == src:
                        old, kept = scores[src], 0.0
                        gains = out.back[pos] + kept - old
                        gains[pos] = -np.inf  # back where it was: no move
                    else:
                        old, kept = scores[src] + scores[dst], float(out.rest[pos])
                        there = into.get(dst)
                        if there is None:
                            there = into[dst] = seen.into_queue(p, dst, queues)
                        row, table = there
                        gains = table[row[i]] + kept - old
                    ins = int(gains.argmax())
                    gain = float(gains[ins])
                    if gain > 1e-9 and (best is None or gain > best[0]):
                        best = (gain, src, pos, dst, ins)
                if out_of_time:
                    break
            if out_of_time:
                break
        if best is not None:
            _, src, pos, dst, ins = best
            i = queues[src].pop(pos)
            queues[dst].insert(ins, i)
            for g in (src, dst):
                scores[g] = seen.queue_score(p, g, queues[g])
                removals.pop(g, None)
                into.pop(g, None)
            improved = True
    return queues


def iterated_local_search(
    p: GroupProblem,
    queues: list[list[int]],
    *,
    deadline_s: float,
    rounds: int = 40,
    stall_rounds: int = ILS_STALL_ROUNDS,
    max_groups: int = 60,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> list[list[int]]:
    """For small problems: perturb the best plan (move a few random groups to random eligible
    positions, seeded) and descend again; keep strict improvements. Escapes the local optima
    that one descent stops in (needed to stay within 2 % of the exact MILP on ≤ 20 groups).
    Stops after ``rounds``, at ``deadline_s``, or after ``stall_rounds`` rounds in a row that
    found nothing better."""
    seen = _Seen()
    best = local_search(p, queues, deadline_s=deadline_s, clock=clock, seen=seen)
    if p.n_groups > max_groups or p.n_groups < 2:
        return best
    best_score = evaluate_queues(p, best).score
    rng = np.random.default_rng(seed)
    stalled = 0
    for _ in range(rounds):
        if clock() > deadline_s or stalled >= stall_rounds:
            break
        cand = [list(q) for q in best]
        for _ in range(min(3, p.n_groups)):
            src = [g for g, q in enumerate(cand) if q]
            g = src[int(rng.integers(len(src)))]
            i = cand[g].pop(int(rng.integers(len(cand[g]))))
            dsts = np.flatnonzero(p.eligible[i])
            d = int(dsts[int(rng.integers(len(dsts)))])
            cand[d].insert(int(rng.integers(len(cand[d]) + 1)), i)
        cand = local_search(p, cand, deadline_s=deadline_s, clock=clock, seen=seen)
        score = evaluate_queues(p, cand).score
        if score > best_score + 1e-9:
            best, best_score = cand, score
            stalled = 0
        else:
            stalled += 1
    return best
