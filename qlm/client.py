"""Python producer for the qlm wire protocol.

::

    async with QlmClient("amqp://guest:guest@127.0.0.1:5672/") as client:
        reply = await client.request(RequestMessage(...), timeout=60)

:meth:`QlmClient.submit` returns once the broker has confirmed the request (from then on it is
durable in a quorum queue) and hands back a future that resolves on the one reply. The client
keeps its own books: a second reply for a request is recorded in ``duplicates`` and never
replaces the first, and ``outstanding()`` counts the requests still waiting. The client does
not declare the broker topology; the coordinator does (``ensure_topology`` exists for tests).

:meth:`QlmClient.stream` asks for the output as it is generated (``stream: true``): the agent
running the request sends ``tokens`` messages (a TokenChunk, or a TokenBatch of several
requests' chunks for this reply queue) ahead of the result, and the stream hands each output
token over once, in order, whatever failovers did to the chunks (qlm/streaming.py), ending
with the result.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Annotated, Any, Self

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)
from pydantic import Field, TypeAdapter, ValidationError

from qlm import amqp as qlm_amqp
from qlm.logging import LibraryLogger
from qlm.streaming import Chunk, Reassembler, decode_token_message
from qlm.topology import INGRESS_EXCHANGE, declare_topology
from qlm.types import (
    CONTENT_TYPE,
    REPLY_ID_HEADER,
    SLO,
    CancelMessage,
    ErrorMessage,
    RequestMessage,
    ResultMessage,
)

# silent unless the program configures logging: this module runs in users' programs
log = LibraryLogger(__name__)

Reply = ResultMessage | ErrorMessage
_reply_adapter: TypeAdapter[Reply] = TypeAdapter(
    Annotated[ResultMessage | ErrorMessage, Field(discriminator="type")]
)

# Replies in flight to this client at once; acks are cheap, so a generous window.
_REPLY_PREFETCH = 1000
_TOKENS_TYPE = "tokens"  # the AMQP type property of a TokenChunk and of a TokenBatch
_CHUNK_ACK_EVERY = 64  # token chunks acked at once (multiple), well within the prefetch
_CHUNK_ACK_DELAY_S = 0.05  # a chunk waits at most this long for its ack


def new_request(
    model: str,
    prompt: str | None = None,
    *,
    max_tokens: int = 256,
    e2e_ms: int | None = 60_000,
    ttft_ms: int | None = None,
    slo_class: str | None = None,
    request_id: str | None = None,
    **fields: Any,
) -> RequestMessage:
    """A RequestMessage with a fresh request id (``req-<uuid4 hex>``) unless one is given,
    and an SLO from ``e2e_ms`` / ``ttft_ms``. ``fields``: any other RequestMessage field
    (``messages``, ``prompt_token_ids``, ``tenant``, ``sampling``, ``priority`` ...). The wire
    format keeps its required ``request_id``: the id is what makes a retry idempotent, so
    it is generated here, once, not by the coordinator."""
    slo = SLO(e2e_ms=e2e_ms, ttft_ms=ttft_ms, slo_class=slo_class)
    return RequestMessage(
        request_id=request_id or f"req-{uuid.uuid4().hex}",
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        slo=slo,
        **fields,
    )


class MalformedReply(ValueError):
    """A reply arrived for one of our requests but is not a valid Result/ErrorMessage."""


class StreamError(Exception):
    """A streamed request was answered with an ErrorMessage (``error``)."""

    def __init__(self, error: ErrorMessage) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


@dataclass(frozen=True)
class StreamPiece:
    """Output tokens of a streamed request, from output index ``offset`` on; the last piece
    of a stream carries the request's ``result`` (and whatever output the chunks missed)."""

    offset: int
    token_ids: list[int]
    text: str
    result: ResultMessage | None = None


