"""CoordinatorCore: the coordinator's state machine, free of I/O.

It owns the tracked requests, the instances and their virtual queues, and the policy. The
service layer (:mod:`qlm.coordinator.service`) feeds it broker events and carries out what it
decides (dispatch, reply, ack). Keeping the rules here means they are unit-tested without a
broker, the same way vLLM tests its scheduler against a fake KV cache.

Exactly-once replies rest on three rules enforced here:

1. a request is answered at most once: the first valid completion moves it to ANSWERING and
   every later completion for it (a stale dispatch, an agent declared dead) is ignored;
2. a request leaves tracking only after the service confirmed the reply and acked the delivery;
3. a redelivery of a tracked request only swaps the delivery handle (the old one died with its
   channel), it never creates a second entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import structlog

from qlm.chains import CallDeadlines, LateTaskRule, call_deadlines, is_last_step
from qlm.collective import CollectiveTracker, stage_call_deadlines
from qlm.control import Completion, Evicted, Heartbeat, InstanceInfo, InstanceStatus
from qlm.coordinator.outcome import first_token_time, slo_outcome
from qlm.policy import CompletionObservation, Plan, PlanInstance, PlanRequest, QueuePolicy
from qlm.streaming import Reassembler
from qlm.types import RequestMessage, SLOOutcome
from qlm.virtual_queue import QueueTally, Restale, VirtualQueue

log = structlog.get_logger(__name__)

# reply routes of copies of a tracked request (the same id published again) answered with it
MAX_EXTRA_REPLY_TARGETS = 4

# dispatch id of work adopted from a previous coordinator (its real id is unknown here)
ADOPTED_DISPATCH = "adopted"
# Streams of requests not tracked yet kept for their redelivery (``untracked_streams``), at
# most: an engine's batch or two per agent of a large fleet
MAX_UNTRACKED_STREAMS = 4096

# automatic replans only while the virtual queues hold at least this many requests per live
# instance: with (nearly) empty queues there is no order to improve, the engines take requests
# as they come
MIN_QUEUED_PER_INSTANCE = 2

# held requests one release passes over because the instance's engine has too short a context
# for them, at most (they stay held; the next heartbeat's release looks again)
HELD_SCAN_MAX = 64


class TrackState(StrEnum):
    HELD = "held"  # batch tier: waits for spare capacity or its promotion time
    QUEUED = "queued"  # in a virtual queue, or unassigned
    DISPATCHED = "dispatched"  # handed to an instance, no result yet
    ANSWERING = "answering"  # a result is being published; nothing else may happen to it
    DONE = "done"


@dataclass
class TrackedRequest:
    request: RequestMessage
    delivery: Any  # the broker's handle (unacked delivery); opaque here
    reply_to: str | None
    correlation_id: str | None
    submitted_at: float
    queued_at: float
    seq: int
    plan_view: PlanRequest
    state: TrackState = TrackState.QUEUED
    instance_id: str | None = None  # queue it waits in, or instance it runs on
    dispatch_id: str | None = None
    dispatched_at: float | None = None
    attempts: int = 0
    # The same request id published again (not a broker redelivery): it is not run twice.
    # Its delivery is acked at once (a flood of copies must not hold a consumer's prefetch
    # or count as queued work); its producer's reply route, if new, is answered with the
    # first (at most MAX_EXTRA_REPLY_TARGETS of them).
    duplicates: list[tuple[str | None, str | None]] = field(default_factory=list)
    duplicate_copies: int = 0
    # Exact resume: the output of evicted attempts; the next attempt continues after it.
    resume_token_ids: list[int] = field(default_factory=list)
    # A streamed request's output as its producer receives it: the agents' token chunks reach
    # the coordinator too (the stream tap, docs/protocol.md "Token streams"), read by the
    # producer's rule. An attempt lost with its agent resumes after them, so a producer never
    # gets tokens that contradict what it already has (a sampled answer run again from
    # scratch would differ).
    streamed: Reassembler | None = None
    stream_resumed_after: int = 0  # the attempt whose loss last resumed it after its stream
    # an engine streamed its last tokens: its producer may hold the whole answer, and an
    # attempt resumed after it would generate past the answer's end
    stream_ended: bool = False
    evictions: int = 0
    # an evicted attempt produced tokens: the first came no later than this (the Evicted
    # report's arrival); the reply's TTFT uses it, a conservative bound
    first_token_at: float | None = None
    evict_requested: str | None = None  # dispatch id an Evict was sent for (sent once)
    # a step of a task chain: its derived deadlines (qlm/chains.py); None for a lone call
    chain: CallDeadlines | None = None
    promote_at: float | None = None  # batch tier: when it stops waiting for spare capacity
    # its producer cancelled it while it ran: the Evict sent stops it, and the Evicted report
    # (or a lost instance) ends it with a "cancelled" reply instead of a requeue
    cancel_requested: bool = False

    def reply_targets(self) -> list[tuple[str, str | None]]:
        """Distinct (reply_to, correlation_id) pairs to answer: one reply each."""
        targets: list[tuple[str, str | None]] = []
        for reply_to, cid in [(self.reply_to, self.correlation_id), *self.duplicates]:
            if reply_to and (reply_to, cid) not in targets:
                targets.append((reply_to, cid))
        return targets

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class InstanceState:
    info: InstanceInfo
    queue: VirtualQueue
    last_seen: float
    status: str = "alive"  # alive | draining | lost
    credit: int = 0
    dispatches_sent: int = 0  # on the agent's count: starts from its dispatches_received
    queued_tokens: float = 0.0
    running: dict[str, str] = field(default_factory=dict)  # request_id -> dispatch_id
    last_status: InstanceStatus | None = None
    model_states_sent: dict[str, str] = field(default_factory=dict)  # the last ModelPlan
    # the last batch cap sent (None: none, or lifted; CAP_UNKNOWN: what the agent has is
    # not known, the next plan sends its cap whatever it is)
    cap_sent: int | None = None
    incarnation: str | None = None  # the agent process of the last heartbeat
    # attempts it was running when it was declared lost (request id -> dispatch id), while
    # its agent, back, still reports them: each is stopped once another attempt replaced it
    orphans: dict[str, str] = field(default_factory=dict)
    # draining because its agent says the engine does not answer (InstanceStatus.engine_ok),
    # not because an operator drained it: lifted when the engine answers again
    engine_down: bool = False
    # the last view and what it was built from: every arrival is placed over every instance's
    # view, so it is rebuilt only when one of these changed (a million-request simulation
    # spends most of its coordinator time here otherwise)
    _view: tuple[tuple[Any, ...], PlanInstance] | None = field(default=None, repr=False)

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    def in_transit(self, status: InstanceStatus) -> int | None:
        """Dispatches sent here that the agent had not received as of ``status`` (None where
        the agent does not report what it received)."""
        if status.dispatches_received is None:
            return None
        return self.dispatches_sent - status.dispatches_received

    def plan_view(self) -> PlanInstance:
        # the objects themselves (not their ids, which a later object may reuse), compared
        # field by field: this runs once per instance per arrival
        cached = self._view
        if cached is not None:
            key = cached[0]
            if (
                key[0] == len(self.running)
                and key[1] == self.status
                and key[2] is self.last_status
                and key[3] is self.info
            ):
                return cached[1]
        view = self._build_view()
        self._view = ((len(self.running), self.status, self.last_status, self.info), view)
        return view

    def _build_view(self) -> PlanInstance:
        st = self.last_status
        return PlanInstance(
            instance_id=self.info.instance_id,
            models=tuple(self.info.models),
            gpu_type=self.info.gpu_type,
            kv_capacity_tokens=self.info.kv_capacity_tokens,
            max_batch_size=self.info.max_batch_size,
            active_model=st.active_model if st else None,
            running=len(self.running),
            draining=self.status != "alive",
            warm_models=(
                tuple(st.warm_models) if st is not None and st.warm_models is not None else None
            ),
            cpu_memory_bytes=(
                self.info.cpu_memory_gb * 2**30 if self.info.cpu_memory_gb is not None else None
            ),
            max_in_engine=st.max_in_engine if st else None,
        )


@dataclass
class DispatchOrder:
    tracked: TrackedRequest
    instance_id: str
    agent_id: str
    dispatch_id: str
    # the registration it was counted against (a lost instance that registers again is a new
    # InstanceState, whose count starts from its agent's), and whether it was taken back
    counted_on: InstanceState | None = field(default=None, repr=False, compare=False)
    undone: bool = False


@dataclass(frozen=True)
class EvictOrder:
    """Stop a running attempt so the plan's more urgent head group gets the instance."""

    tracked: TrackedRequest
    instance_id: str
    agent_id: str
    dispatch_id: str
    mode: str  # "swap" | "evict"


