"""The batch runner: puts a batch's lines on the durable queue and records their answers.

Every gateway replica runs one. It survives any restart because it holds nothing that is not
in the database or the broker:

* **Who publishes.** A replica takes a *lease* on each active batch (``batches.lease_owner``,
  renewed every poll, ``lease_s`` long): one runner per batch at a time, across replicas. A
  replica that dies loses its leases when they run out and another (or its restart) takes over.
* **Publishing.** Lines are marked ``published`` in the database, then published to
  ``qlm.ingress`` with a confirm, under deterministic ids (``batch-<hex>-<line>-<attempt>``). A
  runner that takes a batch over publishes its ``published``-but-unanswered lines again: the
  coordinator runs each request id once (a copy of one in flight rides along with it; one
  answered already gets its recorded answer again, qlm/store/answers.py).
* **Replies.** Every line's reply goes to one durable queue shared by the replicas on the
  same database (``qlm.reply.<user>.batches.<database hash>``), so replies sent while every
  gateway was down wait there.
  Any replica records a reply it receives (whatever replica holds the batch's lease) and acks
  it only after the record is committed; the record is conditional on the line still being
  open, so a reply that comes twice (a re-publish, a redelivery) changes nothing the second
  time: each ``custom_id`` is answered exactly once in the output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import aio_pika
import structlog
from aio_pika.abc import AbstractIncomingMessage
from pydantic import ValidationError

from qlm import amqp as qlm_amqp
from qlm.client import QlmClient, Reply, _reply_adapter
from qlm.store.batches import OPEN_STATES, BatchStore, Counts, LineToPublish
from qlm.types import CONTENT_TYPE, RequestMessage

log = structlog.get_logger(__name__)

_TOKENS_TYPE = "tokens"
_PREFIX = "batch-"


def line_request_id(batch_id: str, line_no: int, attempt: int) -> str:
    """The qlm request id of a batch line's attempt (``batch_`` ids hold an underscore, which
    a request id may not: the hex part only)."""
    return f"{_PREFIX}{batch_id.removeprefix('batch_')}-{line_no}-{attempt}"


def parse_line_request_id(request_id: str) -> tuple[str, int, int] | None:
    """(batch id, line number, attempt) of a batch line's request id; None for any other."""
    if not request_id.startswith(_PREFIX):
        return None
    parts = request_id[len(_PREFIX) :].split("-")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return f"batch_{parts[0]}", int(parts[1]), int(parts[2])


ReplyHandler = Callable[[str, Reply | None, str], Awaitable[None]]


class BatchClient(QlmClient):
    """A ``QlmClient`` on a durable reply queue shared by every gateway replica. A reply is
    handed to ``handler`` (which records it) and acked only once that returned: a reply is
    never lost between the queue and the database. It keeps no per-request books: the
    database is the book."""

    def __init__(self, amqp_url: str, reply_queue: str) -> None:
        super().__init__(amqp_url, reply_queue=reply_queue, app_id="qlm-gateway-batches")
        self.handler: ReplyHandler | None = None
        self._inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        await super().connect()
        self._worker = asyncio.create_task(self._work())

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None
        await super().close()

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        # one worker records replies in arrival order; unacked until it has (prefetch bounds
        # how many wait in the inbox)
        self._inbox.put_nowait(message)

    async def _work(self) -> None:
        while True:
            message = await self._inbox.get()
            try:
                await self._handle(message)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the database is down: try again later
                log.warning("batch_reply_not_recorded", error=repr(exc)[:200])
                await asyncio.sleep(1.0)
                with contextlib.suppress(Exception):
                    await message.nack(requeue=True)
                continue
            with contextlib.suppress(Exception):  # its channel is gone: it comes back anyway
                await message.ack()

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        if message.type == _TOKENS_TYPE:  # batch lines never stream; a stray chunk
            return
        cid = message.correlation_id or ""
        try:
            reply: Reply | None = _reply_adapter.validate_json(message.body)
        except ValidationError:
            reply = None
        rid = cid or (reply.request_id if reply is not None else None) or ""
        if self.handler is not None:
            await self.handler(rid, reply, bytes(message.body[:200]).decode("utf-8", "replace"))

    async def publish_request(self, request: RequestMessage) -> None:
        """Publish one line's request with a confirm; replies to the shared queue."""
        assert self._connection is not None and self._ingress is not None, "not connected"
        rid = request.request_id
        message = aio_pika.Message(
            request.model_dump_json(exclude_none=True).encode(),
            content_type=CONTENT_TYPE,
            content_encoding="utf-8",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=rid,
            correlation_id=rid,
            reply_to=self.reply_queue_name,
            timestamp=datetime.now(tz=UTC),
            app_id=self.app_id,
            user_id=self.user_id,
        )
        await qlm_amqp.publish_confirmed(
            self._connection,
            self._ingress,
            message,
            rid,
            within_s=self.republish_within_s,
            renew_on_nack=True,
        )


