"""The cluster simulator: the product's coordinator core and agents' pull rules driving
simulated engines on a simulated clock.

Time jumps from event to event: request arrivals, the end of an engine iteration / decode run /
model load (:mod:`qlm.tooling.simulator.instance`), heartbeats, replan checks and, when the
planner's
own wall time is charged as decision delay, the moment a plan takes effect.

Nothing the live path decides is re-implemented here. The coordinator is
:class:`qlm.coordinator.core.CoordinatorCore` itself, fed through the same methods the live
service calls, with the same policy object:

* an arrival is a :class:`~qlm.types.RequestMessage` given to ``core.admit`` (deadlines of
  chain steps and collective stages, placement, the virtual queues);
* each engine's agent keeps a :class:`~qlm.admission.PullAdmission`, as the live agent does:
  it grants credit (``core.on_pull``) for what the engine wants, ``core.next_dispatches``
  hands it requests, and its SLO gate (the ``slo_pull`` LSO) holds them back until they fit;
* heartbeats (``core.on_heartbeat``) every 0.5 s, and at once when an engine's resident or warm
  models change, carry what the planner reads about an instance and reconcile credit;
* a finished request is a :class:`~qlm.control.Completion` for ``core.complete``, which
  accepts, judges (the one ``slo_outcome``) and feeds the policy's length model; an evicted
  one an :class:`~qlm.control.Evicted` for ``core.on_evicted`` (exact resume);
* a replan runs when ``core.replan_wanted`` says so, at most once per ``replan_interval_s``;
  the plan is adopted by ``core.adopt_plan`` and its LSO orders (``core.lso_orders``) go to
  the engines: model states, evictions by swap or recompute;
* a capacity controller adds instances (they register by heartbeat, then a replan) and
  releases them (``core.drain``, then the instance retires once idle).

What is the simulator's own: the engines (:mod:`qlm.tooling.simulator.instance`, on the one engine
scheduler and performance model), the workload, the clock, and the figures it reports. The sim
has no broker, so no message is lost or late, no coordinator takeover and no lost agent.

Deterministic for a given workload and policy, except that a planner cut off by its wall-clock
time budget may return a different plan on a slower machine (as it would live).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import structlog

from qlm.admission import (
    GATE_WINDOW,
    OutputBudget,
    PullAdmission,
    SLOAdmissionGate,
    required_speed,
)
from qlm.chains import LateTaskRule
from qlm.control import Completion, Evicted, Heartbeat, InstanceInfo, InstanceStatus
from qlm.coordinator.core import BatchCapOrder, CoordinatorCore, LSOSettings
from qlm.coordinator.outcome import task_met
from qlm.engine_model import EngineProfile, get_profile
from qlm.engine_scheduler import WANTS_AT_MOST
from qlm.policy import Plan, PlanRequest, QueuePolicy
from qlm.service_gain import service_gain
from qlm.tooling.simulator.instance import SimInstance, SimJob
from qlm.tooling.simulator.workload import SimRequest
from qlm.types import SLO, RequestMessage, SamplingParams, TaskInfo
from qlm.virtual_queue import VirtualQueue

log = structlog.get_logger(__name__)

HEARTBEAT_INTERVAL_S = 0.5  # the live agent's default


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
    # the engine's per-iteration token budget (vLLM --max-num-batched-tokens) if not default
    max_num_batched_tokens: int | None = None
    # the agent's pull size (qlm agent --pull-at-most) if not default
    pull_at_most: int | None = None
    # the prompt tokens the agent hands its engine per round (qlm agent --feed-tokens); None:
    # a whole pull at once
    feed_tokens: int | None = None


@dataclass(frozen=True)
class LSOSwitches:
    """Which of QLM's LSOs the simulated agents carry out (request pulling is always on)."""

    eviction: bool = False
    swap: bool = False
    warm_start: bool = False
    slo_pull: bool = False  # SLO-aware pull gate (qlm.admission), else pull while KV allows
    batch_cap: bool = False  # the plan's batch cap per engine (InstanceLSO.max_in_engine)

    @classmethod
    def all(cls) -> LSOSwitches:
        return cls(True, True, True, True, True)