@dataclass(frozen=True)
class StaleAttempt:
    """An attempt an instance declared lost still runs (its agent was hung, and woke) whose
    request another attempt replaced or already answered: its result would be ignored or
    refused, so it is stopped to free the engine."""

    instance_id: str
    agent_id: str
    request_id: str
    dispatch_id: str


@dataclass(frozen=True)
class StreamResyncOrder:
    """An instance's first heartbeat here listed work running (dispatched by a coordinator
    before: a takeover, a restart). Where those requests stream, their producers hold tokens
    this coordinator never saw (the tap's chunks went to the one before): the agent sends
    their published prefixes to the tap (``StreamResync``)."""

    instance_id: str
    agent_id: str
    request_ids: list[str]


@dataclass(frozen=True)
class ModelStateOrder:
    instance_id: str
    agent_id: str
    states: dict[str, str]  # model -> "active" | "warm" | "cold"


class _QueuedLoad(Mapping[str, float]):
    """The queued work of each alive instance, read through to the instances (what a policy's
    ``place`` gets as ``load``): a dict built per arrival cost O(instances) for the reads of
    the few instances a policy looks at."""

    __slots__ = ("_by_id",)

    def __init__(self, live: list[InstanceState]) -> None:
        self._by_id = {i.instance_id: i for i in live}

    def __getitem__(self, instance_id: str) -> float:
        return self._by_id[instance_id].queued_tokens

    def get(self, instance_id: str, default: Any = None) -> Any:
        inst = self._by_id.get(instance_id)
        return default if inst is None else inst.queued_tokens

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)


CAP_UNKNOWN = 0  # never a cap (a cap is at least 1)


@dataclass(frozen=True)
class BatchCapOrder:
    instance_id: str
    agent_id: str
    max_in_engine: int | None  # None: lift the cap


@dataclass(frozen=True)
class AdmissionLimits:
    """Overload control: at most this many tracked (not yet answered) requests, in all and per
    tenant. A redelivery or duplicate of a tracked request is never counted twice or shed."""

    max_queued: int | None = None
    max_queued_per_tenant: int | None = None
    tenant_limits: dict[str, int] = field(default_factory=dict)

    def tenant_limit(self, tenant: str) -> int | None:
        return self.tenant_limits.get(tenant, self.max_queued_per_tenant)


@dataclass(frozen=True)
class Shed:
    """Why a new request was refused as ``overloaded``: the limit it hit and the depth then."""

    limit: str  # "global" | "tenant"
    tenant: str  # the request's tenant ("" when it names none)
    queued: int  # requests tracked (queued or running) under that limit when it arrived
    max_queued: int

    def message(self) -> str:
        if self.limit == "global":
            held = f"{self.queued} requests queued or running"
        else:
            held = f"tenant {self.tenant!r} has {self.queued} requests queued or running"
        return f"overloaded: {held} (limit {self.max_queued}); retry later"

    def details(self) -> dict[str, Any]:
        return {
            "limit": self.limit,
            "tenant": self.tenant,
            "queued": self.queued,
            "max_queued": self.max_queued,
        }


@dataclass(frozen=True)
class LSOSettings:
    """Which of the plan's LSO decisions the live coordinator carries out."""

    # evict (or swap out) running requests for an at-risk head group: off by default, it
    # never paid in the ablations (docs/benchmarks.md, wa-ablation and wb-ablation)
    eviction: bool = False
    warm_start: bool = True  # tell agents which models to keep awake / warm / released
    # tell agents the plan's batch cap: how many requests to keep in each engine at most
    batch_cap: bool = True


@dataclass(frozen=True)
class BatchTier:
    """SageServe's batch queue manager (docs/architecture.md, "Batch tier"). A request whose
    end-to-end deadline is at least ``min_slack_s`` away on arrival (and that has no TTFT
    target and is not a chain step) is *held*: it stays unacked in the durable queue, outside
    every virtual queue, until an instance reports spare capacity - effective memory
    utilisation below ``release_below`` releases one request of a model it serves, below
    ``release_two_below`` two, per heartbeat - or until ``promote_after`` of its time to
    deadline has passed (SageServe: 10 h of a 24 h deadline), when it is placed like any other
    request. ``min_slack_s=None`` turns the tier off."""

    min_slack_s: float | None = 3600.0
    release_below: float = 0.6
    release_two_below: float = 0.5
    promote_after: float = 10.0 / 24.0

    def __post_init__(self) -> None:
        if self.min_slack_s is not None and self.min_slack_s <= 0:
            raise ValueError("the batch tier's min_slack_s must be > 0 (None turns it off)")
        if not 0 <= self.release_two_below <= self.release_below <= 1:
            raise ValueError("need 0 ≤ release_two_below ≤ release_below ≤ 1")
        if not 0 <= self.promote_after <= 1:
            raise ValueError("promote_after is a fraction of the time to deadline, in [0, 1]")


