"""Largest service-gain density first (Tempo's LSDF), as a qlm ordering policy.

Tempo serves the request with the largest *service-gain density*: the gain it can still earn
(``qlm.service_gain``: ``1·prompt + 2·output`` tokens, discounted by ``min(1, SLO / latency)``
if it will be late) per second of processing it still needs. Short requests that are still
worth something go first; a request that can only finish very late is worth less per second
and waits behind those that can still be saved - but never drops to zero, so it is served
eventually. Tempo also keeps a share of capacity for best-effort requests (no deadline: their
"density" is their plain gain) so a stream of urgent work cannot starve them: here every
``1 / best_effort_share``-th position of each virtual queue goes to the oldest best-effort
request (10 %, Tempo's default).

What a policy knows at plan time: the prompt, ``max_tokens`` and the deadlines. The output
length is estimated from completions observed so far (mean per model and SLO class, capped at
``max_tokens``; ``max_tokens / 2`` before any). The processing time is the request's share of
the GPU in the engine performance model (``qlm.engine_model``): its prefill, plus for each
output token its share of a decode iteration at a typical batch (32 sequences, 1k context) -
a decoded token costs several times a prefilled one, which is what makes short outputs dense.
Between replans an arrival is placed by ``sort_key``, the density at its arrival.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from qlm.engine_model import profile_caches
from qlm.policy import (
    CompletionObservation,
    Plan,
    PlanInstance,
    PlanRequest,
    QueuePolicy,
    token_rate,
)
from qlm.service_gain import W_IN, W_OUT, decay

REFERENCE_GPU = "A100-80GB"  # for sort_key, which does not know the instance
TYPICAL_BATCH, TYPICAL_CONTEXT = 32, 1024


@lru_cache(maxsize=256)
def token_costs(gpu_type: str, model: str) -> tuple[float, float]:
    """GPU seconds per prompt token (prefill) and per output token (its share of a decode
    iteration at a typical batch), from the engine performance model; for a pair the model
    does not know, both from ``token_rate``."""
    from qlm.engine_model import get_profile

    try:
        profile = get_profile(gpu_type, model)
    except (KeyError, ValueError):
        per = 1.0 / token_rate(gpu_type, model)
        return per, per
    prefill = profile.prefill_time(TYPICAL_CONTEXT) / TYPICAL_CONTEXT
    decode = profile.decode_iteration_time(TYPICAL_BATCH, TYPICAL_CONTEXT) / TYPICAL_BATCH
    return prefill, decode


profile_caches(token_costs.cache_clear)  # a newly registered profile holds for the next plan


class GainDensityPolicy(QueuePolicy):
    """Largest service-gain density first, with a best-effort reserve (module docstring)."""

    name = "gain_density"
    keeps_state = "the output-length model (observe_completion writes it; sort_key reads it)"

    def __init__(self, best_effort_share: float = 0.1, alpha: float = 1.0) -> None:
        if not 0.0 <= best_effort_share < 1.0:
            raise ValueError("best_effort_share must be in [0, 1)")
        if alpha <= 0:
            raise ValueError("alpha must be > 0")
        self.best_effort_share = best_effort_share
        self.alpha = alpha
        self._out_sum: dict[tuple[str, str | None], float] = defaultdict(float)
        self._out_n: dict[tuple[str, str | None], int] = defaultdict(int)

    # ---------------------------------------------------------------- estimates
    def observe_completion(self, obs: CompletionObservation) -> None:
        key = (obs.model, obs.slo_class)
        self._out_sum[key] += obs.output_tokens
        self._out_n[key] += 1

    def expected_output(self, request: PlanRequest) -> float:
        key = (request.model, request.slo_class)
        n = self._out_n.get(key, 0)
        guess = self._out_sum[key] / n if n else request.max_tokens / 2
        return max(1.0, min(float(request.max_tokens), guess))

    def density(self, request: PlanRequest, now: float, gpu_type: str = REFERENCE_GPU) -> float:
        """Gain still to be earned per second of processing, if it started now."""
        out = self.expected_output(request)
        prefill_s, decode_s = token_costs(gpu_type, request.model)
        first_token_s = request.prompt_tokens * prefill_s
        need_s = first_token_s + out * decode_s
        waited = max(0.0, now - request.arrival_time)
        gain_in, gain_out = W_IN * request.prompt_tokens, W_OUT * out
        if request.deadline is not None:
            slo = request.deadline - request.arrival_time
            f = decay(slo, waited + need_s, self.alpha) if slo > 0 else 0.0
            gain_out *= f
            if request.ttft_deadline is None:
                gain_in *= f
        if request.ttft_deadline is not None:
            ttft_slo = request.ttft_deadline - request.arrival_time
            first_s = waited + first_token_s
            gain_in *= decay(ttft_slo, first_s, self.alpha) if ttft_slo > 0 else 0.0
        return (gain_in + gain_out) / need_s

    @staticmethod
    def best_effort(request: PlanRequest) -> bool:
        return request.deadline is None and request.ttft_deadline is None

    # ---------------------------------------------------------------- ordering
    def sort_key(self, request: PlanRequest) -> tuple[Any, ...]:
        return (-self.density(request, request.arrival_time), request.arrival_time, request.seq)

    def plan(
        self,
        requests: Sequence[PlanRequest],
        instances: Sequence[PlanInstance],
        now: float,
    ) -> Plan:
        fastest = {r.request_id: _fastest_gpu(r.model, instances) for r in requests}
        ranked = sorted(
            (r for r in requests if not self.best_effort(r)),
            key=lambda r: (-self.density(r, now, fastest[r.request_id]), r.arrival_time, r.seq),
        )
        reserve = sorted(
            (r for r in requests if self.best_effort(r)), key=lambda r: (r.arrival_time, r.seq)
        )
        order = _interleave(ranked, reserve, self.best_effort_share)
        queues: dict[str, list[str]] = {i.instance_id: [] for i in instances}
        load: dict[str, float] = dict.fromkeys(queues, 0.0)
        unassigned: list[str] = []
        for req in order:
            inst = self.choose_instance(req, instances, load)
            if inst is None:
                unassigned.append(req.request_id)
                continue
            queues[inst.instance_id].append(req.request_id)
            load[inst.instance_id] += self.work_tokens(req)
        return Plan(queues=queues, unassigned=unassigned, policy=self.name)


def _fastest_gpu(model: str, instances: Sequence[PlanInstance]) -> str:
    gpus = {i.gpu_type for i in instances if i.serves(model)}
    return max(sorted(gpus), key=lambda g: token_rate(g, model)) if gpus else REFERENCE_GPU


def _interleave(
    ranked: list[PlanRequest], reserve: list[PlanRequest], share: float
) -> list[PlanRequest]:
    """``ranked`` with every ``1/share``-th position given to the next of ``reserve`` (and
    what is left of either appended): the best-effort reserve."""
    if share <= 0 or not reserve:
        return ranked + reserve
    every = max(1, math.floor(1.0 / share))
    out: list[PlanRequest] = []
    r = b = 0
    while r < len(ranked) or b < len(reserve):
        if b < len(reserve) and (len(out) + 1) % every == 0 or r >= len(ranked):
            out.append(reserve[b])
            b += 1
        else:
            out.append(ranked[r])
            r += 1
    return out
