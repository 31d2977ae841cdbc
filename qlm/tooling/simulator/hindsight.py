"""A hindsight bound: at most how many requests of a finished workload any scheduler could have
served within their SLOs, knowing every true output length in advance.

It is the optimum of a linear program that relaxes the simulated cluster (docs/simulator.md,
"Hindsight bound", lists every relaxation), so no policy's attainment can exceed it; a policy
that does exposes a bug. A clairvoyant policy would still fall short of it: the program is
fractional, preemptive at no cost, pools every instance of a pool into one machine and ignores
the KV cache and model loads.

**Work.** An engine iteration (qlm.engine_model) lasts
``max(FLOPs / Φ, bytes / β) + comm(tokens) + overhead`` with FLOPs, bytes and the all-reduce
time ``comm`` sums over the tokens it computes, plus the weights read once. It is therefore at
least the compute side and at least the memory side, each a sum of per-token shares:

* every prompt token at position i: ``(2 params + attention(i)) / Φ + comm`` of compute and
  its KV write ``kv / β + comm`` of memory;
* every output token after the first, decoded at context c: ``(2 params + attention(c)) / Φ``
  and ``(kv · c) / β`` plus ``comm``, and, as an iteration decodes at most ``max_num_seqs``
  sequences, ``1 / max_num_seqs`` of the iteration's fixed time (overhead, all-reduce
  latency, and on the memory side the pass over the weights).

A request's work on a resource is the sum of its tokens' shares; tokens recomputed after a
preemption or eviction only add work, so the sum is a lower bound whatever the schedule.

**Program.** ``x_j`` in [0, 1] (request j met), ``y`` the fractions of its work done in time
buckets inside its window [release, deadline] on each pool serving its model (widened to whole
buckets), and for each pool, resource and bucket, the work placed there at most the pool's
instances × the bucket's length. Buckets are dyadic (Δ, 2Δ, 4Δ, ...): a request uses the
coarsest level with about ``buckets_per_window`` buckets across its window, and every bucket
of every level bounds the work of the requests of its level and below inside it (a laminar
family of interval constraints, each true of any real schedule). Requests that cannot make it
even alone on the fastest engine are fixed at 0. ``linprog(method="highs")``, sparse.

Programs of calls are bounded call by call: a call is released no earlier than its program's
start plus its predecessors' solo latencies and think times, and judged against an upper
bound of its derived deadline (a chain step's task deadline minus the producer's remaining
estimate; a tree call's program deadline). Task attainment has no bound here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp
import structlog
from scipy.optimize import linprog

from qlm.engine_model import EngineProfile
from qlm.tooling.simulator.cluster import InstanceSpec, instance_profiles
from qlm.tooling.simulator.workload import SimRequest

log = structlog.get_logger(__name__)

BUCKETS_PER_WINDOW = 16  # a window spans 16-32 buckets of its level: widened by ≤ 2/16
MAX_FINE_BUCKETS = 1 << 16  # the finest level's buckets over the whole horizon, at most
_TIME_EPS = 1e-9  # windows are widened by this before bucketing (never narrowed by rounding)


@dataclass(frozen=True)
class EngineCosts:
    """The coefficients of an engine's iteration time (qlm.engine_model) that the bound needs:
    ``max(flop_s * FLOPs, byte_s * bytes) + comm_token * tokens + fixed``."""

    flop_s: float  # seconds per FLOP at the achieved peak
    byte_s: float  # seconds per byte at the achieved bandwidth
    param_flops: float  # 2 × params: FLOPs per token
    pair_flops: float  # attention FLOPs per query-key pair
    weight_bytes: float
    kv_bytes: float  # KV bytes per token (read by decode, written by prefill)
    comm_token: float  # TP all-reduce seconds per token
    fixed: float  # per iteration: overhead and all-reduce latency
    max_batch: int  # sequences one iteration decodes, at most

    @classmethod
    def of(cls, profile: EngineProfile, max_batch: int | None = None) -> EngineCosts:
        # the profile's own terms, so the bound follows the engine model exactly (a test
        # checks every share against EngineProfile.iteration_time)
        comm0 = profile._tp_comm_time(0)
        return cls(
            flop_s=1.0 / profile._flops_per_s,
            byte_s=1.0 / profile._bytes_per_s,
            param_flops=2.0 * profile.model.params_b * 1e9,
            pair_flops=profile._attention_flops_per_pair,
            weight_bytes=profile.model.weight_bytes,
            kv_bytes=float(profile.kv_bytes_per_token),
            comm_token=profile._tp_comm_time(1) - comm0,
            fixed=profile.iteration_overhead_s + comm0,
            max_batch=max(max_batch or 0, profile.max_num_seqs),
        )

    @classmethod
    def envelope(cls, costs: Sequence[EngineCosts]) -> EngineCosts:
        """Every coefficient at its cheapest: no faster than this on any of the engines, for
        any token (every term is a non-negative coefficient times a non-negative count)."""
        return cls(
            flop_s=min(c.flop_s for c in costs),
            byte_s=min(c.byte_s for c in costs),
            param_flops=min(c.param_flops for c in costs),
            pair_flops=min(c.pair_flops for c in costs),
            weight_bytes=min(c.weight_bytes for c in costs),
            kv_bytes=min(c.kv_bytes for c in costs),
            comm_token=min(c.comm_token for c in costs),
            fixed=min(c.fixed for c in costs),
            max_batch=max(c.max_batch for c in costs),
        )

    # ---- per-request work (seconds of one engine), vectorised over requests -----------

    def prefill_work(self, prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(compute, memory) shares of prefilling prompts of ``prompt`` tokens, chunked or not."""
        p = np.asarray(prompt, dtype=np.float64)
        pairs = p * (p + 1) / 2  # position i attends to i keys, however the prompt is chunked
        comm = self.comm_token * p
        compute = self.flop_s * (self.param_flops * p + self.pair_flops * pairs) + comm
        memory = self.byte_s * self.kv_bytes * p + comm
        return compute, memory

    def decode_work(self, prompt: np.ndarray, output: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(compute, memory) shares of the ``output - 1`` decode steps (the prefill samples the
        first token); step i attends to ``prompt + i`` tokens."""
        p = np.asarray(prompt, dtype=np.float64)
        n = np.maximum(np.asarray(output, dtype=np.float64) - 1, 0)
        contexts = n * p + n * (n + 1) / 2
        per_step = self.comm_token + self.fixed / self.max_batch
        compute = self.flop_s * (self.param_flops * n + self.pair_flops * contexts) + per_step * n
        memory = (
            self.byte_s * (self.weight_bytes * n / self.max_batch + self.kv_bytes * contexts)
            + per_step * n
        )
        return compute, memory

    # ---- a request alone ------------------------------------------------------------

    def solo_prefill(self, prompt: np.ndarray) -> np.ndarray:
        """The prompt's prefill alone in one iteration: no schedule gives a first token
        sooner (more iterations or company only add time)."""
        p = np.asarray(prompt, dtype=np.float64)
        compute = self.flop_s * (self.param_flops * p + self.pair_flops * p * (p + 1) / 2)
        memory = self.byte_s * (self.weight_bytes + self.kv_bytes * p)
        return np.maximum(compute, memory) + self.comm_token * p + self.fixed

    def solo_decode(self, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
        """The ``output - 1`` decode steps alone (batch 1): the sum over i = 1..n of
        ``max(a + b i, c + d i) + e``, in closed form (the larger side switches at most once)."""
        p = np.asarray(prompt, dtype=np.float64)
        n = np.maximum(np.asarray(output, dtype=np.float64) - 1, 0)
        a = self.flop_s * (self.param_flops + self.pair_flops * p)
        b = self.flop_s * self.pair_flops
        c = self.byte_s * (self.weight_bytes + self.kv_bytes * p)
        d = self.byte_s * self.kv_bytes
        return _sum_max_affine(a, b, c, d, n) + n * (self.comm_token + self.fixed)


def _series(alpha: np.ndarray, beta: float, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Σ_{i=lo..hi} (alpha + beta i), 0 where hi < lo."""
    k = np.maximum(hi - lo + 1, 0)
    return k * alpha + beta * k * (lo + hi) / 2


def _sum_max_affine(a: np.ndarray, b: float, c: np.ndarray, d: float, n: np.ndarray) -> np.ndarray:
    """Σ_{i=1..n} max(a + b i, c + d i), element-wise."""
    n = np.floor(n)
    gap = a - c  # compute minus memory at i = 0; the difference changes by (b - d) per step
    slope = b - d
    if slope > 0:  # memory-bound up to the crossing, compute-bound after
        first = np.clip(np.ceil(-gap / slope), 1, n + 1)
        return _series(c, d, np.ones_like(n), first - 1) + _series(a, b, first, n)
    if slope < 0:  # compute-bound up to the crossing, memory-bound after
        last = np.clip(np.floor(-gap / slope), 0, n)
        return _series(a, b, np.ones_like(n), last) + _series(c, d, last + 1, n)
    return np.where(gap >= 0, _series(a, b, np.ones_like(n), n), _series(c, d, np.ones_like(n), n))


# ------------------------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class PoolCapacity:
    """Identical instances: how many, and the engine costs of each model they serve."""

    count: int
    costs: Mapping[str, EngineCosts]


def pools_of(instances: Sequence[InstanceSpec], max_batch: int | None = None) -> list[PoolCapacity]:
    """The cluster's instances grouped into identical ones. ``max_batch``: the largest batch
    cap any column runs with, when above the instances' own (a variant's max_num_seqs)."""
    groups: dict[tuple[Any, ...], list[InstanceSpec]] = {}
    for spec in instances:
        key = (
            spec.gpu_type,
            spec.models,
            spec.tp,
            spec.profiles,
            spec.max_num_seqs,
            spec.max_num_batched_tokens,
        )
        groups.setdefault(key, []).append(spec)
    pools = []
    cache: dict[tuple[str, str, int | None], EngineProfile] = {}
    for members in groups.values():
        profiles = instance_profiles(members[0], cache)
        costs = {m: EngineCosts.of(p, max_batch) for m, p in profiles.items()}
        pools.append(PoolCapacity(len(members), costs))
    return pools


# ------------------------------------------------------------------------------- the bound


@dataclass
class HindsightBound:
    requests: int
    met: int  # at most this many requests met their SLO, whatever the scheduler
    lp_value: float  # the program's optimum (met is its floor)
    solo_infeasible: int  # could not be met even alone on the fastest engine
    unconstrained: int  # no deadline to meet (counted as met when solo-feasible)
    lp: dict[str, Any] = field(default_factory=dict)  # sizes and times

    @property
    def attainment(self) -> float | None:
        return self.met / self.requests if self.requests else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "slo_attainment": self.attainment,
            "met": self.met,
            "requests": self.requests,
            "lp_value": round(self.lp_value, 3),
            "solo_infeasible": self.solo_infeasible,
            "unconstrained": self.unconstrained,
            "lp": self.lp,
        }


