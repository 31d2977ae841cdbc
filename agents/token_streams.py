"""Per-token streams from the agent straight to the producer (``stream: true`` requests).

The engine reports :class:`TokenDelta`s from its own loop; this module buffers them per
request and publishes them every few milliseconds (or at once for a request's first tokens,
whose latency is the client's TTFT, or when a buffer reaches its size cap). One flush sends
one message per reply queue, not one per request: a gateway's streams all share its reply
queue, and at 50 streams one AMQP message per chunk cost the agent and the gateway more CPU
than the tokens themselves. A queue with one chunk due gets a plain
:class:`qlm.types.TokenChunk`, one with several a :class:`qlm.types.TokenBatch`
(docs/protocol.md, "Token streams").

Chunks are transient and best effort: no publisher confirm, not persistent, a failed publish
is logged and dropped. Each message is also routed, by the same publish, to the coordinator's
stream tap (``BCC``), so that a request whose agent dies resumes after the tokens its producer
has. The one durable, exactly-once answer is still the coordinator's
ResultMessage, which carries the whole output, so a consumer fills any gap from it
(qlm/streaming.py). Publishing never blocks the engine: the listener only appends to a
buffer, and one task of its own does the I/O.

A request's last chunk (the one with the engine's final tokens) is held until the agent's
completion report for it is confirmed (:meth:`TokenStreams.release`). A stream's end thus
never reaches anyone before its result is safe: were the agent to die in between, its
producer would hold a whole answer that no durable result backs, and the request, run again
(from scratch, since resuming after an answer's end would generate past it), could answer
otherwise (sampling). Held back, the producer has a prefix, and the next attempt continues
after it. It costs the last tokens one confirm round trip; the stream's consumer ends it at
the result, which mostly comes later still (where it overtakes them, the consumer drops them
as late: the result carries their tokens).

An agent that was silent past the coordinator's heartbeat timeout (hung, stopped, cut off)
has been declared lost, and its requests moved: each resumed elsewhere after the tokens its
producer had. Its engine goes on when it wakes, and chunks of those old attempts would then
contradict the new ones. So the streams fence themselves (``fence_after_s``): when the gap
between two heartbeats the agent got out, or since the last one, passes it, every stream
open at that moment is dropped unsent (its results still reach the coordinator, which takes
a late result only where it agrees with what was streamed). Streams of later dispatches flow
again. An agent whose connection came back fences its streams too: it tells the coordinator
(a goodbye), which moves every attempt it was running.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Any

import aio_pika
import structlog
from aio_pika.abc import AbstractChannel, AbstractRobustConnection

from qlm.agents.engine import TokenDelta
from qlm.control import Dispatch, ReplyRoute
from qlm.streaming import encode_token_message
from qlm.topology import STREAM_END_HEADER, STREAM_TAP_QUEUE
from qlm.types import CONTENT_TYPE, BatchedChunk

log = structlog.get_logger(__name__)

FLUSH_INTERVAL_S = 0.005  # how long tokens wait to be batched into one chunk
MAX_CHUNK_TOKENS = 64  # a buffer this full is sent without waiting for the interval
# Chunks in one TokenBatch at most: a backlog (after a reconnect) goes out in messages of a
# size the broker and the consumer handle without a stall (~100 bytes a chunk).
MAX_BATCH_CHUNKS = 256
# A chunk nobody consumes (the producer went away, its durable reply queue stays) expires
# instead of piling up: it is only useful while the request runs.
CHUNK_TTL_MS = 60_000
# Chunks waiting for the publisher (it is stuck while the connection is down); beyond this the
# oldest are dropped: the results still carry their tokens.
MAX_OUTBOX = 10_000
# The AMQP type of every token-stream message, either shape: it says "not a reply" to
# consumers that predate TokenBatch, which then drop a batch as a stray chunk (the result
# still carries its tokens) instead of taking it for a malformed reply.
TOKENS_TYPE = "tokens"


@dataclass(frozen=True)
class _Cut:
    """A chunk cut from a stream's buffer, waiting to be published to each of its routes."""

    routes: list[ReplyRoute]
    request_id: str
    offset: int
    token_ids: list[int]
    text: str
    attempt: int
    final: bool = False  # it carries the request's last tokens


@dataclass
class _Stream:
    routes: list[ReplyRoute]
    attempt: int
    offset: int = 0  # output index of the first buffered token
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    sent_any: bool = False
    final: bool = False  # the engine finished it: the buffered tokens are its last
    # the output its producer has been sent, from offset 0: the dispatch's resume tokens
    # (earlier attempts streamed them), then this attempt's chunks as their publishes
    # succeed, while they follow on (a dropped chunk leaves a gap: the prefix stops there)
    published: list[int] = field(default_factory=list)


