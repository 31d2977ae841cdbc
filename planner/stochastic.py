"""QLMPolicy: the stochastic planner (QLM §4, §6, §7), policy name ``qlm``.

One replan (``plan``):

1. predict each request's output length (mean, variance) from the workload profile
   (:class:`qlm.estimator.OutputLengthModel`), and price it on every instance that serves its
   model with the hardware profile of that (GPU, model) (:mod:`qlm.estimator`);
2. group requests (:func:`qlm.grouping.build_groups`, Algorithm 1);
3. build the group problem (:class:`qlm.planner.milp.GroupProblem`) with the Δ-quantile
   deterministic equivalents and solve it *by structure*: a greedy incumbent (EDF over groups,
   model affinity, swap costs, hopeless groups deferred), best-improvement local search, then a
   rolling horizon — the head of each queue re-ordered exactly by a small MILP (cvxpy/HiGHS) —
   all under a hard time budget;
4. score every candidate (the group plan before and after improvement, and request-level EDF)
   request by request with the RCT estimator at the chance level Δ, and return the best. On a
   tie, or when no candidate meets every SLO, EDF wins ties: the paper's fallback (A.3).

Also in the plan's ``meta``: ``lso`` (per instance: active/warm/cold models, whether the head
group should preempt the running batch and by swap or eviction) and ``scale_up`` (how many
more instances of which GPU type would make the plan feasible). ``place`` joins an arrival to
its nearest group in O(k) and flags a predicted violation for :meth:`wants_replan`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
from scipy.stats import norm

from qlm.estimator import HardwareProfile, OutputLengthModel, RCTEstimator
from qlm.grouping import GroupIndex, GroupingConfig, build_groups, request_features
from qlm.planner.baselines import EDFPolicy
from qlm.planner.milp import (
    GroupProblem,
    WorkClock,
    evaluate_queues,
    greedy_assign,
    iterated_local_search,
    local_search,
    queue_times,
    solve_slots,
)
from qlm.policy import (
    CompletionObservation,
    InstanceLSO,
    Plan,
    PlanInstance,
    PlanRequest,
    QueuePolicy,
)
from qlm.service_gain import W_IN, W_OUT

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class QLMConfig:
    slo_quantile: float = 0.9  # Δ of eq. 12
    grouping: GroupingConfig = field(default_factory=GroupingConfig)
    # Until completions are observed, assume each request may use its whole max_tokens (the
    # conservative prior); "sharegpt" etc. use a shipped length table instead.
    output_prior: str = "max_tokens"
    # "normal": the per-group fit above; "forest": per-request quantile regression forest once
    # it has 256 completions of a model (qlm/length_forest.py, docs/length-bound.md)
    length_model: str = "normal"
    # False keeps max_tokens out of the forest's features: needed where it is derived from the
    # true output (the simulator's clairvoyant_max_tokens variant), which would leak the answer
    length_cap_feature: bool = True
    time_budget_s: float = 0.3  # improvement phases stop here (measured from plan() start)
    scale_up_budget_s: float = 0.05
    head_groups: int = 6  # rolling horizon: groups per queue ordered exactly by the MILP
    milp_time_limit_s: float = 0.15
    max_milp_queues: int = 8
    enumerate_up_to: int = 4  # heads this short are ordered by enumeration, not the MILP
    local_search_max_groups: int = 400
    ils_max_groups: int = 60  # iterated local search (perturb + descend) up to this many groups
    solver: str = "HIGHS"
    # "wall": budgets are wall-clock seconds (live); "work": a WorkClock, so the same inputs
    # give the same plan on any machine (the simulator's default)
    budget_clock: str = "wall"
    max_plan_age_s: float = 30.0
    drift_threshold: float = 4.0
    starvation_factor: float = 1.0  # overdue by more than this × own SLO: served first
    scale_up_max: int = 256
    balance_factor: float = 2.0  # place(): leave a group's queue above this × the lightest
    # what the plan maximises: "attainment" (requests meeting their SLO, the QLM paper) or
    # "service-gain" (Tempo: w_in·prompt + w_out·output tokens of the requests meeting it)
    objective: str = "attainment"

    def __post_init__(self) -> None:
        if not 0.5 <= self.slo_quantile < 1:
            raise ValueError("slo_quantile (Δ) must be in [0.5, 1)")
        if self.budget_clock not in ("wall", "work"):
            raise ValueError("budget_clock must be 'wall' or 'work'")
        if self.time_budget_s < 0 or self.head_groups < 1:
            raise ValueError("time_budget_s must be >= 0 and head_groups >= 1")
        if self.objective not in ("attainment", "service-gain"):
            raise ValueError("objective must be 'attainment' or 'service-gain'")


@dataclass
class _Priced:
    """Per-request arrays of one replan, in canonical order."""

    reqs: list[PlanRequest]
    model_idx: np.ndarray
    prompt: np.ndarray
    out_mean: np.ndarray
    out_var: np.ndarray
    deadline: np.ndarray  # effective e2e deadline, s from now (inf: none)
    e2e: np.ndarray  # e2e deadline only, s from now
    ttft: np.ndarray  # ttft deadline, s from now
    seq: np.ndarray
    # what meeting each request's SLO is worth: 1 (attainment), or its expected service gain
    # over the mean one (service-gain; normalised so the tie-break weights keep their scale)
    value: np.ndarray


class QLMPolicy(QueuePolicy):
    name = "qlm"

    def __init__(self, config: QLMConfig | None = None, **overrides: Any) -> None:
        cfg = config or QLMConfig()
        if overrides:
            from dataclasses import replace

            cfg = replace(cfg, **overrides)
        self.config = cfg
        self.z = float(norm.ppf(cfg.slo_quantile))
        self._clock: Callable[[], float] = (
            WorkClock() if cfg.budget_clock == "work" else time.perf_counter
        )
        self._forest_lengths = cfg.length_model == "forest"
        if cfg.length_model == "forest":
            from qlm.length_forest import ForestLengthModel, QuantileLengthPredictor

            lengths: OutputLengthModel = ForestLengthModel(
                cfg.output_prior,
                forest=QuantileLengthPredictor(cap_feature=cfg.length_cap_feature),
                auto_refresh=False,  # _maybe_refresh_forest: off the event loop when live
            )
        elif cfg.length_model == "normal":
            lengths = OutputLengthModel(cfg.output_prior)
        else:
            raise ValueError(f"length_model must be normal or forest, got {cfg.length_model!r}")
        self.estimator = RCTEstimator(lengths)
        self._forest_refresh: asyncio.Task[Any] | None = None
        # -- state kept between plans for place()/sort_key()/wants_replan()
        self._keys: dict[str, tuple[float, int]] = {}
        self._index = GroupIndex()
        self._group_inst: dict[int, str] = {}
        self._inst_groups: dict[str, set[int]] = {}  # instance -> its groups, for pruning
        self._group_last_pos: dict[int, float] = {}
        self._group_size: dict[int, int] = {}
        self._plan_len: dict[str, int] = {}
        self._suffix_slack: dict[str, np.ndarray] = {}
        self._added: dict[str, float] = {}
        self._theta: dict[tuple[str, str], float] = {}
        self._next_gid = 0
        self._planned_at: float | None = None
        self._violation = False
        self._arrivals_since_plan = 0
        self._half_out: dict[int, float] = {}
        self._completion: dict[str, np.ndarray] = {}
        self._last_detail: tuple[Any, Any, list[PlanRequest], float] | None = None

    # ------------------------------------------------------------------ interface
    def sort_key(self, request: PlanRequest) -> tuple[Any, ...]:
        """(position of the request's group in its queue, arrival seq): planned requests keep
        their planned position; an arrival sorts right after its group's last member."""
        return self._keys.get(request.request_id, (math.inf, request.seq))

    def observe_completion(self, obs: CompletionObservation) -> None:
        lengths = self.estimator.lengths
        lengths.observe(
            obs.model,
            obs.slo_class,
            obs.output_tokens,
            prompt_tokens=obs.prompt_tokens,
            max_tokens=obs.max_tokens,
            tenant=obs.tenant,
        )
        if self._forest_lengths:
            self._maybe_refresh_forest()

    def _maybe_refresh_forest(self) -> None:
        """Retrain the length forest when due: in a worker thread when an event loop runs (the
        live coordinator: a refresh costs ~0.3 s of CPU), inline otherwise (the simulator,
        whose clock is virtual)."""
        from qlm.length_forest import ForestLengthModel

        lengths = self.estimator.lengths
        assert isinstance(lengths, ForestLengthModel)
        if not lengths.forest.refresh_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            lengths.forest.refresh()
            return
        if self._forest_refresh is None or self._forest_refresh.done():
            self._forest_refresh = loop.create_task(lengths.forest.refresh_async())

    def predicted_completions(self) -> dict[str, float]:
        """Completion time of every request of the last plan at the chance level Δ (with
        Δ = 0.5, the RCT estimator's mean): planned_at + c_q of its queue position."""
        if self._last_detail is None:
            return {}
        queues, details, reqs, planned_at = self._last_detail
        out: dict[str, float] = {}
        for q, (c_q, _) in zip(queues, details, strict=False):
            for k, i in enumerate(q):
                out[reqs[int(i)].request_id] = planned_at + float(c_q[k])
        return out

    def wants_replan(self, now: float) -> bool:
        if self._planned_at is None:
            return self._arrivals_since_plan > 0
        if self._violation:
            return True
        if now - self._planned_at > self.config.max_plan_age_s and self._arrivals_since_plan:
            return True
        return self._index.joined >= 32 and self._index.drift() > self.config.drift_threshold

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
        self._arrivals_since_plan += 1
        self._forget_drained_groups(load)
        ids = {i.instance_id for i in eligible}
        lightest = min(load.get(i, 0.0) for i in ids)
        work = self.work_tokens(request)
        z = self._features(request)
        allowed = {g for g, iid in self._group_inst.items() if iid in ids}
        gid = self._index.nearest(request.model, z, allowed) if allowed else None
        target = self._group_inst.get(gid) if gid is not None else None
        if target is None or load.get(target, 0.0) > (self.config.balance_factor * lightest + work):
            inst = self.choose_instance(request, eligible, load)
            assert inst is not None
            target = inst.instance_id
            mine = {g for g in allowed if self._group_inst[g] == target}
            gid = self._index.nearest(request.model, z, mine) if mine else None
            if gid is None:
                gid = self._new_group(request.model, z, target)
        assert gid is not None
        self._group_size[gid] = self._group_size.get(gid, 0) + 1
        last = self._group_last_pos.get(gid)
        pos = last + 0.5 if last is not None else float(self._plan_len.get(target, 0))
        self._keys[request.request_id] = (pos, request.seq)
        self._check_violation(request, target, last, now)
        return target

    # ------------------------------------------------------------------ place() helpers
    def _forget_drained_groups(self, load: Mapping[str, float]) -> None:
        """Groups on an instance whose virtual queue is empty have no queued member left:
        forget them, so that between replans (none happen while queues stay short) the
        groups created by arrivals do not pile up and slow every later join."""
        drained = [iid for iid in self._inst_groups if load.get(iid, 0.0) <= 0.0]
        for iid in drained:
            gids = self._inst_groups.pop(iid)
            self._index.remove_groups(gids)
            for g in gids:
                self._group_inst.pop(g, None)
                self._group_last_pos.pop(g, None)
                self._group_size.pop(g, None)

    def _features(self, r: PlanRequest) -> np.ndarray:
        d = r.effective_deadline
        if not math.isfinite(d):
            d = r.arrival_time + 3600.0
        out = float(
            self.estimator.lengths.predict(r.model, r.slo_class, np.array([r.max_tokens]))[0][0]
        )
        raw = request_features(np.array([d]), np.array([r.prompt_tokens]), np.array([out]))[0]
        self._index.set_scaler(r.model, raw, np.array([60.0, 1.0, 1.0]))
        return self._index.standardise(r.model, raw)

    def _new_group(self, model: str, z: np.ndarray, instance_id: str) -> int:
        gid = self._next_gid
        self._next_gid += 1
        self._index.add_group(model, gid, z)
        self._group_inst[gid] = instance_id
        self._inst_groups.setdefault(instance_id, set()).add(gid)
        return gid

    def _check_violation(self, r: PlanRequest, target: str, last: float | None, now: float) -> None:
        """§4: an arrival triggers a replan only if it creates a predicted SLO violation: its
        own (its group's tail completion plus its work) or of a group behind it that met its
        SLO in the plan (its slack minus the work added to this queue since)."""
        theta = self._theta.get((target, r.model))
        if theta is None:
            self._violation = self._violation or math.isfinite(r.effective_deadline)
            return
        added = r.max_tokens / theta
        self._added[target] = self._added.get(target, 0.0) + added
        done = self._completion.get(target)
        if (
            last is not None
            and done is not None
            and math.isfinite(r.effective_deadline)
            and r.effective_deadline > now
            and self._planned_at is not None
            and self._planned_at + float(done[int(last)]) + self._added[target]
            > r.effective_deadline
        ):
            self._violation = True  # the arrival itself is predicted to miss where it joined
        slack = self._suffix_slack.get(target)
        if slack is not None and len(slack):
            k = 0 if last is None else min(int(last) + 1, len(slack) - 1)
            if slack[k] < self._added[target]:
                self._violation = True
        if last is None and math.isfinite(r.effective_deadline):
            # a new group at the tail: due before the queue drains?
            tail = self._suffix_slack.get(target + "#end")
            if tail is not None and now + float(tail[0]) + added > r.effective_deadline:
                self._violation = True

    # ------------------------------------------------------------------ plan
    def plan(
        self,
        requests: Sequence[PlanRequest],
        instances: Sequence[PlanInstance],
        now: float,
    ) -> Plan:
        t0 = time.perf_counter()
        budget_end = self._clock() + self.config.time_budget_s
        reqs = sorted(requests, key=lambda r: (r.seq, r.request_id))
        insts = sorted(instances, key=lambda i: i.instance_id)
        live = [i for i in insts if not i.draining]
        queues_out: dict[str, list[str]] = {i.instance_id: [] for i in insts}
        models = sorted({r.model for r in reqs})
        serve = np.array([[i.serves(m) for i in live] for m in models], dtype=bool).reshape(
            len(models), len(live)
        )
        mpos = {m: k for k, m in enumerate(models)}
        priced = self._price(reqs, mpos, now)
        servable = serve[priced.model_idx].any(axis=1) if len(reqs) else np.zeros(0, bool)
        unassigned = [r.request_id for r, ok in zip(reqs, servable, strict=True) if not ok]
        meta: dict[str, Any] = {"groups": 0, "requests": len(reqs)}
        if not servable.any():
            self._adopt([], [], priced, live, {}, now)
            meta.update(feasible=not any(math.isfinite(d) for d in priced.deadline))
            return Plan(queues=queues_out, unassigned=unassigned, policy=self.name, meta=meta)

        hw = self._profiles(priced, live, models, serve)
        self._half_out = {
            m: float(priced.out_mean[priced.model_idx == m].mean()) / 2
            for m in range(len(models))
            if (priced.model_idx == m).any()
        }
        grouping = build_groups(
            reqs,
            priced.out_mean,
            avg_batch={m: self._avg_batch(hw, k) for k, m in enumerate(models)},
            instances_per_model={m: int(serve[k].sum()) for k, m in enumerate(models)},
            config=self.config.grouping,
            deadlines=np.where(np.isfinite(priced.deadline), priced.deadline + now, now + 3600.0),
            skip=~servable,
        )
        problem = self._group_problem(grouping, priced, hw, live, models, serve, now)
        meta["groups"] = problem.n_groups

        # -- candidates: request-level EDF (first: the budget below counts its cost), the group
        # incumbent, and its improvement within what is left of the time budget
        edf = self._edf_queues(priced, live, servable)
        incumbent = greedy_assign(problem)
        group_plans = {"greedy": incumbent}
        improved, milp_stats = self.improve_groups(problem, incumbent, budget_end)
        meta["milp"] = milp_stats
        group_plans["improved"] = improved
        candidates: list[tuple[str, list[np.ndarray]]] = [
            (name, self._expand(gq, grouping)) for name, gq in group_plans.items()
        ]
        candidates.append(("edf", edf))

        scored = []
        for name, qs in candidates:
            met, worth, _ = self._evaluate(qs, priced, hw, live, models)
            scored.append((name, qs, met, worth))
        n_deadline = int(np.isfinite(priced.deadline[servable]).sum() + (~servable).sum() * 0)
        best_met = max(s[2] for s in scored)
        feasible = best_met >= int(servable.sum())
        # ties (and infeasible cases that no candidate improves) go to EDF (A.3's fallback);
        # otherwise the improved group plan is preferred over the greedy one on ties
        order = (
            {"edf": 0, "improved": 1, "greedy": 2}
            if not feasible
            else {"improved": 0, "greedy": 1, "edf": 2}
        )
        by_gain = self.config.objective == "service-gain"
        name, chosen, met, worth = max(
            scored, key=lambda s: (s[3] if by_gain else s[2], -order[s[0]])
        )
        meta.update(
            chosen=name,
            objective=self.config.objective,
            predicted_met=met,
            predicted_value=round(worth, 3),
            predicted_attainment=(met + int((~servable).sum() and 0)) / max(len(reqs), 1),
            candidates={s[0]: s[2] for s in scored},
            feasible=bool(feasible),
            with_deadline=n_deadline,
        )
        if not feasible:
            meta["fallback"] = "edf" if name == "edf" else None
            meta["scale_up"] = self._scale_up(
                problem, live, self._clock() + self.config.scale_up_budget_s
            )
        else:
            meta["scale_up"] = {"needed": False}
        _, _, detail = self._evaluate(chosen, priced, hw, live, models, detail=True)
        lso = self._lso(chosen, priced, hw, live, models)
        for g, ids in enumerate(chosen):
            queues_out[live[g].instance_id] = [reqs[i].request_id for i in ids]
        self._adopt(chosen, detail, priced, live, hw, now, models, grouping)
        meta["replan_s"] = round(time.perf_counter() - t0, 4)
        return Plan(queues=queues_out, unassigned=unassigned, policy=self.name, meta=meta, lso=lso)

    # ------------------------------------------------------------------ pricing
    def _price(self, reqs: list[PlanRequest], mpos: dict[str, int], now: float) -> _Priced:
        n = len(reqs)
        model_idx = np.fromiter((mpos[r.model] for r in reqs), np.int64, n)
        prompt = np.fromiter((r.prompt_tokens for r in reqs), np.float64, n)
        max_tok = np.fromiter((r.max_tokens for r in reqs), np.float64, n)
        out_mean, out_var = np.zeros(n), np.zeros(n)
        keys: dict[tuple[str, str | None], list[int]] = {}
        for k, r in enumerate(reqs):
            keys.setdefault((r.model, r.slo_class), []).append(k)
        for (model, cls), idx in keys.items():
            ix = np.asarray(idx)
            # per request when the forest is in use: it prices each prompt
            out_mean[ix], out_var[ix] = self.estimator.lengths.predict(
                model, cls, max_tok[ix], prompt_tokens=prompt[ix]
            )
        inf = math.inf
        e2e = np.fromiter((r.deadline if r.deadline is not None else inf for r in reqs), float, n)
        ttft = np.fromiter(
            (r.ttft_deadline if r.ttft_deadline is not None else inf for r in reqs), float, n
        )
        seq = np.fromiter((r.seq for r in reqs), np.int64, n)
        value = np.ones(n)
        if self.config.objective == "service-gain" and n:
            gain = W_IN * prompt + W_OUT * out_mean
            value = gain / max(float(gain.mean()), 1e-9)
        return _Priced(
            reqs,
            model_idx,
            prompt,
            out_mean,
            out_var,
            np.minimum(e2e, ttft) - now,
            e2e - now,
            ttft - now,
            seq,
            value,
        )

    def _profiles(
        self, priced: _Priced, live: list[PlanInstance], models: list[str], serve: np.ndarray
    ) -> dict[tuple[int, int], HardwareProfile]:
        out: dict[tuple[int, int], HardwareProfile] = {}
        for m, model in enumerate(models):
            sel = priced.model_idx == m
            if not sel.any():
                continue
            prompt, output = float(priced.prompt[sel].mean()), float(priced.out_mean[sel].mean())
            ctx = prompt + output / 2
            ratio = prompt / max(output, 1.0)
            for g, inst in enumerate(live):
                if serve[m, g]:
                    out[(g, m)] = self.estimator.profile(
                        inst.gpu_type,
                        model,
                        inst.kv_capacity_tokens,
                        inst.max_batch_size,
                        ctx,
                        ratio,
                    )
        return out

    @staticmethod
    def _avg_batch(hw: Mapping[tuple[int, int], HardwareProfile], m: int) -> float:
        bs = [p.batch for (g, mm), p in hw.items() if mm == m]
        return float(np.mean(bs)) if bs else 1.0

    def _switch(self, inst: PlanInstance, hwp: HardwareProfile, model: str) -> float:
        warm = inst.warm_models is None or model in inst.warm_models
        return hwp.switch_in_s(warm)

    def _base(self, inst: PlanInstance, g: int, hw: Mapping, models: list[str]) -> float:
        """Time before the queue's head can start: the running batch's remaining work, each
        running request with half its predicted output still to come."""
        if inst.running <= 0 or inst.active_model not in models:
            return 0.0
        m = models.index(inst.active_model)
        p = hw.get((g, m))
        if p is None:
            return 0.0
        return inst.running * self._half_out.get(m, 128.0) / p.throughput_tps

    def _group_problem(
        self, grouping, priced: _Priced, hw, live, models, serve, now: float
    ) -> GroupProblem:
        G, n_inst, M = len(grouping.groups), len(live), len(models)
        z = self.z
        weight = np.zeros(G)
        size = np.zeros(G)
        deadline = np.full(G, np.inf)
        model = np.zeros(G, np.int64)
        dur = np.full((G, n_inst), np.inf)
        own = np.full((G, n_inst), np.inf)
        elig = np.zeros((G, n_inst), bool)
        prio = np.zeros(G, bool)
        n_arr = np.zeros(G)
        sums = np.zeros((G, 3))
        arrival = np.zeros(G)
        for gi, grp in enumerate(grouping.groups):
            mem = grp.members
            size[gi] = len(mem)
            weight[gi] = float(priced.value[mem].sum())
            deadline[gi] = float(priced.deadline[mem].min())
            model[gi] = int(priced.model_idx[mem[0]])
            arrival[gi] = priced.reqs[int(mem[0])].arrival_time
            sums[gi] = (
                priced.prompt[mem].sum(),
                priced.out_mean[mem].sum(),
                priced.out_var[mem].sum(),
            )
        n_arr = size
        # starvation guard: overdue by more than starvation_factor × its own SLO
        slo_len = np.maximum(deadline + now - arrival, 1e-3)
        prio = np.isfinite(deadline) & (-deadline > self.config.starvation_factor * slo_len)
        for (g, m), p in hw.items():
            sel = np.flatnonzero(model == m)
            if not len(sel):
                continue
            occ_m, occ_v, own_m, own_v = RCTEstimator.group_moments_array(
                p, n_arr[sel], sums[sel, 0], sums[sel, 1], sums[sel, 2]
            )
            dur[sel, g] = occ_m + z * np.sqrt(occ_v)
            own[sel, g] = own_m + z * np.sqrt(own_v)
            elig[sel, g] = True
        base = np.array([self._base(inst, g, hw, models) for g, inst in enumerate(live)])
        init = np.array(
            [models.index(i.active_model) if i.active_model in models else -1 for i in live]
        )
        switch = np.zeros((n_inst, M))
        for (g, m), p in hw.items():
            switch[g, m] = self._switch(live[g], p, models[m])
        return GroupProblem(weight, deadline, model, dur, own, elig, base, init, switch, prio, size)

    # ------------------------------------------------------------------ improvement
    def improve_groups(
        self, problem: GroupProblem, incumbent: list[list[int]], budget_end: float
    ) -> tuple[list[list[int]], dict[str, Any]]:
        """Local search over group moves, then the rolling-horizon MILP on each queue's head;
        each step keeps its input unless it scores strictly better (never worse than the
        incumbent). Public so the exact-MILP comparison (tests, benches) runs the same code."""
        if problem.n_groups <= self.config.ils_max_groups:
            improved = iterated_local_search(
                problem, incumbent, deadline_s=budget_end, clock=self._clock
            )
        else:
            improved = local_search(
                problem,
                incumbent,
                deadline_s=budget_end,
                max_groups=self.config.local_search_max_groups,
                clock=self._clock,
            )
        return self._rolling_horizon(problem, improved, budget_end)

    def _rolling_horizon(
        self, p: GroupProblem, queues: list[list[int]], budget_end: float
    ) -> tuple[list[list[int]], dict[str, Any]]:
        """Re-order each queue's head (``head_groups``) exactly with the slot MILP, queues with
        the most predicted misses in the head first, until the time budget runs out. A MILP
        answer replaces the head only if the whole queue scores better."""
        stats: dict[str, Any] = {"solved": 0, "improved": 0, "skipped_budget": 0, "rejected": 0}
        H = self.config.head_groups
        todo = []
        for g, q in enumerate(queues):
            if len(q) < 2:
                continue
            head = q[:H]
            c = queue_times(p, g, q)[: len(head)]
            misses = float(p.weight[head][c > p.deadline[head]].sum())
            switches = len({int(p.model[i]) for i in head}) > 1
            if misses > 0 or switches:
                todo.append((-misses, g))
        todo.sort()
        queues = [list(q) for q in queues]
        for _, g in todo[: self.config.max_milp_queues]:
            left = budget_end - self._clock()
            if left < 0.03:
                stats["skipped_budget"] += 1
                continue
            q = queues[g]
            head = q[:H]
            if len(head) <= self.config.enumerate_up_to:
                # a handful of groups: enumerating every order is exact and cheaper than a MILP
                best = max(
                    (list(o) + q[H:] for o in itertools.permutations(head)),
                    key=lambda c: (_score(p, g, c), c == q),
                )
                stats["enumerated"] = stats.get("enumerated", 0) + 1
                if _score(p, g, best) > _score(p, g, q) + 1e-9:
                    queues[g] = best
                    stats["improved"] += 1
                continue
            res = solve_slots(
                p,
                head,
                [g],
                len(head),
                time_limit=min(self.config.milp_time_limit_s, left),
                solver=self.config.solver,
            )
            stats["solved"] += 1
            if res.queues is None:
                stats["rejected"] += 1
                continue
            cand = res.queues[0] + q[H:]
            if _score(p, g, cand) > _score(p, g, q) + 1e-9:
                queues[g] = cand
                stats["improved"] += 1
        return queues, stats

    # ------------------------------------------------------------------ request level
    def _expand(self, group_queues: list[list[int]], grouping) -> list[np.ndarray]:
        out = []
        for q in group_queues:
            parts = [grouping.groups[i].members for i in q]
            out.append(np.concatenate(parts) if parts else np.zeros(0, np.int64))
        return out

    def _edf_queues(
        self, priced: _Priced, live: list[PlanInstance], servable: np.ndarray
    ) -> list[np.ndarray]:
        """The EDF baseline's plan (:class:`qlm.planner.baselines.EDFPolicy`, exactly), as index
        arrays: the plan this policy must never be predicted worse than."""
        plan = EDFPolicy().plan([priced.reqs[i] for i in np.flatnonzero(servable)], live, 0.0)
        index = {r.request_id: k for k, r in enumerate(priced.reqs)}
        return [
            np.fromiter((index[rid] for rid in plan.queues[i.instance_id]), np.int64) for i in live
        ]

    def _evaluate(
        self,
        queues: list[np.ndarray],
        priced: _Priced,
        hw: Mapping[tuple[int, int], HardwareProfile],
        live: list[PlanInstance],
        models: list[str],
        *,
        detail: bool = False,
    ) -> tuple[int, float, list[tuple[np.ndarray, np.ndarray]]]:
        """Requests predicted to meet their SLO with probability Δ (request level, eqs. 1-4
        with W from the cumulative occupancy ahead), and what they are worth (``value``): the
        judge between candidate plans."""
        z = self.z
        met = 0
        worth = 0.0
        details: list[tuple[np.ndarray, np.ndarray]] = []
        for g, q in enumerate(queues):
            if len(q) == 0:
                details.append((np.zeros(0), np.zeros(0)))
                continue
            mi = priced.model_idx[q]
            ms = np.unique(mi)
            theta = np.empty(len(q))
            pi = np.empty(len(q))
            tt = np.empty(len(q))
            pf = np.empty(len(q))
            ps = np.empty(len(q))
            sw = np.empty(len(q))
            for m in ms:
                sel = mi == m
                # Θ at the batch this queue's mix of this model actually forms (its mean context,
                # at most as many sequences as it holds plus those already running), not the
                # cluster-wide typical batch
                prompt = float(priced.prompt[q][sel].mean())
                output = float(priced.out_mean[q][sel].mean())
                inst = live[g]
                p = self.estimator.profile(
                    inst.gpu_type,
                    models[int(m)],
                    inst.kv_capacity_tokens,
                    max(1, min(inst.max_batch_size, inst.running + int(sel.sum()))),
                    prompt + output / 2,
                    prompt / max(output, 1.0),
                )
                theta[sel], pi[sel], tt[sel] = p.throughput_tps, p.prefill_tps, p.token_time_s
                pf[sel], ps[sel] = p.prefill_fixed_s, p.prefill_s_per_token
                sw[sel] = self._switch(live[g], p, models[int(m)])
            prompt, om, ov = priced.prompt[q], priced.out_mean[q], priced.out_var[q]
            occ = prompt / pi + om / theta
            occ_v = ov / theta**2
            active = live[g].active_model
            init = models.index(active) if active is not None and active in models else -1
            prev = np.concatenate(([init if init != -1 else mi[0]], mi[:-1]))
            switch = np.where(prev != mi, sw, 0.0)
            base = self._base(live[g], g, hw, models)
            start = base + np.cumsum(switch) + np.concatenate(([0.0], np.cumsum(occ)[:-1]))
            start_v = np.concatenate(([0.0], np.cumsum(occ_v)[:-1]))
            prefill = pf + ps * prompt
            c_q = start + prefill + om * tt + z * np.sqrt(start_v + ov * tt**2)
            first = start + prefill + z * np.sqrt(start_v)
            ok = (c_q <= priced.e2e[q]) & (first <= priced.ttft[q])
            met += int(ok.sum())
            worth += float(priced.value[q][ok].sum())
            if detail:
                details.append((c_q, np.where(ok, priced.deadline[q] - c_q, np.inf)))
        return met, worth, details

    # ------------------------------------------------------------------ LSO, scale-up
    def _lso(self, queues, priced: _Priced, hw, live, models) -> dict[str, InstanceLSO]:
        out: dict[str, InstanceLSO] = {}
        for g, inst in enumerate(live):
            q = queues[g]
            # models in the order the queue first needs them
            mi = priced.model_idx[q]
            _, first = np.unique(mi, return_index=True)
            order = [models[int(mi[k])] for k in sorted(first)]
            head = order[0] if order else inst.active_model
            warm, cold = [], []
            budget = inst.cpu_memory_bytes
            for m in [m for m in order[1:] if m != head] + [
                m for m in inst.models if m not in order and m != head
            ]:
                p = next(
                    (hw[(g, k)] for k in range(len(models)) if (g, k) in hw and models[k] == m),
                    None,
                )
                size = p.weight_bytes if p else 0.0
                if budget is None or size <= budget:
                    warm.append(m)
                    budget = None if budget is None else budget - size
                else:
                    cold.append(m)
            decision = InstanceLSO(
                active_model=head,
                model_switch=head is not None and inst.active_model not in (None, head),
                warm_models=tuple(warm),
                cold_models=tuple(cold),
            )
            if len(q) and head in models:
                p = hw[(g, models.index(head))]
                ctx = int(priced.prompt[q[:64]].mean() + priced.out_mean[q[:64]].mean() / 2)
                # preempt the running batch when the head needs another model and is predicted
                # to miss while the batch drains first. A head of the resident model waits only
                # for a free slot (continuous batching frees one at every completion), never
                # for the drain the estimate charges: evicting for it only wastes work.
                head_deadline = float(priced.deadline[q[: p.batch]].min())
                wait = self._base(inst, g, hw, models) if decision.model_switch else 0.0
                decision = dataclasses.replace(
                    decision,
                    preemption_mode=p.preemption_mode(ctx, inst.cpu_memory_bytes),
                    head_requests=tuple(priced.reqs[i].request_id for i in q[: p.batch]),
                    preempt_running=bool(
                        inst.running > 0
                        and wait > 0
                        and p.prefill_s(ctx) + wait > head_deadline > 0
                    ),
                )
            out[inst.instance_id] = decision
        return out

    def _scale_up(self, p: GroupProblem, live: list[PlanInstance], until: float) -> dict[str, Any]:
        """A.3: the fewest extra instances of one GPU type (cloned from a live instance of that
        type serving the most missed models) that make every attainable group meet its SLO in
        the greedy plan. Groups that miss even alone on an idle instance are unattainable."""
        alone = np.where(p.eligible, p.own, np.inf).min(axis=1) if p.n_instances else np.inf
        attainable = np.asarray(alone <= p.deadline)
        ev = evaluate_queues(p, greedy_assign(p))
        missed = attainable & ~(ev.completion <= p.deadline)
        result: dict[str, Any] = {
            "needed": bool(missed.any()),
            "missed_attainable_requests": int(p.requests[missed].sum()),
            "unattainable_requests": int(p.requests[~attainable].sum()),
        }
        if not missed.any():
            return result
        missed_models = set(p.model[missed].tolist())
        best: dict[str, Any] | None = None
        for gpu in sorted({i.gpu_type for i in live}):
            cands = [g for g, i in enumerate(live) if i.gpu_type == gpu]
            tmpl = max(cands, key=lambda g: (int(p.eligible[missed][:, g].sum()), -g))

            def ok(k: int, tmpl: int = tmpl) -> bool:
                pk = p.with_clones(tmpl, k)
                c = evaluate_queues(pk, greedy_assign(pk)).completion
                return bool(((c <= p.deadline) | ~attainable).all())

            k, found = 1, None
            while k <= self.config.scale_up_max and self._clock() < until:
                if ok(k):
                    found = k
                    break
                k *= 2
            if found is None:
                continue
            lo = found // 2 + 1
            while lo < found and self._clock() < until:
                mid = (lo + found) // 2
                if ok(mid):
                    found = mid
                else:
                    lo = mid + 1
            if best is None or found < best["count"]:
                best = {
                    "gpu_type": gpu,
                    "models": list(live[tmpl].models),
                    "count": found,
                    "serves_missed_models": len(missed_models),
                }
        result["recommendation"] = best
        return result

    # ------------------------------------------------------------------ adopt a plan
    def _adopt(
        self, queues, details, priced: _Priced, live, hw, now: float, models=(), grouping=None
    ) -> None:
        self._keys = {}
        self._group_inst, self._group_last_pos, self._group_size = {}, {}, {}
        self._inst_groups = {}
        self._plan_len, self._suffix_slack, self._added, self._theta = {}, {}, {}, {}
        self._completion = {}
        self._planned_at = now
        self._last_detail = (queues, details, priced.reqs, now) if details else None
        self._violation = False
        self._arrivals_since_plan = 0
        reqs = priced.reqs
        pos_of = np.full(len(reqs), -1.0)
        inst_of = np.full(len(reqs), -1)
        for g, q in enumerate(queues):
            iid = live[g].instance_id
            for k, i in enumerate(q):
                self._keys[reqs[i].request_id] = (float(k), reqs[i].seq)
            pos_of[q] = np.arange(len(q), dtype=float)
            inst_of[q] = g
            self._plan_len[iid] = len(q)
            if details and len(q):
                c_q, slack = details[g]
                self._suffix_slack[iid] = np.minimum.accumulate(slack[::-1])[::-1]
                self._completion[iid] = c_q
                self._suffix_slack[iid + "#end"] = np.array([float(c_q.max())])
        for (g, m), p in hw.items():
            self._theta[(live[g].instance_id, models[m])] = p.throughput_tps
        if grouping is None:
            self._index = GroupIndex()
            self._next_gid = 0
            return
        self._index = GroupIndex.from_grouping(grouping)
        self._next_gid = len(grouping.groups)
        for grp in grouping.groups:
            homes = inst_of[grp.members]
            homes = homes[homes >= 0]
            if not len(homes):
                continue
            g = Counter(homes.tolist()).most_common(1)[0][0]
            self._group_inst[grp.gid] = live[g].instance_id
            self._inst_groups.setdefault(live[g].instance_id, set()).add(grp.gid)
            self._group_last_pos[grp.gid] = float(pos_of[grp.members][homes == g].max())
            self._group_size[grp.gid] = len(grp.members)


def _score(p: GroupProblem, g: int, order: list[int]) -> float:
    return evaluate_queues(p, [order if k == g else [] for k in range(p.n_instances)]).score