@dataclass(frozen=True)
class SimConfig:
    replan_interval_s: float = 5.0
    decision_delay: bool = False  # charge the planner's measured wall time
    drain_s: float = 600.0  # keep simulating this long after the last arrival
    lso: LSOSwitches = field(default_factory=LSOSwitches)
    static_batch: int | None = None  # SHEPHERD: fixed batches, no continuous batching
    # the ``vllm`` baseline: every request to an engine at arrival (no queue manager)
    dispatch_at_arrival: bool = False
    # keep the policy's predicted completion times: its last plan's before a request was
    # dispatched, and its estimate at the dispatch (QueuePolicy.dispatch_estimate)
    record_estimates: bool = False
    max_decode_run: int | None = None  # cap on iterations per decode jump (tests: 1)
    # the SLO-aware pull: "qlm" (qlm's LSO) uses the engine model for the instance's current
    # mix as f(L) and pulls requests that cannot make their deadline in plan order while they
    # slow no running request; "saber" (SABER's Algorithm 1) uses a USL fit of f(L) from
    # ``speed_models``, demotes such requests to a per-instance low-priority queue and serves
    # it only when the instance's virtual queue (the high-priority queue) is empty
    pull_gate: str = "qlm"
    # "saber": instance id -> model -> f(L) (runner.saber_speed_fits profiles and fits them)
    speed_models: Mapping[str, Mapping[str, Callable[[int], float]]] = field(default_factory=dict)
    # "saber": model -> SABER's maxTokens reading (runner.saber_output_budgets profiles each
    # task's mean output); a model not in it: every request at its max_tokens
    output_budgets: Mapping[str, OutputBudget] = field(default_factory=dict)
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
    estimated_finish_s: float | None = None  # the last plan's before it was dispatched
    dispatch_estimated_finish_s: float | None = None  # the policy's, at its (last) dispatch
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
    batch_caps: int = 0  # batch caps set on agents (the batch cap LSO acting)
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
            "batch_caps": self.batch_caps,
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


