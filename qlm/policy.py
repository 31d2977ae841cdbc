"""The one policy interface shared by the live coordinator and the simulator.

A policy decides, for every queued request, which instance's virtual queue it waits in and in
what order. ``plan`` is a full replan over a snapshot; ``place`` puts one new arrival into the
current queues without disturbing anyone else's place. Both are pure functions of their inputs
(no broker, no clock reads), so they are tested with plain builders and a conformance suite
(``tests/conformance/test_policy_conformance.py``) that every policy must pass.

Concrete policies live in the ``planner`` package (FCFS, EDF, the stochastic planner); qlm's core
only knows this interface.
"""

from __future__ import annotations

import functools
import heapq
import math
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from qlm.engine_model import profile_caches


@functools.cache
def token_rate(gpu_type: str, model: str) -> float:
    """Tokens/s an instance processes for a model (engine performance model at a typical
    batch of 32 × 1k context); 1.0 when the pair is unknown, so load is then compared raw."""
    from qlm.engine_model import get_profile

    try:
        return get_profile(gpu_type, model).token_throughput(32, 1024)
    except (KeyError, ValueError):
        return 1.0


profile_caches(token_rate.cache_clear)  # a newly registered profile holds for the next plan


@dataclass(frozen=True, slots=True)
class CompletionObservation:
    """What a policy learns when a request finishes (``QueuePolicy.observe_completion``).

    One object rather than a list of arguments: a new field (a feature the length model could
    use) reaches every policy by being added here, without editing five signatures and every
    caller; a policy that does not need it ignores it."""

    model: str
    slo_class: str | None
    output_tokens: int
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    tenant: str | None = None


@dataclass(frozen=True)
class PlanRequest:
    """What a policy may know about a queued request."""

    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    arrival_time: float  # wall-clock unix s the SLO clock started (submission)
    deadline: float | None  # absolute e2e deadline, unix s
    ttft_deadline: float | None  # absolute TTFT deadline, unix s
    priority: int = 0
    slo_class: str | None = None
    seq: int = 0  # coordinator's arrival sequence number: a stable FCFS tie-breaker
    # its deadline is derived from a task chain's or a program's (qlm/chains.py,
    # qlm/collective.py): the slack it seems to have is the later calls' too
    derived_deadline: bool = False

    @property
    def effective_deadline(self) -> float:
        """The tighter of the two deadlines (TTFT counts as the earliest point we must start).
        Written out (no list, no min()): replans read it for every queued request."""
        e2e, ttft = self.deadline, self.ttft_deadline
        if ttft is None:
            return math.inf if e2e is None else e2e
        return ttft if e2e is None or ttft < e2e else e2e


@dataclass(frozen=True)
class PlanInstance:
    """What a policy may know about an instance."""

    instance_id: str
    models: tuple[str, ...]
    gpu_type: str
    kv_capacity_tokens: int
    max_batch_size: int
    active_model: str | None = None
    running: int = 0
    draining: bool = False
    # Models whose weights sit in host memory (a switch to them is a warm start from CPU);
    # None means unknown: every model the instance serves is taken as warm.
    warm_models: tuple[str, ...] | None = None
    # Host memory free for warm models and swapped KV; None means unknown (no limit assumed).
    cpu_memory_bytes: float | None = None
    # The batch cap its agent applies (InstanceLSO.max_in_engine); None: none
    max_in_engine: int | None = None

    def serves(self, model: str) -> bool:
        return not self.draining and model in self.models


@dataclass(frozen=True, slots=True)
class InstanceLSO:
    """A plan's LSO decisions for one instance, the typed seam from planner to executor (the
    coordinator core turns them into orders for the agent: :meth:`CoordinatorCore.lso_orders`).

    * ``active_model`` - the model the head of its queue needs; ``model_switch`` - it differs
      from the resident one;
    * ``warm_models`` / ``cold_models`` - the other models it serves, to keep in host memory
      (in the order the queue needs them, within the host budget) or to release;
    * ``head_requests`` - the head group (its first batch);
    * ``preempt_running`` - the head group misses its SLO if it waits for the running batch:
      running requests may be preempted for it, by ``preemption_mode`` (``"swap"``: the KV
      goes to host memory and back; ``"evict"``: it is recomputed);
    * ``max_in_engine`` - the batch cap: the agent keeps at most this many requests in the
      engine (running and waiting there), so that each decodes faster than in a full batch,
      for work whose deadline needs it; ``None``: as many as the engine takes."""

    active_model: str | None = None
    model_switch: bool = False
    warm_models: tuple[str, ...] = ()
    cold_models: tuple[str, ...] = ()
    head_requests: tuple[str, ...] = ()
    preempt_running: bool = False
    preemption_mode: Literal["swap", "evict"] = "evict"
    max_in_engine: int | None = None

    def model_states(self, served: Sequence[str]) -> dict[str, str]:
        """model -> "active" | "warm" | "cold", for the models the instance serves."""
        states: dict[str, str] = dict.fromkeys(self.cold_models, "cold")
        states.update(dict.fromkeys(self.warm_models, "warm"))
        if self.active_model:
            states[self.active_model] = "active"
        return {m: s for m, s in states.items() if m in served}

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the admin API's latest plan)."""
        return {
            "active_model": self.active_model,
            "model_switch": self.model_switch,
            "warm_models": list(self.warm_models),
            "cold_models": list(self.cold_models),
            "head_requests": list(self.head_requests),
            "preempt_running": self.preempt_running,
            "preemption_mode": self.preemption_mode,
            "max_in_engine": self.max_in_engine,
        }


