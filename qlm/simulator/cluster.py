"""The cluster simulator: qlm's coordinator rules and a policy object driving simulated engines.

Time is simulated and jumps from event to event: request arrivals, the end of an engine
iteration / decode run / model load (:mod:`qlm.simulator.instance`), replan checks and, when the
planner's own wall time is charged as decision delay, the moment a plan takes effect.

The coordinator side follows :class:`qlm.coordinator.core.CoordinatorCore` (and the live
service's replan rules), with the same :class:`~qlm.virtual_queue.VirtualQueue` and the same
:class:`~qlm.policy.QueuePolicy` object the live coordinator uses:

* an arrival is placed by ``policy.place`` and inserted at ``policy.sort_key``;
* an instance pulls from the head of its virtual queue when the agent's admission control
  allows (engine waiting queue empty, KV usage under 90 %, at most 8 at a time);
* a full replan runs when ``policy.wants_replan`` asks, at most once per ``replan_interval_s``
  and only while the queues hold at least two requests per instance (the live rule);
* for policies granted the LSOs, the plan's ``meta["lso"]`` is carried out: models kept warm in
  host memory, running requests evicted (by swap or recompute) when the head group would miss.

Deterministic for a given workload and policy, except that a planner cut off by its wall-clock
time budget may return a different plan on a slower machine (as it would live).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import structlog

from qlm.admission import SLOAdmissionGate, required_speed
from qlm.chains import CallDeadlines, LateTaskRule, chain_deadlines
from qlm.collective import CollectiveTracker, stage_call_deadlines
from qlm.coordinator.outcome import slo_outcome, task_met
from qlm.engine_model import EngineProfile, get_profile
from qlm.policy import CompletionObservation, Plan, PlanRequest, QueuePolicy
from qlm.service_gain import service_gain
from qlm.simulator.instance import SimInstance, SimJob
from qlm.simulator.workload import SimRequest
from qlm.virtual_queue import VirtualQueue

log = structlog.get_logger(__name__)

MIN_QUEUED_PER_INSTANCE = 2  # the live coordinator's rule for automatic replans
PULL_WINDOW = 16  # SLO-aware pull: how far past the head of the virtual queue the gate looks


@dataclass(frozen=True)
class InstanceSpec:
    instance_id: str
    gpu_type: str
    models: tuple[str, ...]
    tp: int | None = None
    cpu_memory_bytes: float = 256e9
    # measured profiles replacing the roofline one of their model (same GPU type)
    profiles: tuple[EngineProfile, ...] = ()
    max_num_seqs: int | None = None  # the engine's batch cap (vLLM --max-num-seqs) if not default


@dataclass(frozen=True)
class LSOSwitches:
    """Which of QLM's LSOs the simulated agents carry out (request pulling is always on)."""

    eviction: bool = False
    swap: bool = False
    warm_start: bool = False
    slo_pull: bool = False  # SLO-aware pull gate (qlm.admission), else pull while KV allows

    @classmethod
    def all(cls) -> LSOSwitches:
        return cls(True, True, True, True)


@dataclass(frozen=True)
class SimConfig:
    replan_interval_s: float = 5.0
    decision_delay: bool = False  # charge the planner's measured wall time
    drain_s: float = 600.0  # keep simulating this long after the last arrival
    lso: LSOSwitches = field(default_factory=LSOSwitches)
    static_batch: int | None = None  # SHEPHERD: fixed batches, no continuous batching
    record_estimates: bool = False  # keep the policy's predicted completion times
    max_decode_run: int | None = None  # cap on iterations per decode jump (tests: 1)
    # the SLO-aware pull: "qlm" (qlm's LSO) uses the engine model for the instance's current
    # mix as f(L) and pulls requests that cannot make their deadline in plan order while they
    # slow no running request; "saber" (SABER's Algorithm 1) uses a USL fit of f(L) from
    # ``speed_models``, demotes such requests to a per-instance low-priority queue and serves
    # it only when the instance's virtual queue (the high-priority queue) is empty
    pull_gate: str = "qlm"
    # "saber": instance id -> model -> f(L) (runner.saber_speed_fits profiles and fits them)
    speed_models: Mapping[str, Mapping[str, Callable[[int], float]]] = field(default_factory=dict)
    saber_window: int = 16  # SABER's windowSize: the head of the queue it samples from
    seed: int = 0  # SABER's random pick inside the window
    # a chain step whose task is already late: "promote" (CATO) or "demote" (SABER), as the
    # live coordinator's QLM_LATE_TASK_RULE (qlm/chains.py)
    late_task_rule: LateTaskRule = "promote"


@dataclass
class RequestOutcome:
    request_id: str
    model: str
    slo_class: str
    arrival_s: float
    first_token_s: float | None
    finished_s: float | None
    met: bool
    evictions: int
    preemptions: int
    estimated_finish_s: float | None = None
    service_gain: float = 0.0  # Tempo's effective service gain (qlm.service_gain)
    program_id: str | None = None  # the task chain or collective program it is a call of