class CoordinatorCore:
    def __init__(
        self,
        policy: QueuePolicy,
        *,
        heartbeat_timeout_s: float = 3.0,
        clock: Any = time.time,
        lso: LSOSettings | None = None,
        limits: AdmissionLimits | None = None,
        late_task_rule: LateTaskRule = "promote",
        batch: BatchTier | None = None,
    ) -> None:
        self.policy = policy
        self.batch = batch or BatchTier(min_slack_s=None)
        # batch tier: per model, a heap of (promote_at, seq, request id); entries whose
        # request left the tier are skipped when met
        self.held: dict[str, list[tuple[float, int, str]]] = {}
        self.held_count = 0
        self.collective = CollectiveTracker()  # Tempo's collective requests (qlm/collective.py)
        self.late_task_rule = late_task_rule
        self.lso = lso or LSOSettings()
        self.limits = limits or AdmissionLimits()
        self.tenant_counts: dict[str, int] = {}
        # the last "overloaded" admit: which limit refused it, and the depth then
        self.last_shed: Shed | None = None
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self.requests: dict[str, TrackedRequest] = {}
        self.instances: dict[str, InstanceState] = {}
        self._live_cache: list[InstanceState] | None = None
        # instances whose engine reported a context (max_model_len) for some model: only
        # with one of them live does placement check each request's context
        self._context_limited: set[str] = set()
        self._load_view = _QueuedLoad([])
        self._queued = QueueTally()  # requests in every instance's virtual queue
        self.unassigned: list[str] = []
        # Recently answered ids: a redelivery of one of these is acked without a second reply.
        self.answered: OrderedDict[str, None] = OrderedDict()
        self.answered_limit = 200_000
        # streamed requests resumed after the tokens their producer had (_resume_from_stream)
        self.stream_resumes = 0
        # late results ignored because they contradict their request's stream
        self.late_results_refused = 0
        # attempts of a lost instance's woken agent whose request went on without them
        self.stale_attempts: list[StaleAttempt] = []
        # per newly registered instance, the running work whose streams its agent resyncs
        self.stream_resyncs: dict[str, StreamResyncOrder] = {}
        # A broker redelivery of a request this coordinator does not track (a takeover, a
        # restart) may be running on an engine, dispatched by the coordinator before: it is
        # parked, not dispatched, for a heartbeat timeout from its arrival, by when every live
        # agent has reported what its engines run (and it is adopted if one runs it; request
        # id -> parked until). Dispatched at once, it would run twice: harmless for its reply
        # (the first result wins), not for its stream, which would get two engines' tokens.
        # Per request, not per takeover: the broker redelivers within the consumer's
        # prefetch, so many arrive only as earlier ones are answered.
        self.parked: dict[str, float] = {}
        # Stream tap chunks of requests not tracked (yet): after a takeover an agent's
        # resync and chunks can come before the request's redelivery. Kept (bounded, oldest
        # dropped) until it arrives: then they are its stream, and a redelivery nobody runs
        # any more (its agent lost meanwhile) resumes after them.
        self.untracked_streams: dict[str, Reassembler] = {}
        self.stale_attempts_stopped = 0
        # cancels that came before their request, with the tenant that sent them (bounded,
        # like `answered`); honoured only for a request of that tenant
        self.cancelled_early: OrderedDict[str, str] = OrderedDict()
        self._seq = 0
        self.last_plan: Plan | None = None
        # A plan being computed off the event loop (begin_plan ... adopt_plan): meanwhile the
        # policy is left alone - arrivals and requeues wait unassigned (or, where they would
        # start at once, go to a free slot without it: _free_slot) and completions' length
        # observations are kept - so that the planner thread and the loop never share its
        # state. adopt_plan places the waiting ones and hands the observations over.
        self.planning = False
        self._deferred_observations: list[CompletionObservation] = []
        self._sent_free: list[str] = []  # sent to a free slot during this plan
        # placed while plans were computed, ever: sent to a free slot, or held for the plan
        self.plan_arrivals = {"started": 0, "waited": 0}

    # ---------------------------------------------------------------- arrivals
    def admit(
        self,
        request: RequestMessage,
        delivery: Any,
        *,
        reply_to: str | None,
        correlation_id: str | None,
        received_at: float,
        redelivered: bool = False,
        result_held: bool = False,
    ) -> tuple[TrackedRequest | None, str]:
        """Track a validated request. Returns (tracked, outcome) where outcome is "new",
        "redelivered" (a broker redelivery of a tracked request: its old handle died with its
        channel, so the handle is swapped), "duplicate" (the same id published again while
        tracked: it rides along with the first and is answered with it), "answered" (already
        replied: the caller acks the delivery and sends nothing) or "overloaded" (a new
        request beyond the admission limits: not tracked; ``last_shed`` says why).
        ``result_held``: the caller already holds a result for it (a takeover)."""
        rid = request.request_id
        if rid in self.answered:
            return None, "answered"
        early = self.cancelled_early.pop(rid, None) if rid not in self.requests else None
        if early is not None and early == (request.tenant or ""):
            return None, "cancelled"
        existing = self.requests.get(rid)
        if existing is not None:
            if (request.tenant or "") != (existing.request.tenant or ""):
                return existing, "conflict"  # another tenant's id: never its reply
            if redelivered:
                existing.delivery = delivery
                return existing, "redelivered"
            existing.duplicate_copies += 1
            target = (reply_to, correlation_id)
            if (
                reply_to
                and target != (existing.reply_to, existing.correlation_id)
                and target not in existing.duplicates
                and len(existing.duplicates) < MAX_EXTRA_REPLY_TARGETS
            ):
                existing.duplicates.append(target)
            return existing, "duplicate"
        tenant = request.tenant or ""
        # After a takeover, a redelivery of work an engine is running or has finished is not
        # new load: its capacity is already spent, and refusing it would throw that work
        # away. It is admitted even beyond the limits (and counts toward them).
        shed = self._shed_reason(tenant)
        if shed is not None and redelivered and (result_held or self._reported_running(rid)):
            log.info("admitted_beyond_limit", request_id=rid, limit=shed.limit, tenant=tenant)
            shed = None
        if shed is not None:
            self.last_shed = shed
            return None, "overloaded"
        self._seq += 1
        submitted = request.submitted_at if request.submitted_at is not None else received_at
        slo = request.slo
        # a step of a task chain gets its deadline from the task's (qlm/chains.py)
        due = call_deadlines(request, submitted, self.late_task_rule)
        if request.stage is not None:
            due = self._stage_deadlines(request, submitted, received_at, due)
        if due.late:
            log.info("late_task_call", request_id=rid, rule=self.late_task_rule)
        view = PlanRequest(
            request_id=rid,
            model=request.model,
            prompt_tokens=request.prompt_tokens(),
            max_tokens=request.max_tokens,
            arrival_time=submitted,
            deadline=due.deadline,
            ttft_deadline=due.ttft_deadline,
            priority=due.priority,
            slo_class=slo.slo_class,
            seq=self._seq,
            derived_deadline=due.task_deadline is not None or request.stage is not None,
        )
        tracked = TrackedRequest(
            request=request,
            delivery=delivery,
            reply_to=reply_to,
            correlation_id=correlation_id,
            submitted_at=submitted,
            queued_at=received_at,
            seq=self._seq,
            plan_view=view,
            chain=due if due.task_deadline is not None else None,
        )
        # Counted only once everything above (which can raise) is computed; if holding or
        # placing it raises, it is untracked and uncounted again, so that no failure leaks a
        # slot of the tenant's limit, and its redelivery is admitted afresh.
        self.tenant_counts[tenant] = self.tenant_counts.get(tenant, 0) + 1
        self.requests[rid] = tracked
        streamed = self.untracked_streams.pop(rid, None)
        if streamed is not None and request.stream:
            tracked.streamed = streamed  # what its producer got before it was redelivered
        try:
            if redelivered:
                tracked.state, tracked.instance_id = TrackState.QUEUED, None
                self.parked[rid] = received_at + self.heartbeat_timeout_s
            elif not self._hold(tracked, received_at):
                self._place(tracked, received_at)
        except BaseException:
            if tracked.state in (TrackState.QUEUED, TrackState.HELD):
                with contextlib.suppress(Exception):
                    self._unqueue(tracked)
            self.requests.pop(rid, None)
            left = self.tenant_counts.get(tenant, 0) - 1
            if left > 0:
                self.tenant_counts[tenant] = left
            else:
                self.tenant_counts.pop(tenant, None)
            raise
        return tracked, "new"

    def _stage_deadlines(
        self, request: RequestMessage, submitted: float, now: float, own: CallDeadlines
    ) -> CallDeadlines:
        """A call of a collective program: its stage's shared deadline (qlm/collective.py)."""
        return stage_call_deadlines(self.collective.admit(request, submitted, now), own, now)

    # ---------------------------------------------------------------- cancels
    def cancel(
        self, request_id: str, tenant: str | None = None
    ) -> tuple[str, TrackedRequest | None, EvictOrder | None]:
        """A producer withdrew a request. Returns (outcome, tracked, order):

        * ``"cancelled"`` - it was waiting (queued or held): it is out of every queue and now
          ANSWERING; the caller replies ``cancelled`` and settles it;
        * ``"stopping"`` - it runs: ``order`` evicts it; its Evicted report (or the loss of its
          instance) ends it with a ``cancelled`` reply, unless its result comes first;
        * ``"answered"`` - it is being answered or was answered: nothing to do;
        * ``"unknown"`` - not seen yet: remembered, so that it is answered ``cancelled`` on
          arrival without running (if it comes from the same tenant);
        * ``"refused"`` - the request belongs to another tenant than ``tenant``: ignored."""
        tracked = self.requests.get(request_id)
        if tracked is not None and (tracked.request.tenant or "") != (tenant or ""):
            return "refused", None, None
        if tracked is None:
            if request_id in self.answered:
                return "answered", None, None
            self.cancelled_early[request_id] = tenant or ""
            if len(self.cancelled_early) > 10_000:
                self.cancelled_early.popitem(last=False)
            return "unknown", None, None
        if tracked.state in (TrackState.QUEUED, TrackState.HELD):
            self._unqueue(tracked)
            tracked.state = TrackState.ANSWERING
            return "cancelled", tracked, None
        if tracked.state != TrackState.DISPATCHED or tracked.cancel_requested:
            return "answered", tracked, None
        tracked.cancel_requested = True
        inst = self.instances.get(tracked.instance_id or "")
        if inst is None or tracked.dispatch_id is None:
            return "stopping", tracked, None
        tracked.evict_requested = tracked.dispatch_id
        order = EvictOrder(
            tracked, inst.instance_id, inst.info.agent_id, tracked.dispatch_id, "evict"
        )
        return "stopping", tracked, order

    def served_models(self) -> dict[str, list[InstanceState]]:
        """Model -> the live instances that serve it (draining and lost ones take no work).
        One drained because its engine does not answer counts: its agent is there and the
        engine is expected back (a `vllm serve` restarting), so requests for a model it alone
        serves wait for it rather than being refused ``model_not_served``."""
        served: dict[str, list[InstanceState]] = {}
        for inst in self.instances.values():
            if inst.status != "alive" and not (inst.engine_down and inst.status == "draining"):
                continue
            for model in inst.info.models:
                served.setdefault(model, []).append(inst)
        return served

    def withdraw(self, request_id: str) -> TrackedRequest | None:
        """Take a waiting (queued or held) request out of every queue to answer it with an
        error (its model is not served); None when it is not waiting any more."""
        tracked = self.requests.get(request_id)
        if tracked is None or tracked.state not in (TrackState.QUEUED, TrackState.HELD):
            return None
        self._unqueue(tracked)
        tracked.state = TrackState.ANSWERING
        return tracked

    def end_cancelled(self, tracked: TrackedRequest) -> bool:
        """A cancelled request that was running has stopped (or lost its instance): take it
        out of every queue and running set, ready to be answered. False if already answered."""
        if tracked.state in (TrackState.ANSWERING, TrackState.DONE):
            return False
        if tracked.state in (TrackState.QUEUED, TrackState.HELD):
            self._unqueue(tracked)
        self._forget_running(tracked)
        tracked.state = TrackState.ANSWERING
        return True

    # ---------------------------------------------------------------- batch tier
    def _hold(self, tracked: TrackedRequest, now: float) -> bool:
        view, slack = tracked.plan_view, self.batch.min_slack_s
        if (
            slack is None
            or view.deadline is None
            or view.ttft_deadline is not None
            or tracked.chain is not None
            or view.deadline - now < slack
        ):
            return False
        start = min(now, tracked.submitted_at)
        tracked.promote_at = start + self.batch.promote_after * (view.deadline - start)
        tracked.state = TrackState.HELD
        tracked.instance_id = None
        entry = (tracked.promote_at, tracked.seq, tracked.request_id)
        heapq.heappush(self.held.setdefault(view.model, []), entry)
        self.held_count += 1
        return True

    def _take_held(
        self, model: str, limit: int, into: InstanceState | None = None
    ) -> list[TrackedRequest]:
        """Up to ``limit`` held requests of ``model``, the earliest promotion first; with
        ``into``, only those its engine's context takes (the others stay held)."""
        heap = self.held.get(model)
        out: list[TrackedRequest] = []
        kept: list[tuple[float, int, str]] = []
        while heap and len(out) < limit:
            entry = heapq.heappop(heap)
            tracked = self.requests.get(entry[2])
            if tracked is None or tracked.state != TrackState.HELD:
                continue
            if into is not None and not self._fits(into, tracked.plan_view):
                kept.append(entry)
                if len(kept) >= HELD_SCAN_MAX:
                    break  # a beat's release looks no further: the next beat's may
                continue
            self.held_count -= 1
            out.append(tracked)
        for entry in kept:  # popped from it: the heap is there
            heapq.heappush(self.held[model], entry)
        return out

    def _release_to(self, inst: InstanceState) -> int:
        """An instance reported its utilisation: release held work to it if it has room."""
        status = inst.last_status
        if status is None or not self.held_count or inst.info.kv_capacity_tokens <= 0:
            return 0
        if self.planning:  # the policy's order is being recomputed: release on a later beat
            return 0
        emu = status.kv_used_tokens / inst.info.kv_capacity_tokens
        if emu >= self.batch.release_below:
            return 0
        want = 2 if emu < self.batch.release_two_below else 1
        released = 0
        models = [m for m in [status.active_model] if m] + inst.info.models
        for model in dict.fromkeys(models):
            for tracked in self._take_held(model, want - released, into=inst):
                tracked.state = TrackState.QUEUED
                inst.queue.insert(tracked.request_id, self.policy.sort_key(tracked.plan_view))
                inst.queued_tokens += self.policy.work_tokens(tracked.plan_view)
                tracked.instance_id = inst.instance_id
                released += 1
                log.info(
                    "batch_released",
                    request_id=tracked.request_id,
                    instance_id=inst.instance_id,
                    utilisation=round(emu, 3),
                )
            if released >= want:
                break
        return released

    def promote_due(self, now: float) -> list[TrackedRequest]:
        """Held requests whose promotion time has come are placed like any other request."""
        promoted: list[TrackedRequest] = []
        for model, heap in self.held.items():
            while heap and heap[0][0] <= now:
                for tracked in self._take_held(model, 1):
                    self._place(tracked, now)
                    promoted.append(tracked)
                    log.info("batch_promoted", request_id=tracked.request_id)
        return promoted

    def _shed_reason(self, tenant: str) -> Shed | None:
        """Which limit refuses a new request of ``tenant`` now; None: admit it. Every tracked
        request counts, queued or running: each holds an unacked broker delivery and
        coordinator memory until it is answered, and those are what the limits bound."""
        limits = self.limits
        if limits.max_queued is not None and len(self.requests) >= limits.max_queued:
            return Shed("global", tenant, len(self.requests), limits.max_queued)
        cap = limits.tenant_limit(tenant)
        held = self.tenant_counts.get(tenant, 0)
        if cap is not None and held >= cap:
            return Shed("tenant", tenant, held, cap)
        return None

    def _reported_running(self, request_id: str) -> bool:
        """An agent's last heartbeat lists the request as running on its engine."""
        return any(
            inst.last_status is not None and request_id in inst.last_status.in_flight
            for inst in self.instances.values()
            if inst.status != "lost"
        )

    def _live(self) -> list[InstanceState]:
        """The alive instances (a cached list: every arrival reads it; rebuilt when an
        instance registers or changes status, see :meth:`_instances_changed`)."""
        live = self._live_cache
        if live is None:
            live = self._live_cache = [i for i in self.instances.values() if i.status == "alive"]
            self._load_view = _QueuedLoad(live)
        return live

    def _instances_changed(self) -> None:
        self._live_cache = None

    @staticmethod
    def _fits(inst: InstanceState, view: PlanRequest) -> bool:
        """Whether the engine of ``inst`` takes ``view``'s context (prompt + max_tokens, the
        same sum after a resume): within the max_model_len it reports for the model. One it
        says nothing of takes what the catalog allows, which admission checked."""
        limit = inst.info.max_model_len.get(view.model)
        return limit is None or view.prompt_tokens + view.max_tokens <= limit

    def _place(self, tracked: TrackedRequest, now: float) -> None:
        if self.planning:  # the policy is a plan's, elsewhere: adopt_plan places it
            tracked.state = TrackState.QUEUED
            tracked.dispatch_id = None
            free = self._free_slot(tracked.plan_view)
            if free is not None:
                # it would start at once wherever the policy put it: it goes there now (the
                # next pump dispatches it) rather than wait out the plan; the plan never held
                # it, and if it is still queued at the adoption, the policy places it then
                free.queue.insert(tracked.request_id, (tracked.seq,))
                free.queued_tokens += self.policy.work_tokens(tracked.plan_view)
                tracked.instance_id = free.instance_id
                self._sent_free.append(tracked.request_id)
                self.plan_arrivals["started"] += 1
                return
            tracked.instance_id = None
            self.unassigned.append(tracked.request_id)
            self.plan_arrivals["waited"] += 1
            return
        view = tracked.plan_view
        # engines of one model may differ in context (--max-model-len): the policy chooses
        # among those that take this request, so every policy places by context alike
        live, fits = self._live(), self._fits
        views = (
            [i.plan_view() for i in live if fits(i, view)]
            if self._context_limited
            else [i.plan_view() for i in live]
        )
        target = self.policy.place(view, views, self._load_view, now)
        tracked.state = TrackState.QUEUED
        tracked.dispatch_id = None
        if target is None:
            tracked.instance_id = None
            self.unassigned.append(tracked.request_id)
            return
        inst = self.instances[target]
        inst.queue.insert(tracked.request_id, self.policy.sort_key(tracked.plan_view))
        inst.queued_tokens += self.policy.work_tokens(tracked.plan_view)
        tracked.instance_id = target

    def _free_slot(self, view: PlanRequest) -> InstanceState | None:
        """An alive instance running ``view``'s model, taking its context, with a free batch
        slot (counting everything dispatched to it and not finished, and its batch cap),
        credit its agent granted, and nothing queued for it: a request sent there starts now.
        The least busy one, if any."""
        best: InstanceState | None = None
        model = view.model
        for inst in self._live():
            st = inst.last_status
            if inst.credit <= 0 or len(inst.queue) or st is None or st.active_model != model:
                continue
            if not self._fits(inst, view):
                continue
            if st.waiting:  # the engine's own queue holds work (as of its last heartbeat)
                continue
            slots = inst.info.max_batch_size
            if st.max_in_engine is not None:
                slots = min(slots, st.max_in_engine)
            if len(inst.running) >= slots:
                continue
            if best is None or len(inst.running) < len(best.running):
                best = inst
        return best

    def _unqueue(self, tracked: TrackedRequest) -> None:
        """Take a QUEUED (or HELD) request out of wherever it waits."""
        if tracked.state == TrackState.HELD:
            tracked.state = TrackState.QUEUED  # its heap entry is skipped from now on
            self.held_count -= 1
            return
        if tracked.instance_id is None:
            with contextlib.suppress(ValueError):
                self.unassigned.remove(tracked.request_id)
            return
        inst = self.instances.get(tracked.instance_id)
        if inst is not None and inst.queue.remove(tracked.request_id):
            inst.queued_tokens -= self.policy.work_tokens(tracked.plan_view)

    # ---------------------------------------------------------------- agents
    def on_heartbeat(self, hb: Heartbeat, now: float) -> list[str]:
        """Register or refresh the agent's instances. Returns newly registered instance ids."""
        new: list[str] = []
        for status in hb.instances:
            iid = status.info.instance_id
            inst = self.instances.get(iid)
            if inst is None or inst.status == "lost":
                orphans = {} if inst is None else inst.orphans
                inst = InstanceState(
                    info=status.info,
                    queue=VirtualQueue(iid, self._queued),
                    last_seen=now,
                    credit=status.credit_outstanding,
                    dispatches_sent=status.dispatches_received or 0,
                    # a coordinator that took over: the agent still applies the cap the last
                    # one sent, which this one must lift or change like one it sent itself
                    cap_sent=status.max_in_engine,
                    orphans=orphans,
                )
                self.instances[iid] = inst
                self._instances_changed()
                new.append(iid)
                if status.in_flight:
                    # it runs work this coordinator never dispatched (a takeover, a restart):
                    # the streams among it told the tap of a coordinator that is gone, so
                    # the agent is asked what their producers have (StreamResync)
                    self.stream_resyncs[iid] = StreamResyncOrder(
                        iid, hb.agent_id, list(status.in_flight)
                    )
                log.info("instance_registered", instance_id=iid, agent_id=hb.agent_id)
            elif inst.status == "alive":
                if hb.incarnation is not None and inst.incarnation not in (None, hb.incarnation):
                    # the agent process restarted: its dispatch count starts from 0 again,
                    # and nothing this coordinator sent the old process is in transit
                    log.info("agent_restarted", instance_id=iid, agent_id=hb.agent_id)
                    inst.dispatches_sent = status.dispatches_received or 0
                    # nor did the new process get the model plan or batch cap: resend them
                    inst.model_states_sent, inst.cap_sent = {}, CAP_UNKNOWN
                self._reconcile_credit(inst, status)
            if hb.incarnation is not None:
                inst.incarnation = hb.incarnation
            inst.info = status.info
            if status.info.max_model_len:
                self._context_limited.add(iid)
            else:
                self._context_limited.discard(iid)
            inst.last_seen = now
            inst.last_status = status
            if status.engine_ok == inst.engine_down:
                self._engine_changed(inst, status, now)
            self._adopt(inst, status.in_flight)
            if inst.orphans:
                self._stop_replaced(inst, status.in_flight)
            if inst.status == "alive":
                self._release_to(inst)
        if new:
            self._place_unassigned(now)
        if self.parked:
            self._place_parked(now)
        if self.held_count:
            self.promote_due(now)
        return new

    def _engine_changed(self, inst: InstanceState, status: InstanceStatus, now: float) -> None:
        """Its agent says the engine stopped answering, or answers again (a `vllm serve` that
        died and was restarted): drain it meanwhile. Work waiting for it would wait for an
        engine that may never come back, and work sent there would fail at once."""
        if not status.engine_ok:
            if inst.status == "alive":
                moved = self._drain(inst, now)
                inst.engine_down = True
                log.warning("instance_engine_down", instance_id=inst.instance_id, moved=moved)
            return
        inst.engine_down = False
        if inst.status == "draining":
            inst.status = "alive"
            self._instances_changed()
            self._reconcile_credit(inst, status)
            log.info("instance_engine_back", instance_id=inst.instance_id)
            self._place_unassigned(now)

    def _place_parked(self, now: float) -> None:
        """Redeliveries parked a heartbeat timeout ago that no agent reported running are
        placed (parked in arrival order, so due in that order)."""
        due = []
        for rid, until in self.parked.items():
            if until > now:
                break
            due.append(rid)
        for rid in due:
            del self.parked[rid]
            tracked = self.requests.get(rid)
            if (
                tracked is None
                or tracked.state != TrackState.QUEUED
                or tracked.instance_id is not None
            ):
                continue
            # nobody runs it: where its producer already has tokens (an agent streamed them
            # before it was lost), it goes on after them (counted here: an attempt of the
            # coordinator before, which this one's count of attempts does not know)
            if self._resume_from_stream(tracked, now):
                self.stream_resumes += 1
                log.info(
                    "redelivery_resumed_from_stream",
                    request_id=rid,
                    streamed=len(tracked.resume_token_ids),
                )
            if not self._hold(tracked, now):
                self._place(tracked, now)

    def _reconcile_credit(self, inst: InstanceState, status: InstanceStatus) -> None:
        """Credit is a delta protocol (pulls add, dispatches use), and a broker node that dies
        can take pulls or dispatches with it: the agent then waits for dispatches that never
        come while this coordinator waits for credit - a stall. The heartbeat carries the
        agent's side: credit it granted and has not seen used, and dispatches it received.
        Pulls travel the same channel and queue as heartbeats (in order), so none is in
        transit when this heartbeat is handled; dispatches sent but not yet received are.
        What this coordinator should hold is therefore the agent's outstanding credit less
        those dispatches in transit."""
        in_transit = inst.in_transit(status)
        if in_transit is None:
            return
        if in_transit < 0:  # the agent restarted and counts from 0 again
            inst.dispatches_sent -= in_transit  # now the agent's count
            in_transit = 0
        expected = max(0, status.credit_outstanding - in_transit)
        if expected != inst.credit:
            log.info(
                "credit_reconciled",
                instance_id=inst.instance_id,
                held=inst.credit,
                agent_outstanding=status.credit_outstanding,
                in_transit=in_transit,
                now_held=expected,
            )
            inst.credit = expected

    def _adopt(self, inst: InstanceState, in_flight: list[str]) -> None:
        """After a takeover: requests redelivered to this coordinator that an engine is already
        running (dispatched by the coordinator that died) are marked running there instead of
        being dispatched a second time. Only requests this coordinator never dispatched
        (``attempts == 0``) qualify, so an eviction or requeue racing a heartbeat is never
        mistaken for running work. Their result, whatever its dispatch id, is accepted."""
        for rid in in_flight:
            tracked = self.requests.get(rid)
            waiting = (TrackState.QUEUED, TrackState.HELD)
            if tracked is None or tracked.state not in waiting or tracked.attempts:
                continue
            self._unqueue(tracked)
            self.parked.pop(rid, None)
            tracked.state = TrackState.DISPATCHED
            tracked.instance_id = inst.instance_id
            tracked.dispatch_id = ADOPTED_DISPATCH
            tracked.attempts = 1
            inst.running[rid] = ADOPTED_DISPATCH
            log.info("request_adopted", request_id=rid, instance_id=inst.instance_id)

    def _stop_replaced(self, inst: InstanceState, in_flight: list[str]) -> None:
        """The attempts a lost instance's agent, back, still runs: those whose request was
        answered meanwhile, and streamed ones another attempt replaced (their streams are
        fenced, and a result contradicting the new attempt's tokens is refused), are stopped
        (``stale_attempts``, for the service to send); those that ended are forgotten; the
        rest are checked again at the next heartbeat. A replaced attempt without a stream
        runs on: it started first, so its result, taken whichever comes first, is often the
        sooner."""
        running = set(in_flight)
        for rid, did in list(inst.orphans.items()):
            tracked = self.requests.get(rid)
            if rid not in running:
                del inst.orphans[rid]
            elif (
                tracked is None
                or tracked.state in (TrackState.ANSWERING, TrackState.DONE)
                or (
                    tracked.request.stream
                    and tracked.state == TrackState.DISPATCHED
                    and tracked.dispatch_id != did
                )
            ):
                del inst.orphans[rid]
                self.stale_attempts.append(
                    StaleAttempt(inst.instance_id, inst.info.agent_id, rid, did)
                )

    def take_stream_resyncs(self) -> list[StreamResyncOrder]:
        """The stream resyncs found since the last call (for the service to send)."""
        orders, self.stream_resyncs = list(self.stream_resyncs.values()), {}
        return orders

    def take_stale_attempts(self) -> list[StaleAttempt]:
        """The stale attempts found since the last call (for the service to stop)."""
        stale, self.stale_attempts = self.stale_attempts, []
        self.stale_attempts_stopped += len(stale)
        return stale

    def _place_unassigned(self, now: float) -> None:
        waiting, self.unassigned = self.unassigned, []
        for rid in waiting:
            tracked = self.requests.get(rid)
            if tracked is not None and tracked.state == TrackState.QUEUED:
                self._place(tracked, now)

    def on_pull(self, instance_id: str, credit: int) -> bool:
        inst = self.instances.get(instance_id)
        if inst is None or inst.status == "lost":
            return False
        inst.credit += credit
        return True

    def next_dispatches(self, now: float, instance_id: str | None = None) -> list[DispatchOrder]:
        """Hand queued requests to every instance that has credit (or to ``instance_id``
        only), in virtual-queue order; the policy may move a head whose key went stale since
        its plan (:meth:`QueuePolicy.stale_key`) before it leaves."""
        orders: list[DispatchOrder] = []
        misfits: list[TrackedRequest] = []
        if instance_id is None:
            instances: Iterable[InstanceState] = self.instances.values()
        else:
            one = self.instances.get(instance_id)
            instances = () if one is None else (one,)
        for inst in instances:
            if inst.status != "alive" or inst.credit <= 0 or not len(inst.queue):
                continue
            restale = self._restale(inst.instance_id, now)
            while inst.credit > 0 and len(inst.queue):
                rid = inst.queue.pop(restale)
                tracked = self.requests[rid]
                inst.queued_tokens -= self.policy.work_tokens(tracked.plan_view)
                if not self._fits(inst, tracked.plan_view):
                    # its engine came back with a shorter context than it was placed for
                    misfits.append(tracked)
                    continue
                if tracked.streamed is not None:
                    # chunks of a lost attempt may have come in since it was requeued
                    self._resume_from_stream(tracked, now)
                inst.credit -= 1
                inst.dispatches_sent += 1
                tracked.state = TrackState.DISPATCHED
                tracked.instance_id = inst.instance_id
                tracked.dispatch_id = uuid.uuid4().hex
                tracked.dispatched_at = now
                tracked.attempts += 1
                inst.running[rid] = tracked.dispatch_id
                orders.append(
                    DispatchOrder(
                        tracked,
                        inst.instance_id,
                        inst.info.agent_id,
                        tracked.dispatch_id,
                        counted_on=inst,
                    )
                )
        for tracked in misfits:
            self._place(tracked, now)
        return orders

    def _restale(self, instance_id: str, now: float) -> Restale | None:
        """The policy's :meth:`~QueuePolicy.stale_key` as the queue of ``instance_id`` asks it
        (None where the policy keeps the base's, which never moves anything, and while a
        plan computed in another thread owns the policy: :meth:`begin_plan`)."""
        if self.planning or type(self.policy).stale_key is QueuePolicy.stale_key:
            return None
        stale_key, requests = self.policy.stale_key, self.requests

        def restale(rid: str, key: tuple[Any, ...]) -> tuple[Any, ...] | None:
            return stale_key(requests[rid].plan_view, key, instance_id, now)

        return restale

    def undo_dispatch(self, order: DispatchOrder, now: float) -> bool:
        """A dispatch this coordinator failed to publish (its own channel or connection, not
        the agent): the instance gets its credit back, and the request goes back to a queue.
        The credit comes back even when the request has moved on meanwhile (an earlier
        attempt's result answered it, a requeue): the agent never saw this dispatch, so it
        still counts that credit as granted and the dispatch as not received. Keeping both
        would leave the agent's credit owed and the dispatch "in transit" forever; once an
        engine's whole want is owed that way its agent stops pulling and the requests queued
        for it wait indefinitely (seen after a broker leader's kill: eight such failures per
        instance). If the dispatch did arrive after all, the agent's next heartbeat reconciles
        the credit. Returns whether the request was requeued; undoing twice does nothing."""
        if order.undone:
            return False
        order.undone = True
        inst = order.counted_on
        if inst is not None and self.instances.get(inst.instance_id) is inst:
            inst.credit += 1
            inst.dispatches_sent -= 1
        tracked = self.requests.get(order.tracked.request_id)
        if (
            tracked is None
            or tracked.state != TrackState.DISPATCHED
            or tracked.dispatch_id != order.dispatch_id
        ):
            return False
        current = self.instances.get(tracked.instance_id or "")
        if current is not None:
            current.running.pop(tracked.request_id, None)
        tracked.attempts -= 1
        tracked.dispatched_at = None
        self._place(tracked, now)
        return True

    def accept_result(self, request_id: str, dispatch_id: str) -> TrackedRequest | None:
        """The gate for exactly-once replies. Returns the request if this result should be
        answered (and moves it to ANSWERING), None if it must be ignored."""
        tracked = self.requests.get(request_id)
        if tracked is None or tracked.state in (TrackState.ANSWERING, TrackState.DONE):
            return None
        # A result from an older dispatch (e.g. an agent we declared dead that was only slow)
        # is still a correct result: take it, and forget the newer attempt.
        if tracked.state in (TrackState.QUEUED, TrackState.HELD):
            self._unqueue(tracked)
        self._forget_running(tracked)
        if dispatch_id != tracked.dispatch_id:
            log.info("late_result_accepted", request_id=request_id, dispatch_id=dispatch_id)
        tracked.state = TrackState.ANSWERING
        return tracked

    def accept_completion(self, c: Completion) -> TrackedRequest | None:
        tracked = self.requests.get(c.request_id)
        if tracked is not None and self._contradicts_stream(tracked, c):
            return None
        tracked = self.accept_result(c.request_id, c.dispatch_id)
        if tracked is not None:
            tracked.instance_id = c.instance_id
        return tracked

    def _contradicts_stream(self, tracked: TrackedRequest, c: Completion) -> bool:
        """A late result (an older attempt: its agent was declared lost, and woke) of a
        streamed request whose producer already got other tokens, from the attempt that
        replaced it: taking it would make the reply contradict the stream, so it is ignored
        and the current attempt answers. A current attempt's result is always taken (there is
        no other to wait for)."""
        streamed = tracked.streamed
        if (
            streamed is None
            or c.dispatch_id == tracked.dispatch_id
            or tracked.state in (TrackState.ANSWERING, TrackState.DONE)
        ):
            return False
        have = streamed.token_ids
        if c.output_token_ids[: len(have)] == have:
            return False
        self.late_results_refused += 1
        log.warning(
            "late_result_contradicts_stream",
            request_id=tracked.request_id,
            dispatch_id=c.dispatch_id,
            streamed=len(have),
        )
        return True

    def judge_completion(
        self, tracked: TrackedRequest, c: Completion
    ) -> tuple[float | None, SLOOutcome]:
        """The accepted result's first-token time (the earliest across attempts) and SLO
        outcome, by the rules the simulator judges its figures with (qlm/coordinator/
        outcome.py). A call that ends its collective program also closes the program here:
        its task_met is then whether the program met its deadline."""
        request = tracked.request
        slo = request.slo
        first_token_at = first_token_time(c.first_token_at, tracked.first_token_at)
        chain = tracked.chain
        task = request.task
        # only the step that ends its chain says whether the whole task met its SLA
        task_started_at = task_slo_s = None
        if (
            chain is not None
            and chain.task_deadline is not None
            and task is not None
            and task.task_slo_ms is not None
            and is_last_step(request)
        ):
            task_started_at = (
                task.task_started_at if task.task_started_at is not None else tracked.submitted_at
            )
            task_slo_s = task.task_slo_ms / 1000
        outcome = slo_outcome(
            tracked.submitted_at,
            first_token_at,
            c.finished_at,
            len(c.output_token_ids),
            e2e_slo_s=None if slo.e2e_ms is None else slo.e2e_ms / 1000,
            ttft_slo_s=None if slo.ttft_ms is None else slo.ttft_ms / 1000,
            tbt_slo_s=None if slo.tbt_ms is None else slo.tbt_ms / 1000,
            judged_deadline=None if chain is None else chain.judged_deadline,
            task_started_at=task_started_at,
            task_slo_s=task_slo_s,
        )
        program_met = self.collective.finished(request, len(c.output_token_ids), c.finished_at)
        if program_met is not None:  # this call ended its collective program
            outcome = outcome.model_copy(update={"task_met": program_met})
        return first_token_at, outcome

    def complete(self, c: Completion) -> tuple[TrackedRequest, float | None, SLOOutcome] | None:
        """A finished attempt's result: accepted (exactly once), judged, and learned from
        (the policy's output-length model observes what the request really produced). Returns
        (request, first-token time, outcome), or None for a result that must be ignored. The
        live service and the simulator both end a request here."""
        tracked = self.accept_completion(c)
        if tracked is None:
            return None
        first_token_at, outcome = self.judge_completion(tracked, c)
        request = tracked.request
        obs = CompletionObservation(
            model=request.model,
            slo_class=request.slo.slo_class,
            output_tokens=len(c.output_token_ids),
            prompt_tokens=tracked.plan_view.prompt_tokens,
            max_tokens=request.max_tokens,
            tenant=request.tenant,
        )
        if self.planning:
            self._deferred_observations.append(obs)
        else:
            self.policy.observe_completion(obs)
        return tracked, first_token_at, outcome

    def _forget_running(self, tracked: TrackedRequest) -> None:
        # where it runs, as this coordinator knows it; every instance when that is unknown or
        # stale (a result from an instance it was moved away from)
        inst = self.instances.get(tracked.instance_id or "")
        if inst is not None and inst.running.pop(tracked.request_id, None) is not None:
            return
        for inst in self.instances.values():
            inst.running.pop(tracked.request_id, None)

    def finish(self, request_id: str) -> None:
        """The reply is confirmed and the delivery acked: stop tracking."""
        tracked = self.requests.pop(request_id, None)
        if tracked is not None:
            tracked.state = TrackState.DONE
            tenant = tracked.request.tenant or ""
            left = self.tenant_counts.get(tenant, 0) - 1
            if left > 0:
                self.tenant_counts[tenant] = left
            else:
                self.tenant_counts.pop(tenant, None)
        self.answered[request_id] = None
        if len(self.answered) > self.answered_limit:
            self.answered.popitem(last=False)

    def release_answering(self, request_id: str) -> None:
        """Publishing the reply failed: the request goes back to the queue to be tried again."""
        tracked = self.requests.get(request_id)
        if tracked is not None and tracked.state == TrackState.ANSWERING:
            self._place(tracked, self.clock())

    # ---------------------------------------------------------------- failures
    def lose_instance(self, instance_id: str, reason: str, now: float) -> list[TrackedRequest]:
        """Declare an instance dead: its queued and in-flight requests go to other queues."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.status == "lost":
            return []
        inst.status = "lost"
        self._instances_changed()
        inst.credit = 0
        moved = [self.requests[rid] for rid in inst.queue.clear()]
        inst.queued_tokens = 0.0
        for rid, did in inst.running.items():
            tracked = self.requests.get(rid)
            # only the attempt that is still current: an older one was already moved on
            if tracked and tracked.state == TrackState.DISPATCHED and tracked.dispatch_id == did:
                moved.append(tracked)
        inst.orphans = dict(inst.running)
        inst.running.clear()
        from_stream = 0
        for tracked in moved:
            from_stream += self._resume_from_stream(tracked, now)
            self._place(tracked, now)
        log.warning(
            "instance_lost",
            instance_id=instance_id,
            reason=reason,
            requeued=len(moved),
            resumed_from_stream=from_stream,
        )
        return moved

    def lose_agent(self, agent_id: str, reason: str, now: float) -> list[TrackedRequest]:
        moved: list[TrackedRequest] = []
        for inst in list(self.instances.values()):
            if inst.info.agent_id == agent_id:
                moved += self.lose_instance(inst.instance_id, reason, now)
        return moved

    # ---------------------------------------------------------------- evictions
    def on_evicted(self, ev: Evicted, now: float) -> TrackedRequest | None:
        """A running attempt stopped unfinished (evicted, or its engine failed): requeue the
        request to resume after what it generated. Ignored unless it is the current attempt
        (a completion may have won the race, or the instance was declared lost meanwhile)."""
        tracked = self.requests.get(ev.request_id)
        if (
            tracked is None
            or tracked.state != TrackState.DISPATCHED
            or tracked.dispatch_id != ev.dispatch_id
        ):
            return None
        if tracked.cancel_requested:
            # stopped because its producer cancelled it: answered "cancelled", not requeued
            self.end_cancelled(tracked)
            return tracked
        self._forget_running(tracked)
        ids = list(ev.output_token_ids)
        if len(ids) < len(tracked.resume_token_ids) or ids[: len(tracked.resume_token_ids)] != (
            tracked.resume_token_ids
        ):
            # an agent that lost the output (engine died before reporting tokens) hands back
            # less than we had: keep the longer, consistent prefix
            ids = tracked.resume_token_ids
        self._resume_after(tracked, ids, now)
        tracked.evictions += 1
        tracked.evict_requested = None
        self._place(tracked, now)
        log.info(
            "request_requeued_for_resume",
            request_id=ev.request_id,
            instance_id=ev.instance_id,
            reason=ev.reason,
            resume_tokens=len(tracked.resume_token_ids),
        )
        return tracked

    def _resume_after(self, tracked: TrackedRequest, ids: list[int], now: float) -> None:
        """The next attempt continues after ``ids`` (the output so far)."""
        # keep at least one token to generate: an engine needs max_tokens >= 1, and greedy
        # decoding regenerates the dropped token identically
        ids = ids[: max(0, tracked.request.max_tokens - 1)]
        if ids and tracked.first_token_at is None:
            tracked.first_token_at = now
        tracked.resume_token_ids = ids
        base = tracked.request
        tracked.plan_view = dataclasses.replace(
            tracked.plan_view,
            prompt_tokens=base.prompt_tokens() + len(ids),
            max_tokens=base.max_tokens - len(ids),
        )

    # ---------------------------------------------------------------- token streams
    def on_streamed(
        self, request_id: str, offset: int, token_ids: list[int], attempt: int | None
    ) -> bool:
        """A token chunk an agent published to a streamed request's producer (the stream
        tap): follow what the producer receives, by the producer's own rule
        (:class:`qlm.streaming.Reassembler`). A request not tracked (yet) keeps it for its
        redelivery (``untracked_streams``). False where it is not taken: a request answered or
        not streamed, or tokens beyond its ``max_tokens`` (an agent's bug, not the producer's
        output)."""
        tracked = self.requests.get(request_id)
        if tracked is None:
            return self._untracked_streamed(request_id, offset, token_ids, attempt)
        if (
            not tracked.request.stream
            or tracked.state in (TrackState.ANSWERING, TrackState.DONE)
            or offset + len(token_ids) > tracked.request.max_tokens
        ):
            return False
        if tracked.streamed is None:
            tracked.streamed = Reassembler()
        tracked.streamed.add(offset, token_ids, "", attempt)
        return True

    def _untracked_streamed(
        self, request_id: str, offset: int, token_ids: list[int], attempt: int | None
    ) -> bool:
        """A chunk of a request not tracked: kept for its redelivery (``untracked_streams``),
        unless it was answered."""
        if request_id in self.answered:
            return False
        streamed = self.untracked_streams.pop(request_id, None)
        if streamed is None:
            streamed = Reassembler()
            while len(self.untracked_streams) >= MAX_UNTRACKED_STREAMS:
                del self.untracked_streams[next(iter(self.untracked_streams))]
        self.untracked_streams[request_id] = streamed  # the most recent last
        streamed.add(offset, token_ids, "", attempt)
        return True

    def on_stream_end(self, request_id: str) -> None:
        """An engine streamed a request's last tokens (the tap's end header)."""
        tracked = self.requests.get(request_id)
        if tracked is not None and tracked.request.stream:
            tracked.stream_ended = True

    def _resume_from_stream(self, tracked: TrackedRequest, now: float) -> int:
        """Its attempt was lost with its agent: where its producer already holds more of the
        output than the next attempt would start from, it starts after that instead (not once
        an engine streamed its end: the answer is whole, and an agent streams an end only
        after its result is confirmed, so that result is on its way and is accepted when it
        comes; meanwhile it is requeued from its last resume point, as without a stream).
        Returns 1 where it did, else 0."""
        streamed = tracked.streamed
        if streamed is None or tracked.stream_ended:
            return 0
        have, resume = streamed.token_ids, tracked.resume_token_ids
        if len(have) <= len(resume) or have[: len(resume)] != resume:
            return 0
        self._resume_after(tracked, list(have), now)
        if len(tracked.resume_token_ids) <= len(resume):
            return 0
        if tracked.stream_resumed_after != tracked.attempts:
            # once per lost attempt (chunks read after the loss extend it at the dispatch)
            tracked.stream_resumed_after = tracked.attempts
            self.stream_resumes += 1
        return 1

    def lso_orders(self, plan: Plan) -> tuple[list[ModelStateOrder], list[EvictOrder]]:
        """Turn the plan's LSO decisions (``plan.lso``, from policies that make them) into
        orders for the agents: model placement per instance (sent when it changed) and
        evictions of running attempts that would make the head group miss its deadline. The
        victims are those running on the instance, not in the head group, whose deadline is
        later than the head group's most urgent one."""
        model_orders: list[ModelStateOrder] = []
        evictions: list[EvictOrder] = []
        for iid, decision in plan.lso.items():
            inst = self.instances.get(iid)
            if inst is None or inst.status != "alive":
                continue
            if self.lso.warm_start:
                states = decision.model_states(inst.info.models)
                if states and states != inst.model_states_sent:
                    inst.model_states_sent = states
                    model_orders.append(ModelStateOrder(iid, inst.info.agent_id, states))
            if not (self.lso.eviction and decision.preempt_running):
                continue
            head = set(decision.head_requests)
            deadlines = [
                self.requests[r].plan_view.effective_deadline for r in head if r in self.requests
            ]
            if not deadlines:
                continue
            urgent = min(deadlines)
            mode = decision.preemption_mode
            if mode == "swap" and not inst.info.capabilities.get("kv_offload", False):
                mode = "evict"  # the engine cannot keep KV in host memory: recompute
            for rid, did in inst.running.items():
                tracked = self.requests.get(rid)
                if (
                    tracked is None
                    or rid in head
                    or tracked.state != TrackState.DISPATCHED
                    or tracked.dispatch_id != did
                    or tracked.evict_requested == did
                    or tracked.plan_view.effective_deadline <= urgent
                ):
                    continue
                tracked.evict_requested = did
                evictions.append(EvictOrder(tracked, iid, inst.info.agent_id, did, mode))
        return model_orders, evictions

    def cap_orders(self, plan: Plan) -> list[BatchCapOrder]:
        """The plan's batch caps (``InstanceLSO.max_in_engine``) for the agents, each sent when
        it changed. An instance the plan says nothing of keeps what it was sent; a policy that
        makes no LSO decisions sends none."""
        orders: list[BatchCapOrder] = []
        wanted = {iid: d.max_in_engine for iid, d in plan.lso.items()}
        if not self.lso.batch_cap:  # off: lift any cap an agent still applies (from before)
            wanted = {iid: None for iid, i in self.instances.items() if i.cap_sent is not None}
        for iid, cap in wanted.items():
            inst = self.instances.get(iid)
            if inst is None or inst.status != "alive" or cap == inst.cap_sent:
                continue
            inst.cap_sent = cap
            orders.append(BatchCapOrder(iid, inst.info.agent_id, cap))
        return orders

    def lapsed_cap_orders(self, now: float) -> list[BatchCapOrder]:
        """Orders lifting the caps the policy says have lost their reason since its last plan
        (:meth:`QueuePolicy.lapsed_caps`); asked on the caller's periodic tick."""
        orders: list[BatchCapOrder] = []
        if self.planning:  # the policy is a plan's, elsewhere, until it is adopted
            return orders
        for iid in self.policy.lapsed_caps(now):
            inst = self.instances.get(iid)
            if inst is None or inst.status != "alive" or inst.cap_sent is None:
                continue
            inst.cap_sent = None
            orders.append(BatchCapOrder(iid, inst.info.agent_id, None))
        return orders

    def excuse_silence(self, now: float) -> None:
        """The coordinator could not hear heartbeats until ``now`` (its own broker connection
        was down): every instance not lost counts as seen now, and has the whole heartbeat
        timeout from now to be heard again."""
        for inst in self.instances.values():
            if inst.status != "lost":
                inst.last_seen = max(inst.last_seen, now)

    def check_liveness(self, now: float) -> list[tuple[str, list[TrackedRequest]]]:
        lost = []
        for inst in list(self.instances.values()):
            if inst.status != "lost" and now - inst.last_seen > self.heartbeat_timeout_s:
                lost.append(
                    (
                        inst.instance_id,
                        self.lose_instance(inst.instance_id, "heartbeat_timeout", now),
                    )
                )
        return lost

    # ---------------------------------------------------------------- operator actions
    def drain(self, instance_id: str, now: float) -> int:
        inst = self.instances[instance_id]
        if inst.status == "lost":
            return 0
        inst.engine_down = False  # the operator's drain: it stays when the engine is back
        return self._drain(inst, now)

    def _drain(self, inst: InstanceState, now: float) -> int:
        instance_id = inst.instance_id
        inst.status = "draining"
        self._instances_changed()
        inst.credit = 0
        moved = [self.requests[rid] for rid in inst.queue.clear()]
        inst.queued_tokens = 0.0
        for tracked in moved:
            self._place(tracked, now)
        log.info("instance_draining", instance_id=instance_id, moved=len(moved))
        return len(moved)

    def undrain(self, instance_id: str, now: float | None = None) -> str:
        """Take a draining instance back into service; its status after (a lost one stays
        lost: its agent re-registers it with a heartbeat). Its credit comes back with the
        agent's next heartbeat (``_reconcile_credit``) or pull. Requests no live instance
        could take while it drained (its model's, or a context only its engine takes) are
        placed at once, not at the next plan."""
        inst = self.instances[instance_id]
        if inst.status == "draining":
            inst.status = "alive"
            self._instances_changed()
            log.info("instance_undrained", instance_id=instance_id)
            self._place_unassigned(self.clock() if now is None else now)
        return inst.status

    def replan_wanted(self, now: float) -> bool:
        """Whether an automatic replan is worth running now: the policy asks for one and the
        virtual queues hold work (:data:`MIN_QUEUED_PER_INSTANCE` per live instance). How
        often replans may run is the caller's (wall-clock or simulated) budget."""
        if not self.policy.wants_replan(now):
            return False
        need = MIN_QUEUED_PER_INSTANCE * max(len(self._live()), 1)
        return len(self.unassigned) + self._queued.count >= need

    def replan(self, now: float) -> Plan:
        """Full replan of every queued request with the policy; virtual queues adopt it."""
        plan = self.make_plan(now)
        self.adopt_plan(plan, now)
        return plan

    def make_plan(self, now: float) -> Plan:
        """The policy's plan for every queued request, not yet adopted (a caller that charges
        the planner's time adopts it later with :meth:`adopt_plan`)."""
        return self.policy.plan(*self.plan_inputs(), now)

    def plan_inputs(self) -> tuple[list[PlanRequest], list[PlanInstance]]:
        """What a plan is computed from: the queued requests' and live instances' views."""
        parked = self.parked
        queued = [
            t
            for t in self.requests.values()
            if t.state == TrackState.QUEUED and (not parked or t.request_id not in parked)
        ]
        return [t.plan_view for t in queued], [i.plan_view() for i in self._live()]

    def begin_plan(self) -> tuple[list[PlanRequest], list[PlanInstance]]:
        """Start a plan computed elsewhere (another thread): the inputs, and the policy is left
        to it until :meth:`adopt_plan` (or :meth:`abort_plan`)."""
        if self.planning:
            raise RuntimeError("a plan is already being computed")
        inputs = self.plan_inputs()
        self.planning = True
        return inputs

    def abort_plan(self, now: float) -> None:
        """The plan computed elsewhere failed: the policy is the loop's again."""
        self._end_planning(now)

    def _end_planning(self, now: float) -> None:
        if not self.planning:
            return
        self.planning = False
        # sent to a free slot and not dispatched yet: its key is no policy's, so the policy
        # places it again (adopt_plan does the same by clearing every queue)
        sent, self._sent_free = self._sent_free, []
        for rid in sent:
            tracked = self.requests.get(rid)
            if tracked is not None and tracked.state == TrackState.QUEUED:
                self._unqueue(tracked)
                self._place(tracked, now)
        observed, self._deferred_observations = self._deferred_observations, []
        for obs in observed:
            self.policy.observe_completion(obs)
        self._place_unassigned(now)

    def adopt_plan(self, plan: Plan, now: float) -> None:
        """The virtual queues take the plan's order. Requests that left the queues while it
        was computed (dispatched, answered) are skipped; those that arrived meanwhile, and
        those on an instance that is no longer live, are placed again."""
        self.planning = False  # observations are handed over below, once the plan is in
        self._sent_free = []  # any still queued is in a cleared queue below, placed again
        waiting: dict[str, TrackedRequest] = {}
        for inst in self.instances.values():
            for rid in inst.queue.clear():
                waiting[rid] = self.requests[rid]
            inst.queued_tokens = 0.0
        for rid in self.unassigned:
            tracked = self.requests.get(rid)
            if tracked is not None and tracked.state == TrackState.QUEUED:
                waiting[rid] = tracked
        self.unassigned = []
        # a loop over every queued request (100k at the largest backlogs measured, where it
        # took a tenth of the live replan): lookups bound once, the context checked only on
        # an engine that reports one (_fits is true for every request elsewhere)
        sort_key, work_tokens, fits, find = (
            self.policy.sort_key,
            self.policy.work_tokens,
            self._fits,
            waiting.get,
        )
        for iid, ids in plan.queues.items():
            target = self.instances.get(iid)
            if target is None or target.status != "alive":
                continue
            check = bool(target.info.max_model_len)
            entries: list[tuple[str, tuple[Any, ...]]] = []
            add = entries.append
            tokens = target.queued_tokens  # 0.0: summed in the same order as before
            for rid in ids:
                tracked = find(rid)
                if tracked is None:
                    continue
                view = tracked.plan_view
                if check and not fits(target, view):
                    continue  # one beyond this engine's context is placed again, below
                del waiting[rid]
                tracked.instance_id = iid
                add((rid, sort_key(view)))
                tokens += work_tokens(view)
            target.queued_tokens = tokens
            target.queue.replace(entries)
        for rid in plan.unassigned:
            tracked = waiting.pop(rid, None)
            if tracked is not None:
                tracked.instance_id = None
                self.unassigned.append(rid)
        for tracked in sorted(waiting.values(), key=lambda t: t.seq):
            self._place(tracked, now)
        self.last_plan = plan
        observed, self._deferred_observations = self._deferred_observations, []
        for obs in observed:
            self.policy.observe_completion(obs)

    # ---------------------------------------------------------------- views
    def state_counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in TrackState if s != TrackState.DONE}
        for t in self.requests.values():
            counts[t.state.value] += 1
        return counts

    def queue_depths(self) -> dict[str, int]:
        return {iid: len(i.queue) for iid, i in self.instances.items()}

    def queued_requests(self, instance_id: str | None) -> Iterable[TrackedRequest]:
        ids = self.unassigned if instance_id is None else self.instances[instance_id].queue
        for rid in list(ids):
            t = self.requests.get(rid)
            if t is not None:
                yield t
