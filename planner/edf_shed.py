"""EDFShedPolicy: EDF with a latency-SLO admitter and model affinity, policy name ``edf-shed``.

What a platform team gets today from llm-d's flow control without a stochastic planner: requests
ordered earliest-deadline-first; an admitter that predicts, for each request, whether it can
still finish by its deadline where it would wait, and demotes the ones predicted to miss to a
best-effort tail (served only when nothing feasible waits on that instance) or, with
``on_miss="shed"``, drops them; and placement that prefers an instance already running the
request's model unless another is clearly less loaded.

When to choose it: as the strong simple baseline for a mostly single-model fleet in overload,
where serving work that will miss anyway only delays work that can still meet; and to measure
what qlm's planner adds beyond "EDF + don't waste capacity on hopeless requests". It never
preempts, keeps no models warm and has no notion of groups or model runs beyond affinity, so it
pays a model switch whenever EDF interleaves models on an instance. Under sustained overload
the demoted tail can starve (by design, as llm-d's best-effort band does); until the policy has
seen ``min_history`` completions of a model it has no length model and demotes nothing (EDF).

The prediction ("will this request miss?") uses only what is known before it runs:

* its output length: the same output-length model the ``qlm`` policy uses
  (:class:`qlm.estimator.OutputLengthModel`, or the per-request forest of
  :mod:`qlm.length_forest` with ``length_model="forest"``), fitted on completions observed
  online, at the ``length_quantile`` (0.5: the mean). The request's ``max_tokens`` is not used
  unless ``use_max_tokens=True`` (a client's cap says little; in the simulator's labelled
  clairvoyant variant it is the true output);
* the instance's per-token time at the batch it runs, from :mod:`qlm.engine_model` (the typical
  batch of the RCT estimator when work waits, the running batch plus one when none does), and
  the prompt's prefill time;
* its wait: the estimated work (prompt + predicted output tokens) queued ahead of it in EDF
  order on that instance, at the instance's token throughput (the RCT estimator's eq. 2).

``plan`` walks every queued request in EDF order and decides each one exactly; ``place`` (one
arrival) estimates the work ahead from the last plan's deadline profile of the instance scaled to
its current load, and asks for a replan every ``replan_every_s`` while arrivals come.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from qlm.estimator import OutputLengthModel, RCTEstimator, engine_profile, normal_quantile
from qlm.policy import CompletionObservation, Plan, PlanInstance, PlanRequest, QueuePolicy

NO_CAP = 1 << 20  # output-length cap when the request's max_tokens is not used
DEFAULT_CTX = 1024  # context tokens assumed for the batch before any completion is seen


@dataclass(frozen=True)
class EDFShedConfig:
    # what happens to a request predicted to miss: best-effort tail, or dropped (unassigned)
    on_miss: Literal["demote", "shed"] = "demote"
    length_model: Literal["normal", "forest"] = "normal"
    length_quantile: float = 0.5  # the predicted output length: this quantile of the model
    min_history: int = 32  # completions of a model before anything of it is demoted
    use_max_tokens: bool = False  # cap the length estimate at the request's max_tokens
    affinity: bool = True  # prefer an instance whose active model matches
    replan_every_s: float = 1.0

    def __post_init__(self) -> None:
        if self.on_miss not in ("demote", "shed"):
            raise ValueError("on_miss must be 'demote' or 'shed'")
        if self.length_model not in ("normal", "forest"):
            raise ValueError("length_model must be 'normal' or 'forest'")
        if not 0.0 < self.length_quantile < 1.0:
            raise ValueError("length_quantile must be in (0, 1)")
        if self.min_history < 1 or self.replan_every_s <= 0:
            raise ValueError("min_history must be >= 1 and replan_every_s > 0")


@dataclass
class _Rates:
    """One (instance, model)'s timing: token throughput, prefill, per-token time, switch-in."""

    throughput_tps: float
    prefill_fixed_s: float
    prefill_s_per_token: float
    token_s_busy: float  # per output token inside the typical batch
    token_s_idle: float  # per output token inside the running batch plus this request
    switch_s: float


