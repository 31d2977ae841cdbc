"""Per-token streams from the agent straight to the producer (``stream: true`` requests).

The engine reports :class:`TokenDelta`s from its own loop; this module buffers them per
request and publishes them as :class:`qlm.types.TokenChunk` messages every few milliseconds
(or at once for a request's first tokens, whose latency is the client's TTFT, or when a
buffer reaches its size cap). Chunks are transient and best effort: no publisher confirm, not
persistent, a failed publish is logged and dropped. The one durable, exactly-once answer is
still the coordinator's ResultMessage, which carries the whole output, so a consumer fills
any gap from it (qlm/streaming.py). Publishing never blocks the engine: the listener only
appends to a buffer, and one task of its own does the I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import aio_pika
import structlog
from aio_pika.abc import AbstractChannel, AbstractRobustConnection

from qlm.agents.engine import TokenDelta
from qlm.control import Dispatch, ReplyRoute
from qlm.types import CONTENT_TYPE, TokenChunk

log = structlog.get_logger(__name__)

FLUSH_INTERVAL_S = 0.005  # how long tokens wait to be batched into one chunk
MAX_CHUNK_TOKENS = 64  # a buffer this full is sent without waiting for the interval
# A chunk nobody consumes (the producer went away, its durable reply queue stays) expires
# instead of piling up: it is only useful while the request runs.
CHUNK_TTL_MS = 60_000
# Chunks waiting for the publisher (it is stuck while the connection is down); beyond this the
# oldest are dropped: the results still carry their tokens.
MAX_OUTBOX = 10_000


@dataclass
class _Stream:
    routes: list[ReplyRoute]
    attempt: int
    offset: int = 0  # output index of the first buffered token
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    sent_any: bool = False


class TokenStreams:
    """Buffers and publishes the token chunks of the streamed requests an agent runs."""

    def __init__(
        self,
        *,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        max_chunk_tokens: int = MAX_CHUNK_TOKENS,
        log_context: structlog.typing.FilteringBoundLogger | None = None,
    ) -> None:
        self.flush_interval_s = flush_interval_s
        self.max_chunk_tokens = max_chunk_tokens
        self._streams: dict[str, _Stream] = {}
        # chunks cut and waiting for the publisher, in order: (routes, chunk); a stream's
        # first chunk waits apart and goes ahead of the others' (it is its client's TTFT,
        # and, being its request's first, it overtakes nothing of its own)
        self._outbox: list[tuple[list[ReplyRoute], TokenChunk]] = []
        self._first: list[tuple[list[ReplyRoute], TokenChunk]] = []
        self._dirty = asyncio.Event()
        self._urgent = asyncio.Event()
        self._conn: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._task: asyncio.Task[None] | None = None
        self.log = log_context or log
        self.published = 0
        self.publish_failures = 0

    async def start(self, conn: AbstractRobustConnection) -> None:
        self._conn = conn
        # no confirms: a chunk is not worth a round trip, the result carries everything
        self._channel = await conn.channel(publisher_confirms=False)
        self._task = asyncio.create_task(self._publisher(), name="agent-token-streams")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = None
        self._streams.clear()
        self._outbox.clear()
        self._first.clear()

    # ---- what the agent tells it

    def open(self, dispatch: Dispatch) -> None:
        """A dispatch started: stream its tokens if its producer asked to (a new attempt at
        the same request replaces the old one's stream)."""
        rid = dispatch.request.request_id
        if not dispatch.request.stream or not dispatch.reply_routes:
            self._streams.pop(rid, None)
            return
        self._streams[rid] = _Stream(routes=list(dispatch.reply_routes), attempt=dispatch.attempt)

    def close(self, request_id: str) -> None:
        """The request finished or left this agent: what is buffered still goes out (it
        keeps the stream smooth up to the result, and spares a resumed attempt's consumer a
        gap), then nothing more is taken for it."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream.token_ids:
            self._cut(request_id, stream)
            self._urgent.set()
            self._dirty.set()

    def on_delta(self, delta: TokenDelta) -> None:
        """The engine's token listener: called from the engine's loop, so it only buffers."""
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return  # not a streamed request (or it already finished here)
        if stream.token_ids and delta.offset != stream.offset + len(stream.token_ids):
            self._cut(delta.request_id, stream)  # not contiguous: a chunk of its own
        if not stream.token_ids:
            stream.offset = delta.offset
        stream.token_ids.extend(delta.token_ids)
        stream.text.append(delta.text)
        if not stream.sent_any or len(stream.token_ids) >= self.max_chunk_tokens:
            # the first tokens are the client's TTFT: no batching delay for them
            self._urgent.set()
        self._dirty.set()

    def streaming(self, request_id: str) -> bool:
        return request_id in self._streams

    # ---- publishing

    def _cut(self, request_id: str, stream: _Stream) -> None:
        chunk = TokenChunk(
            request_id=request_id,
            offset=stream.offset,
            token_ids=stream.token_ids,
            text="".join(stream.text),
            attempt=stream.attempt,
        )
        (self._outbox if stream.sent_any else self._first).append((stream.routes, chunk))
        if len(self._outbox) > MAX_OUTBOX:
            del self._outbox[: len(self._outbox) - MAX_OUTBOX]
            self.publish_failures += 1
        stream.offset += len(stream.token_ids)
        stream.token_ids, stream.text = [], []
        stream.sent_any = True

    async def _publisher(self) -> None:
        while True:
            await self._dirty.wait()
            if not self._urgent.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), self.flush_interval_s)
            self._dirty.clear()
            self._urgent.clear()
            for rid, stream in self._streams.items():
                if stream.token_ids:
                    self._cut(rid, stream)
            outbox, self._outbox = self._outbox, []
            for routes, chunk in outbox:
                while self._first:
                    await self._publish(*self._first.pop(0))
                await self._publish(routes, chunk)
            while self._first:
                await self._publish(*self._first.pop(0))

    async def _publish(self, routes: list[ReplyRoute], chunk: TokenChunk) -> None:
        body = chunk.model_dump_json().encode()
        for route in routes:
            try:
                channel = await self._ensure_channel()
                await channel.default_exchange.publish(
                    aio_pika.Message(
                        body,
                        content_type=CONTENT_TYPE,
                        correlation_id=route.correlation_id,
                        type=chunk.type,
                        delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
                        expiration=CHUNK_TTL_MS / 1000,
                    ),
                    routing_key=route.reply_to,
                    mandatory=False,  # a producer that went away loses its chunks, no more
                )
                self.published += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # best effort: the result carries every token, so the chunk is dropped
                self.publish_failures += 1
                self.log.warning(
                    "token_chunk_publish_failed", request_id=chunk.request_id, error=repr(exc)
                )

    async def _ensure_channel(self) -> AbstractChannel:
        channel = self._channel
        if channel is None or channel.is_closed:
            # e.g. the broker closed it over a bad reply route: a fresh one for the next chunk
            assert self._conn is not None
            channel = self._channel = await self._conn.channel(publisher_confirms=False)
        return channel
