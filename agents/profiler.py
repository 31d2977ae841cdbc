"""``qlm profile``: measure a real engine and fit the profile the estimator, the engine model
(simulator, sim backend) and SABER's admission gate use.

Three runs through the :class:`~agents.engine.EngineBackend` interface, so any backend can be
profiled (vLLM for real; the sim backend to check the profiler against a known model):

1. *Single requests* at several prompt lengths: time to first token gives the prefill line
   ``P(n) = a + b n``; the gaps between tokens give the batch-1 decode step ``d``.
2. *A concurrency sweep*: L identical requests at once for L = 1, 2, 4, ...; each request's
   decode speed (tokens/s) at concurrency L gives SABER's f(L), fitted with the USL.
3. *Model switches*, where the backend has them: the model put ``warm`` (sleep mode) then
   ``active``, and released (``cold``) then made ``active``; the time ``set_model_states``
   blocks plus the next request's extra time to first token is the warm or cold load time.
   A backend that cannot do it gets ``None`` with the reason recorded.

The fit maps onto the engine model's roofline (docs/engine-model.md): the measured prefill slope
gives the effective compute rate, the decode step gives the effective memory rate, the prefill
intercept the per-iteration overhead, all with efficiency 1 (they are measured, not peaks).
The RCT estimator's constants (P, d, ε, Θ; ``qlm.estimator.HardwareProfile``) are also
reported as measured, in ``measurements.estimator``, to compare with what it derives.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
from scipy.optimize import OptimizeWarning

from qlm.admission import USLSpeedModel, fit_usl
from qlm.agents.engine import EngineBackend, EngineOutput, EngineRequest, ModelState
from qlm.catalog import GPUS, GPUSpec, ModelSpec, canonical_gpu, resolve_model
from qlm.engine_model import EngineProfile, profile_to_dict

log = structlog.get_logger(__name__)

PROFILE_SOURCE = "measured:qlm-profile"
DEFAULT_PROMPTS = (16, 64, 256)
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16)


class ProfilingError(RuntimeError):
    """The engine failed a profiling request, or the measurements cannot be fitted."""


def concurrency_levels(max_concurrency: int) -> list[int]:
    """1, 2, 4, ... up to ``max_concurrency`` (included): the sweep's levels."""
    if max_concurrency < 1:
        raise ProfilingError(f"max concurrency must be >= 1, got {max_concurrency}")
    levels = [1]
    while levels[-1] * 2 < max_concurrency:
        levels.append(levels[-1] * 2)
    if levels[-1] != max_concurrency:
        levels.append(max_concurrency)
    return levels


@dataclass(frozen=True)
class ProfileResult:
    profile: EngineProfile
    usl: USLSpeedModel
    measurements: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """``profile_to_dict`` plus ``usl`` and ``measurements``: loads with the simulator's
        ``load_profile`` (``engine_model.profile_from_dict`` ignores those two keys)."""
        out = profile_to_dict(self.profile)
        out["usl"] = self.usl.to_dict()
        out["measurements"] = self.measurements
        return out


