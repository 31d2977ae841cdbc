"""Run every policy of a scenario (and every point of its sweep) and build the summary.

Policies are built by a factory the caller passes in (the CLI passes
``qlm.planner.simulation_policy``),
so qlm's core does not import the planner. Every policy sees the same requests (built once per
sweep point from the scenario's seed), the same instances and the same engine model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import structlog

from qlm.admission import OutputBudget
from qlm.chains import LateTaskRule
from qlm.engine_model import (
    EngineProfile,
    clear_measured_profiles,
    measured_profiles,
    register_measured_profile,
)
from qlm.policy import QueuePolicy
from qlm.tooling.simulator.cluster import (
    ClusterSimulator,
    InstanceSpec,
    LSOSwitches,
    SimConfig,
    SimResult,
    instance_profiles,
)
from qlm.tooling.simulator.hindsight import HindsightBound, hindsight_bound, pools_of
from qlm.tooling.simulator.saber import (
    SpeedFit,
    fit_decode_speed,
    fit_engine_speed,
    task_mean_outputs,
    workload_lengths,
)
from qlm.tooling.simulator.scenario import ScenarioSpec, VariantSpec, load_profile
from qlm.tooling.simulator.workload import SimRequest, build_requests

log = structlog.get_logger(__name__)

PolicyFactory = Callable[[str, Mapping[str, Any]], QueuePolicy]
Progress = Callable[[str, float], None]

SUMMARY_METRICS = (
    "slo_attainment",
    "throughput_rps",
    "goodput_rps",
    "service_gain",
    "task_attainment",  # programs (task chains, collective programs) met; None without any
    "tasks",
    "gpu_utilisation",
    "kv_utilisation",
    "model_swaps",
    "cold_loads",
    "evictions",
    "kv_swaps",
    "preemptions",
    "batch_caps",  # caps the plans set on agents: the batch cap LSO acting (0: it never did)
    "p50_latency_s",
    "p99_latency_s",
    "requests",
    "completed",
    "replans",
    "planner_wall_s",
    "sim_wall_s",
)
OPTIONAL_METRICS = ("demoted",)  # only some columns have them (SABER's gate)


@dataclass(frozen=True)
class PolicyVariant:
    """One column of a run: a policy with constructor overrides, under a display name."""

    label: str
    policy: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    # engine-side settings of this column: a static batch cap (vLLM --max-num-seqs) on every
    # instance, and SABER's SLO-aware admission in the agents (whatever the scenario says)
    max_num_seqs: int | None = None
    slo_pull: bool | None = None
    pull_gate: str | None = None  # "qlm" | "saber" (see SimConfig.pull_gate)
    # "saber": how f(L) is profiled, "decode" (qlm profile's sweep) or "e2e" (SABER's paper)
    speed_profile: str = "decode"
    # "saber": its maxTokens, "max_tokens" (the request's) or "task_mean" (each SLO class's
    # mean output, profiled on the workload before the run: OutputBudget)
    saber_tokens: str = "max_tokens"
    late_task_rule: LateTaskRule | None = None  # the coordinator's, for late task-chain calls

    @property
    def engine_settings(self) -> bool:
        """Whether the column sets anything beside the policy (engine or coordinator)."""
        return any(
            x is not None
            for x in (self.max_num_seqs, self.slo_pull, self.pull_gate, self.late_task_rule)
        )

    @classmethod
    def from_spec(cls, spec: VariantSpec) -> PolicyVariant:
        slo_pull = None if spec.admission is None else spec.admission != "none"
        gate = spec.admission if spec.admission in ("saber", "qlm") else None
        return cls(
            spec.name,
            spec.policy,
            dict(spec.overrides),
            spec.max_num_seqs,
            slo_pull,
            gate,
            spec.speed_profile,
            spec.saber_tokens,
            spec.late_task_rule,
        )


def expand_variants(spec: ScenarioSpec, variants: Sequence[PolicyVariant]) -> list[PolicyVariant]:
    """A plain column (a policy, no engine settings) of a policy the scenario gives
    ``variants`` for becomes those variants, its overrides under theirs; anything else stays."""
    by_policy: dict[str, list[VariantSpec]] = {}
    for v in spec.variants or []:
        by_policy.setdefault(v.policy, []).append(v)
    out: list[PolicyVariant] = []
    for variant in variants:
        specs = by_policy.get(variant.policy)
        if variant.engine_settings or not specs:
            out.append(variant)
            continue
        for vs in specs:
            column = PolicyVariant.from_spec(vs)
            out.append(replace(column, overrides={**variant.overrides, **column.overrides}))
    return out


def engine_model_name(spec: ScenarioSpec, name: str) -> str:
    """The name the engine model and the planner know a scenario model by: an alias
    ``ft -> vicuna-13b`` becomes the variant ``vicuna-13b@ft`` (same shape, its own weights)."""
    base = spec.models.get(name)
    if base is None:
        return name
    return f"{base.partition('@')[0]}@{name}"


def scenario_requests(spec: ScenarioSpec) -> list[SimRequest]:
    reqs = build_requests(spec)
    if spec.models:
        for r in reqs:
            r.model = engine_model_name(spec, r.model)
    return reqs


def instance_specs(spec: ScenarioSpec) -> list[InstanceSpec]:
    out = []
    for pool in spec.pools:
        name = pool.name or pool.gpu
        for k in range(pool.count):
            out.append(
                InstanceSpec(
                    instance_id=f"{name}-{k}",
                    gpu_type=pool.gpu,
                    models=tuple(engine_model_name(spec, m) for m in pool.models),
                    tp=pool.tp,
                    cpu_memory_bytes=pool.cpu_memory_gb * 1e9,
                    profiles=tuple(load_profile(p) for p in pool.profiles),
                    max_num_seqs=pool.max_num_seqs,
                    max_num_batched_tokens=pool.max_num_batched_tokens,
                    pull_at_most=pool.pull_at_most,
                    feed_tokens=pool.feed_tokens,
                )
            )
    return out


def sim_config(spec: ScenarioSpec, policy_name: str, policy: QueuePolicy) -> SimConfig:
    opts = spec.options
    lso = (
        LSOSwitches(
            opts.lso.eviction,
            opts.lso.swap,
            opts.lso.warm_start,
            opts.lso.slo_pull,
            opts.lso.batch_cap,
        )
        if policy_name in opts.lso_policies
        else LSOSwitches()
    )
    return SimConfig(
        replan_interval_s=opts.replan_interval_s,
        decision_delay=opts.decision_delay == "measured",
        drain_s=opts.drain_s,
        lso=lso,
        static_batch=policy.static_batch_size,
        dispatch_at_arrival=policy.dispatch_at_arrival,
        late_task_rule=opts.late_task_rule,
    )


def simulate(
    spec: ScenarioSpec,
    variant: PolicyVariant,
    factory: PolicyFactory,
    requests: Sequence[SimRequest] | None = None,
    *,
    record_estimates: bool = False,
    progress: Callable[[float], None] | None = None,
) -> SimResult:
    policy = factory(variant.policy, variant.overrides)
    config = sim_config(spec, variant.policy, policy)
    if record_estimates:
        config = replace(config, record_estimates=True)
    if variant.slo_pull is not None:
        config = replace(config, lso=replace(config.lso, slo_pull=variant.slo_pull))
    if variant.pull_gate is not None:
        config = replace(config, pull_gate=variant.pull_gate)
    if variant.late_task_rule is not None:
        config = replace(config, late_task_rule=variant.late_task_rule)
    reqs = scenario_requests(spec) if requests is None else requests
    instances = instance_specs(spec)
    if variant.max_num_seqs is not None:
        instances = [replace(i, max_num_seqs=variant.max_num_seqs) for i in instances]
    fits: dict[str, dict[str, SpeedFit]] = {}
    if config.lso.slo_pull and config.pull_gate == "saber":
        fits = saber_speed_fits(instances, reqs, spec.seed, variant.speed_profile)
        speed = {iid: {m: f.usl for m, f in per.items()} for iid, per in fits.items()}
        config = replace(config, speed_models=speed)
        if variant.saber_tokens == "task_mean":
            config = replace(
                config, output_budgets=saber_output_budgets(instances, reqs, spec.seed)
            )
        elif variant.saber_tokens != "max_tokens":
            raise ValueError(
                f"saber_tokens must be 'max_tokens' or 'task_mean', not {variant.saber_tokens!r}"
            )
    with engine_settings_known(instances):
        sim = ClusterSimulator(instances, policy, reqs, config, progress=progress)
        result = sim.run()
    result.speed_fits = {
        iid: {m: _fit_record(f, config.output_budgets.get(m)) for m, f in per.items()}
        for iid, per in fits.items()
    }
    return result


@contextmanager
def engine_settings_known(instances: Sequence[InstanceSpec]) -> Iterator[None]:
    """While a run lasts, the planner prices the engines whose pool sets a token budget
    (``max_num_batched_tokens``) at that budget, not at vLLM's default for the GPU: their
    profiles are registered as the live coordinator registers measured ones (stored by `qlm
    profile`). The planner prices a (GPU type, model) once, so every instance of one must run
    the same budget. The profiles registered before are back afterwards."""
    chosen: dict[tuple[str, str], int | None] = {}
    profiles: dict[tuple[str, str], EngineProfile] = {}
    cache: dict[tuple[str, str, int | None], EngineProfile] = {}
    for spec in instances:
        for profile in instance_profiles(spec, cache).values():
            key = (profile.gpu.name, profile.model.name)
            budget = spec.max_num_batched_tokens
            if chosen.setdefault(key, budget) != budget:
                raise ValueError(
                    f"{key[1]} on {key[0]}: every pool must run one max_num_batched_tokens "
                    f"(the planner prices a GPU type and model once), not {chosen[key]} and "
                    f"{budget}"
                )
            if budget is not None:
                profiles[key] = profile
    if not profiles:
        yield
        return
    before = measured_profiles()
    for profile in profiles.values():
        register_measured_profile(profile)
    try:
        yield
    finally:
        clear_measured_profiles()
        for profile in before.values():
            register_measured_profile(profile)


def _fit_record(fit: SpeedFit, budget: OutputBudget | None) -> dict[str, Any]:
    """A SABER column's f(L) fit as the summary keeps it, with its maxTokens per task."""
    record = fit.to_dict()
    if budget is not None:
        record["expected_output_tokens"] = {k: round(v, 1) for k, v in budget.expected.items()}
    return record