@dataclass
class _Windows:
    """Per request: earliest issue, latest judged deadline, prefill deadline, SLO budgets."""

    release: np.ndarray
    deadline: np.ndarray  # inf: none
    first_token_by: np.ndarray  # inf: none (or not knowable: a program call's)
    ttft: np.ndarray  # inf: none
    tbt: np.ndarray  # inf: none


def _windows(requests: Sequence[SimRequest], solo: np.ndarray) -> _Windows:
    n = len(requests)
    inf = math.inf
    release = np.fromiter((r.arrival_s for r in requests), np.float64, n)
    ttft = np.fromiter((r.ttft_slo_s or inf for r in requests), np.float64, n)
    tbt = np.fromiter((r.tbt_slo_s or inf for r in requests), np.float64, n)
    e2e = np.fromiter((r.e2e_slo_s or inf for r in requests), np.float64, n)
    deadline = release + e2e
    first_token_by = release + ttft
    index = {r.request_id: k for k, r in enumerate(requests)}
    calls = [k for k, r in enumerate(requests) if r.program_id is not None]
    # a call is issued think_s after the last of its predecessors finished, each no sooner
    # than its own release plus its solo latency: memoised over the dependency graph
    earliest: dict[int, float] = {}
    for k in calls:
        stack = [k]
        while stack:
            top = stack[-1]
            pending = [index[d] for d in requests[top].after if index[d] not in earliest]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            r = requests[top]
            if r.after:
                done = max(earliest[index[d]] + solo[index[d]] for d in r.after)
                earliest[top] = done + r.think_s
            else:
                earliest[top] = r.arrival_s
    for k in calls:
        r = requests[k]
        release[k] = earliest[k]
        start = r.arrival_s  # the program's first call's arrival: its task start
        if r.task_slo_s is not None:  # chain: judged against min(own, task - remaining)
            deadline[k] = start + r.task_slo_s - r.remaining_s
        elif r.program_slo_s is not None:  # tree: its stage's deadline <= its program's
            deadline[k] = start + r.program_slo_s + 1e-3  # the stage carries it in whole ms
        else:  # its own SLO from an issue time that has no upper bound
            deadline[k] = inf
        first_token_by[k] = inf  # counted from the issue: only the solo check applies
    return _Windows(release, deadline, first_token_by, ttft, tbt)