class EDFShedPolicy(QueuePolicy):
    name = "edf-shed"
    keeps_state = (
        "the last plan's deadline profile per instance (place reads it) and the output-length "
        "model (observe_completion writes it)"
    )

    def __init__(self, config: EDFShedConfig | None = None, **overrides: Any) -> None:
        cfg = config or EDFShedConfig()
        if overrides:
            cfg = replace(cfg, **overrides)
        self.config = cfg
        self._z = normal_quantile(cfg.length_quantile)
        self.lengths: OutputLengthModel
        if cfg.length_model == "forest":
            from qlm.length_forest import ForestLengthModel, QuantileLengthPredictor

            self.lengths = ForestLengthModel(
                "max_tokens",
                forest=QuantileLengthPredictor(cap_feature=cfg.use_max_tokens),
                prior_weight=0.0,
            )
        else:
            self.lengths = OutputLengthModel("max_tokens", prior_weight=0.0)
        self._history: dict[str, int] = {}  # completions seen per model
        self._prompt_sum: dict[str, float] = {}
        self._out_sum: dict[str, float] = {}
        # per request: (work tokens, demoted?, stamp); work is fixed at first sight so the
        # caller's load bookkeeping (add at place, subtract at dispatch) stays exact
        self._memo: dict[str, tuple[int, bool, int]] = {}
        self._stamp = 0
        self._forget_before = 0  # stamps up to here not in a plan's snapshot are forgotten
        # per instance, from the last plan: feasible requests' deadlines and the work queued
        # up to each (place() scales it to the instance's current load)
        self._profile: dict[str, tuple[list[float], list[float]]] = {}
        self._planned_at: float | None = None
        self._arrivals = 0
        self.shed: list[str] = []  # shed by the last plan (on_miss="shed")
        # until the next completion changes the length model: predictions and timings
        self._predicted: dict[tuple[Any, ...], float] = {}
        self._rates_cache: dict[tuple[Any, ...], _Rates] = {}

    # ------------------------------------------------------------------ interface
    def sort_key(self, request: PlanRequest) -> tuple[Any, ...]:
        """(demoted, effective deadline, arrival, seq): EDF among feasible work, then the
        best-effort tail in EDF order."""
        memo = self._memo.get(request.request_id)
        demoted = memo[1] if memo else False
        return (demoted, request.effective_deadline, request.arrival_time, request.seq)

    def work_tokens(self, request: PlanRequest) -> int:  # type: ignore[override]
        """Prompt plus predicted output tokens, fixed at the request's first sight."""
        memo = self._memo.get(request.request_id)
        if memo is None:
            memo = self._remember(request, False)
        return memo[0]

    def wants_replan(self, now: float) -> bool:
        if not self._arrivals:
            return False
        return self._planned_at is None or now - self._planned_at >= self.config.replan_every_s

    def observe_completion(self, obs: CompletionObservation) -> None:
        model = obs.model
        self.lengths.observe(
            model,
            obs.slo_class,
            obs.output_tokens,
            prompt_tokens=obs.prompt_tokens,
            max_tokens=obs.max_tokens if self.config.use_max_tokens else None,
            tenant=obs.tenant,
        )
        self._predicted.clear()
        self._rates_cache.clear()
        self._history[model] = self._history.get(model, 0) + 1
        self._out_sum[model] = self._out_sum.get(model, 0.0) + max(obs.output_tokens, 1)
        self._prompt_sum[model] = self._prompt_sum.get(model, 0.0) + (obs.prompt_tokens or 0)

    def place(
        self,
        request: PlanRequest,
        instances: Sequence[PlanInstance],
        load: Mapping[str, float],
        now: float,
    ) -> str | None:
        eligible = [i for i in instances if i.serves(request.model)]
        if not eligible:
            return None
        self._arrivals += 1
        work = self.work_tokens(request)
        best: tuple[tuple[Any, ...], PlanInstance, float] | None = None
        for inst in eligible:
            rates = self._rates(inst, request.model)
            queued = max(load.get(inst.instance_id, 0.0), 0.0)
            wait = self._ahead_fraction(inst.instance_id, request) * queued / rates.throughput_tps
            key = (
                queued / rates.throughput_tps + self._switch(inst, request.model, rates),
                inst.active_model != request.model,
                inst.running,
                inst.instance_id,
            )
            if best is None or key < best[0]:
                best = (key, inst, wait + self._switch(inst, request.model, rates))
        assert best is not None
        _, inst, wait = best
        rates = self._rates(inst, request.model)
        busy = load.get(inst.instance_id, 0.0) > 0 or inst.running >= self._batch(inst, request)
        if self._misses(request, rates, now + wait, busy):
            if self.config.on_miss == "shed":
                self._memo.pop(request.request_id, None)
                return None
            self._memo[request.request_id] = (work, True, self._memo[request.request_id][2])
        return inst.instance_id

    def plan(
        self,
        requests: Sequence[PlanRequest],
        instances: Sequence[PlanInstance],
        now: float,
    ) -> Plan:
        """Every request in EDF order to the instance where it would start first (model
        affinity: a switch costs its load time), demoted (or shed) there when predicted to
        miss; demoted work joins the least loaded tail."""
        self._forget(requests)
        self._planned_at = now
        self._arrivals = 0
        self.shed = []
        feasible: dict[str, list[PlanRequest]] = {i.instance_id: [] for i in instances}
        tail: dict[str, list[PlanRequest]] = {i.instance_id: [] for i in instances}
        ahead_s = dict.fromkeys(feasible, 0.0)  # feasible work queued, in seconds
        tail_s = dict.fromkeys(feasible, 0.0)
        last_model = {i.instance_id: i.active_model for i in instances}
        profile: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in feasible}
        unassigned: list[str] = []
        ordered = sorted(
            requests, key=lambda r: (r.effective_deadline, r.arrival_time, r.seq, r.request_id)
        )
        for req in ordered:
            eligible = [i for i in instances if i.serves(req.model)]
            if not eligible:
                unassigned.append(req.request_id)
                continue
            work = self.work_tokens(req)
            scored = []
            for inst in eligible:
                rates = self._rates(inst, req.model)
                switch = self._switch_from(last_model[inst.instance_id], inst, req.model, rates)
                scored.append(
                    (
                        ahead_s[inst.instance_id] + switch,
                        inst.running,
                        inst.instance_id,
                        inst,
                        rates,
                        switch,
                    )
                )
            start, _, iid, inst, rates, switch = min(scored, key=lambda s: s[:3])
            busy = ahead_s[iid] > 0 or inst.running >= self._batch(inst, req)
            if self._misses(req, rates, now + start, busy):
                if self.config.on_miss == "shed":
                    self.shed.append(req.request_id)
                    unassigned.append(req.request_id)
                    self._memo.pop(req.request_id, None)
                    continue
                self._set_demoted(req, True)
                target = min(eligible, key=lambda i: (tail_s[i.instance_id], i.instance_id))
                tail[target.instance_id].append(req)
                tail_s[target.instance_id] += work / self._rates(target, req.model).throughput_tps
                continue
            self._set_demoted(req, False)
            feasible[iid].append(req)
            ahead_s[iid] += switch + work / rates.throughput_tps
            last_model[iid] = req.model
            deadlines, cum = profile[iid]
            deadlines.append(req.effective_deadline)
            cum.append((cum[-1] if cum else 0.0) + work)
        self._profile = profile
        queues = {
            iid: [r.request_id for r in feasible[iid]] + [r.request_id for r in tail[iid]]
            for iid in feasible
        }
        meta: dict[str, Any] = {"demoted": sum(len(t) for t in tail.values())}
        if self.shed:
            meta["shed"] = list(self.shed)
        return Plan(queues=queues, unassigned=unassigned, policy=self.name, meta=meta)

    # ------------------------------------------------------------------ prediction
    def _predicted_output(self, request: PlanRequest) -> float | None:
        """The output length at ``length_quantile``, or None while the model has too little
        history to say."""
        if self._history.get(request.model, 0) < self.config.min_history:
            return None
        cap = request.max_tokens if self.config.use_max_tokens else NO_CAP
        forest = self.config.length_model == "forest"
        key = (request.model, request.slo_class, cap, request.prompt_tokens if forest else 0)
        cached = self._predicted.get(key)
        if cached is not None:
            return cached
        mean, var = self.lengths.predict(
            request.model,
            request.slo_class,
            np.array([max(cap, 1)]),
            prompt_tokens=np.array([request.prompt_tokens]),
        )
        out = float(np.clip(mean[0] + self._z * math.sqrt(float(var[0])), 1.0, max(cap, 1)))
        if len(self._predicted) > 65536:
            self._predicted.clear()
        self._predicted[key] = out
        return out

    def _remember(self, request: PlanRequest, demoted: bool) -> tuple[int, bool, int]:
        out = self._predicted_output(request)
        if out is None:  # no length model yet: the model's mean so far, else the client's cap
            n = self._history.get(request.model, 0)
            out = self._out_sum[request.model] / n if n else float(request.max_tokens)
        self._stamp += 1
        memo = (int(request.prompt_tokens + round(out)), demoted, self._stamp)
        self._memo[request.request_id] = memo
        return memo

    def _set_demoted(self, request: PlanRequest, demoted: bool) -> None:
        work, _, stamp = self._memo.get(request.request_id) or self._remember(request, demoted)
        self._memo[request.request_id] = (work, demoted, stamp)

    def _forget(self, requests: Sequence[PlanRequest]) -> None:
        """Drop what is known about requests no longer queued (dispatched or gone); requests
        first seen since the previous plan are kept (they may be queued beside the snapshot)."""
        keep = {r.request_id for r in requests}
        since = self._forget_before
        self._memo = {k: v for k, v in self._memo.items() if k in keep or v[2] > since}
        self._forget_before = self._stamp

    def _misses(self, request: PlanRequest, rates: _Rates, start: float, busy: bool) -> bool:
        """Whether the request, starting at ``start``, is predicted to miss a deadline."""
        out = self._predicted_output(request)
        if out is None:
            return False
        first_token = (
            start + rates.prefill_fixed_s + rates.prefill_s_per_token * request.prompt_tokens
        )
        if request.ttft_deadline is not None and first_token > request.ttft_deadline:
            return True
        per_token = rates.token_s_busy if busy else rates.token_s_idle
        return request.deadline is not None and first_token + out * per_token > request.deadline

    def _ahead_fraction(self, iid: str, request: PlanRequest) -> float:
        """Share of an instance's queued work due no later than the request (last plan's
        profile; all of it when there is none)."""
        deadlines, cum = self._profile.get(iid, ([], []))
        if not cum or cum[-1] <= 0:
            return 1.0
        k = bisect.bisect_right(deadlines, request.effective_deadline)
        return cum[k - 1] / cum[-1] if k else 0.0

    def _ctx(self, model: str) -> int:
        n = self._history.get(model, 0)
        if not n:
            return DEFAULT_CTX
        return max(1, round((self._prompt_sum[model] + self._out_sum[model] / 2) / n))

    def _batch(self, inst: PlanInstance, request: PlanRequest) -> int:
        return self._hw(inst, request.model).batch

    def _hw(self, inst: PlanInstance, model: str) -> Any:
        return RCTEstimator.profile(
            inst.gpu_type, model, inst.kv_capacity_tokens, inst.max_batch_size, self._ctx(model)
        )

    def _rates(self, inst: PlanInstance, model: str) -> _Rates:
        key = (
            inst.gpu_type,
            model,
            inst.kv_capacity_tokens,
            inst.max_batch_size,
            inst.running,
            inst.warm_models is None or model in inst.warm_models,
        )
        rates = self._rates_cache.get(key)
        if rates is None:
            rates = self._rates_cache[key] = self._compute_rates(inst, model)
        return rates

    def _compute_rates(self, inst: PlanInstance, model: str) -> _Rates:
        hw = self._hw(inst, model)
        ep = engine_profile(inst.gpu_type, model)
        ctx = self._ctx(model)
        idle_batch = max(1, min(hw.batch, inst.running + 1))
        warm = inst.warm_models is None or model in inst.warm_models
        return _Rates(
            throughput_tps=hw.throughput_tps,
            prefill_fixed_s=hw.prefill_fixed_s,
            prefill_s_per_token=hw.prefill_s_per_token,
            token_s_busy=ep.decode_iteration_time(hw.batch, ctx),
            token_s_idle=ep.decode_iteration_time(idle_batch, ctx),
            switch_s=hw.switch_in_s(warm),
        )

    def _switch(self, inst: PlanInstance, model: str, rates: _Rates) -> float:
        return self._switch_from(inst.active_model, inst, model, rates)

    def _switch_from(
        self, current: str | None, inst: PlanInstance, model: str, rates: _Rates
    ) -> float:
        """The model-affinity term: a switch costs the load time (nothing when the instance is
        empty of models, or without affinity)."""
        if not self.config.affinity or current is None or current == model:
            return 0.0
        return rates.switch_s
