"""The subset of the OpenAI HTTP API that the gateway speaks, as pydantic models.

Requests are parsed with these models and then turned into qlm ``RequestMessage``s. Fields that
OpenAI defines but qlm cannot honour (``n > 1``, ``logprobs``, tools, images, ``echo``, ...)
are rejected with a 400 rather than silently ignored, so a client never gets an answer to a
different question than the one it asked. Fields qlm has no use for but that do not change the
answer (``user``, ``metadata``, ``presence_penalty`` of 0, ...) are accepted and dropped:
official clients send some of them by default.

The ``qlm_*`` fields are qlm's extensions, sent with the OpenAI clients' ``extra_body``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

# OpenAI's own limits where it documents them; qlm's where they are tighter.
_MAX_STOPS = 4
_SLO_MS = Annotated[int, Field(gt=0, le=7 * 24 * 3_600_000)]

# OpenAI's service_tier -> qlm SLO class (docs/gateway.md, "Priority and service tier"): the
# standard tiers are interactive work, flex is OpenAI's cheaper, slower tier: qlm's batch class.
SERVICE_TIER_CLASSES: dict[str, str] = {
    "auto": "interactive",
    "default": "interactive",
    "flex": "batch",
}

# OpenAI fields qlm cannot honour, and the values of each that ask for nothing qlm lacks.
_ACCEPTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "echo": (False,),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
}


def _only_accepted(value: Any, info: ValidationInfo) -> Any:
    accepted = _ACCEPTED[str(info.field_name)]
    if value not in accepted:
        shown = " or ".join(json.dumps(a) for a in accepted)
        raise ValueError(f"not supported by qlm (send {shown}, or leave it out)")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    include_usage: bool | None = None


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers (vLLM, TGI) do: clients and SDKs
    # add new optional fields faster than any server follows. The ones that would change the
    # answer are named below and refused.
    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str = Field(min_length=1, max_length=256)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    # vLLM's scheduling priority: any integer, lower is served earlier, default 0
    priority: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)
    service_tier: str | None = None

    # qlm extensions (extra_body): the SLO and scheduling hints. Header equivalents exist
    # (x-qlm-slo-ms, ...); a body field wins over its header.
    qlm_slo_ms: _SLO_MS | None = None
    qlm_ttft_ms: _SLO_MS | None = None
    qlm_tbt_ms: _SLO_MS | None = None  # streaming: mean time between tokens
    qlm_slo_class: str | None = Field(default=None, max_length=64)
    qlm_priority: int | None = Field(default=None, ge=0, le=9)
    qlm_top_k: int | None = Field(default=None, ge=-1)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > _MAX_STOPS:
            raise ValueError(f"at most {_MAX_STOPS} stop sequences")
        return value

    @field_validator("service_tier")
    @classmethod
    def _known_tier(cls, value: str | None) -> str | None:
        if value is not None and value not in SERVICE_TIER_CLASSES:
            shown = ", ".join(SERVICE_TIER_CLASSES)
            raise ValueError(f"{value!r} is not supported by qlm (send {shown}, or leave it out)")
        return value

    _unsupported = field_validator(
        "n", "logprobs", "logit_bias", "presence_penalty", "frequency_penalty"
    )(_only_accepted)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)


class CompletionRequest(_Request):
    """``POST /v1/completions``. One prompt per call: a string, a list of token ids, or a
    list holding exactly one of those."""

    prompt: str | list[Annotated[int, Field(ge=0)]] | list[str] | list[list[int]]
    # OpenAI's default for the legacy completions endpoint.
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    _unsupported_completion = field_validator("echo", "best_of", "suffix")(_only_accepted)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(
        cls, p: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(p, str):
            return p
        if not p or (isinstance(p[0], list) and not p[0]):
            raise ValueError("must not be empty")
        if not isinstance(p[0], int) and len(p) != 1:
            raise ValueError("one prompt per request (batched prompts are not supported)")
        return p

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids), unwrapped from a one-element list."""
        p = self.prompt
        if isinstance(p, str):
            return p
        first = p[0]
        if isinstance(first, int):
            return [x for x in p if isinstance(x, int)]
        return list(first) if isinstance(first, list) else first


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    # "developer" is OpenAI's newer name for "system"; qlm's wire protocol knows "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Content parts other than text (images, audio, files) fail validation: qlm serves text.
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Any = None

    @model_validator(mode="after")
    def _text_only(self) -> ChatMessageIn:
        if self.tool_calls:
            raise ValueError("tool_calls: not supported")
        # null (or absent) content is OpenAI's for an assistant turn that only calls tools,
        # which qlm does not serve: refused, not sent on as an empty message
        if self.content is None:
            raise ValueError("content: must be a string or a list of text parts, not null")
        return self

    def text(self) -> str:
        if self.content is None:  # refused by _text_only; kept for the type checker
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def wire_role(self) -> Literal["system", "user", "assistant", "tool"]:
        return "system" if self.role == "developer" else self.role


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    # The newer name for max_tokens; either may be sent, not both with different values.
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    top_logprobs: int | None = None

    _unsupported_chat = field_validator("tools", "functions", "tool_choice", "top_logprobs")(
        _only_accepted
    )

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise ValueError("only {'type': 'text'} is supported by qlm")
        return value

    @model_validator(mode="after")
    def _one_max_tokens(self) -> ChatCompletionRequest:
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise ValueError("max_tokens and max_completion_tokens disagree")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# --- responses ---------------------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class UsageOut(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class QlmInfo(_Out):
    """qlm's own facts about the answer, as an extra top-level ``qlm`` field (OpenAI clients
    keep unknown fields: ``response.model_extra["qlm"]``)."""

    request_id: str
    instance_id: str
    attempts: int
    slo_met: bool
    e2e_ms: float | None = None
    ttft_ms: float | None = None
    tbt_ms: float | None = None
    queue_ms: float | None = None


FinishReason = Literal["stop", "length"]


class CompletionChoice(_Out):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut | None = None
    qlm: QlmInfo | None = None


class ChatMessageOut(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Out):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut
    qlm: QlmInfo | None = None


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Out):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageOut | None = None
    qlm: QlmInfo | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "qlm"
    # vLLM's extension: prompt + output tokens the model accepts (here: the smallest of the
    # catalog's max_context and what the live engines serving it report)
    max_model_len: int | None = None


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    error: ErrorDetail