_FIT_CACHE: dict[tuple[Any, ...], SpeedFit] = {}


def saber_speed_fits(
    instances: Sequence[InstanceSpec],
    requests: Sequence[SimRequest],
    seed: int = 0,
    method: str = "decode",
) -> dict[str, dict[str, SpeedFit]]:
    """SABER's offline phase for every instance and model it serves: a USL fit of f(L) on a
    profiling sweep of the simulated engine (its cap as configured) with the workload's lengths.
    Cached per (GPU, model, profile, lengths): identical instances are profiled once."""
    if method not in ("decode", "e2e"):
        raise ValueError(f"speed profile must be 'decode' or 'e2e', not {method!r}")
    out: dict[str, dict[str, SpeedFit]] = {}
    for inst in instances:
        per: dict[str, SpeedFit] = {}
        profiles = instance_profiles(inst)
        for model in inst.models:
            if not any(r.model == model for r in requests):
                continue  # nothing to profile with, and nothing the gate will be asked about
            profile = profiles[model]
            lengths = workload_lengths(requests, model, seed)
            key = (method, inst.gpu_type, model, profile, tuple(lengths))
            fit = _FIT_CACHE.get(key)
            if fit is None:
                fitter = fit_engine_speed if method == "e2e" else fit_decode_speed
                fit = _FIT_CACHE[key] = fitter(profile, inst.gpu_type, model, lengths)
            per[model] = fit
        out[inst.instance_id] = per
    return out