def _quantile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-quantile (an observed value: numpy's ``inverted_cdf``)."""
    if not values:
        return None
    return float(np.quantile(values, q, method="inverted_cdf"))


_ARRIVAL, _STEP, _TICK, _ADOPT, _READY, _CONTROL, _ISSUE, _HEARTBEAT = range(8)


@functools.lru_cache(maxsize=65536)
def _tokens(n: int) -> list[int]:
    """Stand-in token ids: the core counts them and never reads them. One shared list per
    length keeps a million requests' prompts and outputs from being materialised; nobody
    mutates them (the core copies what it keeps)."""
    return [0] * n


def _agent_id(instance_id: str) -> str:
    return f"sim-agent-{instance_id}"


def _job_id(job: SimJob) -> str:
    return job.request_id


def _prefill_tokens(job: SimJob) -> int:
    """What the engine prefills to start it: the prompt and any output it resumes after."""
    return job.num_tokens


@dataclass(frozen=True)
class _Need:
    """SABER's reqSpd: the tokens it has left over the time left to its deadline. The view as
    dispatched is already the resume's: what its cap leaves is its max_tokens; the model's
    budget (SABER's maxTokens reading, :class:`~qlm.admission.OutputBudget`) may take less."""

    budgets: Mapping[str, OutputBudget]

    def __call__(self, job: SimJob, now: float) -> float:
        left = job.view.max_tokens
        budget = self.budgets.get(job.req.model)
        if budget is not None:
            left = budget.tokens_left(left, job.req.max_tokens - left, job.req.slo_class)
        return required_speed(left, job.view.deadline, now)


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


# every message is a copy of this one with the request's own fields: model_construct looks up
# the signature of each default factory per call (SamplingParams'), which was most of the
# simulator's time per arrival for the cheap policies (1M requests: minutes)
_MESSAGE_TEMPLATE = RequestMessage.model_construct(
    request_id="template", model="template", max_tokens=1, sampling=SamplingParams()
)


def _message(req: SimRequest, program_started: float | None) -> RequestMessage:
    """The request as a producer publishes it (built without validation: the workload's own
    values). Times are simulated seconds, the core's clock in the simulator."""
    task = None
    if req.task_slo_s is not None and req.stage is None:
        task = TaskInfo.model_construct(
            task_id=req.program_id or req.request_id,
            step=0,
            task_slo_ms=_ms(req.task_slo_s),
            task_started_at=program_started,
            remaining_ms=_ms(req.remaining_s),
        )
    slo = SLO.model_construct(
        e2e_ms=_ms(req.e2e_slo_s),
        ttft_ms=_ms(req.ttft_slo_s),
        tbt_ms=_ms(req.tbt_slo_s),
        slo_class=req.slo_class,
    )
    return _MESSAGE_TEMPLATE.model_copy(
        update={
            "request_id": req.request_id,
            "model": req.model,
            "prompt_token_ids": _tokens(req.prompt_tokens),
            "max_tokens": req.max_tokens,
            "slo": slo,
            "submitted_at": req.arrival_s,
            "task": task,
            "stage": req.stage,
        }
    )


class CapacityController(Protocol):
    """Called every ``interval_s`` simulated seconds with the simulator, which it may change
    through :meth:`ClusterSimulator.add_instance` and :meth:`ClusterSimulator.release_instance`
    (an autoscaler in the loop: qlm/tooling/capacity/sim.py)."""

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
    if spec.max_num_batched_tokens is not None:
        budget = spec.max_num_batched_tokens
        profiles = {m: replace(p, max_num_batched_tokens=budget) for m, p in profiles.items()}
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
        if self.config.pull_gate not in ("qlm", "saber"):
            raise ValueError(f"pull_gate must be 'qlm' or 'saber', not {self.config.pull_gate!r}")
        self.policy = policy
        self.now = 0.0
        lso = self.config.lso
        # the product's coordinator core, on the simulated clock; the sim has no coordinator
        # takeover and no lost agents, so liveness never expires an instance
        self.core = CoordinatorCore(
            policy,
            heartbeat_timeout_s=math.inf,
            clock=lambda: self.now,
            lso=LSOSettings(
                eviction=lso.eviction, warm_start=lso.warm_start, batch_cap=lso.batch_cap
            ),
            late_task_rule=self.config.late_task_rule,
        )
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
        self._program_start: dict[str, float] = {}
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
        self.jobs: dict[str, SimJob] = {}
        self._judged: dict[str, float | None] = {}  # a program call's derived deadline
        # the core's judgement of each answered call (``SLOOutcome.met``: the whole outcome,
        # a pydantic model, cost ~1 KB a request, a gigabyte over a million-request run)
        self.met: dict[str, bool] = {}
        # each engine's agent: credit, dispatches received, the SLO gate's held requests
        self.agents: dict[str, PullAdmission[SimJob]] = {}
        self._all_agents: list[PullAdmission[SimJob]] = []  # retired ones too (their counts)
        self._sent_view: dict[str, tuple[str | None, tuple[str, ...]]] = {}
        self._infos: dict[str, InstanceInfo] = {}
        self._rng = random.Random(self.config.seed)
        self._saber = lso.slo_pull and self.config.pull_gate == "saber"
        self._need = _Need(self.config.output_budgets if self._saber else {})
        if self._saber and controller is not None:
            raise ValueError("the SABER pull gate does not run with a capacity controller")
        if self._saber:
            self._check_speed_models(instances)
        for spec in instances:
            inst = self._make_instance(spec)
            if lso.warm_start:
                inst.set_warm(list(spec.models[1:]), 0.0)
                for m in inst.warm:
                    inst.warm[m] = 0.0  # a warm cluster: host copies made before the run
            self.lives[spec.instance_id] = InstanceLife(spec, 0.0, 0.0, initial=True)
            self._join(inst)
        self.finished = 0
        self.last_finish = 0.0
        self.replans = 0
        self.batch_caps = 0  # batch caps set on agents (BatchCapOrder with a cap)
        self.planner_wall_s = 0.0
        self._last_replan = -math.inf
        self._plan_pending = False
        self._estimates: dict[str, float] = {}
        self._dispatch_estimates: dict[str, float] = {}
        self.events = 0

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
            pull_at_most=spec.pull_at_most or WANTS_AT_MOST,
        )

    def _check_speed_models(self, instances: Sequence[InstanceSpec]) -> None:
        served = {r.model for r in self.requests}
        for spec in instances:
            iid = spec.instance_id
            have = self.config.speed_models.get(iid, {})
            missing = [m for m in spec.models if m in served and m not in have]
            if missing:
                raise ValueError(
                    f"the SABER gate needs f(L) for {missing} on {iid} "
                    "(SimConfig.speed_models; runner.saber_speed_fits profiles them)"
                )

    @property
    def demoted(self) -> int:
        """Held requests the agents' SLO gates moved to their best-effort tier."""
        return sum(a.demoted for a in self._all_agents)

    @property
    def queues(self) -> dict[str, VirtualQueue]:
        """The live instances' virtual queues (the core's)."""
        return {iid: self.core.instances[iid].queue for iid in self.instances}

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
        self._push(HEARTBEAT_INTERVAL_S, _HEARTBEAT)
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
            more = i < n or self.finished < total
            if t_arrival <= t_event:
                self._arrive(reqs[i])
                i += 1
            else:
                _, _, kind, payload, version = heapq.heappop(self._heap)
                if kind == _STEP:
                    if payload.version == version:
                        self._step_done(payload)
                elif kind == _TICK:
                    self._lift_lapsed_caps()
                    self._maybe_replan()
                    if more:
                        self._push(t + self.config.replan_interval_s, _TICK)
                elif kind == _HEARTBEAT:
                    self._heartbeats(force=True)
                    if more:
                        self._push(t + HEARTBEAT_INTERVAL_S, _HEARTBEAT)
                elif kind == _ADOPT:
                    self._adopt(payload)
                elif kind == _READY:
                    self._ready(payload)
                elif kind == _CONTROL:
                    assert self.controller is not None
                    self.controller.on_tick(self)
                    if more:
                        self._push(t + self.controller.interval_s, _CONTROL)
                elif kind == _ISSUE:
                    self._arrive(replace(payload, arrival_s=t))
            if self._progress is not None and t >= next_report:
                self._progress(min(1.0, t / end) if end > 0 else 1.0)
                next_report = t + end / 200
        if self._progress is not None:
            self._progress(1.0)
        return self._result(time.perf_counter() - started)

    # ------------------------------------------------------------------ the agents' side
    def _status(self, inst: SimInstance) -> InstanceStatus:
        """What the instance's agent reports in a heartbeat (built without validation: the
        simulator's own values, at a million requests' pace)."""
        iid = inst.instance_id
        agent = self.agents[iid]
        info = self._infos.get(iid)
        if info is None:  # what an instance is never changes: built once, as an agent does
            info = self._infos[iid] = InstanceInfo.model_construct(
                instance_id=iid,
                agent_id=_agent_id(iid),
                engine="sim",
                gpu_type=inst.gpu_type,
                gpu_memory_gb=0.0,
                models=list(inst.models),
                kv_capacity_tokens=inst.kv_capacity,
                max_batch_size=inst.static_batch or inst.max_batch,
                capabilities={"kv_offload": self.config.lso.swap},
                capability_notes=[],
                # exact: a power-of-two scale, the core multiplies it back
                cpu_memory_gb=inst.cpu_memory_bytes / 2**30,
            )
        return InstanceStatus.model_construct(
            info=info,
            active_model=inst.active_model,
            running=len(inst.running),
            waiting=len(inst.waiting),
            kv_used_tokens=inst.kv_used,
            tokens_per_s=0.0,
            in_flight=[],  # read only by a coordinator taking over, which the sim never has
            credit_outstanding=agent.owed,
            dispatches_received=agent.received,
            warm_models=list(inst.warm) if inst.warm_start else [],
            max_in_engine=agent.cap,
        )

    def _heartbeat(self, inst: SimInstance) -> None:
        iid = inst.instance_id
        self._sent_view[iid] = (inst.active_model, tuple(inst.warm))
        hb = Heartbeat.model_construct(
            type="heartbeat",
            agent_id=_agent_id(iid),
            sent_at=self.now,
            instances=[self._status(inst)],
        )
        self.core.on_heartbeat(hb, self.now)

    def _heartbeats(self, *, force: bool = False) -> None:
        """Agents heartbeat every :data:`HEARTBEAT_INTERVAL_S`, and at once when the resident
        or warm models changed (what the planner reads from heartbeats), so plans see them."""
        for inst in list(self.instances.values()) + list(self.draining.values()):
            if force or self._sent_view.get(inst.instance_id) != (
                inst.active_model,
                tuple(inst.warm),
            ):
                self._heartbeat(inst)
        self._dispatch()

    def _join(self, inst: SimInstance) -> None:
        iid = inst.instance_id
        self.instances[iid] = inst
        gate = None
        window = GATE_WINDOW
        if self.config.lso.slo_pull:
            if self._saber:
                fits = self.config.speed_models[iid]
                gate = SLOAdmissionGate(next(iter(fits.values())))
                window = self.config.saber_window
            else:
                gate = SLOAdmissionGate(inst.decode_speed)
        agent: PullAdmission[SimJob] = PullAdmission(
            gate,
            need=self._need,
            key=_job_id,
            window=window,
            strict=self._saber,
            rng=self._rng if self._saber else None,
            unbounded=self.config.dispatch_at_arrival,
            # no feed budget where there is no agent to hold work (`vllm`), the engine takes
            # whole static batches (SHEPHERD) or a gate admits (as `qlm agent` refuses both)
            feed_tokens=None
            if self.config.dispatch_at_arrival
            or self.config.static_batch is not None
            or gate is not None
            else self.lives[iid].spec.feed_tokens,
            tokens=_prefill_tokens,
        )
        self.agents[iid] = agent
        self._all_agents.append(agent)
        self._heartbeat(inst)
        self._pull(inst)  # the agent's pull loop starts with the agent

    def _pull(self, inst: SimInstance) -> None:
        """The agent's pull loop for one engine: the gate (or the feed budget) admits what it
        holds, then credit for what the engine wants goes to the coordinator, which
        dispatches. A dispatch wakes the live agent's loop at once, so with a gate or a feed
        budget it runs again until the coordinator sends nothing; its last pass admits with
        the credit left unused (the coordinator's queue for this engine is empty: the gate's
        best-effort tier may go)."""
        iid = inst.instance_id
        agent = self.agents.get(iid)
        if agent is None:
            return
        model = inst.active_model
        if self._saber and model is not None and model in self.config.speed_models[iid]:
            agent.gate = SLOAdmissionGate(self._speed(iid, model))  # f(L) of the model it runs
        while True:
            batch: list[SimJob] = []
            agent.admit(inst.wants, batch.append, self.now)
            if batch:
                inst.enqueue(batch, self.now)
            if iid not in self.instances:
                return  # draining: it pulls nothing new
            want = agent.credit_wanted(inst.wants(), len(inst.running) + len(inst.waiting))
            if want > 0:
                agent.granted(want)
                self.core.on_pull(iid, want)
            received = agent.received
            self._dispatch(iid, wake=False)
            if (agent.gate is None and agent.feed_tokens is None) or agent.received == received:
                break
        if agent.gate is not None and agent.best_effort and agent.owed > 0:
            batch = []
            agent.admit(inst.wants, batch.append, self.now)
            if batch:
                inst.enqueue(batch, self.now)

    def _dispatch(self, instance_id: str | None = None, *, wake: bool = True) -> None:
        """The coordinator hands queued requests to instances holding credit. With a gate, a
        dispatch wakes the agent's pull loop (``wake``; :meth:`_pull` itself does not)."""
        delivered: dict[str, list[SimJob]] = {}
        for order in self.core.next_dispatches(self.now, instance_id):
            job = self.jobs[order.tracked.request_id]
            job.view = order.tracked.plan_view  # an evicted request's: its resume
            job.dispatch_id = order.dispatch_id
            if self.config.record_estimates:
                self._estimate_at_dispatch(order.tracked.plan_view, order.instance_id)
            batch = delivered.setdefault(order.instance_id, [])
            self.agents[order.instance_id].on_dispatch(job, batch.append)
        for iid, batch in delivered.items():
            inst = self.instances[iid]
            if batch:
                inst.enqueue(batch, self.now)
            agent = self.agents[iid]
            if agent.gate is not None or agent.feed_tokens is not None:
                if wake:
                    self._pull(inst)
                    continue
                batch = []
                agent.admit(inst.wants, batch.append, self.now)
                if batch:
                    inst.enqueue(batch, self.now)

    def _estimate_at_dispatch(self, request: PlanRequest, iid: str) -> None:
        """The policy's estimate as the request is handed over, from the coordinator's view of
        the instance (its running count has every request of this dispatch round in it). A
        request dispatched again after an eviction keeps the later estimate."""
        view = self.core.instances[iid].plan_view()
        t = self.policy.dispatch_estimate(request, view, self.now)
        if t is not None:
            self._dispatch_estimates[request.request_id] = t

    def _speed(self, iid: str, model: str) -> Callable[[int], float]:
        return self.config.speed_models[iid][model]

    # ------------------------------------------------------------------ the producers' side
    def _arrive(self, req: SimRequest) -> None:
        started = None
        if req.program_id is not None:
            started = self._program_start.setdefault(req.program_id, req.arrival_s)
        message = _message(req, started)
        tracked, outcome = self.core.admit(
            message, None, reply_to=None, correlation_id=None, received_at=self.now
        )
        if tracked is None:
            raise RuntimeError(f"{req.request_id}: the core refused it ({outcome})")
        self.jobs[req.request_id] = SimJob(req=req, view=tracked.plan_view)
        if tracked.chain is not None:
            self._judged[req.request_id] = tracked.chain.judged_deadline
        self._maybe_replan()
        if tracked.instance_id is not None:
            self._dispatch(tracked.instance_id)

    # ------------------------------------------------------------------ engine events
    def _step_done(self, inst: SimInstance) -> None:
        inst.on_event(self.now)
        if inst.evicted_out:
            evicted, inst.evicted_out = inst.evicted_out, []
            for job in evicted:
                self._report_evicted(inst.instance_id, job)
        self._pull(inst)
        inst.resume(self.now)
        if inst.instance_id in self.draining and self._idle(inst):
            self._retire(inst)

    def _report_evicted(self, iid: str, job: SimJob) -> None:
        """The agent's Evicted report: everything generated so far, for an exact resume."""
        self.agents[iid].forget(job.request_id)
        ev = Evicted.model_construct(
            type="evicted",
            agent_id=_agent_id(iid),
            instance_id=iid,
            dispatch_id=job.dispatch_id,
            request_id=job.request_id,
            output_token_ids=_tokens(job.generated),
            reason="evicted",
        )
        tracked = self.core.on_evicted(ev, self.now)
        if tracked is not None and tracked.instance_id is not None:
            self._dispatch(tracked.instance_id)

    def _on_finish(self, job: SimJob, now: float) -> None:
        iid = job.instance_id or ""
        agent = self.agents.get(iid)
        if agent is not None:
            agent.forget(job.request_id)
        c = Completion.model_construct(
            type="completion",
            agent_id=_agent_id(iid),
            instance_id=iid,
            dispatch_id=job.dispatch_id,
            request_id=job.request_id,
            output_token_ids=_tokens(job.generated),
            output_text="",
            finish_reason="length",
            prompt_tokens=job.req.prompt_tokens,
            started_at=job.started_s if job.started_s is not None else now,
            first_token_at=job.first_token_s,
            finished_at=now,
            preemptions=0,
        )
        done = self.core.complete(c)
        if done is None:
            raise RuntimeError(f"{job.request_id}: its completion was refused by the core")
        tracked, _, outcome = done
        self.met[job.request_id] = outcome.met
        self.core.finish(job.request_id)
        self.finished += 1
        if self.controller is not None:
            self._finished_log.append(job)
        self.last_finish = max(self.last_finish, now)
        for nxt in self._dependents.pop(job.request_id, ()):
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
        """Let an instance go: one still starting is cancelled at once; a live one is drained
        (its virtual queue is placed again on the others, as the admin API's drain does) and
        retires once what it runs has finished."""
        life = self.lives.get(iid)
        if life is None or life.released_s is not None:
            raise ValueError(f"no instance {iid!r} to release")
        life.released_s = self.now
        inst = self.instances.pop(iid, None)
        if inst is None:  # still starting
            life.retired_s = self.now
            return
        self.draining[iid] = inst
        self.core.drain(iid, self.now)
        self._dispatch()
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
        state = self.core.instances.get(iid)
        return [] if state is None else [self.jobs[rid] for rid in state.queue]

    def _ready(self, iid: str) -> None:
        life = self.lives[iid]
        if life.retired_s is not None:
            return  # cancelled while starting
        life.ready_s = self.now
        inst = self._make_instance(life.spec)
        self._join(inst)
        # a membership change: every queued request is planned again, so the new instance
        # takes its share of the backlog at once (the live coordinator replans then too)
        self._replan()
        self._pull(inst)

    def _idle(self, inst: SimInstance) -> bool:
        agent = self.agents.get(inst.instance_id)
        held = agent is not None and (agent.held or agent.best_effort)
        return not inst.running and not inst.waiting and inst.loading is None and not held

    def _retire(self, inst: SimInstance) -> None:
        iid = inst.instance_id
        self.draining.pop(iid, None)
        self.retired[iid] = inst
        self.lives[iid].retired_s = self.now
        self.core.lose_instance(iid, "released", self.now)  # nothing left on it to requeue
        self.agents.pop(iid, None)

    # ------------------------------------------------------------------ planning
    def _lift_lapsed_caps(self) -> None:
        for cap in self.core.lapsed_cap_orders(self.now):
            self._apply_cap(cap)

    def _apply_cap(self, cap: BatchCapOrder) -> None:
        agent = self.agents.get(cap.instance_id)
        if agent is not None and agent.cap != cap.max_in_engine:
            agent.cap = cap.max_in_engine
            if cap.max_in_engine is not None:
                self.batch_caps += 1
            inst = self.instances.get(cap.instance_id)
            if inst is not None:
                self._heartbeat(inst)  # the planner prices at the cap the agent applies

    def _maybe_replan(self) -> None:
        now = self.now
        if self._plan_pending or now - self._last_replan < self.config.replan_interval_s:
            return
        if self.core.replan_wanted(now):
            self._replan()

    def _replan(self) -> None:
        now = self.now
        t0 = time.perf_counter()
        plan = self.core.make_plan(now)
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
        """The virtual queues take the plan's order (the core skips requests dispatched while
        it was computed and places those that arrived meanwhile); its LSO orders go to the
        agents; every instance then pulls."""
        self._plan_pending = False
        self.core.adopt_plan(plan, self.now)
        model_orders, evictions = self.core.lso_orders(plan)
        for cap in self.core.cap_orders(plan):
            self._apply_cap(cap)
        for mo in model_orders:
            inst = self.instances.get(mo.instance_id)
            if inst is not None:
                inst.apply_model_states(mo.states, self.now)
        by_instance: dict[str, list[tuple[SimJob, str]]] = {}
        for order in evictions:
            job = self.jobs[order.tracked.request_id]
            agent = self.agents.get(order.instance_id)
            if agent is not None and agent.take_held(job.request_id) is not None:
                self._report_evicted(order.instance_id, job)  # the engine never saw it
                continue
            mode = order.mode if self.config.lso.swap else "evict"
            by_instance.setdefault(order.instance_id, []).append((job, mode))
        for iid, victims in by_instance.items():
            inst = self.instances.get(iid)
            if inst is None:
                continue
            for mode in ("swap", "evict"):
                jobs = [j for j, m in victims if m == mode]
                if jobs:
                    inst.evict(jobs, mode, self.now)
        for inst in list(self.instances.values()):
            self._pull(inst)
            inst.resume(self.now)
        self._dispatch()

    # ------------------------------------------------------------------ results
    def _result(self, wall: float) -> SimResult:
        outcomes = []
        for job in self.jobs.values():
            req = job.req
            # the core's judgement (CoordinatorCore.complete); never finished by the end of
            # the run: missed. A call of a program is judged against its derived deadline
            # (qlm/chains.py, qlm/collective.py), which its service gain uses too.
            judged = self._judged.get(req.request_id)
            e2e_slo_s = req.e2e_slo_s if judged is None else judged - req.arrival_s
            met = self.met.get(req.request_id, False)
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
                    dispatch_estimated_finish_s=self._dispatch_estimates.get(req.request_id),
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
            batch_caps=self.batch_caps,
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