class TokenStream:
    """One streamed request as seen by its producer: :meth:`next` returns its pieces in
    order, each output token once, then None. Made by :meth:`QlmClient.open_stream`."""

    def __init__(self, client: QlmClient, request_id: str, reply: asyncio.Future[Reply]) -> None:
        self.request_id = request_id
        self.reassembler = Reassembler()
        self._client = client
        self._reply = reply
        # token chunks in arrival order; None: the reply came
        self._inbox: asyncio.Queue[Chunk | None] = asyncio.Queue()
        self._ready: deque[StreamPiece] = deque()
        self.done = False
        self.chunks = 0  # token chunks received

    def _feed(self, chunk: Chunk) -> None:
        self.chunks += 1
        self._inbox.put_nowait(chunk)

    def _take(self, chunk: Chunk) -> None:
        for p in self.reassembler.add(chunk.offset, chunk.token_ids, chunk.text, chunk.attempt):
            self._ready.append(StreamPiece(p.offset, p.token_ids, p.text))

    async def next(self, timeout: float | None = None) -> StreamPiece | None:  # noqa: ASYNC109
        """The next piece; None once the result was handed over. Raises StreamError for an
        error reply, MalformedReply, or TimeoutError (the request stays outstanding)."""
        while not self._ready:
            if self.done:
                return None
            if self._reply.done():
                while not self._inbox.empty():  # chunks that came before the result
                    chunk = self._inbox.get_nowait()
                    if chunk is not None:
                        self._take(chunk)
                if self._ready:
                    break
                return self._finish(self._reply.result())
            if timeout is not None and timeout <= 0:
                raise TimeoutError(f"no reply for {self.request_id!r} in time")
            # asyncio.timeout, not wait_for: no task per chunk
            async with asyncio.timeout(timeout):
                item = await self._inbox.get()
            if item is not None:
                self._take(item)
        return self._ready.popleft()

    def next_ready(self) -> StreamPiece | None:
        """The next piece if the chunks received so far make one deliverable, without
        waiting; None otherwise. Never the result's piece (only :meth:`next` hands that
        over), so a reader may use it to join what is already here into fewer pieces."""
        while not self._ready and not self._inbox.empty():
            # a None is only the wake-up of a reply whose future is already resolved: next()
            # looks at the future before it waits, so taking it here loses nothing
            chunk = self._inbox.get_nowait()
            if chunk is not None:
                self._take(chunk)
        return self._ready.popleft() if self._ready else None

    def _finish(self, reply: Reply) -> StreamPiece:
        self.done = True
        self.close()
        if isinstance(reply, ErrorMessage):
            raise StreamError(reply)
        p = self.reassembler.finish(reply.output_token_ids, reply.output_text)
        return StreamPiece(p.offset, p.token_ids, p.text, reply)

    def close(self) -> None:
        """Stop receiving chunks (the reply is still recorded by the client)."""
        self._client._streams.pop(self.request_id, None)

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> StreamPiece:
        piece = await self.next()
        if piece is None:
            raise StopAsyncIteration
        return piece