def hindsight_bound(
    requests: Sequence[SimRequest],
    pools: Sequence[PoolCapacity],
    *,
    buckets_per_window: int = BUCKETS_PER_WINDOW,
) -> HindsightBound:
    """At most how many of ``requests`` any scheduler could serve within their SLOs on
    ``pools`` (module docstring)."""
    started = time.perf_counter()
    n = len(requests)
    if n == 0:
        return HindsightBound(0, 0, 0.0, 0, 0)
    models = sorted({r.model for r in requests})
    serving = {m: [g for g, pool in enumerate(pools) if m in pool.costs] for m in models}
    missing = [m for m, gs in serving.items() if not gs]
    if missing:
        raise ValueError(f"no pool serves {missing}")
    # one cost model per model: its pools' own when they agree, else the cheapest envelope
    # (a request's work is then charged at that rate on every pool, a lower bound everywhere)
    costs: dict[str, EngineCosts] = {}
    for m, gs in serving.items():
        distinct = list(dict.fromkeys(pools[g].costs[m] for g in gs))
        costs[m] = distinct[0] if len(distinct) == 1 else EngineCosts.envelope(distinct)

    model_idx = np.fromiter((models.index(r.model) for r in requests), np.int64, n)
    prompt = np.fromiter((r.prompt_tokens for r in requests), np.float64, n)
    output = np.fromiter((r.output_tokens for r in requests), np.float64, n)
    first = np.zeros(n)
    decode = np.zeros(n)
    work = np.zeros((4, n))  # prefill compute, prefill memory, decode compute, decode memory
    for i, m in enumerate(models):
        rows = model_idx == i
        c = costs[m]
        first[rows] = c.solo_prefill(prompt[rows])
        decode[rows] = c.solo_decode(prompt[rows], output[rows])
        work[0, rows], work[1, rows] = c.prefill_work(prompt[rows])
        work[2, rows], work[3, rows] = c.decode_work(prompt[rows], output[rows])
    solo = first + decode
    win = _windows(requests, solo)

    # alone on the fastest engine, from its earliest issue: judged as the coordinator does
    slack = 1e-9 * np.maximum(1.0, solo)  # float noise never rules a request out
    feasible = win.release + solo <= win.deadline + slack
    feasible &= first <= win.ttft + slack
    steps = np.maximum(output - 1, 1)
    feasible &= (output <= 1) | (decode / steps <= win.tbt + slack)
    has_e2e = np.isfinite(win.deadline)
    has_ttft = np.isfinite(win.first_token_by) & (win.first_token_by < win.deadline)
    free = feasible & ~has_e2e & ~has_ttft

    # the program's parts: (request, window start, window end, compute work, memory work)
    both = feasible & has_e2e & has_ttft
    whole = feasible & has_e2e & ~has_ttft
    only_first = feasible & ~has_e2e & has_ttft
    part_job = np.concatenate(
        [
            np.flatnonzero(whole),
            np.flatnonzero(both),
            np.flatnonzero(both),
            np.flatnonzero(only_first),
        ]
    )
    part_end = np.concatenate(
        [
            win.deadline[whole],
            win.first_token_by[both],
            win.deadline[both],
            win.first_token_by[only_first],
        ]
    )
    part_work = np.concatenate(
        [
            np.stack([(work[0] + work[2])[whole], (work[1] + work[3])[whole]], axis=1),
            np.stack([work[0][both], work[1][both]], axis=1),
            np.stack([work[2][both], work[3][both]], axis=1),
            np.stack([work[0][only_first], work[1][only_first]], axis=1),
        ]
    )
    poolsets = list(dict.fromkeys(tuple(gs) for gs in serving.values()))
    model_set = np.asarray([poolsets.index(tuple(serving[m])) for m in models], dtype=np.int64)
    lp = _solve(
        part_job,
        win.release[part_job],
        part_end,
        part_work,
        model_set[model_idx[part_job]],
        poolsets,
        [pool.count for pool in pools],
        buckets_per_window,
    )
    value = lp.pop("value")
    # counts are whole: the floor, after forgiving the solver's tolerance (rounding a true
    # optimum a hair below an integer up to it only loosens the bound)
    met = math.floor(value * (1 + 1e-6) + 1e-6) + int(free.sum())
    lp["wall_s"] = round(time.perf_counter() - started, 3)
    bound = HindsightBound(
        requests=n,
        met=met,
        lp_value=value + float(free.sum()),
        solo_infeasible=int((~feasible).sum()),
        unconstrained=int(free.sum()),
        lp=lp,
    )
    log.info("hindsight_bound", requests=n, met=met, **lp)
    return bound


