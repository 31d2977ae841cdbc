"""SABER's offline phase on the simulated engine: profile f(L), fit the USL.

SABER (shared/reference/saber-cato-digest.md, part A2.2) measures, with the engine's batch cap
above every concurrency it sends, the speed of every completed request (generated tokens /
execution time, prefill included) and the load L while it ran, injecting the deployment's own
task mix at varying load, and fits ``f(L) = lam / (1 + sigma (L - 1) + kappa L (L - 1))`` to
those points (:func:`qlm.admission.fit_usl`). Here the engine is a :class:`SimInstance` fed
Poisson arrivals at a range of rates, drawn from a sample of the workload's (prompt, output)
lengths; a request's L is the time-weighted mean number running from its admission to its
completion (the digest's reading of "load during its execution"). Open-loop load keeps the
turnover of requests (so the share of time spent on prefills) as it is at that L in service; a
closed loop holding L requests would replace short ones far faster than any real load does.

The simulated SABER gate (:mod:`qlm.tooling.simulator.cluster`, ``pull_gate="saber"``) then uses
this
fit, a function of L alone, as SABER does; qlm's own gate uses the engine model for the
instance's current mix instead.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import structlog

from qlm.admission import USLSpeedModel, fit_usl
from qlm.engine_model import EngineProfile
from qlm.policy import PlanRequest
from qlm.tooling.simulator.instance import SimInstance, SimJob
from qlm.tooling.simulator.workload import SimRequest

log = structlog.get_logger(__name__)

# Open-loop Poisson rates (req/s), from an idle engine to one held at its batch cap (SABER
# ran 1 to 20 req/s); about 1,200 points in all, as SABER's ~1,000
PROFILE_RATES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
PROFILE_REQUESTS_PER_RATE = 150
SWEEP_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the decode sweep's concurrency levels
PROFILE_SAMPLE = 512  # workload requests the profiling draws its lengths from


@dataclass(frozen=True)
class SpeedFit:
    """A USL fit of one (GPU, model, engine cap) on one workload, and the points behind it."""

    usl: USLSpeedModel
    points: tuple[tuple[int, float], ...]  # (concurrency, per-request tokens/s)
    method: str  # "decode" (qlm profile's sweep) or "e2e" (SABER's open-loop injection)
    setting: tuple[float, ...]  # decode: (prompt, output) of the sweep; e2e: the rates

    def to_dict(self) -> dict[str, object]:
        bins = [(1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 127), (128, 10**9)]
        means = {}
        for lo, hi in bins:
            speeds = [v for n, v in self.points if lo <= n <= hi]
            if speeds:
                means[f"{lo}-{hi}" if hi < 10**9 else f">={lo}"] = round(float(np.mean(speeds)), 2)
        return {
            **self.usl.to_dict(),
            "method": self.method,
            "setting": list(self.setting),
            "points": len(self.points),
            "max_concurrency": max(n for n, _ in self.points),
            "mean_speed_by_concurrency": means,
        }


def measure_speeds(
    profile: EngineProfile,
    gpu_type: str,
    model: str,
    lengths: Sequence[tuple[int, int]],
    rate_rps: float,
    requests: int,
    seed: int = 0,
) -> list[tuple[float, float]]:
    """Inject ``requests`` Poisson arrivals at ``rate_rps`` (lengths cycled from ``lengths``)
    into an engine of its own; for each completed request, (time-weighted mean number of
    requests running while it ran, generated tokens / time from admission to completion)."""
    if rate_rps <= 0 or requests < 1 or not lengths:
        raise ValueError("profiling needs a rate > 0, requests >= 1 and some request lengths")
    heap: list[tuple[float, int, int]] = []
    seq = itertools.count()
    done: list[SimJob] = []

    def schedule(t: float, inst: SimInstance, version: int) -> None:
        heapq.heappush(heap, (t, next(seq), version))

    inst = SimInstance(
        "profile",
        gpu_type,
        [model],
        {model: profile},
        cpu_memory_bytes=0.0,
        schedule=schedule,
        on_finish=lambda job, now: done.append(job),
    )
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_rps, size=requests)).tolist()
    area = 0.0  # integral over time of the number of running requests
    last = 0.0
    admitted: dict[SimJob, tuple[float, float]] = {}  # job -> (time, area) when it started
    out: list[tuple[float, float]] = []
    k = 0
    while k < requests or heap:
        t_arrival = arrivals[k] if k < requests else math.inf
        t = min(t_arrival, heap[0][0] if heap else math.inf)
        area += len(inst.running) * (t - last)
        last = t
        if t_arrival <= t:
            prompt, output = lengths[k % len(lengths)]
            req = SimRequest(f"p{k}", model, t, prompt, output, output, "p", None, None, "p")
            view = PlanRequest(f"p{k}", model, prompt, output, t, None, None, seq=k)
            inst.enqueue([SimJob(req=req, view=view)], t)
            k += 1
        else:
            _, _, version = heapq.heappop(heap)
            if version != inst.version:
                continue
            inst.on_event(t)
            for job in done:
                start_t, start_area = admitted.pop(job)
                if t > start_t:
                    out.append(((area - start_area) / (t - start_t), job.generated / (t - start_t)))
            done.clear()
            inst.resume(t)
        for job in inst.running:  # admitted in this event (running is in admission order)
            if job not in admitted and job.finished_s is None:
                admitted[job] = (t, area)
    return out


def measure_decode_speeds(
    profile: EngineProfile, gpu_type: str, model: str, prompt: int, output: int, level: int
) -> list[float]:
    """``qlm profile``'s concurrency sweep on the simulated engine: ``level`` identical requests
    at once; each one's decode speed, (tokens - 1) / (finish - first token)."""
    if level < 1 or prompt < 1 or output < 2:
        raise ValueError("a decode sweep needs a level >= 1, prompt >= 1 and output >= 2")
    heap: list[tuple[float, int, int]] = []
    seq = itertools.count()
    done: list[SimJob] = []

    def schedule(t: float, inst: SimInstance, version: int) -> None:
        heapq.heappush(heap, (t, next(seq), version))

    inst = SimInstance(
        "profile",
        gpu_type,
        [model],
        {model: profile},
        cpu_memory_bytes=0.0,
        schedule=schedule,
        on_finish=lambda job, now: done.append(job),
    )
    jobs = []
    for k in range(level):
        req = SimRequest(f"p{k}", model, 0.0, prompt, output, output, "p", None, None, "p")
        view = PlanRequest(f"p{k}", model, prompt, output, 0.0, None, None, seq=k)
        jobs.append(SimJob(req=req, view=view))
    inst.enqueue(jobs, 0.0)
    while heap:
        t, _, version = heapq.heappop(heap)
        if version == inst.version:
            inst.on_event(t)
            inst.resume(t)
    speeds = []
    for job in done:
        assert job.first_token_s is not None and job.finished_s is not None
        if job.finished_s > job.first_token_s:
            speeds.append((job.generated - 1) / (job.finished_s - job.first_token_s))
    return speeds


