"""``qlm bench planner``: replan latency, predicted SLO attainment and memory of each policy.

A benchmark, not a test. Each case is a synthetic queue of ``queued`` requests waiting for
``instances`` instances, with tight or loose SLOs; each policy replans it ``repeats`` times.

**Queue.** Prompt/output lengths are drawn (seeded) from three shipped tables with equal odds:
the Azure 2023 conversation and code traces and ShareGPT (:mod:`qlm.trace`). Models:
mistral-7b (60 %) and vicuna-13b (40 %); lengths are clipped to the model's context as
:func:`qlm.trace.to_requests` does. The backlog arrived evenly over the ``ARRIVAL_WINDOW_S``
seconds before ``now``.

**Instances.** Alternating blocks of four A100-80GB and four H100-80GB; in each block one
instance serves only mistral-7b, one only vicuna-13b and two serve both. Each instance's
KV capacity and max batch come from the engine model; its active model is its first model.

**SLOs**, relative to each request's *service estimate* ``s`` (prefill alone plus its output
at ``REFERENCE_BATCH`` decode iterations on an A100-80GB, from :mod:`qlm.engine_model`) and to
the queue's *drain estimate* ``D`` (the whole backlog's occupancy, as
:mod:`qlm.planner.evaluate` computes it on an A100-80GB serving one model, divided by the
instance count):

* 30 % interactive: e2e deadline = arrival + ``k * s``, ``k`` = 3 (tight) or 10 (loose);
* 70 % batch: e2e deadline = now + ``u * D``, ``u`` uniform in [0.1, 0.6] (tight) or
  [0.5, 1.5] (loose).

**Measures.** Replan latency is the wall time of ``policy.plan`` (p50/p95 over the repeats,
the first call included: it pays any lazy imports, as a coordinator's first replan would).
With ``--live`` it is the live coordinator's replan instead: the backlog is admitted into a
:class:`~qlm.coordinator.core.CoordinatorCore` (each request placed on arrival by the
policy), and a replan is its inputs taken (``begin_plan``), the policy's plan and the virtual
queues adopting it (``adopt_plan``), each phase's seconds in the JSON (``live_phases_s``).
Predicted SLO attainment is :func:`qlm.planner.evaluate.predicted_attainment` of the last plan,
the same evaluator for every policy. Peak RSS: every (case, policy) runs in a fresh
``spawn``-ed process, which reports its own ``ru_maxrss`` (peak resident set of the whole
process: interpreter, imports, the queue and the replans) and its RSS just before the first
replan (``base_rss_mb``), so ``peak - base`` is what planning added.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import random
import resource
import statistics
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import structlog

from qlm.catalog import MODELS
from qlm.control import Heartbeat, InstanceInfo, InstanceStatus
from qlm.coordinator.core import CoordinatorCore
from qlm.planner import POLICIES, create_policy
from qlm.planner.evaluate import predicted_attainment, profile_for, service_rates
from qlm.policy import PlanInstance, PlanRequest, QueuePolicy
from qlm.trace import load_azure_trace, load_request_lengths
from qlm.types import SLO, RequestMessage

log = structlog.get_logger(__name__)

QUEUED = (1_000, 10_000, 100_000)
INSTANCES = (8, 32)
SLOS = ("tight", "loose")
DEFAULT_POLICIES = ("qlm", "edf", "fcfs", "shepherd", "round_robin", "random")
PRIMARY = "qlm"

BENCH_MODELS = ("mistral-7b", "vicuna-13b")
MODEL_WEIGHTS = (0.6, 0.4)
GPU_BLOCKS = ("A100-80GB", "H100-80GB")
REFERENCE_GPU = "A100-80GB"
REFERENCE_BATCH = 32
ARRIVAL_WINDOW_S = 2.0
INTERACTIVE_SHARE = 0.3
NOW = 1_700_000_000.0  # a fixed wall clock, so cases are reproducible


@dataclass(frozen=True)
class SLOSetting:
    interactive_factor: float
    batch_lo: float
    batch_hi: float


SLO_SETTINGS = {
    "tight": SLOSetting(interactive_factor=3.0, batch_lo=0.1, batch_hi=0.6),
    "loose": SLOSetting(interactive_factor=10.0, batch_lo=0.5, batch_hi=1.5),
}


@cache
def _length_pools() -> tuple[tuple[tuple[int, int], ...], ...]:
    conv = tuple((r.prompt_tokens, r.output_tokens) for r in load_azure_trace("conv"))
    code = tuple((r.prompt_tokens, r.output_tokens) for r in load_azure_trace("code"))
    share = tuple(load_request_lengths("sharegpt"))
    return conv, code, share


def build_instances(n: int) -> list[PlanInstance]:
    out = []
    for k in range(n):
        gpu = GPU_BLOCKS[(k // 4) % 2]
        models = {0: ("mistral-7b",), 1: ("vicuna-13b",)}.get(k % 4, BENCH_MODELS)
        profiles = [profile_for(gpu, m) for m in models]
        out.append(
            PlanInstance(
                instance_id=f"inst-{k:03d}",
                models=tuple(models),
                gpu_type=gpu,
                kv_capacity_tokens=min(p.kv_capacity_tokens for p in profiles),
                max_batch_size=min(p.max_batch_size for p in profiles),
                active_model=models[0],
            )
        )
    return out


def service_estimate_s(model: str, prompt: int, output: int) -> float:
    profile = profile_for(REFERENCE_GPU, model)
    ctx = max(1, round(prompt + output / 2))
    return profile.prefill_time(max(prompt, 1)) + output * profile.decode_iteration_time(
        REFERENCE_BATCH, ctx
    )


def build_queue(queued: int, n_instances: int, slo: str, seed: int = 0) -> list[PlanRequest]:
    """The synthetic backlog of one case (see the module docstring)."""
    if slo not in SLO_SETTINGS:
        raise ValueError(f"slo must be one of {sorted(SLO_SETTINGS)}")
    setting = SLO_SETTINGS[slo]
    rng = random.Random(f"bench-planner/{seed}/{queued}/{n_instances}/{slo}")
    pools = _length_pools()
    drafts: list[tuple[str, int, int, float]] = []
    for i in range(queued):
        model = rng.choices(BENCH_MODELS, weights=MODEL_WEIGHTS)[0]
        spec = MODELS[model]
        prompt, output = rng.choice(rng.choice(pools))
        output = min(max(output, 1), spec.max_output_tokens, spec.max_context - 1)
        prompt = min(max(prompt, 1), spec.max_context - output)
        arrival = NOW - ARRIVAL_WINDOW_S * (1 - i / queued)
        drafts.append((model, prompt, output, arrival))
    # Drain estimate: the backlog's occupancy on reference instances, shared by all instances.
    occupancy = 0.0
    for model in BENCH_MODELS:
        mine = [(p, o) for m, p, o, _ in drafts if m == model]
        if not mine:
            continue
        ref = build_instances(4)[2]  # a both-models A100 instance
        rates = service_rates(
            ref,
            model,
            len(mine),
            statistics.fmean(p for p, _ in mine),
            statistics.fmean(o for _, o in mine),
        )
        occupancy += sum(rates.occupancy_s(p, o) for p, o in mine)
    drain = occupancy / max(n_instances, 1)
    out = []
    for i, (model, prompt, output, arrival) in enumerate(drafts):
        if rng.random() < INTERACTIVE_SHARE:
            cls = "interactive"
            deadline = arrival + setting.interactive_factor * service_estimate_s(
                model, prompt, output
            )
        else:
            cls = "batch"
            deadline = NOW + rng.uniform(setting.batch_lo, setting.batch_hi) * drain
        out.append(
            PlanRequest(
                request_id=f"q{i}",
                model=model,
                prompt_tokens=prompt,
                max_tokens=output,
                arrival_time=arrival,
                deadline=deadline,
                ttft_deadline=None,
                slo_class=cls,
                seq=i,
            )
        )
    return out


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: with few repeats p95 is the slowest run)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def live_core(
    reqs: Sequence[PlanRequest], insts: Sequence[PlanInstance], policy: QueuePolicy
) -> CoordinatorCore:
    """A coordinator core holding the case's backlog as the live coordinator would: its
    instances registered by one heartbeat, each request admitted as a message (a text prompt
    of 4 bytes a token, which the core counts back to its length; its SLO in whole ms) and
    placed by ``policy`` on arrival. Nothing is dispatched: every request stays queued."""
    core = CoordinatorCore(policy, heartbeat_timeout_s=3600.0, clock=lambda: NOW)
    core.on_heartbeat(
        Heartbeat(
            agent_id="bench",
            sent_at=NOW,
            instances=[
                InstanceStatus(
                    info=InstanceInfo(
                        instance_id=i.instance_id,
                        agent_id="bench",
                        engine="sim",
                        gpu_type=i.gpu_type,
                        gpu_memory_gb=80,
                        models=list(i.models),
                        kv_capacity_tokens=i.kv_capacity_tokens,
                        max_batch_size=i.max_batch_size,
                    ),
                    active_model=i.active_model,
                )
                for i in insts
            ],
        ),
        now=NOW,
    )
    texts: dict[int, str] = {}  # one string per prompt length: the backlog's memory is not
    # what is measured
    for r in reqs:
        assert r.deadline is not None
        text = texts.get(r.prompt_tokens)
        if text is None:
            text = texts[r.prompt_tokens] = "x" * (4 * r.prompt_tokens)
        msg = RequestMessage(
            request_id=r.request_id,
            model=r.model,
            prompt=text,
            max_tokens=r.max_tokens,
            slo=SLO(
                e2e_ms=max(1, round((r.deadline - r.arrival_time) * 1000)), slo_class=r.slo_class
            ),
            submitted_at=r.arrival_time,
        )
        core.admit(
            msg, None, reply_to="bench", correlation_id=r.request_id, received_at=r.arrival_time
        )
    return core


def run_policy_case(
    queued: int,
    instances: int,
    slo: str,
    policy: str,
    repeats: int,
    seed: int = 0,
    live: bool = False,
) -> dict[str, Any]:
    """One (case, policy): build the queue, replan ``repeats`` times, evaluate the last plan.
    ``live``: the backlog sits in a coordinator core (:func:`live_core`) and a replan is what
    the live coordinator does: the inputs taken (``begin_plan``), the policy's plan, and the
    virtual queues taking it (``adopt_plan``). Meant to run in a fresh process (see
    :func:`run_cases`) so its peak RSS is its own."""
    reqs = build_queue(queued, instances, slo, seed)
    insts = build_instances(instances)
    pol = create_policy(policy)
    core = live_core(reqs, insts, pol) if live else None
    base_rss = _rss_now_mb()
    times = []
    phases: list[tuple[float, float, float]] = []
    plan = None
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        if core is None:
            plan = pol.plan(reqs, insts, NOW)
            times.append(time.perf_counter() - t0)
            continue
        inputs = core.begin_plan()
        t1 = time.perf_counter()
        plan = pol.plan(*inputs, NOW)
        t2 = time.perf_counter()
        core.adopt_plan(plan, NOW)
        t3 = time.perf_counter()
        times.append(t3 - t0)
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        reqs, insts = inputs  # what the last plan was made of
    assert plan is not None
    attainment = predicted_attainment(plan, reqs, insts, NOW)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    out = {
        "policy": policy,
        "replan_s": times,
        "replan_s_p50": statistics.median(times),
        "replan_s_p95": _percentile(times, 95),
        "predicted_slo_attainment": attainment,
        "peak_rss_mb": round(peak_rss, 1),
        "base_rss_mb": round(base_rss, 1),
        "unassigned": len(plan.unassigned),
        "plan_meta": {k: v for k, v in plan.meta.items() if isinstance(v, int | float | str)},
    }
    if core is not None:
        out["live_phases_s"] = [
            {"begin_plan": round(b, 4), "plan": round(p, 4), "adopt_plan": round(a, 4)}
            for b, p, a in phases
        ]
    return out


def _spawned(args: tuple[int, int, str, str, int, int, bool]) -> dict[str, Any]:
    return run_policy_case(*args)


def run_cases(
    cases: Iterable[tuple[int, int, str]],
    policies: Sequence[str],
    *,
    repeats: int = 3,
    seed: int = 0,
    isolate: bool = True,
    on_result: Any = None,
    live: bool = False,
) -> dict[str, Any]:
    """Run every case with every policy; returns the JSON document ``--json`` writes."""
    ctx = multiprocessing.get_context("spawn")
    registered = [p for p in policies if p in POLICIES]
    missing = [p for p in policies if p not in POLICIES]
    out_cases = []
    for queued, n_inst, slo in cases:
        per_policy: dict[str, Any] = {
            p: {"policy": p, "skipped": "policy not registered"} for p in missing
        }
        for name in registered:
            args = (queued, n_inst, slo, name, repeats, seed, live)
            if isolate:
                # One fresh process per (case, policy): its ru_maxrss is this run's peak alone.
                with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                    result = pool.submit(_spawned, args).result()
            else:
                result = run_policy_case(*args)
            per_policy[name] = result
            if on_result is not None:
                on_result(queued, n_inst, slo, result)
        primary = per_policy.get(PRIMARY, {})
        edf = per_policy.get("edf", {})
        out_cases.append(
            {
                "queued": queued,
                "instances": n_inst,
                "slo": slo,
                "primary_policy": PRIMARY if "replan_s_p50" in primary else None,
                "replan_s_p50": primary.get("replan_s_p50"),
                "replan_s_p95": primary.get("replan_s_p95"),
                "predicted_slo_attainment": primary.get("predicted_slo_attainment"),
                "edf_predicted_slo_attainment": edf.get("predicted_slo_attainment"),
                "peak_rss_mb": primary.get("peak_rss_mb"),
                "policies": per_policy,
            }
        )
    return {
        "benchmark": "planner",
        "live": live,
        "repeats": repeats,
        "seed": seed,
        "rss": "ru_maxrss of a fresh spawned process per (case, policy)"
        if isolate
        else "ru_maxrss of the bench process (not isolated)",
        "notes": [f"{PRIMARY!r} not registered: top-level planner figures are null"]
        if PRIMARY not in POLICIES
        else [],
        "cases": out_cases,
    }


def format_row(queued: int, n_inst: int, slo: str, r: dict[str, Any]) -> str:
    if "skipped" in r:
        return (
            f"{queued:>7} {n_inst:>4} {slo:>5}  {r.get('policy', ''):<12} skipped: {r['skipped']}"
        )
    return (
        f"{queued:>7} {n_inst:>4} {slo:>5}  {r['policy']:<12} {r['replan_s_p50']:>8.3f} "
        f"{r['replan_s_p95']:>8.3f} {r['predicted_slo_attainment']:>9.3f} {r['peak_rss_mb']:>8.0f}"
    )


HEADER = (
    f"{'queued':>7} {'inst':>4} {'slo':>5}  {'policy':<12} {'p50 s':>8} {'p95 s':>8} "
    f"{'attain':>9} {'rss MB':>8}"
)


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=2))


def select_cases(
    queued: int | None, instances: int | None, slo: str | None
) -> list[tuple[int, int, str]]:
    """The grid, narrowed by whichever of ``--queued/--instances/--slo`` were given."""
    if slo is not None and slo not in SLO_SETTINGS:
        raise ValueError(f"--slo must be one of {sorted(SLO_SETTINGS)}")
    return [
        (q, m, s)
        for q in ((queued,) if queued is not None else QUEUED)
        for m in ((instances,) if instances is not None else INSTANCES)
        for s in ((slo,) if slo is not None else SLOS)
    ]


def run_bench(
    *,
    queued: int | None = None,
    instances: int | None = None,
    slo: str | None = None,
    repeats: int = 3,
    policies: Sequence[str] = DEFAULT_POLICIES,
    seed: int = 0,
    json_path: Path | None = None,
    isolate: bool = True,
    echo: Any = print,
    live: bool = False,
) -> dict[str, Any]:
    """What ``qlm bench planner`` runs: prints a table row per (case, policy) as it goes."""
    cases = select_cases(queued, instances, slo)
    echo(HEADER)
    doc = run_cases(
        cases,
        policies,
        repeats=repeats,
        seed=seed,
        isolate=isolate,
        on_result=lambda q, m, s, r: echo(format_row(q, m, s, r)),
        live=live,
    )
    for case in doc["cases"]:
        for r in case["policies"].values():
            if "skipped" in r:
                echo(format_row(case["queued"], case["instances"], case["slo"], r))
    for note in doc["notes"]:
        echo(f"note: {note}")
    if json_path is not None:
        write_json(doc, json_path)
    return doc