@dataclass
class SimResult:
    outcomes: list[RequestOutcome]
    makespan_s: float
    sim_end_s: float
    instances: dict[str, dict[str, float]]
    replans: int
    planner_wall_s: float
    wall_s: float
    events: int
    # SABER runs: instance id -> model -> the USL fit the gate used (runner.simulate fills it)
    speed_fits: dict[str, dict[str, Any]] = field(default_factory=dict)
    demoted: int = 0  # SABER runs: requests moved to a low-priority queue
    # runs with a capacity controller: instance-hours and the like (ClusterSimulator docs)
    capacity: dict[str, Any] = field(default_factory=dict)
    # one per program (task chain or collective program): (its calls' SLO class, whether its
    # last call finished by the program's deadline, counted from its first call's arrival)
    tasks: list[tuple[str, bool]] = field(default_factory=list)

    def metrics(self) -> dict[str, Any]:
        """The summary figures ``qlm bench sim`` reports."""
        n = len(self.outcomes)
        done = [o for o in self.outcomes if o.finished_s is not None]
        met = sum(o.met for o in self.outcomes)
        classes: dict[str, list[bool]] = {}
        for o in self.outcomes:
            classes.setdefault(o.slo_class, []).append(o.met)
        latencies = sorted(o.finished_s - o.arrival_s for o in done if o.finished_s is not None)
        span = self.makespan_s if self.makespan_s > 0 else float("nan")
        inst = self.instances.values()
        total_time = sum(i["time_s"] for i in inst) or float("nan")
        out = {
            "slo_attainment": met / n if n else None,
            "slo_attainment_by_class": {
                c: sum(v) / len(v) for c, v in sorted(classes.items()) if v
            },
            "throughput_rps": len(done) / span if done else 0.0,
            "goodput_rps": met / span if done else 0.0,
            "service_gain": round(sum(o.service_gain for o in self.outcomes), 1),
            "task_attainment": (
                sum(met for _, met in self.tasks) / len(self.tasks) if self.tasks else None
            ),
            "task_attainment_by_class": _by_class(self.tasks),
            "tasks": len(self.tasks) or None,  # programs; None in a scenario without any
            "gpu_utilisation": sum(i["busy_s"] for i in inst) / total_time,
            "kv_utilisation": sum(i["kv_token_s"] for i in inst)
            / (sum(i["kv_capacity"] * i["time_s"] for i in inst) or float("nan")),
            "model_swaps": int(sum(i["model_swaps"] for i in inst)),
            "cold_loads": int(sum(i["cold_loads"] for i in inst)),
            "evictions": int(sum(i["evictions"] for i in inst)),
            "kv_swaps": int(sum(i["swaps"] for i in inst)),
            "preemptions": int(sum(i["preemptions"] for i in inst)),
            "p50_latency_s": _quantile(latencies, 0.5),
            "p99_latency_s": _quantile(latencies, 0.99),
            "requests": n,
            "completed": len(done),
            "replans": self.replans,
            "planner_wall_s": round(self.planner_wall_s, 3),
            "sim_wall_s": round(self.wall_s, 2),
        }
        if self.capacity:
            ttfts = sorted(
                o.first_token_s - o.arrival_s for o in self.outcomes if o.first_token_s is not None
            )
            out["p95_latency_s"] = _quantile(latencies, 0.95)
            out["p95_ttft_s"] = _quantile(ttfts, 0.95)
            out.update(self.capacity)
        return out


def _by_class(pairs: Sequence[tuple[str, bool]]) -> dict[str, float]:
    classes: dict[str, list[bool]] = {}
    for c, met in pairs:
        classes.setdefault(c, []).append(met)
    return {c: sum(v) / len(v) for c, v in sorted(classes.items())}


def _since(t: float | None, start: float) -> float | None:
    return None if t is None else t - start