def fit_decode_speed(
    profile: EngineProfile,
    gpu_type: str,
    model: str,
    lengths: Sequence[tuple[int, int]],
    *,
    levels: Sequence[int] | None = None,
) -> SpeedFit:
    """f(L) as ``qlm profile`` measures it: a concurrency sweep (1, 2, 4, ... up to the engine's
    batch cap) of identical requests with the workload's mean prompt and output, each request's
    decode speed a point; the USL fitted to them."""
    cap = profile.max_batch_size
    chosen = sorted(set(levels)) if levels is not None else [n for n in SWEEP_LEVELS if n <= cap]
    if cap not in chosen and levels is None:
        chosen.append(cap)
    prompt = max(1, round(float(np.mean([p for p, _ in lengths]))))
    output = max(2, round(float(np.mean([o for _, o in lengths]))))
    pts: list[tuple[int, float]] = []
    for level in chosen:
        pts += [
            (level, v)
            for v in measure_decode_speeds(profile, gpu_type, model, prompt, output, level)
        ]
    usl = fit_usl(pts)
    return SpeedFit(usl, tuple(pts), "decode", (prompt, output))


def fit_engine_speed(
    profile: EngineProfile,
    gpu_type: str,
    model: str,
    lengths: Sequence[tuple[int, int]],
    *,
    rates: Sequence[float] = PROFILE_RATES,
    requests_per_rate: int = PROFILE_REQUESTS_PER_RATE,
) -> SpeedFit:
    """Profile the simulated engine (its batch cap as configured) under open-loop load at
    every rate on the workload's lengths and fit the USL to all the points, as SABER's offline
    phase does. A point's concurrency is its time-weighted mean, rounded."""
    pts: list[tuple[int, float]] = []
    for k, rate in enumerate(rates):
        for level, speed in measure_speeds(
            profile, gpu_type, model, lengths, rate, requests_per_rate, seed=k
        ):
            pts.append((max(1, round(level)), speed))
    usl = fit_usl(pts)
    log.debug(
        "saber_speed_fitted",
        gpu=gpu_type,
        model=model,
        lam=usl.lam,
        sigma=usl.sigma,
        kappa=usl.kappa,
        r_squared=usl.r_squared,
        points=len(pts),
    )
    return SpeedFit(usl, tuple(pts), "e2e", tuple(rates))


def workload_lengths(
    requests: Sequence[SimRequest], model: str, seed: int = 0
) -> list[tuple[int, int]]:
    """A seeded sample of the (prompt, output) lengths of the requests to ``model``: SABER
    profiles with the deployment's own task mix."""
    pairs = [(r.prompt_tokens, r.output_tokens) for r in requests if r.model == model]
    if not pairs:
        raise ValueError(f"no request to {model!r} to profile the engine with")
    rng = np.random.default_rng(seed)
    if len(pairs) > PROFILE_SAMPLE:
        idx = rng.choice(len(pairs), size=PROFILE_SAMPLE, replace=False)
        pairs = [pairs[int(i)] for i in idx]
    else:
        order = rng.permutation(len(pairs))
        pairs = [pairs[int(i)] for i in order]
    return pairs


def task_mean_outputs(
    requests: Sequence[SimRequest], model: str, seed: int = 0
) -> dict[str, float]:
    """SABER's "average output length per task type" for ``model``: each SLO class's mean
    output over a seeded sample of the requests to it (at most ``PROFILE_SAMPLE`` per class),
    profiled before the run as f(L) is."""
    by_class: dict[str, list[int]] = {}
    for r in requests:
        if r.model == model:
            by_class.setdefault(r.slo_class, []).append(r.output_tokens)
    if not by_class:
        raise ValueError(f"no request to {model!r} to profile the output lengths with")
    rng = np.random.default_rng(seed)
    means: dict[str, float] = {}
    for name in sorted(by_class):
        outputs = by_class[name]
        if len(outputs) > PROFILE_SAMPLE:
            outputs = [outputs[int(i)] for i in rng.choice(len(outputs), PROFILE_SAMPLE, False)]
        means[name] = float(np.mean(outputs))
    return means
