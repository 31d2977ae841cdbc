"""Control messages between the coordinator and the agents (JSON over ``qlm.control``).

Agents → coordinator (routing key ``coordinator``): :class:`Heartbeat` (also registers the
agent's instances, so a restarted coordinator learns the fleet from the next beat),
:class:`Pull` (credit: "send me up to N more requests for this instance"), :class:`Completion`,
:class:`Failure`, :class:`Goodbye`.

Coordinator → agent (routing key ``agent.<agent_id>``): :class:`Dispatch`, :class:`Evict`
(stop a running request and hand back its output so far), :class:`ModelPlan` (which models
each instance keeps awake, warm in host memory, or releases), :class:`BatchCap` (at most how
many requests to keep in an engine).

Agents → coordinator also: :class:`Evicted` (a request stopped before it finished, with the
tokens it generated: the coordinator requeues it and the next attempt resumes exactly there).

``dispatch_id`` names one attempt at a request. The coordinator only accepts a completion whose
dispatch_id is the request's current one and whose request is not yet answered; that is how a
late result from an agent declared dead is kept from producing a second reply.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from qlm.types import RequestMessage


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InstanceInfo(_Msg):
    """What an instance is: one engine on one GPU (or one TP group)."""

    instance_id: str
    agent_id: str
    engine: str  # "sim" | "vllm" | "http"
    gpu_type: str
    gpu_memory_gb: float
    models: list[str]
    kv_capacity_tokens: int
    max_batch_size: int
    # what the engine can do beyond serving (EngineCapabilities: exact_resume, prefix_caching,
    # kv_offload, sleep_mode) and why something is off; shown on the admin API
    capabilities: dict[str, bool] = Field(default_factory=dict)
    capability_notes: list[str] = Field(default_factory=list)
    cpu_memory_gb: float | None = None  # host memory for warm models and swapped KV
    # per model, the context (prompt + output tokens) the engine itself accepts, where it says
    # (vLLM's config or its server's /v1/models); models left out: the catalog's max_context
    max_model_len: dict[str, int] = Field(default_factory=dict)


class InstanceStatus(_Msg):
    info: InstanceInfo
    active_model: str | None = None
    running: int = 0
    waiting: int = 0
    kv_used_tokens: int = 0
    tokens_per_s: float = 0.0
    # request ids the engine holds now: lets a new coordinator rebuild what is in flight
    in_flight: list[str] = Field(default_factory=list)
    # credit the agent granted and has not seen used: a coordinator that (re)registers the
    # instance starts from it, so no credit is stranded with a coordinator that died
    credit_outstanding: int = Field(default=0, ge=0)
    # dispatches for this instance the agent has received since it started: with the
    # coordinator's count of dispatches sent, it tells dispatches in transit from credit or
    # dispatches lost with a queue (a broker node's death), so credit is reconciled at every
    # heartbeat. None (an older agent): no reconciliation.
    dispatches_received: int | None = Field(default=None, ge=0)
    # models whose weights are in host memory (a switch to them is a warm start); None: unknown
    warm_models: list[str] | None = None
    # the batch cap the agent applies (BatchCap): at most this many requests in the engine
    max_in_engine: int | None = Field(default=None, ge=1)
    # False while the engine does not answer (e.g. the agent's `vllm serve` died): the
    # coordinator places no work there and moves what waits for it elsewhere until it is True
    # again (an automatic drain, lifted by itself)
    engine_ok: bool = True


class Heartbeat(_Msg):
    type: Literal["heartbeat"] = "heartbeat"
    agent_id: str
    sent_at: float
    instances: list[InstanceStatus]
    # a fresh id per agent process: a restarted agent (same agent and instance ids) counts its
    # dispatches from 0 again, which the coordinator cannot tell from dispatches in transit
    # without it (a heartbeat of the dead process may register the instance first)
    incarnation: str | None = Field(default=None, max_length=64)


class Pull(_Msg):
    type: Literal["pull"] = "pull"
    agent_id: str
    instance_id: str
    credit: int = Field(ge=1, description="additional requests the instance can take now")


class ReplyRoute(_Msg):
    reply_to: str
    correlation_id: str | None = None


class Dispatch(_Msg):
    type: Literal["dispatch"] = "dispatch"
    dispatch_id: str
    instance_id: str
    attempt: int
    request: RequestMessage
    submitted_at: float
    queued_at: float
    dispatched_at: float
    # output of earlier attempts that were evicted: the engine continues after these tokens
    # and its output starts with them (exact resume)
    resume_token_ids: list[int] = Field(default_factory=list)
    deadline: float | None = None  # unix s (end-to-end SLO), for the agent's admission gate
    # streamed requests only (request.stream): where the agent publishes TokenChunks, the
    # (reply_to, correlation_id) pairs the coordinator validated and will answer
    reply_routes: list[ReplyRoute] = Field(default_factory=list)


class Evict(_Msg):
    """Stop this attempt: the plan wants the instance for more urgent work (``mode`` "swap":
    the KV may be kept in host memory where the engine can; "evict": it is recomputed)."""

    type: Literal["evict"] = "evict"
    instance_id: str
    request_id: str
    dispatch_id: str
    mode: Literal["evict", "swap"] = "evict"
    reason: str = "plan"


class ModelPlan(_Msg):
    """The plan's model placement for one instance (QLM's model warm start LSO)."""

    type: Literal["model_plan"] = "model_plan"
    instance_id: str
    states: dict[str, Literal["active", "warm", "cold"]]


class BatchCap(_Msg):
    """The plan's batch cap for one instance: keep at most ``max_in_engine`` requests in the
    engine (running or waiting there), so that each decodes faster than in a full batch;
    ``None`` lifts it. The agent pulls less; nothing running is stopped."""

    type: Literal["batch_cap"] = "batch_cap"
    instance_id: str
    max_in_engine: int | None = Field(default=None, ge=1)


class StreamResync(_Msg):
    """After a takeover or a restart: send the coordinator's stream tap what the producers of
    these requests, running here, have been streamed so far (the chunks the coordinator
    before had read are gone with it). Should this agent be lost, they then resume after it."""

    type: Literal["stream_resync"] = "stream_resync"
    instance_id: str
    request_ids: list[str] = Field(max_length=4096)  # service.MAX_RESYNC_REQUESTS


ToAgent = Annotated[
    Dispatch | Evict | ModelPlan | BatchCap | StreamResync, Field(discriminator="type")
]
to_agent_adapter: TypeAdapter[ToAgent] = TypeAdapter(ToAgent)


class Completion(_Msg):
    type: Literal["completion"] = "completion"
    agent_id: str
    instance_id: str
    dispatch_id: str
    request_id: str
    output_token_ids: list[int]
    output_text: str
    finish_reason: Literal["length", "stop", "abort"]
    prompt_tokens: int
    started_at: float
    first_token_at: float | None
    finished_at: float
    preemptions: int = 0


class Failure(_Msg):
    """The engine could not run a request (it will not succeed elsewhere either)."""

    type: Literal["failure"] = "failure"
    agent_id: str
    instance_id: str
    dispatch_id: str
    request_id: str
    message: str


class Evicted(_Msg):
    """A dispatched request stopped without finishing: evicted on the coordinator's order, or
    its engine failed or restarted (``reason``). ``output_token_ids`` is everything generated so
    far (earlier attempts included); the coordinator requeues the request to resume after it."""

    type: Literal["evicted"] = "evicted"
    agent_id: str
    instance_id: str
    dispatch_id: str
    request_id: str
    output_token_ids: list[int] = Field(default_factory=list)
    reason: str = "evicted"


class Goodbye(_Msg):
    """Graceful agent shutdown: requeue whatever the coordinator had sent it and not heard back."""

    type: Literal["goodbye"] = "goodbye"
    agent_id: str


ToCoordinator = Annotated[
    Heartbeat | Pull | Completion | Failure | Evicted | Goodbye, Field(discriminator="type")
]
to_coordinator_adapter: TypeAdapter[ToCoordinator] = TypeAdapter(ToCoordinator)


class ServedModel(_Msg):
    id: str
    # prompt + output tokens a request may have: the smaller of the catalog's max_context and
    # the most a live engine serving it takes (InstanceInfo.max_model_len; the coordinator
    # places a request only on an engine that takes it)
    max_model_len: int
    instances: int  # live instances serving it


class ServedModels(_Msg):
    """What the coordinator serves now, fanned out on ``qlm.models`` to every gateway (their
    ``GET /v1/models``); sent after its start grace, on every change and every
    ``SERVED_MODELS_INTERVAL_S``. A list older than ``valid_s`` is stale (the coordinator is
    gone)."""

    type: Literal["served_models"] = "served_models"
    sent_at: float
    valid_s: float
    models: list[ServedModel]