class TokenStreams:
    """Buffers and publishes the token chunks of the streamed requests an agent runs."""

    def __init__(
        self,
        *,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        max_chunk_tokens: int = MAX_CHUNK_TOKENS,
        fence_after_s: float | None = None,
        log_context: structlog.typing.FilteringBoundLogger | None = None,
    ) -> None:
        self.flush_interval_s = flush_interval_s
        self.max_chunk_tokens = max_chunk_tokens
        # silent this long, the agent may have been declared lost (module docstring); None:
        # never fenced
        self.fence_after_s = fence_after_s
        self._alive_at = time.monotonic()  # when the agent's last heartbeat went out
        self._streams: dict[str, _Stream] = {}
        # chunks cut and waiting for the publisher, in order; a stream's first chunk waits
        # apart and goes ahead of the others' (it is its client's TTFT, and, being its
        # request's first, it overtakes nothing of its own)
        self._outbox: list[_Cut] = []
        self._first: list[_Cut] = []
        # each request's last chunk, until its result is confirmed (module docstring)
        self._held: dict[str, _Cut] = {}
        self._dirty = asyncio.Event()
        self._urgent = asyncio.Event()
        self._conn: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._task: asyncio.Task[None] | None = None
        self.log = log_context or log
        self.published = 0  # chunks, one per route
        self.messages = 0  # AMQP messages they went out in
        self.publish_failures = 0  # chunks dropped
        self.fenced = 0  # streams dropped by a fence

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
        self._held.clear()

    # ---- what the agent tells it

    def open(self, dispatch: Dispatch) -> None:
        """A dispatch started: stream its tokens if its producer asked to (a new attempt at
        the same request replaces the old one's stream)."""
        rid = dispatch.request.request_id
        if not dispatch.request.stream or not dispatch.reply_routes:
            self._streams.pop(rid, None)
            return
        self._streams[rid] = _Stream(
            routes=list(dispatch.reply_routes),
            attempt=dispatch.attempt,
            published=list(dispatch.resume_token_ids),
        )

    def close(self, request_id: str) -> None:
        """The request finished or left this agent: what is buffered still goes out (it
        keeps the stream smooth up to the result, and spares a resumed attempt's consumer a
        gap), then nothing more is taken for it."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream.token_ids:
            self._cut(request_id, stream)
            self._urgent.set()
            self._dirty.set()

    def heartbeat_sent(self, now: float | None = None) -> None:
        """The agent's heartbeat went out: after a gap past the fence, first drop the streams
        of the attempts the coordinator may have moved (module docstring)."""
        now = time.monotonic() if now is None else now
        self._fence_if_lapsed(now)
        self._alive_at = now

    def _fence_if_lapsed(self, now: float) -> None:
        if self.fence_after_s is not None and now - self._alive_at > self.fence_after_s:
            self.fence(f"silent {now - self._alive_at:.3f} s")
            self._alive_at = now  # fenced once per gap: later dispatches stream again

    def fence(self, reason: str) -> None:
        """Drop every stream open now, unsent: the coordinator moved (or may have moved) the
        attempts they belong to (module docstring). Streams of later dispatches flow."""
        dropped = list(self._streams)
        if dropped:
            self.fenced += len(dropped)
            self.log.warning(
                "token_streams_fenced",
                reason=reason,
                streams=len(dropped),
                request_ids=sorted(dropped)[:10],
            )
        self._streams.clear()
        self._outbox.clear()
        self._first.clear()
        self._held.clear()

    def release(self, request_id: str, *, final: bool) -> None:
        """The request's report is confirmed: its held last chunk goes out, as its stream's
        end where ``final`` (a completion), else as plain tokens (the attempt was evicted or
        failed: its report carries them, and the request goes on elsewhere)."""
        cut = self._held.pop(request_id, None)
        if cut is None:
            return
        if not final:
            cut = replace(cut, final=False)
        self._outbox.append(cut)
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
        stream.final = stream.final or delta.final
        if not stream.sent_any or len(stream.token_ids) >= self.max_chunk_tokens:
            # the first tokens are the client's TTFT: no batching delay for them
            self._urgent.set()
        self._dirty.set()

    def streaming(self, request_id: str) -> bool:
        return request_id in self._streams

    async def resync(self, request_ids: list[str]) -> int:
        """A coordinator that took over asks what these requests' producers have: each open
        stream's published prefix goes to its stream tap alone, one message per request, as
        a chunk at offset 0 (its reassembler takes what it lacks of it). Returns the
        messages sent. Best effort, like every chunk: the coordinator then resumes a request
        lost with this agent after what its producer has, not from its last resume point."""
        sent = 0
        for rid in dict.fromkeys(request_ids):
            stream = self._streams.get(rid)
            if stream is None or not stream.published:
                continue
            body, correlation_id = encode_token_message(
                [
                    BatchedChunk(
                        correlation_id=None,
                        request_id=rid,
                        offset=0,
                        token_ids=list(stream.published),
                        text="",
                        attempt=stream.attempt,
                    )
                ]
            )
            try:
                await self._send(body, correlation_id, STREAM_TAP_QUEUE)
                sent += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.log.warning("stream_resync_failed", request_id=rid, error=repr(exc))
        self.log.info("streams_resynced", requested=len(request_ids), sent=sent)
        return sent

    def _published(self, group: list[tuple[str | None, _Cut]]) -> None:
        """These cuts reached the broker: their tokens extend their streams' published
        prefix where they follow on (a cut goes once per route; the first counts)."""
        for _, cut in group:
            stream = self._streams.get(cut.request_id)
            if (
                stream is not None
                and stream.attempt == cut.attempt
                and cut.offset == len(stream.published)
            ):
                stream.published.extend(cut.token_ids)

    # ---- publishing

    def _cut(self, request_id: str, stream: _Stream) -> None:
        cut = _Cut(
            routes=stream.routes,
            request_id=request_id,
            offset=stream.offset,
            token_ids=stream.token_ids,
            text="".join(stream.text),
            attempt=stream.attempt,
            final=stream.final,
        )
        if cut.final:
            earlier = self._held.pop(request_id, None)
            if earlier is not None:  # never two ends; should one come, the older is tokens
                self._outbox.append(replace(earlier, final=False))
            self._held[request_id] = cut
        else:
            (self._outbox if stream.sent_any else self._first).append(cut)
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
            self._fence_if_lapsed(time.monotonic())
            for rid, stream in self._streams.items():
                if stream.token_ids:
                    self._cut(rid, stream)
            cuts = self._first + self._outbox
            self._first, self._outbox = [], []
            for reply_to, group in _by_reply_queue(cuts).items():
                for i in range(0, len(group), MAX_BATCH_CHUNKS):
                    await self._publish(reply_to, group[i : i + MAX_BATCH_CHUNKS])

    async def _publish(self, reply_to: str, group: list[tuple[str | None, _Cut]]) -> None:
        """One message to ``reply_to`` with ``group``'s chunks (qlm.streaming's encoding: a
        TokenChunk for a lone chunk, else a TokenBatch)."""
        body, correlation_id = encode_token_message(
            [
                BatchedChunk(
                    correlation_id=cid,
                    request_id=cut.request_id,
                    offset=cut.offset,
                    token_ids=cut.token_ids,
                    text=cut.text,
                    attempt=cut.attempt,
                )
                for cid, cut in group
            ]
        )
        # the coordinator's copy (qlm.topology.STREAM_TAP_QUEUE): routed with the producer's by
        # the same publish, so it follows exactly what the producer can receive (BCC is
        # stripped before delivery); and which requests' last tokens this carries, so that it
        # never resumes one after its end
        headers: dict[str, Any] = {"BCC": [STREAM_TAP_QUEUE]}
        ended = [cut.request_id for _, cut in group if cut.final]
        if ended:
            headers[STREAM_END_HEADER] = ended
        try:
            await self._send(body, correlation_id, reply_to, headers)
            self.published += len(group)
            self.messages += 1
            self._published(group)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # best effort: the results carry every token, so the chunks are dropped
            self.publish_failures += len(group)
            self.log.warning(
                "token_chunk_publish_failed",
                reply_to=reply_to,
                request_ids=sorted({cut.request_id for _, cut in group})[:10],
                chunks=len(group),
                error=repr(exc),
            )

    async def _send(
        self,
        body: bytes,
        correlation_id: str | None,
        routing_key: str,
        headers: dict[str, Any] | None = None,
    ) -> None:
        """One token message: transient, expiring, not mandatory (a producer that went away
        loses its chunks, no more)."""
        channel = await self._ensure_channel()
        await channel.default_exchange.publish(
            aio_pika.Message(
                body,
                content_type=CONTENT_TYPE,
                correlation_id=correlation_id,
                type=TOKENS_TYPE,
                delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
                expiration=CHUNK_TTL_MS / 1000,
                headers=headers,
            ),
            routing_key=routing_key,
            mandatory=False,
        )

    async def _ensure_channel(self) -> AbstractChannel:
        channel = self._channel
        if channel is None or channel.is_closed:
            # e.g. the broker closed it over a bad reply route: a fresh one for the next chunk
            assert self._conn is not None
            channel = self._channel = await self._conn.channel(publisher_confirms=False)
        return channel


def _by_reply_queue(cuts: list[_Cut]) -> dict[str, list[tuple[str | None, _Cut]]]:
    """The cuts' (correlation id, cut) pairs grouped by reply queue: the queues in the order
    their first chunk was cut (so first chunks, cut ahead, go out first), each queue's pairs
    in cut order (a request's chunks keep their order)."""
    groups: dict[str, list[tuple[str | None, _Cut]]] = {}
    for cut in cuts:
        for route in cut.routes:
            groups.setdefault(route.reply_to, []).append((route.correlation_id, cut))
    return groups
