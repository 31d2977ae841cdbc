"""Server-sent events of a streamed call (``stream: true``), as vLLM and OpenAI send them.

One chunk per piece of the request's token stream (:class:`qlm.client.TokenStream`: each
output token once, in order, whatever failovers did), ``text`` for ``/v1/completions`` and
``delta.content`` for ``/v1/chat/completions`` (whose first chunk carries the role); then a
chunk with the ``finish_reason``; with ``stream_options.include_usage`` a last chunk with
empty ``choices`` and the ``usage``; then ``data: [DONE]``. An error after the stream began
(the request failed, or the gateway's timeout passed) cannot change the HTTP status any
more: it is sent as an ``{"error": ...}`` event before ``[DONE]``, as vLLM does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal

from pydantic import BaseModel

from qlm.client import StreamPiece
from qlm.gateway.openai_types import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    FinishReason,
    QlmInfo,
    UsageOut,
)
from qlm.types import ResultMessage

DONE = b"data: [DONE]\n\n"

# the next piece of the stream (None: it ended), or an exception to report
NextPiece = Callable[[], Awaitable[StreamPiece | None]]


def sse(payload: BaseModel) -> bytes:
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


class SseRenderer:
    """Builds the chunks of one call."""

    def __init__(self, kind: Literal["completion", "chat"], public_id: str, model: str) -> None:
        self.kind = kind
        self.public_id = public_id
        self.model = model
        self.created = int(time.time())

    def text(self, text: str, reason: FinishReason | None = None) -> bytes:
        if self.kind == "completion":
            return sse(
                CompletionResponse(
                    id=self.public_id,
                    created=self.created,
                    model=self.model,
                    choices=[CompletionChoice(text=text, finish_reason=reason)],
                )
            )
        delta = ChatDelta(content=text) if text or reason is None else ChatDelta()
        return self._chat(delta, reason)

    def role(self) -> bytes:
        return self._chat(ChatDelta(role="assistant", content=""), None)

    def usage(self, usage: UsageOut, info: QlmInfo) -> bytes:
        if self.kind == "completion":
            return sse(
                CompletionResponse(
                    id=self.public_id,
                    created=self.created,
                    model=self.model,
                    choices=[],
                    usage=usage,
                    qlm=info,
                )
            )
        return sse(
            ChatCompletionChunk(
                id=self.public_id,
                created=self.created,
                model=self.model,
                choices=[],
                usage=usage,
                qlm=info,
            )
        )

    def _chat(self, delta: ChatDelta, reason: FinishReason | None) -> bytes:
        return sse(
            ChatCompletionChunk(
                id=self.public_id,
                created=self.created,
                model=self.model,
                choices=[ChatChunkChoice(delta=delta, finish_reason=reason)],
            )
        )


def error_event(message: str, type_: str, code: str) -> bytes:
    return sse(ErrorResponse(error=ErrorDetail(message=message, type=type_, code=code)))


async def stream_events(
    render: SseRenderer,
    first: StreamPiece,
    next_piece: NextPiece,
    *,
    include_usage: bool,
    finish: Callable[[ResultMessage], tuple[FinishReason, UsageOut, QlmInfo]],
) -> AsyncIterator[bytes]:
    """The events of a stream whose first piece has come; errors from ``next_piece``
    propagate (the caller turns them into an error event)."""
    if render.kind == "chat":
        yield render.role()
    piece: StreamPiece | None = first
    while piece is not None:
        if piece.text:
            yield render.text(piece.text)
        if piece.result is not None:
            reason, usage, info = finish(piece.result)
            yield render.text("", reason)
            if include_usage:
                yield render.usage(usage, info)
            return
        piece = await next_piece()
