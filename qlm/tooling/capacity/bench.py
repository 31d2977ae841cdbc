"""Solve-time benchmark of the capacity ILP (issue 8 target: ≤ 2 s for 4 models × 3 pools ×
2 GPU types; docs/capacity.md).

Each solve is one :func:`qlm.planner.capacity.policies.solve_capacity_ilp` call, timed end to end
(cvxpy's problem construction and canonicalisation included, not only the solver), on a fresh random
instance: per (model, pool) a demand drawn around a diurnal level, current counts drawn around what
covers the previous hour, and GPU limits per (GPU type, pool) that bind on roughly a fifth of the
instances (so the capped path, which solves three problems, is measured too). The first solve of a
process pays the cvxpy/HiGHS import and is reported apart as ``first_solve_s``.

This module lives in the core package but imports ``planner`` lazily inside the function: the
CLI wires ``qlm bench capacity-ilp`` to :func:`bench_capacity_ilp`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

TARGET_S = 2.0  # issue 8: ILP ≤ 2 s at 4 models × 3 pools × 2 GPU types


def bench_capacity_ilp(
    *,
    models: int = 4,
    pools: int = 3,
    gpu_types: int = 2,
    solves: int = 30,
    seed: int = 0,
    epsilon: float = 1.0,
    time_limit_s: float = 10.0,
    mip_rel_gap: float = 1e-3,
) -> dict[str, Any]:
    """Time ``solves`` ILP solves of the given size; returns a JSON-able dict with
    ``median_s``, ``p95_s``, ``max_s``, ``first_solve_s``, the status counts, the sizes and
    ``meets_target`` (p95 ≤ 2 s)."""
    from qlm.planner.capacity.policies import (
        CapacitySpec,
        Cell,
        InstanceProfile,
        PoolKey,
        solve_capacity_ilp,
    )

    if min(models, pools, gpu_types, solves) < 1:
        raise ValueError("models, pools, gpu_types and solves must be ≥ 1")
    rng = np.random.default_rng(seed)
    model_names = [f"model-{i}" for i in range(models)]
    pool_names = [f"pool-{j}" for j in range(pools)]
    gpu_names = [f"gpu-{k}" for k in range(gpu_types)]
    # a faster GPU type is dearer per hour but cheaper per token, as H100 vs A100 roughly are;
    # models differ by ~an order of magnitude in throughput (70B vs 7B class)
    cost = {g: 3.0 * (1.8**k) for k, g in enumerate(gpu_names)}
    profiles = []
    for i, m in enumerate(model_names):
        base = 20_000.0 / (1 + 2 * i)
        gpus = 1 + (i % 3)
        for k, g in enumerate(gpu_names):
            tpm = base * (2.2**k) * float(rng.uniform(0.9, 1.1))
            profiles.append(
                InstanceProfile(m, g, tpm=tpm, gpus=gpus, startup_s=float(rng.uniform(60, 900)))
            )
    prof = {(p.model, p.gpu_type): p for p in profiles}
    level = {m: float(rng.uniform(50_000, 300_000)) for m in model_names}

    times: list[float] = []
    statuses: dict[str, int] = {}
    first_s: float | None = None
    for _ in range(solves + 1):
        demand = {
            PoolKey(m, p): level[m] * float(rng.uniform(0.3, 1.5))
            for m in model_names
            for p in pool_names
        }
        current: dict[Cell, int] = {}
        for m in model_names:
            for p in pool_names:
                prev = demand[PoolKey(m, p)] * float(rng.uniform(0.6, 1.4))
                share = rng.dirichlet(np.ones(gpu_types))
                for g, s in zip(gpu_names, share, strict=True):
                    current[Cell(m, g, p)] = int(prev * s / prof[(m, g)].tpm)
        need_gpus = {
            (g, p): sum(
                demand[PoolKey(m, p)] / gpu_types / prof[(m, g)].tpm * prof[(m, g)].gpus
                for m in model_names
            )
            for g in gpu_names
            for p in pool_names
        }
        limits = {key: int(v * float(rng.uniform(0.8, 3.0))) + 1 for key, v in need_gpus.items()}
        spec = CapacitySpec(
            profiles=tuple(profiles),
            gpu_cost_per_hour=cost,
            gpu_limits=limits,
            epsilon=epsilon,
        )
        t0 = time.perf_counter()
        res = solve_capacity_ilp(
            spec, demand, current, time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap
        )
        dt = time.perf_counter() - t0
        if first_s is None:
            first_s = dt  # imports and HiGHS start-up: not a steady-state solve
            continue
        times.append(dt)
        statuses[res.status] = statuses.get(res.status, 0) + 1
    arr = np.asarray(times)
    p95 = float(np.percentile(arr, 95))
    return {
        "bench": "capacity-ilp",
        "models": models,
        "pools": pools,
        "gpu_types": gpu_types,
        "integer_variables": models * pools * gpu_types,
        "epsilon": epsilon,
        "mip_rel_gap": mip_rel_gap,
        "time_limit_s": time_limit_s,
        "solves": solves,
        "seed": seed,
        "median_s": float(np.median(arr)),
        "p95_s": p95,
        "max_s": float(arr.max()),
        "mean_s": float(arr.mean()),
        "first_solve_s": first_s,
        "statuses": statuses,
        "target_s": TARGET_S,
        "meets_target": p95 <= TARGET_S,
    }