class _Collector:
    def __init__(self) -> None:
        self.futures: dict[str, asyncio.Future[EngineOutput]] = {}

    def expect(self, rid: str) -> asyncio.Future[EngineOutput]:
        fut: asyncio.Future[EngineOutput] = asyncio.get_running_loop().create_future()
        self.futures[rid] = fut
        return fut

    async def __call__(self, out: EngineOutput) -> None:
        fut = self.futures.pop(out.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(out)


async def profile_engine(
    engine: EngineBackend,
    model: str,
    gpu_type: str,
    *,
    prompts: Sequence[int] = DEFAULT_PROMPTS,
    output_tokens: int = 64,
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    measure_load: bool = True,
    timeout_s: float = 600.0,
    started: bool = False,
) -> ProfileResult:
    """Profile ``model`` on a (not yet started, unless ``started``) engine and stop it after."""
    try:
        spec = resolve_model(model)
    except KeyError as exc:
        raise ProfilingError(exc.args[0]) from exc
    if model not in engine.models:
        raise ProfilingError(f"the engine does not serve {model!r} (it serves {engine.models})")
    if output_tokens < 4 or not prompts or min(prompts) < 1:
        raise ProfilingError("output_tokens must be >= 4 and prompt lengths >= 1")
    if not concurrency or min(concurrency) < 1 or len(set(concurrency)) < 3:
        raise ProfilingError(
            "concurrency needs >= 3 distinct levels, each >= 1 (the USL fit has 3 parameters)"
        )
    collector = _Collector()
    if not started:
        try:
            await engine.start(collector)
        except Exception as exc:  # the engine's own failure, whatever its type: report it
            raise ProfilingError(f"the engine failed to start: {_describe(exc)}") from exc
    counter = iter(range(1_000_000))
    t_start = time.monotonic()
    # the sim backend runs `time_scale` times faster than the hardware it models: profile the
    # modelled hardware (engine seconds), not the wall clock
    scale = float(getattr(engine, "time_scale", 1.0))

    async def run(batch: list[tuple[int, int]]) -> list[EngineOutput]:
        futures = []
        try:
            for prompt_len, max_tokens in batch:
                rid = f"qlm-profile-{next(counter)}"
                futures.append(collector.expect(rid))
                engine.submit(_request(rid, model, prompt_len, max_tokens))
            outs = await asyncio.wait_for(asyncio.gather(*futures), timeout_s)
        except TimeoutError as exc:
            raise ProfilingError(
                f"the engine did not finish {len(batch)} profiling request(s) in {timeout_s} s"
            ) from exc
        except Exception as exc:
            raise ProfilingError(
                f"the engine failed a profiling request: {_describe(exc)}"
            ) from exc
        for out in outs:
            if out.error is not None:
                raise ProfilingError(f"the engine failed a profiling request: {out.error}")
        return list(outs)

    try:
        if max(concurrency) > engine.max_batch_size:  # known once started (vLLM sizes then)
            raise ProfilingError(
                f"concurrency {max(concurrency)} exceeds the engine's batch cap of "
                f"{engine.max_batch_size}: the extra requests would wait, not run concurrently"
            )
        await run([(min(prompts), 4)])  # warm-up: first-request costs are not the model's
        ttfts: list[tuple[int, float]] = []
        steps: list[float] = []
        # (batch, context per sequence, seconds per decode step) for the joint fit
        decode_obs: list[tuple[int, int, float]] = []
        for p in prompts:
            for _ in range(2):
                [out] = await run([(p, output_tokens)])
                ttfts.append((p, _ttft(out, scale)))
                steps.append(_decode_step(out, scale))
                decode_obs.append((1, p + output_tokens // 2, steps[-1]))
        points: list[tuple[int, float]] = []
        throughput: dict[int, float] = {}
        level_step: dict[int, float] = {}
        for level in sorted(set(concurrency)):
            outs = await run([(min(prompts), output_tokens)] * level)
            level_steps = [_decode_step(o, scale) for o in outs]
            points += [(level, 1.0 / step) for step in level_steps]
            ctx = min(prompts) + output_tokens // 2
            level_step[level] = statistics.median(level_steps)
            decode_obs.append((level, ctx, level_step[level]))
            span = (max(o.finished_at for o in outs) - min(o.started_at for o in outs)) * scale
            throughput[level] = level * output_tokens / span if span > 0 else 0.0
        if measure_load:
            switches = await _switch_times(engine, model, run, min(prompts), scale)
        else:
            switches = {k: None for k in SWITCH_KEYS} | {"reason": "not measured (disabled)"}
    except ProfilingError:
        raise
    except Exception as exc:
        raise ProfilingError(f"the engine failed during profiling: {_describe(exc)}") from exc
    finally:
        try:
            await engine.stop()
        except Exception as exc:  # stopping is best effort; the measurements stand or fell
            log.warning("profile_engine_stop_failed", error=_describe(exc))

    a, b = _line([(float(n), t) for n, t in ttfts])  # reported; the fit uses every point
    d = statistics.median(steps)
    # f(L) is the typical per-request speed at concurrency L: fit the USL to each level's
    # median. Requests of one level differ by how many of the others' prefills they decode
    # through (staggered admission), a spread L does not explain; R² over every request is
    # reported beside it
    by_level: dict[int, list[float]] = {}
    for level, speed in points:
        by_level.setdefault(level, []).append(speed)
    medians = [(level, statistics.median(v)) for level, v in sorted(by_level.items())]
    try:
        with warnings.catch_warnings():  # the parameters' covariance is not used
            warnings.simplefilter("ignore", OptimizeWarning)
            usl = fit_usl(medians)
        r2_all = _r_squared(usl, points)
        profile, fit_error = _fit_profile(spec, gpu_type, ttfts, decode_obs, engine)
    except (ValueError, RuntimeError) as exc:  # RuntimeError: scipy found no fit
        raise ProfilingError(f"the measurements cannot be fitted: {exc}") from exc
    profile = replace(
        profile,
        measured_load_from_disk_s=switches["cold_to_active_s"],
        measured_load_from_cpu_s=switches["warm_to_active_s"],
    )
    # the estimator's constants as measured, at the sweep's context (qlm.estimator eqs. 1-4):
    # ε(L) = decode step at L / at 1, Θ(L) = L / decode step at L
    base = level_step.get(1, d)
    estimator = {
        "prefill_fixed_s": a,
        "prefill_s_per_token": b,
        "decode_token_s": d,
        "context_tokens": min(prompts) + output_tokens // 2,
        "by_concurrency": {
            str(level): {"inefficiency": step / base, "throughput_tps": level / step}
            for level, step in level_step.items()
        },
    }
    measurements = {
        "prefill_ttft_s": [[n, round(t, 6)] for n, t in ttfts],
        "prefill_line": {"intercept_s": a, "slope_s_per_token": b},
        "decode_step_s": d,
        "decode_steps_s": [round(s, 6) for s in steps],
        "decode_observations": [[b_, c, round(t, 6)] for b_, c, t in decode_obs],
        "fit_median_relative_error": round(fit_error, 4),
        "concurrency_points": [[n, round(v, 3)] for n, v in points],
        "usl_r_squared_all_requests": round(r2_all, 4),
        "engine_tokens_per_s": {str(k): round(v, 2) for k, v in throughput.items()},
        "estimator": estimator,
        "load_cold_s": switches["cold_to_active_s"],
        "load_warm_s": switches["warm_to_active_s"],
        "load_note": switches["reason"],
        "kv_capacity_tokens": engine.kv_capacity_tokens,
        "max_batch_size": engine.max_batch_size,
        "capabilities": vars(engine.capabilities()) | {"notes": list(engine.capabilities().notes)},
        "wall_s": round(time.monotonic() - t_start, 2),
    }
    log.info(
        "profile_fitted",
        model=model,
        gpu_type=gpu_type,
        decode_step_s=d,
        prefill_slope_s=b,
        usl_r2=usl.r_squared,
    )
    return ProfileResult(profile=profile, usl=usl, measurements=measurements)


def _r_squared(usl: USLSpeedModel, points: list[tuple[int, float]]) -> float:
    mean = statistics.fmean(v for _, v in points)
    total = sum((v - mean) ** 2 for _, v in points)
    residual = sum((v - usl(n)) ** 2 for n, v in points)
    return 1.0 - residual / total if total > 0 else 1.0


def _request(rid: str, model: str, prompt_len: int, max_tokens: int) -> EngineRequest:
    # ids 1..200 stay inside any vocabulary, the tiny test model's 512 included
    ids = [1 + (i * 37) % 200 for i in range(prompt_len)]
    return EngineRequest(
        request_id=rid,
        model=model,
        prompt_token_ids=ids,
        prompt_tokens=prompt_len,
        prompt_text=None,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
    )


def _ttft(out: EngineOutput, scale: float = 1.0) -> float:
    if out.first_token_at is None:
        raise ProfilingError(f"request {out.request_id} reported no first token")
    return (out.first_token_at - out.started_at) * scale


def _decode_step(out: EngineOutput, scale: float = 1.0) -> float:
    n = len(out.output_token_ids)
    if out.first_token_at is None or n < 2 or out.finished_at <= out.first_token_at:
        raise ProfilingError(f"request {out.request_id}: too few timed tokens to measure decode")
    return (out.finished_at - out.first_token_at) / (n - 1) * scale


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares a + b x."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ProfilingError("prefill needs at least two distinct prompt lengths")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, max(b, 1e-12)


def _fit_profile(
    spec: ModelSpec,
    gpu_type: str,
    ttfts: list[tuple[int, float]],
    decode_obs: list[tuple[int, int, float]],
    engine: EngineBackend,
) -> tuple[EngineProfile, float]:
    """Fit the engine model's three free constants to every measurement at once: the
    effective compute rate F, the effective memory rate B (efficiencies 1: they are measured,
    not peaks) and the per-iteration overhead o, so that ``prefill_time(n)`` matches the times
    to first token and ``decode_iteration_time(batch, ctx)`` the decode steps, in relative
    least squares. Returns the profile and the fit's median relative error."""
    import numpy as np
    from scipy.optimize import least_squares

    known = GPUS.get(canonical_gpu(gpu_type))

    # the engine's token budget, where its backend knows it: the planner prices the chunked
    # prefill beside a decode batch with it (else the profile's default)
    batched = engine.max_num_batched_tokens
    budget = {} if batched is None else {"max_num_batched_tokens": batched}

    def make(x: Any) -> EngineProfile:
        gpu = GPUSpec(
            name=gpu_type,
            memory_gb=known.memory_gb if known else 0.0,
            bf16_tflops=float(np.exp(x[0])),
            mem_bw_gbs=float(np.exp(x[1])),
            pcie_gbs=known.pcie_gbs if known else 25.0,
        )
        return EngineProfile(
            gpu=gpu,
            model=spec,
            prefill_mfu=1.0,
            decode_bw_efficiency=1.0,
            iteration_overhead_s=float(x[2]),
            max_num_seqs=engine.max_batch_size,
            **budget,
            source=PROFILE_SOURCE,
            measured_kv_capacity_tokens=engine.kv_capacity_tokens,
        )

    def residuals(x: Any) -> Any:
        p = make(x)
        r = [p.prefill_time(n) / t - 1.0 for n, t in ttfts if t > 0]
        r += [p.decode_iteration_time(b, c) / t - 1.0 for b, c, t in decode_obs if t > 0]
        return np.array(r)

    d = min(t for _, _, t in decode_obs)
    # start: overhead a third of a decode step, the rest split by the roofline
    flops = 2.0 * spec.params_b * 1e9
    x0 = [
        np.log(flops * max(n for n, _ in ttfts) / max(t for _, t in ttfts) / 1e12),
        np.log(spec.weight_bytes / (d * 2 / 3) / 1e9),
        d / 3,
    ]
    fit = least_squares(
        residuals, x0, bounds=([-20.0, -20.0, 0.0], [20.0, 20.0, max(d, 1e-6)]), loss="soft_l1"
    )
    return make(fit.x), float(np.median(np.abs(residuals(fit.x))))


SWITCH_KEYS = ("cold_to_active_s", "warm_to_active_s")


async def _switch_times(
    engine: EngineBackend, model: str, run: Any, prompt_len: int, scale: float
) -> dict[str, Any]:
    """Warm and cold start costs: put the model ``warm`` (only with sleep mode) or ``cold``,
    make it ``active`` again, and add the time that blocked to the next request's extra time
    to first token over a warm one's (a backend may load in the background instead). ``None``
    where the backend cannot do it, and ``reason`` says why."""
    reasons: list[str] = []
    out: dict[str, Any] = {}
    if engine.capabilities().sleep_mode:
        out["warm_to_active_s"] = await _switch(engine, model, "warm", run, prompt_len, scale)
        if out["warm_to_active_s"] is None:
            reasons.append("warm: the backend keeps its active model resident")
    else:
        out["warm_to_active_s"] = None
        notes = "; ".join(engine.capabilities().notes)
        reasons.append("warm: the backend has no sleep mode" + (f" ({notes})" if notes else ""))
    out["cold_to_active_s"] = await _switch(engine, model, "cold", run, prompt_len, scale)
    if out["cold_to_active_s"] is None:
        reasons.append("cold: the backend keeps its active model resident")
    out["reason"] = "; ".join(reasons) or None
    return out


async def _switch(
    engine: EngineBackend, model: str, state: ModelState, run: Any, prompt_len: int, scale: float
) -> float | None:
    [warm] = await run([(prompt_len, 4)])
    t0 = time.monotonic()
    await engine.set_model_states({model: state})
    if engine.stats().active_model == model:
        await engine.set_model_states({model: "active"})
        return None  # nothing left the GPU: nothing to time
    await engine.set_model_states({model: "active"})
    blocking = (time.monotonic() - t0) * scale
    [first] = await run([(prompt_len, 4)])
    return max(blocking + _ttft(first, scale) - _ttft(warm, scale), 0.0)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
