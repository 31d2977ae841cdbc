"""Wire protocol v1: the request, result and error messages.

These pydantic models are the single source of truth for the message schema: the JSON Schema
file ``qlm/schemas/protocol-v1.schema.json`` is generated from them (``qlm schema``) and a test
checks that the committed file matches. Producers in any language validate against that file;
the coordinator and agents validate with these classes.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PROTOCOL_VERSION = 1
CONTENT_TYPE = "application/json"
# AMQP header of every reply: unique per reply published (see docs/protocol.md, "The reply")
REPLY_ID_HEADER = "x-qlm-reply-id"

RequestId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@/+=-]+$")]
# A tenant name: printable, no control characters (it becomes a database key, a metric label,
# a broker user and part of a reply queue's name)
TenantName = Annotated[str, Field(max_length=128, pattern=r"^[^\x00-\x1f\x7f]*$")]

# Bounds on every number of a request, checked before anything is tracked: a 400-digit integer
# is valid JSON and a valid Python int, but no float holds it, and deadline arithmetic raised
# OverflowError in the middle of admission.
MAX_SLO_MS = 30 * 24 * 3_600_000  # 30 days, in ms: the longest deadline qlm accepts
MAX_INT32 = 2**31 - 1  # counts the engines take as C ints: max_tokens, top_k, steps
MAX_TOKEN_ID = 2**32 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


class _Strict(BaseModel):
    # allow_inf_nan=False: NaN and ±Infinity (Python's json reads the non-standard literals
    # NaN/Infinity, and 1e400 as inf) are refused in every float field.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class SamplingParams(_Strict):
    """Sampling parameters, passed through to the engine."""

    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=MAX_INT32)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[str] = Field(default_factory=list, max_length=16)
    ignore_eos: bool = False


class SLO(_Strict):
    """Service-level objective. At least one of the two deadlines must be set.

    Deadlines are relative to the request's submission time (``submitted_at`` when the producer
    sets it, otherwise the moment the coordinator first receives the message).
    """

    # The model validator below, restated in JSON Schema so non-Python producers see it too.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["e2e_ms"], "properties": {"e2e_ms": {"type": "integer"}}},
                {"required": ["ttft_ms"], "properties": {"ttft_ms": {"type": "integer"}}},
            ]
        }
    )

    e2e_ms: int | None = Field(
        default=None, gt=0, le=MAX_SLO_MS, description="end-to-end deadline (last token)"
    )
    ttft_ms: int | None = Field(
        default=None, gt=0, le=MAX_SLO_MS, description="time-to-first-token deadline"
    )
    tbt_ms: int | None = Field(
        default=None,
        gt=0,
        le=MAX_SLO_MS,
        description="streaming: mean time between output tokens (after the first) at most this",
    )
    slo_class: str | None = Field(
        default=None, max_length=64, description="free-form class label used in metrics"
    )

    @model_validator(mode="after")
    def _one_deadline(self) -> SLO:
        if self.e2e_ms is None and self.ttft_ms is None:
            raise ValueError("slo needs e2e_ms and/or ttft_ms")
        if self.e2e_ms is not None and self.ttft_ms is not None and self.ttft_ms > self.e2e_ms:
            raise ValueError(
                "slo.ttft_ms is longer than slo.e2e_ms: the first token cannot be due after "
                "the last"
            )
        return self


class TaskInfo(_Strict):
    """The call's place in a multi-call task chain (CATO; qlm/chains.py): its deadline is the
    task's SLA, counted from the task's start, less the expected time of the later steps."""

    task_id: str = Field(min_length=1, max_length=128)
    step: int = Field(default=0, ge=0, le=MAX_INT32)
    task_slo_ms: int | None = Field(
        default=None,
        gt=0,
        le=MAX_SLO_MS,
        description="the whole task's SLA; absent: the call keeps its own SLO",
    )
    task_started_at: float | None = Field(
        default=None, gt=0, description="unix s the task started; absent: this call's submission"
    )
    remaining_ms: int | None = Field(
        default=None,
        ge=0,
        le=MAX_SLO_MS,
        description="expected time of the steps after this one; 0: last step",
    )


class StageInfo(_Strict):
    """The call's place in a collective request (Tempo; qlm/collective.py): a program - a graph
    of LLM calls with one deadline - made of stages whose calls run together. The stage's
    deadline is derived from the program's by matching its graph so far against finished
    programs of the same application; every call of the stage shares it."""

    program_id: str = Field(min_length=1, max_length=128)
    app_type: str = Field(min_length=1, max_length=64, description="the application, e.g. tot")
    stage_id: str = Field(min_length=1, max_length=64)
    after: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=64, description="stage ids this stage comes after"
    )
    program_slo_ms: int | None = Field(
        default=None,
        gt=0,
        le=MAX_SLO_MS,
        description="the whole program's deadline (time to its last token)",
    )
    program_started_at: float | None = Field(
        default=None, gt=0, description="unix s the program started; absent: its first call"
    )
    last_stage: bool = Field(default=False, description="the program's final stage")


class RequestMessage(_Strict):
    """A generation request, as published to the ingress exchange."""

    # The "exactly one prompt" validator below, restated in JSON Schema; an explicit null counts
    # as absent, as it does for pydantic.
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
                {
                    "required": ["prompt_token_ids"],
                    "properties": {"prompt_token_ids": {"type": "array"}},
                },
            ],
            # a task chain's step or a program's stage, not both
            "not": {
                "required": ["task", "stage"],
                "properties": {"task": {"type": "object"}, "stage": {"type": "object"}},
            },
        }
    )

    version: Literal[1] = 1
    request_id: RequestId
    model: str = Field(min_length=1, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = Field(
        default=None, min_length=1
    )
    max_tokens: int = Field(ge=1, le=MAX_INT32)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    slo: SLO
    priority: int = Field(default=0, ge=0, le=9)
    tenant: TenantName | None = None
    submitted_at: float | None = Field(
        default=None,
        ge=0,
        description="producer's wall-clock submission time (unix seconds); the coordinator "
        "refuses one more than 60 s ahead of its clock (submitted_in_future)",
    )
    task: TaskInfo | None = None
    stage: StageInfo | None = None
    stream: bool = Field(
        default=False,
        description="send TokenChunk / TokenBatch messages (AMQP type 'tokens') to reply_to "
        "as tokens are generated, before the one ResultMessage",
    )

    @model_validator(mode="after")
    def _one_prompt(self) -> RequestMessage:
        given = [x for x in (self.prompt, self.messages, self.prompt_token_ids) if x is not None]
        if len(given) != 1:
            raise ValueError("exactly one of prompt, messages, prompt_token_ids is required")
        if self.task is not None and self.stage is not None:
            raise ValueError("a call belongs to a task chain (task) or a program (stage), not both")
        return self

    def prompt_tokens(self) -> int:
        """Prompt length in tokens: exact for token ids, estimated (4 bytes/token) for text."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        if self.prompt is not None:
            text = self.prompt
        else:
            assert self.messages is not None
            text = "\n".join(f"{m.role}: {m.content}" for m in self.messages)
        return max(1, (len(text.encode("utf-8")) + 3) // 4)


class Usage(_Strict):
    prompt_tokens: int
    completion_tokens: int


class Timestamps(_Strict):
    """Wall-clock unix seconds of each step of the request's life."""

    submitted: float
    queued: float
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None


class SLOOutcome(_Strict):
    met: bool
    e2e_met: bool | None = None
    ttft_met: bool | None = None
    e2e_ms: float | None = None
    ttft_ms: float | None = None
    tbt_met: bool | None = None  # null when slo.tbt_ms was not set (or one token only)
    tbt_ms: float | None = None  # measured mean time between output tokens
    # a step of a task chain: e2e_met is judged against its derived deadline; the last step
    # (remaining_ms 0 or absent) also says whether the whole task met its SLA
    task_met: bool | None = None


class ResultMessage(_Strict):
    """The one reply a producer receives for a request that was served."""

    type: Literal["result"] = "result"
    version: Literal[1] = 1
    request_id: str
    model: str
    output_text: str
    output_token_ids: list[int]
    finish_reason: Literal["length", "stop", "abort"]
    usage: Usage
    timestamps: Timestamps
    slo: SLOOutcome
    instance_id: str
    attempts: int = Field(ge=1, description="dispatches it took (more than 1 after a failover)")


# The fields that place tokens in a streamed request's output: a TokenChunk's, and each entry's
# of a TokenBatch.
_ChunkOffset = Annotated[
    int, Field(ge=0, description="index in output_token_ids of the first token here")
]
_ChunkText = Annotated[str, Field(description="the detokenized text of these tokens")]
_ChunkAttempt = Annotated[int | None, Field(ge=1, description="the dispatch that sent it")]


class TokenChunk(_Strict):
    """Tokens of a streamed request (``stream: true``) as they are generated: transient and
    best effort, published by the agent running the request straight to the reply route. The
    ResultMessage that follows is the durable answer and carries the whole output, so a
    consumer that missed chunks (an agent died, the broker dropped them) fills the gap from it.
    Chunks can repeat or overlap (a request resumed elsewhere starts again at its resume
    point): ``offset`` says where in the output they belong. Its request is the one the AMQP
    ``correlation_id`` names."""

    type: Literal["tokens"] = "tokens"
    version: Literal[1] = 1
    request_id: str
    offset: _ChunkOffset
    token_ids: list[int]
    text: _ChunkText = ""
    attempt: _ChunkAttempt = None


class BatchedChunk(_Strict):
    """One entry of a TokenBatch: a TokenChunk's fields and the correlation id of the reply
    route it is for (the message's AMQP ``correlation_id`` cannot name several requests)."""

    correlation_id: str | None = Field(
        min_length=1,
        description="the reply route's correlation id, as on its reply; null where the request "
        "was published without one (its reply has none either: match by request_id)",
    )
    request_id: str
    offset: _ChunkOffset
    token_ids: list[int]
    text: _ChunkText = ""
    attempt: _ChunkAttempt = None


class TokenBatch(_Strict):
    """The token chunks of several streamed requests whose producers share one reply queue, in
    one message: an agent sends, per flush, one message per reply queue instead of one per
    request. ``chunks`` of one request keep the order they were cut in (increasing offsets
    within an attempt); each is read exactly as a TokenChunk with its ``correlation_id``."""

    type: Literal["tokens_batch"] = "tokens_batch"
    version: Literal[1] = 1
    chunks: list[BatchedChunk] = Field(min_length=1)


class ErrorCode(StrEnum):
    INVALID_JSON = "invalid_json"
    INVALID_ENCODING = "invalid_encoding"
    INVALID_CONTENT_TYPE = "invalid_content_type"
    BODY_TOO_LARGE = "body_too_large"
    SCHEMA_VIOLATION = "schema_violation"
    UNKNOWN_MODEL = "unknown_model"
    # a catalog model no live agent serves (after the coordinator's hold, if one is set)
    MODEL_NOT_SERVED = "model_not_served"
    MAX_TOKENS_OUT_OF_RANGE = "max_tokens_out_of_range"
    PROMPT_TOO_LONG = "prompt_too_long"
    OVERLOADED = "overloaded"
    ENGINE_ERROR = "engine_error"
    DELIVERY_LIMIT = "delivery_limit"
    CANCELLED = "cancelled"
    INVALID_GRAPH = "invalid_graph"
    INTERNAL_ERROR = "internal_error"
    # hostile input (docs/protocol.md, "Errors")
    INVALID_PROPERTY = "invalid_property"
    SUBMITTED_IN_FUTURE = "submitted_in_future"
    # producer identity (docs/reliability.md, "Threat model")
    INVALID_REPLY_TO = "invalid_reply_to"
    IDENTITY_REQUIRED = "identity_required"
    TENANT_MISMATCH = "tenant_mismatch"
    DUPLICATE_REQUEST_ID = "duplicate_request_id"


class ErrorMessage(_Strict):
    """The one reply a producer receives for a request that cannot be served."""

    type: Literal["error"] = "error"
    version: Literal[1] = 1
    request_id: str | None
    code: ErrorCode
    message: str
    details: dict[str, Any] | None = None


class CancelMessage(_Strict):
    """Withdraw a request: published to the ingress exchange like the request, with the same
    routing key (its ``request_id``), so it reaches the same shard after it. The request's
    producer then receives exactly one reply: a ``cancelled`` ErrorMessage if the request was
    still queued or could be stopped, or its result if it finished first. The cancel itself
    gets no reply."""

    type: Literal["cancel"] = "cancel"
    version: Literal[1] = 1
    request_id: RequestId
    reason: str | None = Field(default=None, max_length=256)
    # the tenant of the request to cancel: a cancel is honoured only from the request's own
    # tenant (with QLM_PRODUCER_IDENTITY=broker the broker-verified user, not this field)
    tenant: TenantName | None = None


def protocol_json_schema() -> dict[str, Any]:
    """The JSON Schema of protocol v1 (request, cancel, result, error, token chunks), as
    committed."""
    from pydantic.json_schema import models_json_schema

    _, defs = models_json_schema(
        [
            (RequestMessage, "validation"),
            (CancelMessage, "validation"),
            (ResultMessage, "serialization"),
            (ErrorMessage, "serialization"),
            (TokenChunk, "serialization"),
            (TokenBatch, "serialization"),
        ],
        title="qlm wire protocol v1",
    )
    defs["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    defs["$id"] = "https://qlm.dev/schemas/protocol-v1.schema.json"
    defs["description"] = (
        "Generated from qlm/types.py by `qlm schema`. Publish a RequestMessage to the ingress "
        "exchange; receive exactly one ResultMessage or ErrorMessage on reply_to (before it, "
        "TokenChunk and TokenBatch messages when the request asked to stream). A CancelMessage "
        "on the same exchange withdraws a request."
    )
    defs["oneOf"] = [
        {"$ref": "#/$defs/RequestMessage"},
        {"$ref": "#/$defs/CancelMessage"},
        {"$ref": "#/$defs/ResultMessage"},
        {"$ref": "#/$defs/ErrorMessage"},
        {"$ref": "#/$defs/TokenChunk"},
        {"$ref": "#/$defs/TokenBatch"},
    ]
    return defs
