"""Predicted SLO attainment of a Plan: one deterministic yardstick shared by every policy.

The planner bench (``qlm bench planner``) judges each policy's plan with this evaluator, so the
comparison does not depend on any policy's own internal estimate. The model is deliberately
simple and uses only the engine performance model (:func:`qlm.engine_model.get_profile`):

* Each instance serves its virtual queue front to back with continuous batching. For each
  model on an instance, a *typical batch* ``b`` is the number of that model's requests queued
  there, capped by the instance's ``max_batch_size`` and by how many typical sequences fit its
  KV cache (``kv_capacity_tokens // ctx``, ``ctx`` = mean prompt + half the mean output).
* The instance's output-token throughput at that batch is ``Θ = b / iteration_time(b)`` and
  its prefill throughput ``Π`` is one full chunk (``max_num_batched_tokens``) per iteration.
* A request *occupies* the instance for ``P / Π + O / Θ`` seconds (its share of the batched
  work); the queue ahead of it has to be worked off before it starts (the paper's eq. 2:
  tokens ahead divided by throughput). Its own latency once started is its prefill alone plus
  ``O`` decode iterations at the typical batch (eq. 4 with the batch as the inefficiency).
* A model switch along the queue (including from the instance's ``active_model``) costs the
  warm load time of the incoming model (``load_time_from_cpu``). ``active_model=None`` means
  unknown: the first model is taken as already loaded.
* Requests already running on the instance are ignored (``PlanInstance`` has only a count).

A request meets its SLO when its predicted completion is at or before its e2e deadline and its
predicted first token at or before its TTFT deadline. Requests without deadlines always meet;
requests left unassigned miss unless they have no deadline.

Models or GPUs that the catalog does not know (unit tests use made-up names) are timed with the
profile of ``FALLBACK_MODEL`` on ``FALLBACK_GPU``, so the evaluator never raises on them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from qlm.engine_model import EngineProfile, InsufficientMemoryError, get_profile, profile_caches
from qlm.policy import Plan, PlanInstance, PlanRequest

FALLBACK_GPU = "A100-80GB"
FALLBACK_MODEL = "mistral-7b"


@lru_cache(maxsize=256)
def profile_for(gpu_type: str, model: str) -> EngineProfile:
    """The engine profile of ``model`` on ``gpu_type``; unknown names use the fallback."""
    try:
        return get_profile(gpu_type, model)
    except (KeyError, InsufficientMemoryError):
        try:
            return get_profile(gpu_type, FALLBACK_MODEL)
        except (KeyError, InsufficientMemoryError):
            return get_profile(FALLBACK_GPU, FALLBACK_MODEL)


profile_caches(profile_for.cache_clear)  # a newly registered profile holds for the next plan


@dataclass(frozen=True)
class ServiceRates:
    """How fast one instance works through one model's requests (see module docstring)."""

    profile: EngineProfile
    batch: int
    iteration_s: float  # one decode iteration at the typical batch
    decode_tokens_per_s: float  # Θ
    prefill_tokens_per_s: float  # Π

    def occupancy_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """Seconds of the instance's batched capacity this request uses up."""
        return prompt_tokens / self.prefill_tokens_per_s + output_tokens / self.decode_tokens_per_s

    def latency_s(self, prompt_tokens: int, output_tokens: int) -> tuple[float, float]:
        """(time to first token, time to completion) once the request starts."""
        ttft = self.profile.prefill_time(max(prompt_tokens, 1))
        return ttft, ttft + output_tokens * self.iteration_s


def service_rates(
    instance: PlanInstance, model: str, n_requests: int, mean_prompt: float, mean_output: float
) -> ServiceRates:
    profile = profile_for(instance.gpu_type, model)
    ctx = max(1, round(mean_prompt + mean_output / 2))
    fit = max(1, instance.kv_capacity_tokens // ctx)
    batch = max(1, min(instance.max_batch_size, fit, n_requests))
    iteration = profile.decode_iteration_time(batch, ctx)
    chunk = profile.max_num_batched_tokens
    return ServiceRates(
        profile=profile,
        batch=batch,
        iteration_s=iteration,
        decode_tokens_per_s=batch / iteration,
        prefill_tokens_per_s=chunk / profile.prefill_time(chunk),
    )


def switch_cost_s(instance: PlanInstance, model: str) -> float:
    return profile_for(instance.gpu_type, model).load_time_from_cpu()


def _meets(req: PlanRequest, first_token: float, completion: float) -> bool:
    if req.deadline is not None and completion > req.deadline:
        return False
    return not (req.ttft_deadline is not None and first_token > req.ttft_deadline)


def queue_completions(
    queue: Sequence[PlanRequest], instance: PlanInstance, now: float
) -> list[tuple[float, float]]:
    """Predicted (first token, completion) times of each request of one virtual queue."""
    stats: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for req in queue:
        s = stats[req.model]
        s[0] += 1
        s[1] += req.prompt_tokens
        s[2] += req.max_tokens
    rates = {m: service_rates(instance, m, int(n), p / n, o / n) for m, (n, p, o) in stats.items()}
    out: list[tuple[float, float]] = []
    t = now
    current = instance.active_model
    for req in queue:
        if current is not None and req.model != current:
            t += switch_cost_s(instance, req.model)
        current = req.model
        r = rates[req.model]
        ttft, done = r.latency_s(req.prompt_tokens, req.max_tokens)
        out.append((t + ttft, t + done))
        t += r.occupancy_s(req.prompt_tokens, req.max_tokens)
    return out


def predicted_attainment(
    plan: Plan,
    requests: Sequence[PlanRequest],
    instances: Sequence[PlanInstance],
    now: float,
) -> float:
    """Fraction of ``requests`` predicted to meet their SLO under ``plan`` (1.0 when empty).

    Ids in the plan that are not in ``requests`` are ignored (they do not occupy capacity);
    requests the plan leaves out entirely count as unassigned.
    """
    if not requests:
        return 1.0
    by_id = {r.request_id: r for r in requests}
    inst_by_id = {i.instance_id: i for i in instances}
    met = 0
    seen: set[str] = set()
    for iid, ids in plan.queues.items():
        inst = inst_by_id.get(iid)
        queue = [by_id[rid] for rid in ids if rid in by_id]
        if inst is None or not queue:
            continue
        for req, (first, done) in zip(queue, queue_completions(queue, inst, now), strict=True):
            seen.add(req.request_id)
            met += _meets(req, first, done)
    # Unassigned (or never placed): only requests without any deadline count as met.
    met += sum(
        1
        for r in requests
        if r.request_id not in seen and r.deadline is None and r.ttft_deadline is None
    )
    return met / len(requests)