@dataclass
class Plan:
    """An ordering of every queued request: one list per instance, plus what no instance serves.
    ``lso``: per instance, the LSO decisions of policies that make them (empty for the others);
    ``meta``: figures a policy reports about its plan (predicted attainment, feasibility,
    scale-up advice), for operators and benches, never read to act on."""

    queues: dict[str, list[str]]
    unassigned: list[str] = field(default_factory=list)
    plan_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    policy: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    lso: dict[str, InstanceLSO] = field(default_factory=dict)

    def assigned_ids(self) -> list[str]:
        return [rid for q in self.queues.values() for rid in q]


class QueuePolicy(ABC):
    """Base of every ordering policy. Subclasses give an order (``sort_key``) or override
    ``plan``/``place`` entirely (the stochastic planner does)."""

    name: str = "abstract"
    # Set by policies whose executor runs fixed batches without continuous batching (the
    # SHEPHERD baseline): the cluster simulator then runs their instances that way.
    static_batch_size: int | None = None
    # What the policy keeps between calls, in words; "" for a pure policy (its plan and keys
    # depend on their arguments alone: the conformance suite checks it). The coordinator core
    # never calls a policy while its plan runs in another thread (begin_plan / adopt_plan), so
    # a stateful policy needs no locks.
    keeps_state: str = ""
    # Set by the no-queue-manager baseline (``vllm``): its engines take every request the
    # moment it is placed (agents grant unbounded credit), so nothing waits in a virtual
    # queue and each engine's own FCFS waiting queue and preemption decide.
    dispatch_at_arrival: bool = False

    @abstractmethod
    def sort_key(self, request: PlanRequest) -> tuple[Any, ...]:
        """Order inside one virtual queue: smaller goes first."""

    # -- load balancing shared by the simple policies ---------------------------------------
    @staticmethod
    def work_tokens(request: PlanRequest) -> int:
        return request.prompt_tokens + request.max_tokens

    def choose_instance(
        self,
        request: PlanRequest,
        instances: Sequence[PlanInstance],
        load: Mapping[str, float],
    ) -> PlanInstance | None:
        """Least queued work, in seconds of the instance's token throughput for this model
        (so a faster GPU takes proportionally more), among instances that serve the model; on
        a tie (empty queues, when agents pull as fast as work arrives) one whose active model
        already matches (no model switch), then the one running the fewest requests (so light
        load spreads over the instances instead of piling onto the first)."""
        eligible = [i for i in instances if i.serves(request.model)]
        if not eligible:
            return None
        return min(
            eligible,
            key=lambda i: (
                load.get(i.instance_id, 0.0) / token_rate(i.gpu_type, request.model),
                i.active_model != request.model,
                i.running,
                i.instance_id,
            ),
        )

    def plan(
        self,
        requests: Sequence[PlanRequest],
        instances: Sequence[PlanInstance],
        now: float,
    ) -> Plan:
        """Full replan: walk requests in policy order, each to the least-loaded eligible queue
        (:meth:`choose_instance`). With the base class's choice, one heap of instances per
        model finds it in O(log instances) per request instead of comparing every instance:
        the same plan (tests/unit/test_policy_plan_heap.py), which at 100k queued on 32
        instances was most of EDF's replan."""
        queues: dict[str, list[str]] = {i.instance_id: [] for i in instances}
        unassigned: list[str] = []
        ordered = sorted(requests, key=self.sort_key)
        fast = type(self).choose_instance is QueuePolicy.choose_instance
        if fast and len(instances) > 1 and len(queues) == len(instances):  # ids unique
            _least_loaded_walk(ordered, instances, self.work_tokens, queues, unassigned)
            return Plan(queues=queues, unassigned=unassigned, policy=self.name)
        load: dict[str, float] = dict.fromkeys(queues, 0.0)
        for req in ordered:
            inst = self.choose_instance(req, instances, load)
            if inst is None:
                unassigned.append(req.request_id)
                continue
            queues[inst.instance_id].append(req.request_id)
            load[inst.instance_id] += self.work_tokens(req)
        return Plan(queues=queues, unassigned=unassigned, policy=self.name)

    def wants_replan(self, now: float) -> bool:
        """Whether the coordinator should run ``plan`` now (e.g. an arrival created a predicted
        SLO violation, or the last plan is too old). Simple policies never ask."""
        return False

    def lapsed_caps(self, now: float) -> list[str]:
        """Instances whose batch cap (``InstanceLSO.max_in_engine`` of the last plan) has lost
        its reason by ``now`` and is to be lifted without waiting for a plan; each is named
        once. Policies that set no caps name none."""
        return []

    def stale_key(
        self, request: PlanRequest, key: tuple[Any, ...], instance_id: str, now: float
    ) -> tuple[Any, ...] | None:
        """Asked as ``request`` reaches the head of ``instance_id``'s queue, about to be
        dispatched: a new sort key when its own ``key`` no longer holds at ``now`` (the
        request moves there and the next head is asked), or None to dispatch it. A policy whose
        keys promise a deadline can be met uses it to demote, between replans, work whose
        latest start has passed. The new key must not be stale itself. Not asked while a plan
        computed in another thread owns the policy. Default: None."""
        return None

    def predicted_completions(self) -> Mapping[str, float]:
        """The policy's own estimate of when each request of its last plan completes (absolute
        time, the clock of ``now``): what the simulator's ``rct`` scenario checks against the
        simulated completions. Empty for policies that make no estimate."""
        return {}

    def dispatch_estimate(
        self, request: PlanRequest, instance: PlanInstance, now: float
    ) -> float | None:
        """The policy's estimate of when ``request`` completes (absolute time, the clock of
        ``now``), made at ``now`` as it is handed to ``instance``. Its wait so far is then a
        fact, and the estimate prices only what is left, at the batch ``instance`` runs
        (``instance.running`` counts this request). The ``rct`` scenario checks it against the
        simulated completion. None for policies that make no estimate."""
        return None

    def observe_completion(self, obs: CompletionObservation) -> None:
        """A request finished with ``obs.output_tokens`` tokens: policies that profile the workload
        learn from it (the stochastic planner's output-length model; with the per-request
        features, its length forest). Default: ignored."""
        return None

    def place(
        self,
        request: PlanRequest,
        instances: Sequence[PlanInstance],
        load: Mapping[str, float],
        now: float,
    ) -> str | None:
        """Incremental placement of one arrival: the instance whose virtual queue it joins
        (its position there follows ``sort_key``), or None when no live instance serves it.
        ``load`` is the queued work (tokens) per instance, maintained by the caller."""
        inst = self.choose_instance(request, instances, load)
        return None if inst is None else inst.instance_id