def _quantile(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return float(sorted_values[k])


_ARRIVAL, _STEP, _TICK, _ADOPT, _READY, _CONTROL, _ISSUE = 0, 1, 2, 3, 4, 5, 6


class CapacityController(Protocol):
    """Called every ``interval_s`` simulated seconds with the simulator, which it may change
    through :meth:`ClusterSimulator.add_instance` and :meth:`ClusterSimulator.release_instance`
    (an autoscaler in the loop: qlm/simulator/capacity_sim.py)."""

    interval_s: float

    def on_tick(self, sim: ClusterSimulator) -> None: ...


@dataclass
class InstanceLife:
    """When an instance was asked for, became ready and was released (simulated seconds);
    the instance is paid for from ``requested_s`` to ``released_s`` (or the end)."""

    spec: InstanceSpec
    requested_s: float
    ready_s: float | None = None
    released_s: float | None = None  # asked to go (a live one drains first)
    retired_s: float | None = None  # gone: drained, or cancelled while starting
    initial: bool = False  # part of the cluster at t = 0


def instance_profiles(
    spec: InstanceSpec, cache: dict[tuple[str, str, int | None], EngineProfile] | None = None
) -> dict[str, EngineProfile]:
    """The engine profile of every model of an instance: a measured one where given, else the
    roofline one at the instance's TP degree, with the instance's batch cap."""
    cache = {} if cache is None else cache
    measured = {p.model.name: p for p in spec.profiles}
    tp = spec.tp
    if tp is None:  # the models share one GPU group: the largest degree any needs
        tp = max(
            measured[m].tp if m in measured else get_profile(spec.gpu_type, m).tp
            for m in spec.models
        )
    profiles = {}
    for m in spec.models:
        if m in measured:
            profiles[m] = measured[m]
            continue
        key = (spec.gpu_type, m, tp)
        if key not in cache:
            cache[key] = get_profile(spec.gpu_type, m, tp=tp)
        profiles[m] = cache[key]
    if spec.max_num_seqs is not None:
        profiles = {m: replace(p, max_num_seqs=spec.max_num_seqs) for m, p in profiles.items()}
    return profiles


class ClusterSimulator:
    def __init__(
        self,
        instances: Sequence[InstanceSpec],
        policy: QueuePolicy,
        requests: Sequence[SimRequest],
        config: SimConfig | None = None,
        *,
        progress: Callable[[float], None] | None = None,
        controller: CapacityController | None = None,
    ) -> None:
        if not instances:
            raise ValueError("a simulated cluster needs at least one instance")
        self.config = config or SimConfig()
        if self.config.replan_interval_s <= 0:
            raise ValueError("replan_interval_s must be > 0")
        self.policy = policy
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        # Calls of programs (task chains, collective programs) that wait for others: issued
        # when the last of them finishes, so only the others arrive from the workload.
        self._roots = [r for r in self.requests if not r.after]
        self._deps_left: dict[str, int] = {}
        self._dependents: dict[str, list[SimRequest]] = {}
        known = {r.request_id for r in self.requests}
        for r in self.requests:
            if not r.after:
                continue
            missing = sorted(set(r.after) - known)
            if missing:
                raise ValueError(f"{r.request_id} comes after unknown requests {missing}")
            self._deps_left[r.request_id] = len(set(r.after))
            for d in set(r.after):
                self._dependents.setdefault(d, []).append(r)
        self.collective = CollectiveTracker()  # the live coordinator's stage deadlines
        self._program_start: dict[str, float] = {}
        self._judged: dict[str, float | None] = {}
        self._progress = progress
        self._heap: list[tuple[float, int, int, Any, int]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.instances: dict[str, SimInstance] = {}  # live: placed on, planned over
        self._profile_cache: dict[tuple[str, str, int | None], EngineProfile] = {}
        self.lives: dict[str, InstanceLife] = {}
        self.draining: dict[str, SimInstance] = {}  # released, finishing what they run
        self.retired: dict[str, SimInstance] = {}
        self.controller = controller
        self._finished_log: list[SimJob] = []
        for spec in instances:
            inst = self._make_instance(spec)
            if self.config.lso.warm_start:
                inst.set_warm(list(spec.models[1:]), 0.0)
                for m in inst.warm:
                    inst.warm[m] = 0.0  # a warm cluster: host copies made before the run
            self.instances[spec.instance_id] = inst
            self.lives[spec.instance_id] = InstanceLife(spec, 0.0, 0.0, initial=True)
        self.queues = {iid: VirtualQueue(iid) for iid in self.instances}
        self.queued_tokens = dict.fromkeys(self.instances, 0.0)
        self.jobs: dict[str, SimJob] = {}
        self.unassigned: list[SimJob] = []
        self.queued_count = 0
        self.finished = 0
        self.last_finish = 0.0
        self.replans = 0
        self.planner_wall_s = 0.0
        self._last_replan = -math.inf
        self._plan_pending = False
        self._estimates: dict[str, float] = {}
        self.events = 0
        # SABER mode: per-instance low-priority queues, and when each queued request becomes
        # hopeless (a heap of (time, seq, job))
        if self.config.pull_gate not in ("qlm", "saber"):
            raise ValueError(f"pull_gate must be 'qlm' or 'saber', not {self.config.pull_gate!r}")
        self._saber = self.config.lso.slo_pull and self.config.pull_gate == "saber"
        self._lpq: dict[str, deque[SimJob]] = {iid: deque() for iid in self.instances}
        self._hopeless: list[tuple[float, int, SimJob]] = []
        self._rng = random.Random(self.config.seed)
        self.demoted = 0
        if self._saber:
            self._check_speed_models()
            if controller is not None:
                raise ValueError("the SABER pull gate does not run with a capacity controller")

    def _make_instance(self, spec: InstanceSpec) -> SimInstance:
        return SimInstance(
            spec.instance_id,
            spec.gpu_type,
            list(spec.models),
            instance_profiles(spec, self._profile_cache),
            cpu_memory_bytes=spec.cpu_memory_bytes,
            schedule=self._schedule_step,
            on_finish=self._on_finish,
            warm_start=self.config.lso.warm_start,
            static_batch=self.config.static_batch,
            max_decode_run=self.config.max_decode_run,
        )

    def _check_speed_models(self) -> None:
        served = {r.model for r in self.requests}
        for iid, inst in self.instances.items():
            have = self.config.speed_models.get(iid, {})
            missing = [m for m in inst.models if m in served and m not in have]
            if missing:
                raise ValueError(
                    f"the SABER gate needs f(L) for {missing} on {iid} "
                    "(SimConfig.speed_models; runner.saber_speed_fits profiles them)"
                )

    # ------------------------------------------------------------------ event plumbing
    def _push(self, t: float, kind: int, payload: Any = None, version: int = 0) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload, version))

    def _schedule_step(self, t: float, inst: SimInstance, version: int) -> None:
        self._push(t, _STEP, inst, version)

    # ------------------------------------------------------------------ main loop
    def run(self) -> SimResult:
        started = time.perf_counter()
        reqs = self._roots
        n = len(reqs)
        total = len(self.requests)
        last_arrival = reqs[-1].arrival_s if reqs else 0.0
        end = last_arrival + self.config.drain_s
        self._push(self.config.replan_interval_s, _TICK)
        if self.controller is not None:
            if not self.controller.interval_s > 0:
                raise ValueError("the capacity controller's interval_s must be > 0")
            self._push(0.0, _CONTROL)
        i = 0
        next_report = 0.0
        while True:
            t_arrival = reqs[i].arrival_s if i < n else math.inf
            t_event = self._heap[0][0] if self._heap else math.inf
            t = min(t_arrival, t_event)
            if t > end or (i >= n and self.finished >= total):
                break
            self.now = t
            self.events += 1
            if t_arrival <= t_event:
                self._arrive(reqs[i])
                i += 1
            else:
                _, _, kind, payload, version = heapq.heappop(self._heap)
                if kind == _STEP:
                    if payload.version == version:
                        self._step_done(payload)
                elif kind == _TICK:
                    self._maybe_replan()
                    if i < n or self.finished < total:
                        self._push(t + self.config.replan_interval_s, _TICK)
                elif kind == _ADOPT:
                    self._adopt(payload)
                elif kind == _READY:
                    self._ready(payload)
                elif kind == _CONTROL:
                    assert self.controller is not None
                    self.controller.on_tick(self)
                    if i < n or self.finished < total:
                        self._push(t + self.controller.interval_s, _CONTROL)
                elif kind == _ISSUE:
                    self._arrive(replace(payload, arrival_s=t))
            if self._progress is not None and t >= next_report:
                self._progress(min(1.0, t / end) if end > 0 else 1.0)
                next_report = t + end / 200
        if self._progress is not None:
            self._progress(1.0)
        return self._result(time.perf_counter() - started)

    # ------------------------------------------------------------------ coordinator rules
    def _arrive(self, req: SimRequest) -> None:
        due = self._deadlines(req)
        self._judged[req.request_id] = due.judged_deadline
        view = PlanRequest(
            request_id=req.request_id,
            model=req.model,
            prompt_tokens=req.prompt_tokens,
            max_tokens=req.max_tokens,
            arrival_time=req.arrival_s,
            deadline=due.deadline,
            ttft_deadline=due.ttft_deadline,
            priority=due.priority,
            slo_class=req.slo_class,
            seq=len(self.jobs) + 1,
        )
        job = SimJob(req=req, view=view)
        self.jobs[req.request_id] = job
        target = self._place(job)
        self._maybe_replan()
        if target is not None:
            self._feed(self.instances[target])

    def _deadlines(self, req: SimRequest) -> CallDeadlines:
        """The call's deadlines as the live coordinator derives them: its own SLO, a chain
        step's from its task (qlm/chains.py), a stage's shared one (qlm/collective.py)."""
        now = req.arrival_s
        started = None
        if req.program_id is not None:
            started = self._program_start.setdefault(req.program_id, now)
        due = chain_deadlines(
            now,
            e2e_s=req.e2e_slo_s,
            ttft_s=req.ttft_slo_s,
            task_slo_s=req.task_slo_s,
            task_started_at=started,
            remaining_s=req.remaining_s,
            rule=self.config.late_task_rule,
        )
        if req.stage is not None:
            sd = self.collective.admit_stage(req.stage, req.prompt_tokens, req.e2e_slo_s, now, now)
            due = stage_call_deadlines(sd, due, now)
        return due

    def _place(self, job: SimJob) -> str | None:
        live = [inst.plan_view() for inst in self.instances.values()]
        target = self.policy.place(job.view, live, self.queued_tokens, self.now)
        self.queued_count += 1
        if target is None:
            job.queue_id = None
            self.unassigned.append(job)
            return None
        self.queues[target].insert(job.req.request_id, self.policy.sort_key(job.view))
        self.queued_tokens[target] += self.policy.work_tokens(job.view)
        job.queue_id = target
        if self._saber:
            self._watch_demotion(job, target)
        return target

    def _feed(self, inst: SimInstance) -> None:
        """The agent's pull: dispatch the head of the virtual queue while the engine wants it."""
        queue = self.queues.get(inst.instance_id)
        if queue is None:
            return  # draining: it pulls nothing new
        want = inst.wants()
        if self._saber:
            if want > 0:
                self._feed_saber(inst, queue, want)
            return
        if want <= 0 or not len(queue):
            return
        if self.config.lso.slo_pull:
            self._feed_gated(inst, queue, want)
            return
        batch: list[SimJob] = []
        while want > 0 and len(queue):
            job = self.jobs[queue.pop()]
            self.queued_tokens[inst.instance_id] -= self.policy.work_tokens(job.view)
            self.queued_count -= 1
            batch.append(job)
            want -= 1
        inst.enqueue(batch, self.now)

    def _feed_gated(self, inst: SimInstance, queue: VirtualQueue, want: int) -> None:
        """SLO-aware pull: walk the head of the virtual queue in plan order and pull what the
        gate admits, re-evaluating the load after each (SABER's window over the queue head)."""
        now = self.now
        load = len(inst.running) + len(inst.waiting)
        floor = inst.speed_floor()
        batch: list[SimJob] = []
        for rid in queue.head(PULL_WINDOW):
            job = self.jobs[rid]
            need = required_speed(job.view.max_tokens, job.view.deadline, now)
            gate = SLOAdmissionGate(
                lambda n, j=job: inst.decode_speed(n, j)  # type: ignore[misc]
            )
            if not gate.admits(load, need, floor):
                continue  # SABER: later requests in the window may still fit
            job.req_speed = 0.0 if gate.best_effort(need) else need
            floor = max(floor, job.req_speed)
            load += 1
            batch.append(job)
            if len(batch) >= want:
                break
        self._take(inst, queue, batch)

    def _take(self, inst: SimInstance, queue: VirtualQueue, batch: list[SimJob]) -> None:
        for job in batch:
            queue.remove(job.req.request_id)
            self.queued_tokens[inst.instance_id] -= self.policy.work_tokens(job.view)
            self.queued_count -= 1
        if batch:
            inst.enqueue(batch, self.now)

    # ------------------------------------------------------------------ SABER (Algorithm 1)
    def _speed(self, iid: str, model: str) -> Callable[[int], float]:
        return self.config.speed_models[iid][model]

    def _watch_demotion(self, job: SimJob, iid: str) -> None:
        """Note when a queued request stops being able to make its deadline even alone:
        reqSpd(t) = maxTokens / (deadline - t) passes f(1) at deadline - maxTokens / f(1)."""
        deadline = job.view.deadline
        if deadline is None or not math.isfinite(deadline):
            return
        fastest = self._speed(iid, job.req.model)(1)
        hopeless_at = deadline - job.view.max_tokens / fastest
        heapq.heappush(self._hopeless, (hopeless_at, next(self._seq), job))

    def _demote_due(self) -> None:
        """Move every queued request that can no longer make its deadline, even running alone,
        from its virtual queue (SABER's high-priority queue) to the low-priority one."""
        now = self.now
        heap = self._hopeless
        while heap and heap[0][0] <= now:
            _, _, job = heapq.heappop(heap)
            iid = job.queue_id
            if iid is None or job.req.request_id not in self.queues[iid]:
                continue  # dispatched (or unassigned) since
            need = required_speed(job.view.max_tokens, job.view.deadline, now)
            if need <= self._speed(iid, job.req.model)(1):
                self._watch_demotion(job, iid)  # re-placed on an instance with another f
                continue
            self.queues[iid].remove(job.req.request_id)
            self.queued_tokens[iid] -= self.policy.work_tokens(job.view)
            self.queued_count -= 1
            job.queue_id = None
            self._lpq[iid].append(job)
            self.demoted += 1

    def _feed_saber(self, inst: SimInstance, queue: VirtualQueue, want: int) -> None:
        """SABER's Algorithm 1 at this instance: demote what cannot make it; while the
        high-priority queue (the virtual queue) holds requests, admit one sampled at random
        from its first ``saber_window`` whose required speed f(L + 1) meets, as long as
        f(L + 1) also stays at or above every running request's frozen required speed, and
        sample again; only when it is empty, hand low-priority requests to the engine without
        a check. Each admission is one of SABER's control-loop ticks (δ -> 0)."""
        self._demote_due()
        now = self.now
        iid = inst.instance_id
        load = len(inst.running) + len(inst.waiting)  # every request in the engine, LPQ too
        floor = inst.speed_floor()
        batch: list[SimJob] = []
        if len(queue):
            taken: set[str] = set()
            while len(batch) < want:
                window = [r for r in queue.head(self.config.saber_window + len(taken))]
                window = [r for r in window if r not in taken][: self.config.saber_window]
                self._rng.shuffle(window)
                admitted = None
                for rid in window:
                    job = self.jobs[rid]
                    need = required_speed(job.view.max_tokens, job.view.deadline, now)
                    gate = SLOAdmissionGate(self._speed(iid, job.req.model))
                    if gate.admits_in_time(load, need, floor):
                        admitted = job
                        job.req_speed = need  # frozen: later checks use this value
                        floor = max(floor, need)
                        load += 1
                        break
                if admitted is None:
                    break
                taken.add(admitted.req.request_id)
                batch.append(admitted)
            self._take(inst, queue, batch)
            return
        lpq = self._lpq[iid]
        while lpq and len(batch) < want:
            job = lpq.popleft()
            job.req_speed = 0.0  # best effort: no speed of its own to protect
            batch.append(job)
        if batch:
            inst.enqueue(batch, now)

    def _step_done(self, inst: SimInstance) -> None:
        inst.on_event(self.now)
        if inst.evicted_out:
            evicted, inst.evicted_out = inst.evicted_out, []
            for job in evicted:
                # exact resume: the request comes back as prompt + generated, for what is left
                job.view = dataclasses.replace(
                    job.view,
                    prompt_tokens=job.req.prompt_tokens + job.generated,
                    max_tokens=max(1, job.req.max_tokens - job.generated),
                )
                target = self._place(job)
                if target is not None and target != inst.instance_id:
                    self._feed(self.instances[target])
        self._feed(inst)
        inst.resume(self.now)
        if inst.instance_id in self.draining and self._idle(inst):
            self._retire(inst)

    def _on_finish(self, job: SimJob, now: float) -> None:
        self.finished += 1
        if self.controller is not None:
            self._finished_log.append(job)
        self.last_finish = max(self.last_finish, now)
        self.policy.observe_completion(
            CompletionObservation(
                model=job.req.model,
                slo_class=job.req.slo_class,
                output_tokens=job.generated,
                prompt_tokens=job.req.prompt_tokens,
                max_tokens=job.req.max_tokens,
            )
        )
        req = job.req
        if req.stage is not None:
            self.collective.finished_stage(req.stage, job.generated, now)
        for nxt in self._dependents.pop(req.request_id, ()):
            left = self._deps_left[nxt.request_id] - 1
            self._deps_left[nxt.request_id] = left
            if left == 0:  # the program's next call: issued after the tool / think time
                del self._deps_left[nxt.request_id]
                self._push(now + nxt.think_s, _ISSUE, nxt)

    # ------------------------------------------------------------------ capacity changes
    def add_instance(self, spec: InstanceSpec, ready_in_s: float) -> None:
        """Ask for a new instance; it joins (is placed on, planned over) ``ready_in_s`` from now
        - its start-up time - and is paid for from now."""
        iid = spec.instance_id
        if iid in self.lives:
            raise ValueError(f"instance id {iid!r} was already used")
        if not (math.isfinite(ready_in_s) and ready_in_s >= 0):
            raise ValueError("ready_in_s must be a finite number ≥ 0")
        self.lives[iid] = InstanceLife(spec, self.now)
        self._push(self.now + ready_in_s, _READY, iid)

    def release_instance(self, iid: str) -> None:
        """Let an instance go: one still starting is cancelled at once; a live one stops taking
        work (its virtual queue is placed again on the others) and retires once what it runs
        has finished."""
        life = self.lives.get(iid)
        if life is None or life.released_s is not None:
            raise ValueError(f"no instance {iid!r} to release")
        life.released_s = self.now
        inst = self.instances.pop(iid, None)
        if inst is None:  # still starting
            life.retired_s = self.now
            return
        queue = self.queues.pop(iid)
        self.queued_tokens.pop(iid, None)
        self._lpq.pop(iid, None)
        self.draining[iid] = inst
        orphans = [self.jobs[rid] for rid in queue.clear()]
        self.queued_count -= len(orphans)
        for job in orphans:
            job.queue_id = None
        self._rebalance(orphans)
        if self._idle(inst):
            self._retire(inst)

    def starting(self) -> list[str]:
        """Instances asked for that are not ready yet."""
        return [
            i for i, life in self.lives.items() if life.ready_s is None and life.retired_s is None
        ]

    def take_finished(self) -> list[SimJob]:
        """Requests finished since the last call (kept only with a capacity controller)."""
        out, self._finished_log = self._finished_log, []
        return out

    def queued_jobs(self, iid: str) -> list[SimJob]:
        queue = self.queues.get(iid)
        return [] if queue is None else [self.jobs[rid] for rid in queue]

    def _ready(self, iid: str) -> None:
        life = self.lives[iid]
        if life.retired_s is not None:
            return  # cancelled while starting
        life.ready_s = self.now
        inst = self._make_instance(life.spec)
        self.instances[iid] = inst
        self.queues[iid] = VirtualQueue(iid)
        self.queued_tokens[iid] = 0.0
        self._lpq[iid] = deque()
        self._rebalance([])

    @staticmethod
    def _idle(inst: SimInstance) -> bool:
        return not inst.running and not inst.waiting and inst.loading is None

    def _retire(self, inst: SimInstance) -> None:
        iid = inst.instance_id
        self.draining.pop(iid, None)
        self.retired[iid] = inst
        self.lives[iid].retired_s = self.now

    def _rebalance(self, extra: list[SimJob]) -> None:
        """After the set of live instances changed: every queued request is placed again, in
        arrival order, so a new instance takes its share of the backlog at once (the live
        coordinator replans on a membership change for the same reason)."""
        queued = list(extra) + self.unassigned
        for iid, q in self.queues.items():
            queued += [self.jobs[rid] for rid in q.clear()]
            self.queued_tokens[iid] = 0.0
        self.unassigned = []
        self.queued_count = 0
        for job in sorted(queued, key=lambda j: j.view.seq):
            self._place(job)
        for inst in self.instances.values():
            self._feed(inst)
            inst.resume(self.now)

    # ------------------------------------------------------------------ planning
    def _maybe_replan(self) -> None:
        now = self.now
        if self._plan_pending or now - self._last_replan < self.config.replan_interval_s:
            return
        if self.queued_count < MIN_QUEUED_PER_INSTANCE * len(self.instances):
            return
        if not self.policy.wants_replan(now):
            return
        self._replan()

    def _replan(self) -> None:
        now = self.now
        queued = [self.jobs[rid] for q in self.queues.values() for rid in q]
        queued += self.unassigned
        views = [inst.plan_view() for inst in self.instances.values()]
        t0 = time.perf_counter()
        plan = self.policy.plan([j.view for j in queued], views, now)
        wall = time.perf_counter() - t0
        self.replans += 1
        self.planner_wall_s += wall
        self._last_replan = now
        if self.config.record_estimates:
            for rid, t in self.policy.predicted_completions().items():
                self._estimates[rid] = t  # the latest plan before it was dispatched
        if self.config.decision_delay:
            self._plan_pending = True
            self._push(now + wall, _ADOPT, plan)
        else:
            self._adopt(plan)

    def _adopt(self, plan: Plan) -> None:
        """The virtual queues take the plan's order; requests dispatched while it was computed
        are skipped, and those that arrived meanwhile are placed again."""
        self._plan_pending = False
        queued: dict[str, SimJob] = {}
        for q in self.queues.values():
            for rid in q.clear():
                queued[rid] = self.jobs[rid]
        for job in self.unassigned:
            queued[job.req.request_id] = job
        self.unassigned = []
        self.queued_tokens = dict.fromkeys(self.instances, 0.0)
        self.queued_count = 0
        for iid, ids in plan.queues.items():
            if iid not in self.queues:
                continue  # released while the plan was computed: its requests are re-placed
            entries = []
            for rid in ids:
                if rid not in queued:
                    continue  # dispatched while the plan was computed
                job = queued.pop(rid)
                entries.append((rid, self.policy.sort_key(job.view)))
                self.queued_tokens[iid] += self.policy.work_tokens(job.view)
                job.queue_id = iid
            self.queues[iid].replace(entries)
            self.queued_count += len(entries)
        for job in sorted(queued.values(), key=lambda j: j.view.seq):
            self._place(job)  # unassigned by the plan, or arrived while it was computed
        self._carry_out_lso(plan)
        for inst in self.instances.values():
            self._feed(inst)
            inst.resume(self.now)

    def _carry_out_lso(self, plan: Plan) -> None:
        lso = self.config.lso
        decisions = plan.meta.get("lso") if plan.meta else None
        if not decisions:
            return
        for iid, entry in decisions.items():
            inst = self.instances.get(iid)
            if inst is None:
                continue
            if lso.warm_start:
                # the plan's head model (the next to load when it differs from the resident
                # one) stays warm too, then the others in the order the queue needs them
                wanted = [entry.get("active_model"), *entry.get("warm_models", [])]
                inst.set_warm([m for m in wanted if m and m != inst.active_model], self.now)
            if not (lso.eviction and entry.get("preempt_running")):
                continue
            head = set(entry.get("head_requests", []))
            head_jobs = [self.jobs[r] for r in head if r in self.jobs]
            if not head_jobs:
                continue
            urgent = min(j.view.effective_deadline for j in head_jobs)
            victims = [
                j
                for j in inst.running
                if j.req.request_id not in head and j.view.effective_deadline > urgent
            ]
            if victims:
                mode = "swap" if lso.swap and entry.get("preemption_mode") == "swap" else "evict"
                inst.evict(victims, mode, self.now)

    # ------------------------------------------------------------------ results
    def _result(self, wall: float) -> SimResult:
        outcomes = []
        for job in self.jobs.values():
            req = job.req
            # a call of a program is judged against its derived deadline (qlm/chains.py)
            judged = self._judged.get(req.request_id) if req.program_id is not None else None
            e2e_slo_s = req.e2e_slo_s if judged is None else judged - req.arrival_s
            # the live coordinator's judgement (qlm/coordinator/outcome.py); never finished
            # by the end of the run: missed. job.first_token_s is already the earliest across
            # attempts (an evicted attempt's first token counts, as live)
            met = job.finished_s is not None and (
                slo_outcome(
                    req.arrival_s,
                    job.first_token_s,
                    job.finished_s,
                    job.generated,
                    e2e_slo_s=req.e2e_slo_s,
                    ttft_slo_s=req.ttft_slo_s,
                    tbt_slo_s=req.tbt_slo_s,
                    judged_deadline=judged,
                ).met
            )
            outcomes.append(
                RequestOutcome(
                    request_id=req.request_id,
                    model=req.model,
                    slo_class=req.slo_class,
                    arrival_s=req.arrival_s,
                    first_token_s=job.first_token_s,
                    finished_s=job.finished_s,
                    met=met,
                    evictions=job.evictions,
                    preemptions=job.preemptions,
                    estimated_finish_s=self._estimates.get(req.request_id),
                    # a call of a task already late when it arrived has no time to be on:
                    # it gains nothing
                    service_gain=0.0
                    if e2e_slo_s is not None and e2e_slo_s <= 0
                    else service_gain(
                        req.prompt_tokens,
                        req.output_tokens,
                        ttft_s=_since(job.first_token_s, req.arrival_s),
                        e2e_s=_since(job.finished_s, req.arrival_s),
                        e2e_slo_s=e2e_slo_s,
                        ttft_slo_s=req.ttft_slo_s,
                    ),
                    program_id=req.program_id,
                )
            )
        # requests that never arrived before the end still count (as missed)
        for req in self.requests:
            if req.request_id not in self.jobs:
                outcomes.append(
                    RequestOutcome(
                        req.request_id,
                        req.model,
                        req.slo_class,
                        req.arrival_s,
                        None,
                        None,
                        False,
                        0,
                        0,
                        program_id=req.program_id,
                    )
                )
        end = self.now
        stats = {}
        every = {**self.retired, **self.draining, **self.instances}
        for iid, inst in every.items():
            life = self.lives[iid]
            ready = life.ready_s if life.ready_s is not None else end
            stats[iid] = {
                "time_s": (life.retired_s if life.retired_s is not None else end) - ready,
                "busy_s": inst.busy_s,
                "loading_s": inst.loading_s,
                "kv_token_s": inst.kv_token_s,
                "kv_capacity": float(inst.kv_capacity),
                "model_swaps": inst.model_swaps,
                "cold_loads": inst.cold_loads,
                "evictions": inst.evictions,
                "swaps": inst.swaps,
                "preemptions": inst.preemptions,
                "iterations": inst.iterations,
            }
        return SimResult(
            capacity=self._capacity_figures(end) if self.controller is not None else {},
            outcomes=outcomes,
            makespan_s=self.last_finish,
            sim_end_s=end,
            instances=stats,
            replans=self.replans,
            planner_wall_s=self.planner_wall_s,
            wall_s=wall,
            events=self.events,
            demoted=self.demoted,
            tasks=self._task_outcomes(),
        )

    def _task_outcomes(self) -> list[tuple[str, bool]]:
        """Per program: met when every call finished and the last by the program's deadline
        (its SLO counted from its first call's arrival); unstarted or unfinished: missed."""
        last: dict[str, float | None] = {}
        first: dict[str, SimRequest] = {}
        for req in self.requests:
            pid = req.program_id
            if pid is None:
                continue
            first.setdefault(pid, req)
            job = self.jobs.get(req.request_id)
            done = job.finished_s if job is not None else None
            prev = last.get(pid, 0.0)
            last[pid] = None if done is None or prev is None else max(prev, done)
        out = []
        for pid, req in first.items():
            start = self._program_start.get(pid)
            end = last[pid]
            slo = req.program_slo_s
            met = start is not None and end is not None and task_met(start, end, slo)
            out.append((req.slo_class, met))
        return out

    def _capacity_figures(self, end: float) -> dict[str, Any]:
        """Instance-hours paid (asked for → released or the end: start-up and draining
        included), the part of them spent starting (SageServe's scaling waste), and the
        number of instances started and released."""
        paid = starting = 0.0
        for life in self.lives.values():
            stop = life.retired_s if life.retired_s is not None else end
            paid += stop - life.requested_s
            starting += (life.ready_s if life.ready_s is not None else stop) - life.requested_s
        added = sum(1 for life in self.lives.values() if not life.initial)
        return {
            "instance_hours": round(paid / 3600.0, 3),
            "scaling_waste_hours": round(starting / 3600.0, 3),
            "instances_started": added,
            "instances_released": sum(
                1 for life in self.lives.values() if life.released_s is not None
            ),
            "peak_instances": self._peak_instances(end),
        }

    def _peak_instances(self, end: float) -> int:
        edges: list[tuple[float, int]] = []
        for life in self.lives.values():
            edges.append((life.requested_s, 1))
            edges.append((life.retired_s if life.retired_s is not None else end, -1))
        peak = cur = 0
        for _, d in sorted(edges, key=lambda e: (e[0], e[1])):
            cur += d
            peak = max(peak, cur)
        return peak