def error_line(
    batch_id: str,
    line_no: int,
    custom_id: str | None,
    code: str,
    message: str,
    response: dict[str, Any] | None = None,
) -> str:
    """A line of a batch's error file, as OpenAI writes them, plus the input line's number."""
    return json.dumps(
        {
            "id": f"batch_req_{batch_id.removeprefix('batch_')}_{line_no}",
            "custom_id": custom_id,
            "response": response,
            "error": {"code": code, "message": message, "line": line_no},
        },
        separators=(",", ":"),
    )


class BatchRunner:
    """Drives the batches this replica holds the lease of: publishes their lines, cancels,
    expires and finalizes them. The answers themselves are recorded by the Batch API's reply
    handler, on whatever replica receives them."""

    def __init__(
        self,
        store: BatchStore,
        client: BatchClient,
        *,
        lease_s: float = 15.0,
        poll_s: float = 0.5,
        publish_chunk: int = 500,
        cancel_grace_s: float = 30.0,
        pace: float = 0.75,
        max_in_flight: int = 500,
        owner: str | None = None,
    ) -> None:
        self.store = store
        self.client = client
        self.owner = owner or f"gw-{uuid.uuid4().hex[:12]}"
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.publish_chunk = publish_chunk
        self.cancel_grace_s = cancel_grace_s
        self.pace = pace
        self.max_in_flight = max_in_flight
        self._held: set[str] = set()
        # batches taken over, and the line after which their re-publish goes on
        self._republishing: dict[str, int] = {}
        self._cancels_sent: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    def wake(self) -> None:
        """A batch was created or cancelled: look now rather than at the next poll."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        # let another replica take over at once (a crash instead waits out the lease)
        with contextlib.suppress(Exception):
            await self.store.release(self.owner)

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - broker or database down: next poll
                log.warning("batch_runner_tick_failed", error=repr(exc)[:300])
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)

    async def tick(self) -> None:
        now = time.time()
        mine = set(await self.store.claim(self.owner, self.lease_s, now))
        for batch_id in mine - self._held:
            log.info("batch_lease_taken", batch_id=batch_id, owner=self.owner)
            self._republishing[batch_id] = 0
        self._held = mine
        self._cancels_sent &= mine
        self._republishing = {b: n for b, n in self._republishing.items() if b in mine}
        for batch_id in sorted(mine):
            await self._drive(batch_id)

    async def _drive(self, batch_id: str) -> None:
        batch = await self.store.get_batch(batch_id)
        if batch is None or batch["lease_owner"] != self.owner:
            return
        now = time.time()
        status, tenant = batch["status"], batch["tenant"]
        if status == "in_progress" and now >= batch["expires_at"]:
            await self._expire(batch_id, tenant)
        elif status == "in_progress":
            # a time budget per tick: the lease is renewed between ticks
            budget = time.monotonic() + self.lease_s / 3
            if batch_id in self._republishing:
                after = self._republishing[batch_id]
                done, after = await self._publish_lines(batch_id, True, after, budget)
                if not done:
                    self._republishing[batch_id] = after
                    return
                del self._republishing[batch_id]
            allowed = self._allowed(batch, await self.store.counts(batch_id), now)
            done, _ = await self._publish_lines(batch_id, False, 0, budget, allowed)
            if done and (await self.store.counts(batch_id)).open == 0:
                await self.store.finalize(batch_id, "completed", "completed_at", time.time())
                log.info("batch_completed", batch_id=batch_id)
        elif status == "cancelling":
            await self.store.close_open_lines(batch_id, "cancelled", ("pending",))
            if batch_id not in self._cancels_sent:
                await self._cancel_published(batch_id, tenant)
                self._cancels_sent.add(batch_id)
            waited = now - (batch["cancelling_at"] or now)
            open_ = (await self.store.counts(batch_id)).open
            if open_ == 0 or waited > self.cancel_grace_s:
                await self.store.close_open_lines(batch_id, "cancelled", OPEN_STATES)
                await self.store.finalize(batch_id, "cancelled", "cancelled_at", time.time())
                log.info("batch_cancelled", batch_id=batch_id, unanswered=open_)

    async def _expire(self, batch_id: str, tenant: str) -> None:
        """The window passed: what is still queued is withdrawn, and every unanswered line
        goes to the error file as ``batch_expired`` (OpenAI's code)."""
        await self._cancel_published(batch_id, tenant)

        def expired(line_no: int, custom_id: str | None) -> str:
            return error_line(
                batch_id,
                line_no,
                custom_id,
                "batch_expired",
                "This request could not be executed before the completion window expired.",
            )

        n = await self.store.close_open_lines(batch_id, "failed", OPEN_STATES, expired)
        await self.store.finalize(batch_id, "expired", "expired_at", time.time())
        log.warning("batch_expired", batch_id=batch_id, unanswered=n)

    def _allowed(self, batch: dict[str, Any], counts: Counts, now: float) -> int | None:
        """How many more lines may go on the queue now (None: all of them).

        A batch is released gradually, so that it fills spare capacity instead of arriving
        as one wall of work in front of interactive traffic: at most ``max_in_flight`` lines
        on the queue at once - as they are answered, more follow, as fast as the cluster
        serves them - but never behind the *pace*, a straight line from the batch's creation
        to all lines released at ``pace`` of its window, so that a busy cluster still gets
        the whole batch in time to meet its deadline."""
        if self.pace <= 0:
            return None
        released = counts.valid - counts.pending  # published at least once
        by_window = self.max_in_flight - counts.published
        spread = self.pace * batch["window_s"]
        on_pace = math.ceil(counts.valid * min(1.0, (now - batch["created_at"]) / spread))
        return max(0, by_window, on_pace - released)

    async def _publish_lines(
        self,
        batch_id: str,
        republish: bool,
        after: int,
        budget: float,
        allowed: int | None = None,
    ) -> tuple[bool, int]:
        """Publish due lines (with ``republish``, the published ones as well) after line
        ``after``, at most ``allowed`` of them, until none is left or allowed (True) or the
        budget is spent (False, and where to go on from)."""
        while time.monotonic() < budget:
            limit = self.publish_chunk if allowed is None else min(self.publish_chunk, allowed)
            if limit <= 0:
                return True, after
            lines = await self.store.lines_to_publish(
                batch_id, time.time(), limit, republish=republish, after_line=after
            )
            if not lines:
                return True, after
            if allowed is not None:
                allowed -= len(lines)
            await self.store.mark_published(batch_id, lines)
            # confirms pipeline: a chunk at once, not one round trip per line
            await asyncio.gather(*(self._publish(batch_id, ln) for ln in lines))
            after = lines[-1].line_no
            log.info(
                "batch_lines_published",
                batch_id=batch_id,
                n=len(lines),
                through=after,
                again=republish,
            )
        return False, after

    async def _publish(self, batch_id: str, line: LineToPublish) -> None:
        rid = line_request_id(batch_id, line.line_no, line.attempt)
        request = RequestMessage.model_validate_json(line.request).model_copy(
            update={"request_id": rid}
        )
        await self.client.publish_request(request)

    async def _cancel_published(self, batch_id: str, tenant: str) -> None:
        published = await self.store.published_lines(batch_id)

        async def cancel(line_no: int, attempt: int) -> None:
            rid = line_request_id(batch_id, line_no, attempt)
            try:
                await self.client.cancel(rid, "the batch was cancelled", tenant=tenant or None)
            except Exception as exc:  # noqa: BLE001 - best effort: it runs, and is answered
                log.warning("batch_line_cancel_failed", request_id=rid, error=repr(exc)[:200])

        for i in range(0, len(published), self.publish_chunk):
            await asyncio.gather(*(cancel(n, a) for n, a in published[i : i + self.publish_chunk]))
        log.info("batch_cancels_sent", batch_id=batch_id, n=len(published))