def _least_loaded_walk(
    ordered: Sequence[PlanRequest],
    instances: Sequence[PlanInstance],
    work_tokens: Callable[[PlanRequest], int],
    queues: dict[str, list[str]],
    unassigned: list[str],
) -> None:
    """:meth:`QueuePolicy.plan`'s walk with :meth:`QueuePolicy.choose_instance`'s choice, by
    heaps: per model, its instances keyed by that choice's key. A request adds load to one
    instance only, and load only grows, so an entry is at most its instance's key now: the
    top is taken if still current, else pushed back with its key now (lazy deletion). The
    key ends in the instance id, so no two instances tie and the heap's choice is
    ``min()``'s."""
    load: dict[str, float] = dict.fromkeys(queues, 0.0)
    version: dict[str, int] = dict.fromkeys(queues, 0)
    heaps: dict[str, list[tuple[float, bool, int, str, int]]] = {}
    by_id = {i.instance_id: i for i in instances}

    def heap_of(model: str) -> list[tuple[float, bool, int, str, int]]:
        heap = [
            (0.0, i.active_model != model, i.running, i.instance_id, 0)
            for i in instances
            if i.serves(model)
        ]
        heapq.heapify(heap)
        heaps[model] = heap
        return heap

    for req in ordered:
        model = req.model
        heap = heaps.get(model)
        if heap is None:
            heap = heap_of(model)
        if not heap:
            unassigned.append(req.request_id)
            continue
        while True:
            _, switch, running, iid, seen = heap[0]
            if seen == version[iid]:
                break
            inst = by_id[iid]
            heapq.heapreplace(
                heap,
                (load[iid] / token_rate(inst.gpu_type, model), switch, running, iid, version[iid]),
            )
        queues[iid].append(req.request_id)
        load[iid] += work_tokens(req)
        version[iid] += 1
        heapq.heapreplace(
            heap,
            (
                load[iid] / token_rate(by_id[iid].gpu_type, model),
                switch,
                running,
                iid,
                version[iid],
            ),
        )