def _solve(
    part_job: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    work: np.ndarray,
    part_set: np.ndarray,
    poolsets: list[tuple[int, ...]],
    counts: list[int],
    per_window: int,
) -> dict[str, Any]:
    """Build and solve the bucketed program; "value" is its optimum, the sum of the x of the
    requests with work to place, beside the sizes and times.

    Parts with the same buckets and pools form a group, and the program has one work variable
    per (group, resource, pool, bucket): any split of a group's work over its buckets is a
    split of each member's (every member in the same proportions), so grouping loses nothing
    and keeps the program small. The two resources have separate variables, tied only by x: a
    request's compute and memory work need not be spread alike over time (its prefill is
    compute, its decode mostly memory)."""
    built = time.perf_counter()
    if len(part_job) == 0:
        return {"value": 0.0, "variables": 0, "constraints": 0}
    jobs, job_of_part = np.unique(part_job, return_inverse=True)
    n_x = len(jobs)
    t0 = float(start.min())
    horizon = float(end.max()) - t0
    length = end - start
    # the finest bucket: a 1/per_window of the shortest window, unless that makes too many
    delta = max(float(length.min()) / per_window, horizon / MAX_FINE_BUCKETS, 1e-6)
    level = np.floor(np.log2(np.maximum(length / (per_window * delta), 1.0))).astype(np.int64)
    top = int(level.max())
    # room past the horizon for a top-level bucket, in whole buckets at every level
    n_fine = math.ceil(horizon / delta) + (2 << top)
    n_fine = -(-n_fine // (1 << top)) * (1 << top)
    width = delta * (2.0**level)
    # every bucket that meets the window, rounding outwards (widen, never narrow)
    lo = np.maximum(np.floor((start - t0) / width - _TIME_EPS).astype(np.int64), 0)
    hi = np.maximum(np.ceil((end - t0) / width + _TIME_EPS).astype(np.int64) - 1, lo)
    assert (hi < (n_fine >> level)).all()
    keys = np.stack([part_set, level, lo, hi], axis=1)
    groups, group_of_part = np.unique(keys, axis=0, return_inverse=True)
    group_of_part = group_of_part.ravel()
    g_set, g_level, g_lo, g_hi = groups.T
    n_groups = len(groups)

    # blocks: one per (group, resource, pool of the group's set); a block's variables are the
    # group's buckets at its level
    b_group, b_res, b_pool = [], [], []
    for g in range(n_groups):
        for res in (0, 1):
            for pool in poolsets[int(g_set[g])]:
                b_group.append(g)
                b_res.append(res)
                b_pool.append(pool)
    block_group = np.asarray(b_group, dtype=np.int64)
    block_res = np.asarray(b_res, dtype=np.int64)
    block_pool = np.asarray(b_pool, dtype=np.int64)
    span = (g_hi - g_lo + 1)[block_group]
    n_y = int(span.sum())
    y_block = np.repeat(np.arange(len(block_group)), span)
    y_bucket = g_lo[block_group][y_block] + np.arange(n_y) - (np.cumsum(span) - span)[y_block]
    y_group = block_group[y_block]
    y_res = block_res[y_block]

    # z: the work on each (pool, resource, level, bucket) node, levels 0 to the top
    n_pools = len(counts)
    per_level = [n_fine >> lv for lv in range(top + 1)]
    level_base = np.concatenate([[0], np.cumsum(per_level)]).astype(np.int64)
    nodes = int(level_base[-1])  # per (pool, resource)
    n_z = n_pools * 2 * nodes

    def z_index(pool: Any, res: Any, lv: Any, b: Any) -> Any:
        return (pool * 2 + res) * nodes + level_base[lv] + b

    x0, y0, z0 = 0, n_x, n_x + n_y
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    # per (group, resource): its work over buckets and pools = its members' work × their x
    rows += [y_group * 2 + y_res]
    cols += [y0 + np.arange(n_y)]
    vals += [np.ones(n_y)]
    for res in (0, 1):
        rows.append(group_of_part * 2 + res)
        cols.append(x0 + job_of_part)
        vals.append(-work[:, res])
    # per node: z - Σ children z - Σ work placed in it = 0
    row0 = n_groups * 2
    rows.append(row0 + z_index(block_pool[y_block], y_res, g_level[y_group], y_bucket))
    cols.append(y0 + np.arange(n_y))
    vals.append(-np.ones(n_y))
    rows.append(row0 + np.arange(n_z))
    cols.append(z0 + np.arange(n_z))
    vals.append(np.ones(n_z))
    upper = np.empty(n_z)
    for pool in range(n_pools):
        for res in (0, 1):
            for lv in range(top + 1):
                b = np.arange(per_level[lv])
                here = z_index(pool, res, lv, b)
                upper[here] = counts[pool] * delta * 2.0**lv  # instances × the bucket
                if lv:
                    for child in (2 * b, 2 * b + 1):
                        rows.append(row0 + here)
                        cols.append(z0 + z_index(pool, res, lv - 1, child))
                        vals.append(-np.ones(len(b)))
    a_eq = sp.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
        shape=(row0 + n_z, n_x + n_y + n_z),
    )
    bounds = np.zeros((n_x + n_y + n_z, 2))
    bounds[:n_x, 1] = 1.0
    bounds[n_x : n_x + n_y, 1] = np.inf
    bounds[n_x + n_y :, 1] = upper
    objective = np.zeros(n_x + n_y + n_z)
    objective[:n_x] = -1.0
    solving = time.perf_counter()
    res = linprog(objective, A_eq=a_eq, b_eq=np.zeros(a_eq.shape[0]), bounds=bounds, method="highs")
    done = time.perf_counter()
    if res.status != 0:
        raise RuntimeError(f"hindsight LP not solved: {res.message}")
    return {
        "value": float(-res.fun),
        "variables": int(a_eq.shape[1]),
        "constraints": int(a_eq.shape[0]),
        "nonzeros": int(a_eq.nnz),
        "groups": n_groups,
        "bucket_s": round(delta, 4),
        "levels": top + 1,
        "build_s": round(solving - built, 3),
        "solve_s": round(done - solving, 3),
    }