class QlmClient:
    """Publishes requests to ``qlm.ingress`` and matches replies by correlation id."""

    def __init__(
        self,
        amqp_url: str,
        *,
        reply_queue: str | None = None,
        app_id: str = "qlm-client",
        republish_within_s: float = 60.0,
    ) -> None:
        """``reply_queue``: a durable queue to receive replies on (it survives this client;
        replies wait there across a restart). Default: a private exclusive, auto-delete queue
        that lives as long as the connection. ``republish_within_s``: how long a publish that
        lost its connection (or was nacked) keeps being retried after reconnects."""
        self.amqp_url = amqp_url
        self.app_id = app_id
        # the broker user this client connects as: sent as the AMQP user_id property, which
        # RabbitMQ checks against the connection's user, so a coordinator with
        # QLM_PRODUCER_IDENTITY=broker knows the tenant for certain (docs/reliability.md)
        self.user_id = qlm_amqp.username_of(amqp_url)
        self.republish_within_s = republish_within_s
        self._durable_replies = reply_queue is not None
        # A client-chosen name (not a server-named amq.gen-*): a robust reconnect re-declares the
        # same name, so replies for requests sent before the reconnect still find us.
        # Under the user's reply prefix (qlm.reply.<user>.), which broker-verified identity
        # requires and per-user permissions can reserve to this user.
        self.reply_queue_name = reply_queue or f"qlm.reply.{self.user_id}.{uuid.uuid4().hex}"
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._ingress: AbstractExchange | None = None
        self._queue: AbstractQueue | None = None
        self._consumer_tag: str | None = None
        self._pending: dict[str, asyncio.Future[Reply]] = {}
        # correlation id -> the request id it was published for (and its tenant): a reply
        # must name that request, and a cancel speaks for the same tenant
        self._request_ids: dict[str, str] = {}
        self._tenants: dict[str, str | None] = {}
        self.reply_counts: Counter[str] = Counter()
        #: correlation id → the second, third ... replies for it (the first resolved the future)
        self.duplicates: dict[str, list[Reply]] = {}
        # broker redeliveries of a reply already recorded (same x-qlm-reply-id): the ack of
        # the first delivery was lost with a connection; not a second answer
        self.redelivered_replies = 0
        self._reply_ids: dict[str, str] = {}
        # ids given up with forget(): a late reply for one is acked and dropped quietly
        self._forgotten: OrderedDict[str, None] = OrderedDict()
        #: replies whose correlation id this client never published
        self.unexpected: list[AbstractIncomingMessage] = []
        #: wall-clock receive time of each request's first reply
        self.received_at: dict[str, float] = {}
        # correlation id -> the open stream of a streamed request (token chunks go there)
        self._streams: dict[str, TokenStream] = {}
        #: token chunks dropped: for no open stream, or not valid
        self.stray_chunks = 0
        #: token-stream messages received (valid ones) and the chunks in them that reached an
        #: open stream: a TokenBatch carries several requests' chunks in one message
        self.token_messages = 0
        self.token_chunks = 0
        self._unacked_chunk: AbstractIncomingMessage | None = None
        self._unacked_chunks = 0
        self._chunk_ack_timer: asyncio.TimerHandle | None = None
        self._ack_tasks: set[asyncio.Future[None]] = set()

    # --- lifecycle ---------------------------------------------------------------------------

    async def connect(self) -> None:
        self._connection = await qlm_amqp.connect(self.amqp_url, name="qlm-client")
        # Unroutable publishes (no shard bound yet) raise instead of vanishing silently.
        self._channel = await self._connection.channel(
            publisher_confirms=True, on_return_raises=True
        )
        await self._channel.set_qos(prefetch_count=_REPLY_PREFETCH)
        # Not declared here: the coordinator owns the topology. Publishing to an exchange that
        # does not exist closes the channel with NOT_FOUND, which surfaces in submit().
        self._ingress = await self._channel.get_exchange(INGRESS_EXCHANGE, ensure=False)
        if self._durable_replies:
            self._queue = await self._channel.declare_queue(self.reply_queue_name, durable=True)
        else:
            self._queue = await self._channel.declare_queue(
                self.reply_queue_name, exclusive=True, auto_delete=True
            )
        self._consumer_tag = await self._queue.consume(self._on_reply, no_ack=False)
        log.debug("client_connected", reply_queue=self.reply_queue_name)

    async def close(self) -> None:
        if self._chunk_ack_timer is not None:
            self._chunk_ack_timer.cancel()
            self._chunk_ack_timer = None
        for fut in self._pending.values():
            if not fut.done():
                fut.cancel()
        if self._connection is not None:
            await self._connection.close()
        self._connection = self._channel = self._ingress = self._queue = None

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def ensure_topology(self, shards: int, delivery_limit: int = 20) -> None:
        """Declare the broker topology (for tests and benchmarks run without a coordinator)."""
        assert self._connection is not None, "not connected"
        # A channel of its own: a declaration that conflicts with existing arguments closes it.
        channel = await self._connection.channel()
        try:
            await declare_topology(channel, shards, delivery_limit=delivery_limit)
        finally:
            await channel.close()

    # --- publishing --------------------------------------------------------------------------

    async def submit(
        self, request: RequestMessage, *, submitted_at: float | None = None
    ) -> asyncio.Future[Reply]:
        """Publish ``request``; return once the broker confirmed it, with a future for the reply.

        Submitting the same request id again publishes it again and returns the same future.

        ``submitted_at`` (unix seconds) is written into the request: its SLO deadlines then count
        from that moment instead of from the coordinator's receipt.
        """
        if submitted_at is not None:
            request = request.model_copy(update={"submitted_at": submitted_at})
        body = request.model_dump_json(exclude_none=True).encode()
        self._request_ids[request.request_id] = request.request_id
        self._tenants[request.request_id] = request.tenant
        return await self._publish(
            body,
            routing_key=request.request_id,
            correlation_id=request.request_id,
            content_type=CONTENT_TYPE,
            headers=None,
        )

    async def open_stream(
        self, request: RequestMessage, *, submitted_at: float | None = None
    ) -> TokenStream:
        """Submit ``request`` asking for its tokens as they come (``stream: true``); returns
        once the broker confirmed it, with the stream to read them from."""
        rid = request.request_id
        if not request.stream:
            request = request.model_copy(update={"stream": True})
        # open before publishing: the first chunk can beat the confirm back to us
        placeholder: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        stream = self._streams[rid] = TokenStream(self, rid, placeholder)
        try:
            stream._reply = await self.submit(request, submitted_at=submitted_at)
        except BaseException:
            stream.close()
            raise
        if stream._reply.done():  # answered before the confirm came back
            stream._inbox.put_nowait(None)
        return stream

    async def stream(
        self,
        request: RequestMessage,
        timeout: float,  # noqa: ASYNC109
    ) -> AsyncIterator[StreamPiece]:
        """Submit ``request`` as a streamed one and yield its output as it is generated: each
        token once, in order; the last piece carries the ResultMessage. Raises StreamError on
        an error reply, TimeoutError when the whole answer takes over ``timeout`` s (the
        request stays outstanding)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        stream = await self.open_stream(request)
        try:
            while (piece := await stream.next(deadline - loop.time())) is not None:
                yield piece
        finally:
            stream.close()

    async def request(self, request: RequestMessage, timeout: float) -> Reply:  # noqa: ASYNC109
        """Submit and wait for the reply; raises TimeoutError (the request stays outstanding)."""
        fut = await self.submit(request)
        # shield: a timeout must not cancel the future, or a late reply would be lost.
        return await asyncio.wait_for(asyncio.shield(fut), timeout)

    async def complete(
        self,
        model: str,
        prompt: str,
        *,
        max_tokens: int = 256,
        e2e_ms: int | None = 60_000,
        timeout: float = 120.0,  # noqa: ASYNC109
        **fields: Any,
    ) -> Reply:
        """``prompt`` to ``model`` and back, no request id or SLO object to build:
        :func:`new_request` makes the request (``fields``: any other RequestMessage field)."""
        req = new_request(model, prompt, max_tokens=max_tokens, e2e_ms=e2e_ms, **fields)
        return await self.request(req, timeout)

    async def cancel(
        self, request_id: str, reason: str | None = None, *, tenant: str | None = None
    ) -> None:
        """Withdraw a submitted request (returns once the broker confirmed the cancel). Its
        future still resolves, exactly once: with a ``cancelled`` error if the request was
        waiting or could be stopped, or with its result if it finished first. The cancel
        speaks for the tenant the request was submitted with (or ``tenant``): the
        coordinator honours it only for a request of that tenant."""
        if self._ingress is None or self._connection is None:
            raise RuntimeError("QlmClient is not connected; use `async with QlmClient(url)`")
        tenant = tenant if tenant is not None else self._tenants.get(request_id)
        body = CancelMessage(request_id=request_id, reason=reason, tenant=tenant).model_dump_json(
            exclude_none=True
        )
        message = aio_pika.Message(
            body.encode(),
            content_type=CONTENT_TYPE,
            content_encoding="utf-8",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=f"cancel-{request_id}",
            timestamp=datetime.now(tz=UTC),
            app_id=self.app_id,
            user_id=self.user_id,
        )
        # the request's routing key: the cancel lands on the request's shard, behind it
        await qlm_amqp.publish_confirmed(
            self._connection,
            self._ingress,
            message,
            request_id,
            within_s=self.republish_within_s,
            renew_on_nack=True,  # a quorum shard's dead leader (docs/reliability.md)
        )

    async def publish_raw(
        self,
        body: bytes,
        *,
        content_type: str | None = CONTENT_TYPE,
        correlation_id: str | None = None,
        headers: dict[str, Any] | None = None,
    ) -> asyncio.Future[Reply]:
        """Publish arbitrary bytes (hostile-input tests). The reply is matched by the
        correlation id (a fresh one when not given), since the body may hold no request id."""
        correlation_id = correlation_id or f"raw-{uuid.uuid4().hex}"
        return await self._publish(
            body,
            routing_key=correlation_id,
            correlation_id=correlation_id,
            content_type=content_type,
            headers=headers,
        )

    async def _publish(
        self,
        body: bytes,
        *,
        routing_key: str,
        correlation_id: str,
        content_type: str | None,
        headers: dict[str, Any] | None,
    ) -> asyncio.Future[Reply]:
        if self._ingress is None:
            raise RuntimeError("QlmClient is not connected; use `async with QlmClient(url)`")
        # Publishing an id again (a retry after an unclear failure) shares the first future: the
        # coordinator answers each request id once.
        existing = self._pending.get(correlation_id)
        fut: asyncio.Future[Reply] = existing or asyncio.get_running_loop().create_future()
        # Registered before publishing: the reply can beat the confirm back to us.
        self._pending[correlation_id] = fut
        message = aio_pika.Message(
            body,
            content_type=content_type,
            content_encoding="utf-8" if content_type == CONTENT_TYPE else None,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=correlation_id,
            correlation_id=correlation_id,
            reply_to=self.reply_queue_name,
            timestamp=datetime.now(tz=UTC),
            app_id=self.app_id,
            user_id=self.user_id,
            headers=headers,
        )
        try:
            assert self._connection is not None
            await qlm_amqp.publish_confirmed(
                self._connection,
                self._ingress,
                message,
                routing_key,
                within_s=self.republish_within_s,
                # RabbitMQ 3.10 can nack a quorum shard on this channel for good after its
                # leader died: reopen the channel (replies consumer restored) and publish again
                renew_on_nack=True,
            )
        except BaseException:
            # Not confirmed: the caller decides whether to retry (a retry with the same id is
            # safe: the coordinator runs and answers each request id once).
            if existing is None:
                del self._pending[correlation_id]
                fut.cancel()
            raise
        return fut

    # --- replies -----------------------------------------------------------------------------

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        try:
            self._record(message)
        finally:
            # Recorded in memory either way; a reply we cannot use must not come back forever.
            if message.type == _TOKENS_TYPE:
                await self._ack_chunk(message)
            else:
                # multiple: the token chunks delivered before it are recorded too (each
                # delivery's callback records it before its first await, in order)
                self._unacked_chunk, self._unacked_chunks = None, 0
                await message.ack(multiple=True)

    async def _ack_chunk(self, message: AbstractIncomingMessage) -> None:
        """Token chunks are acked in batches (an ack per chunk is a socket write per token
        batch, which costs more than the chunk itself): every ``_CHUNK_ACK_EVERY``, with
        the next reply, or after ``_CHUNK_ACK_DELAY_S``."""
        self._unacked_chunk = message
        self._unacked_chunks += 1
        if self._unacked_chunks >= _CHUNK_ACK_EVERY:
            await self._flush_chunk_acks()
        elif self._chunk_ack_timer is None:
            self._chunk_ack_timer = asyncio.get_running_loop().call_later(
                _CHUNK_ACK_DELAY_S, self._chunk_ack_due
            )

    def _chunk_ack_due(self) -> None:
        self._chunk_ack_timer = None
        task = asyncio.ensure_future(self._flush_chunk_acks())
        self._ack_tasks.add(task)
        task.add_done_callback(self._ack_tasks.discard)

    async def _flush_chunk_acks(self) -> None:
        message, self._unacked_chunk, self._unacked_chunks = self._unacked_chunk, None, 0
        if message is None:
            return
        try:
            await message.ack(multiple=True)
        except Exception as exc:  # noqa: BLE001 - e.g. its channel is gone with a reconnect
            log.debug("token_chunk_ack_failed", error=repr(exc))

    def forget(self, correlation_id: str, *, remember: int = 100_000) -> None:
        """Stop tracking a request (its caller gave up: answered, timed out, went away), so a
        long-lived client's books stay bounded. A reply that still comes for it is dropped; the
        last ``remember`` forgotten ids are kept to recognise such replies."""
        fut = self._pending.pop(correlation_id, None)
        if fut is not None and not fut.done():
            fut.cancel()
        for book in (
            self.reply_counts,
            self.received_at,
            self.duplicates,
            self._reply_ids,
            self._request_ids,
            self._tenants,
            self._streams,
        ):
            book.pop(correlation_id, None)
        self._forgotten[correlation_id] = None
        while len(self._forgotten) > remember:
            self._forgotten.popitem(last=False)

    def _on_tokens(self, message: AbstractIncomingMessage) -> None:
        """A token-stream message (an agent's best effort, not a reply): each chunk in it to
        its open stream, or dropped. It never counts as a reply, duplicate or malformed
        reply."""
        try:
            chunks = decode_token_message(message.body, message.correlation_id)
        except ValidationError as exc:
            self.stray_chunks += 1
            log.debug(
                "token_chunk_invalid", correlation_id=message.correlation_id, error=str(exc)[:200]
            )
            return
        self.token_messages += 1
        for cid, chunk in chunks:
            self._route_chunk(cid, chunk)

    def _route_chunk(self, cid: str, chunk: Chunk) -> None:
        stream = self._streams.get(cid)
        if stream is None:
            self.stray_chunks += 1
            log.debug("token_chunk_for_unknown_request", correlation_id=cid)
            return
        if chunk.request_id != stream.request_id:
            self.stray_chunks += 1
            log.debug("token_chunk_for_other_request", correlation_id=cid)
            return
        self.token_chunks += 1
        stream._feed(chunk)

    def _record(self, message: AbstractIncomingMessage) -> None:
        if message.type == _TOKENS_TYPE:
            self._on_tokens(message)
            return
        if message.correlation_id in self._forgotten:
            log.debug("reply_for_forgotten_request", correlation_id=message.correlation_id)
            return
        try:
            reply: Reply | None = _reply_adapter.validate_json(message.body)
        except ValidationError as e:
            reply, error = None, e
        cid = message.correlation_id or (reply.request_id if reply is not None else None)
        if cid is None or cid not in self._pending:
            log.warning("reply_unexpected", correlation_id=cid)
            self.unexpected.append(message)
            return
        expected = self._request_ids.get(cid)
        if reply is not None and expected is not None and reply.request_id not in (None, expected):
            # matching correlation id, another request's reply (a producer that knows our
            # reply queue and correlation ids cannot feed us its own result)
            log.warning("reply_for_other_request", correlation_id=cid, request_id=reply.request_id)
            self.unexpected.append(message)
            return
        reply_id = str((message.headers or {}).get(REPLY_ID_HEADER) or "")
        if reply_id and self._reply_ids.get(cid) == reply_id:
            self.redelivered_replies += 1
            log.info("reply_redelivered", correlation_id=cid)
            return
        if reply_id:
            self._reply_ids.setdefault(cid, reply_id)
        self.reply_counts[cid] += 1
        fut = self._pending[cid]
        if self.reply_counts[cid] > 1:
            log.warning("reply_duplicate", correlation_id=cid, n=self.reply_counts[cid])
            if reply is not None:
                self.duplicates.setdefault(cid, []).append(reply)
            return
        self.received_at[cid] = time.time()
        stream = self._streams.get(cid)
        if stream is not None:
            stream._inbox.put_nowait(None)  # wakes its reader: the reply is in
        if fut.done():  # cancelled by close()
            return
        if reply is None:
            fut.set_exception(MalformedReply(f"reply for {cid!r} is not valid: {error}"))
        else:
            fut.set_result(reply)

    # --- bookkeeping -------------------------------------------------------------------------

    def outstanding(self) -> int:
        """Requests published (and confirmed) that have had no reply yet."""
        return sum(1 for cid in self._pending if self.reply_counts[cid] == 0)

    def outstanding_ids(self) -> set[str]:
        return {cid for cid in self._pending if self.reply_counts[cid] == 0}

    def duplicate_count(self) -> int:
        return sum(len(v) for v in self.duplicates.values())


# --- trace replay ----------------------------------------------------------------------------


@dataclass
class ReplayResult:
    """What a replay sent and got back; ``results`` pairs each request with its reply (None
    when lost: no reply before the timeout, or the publish was never confirmed)."""

    sent: int
    replies: int
    errors: int
    duplicates: int
    lost: int
    publish_failures: int
    started_at: float  # wall clock of the first scheduled arrival
    finished_at: float  # wall clock when the last reply came (or the wait ended)
    max_send_lag_s: float  # how far publishing fell behind the trace schedule
    results: list[tuple[RequestMessage, Reply | None]] = field(default_factory=list)
    # wall clock at which each request was published, by request id
    sent_at: dict[str, float] = field(default_factory=dict)


async def replay(
    client: QlmClient,
    timed_requests: Sequence[tuple[float, RequestMessage]],
    *,
    speedup: float = 1.0,
    timeout: float = 300.0,  # noqa: ASYNC109 - measured from the last publish, not the call
) -> ReplayResult:
    """Publish each request at its arrival time (seconds from the start, divided by
    ``speedup``), stamping ``submitted_at``; then wait up to ``timeout`` s after the last
    publish for all replies."""
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    loop = asyncio.get_running_loop()
    order = sorted(range(len(timed_requests)), key=lambda i: timed_requests[i][0])
    t0_mono, t0_wall = loop.time(), time.time()
    dup_before = {cid: len(v) for cid, v in client.duplicates.items()}
    sent_at: dict[str, float] = {}
    max_lag = 0.0

    async def send(req: RequestMessage) -> asyncio.Future[Reply]:
        now = time.time()
        sent_at[req.request_id] = now
        return await client.submit(req, submitted_at=now)

    # Publishes run as tasks so confirms pipeline; one slow confirm never delays the schedule.
    tasks: list[asyncio.Task[asyncio.Future[Reply]]] = []
    for i in order:
        arrival, req = timed_requests[i]
        due = t0_mono + arrival / speedup
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        max_lag = max(max_lag, loop.time() - due)
        tasks.append(asyncio.create_task(send(req)))
    published = await asyncio.gather(*tasks, return_exceptions=True)

    futures: dict[int, asyncio.Future[Reply]] = {}
    failures = 0
    for i, outcome in zip(order, published, strict=True):
        if isinstance(outcome, BaseException):
            failures += 1
            rid = timed_requests[i][1].request_id
            log.warning("replay_publish_failed", request_id=rid, error=repr(outcome))
        else:
            futures[i] = outcome
    if futures:
        await asyncio.wait(list(futures.values()), timeout=timeout)

    results: list[tuple[RequestMessage, Reply | None]] = []
    replies = errors = 0
    for i, (_, req) in enumerate(timed_requests):
        reply: Reply | None = None
        fut = futures.get(i)
        if fut is not None and fut.done() and not fut.cancelled():
            replies += 1
            if fut.exception() is not None:  # a MalformedReply: it came, but is unusable
                errors += 1
            else:
                reply = fut.result()
                errors += isinstance(reply, ErrorMessage)
        results.append((req, reply))
    ids = {req.request_id for _, req in timed_requests}
    duplicates = sum(
        len(v) - dup_before.get(cid, 0) for cid, v in client.duplicates.items() if cid in ids
    )
    received = [client.received_at[r] for r in ids if r in client.received_at]
    return ReplayResult(
        sent=len(futures),
        replies=replies,
        errors=errors,
        duplicates=duplicates,
        lost=len(futures) - replies,
        publish_failures=failures,
        started_at=t0_wall,
        finished_at=max(received, default=time.time()),
        max_send_lag_s=max_lag,
        results=results,
        sent_at=sent_at,
    )