def saber_output_budgets(
    instances: Sequence[InstanceSpec], requests: Sequence[SimRequest], seed: int = 0
) -> dict[str, OutputBudget]:
    """SABER's maxTokens per task for every model an instance serves (and requests use): each
    SLO class's mean output, from a seeded sample of the workload (``task_mean_outputs``)."""
    models = {m for inst in instances for m in inst.models}
    used = {r.model for r in requests}
    return {m: OutputBudget(task_mean_outputs(requests, m, seed)) for m in sorted(models & used)}


def run_scenario(
    spec: ScenarioSpec,
    factory: PolicyFactory,
    *,
    command: str = "",
    variants: Sequence[PolicyVariant] | None = None,
    policy_sweep: tuple[str, Sequence[tuple[str, PolicyVariant]]] | None = None,
    record_estimates: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Every policy × every sweep point, one summary (see qlm.tooling.simulator.report for its
    shape).

    ``variants`` defaults to ``spec.policies`` without overrides. ``policy_sweep`` =
    (label, [(point label, variant), ...]) sweeps a policy's configuration instead of the
    scenario (e.g. the grouping's δ): every point runs on the same requests."""
    if variants is None:
        variants = [PolicyVariant(p, p) for p in spec.policies]
    variants = expand_variants(spec, variants)
    summary: dict[str, Any] = {
        "scenario": spec.name,
        "description": spec.description,
        "command": command,
        "seed": spec.seed,
        # policies were told every request's true output length (max_tokens = output)
        "clairvoyant_max_tokens": spec.clairvoyant_max_tokens,
        "sweep": None,
        "policies": {},
    }
    if policy_sweep is not None:
        label, points = policy_sweep
        reqs = scenario_requests(spec)
        batch = _largest_batch([v for _, v in points], factory)
        summary["hindsight"] = _hindsight([_bound(spec, reqs, batch)], swept=False)
        summary["sweep"] = {
            "parameter": label,
            "label": label,
            "values": [p for p, _ in points],
            "variants": [str(p) for p, _ in points],
        }
        for point, variant in points:
            result, metrics = _one(spec, variant, factory, reqs, record_estimates, progress, point)
            _append(summary, variant.policy, metrics, sweep=True)
            _record_fits(summary, variant.policy, point, result)
            del result  # before the next run (above)
        return summary
    points_spec = spec.sweep_points()
    swept = spec.sweep is not None
    if swept:
        assert spec.sweep is not None
        summary["sweep"] = {
            "parameter": spec.sweep.parameter,
            "label": spec.sweep.label or spec.sweep.parameter,
            "values": list(spec.sweep.values),
            "variants": list(spec.sweep.variants or [str(v) for v in spec.sweep.values]),
        }
    # every point's requests first: a bad trace fails before any simulation ran
    workloads = {k: scenario_requests(pspec) for k, (_, pspec) in enumerate(points_spec)}
    batch = _largest_batch(variants, factory)
    bounds = [_bound(pspec, workloads[k], batch) for k, (_, pspec) in enumerate(points_spec)]
    summary["hindsight"] = _hindsight(bounds, swept=swept)
    # (point, estimate) -> (estimated, simulated) completion times, s after arrival
    pairs: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for variant in variants:
        for k, (point, pspec) in enumerate(points_spec):
            result, metrics = _one(
                pspec, variant, factory, workloads[k], record_estimates, progress, point
            )
            _append(summary, variant.label, metrics, sweep=swept)
            _record_fits(summary, variant.label, point, result)
            if record_estimates:
                _collect_estimates(pairs, point, result)
            # a run's per-request outcomes go before the next run starts, not when its result
            # replaces them (a million-request run's held a few hundred MB through the next)
            del result
    if record_estimates:
        _add_scatters(summary, pairs, [point for point, _ in points_spec])
    return summary


# what a recorded estimate is: the policy's at dispatch (QueuePolicy.dispatch_estimate), the
# target's figure; the last plan's before the request was dispatched (predicted_completions)
ESTIMATES = {
    "dispatch": "RCT estimate at dispatch",
    "plan": "RCT estimate of the last plan before dispatch",
}


def _collect_estimates(
    pairs: dict[tuple[str, str], tuple[list[float], list[float]]], point: str, result: SimResult
) -> None:
    for o in result.outcomes:
        if o.finished_s is None:
            continue
        for kind, t in (
            ("dispatch", o.dispatch_estimated_finish_s),
            ("plan", o.estimated_finish_s),
        ):
            if t is not None:
                # to 10 ms, far below the errors of interest: summary.json stays small
                xs, ys = pairs.setdefault((point, kind), ([], []))
                xs.append(round(t - o.arrival_s, 2))
                ys.append(round(o.finished_s - o.arrival_s, 2))


def _add_scatters(
    summary: dict[str, Any],
    pairs: Mapping[tuple[str, str], tuple[Sequence[float], Sequence[float]]],
    points: Sequence[str],
) -> None:
    """``summary["scatter"]``: the estimates at dispatch against the simulated completions at
    the first point (what the ``rct`` target judges); ``summary["scatters"]``: every other
    (point, estimate) that has any, each with its own R² (the plan's; the other points')."""
    scatters = []
    for point in points:
        for kind, what in ESTIMATES.items():
            if (point, kind) not in pairs:
                continue
            xs, ys = pairs[(point, kind)]
            scatters.append(
                {
                    "name": f"{kind} {point}".strip(),
                    "point": point,
                    "estimate": kind,
                    "title": f"{what} vs simulated completion time"
                    + (f" ({point})" if point else ""),
                    "x_label": "estimated completion time (s after arrival)",
                    "y_label": "simulated completion time (s after arrival)",
                    "x": list(xs),
                    "y": list(ys),
                    "r2": r_squared(xs, ys),
                }
            )
    if scatters and scatters[0]["point"] == points[0] and scatters[0]["estimate"] == "dispatch":
        summary["scatter"] = scatters.pop(0)
    if scatters:
        summary["scatters"] = scatters


def _largest_batch(variants: Sequence[PolicyVariant], factory: PolicyFactory) -> int:
    """The most sequences any column lets an engine decode at once: a column's max_num_seqs,
    or a policy's static batch (SHEPHERD's ignores the engine cap). The hindsight bound
    spreads each iteration's fixed time over at most this many."""
    caps = [v.max_num_seqs or 0 for v in variants]
    caps += [factory(v.policy, v.overrides).static_batch_size or 0 for v in variants]
    return max(caps, default=0)


def _bound(spec: ScenarioSpec, reqs: Sequence[SimRequest], batch: int) -> HindsightBound:
    """At most how many requests of the point any policy could meet
    (qlm/tooling/simulator/hindsight.py)."""
    return hindsight_bound(reqs, pools_of(instance_specs(spec), max_batch=batch))


def _hindsight(bounds: Sequence[HindsightBound], *, swept: bool) -> dict[str, Any]:
    """summary["hindsight"]: each figure a list over the sweep's points, or a scalar."""
    entries = [b.to_dict() for b in bounds]
    if not swept:
        return entries[0]
    return {key: [e[key] for e in entries] for key in entries[0]}


def _one(
    spec: ScenarioSpec,
    variant: PolicyVariant,
    factory: PolicyFactory,
    reqs: Sequence[SimRequest],
    record_estimates: bool,
    progress: Progress | None,
    point: str,
) -> tuple[SimResult, dict[str, Any]]:
    """One simulation, and its summary figures (computed once: they sort every latency)."""
    name = f"{variant.label} {point}".strip()

    def report(fraction: float) -> None:
        if progress is not None:
            progress(name, fraction)

    result = simulate(
        spec, variant, factory, reqs, record_estimates=record_estimates, progress=report
    )
    metrics = result.metrics()
    if result.speed_fits:  # a SABER run: how many requests its gate demoted
        metrics["demoted"] = result.demoted
    log.info(
        "sim_run_done",
        scenario=spec.name,
        policy=variant.label,
        point=point,
        requests=len(reqs),
        wall_s=round(result.wall_s, 2),
        events=result.events,
        attainment=metrics["slo_attainment"],
    )
    return result, metrics


def _record_fits(summary: dict[str, Any], label: str, point: str, result: SimResult) -> None:
    """SABER runs: the USL fit of f(L) the gate used, per column, sweep point, instance, model
    (``summary["speed_models"][column][point][instance][model]``)."""
    if result.speed_fits:
        per_point = summary.setdefault("speed_models", {}).setdefault(label, {})
        per_point[point] = result.speed_fits


def _append(summary: dict[str, Any], label: str, metrics: dict[str, Any], *, sweep: bool) -> None:
    entry = summary["policies"].setdefault(label, {})
    for key in (*SUMMARY_METRICS, *(k for k in OPTIONAL_METRICS if k in metrics)):
        if sweep:
            entry.setdefault(key, []).append(metrics[key])
        else:
            entry[key] = metrics[key]
    for key in ("slo_attainment_by_class", "task_attainment_by_class"):
        _append_by_class(entry, key, metrics[key], sweep=sweep)


def _append_by_class(
    entry: dict[str, Any], key: str, values: Mapping[str, float], *, sweep: bool
) -> None:
    by_class = entry.setdefault(key, {})
    points = len(entry["slo_attainment"]) if sweep else 1
    for cls, value in values.items():
        if sweep:
            # a class absent at earlier points of the sweep: None there
            by_class.setdefault(cls, [None] * (points - 1)).append(value)
        else:
            by_class[cls] = value
    if sweep:
        for per_point in by_class.values():
            if len(per_point) < points:
                per_point.append(None)  # absent at this point


def r_squared(estimated: Sequence[float], actual: Sequence[float]) -> float:
    """Coefficient of determination of ``actual`` by ``estimated`` (the y = x line)."""
    x = np.asarray(estimated, dtype=float)
    y = np.asarray(actual, dtype=float)
    ss_res = float(((y - x) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")
