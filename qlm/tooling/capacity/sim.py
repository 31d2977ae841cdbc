"""Capacity policies in the loop of the cluster simulator: the ``capacity`` scenario.

:class:`CapacityLoop` is what a live autoscaling loop does, on simulated time: every
``interval_s`` it measures the cluster (instances per cell, effective memory utilisation, the
last minute's input tokens, SLO misses, idle instances), forecasts the next hour at each hour
boundary for the forecast-driven policies, asks a :class:`~planner.capacity.CapacityPolicy` for
a decision and hands the decision's JSON to the simulator's driver
(:class:`qlm.tooling.capacity.autoscaling.SimulatorDriver`), where new instances join after their
start-up time.

:func:`run_capacity_scenario` runs one day of diurnal load (:mod:`qlm.tooling.capacity.diurnal`)
once
per capacity policy, on the same requests, with the same request ordering policy (FCFS by
default), and reports instance-hours, scaling waste, p95 latency and SLO attainment side by
side. docs/capacity.md describes the scenario and its measured results.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from qlm.capacity.forecast import TokenForecast, TokenRateSeries, forecast_next_hour, trailing_mean
from qlm.planner.capacity.policies import (
    CapacityObservation,
    CapacityPolicy,
    CapacitySpec,
    Cell,
    InstanceProfile,
    PoolKey,
    cato_counts_violation,
    create_capacity_policy,
)
from qlm.policy import QueuePolicy
from qlm.tooling.capacity.autoscaling import InstanceTemplate, SimulatorDriver
from qlm.tooling.capacity.diurnal import DiurnalLoad, diurnal_requests, history_tpm
from qlm.tooling.simulator.cluster import ClusterSimulator, InstanceSpec, SimConfig
from qlm.tooling.simulator.cluster import instance_profiles as engine_profiles

log = structlog.get_logger(__name__)

CAPACITY_POLICY_NAMES = ("reactive", "cato", "lt-i", "lt-u", "lt-ua")


def cell_key(cell: Cell) -> str:
    return "/".join(cell)


@dataclass
class TimelinePoint:
    t_s: float
    live: int
    starting: int
    arrival_rps: float
    emu: float


class CapacityLoop:
    """The autoscaler in the simulator's loop: a
    ``qlm.tooling.simulator.cluster.CapacityController``."""

    def __init__(
        self,
        policy: CapacityPolicy,
        templates: dict[Cell, InstanceTemplate],
        *,
        interval_s: float = 15.0,
        forecast: bool = False,
        history: dict[PoolKey, np.ndarray] | None = None,
        timeline_every_s: float = 300.0,
        smoothing_min: int = 10,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.policy = policy
        self.templates = templates
        self.interval_s = interval_s
        self.forecast = forecast
        self.smoothing_min = smoothing_min
        self.driver: SimulatorDriver | None = None
        self._series: dict[PoolKey, TokenRateSeries] = {}
        self._recent: dict[PoolKey, deque[tuple[float, int]]] = {}
        self._seen = 0  # arrivals accounted for
        self._finished_seen: set[str] = set()
        self._forecasts: dict[PoolKey, TokenForecast] = {}
        self._forecast_hour: int | None = None
        self.forecast_s = 0.0
        self.decide_s = 0.0
        self.timeline: list[TimelinePoint] = []
        self._timeline_every = timeline_every_s
        self._next_point = 0.0
        self._arrived_since_point = 0
        self._kv_cache: dict[Cell, int] = {}
        for key, per_minute in (history or {}).items():
            series = self._series_of(key)
            for m, tokens in enumerate(per_minute):
                series.observe(-60.0 * (len(per_minute) - m) + 30.0, float(tokens))

    def attach(self, sim: ClusterSimulator, owned: dict[str, list[str]]) -> None:
        self.driver = SimulatorDriver(
            sim, {cell_key(c): t for c, t in self.templates.items()}, owned=owned
        )

    def _series_of(self, key: PoolKey) -> TokenRateSeries:
        if key not in self._series:
            self._series[key] = TokenRateSeries(key.model, key.pool, keep_minutes=120)
        return self._series[key]

    def _pool_of(self, model: str) -> PoolKey | None:
        for c in self.templates:
            if c.model == model:
                return PoolKey(c.model, c.pool)
        return None

    # ------------------------------------------------------------------ one tick
    def on_tick(self, sim: ClusterSimulator) -> None:
        assert self.driver is not None, "attach() the loop to its simulator first"
        now = sim.now
        self._account_arrivals(sim)
        violations, idle = self._violations_and_idle(sim)
        obs = CapacityObservation(
            now=now,
            instances=self._instances(),
            utilisation=self._utilisation(sim),
            observed_tpm=self._observed_tpm(now),
            forecasts=self._forecasts_at(now) if self.forecast else {},
            sla_violations=violations,
            idle_instances=idle,
        )
        t0 = time.perf_counter()
        decision = self.policy.decide(obs)
        self.decide_s += time.perf_counter() - t0
        if decision.changed:
            self.driver.apply_now(decision.to_dict())
        if now >= self._next_point:
            self._record(sim, obs)

    def _instances(self) -> dict[Cell, int]:
        assert self.driver is not None
        counts = {c: 0 for c in self.templates}
        for key, n in self.driver.counts().items():
            model, gpu, pool = key.rsplit("/", 2)
            counts[Cell(model, gpu, pool)] = n
        return counts

    def _account_arrivals(self, sim: ClusterSimulator) -> None:
        arrived = len(sim.jobs)
        for req in sim.requests[self._seen : arrived]:
            key = self._pool_of(req.model)
            if key is None:
                continue
            self._series_of(key).observe(req.arrival_s, req.prompt_tokens)
            self._recent.setdefault(key, deque()).append((req.arrival_s, req.prompt_tokens))
        self._arrived_since_point += arrived - self._seen
        self._seen = arrived

    def _observed_tpm(self, now: float) -> dict[PoolKey, float]:
        out = {}
        for key, window in self._recent.items():
            while window and window[0][0] <= now - 60.0:
                window.popleft()
            out[key] = float(sum(n for _, n in window))
        return out

    def _forecasts_at(self, now: float) -> dict[PoolKey, TokenForecast]:
        hour = int(math.floor(now / 3600.0))
        if hour != self._forecast_hour:
            self._forecast_hour = hour
            t0 = time.perf_counter()
            self._forecasts = {}
            for key, series in self._series.items():
                per_minute = series.per_minute(now)
                if per_minute.size == 0:  # nothing measured yet: no forecast, hold capacity
                    log.warning("capacity_forecast_skipped", model=key.model)
                    continue
                self._forecasts[key] = forecast_next_hour(
                    trailing_mean(per_minute, self.smoothing_min),
                    origin_s=math.floor(now / 60.0) * 60.0,
                    model=key.model,
                    pool=key.pool,
                )
            self.forecast_s += time.perf_counter() - t0
        return self._forecasts

    def _live_of(self, sim: ClusterSimulator, key: PoolKey) -> list[str]:
        assert self.driver is not None
        ids = []
        for cell, members in self.driver.cells.items():
            model, _, pool = cell.rsplit("/", 2)
            if (model, pool) == key:
                ids += [i for i in members if i in sim.instances]
        return ids

    def _utilisation(self, sim: ClusterSimulator) -> dict[PoolKey, float]:
        """SageServe's EMU: KV memory in use over the KV memory of the deployment, draining
        instances included (they still hold memory). [interp] Instances still starting count
        in the denominator (their memory is the deployment's already): without that, EMU
        stays high for the whole start-up of an instance, and a policy with a 15 s cooldown
        keeps adding instances for the same burst."""
        assert self.driver is not None
        out: dict[PoolKey, float] = {}
        starting = set(sim.starting())
        for key in {PoolKey(c.model, c.pool) for c in self.templates}:
            used = capacity = 0.0
            for inst in [*sim.instances.values(), *sim.draining.values()]:
                if key.model in inst.models:
                    used += inst.kv_used
                    capacity += inst.kv_capacity
            for cell, members in self.driver.cells.items():
                model, gpu, pool = cell.rsplit("/", 2)
                n_start = sum(1 for i in members if i in starting)
                if (model, pool) == key and n_start:
                    capacity += n_start * self._kv_capacity(Cell(model, gpu, pool))
            if capacity > 0:
                out[key] = min(1.0, used / capacity)
        return out

    def _kv_capacity(self, cell: Cell) -> int:
        if cell not in self._kv_cache:
            spec = self.templates[cell].spec
            self._kv_cache[cell] = engine_profiles(spec)[cell.model].kv_capacity_tokens
        return self._kv_cache[cell]

    def _violations_and_idle(
        self, sim: ClusterSimulator
    ) -> tuple[dict[PoolKey, int], dict[PoolKey, int]]:
        idle: dict[PoolKey, int] = {}
        for key in {PoolKey(c.model, c.pool) for c in self.templates}:
            idle[key] = sum(
                1
                for iid in self._live_of(sim, key)
                if not sim.instances[iid].running
                and not sim.instances[iid].waiting
                and not len(sim.queues[iid])
            )
        violations: dict[PoolKey, int] = {}
        for job in sim.take_finished():
            pool_key = self._pool_of(job.req.model)
            slo = job.req.e2e_slo_s
            if pool_key is None or slo is None or job.finished_s is None:
                continue
            elapsed = job.finished_s - job.req.arrival_s
            if cato_counts_violation(
                remaining_completion_s=elapsed,
                remaining_slack_s=slo,
                last_elapsed_s=elapsed,
                node_target_s=slo,
                idle_replicas=idle.get(pool_key, 0),
            ):
                violations[pool_key] = violations.get(pool_key, 0) + 1
        return violations, idle

    def _record(self, sim: ClusterSimulator, obs: CapacityObservation) -> None:
        span = sim.now - (self.timeline[-1].t_s if self.timeline else 0.0)
        rate = self._arrived_since_point / span if span > 0 else 0.0
        emu = max(obs.utilisation.values(), default=0.0)
        self.timeline.append(
            TimelinePoint(sim.now, len(sim.instances), len(sim.starting()), rate, emu)
        )
        self._arrived_since_point = 0
        self._next_point = sim.now + self._timeline_every


# ---------------------------------------------------------------------------- profiling


def profile_instance_rps(
    template: InstanceSpec,
    load: DiurnalLoad,
    policy_factory: Callable[[str], QueuePolicy],
    *,
    minutes: float = 20.0,
    attainment: float = 0.95,
    seed: int = 0,
) -> float:
    """The highest steady arrival rate (req/s) of ``load``'s requests one instance serves at
    ≥ ``attainment`` SLO attainment: SageServe's "throughput at the target latency", profiled
    offline on the engine model by bisection over short constant-rate runs."""
    model = template.models[0]

    def ok(rps: float) -> bool:
        steady = DiurnalLoad(
            model=model,
            peak_rps=rps,
            trace=load.trace,
            trough_ratio=1.0,
            e2e_slo_s=load.e2e_slo_s,
            ttft_slo_s=load.ttft_slo_s,
            name="profile",
        )
        reqs = diurnal_requests([steady], hours=minutes / 60.0, seed=seed)
        sim = ClusterSimulator([template], policy_factory("fcfs"), reqs, SimConfig(drain_s=900))
        got = sim.run().metrics()["slo_attainment"] or 0.0
        return bool(got >= attainment)

    lo, hi = 0.0, 0.5
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise ValueError("the instance never saturates: check the SLO")
    for _ in range(7):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    if lo <= 0:
        raise ValueError(f"one {template.gpu_type} instance cannot meet the SLO of {model} at all")
    return lo


# ---------------------------------------------------------------------------- the scenario


@dataclass(frozen=True)
class CapacityScenario:
    """One pool, one GPU type, one model per diurnal stream (docs/capacity.md)."""

    loads: tuple[DiurnalLoad, ...]
    gpu_type: str = "A100-80GB"
    gpu_cost_per_hour: float = 3.67  # on-demand A100 80GB, per GPU (public price lists, 2024)
    pool: str = "pool-0"
    hours: float = 24.0
    startup_s: float = 600.0  # cold; SageServe: ≈ 10 min to redeploy a model in the region
    warm_start_s: float = 60.0  # reclaiming a spare holding the model; SageServe: ≈ 1 min
    forecast_smoothing_min: int = 10  # the forecaster sees a trailing mean of the token rate
    interval_s: float = 15.0
    min_instances: int = 1
    max_instances: int = 24
    queue_policy: str = "fcfs"
    initial_instances: int | None = None  # per model; default: what covers the rate at t = 0
    seed: int = 0
    description: str = ""

    def template(self, model: str) -> InstanceSpec:
        return InstanceSpec("template", self.gpu_type, (model,))


def capacity_preset(
    hours: float = 24.0, peak_rps: float = 8.0, warm_start_s: float = 60.0
) -> CapacityScenario:
    """The shipped ``capacity`` scenario: Llama-2-70B (TP 2 on A100-80GB) serving the Azure
    conversation trace shaped into a day peaking at ``peak_rps`` at 14:00, trough 25 %."""
    load = DiurnalLoad(
        model="llama-2-70b",
        peak_rps=peak_rps,
        trace="conv",
        trough_ratio=0.25,
        peak_hour=14.0,
        e2e_slo_s=60.0,
        name="conv",
    )
    return CapacityScenario(
        loads=(load,),
        hours=hours,
        warm_start_s=warm_start_s,
        description=(
            f"A day ({hours:g} h) of the Azure conversation trace shaped into a diurnal curve "
            f"(peak {peak_rps:g} req/s at 14:00, trough 25 %) on Llama-2-70B instances (2 × "
            f"A100-80GB each) started in 10 min cold, {warm_start_s:g} s from the spare pool; "
            "instance-hours, scaling waste, p95 latency and SLO attainment (60 s end to end) "
            "per capacity policy"
        ),
    )


def run_capacity_scenario(
    scenario: CapacityScenario,
    policy_factory: Callable[[str], QueuePolicy],
    *,
    policies: Sequence[str] = CAPACITY_POLICY_NAMES,
    command: str = "",
    echo: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every capacity policy on the same day of requests; returns the summary (JSON-able)."""
    unknown = [p for p in policies if p not in CAPACITY_POLICY_NAMES and reactive_up(p) is None]
    if unknown:
        raise ValueError(
            f"unknown capacity policies {unknown}; known: {CAPACITY_POLICY_NAMES} and "
            "reactive@U (reactive with up threshold U)"
        )
    started = time.perf_counter()
    requests = diurnal_requests(list(scenario.loads), hours=scenario.hours, seed=scenario.seed)
    profiles: dict[str, dict[str, float]] = {}
    instance_profiles: list[InstanceProfile] = []
    templates: dict[Cell, InstanceTemplate] = {}
    history: dict[PoolKey, np.ndarray] = {}
    initial: dict[Cell, int] = {}
    for load in scenario.loads:
        template = scenario.template(load.model)
        rps = profile_instance_rps(template, load, policy_factory, seed=scenario.seed)
        reqs = [r for r in requests if r.model == load.model]
        mean_prompt = float(np.mean([r.prompt_tokens for r in reqs])) if reqs else 1.0
        tpm = rps * mean_prompt * 60.0
        gpus = engine_profiles(template)[load.model].tp
        cell = Cell(load.model, scenario.gpu_type, scenario.pool)
        instance_profiles.append(
            InstanceProfile(load.model, scenario.gpu_type, tpm, gpus, scenario.startup_s)
        )
        templates[cell] = InstanceTemplate(template, scenario.startup_s, scenario.warm_start_s)
        history[PoolKey(load.model, scenario.pool)] = history_tpm(load, seed=scenario.seed)
        initial[cell] = scenario.initial_instances or max(
            scenario.min_instances, math.ceil(float(load.rate(0.0)) / rps)
        )
        profiles[load.model] = {
            "rps_at_slo": round(rps, 3),
            "tpm": round(tpm),
            "gpus": gpus,
            "mean_prompt_tokens": round(mean_prompt, 1),
            "initial_instances": initial[cell],
        }
        echo(
            f"profiled {load.model} on {scenario.gpu_type}: {rps:.2f} req/s at the SLO "
            f"(θ = {tpm:,.0f} input tokens/min); {initial[cell]} instance(s) at t = 0"
        )
    capacity_spec = CapacitySpec(
        profiles=tuple(instance_profiles),
        gpu_cost_per_hour={scenario.gpu_type: scenario.gpu_cost_per_hour},
        default_min_instances=scenario.min_instances,
        max_instances={PoolKey(c.model, c.pool): scenario.max_instances for c in templates},
    )
    results: dict[str, Any] = {}
    timelines: dict[str, list[dict[str, float]]] = {}
    for name in policies:
        kwargs: dict[str, Any] = {}
        if name == "cato":
            kwargs["max_replicas"] = scenario.max_instances
        up = reactive_up(name)
        if up is not None:  # reactive with other thresholds, the same 0.4 apart as 0.7 / 0.3
            kwargs.update(up_threshold=up, down_threshold=max(0.0, up - REACTIVE_GAP))
        policy = create_capacity_policy(
            "reactive" if up is not None else name, capacity_spec, **kwargs
        )
        loop = CapacityLoop(
            policy,
            templates,
            interval_s=scenario.interval_s,
            forecast=name.startswith("lt-"),
            history=history,
            smoothing_min=scenario.forecast_smoothing_min,
        )
        specs: list[InstanceSpec] = []
        owned: dict[str, list[str]] = {}
        for cell, n in initial.items():
            for k in range(n):
                iid = f"{cell.pool}-{cell.gpu_type}-{cell.model}-init{k}"
                specs.append(InstanceSpec(iid, cell.gpu_type, (cell.model,)))
                owned.setdefault(cell_key(cell), []).append(iid)
        sim = ClusterSimulator(
            specs,
            policy_factory(scenario.queue_policy),
            requests,
            SimConfig(drain_s=1800.0),
            controller=loop,
        )
        loop.attach(sim, owned)
        t0 = time.perf_counter()
        result = sim.run()
        metrics = result.metrics()
        metrics["forecast_wall_s"] = round(loop.forecast_s, 2)
        metrics["decide_wall_s"] = round(loop.decide_s, 2)
        metrics["decisions"] = loop.driver.decisions if loop.driver else 0
        metrics["sim_wall_s"] = round(time.perf_counter() - t0, 1)
        results[name] = metrics
        timelines[name] = [
            {
                "t_h": round(p.t_s / 3600.0, 3),
                "live": p.live,
                "starting": p.starting,
                "arrival_rps": round(p.arrival_rps, 3),
                "emu": round(p.emu, 3),
            }
            for p in loop.timeline
        ]
        echo(
            f"{name:>8}: {metrics['instance_hours']:.1f} instance-h, waste "
            f"{metrics['scaling_waste_hours']:.1f} h, p95 {_fmt(metrics['p95_latency_s'])} s, "
            f"SLO {100 * (metrics['slo_attainment'] or 0):.1f} %  ({metrics['sim_wall_s']} s)"
        )
    summary: dict[str, Any] = {
        "scenario": "capacity",
        "description": scenario.description,
        "command": command,
        "seed": scenario.seed,
        "hours": scenario.hours,
        "requests": len(requests),
        "profiles": profiles,
        "policies": results,
        "timelines": timelines,
        "wall_s": round(time.perf_counter() - started, 1),
        # the diurnal day's requests carry their true output as max_tokens (diurnal.py): the
        # capacity policies size fleets from token rates, and the request planner sees it too
        "clairvoyant_max_tokens": True,
    }
    summary["checks"] = capacity_checks(results)
    return summary


REACTIVE_GAP = 0.4  # reactive's default thresholds, 0.7 up and 0.3 down, are this far apart


def reactive_up(name: str) -> float | None:
    """The up threshold of a tuned reactive column ``reactive@U`` (None: not one)."""
    base, sep, value = name.partition("@")
    if base != "reactive" or not sep:
        return None
    try:
        up = float(value)
    except ValueError:
        return None
    return up if 0.0 < up <= 1.0 else None


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def capacity_checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 8's target: LT-UA ≥ 20 % fewer instance-hours than reactive with p95 end-to-end
    latency and SLO attainment no worse."""
    if "lt-ua" not in results or "reactive" not in results:
        return []
    checks = _default_reactive_checks(results)
    tuned = {n: r for n, r in results.items() if n == "reactive" or reactive_up(n) is not None}
    if len(tuned) > 1:
        checks.append(_equal_attainment_check(results["lt-ua"], tuned))
    return checks


def _equal_attainment_check(ua: dict[str, Any], reactive: dict[str, Any]) -> dict[str, Any]:
    """Issue 17's form of the target: reactive's thresholds tuned to LT-UA's SLO attainment.
    Among the reactive columns that meet at least LT-UA's attainment, the cheapest; LT-UA must
    use >= 20 % fewer instance-hours than it. None reaching it: LT-UA wins at equal attainment
    as far as the thresholds tried go (said so)."""
    target = ua["slo_attainment"] or 0.0
    reach = {n: r for n, r in reactive.items() if (r["slo_attainment"] or 0.0) >= target}
    tried = ", ".join(
        f"{n} {100 * (r['slo_attainment'] or 0):.1f} % / {r['instance_hours']:.1f} h"
        for n, r in sorted(reactive.items())
    )
    name = "LT-UA uses ≥ 20 % fewer instance-hours than reactive tuned to its SLO attainment"
    if not reach:
        return {
            "target": name,
            "measured": f"no reactive threshold tried reaches LT-UA's {100 * target:.1f} % "
            f"({tried})",
            "met": True,
        }
    best_name, best = min(reach.items(), key=lambda kv: kv[1]["instance_hours"])
    saving = 1.0 - ua["instance_hours"] / best["instance_hours"]
    return {
        "target": name,
        "measured": f"{100 * saving:.1f} % fewer ({ua['instance_hours']:.1f} vs {best_name} "
        f"{best['instance_hours']:.1f} at {100 * (best['slo_attainment'] or 0):.1f} % against "
        f"LT-UA's {100 * target:.1f} %; tried: {tried})",
        "met": saving >= 0.20,
    }


def _default_reactive_checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    ua, re = results["lt-ua"], results["reactive"]
    saving = 1.0 - ua["instance_hours"] / re["instance_hours"] if re["instance_hours"] else 0.0
    p95_ok = (ua["p95_latency_s"] or math.inf) <= (re["p95_latency_s"] or math.inf)
    slo_ok = (ua["slo_attainment"] or 0.0) >= (re["slo_attainment"] or 0.0)
    return [
        {
            "target": "LT-UA uses ≥ 20 % fewer instance-hours than reactive",
            "measured": f"{100 * saving:.1f} % fewer ({ua['instance_hours']:.1f} vs "
            f"{re['instance_hours']:.1f})",
            "met": saving >= 0.20,
        },
        {
            "target": "LT-UA p95 end-to-end latency no worse than reactive",
            "measured": f"{_fmt(ua['p95_latency_s'])} s vs {_fmt(re['p95_latency_s'])} s",
            "met": p95_ok,
        },
        {
            "target": "LT-UA SLO attainment no worse than reactive",
            "measured": f"{100 * (ua['slo_attainment'] or 0):.1f} % vs "
            f"{100 * (re['slo_attainment'] or 0):.1f} %",
            "met": slo_ok,
        },
    ]
