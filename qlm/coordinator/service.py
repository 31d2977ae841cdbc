"""The coordinator service: broker I/O around :class:`CoordinatorCore`.

Consumes the global queue shards (manual acks, each delivery held unacked until its reply is
confirmed) and the control queue; publishes dispatches to agents, replies to producers and
dead-letter copies of invalid input; runs the liveness check; serves the admin API.
All exception-to-nack/reject decisions live in :meth:`Coordinator._guarded` so no handler can
take the service down.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aio_pika
import structlog
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractRobustConnection,
)
from pydantic import ValidationError

from qlm import amqp as qlm_amqp
from qlm.amqp import escape_raw
from qlm.capacity.telemetry import AutoscalerView, CapacityTelemetry
from qlm.catalog import ModelCatalog
from qlm.chains import LateTaskRule
from qlm.collective import GraphError
from qlm.control import (
    BatchCap,
    Completion,
    Dispatch,
    Evict,
    Evicted,
    Failure,
    Goodbye,
    Heartbeat,
    ModelPlan,
    Pull,
    ReplyRoute,
    ServedModel,
    ServedModels,
    StreamResync,
    to_coordinator_adapter,
)
from qlm.coordinator import refresh
from qlm.coordinator.core import (
    CAP_UNKNOWN,
    AdmissionLimits,
    BatchCapOrder,
    BatchTier,
    CoordinatorCore,
    DispatchOrder,
    EvictOrder,
    LSOSettings,
    ModelStateOrder,
    StaleAttempt,
    StreamResyncOrder,
    TrackedRequest,
)
from qlm.coordinator.identity import ProducerIdentity
from qlm.coordinator.validation import (
    InvalidRequest,
    check_properties,
    clean_message_id,
    dead_letter_properties,
    parse_request,
    reply_route,
)
from qlm.logging import log_request_outcome
from qlm.metrics import CoordinatorMetrics
from qlm.policy import QueuePolicy
from qlm.store import AnswerLogUnavailable, RequestStatus, Store, StoredAnswer
from qlm.streaming import decode_token_message
from qlm.topology import (
    CONTROL_EXCHANGE,
    REASON_HEADER,
    REASON_TEXT_HEADER,
    SERVED_MODELS_INTERVAL_S,
    STREAM_END_HEADER,
    STREAM_TAP_QUEUE,
    Topology,
    agent_queue,
    agent_routing_key,
    declare_models_exchange,
    declare_topology,
)
from qlm.types import (
    CONTENT_TYPE,
    REPLY_ID_HEADER,
    CancelMessage,
    ErrorCode,
    ErrorMessage,
    RequestMessage,
    ResultMessage,
    Timestamps,
    Usage,
)

log = structlog.get_logger(__name__)

ORPHAN_TTL_S = 60.0  # how long a result waits for its request to be (re)delivered
MAX_ORPHANS = 1000  # held results at most (they hold control-queue prefetch slots)

EVENT_EXCHANGE = "amq.rabbitmq.event"
AGENT_QUEUE_PREFIX = agent_queue("")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value or "")


def request_log(
    outcome: str,
    t: TrackedRequest,
    *,
    instance_id: str | None = None,
    latency_s: float | None = None,
    met: bool | None = None,
    code: str | None = None,
) -> None:
    """The request's one ``request_outcome`` line (qlm/logging.py); latency from submission
    to now unless given."""
    req = t.request
    log_request_outcome(
        outcome,
        request_id=t.request_id,
        tenant=req.tenant,
        model=req.model,
        slo_class=req.slo.slo_class,
        instance_id=instance_id if instance_id is not None else t.instance_id,
        latency_s=time.time() - t.submitted_at if latency_s is None else latency_s,
        met=met,
        code=code,
        attempts=t.attempts,
    )


def _user_id(message: AbstractIncomingMessage) -> str | None:
    """The AMQP ``user_id`` property: RabbitMQ delivers it only if it equals the publishing
    connection's user, so it names the producer for certain."""
    value = message.user_id
    return value if isinstance(value, str) and value else None


# How long a reply whose confirm was lost keeps being published again (after reconnects)
# before the request goes back to a virtual queue to be run again.
REPLY_REPUBLISH_S = 60.0
DISPATCH_RETRY_S = 0.5  # pause before dispatching again after this side's publish failed
ANSWER_PRUNE_INTERVAL_S = 600.0  # how often answers past their retention are deleted
# The stream tap's barrier (:meth:`Coordinator._tap_barrier`): its marker's AMQP type, and
# how long a lost agent's work waits for it at most (it takes a broker round trip)
TAP_BARRIER_TYPE = "qlm.tap-barrier"
TAP_BARRIER_TIMEOUT_S = 1.0
MAX_RESYNC_REQUESTS = 4096  # request ids in one StreamResync order (its schema's bound)


class Coordinator:
    def __init__(
        self,
        *,
        amqp_url: str,
        policy: QueuePolicy,
        store: Store,
        catalog: ModelCatalog | None = None,
        shards: int = 2,
        prefetch_per_shard: int = 65535,
        delivery_limit: int = 20,
        max_body_bytes: int = 1_048_576,
        heartbeat_timeout_s: float = 3.0,
        liveness_interval_s: float = 0.5,
        metrics: CoordinatorMetrics | None = None,
        lso: LSOSettings | None = None,
        limits: AdmissionLimits | None = None,
        late_task_rule: LateTaskRule = "promote",
        batch: BatchTier | None = None,
        identity: ProducerIdentity | None = None,
        answer_retention_s: float = 7 * 86400.0,
        unserved_model_hold_s: float | None = None,
        unserved_model_grace_s: float | None = None,
    ) -> None:
        self.amqp_url = amqp_url
        # acks of global-queue deliveries being sent, by id(message) (_ack_once)
        self._acks: dict[int, asyncio.Event] = {}
        # the broker user this coordinator publishes as: its refreshed copies carry it
        self._own_user = qlm_amqp.username_of(amqp_url)
        # A request for a model no live instance serves: refused `model_not_served` after this
        # hold (0: at once). None turns the rule off: such requests wait in the queue, as a
        # library user embedding the coordinator may want; `qlm coordinator` sets 0.
        self.unserved_model_hold_s = unserved_model_hold_s
        # Agents register with their first heartbeat after this coordinator becomes active:
        # until then no model looks served, so the rule waits this long from then.
        self.unserved_model_grace_s = (
            heartbeat_timeout_s if unserved_model_grace_s is None else unserved_model_grace_s
        )
        # The stream tap's barriers (their message id -> the waiter): a loss waits until every
        # chunk the broker routed before it was read (:meth:`_tap_barrier`)
        self._tap_waiters: dict[str, asyncio.Future[None]] = {}
        self.tap_messages = 0
        self.tap_rejected = 0  # tap messages that were not token messages
        # Active from its first delivery, not from start(): a standby starts long before it
        # takes over (single active consumer) and then knows no instance yet either.
        self._active_since: float | None = None
        # When this coordinator's broker connection last came back (unix s): heartbeats sent
        # while it was down never reached it, so the agents get the registration grace again
        # from then (none is judged lost, no model looks unserved, for that long).
        self._reconnected_at: float | None = None
        # From the connection's loss until its channels and consumers are restored (the
        # reconnect callback): the transport may be back seconds earlier, while the control
        # queue's consumer (heartbeats) still waits for a new quorum leader
        self._restoring = False
        self._held_unserved: dict[str, float] = {}  # request id -> when its hold ends (unix s)
        self._models_exchange: AbstractExchange | None = None
        self._announced: tuple[list[ServedModel], float] | None = None  # what and when
        self.identity = identity or ProducerIdentity()
        # how long the durable answer record keeps a request's reply (redeliveries and
        # producer re-publishes within it are answered from the record, never run again)
        self.answer_retention_s = answer_retention_s
        self._last_prune = 0.0
        self.store = store
        self.catalog = catalog or ModelCatalog()
        self.shards = shards
        self.prefetch = prefetch_per_shard
        self.delivery_limit = delivery_limit
        self.max_body_bytes = max_body_bytes
        self.liveness_interval_s = liveness_interval_s
        self.core = CoordinatorCore(
            policy,
            heartbeat_timeout_s=heartbeat_timeout_s,
            lso=lso,
            limits=limits,
            late_task_rule=late_task_rule,
            batch=batch,
        )
        self.metrics = metrics or CoordinatorMetrics()
        self._conn: AbstractRobustConnection | None = None
        self._events_conn: AbstractRobustConnection | None = None
        self._pub: AbstractChannel | None = None
        # Strong references: a robust connection holds its channels only weakly, and restores
        # after a reconnect only the channels still alive and the queues declared through them
        # (so consumers go through declare_queue(passive=True), never get_queue(ensure=False)).
        self._held: list[Any] = []
        self._topology: Topology | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._liveness: asyncio.Task[None] | None = None
        self._stopping = False
        self._replan_pending = False
        self._replan_lock = asyncio.Lock()
        self._last_plan_at = 0.0
        self._store_seen = (0, 0)  # (failures, committed) at the last health check
        self._last_auto_replan = float("-inf")
        self._last_replan_s = 0.0
        # Results for requests not (yet) tracked: after a takeover a completion can arrive
        # before the broker redelivers its request. Held unacked for ORPHAN_TTL_S and answered
        # when the request shows up, instead of being dropped and the work repeated.
        self._orphans: dict[str, tuple[Completion, AbstractIncomingMessage, float]] = {}
        self.ingested = 0
        self.received_at_first: float | None = None
        # what an autoscaler measures (planner/capacity/live_loop.py reads it; the CLI wires one)
        self.capacity = CapacityTelemetry()
        self.autoscaler: AutoscalerView | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        try:  # the recent answers, so a re-published id is recognised without a lookup
            for rid in await self.store.answers.recent_ids(self.core.answered_limit):
                self.core.answered[rid] = None
        except Exception as exc:  # a cache only: the record itself is consulted on redelivery
            log.warning("answered_ids_not_loaded", error=repr(exc)[:200])
        self._conn = await qlm_amqp.connect(self.amqp_url, name="qlm-coordinator")
        self._conn.close_callbacks.add(self._on_connection_lost)
        self._conn.reconnect_callbacks.add(self._on_reconnected)
        self._pub = await self._conn.channel(publisher_confirms=True, on_return_raises=True)
        # The setup channel re-declares the topology after a broker restart (a non-durable
        # queue is gone then); the consumers' passive declarations wait for it.
        setup = await self._conn.channel()
        self._topology = await declare_topology(setup, self.shards, self.delivery_limit)
        self._models_exchange = await declare_models_exchange(setup)
        ctl_ch = await self._conn.channel()
        await ctl_ch.set_qos(prefetch_count=2000)
        self._held += [setup, ctl_ch]
        for q in (self._topology.coordinator, self._topology.live):
            ctl_q = await ctl_ch.declare_queue(q.name, passive=True)
            await ctl_q.consume(self._on_control, no_ack=False)
            self._held.append(ctl_q)
        # The stream tap: transient copies, nothing to settle, so no acks
        tap_ch = await self._conn.channel()
        tap_q = await tap_ch.declare_queue(self._topology.stream_tap.name, passive=True)
        await tap_q.consume(self._on_stream_tap, no_ack=True)
        self._held += [tap_ch, tap_q]
        # One channel per shard: prefetch is per consumer, and each holds up to 65,535 unacked.
        for q in self._topology.shards:
            ch = await self._conn.channel()
            await ch.set_qos(prefetch_count=self.prefetch)
            shard = await ch.declare_queue(q.name, passive=True)
            await shard.consume(self._on_request, no_ack=False)
            self._held += [ch, shard]
        await self._watch_agent_queues()
        self._liveness = asyncio.create_task(self._liveness_loop())
        log.info("coordinator_started", shards=self.shards, policy=self.core.policy.name)

    async def _watch_agent_queues(self) -> None:
        """Learn at once when an agent's connection closes: its exclusive dispatch queue is
        deleted with it, and the broker's event exchange (plugin ``rabbitmq_event_exchange``,
        which publishes in the default vhost ``/`` for every vhost) announces that. Best
        effort: without the plugin or access to ``/``, heartbeat timeouts and returned
        dispatches still detect a lost agent, only later."""
        vhost = qlm_amqp.vhost_of(self.amqp_url)
        try:
            self._events_conn = await qlm_amqp.connect(
                qlm_amqp.with_vhost(self.amqp_url, "/"), name="qlm-coordinator-events"
            )
            ch = await self._events_conn.channel()
            events = await ch.get_exchange(EVENT_EXCHANGE, ensure=True)
            q = await ch.declare_queue(exclusive=True, auto_delete=True)
            await q.bind(events, routing_key="queue.deleted")
            self._held += [ch, q]
        except Exception as exc:
            log.warning("agent_queue_events_unavailable", error=repr(exc)[:200])
            if self._events_conn is not None:
                with contextlib.suppress(Exception):
                    await self._events_conn.close()
                self._events_conn = None
            return

        async def on_event(message: AbstractIncomingMessage) -> None:
            headers = message.headers or {}
            name = _text(headers.get("name"))
            if _text(headers.get("vhost")) == vhost and name.startswith(AGENT_QUEUE_PREFIX):
                self._lost_agent(name[len(AGENT_QUEUE_PREFIX) :], "connection_closed")

        await q.consume(on_event, no_ack=True)

    async def stop(self) -> None:
        self._stopping = True
        if self._liveness:
            self._liveness.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._liveness
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        for conn in (self._events_conn, self._conn):
            if conn is not None:
                await conn.close()
        await self.store.flush()
        log.info("coordinator_stopped")

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ one place for failures
    async def _guarded(
        self,
        message: AbstractIncomingMessage,
        handler: Callable[[AbstractIncomingMessage], Awaitable[None]],
        *,
        requeue_on_error: bool,
    ) -> None:
        try:
            await handler(message)
        except Exception:
            log.exception(
                "handler_failed",
                message_id=escape_raw(message.message_id or ""),
                requeue=requeue_on_error,
            )
            if requeue_on_error and self._last_delivery(message):
                await self._reply_delivery_limit(message)
            # Requeue for a global-queue message: the quorum delivery limit dead-letters a
            # message that keeps failing. A broken control message is dropped.
            with contextlib.suppress(Exception):
                await message.nack(requeue=requeue_on_error)

    def _last_delivery(self, message: AbstractIncomingMessage) -> bool:
        """Whether returning this delivery makes the quorum queue dead-letter it: the broker
        counts returns in ``x-delivery-count`` (absent on the first delivery) and dead-letters
        at the return after delivery number ``delivery_limit + 1``. A first delivery
        (``redelivered`` false) never is: a producer can set ``x-delivery-count`` itself, and
        only on a redelivery does the broker's own count replace it."""
        if not message.redelivered:
            return False
        count = (message.headers or {}).get("x-delivery-count") or 0
        return isinstance(count, int) and count >= self.delivery_limit

    async def _reply_delivery_limit(self, message: AbstractIncomingMessage) -> None:
        """The producer of a message that failed every time gets an error reply before the
        broker dead-letters it (best effort: the dead letter keeps the message either way)."""
        reply_to, correlation_id = reply_route(message)  # None where not UTF-8 on the wire
        if not reply_to:
            return
        rid = clean_message_id(message)
        err = ErrorMessage(
            request_id=rid,
            code=ErrorCode.DELIVERY_LIMIT,
            message=(
                f"the coordinator failed to handle this message {self.delivery_limit + 1} "
                "times; it is dead-lettered to qlm.dead (x-death reason delivery_limit)"
            ),
        )
        try:
            await self._reply(reply_to, correlation_id or rid, err)
        except Exception as exc:
            log.warning("delivery_limit_reply_failed", message_id=rid, error=repr(exc)[:200])

    # ------------------------------------------------------------------ ingest
    async def _on_request(self, message: AbstractIncomingMessage) -> None:
        await self._guarded(message, self._ingest, requeue_on_error=True)

    async def _ingest(self, message: AbstractIncomingMessage) -> None:
        now = time.time()
        if self.received_at_first is None:
            self.received_at_first = now
        if self._active_since is None:
            self._active_since = now
        try:
            # first the envelope: a property that is not UTF-8 (decoded tolerantly, see
            # qlm.amqp) is refused before anything reads it
            check_properties(message)
            req = parse_request(
                message.body,
                message.content_type,
                self.catalog,
                max_body_bytes=self.max_body_bytes,
                message_id=message.message_id,
                now=now,
            )
        except InvalidRequest as bad:
            await self._reject(message, bad, now)
            return
        if isinstance(req, CancelMessage):
            await self._on_cancel(req, message)
            return
        # the coordinator's own copy of a request whose delivery count it refreshed: a
        # redelivery, and its producer's user is the one it carries (qlm/coordinator/refresh.py)
        refreshes = refresh.refreshes_of(message, self._own_user)
        producer = _user_id(message) if refreshes is None else refresh.original_user(message)
        redelivered = bool(message.redelivered) or refreshes is not None
        try:  # who sent it, and may its reply go where it asks
            tenant = self.identity.tenant_of(req.tenant, producer, req.request_id)
            self.identity.check_reply_to(message.reply_to, tenant, req.request_id)
        except InvalidRequest as bad:
            await self._reject(message, bad, now)
            return
        if tenant != req.tenant:
            req = req.model_copy(update={"tenant": tenant})
        rid = req.request_id
        if rid not in self.core.requests and (redelivered or rid in self.core.answered):
            # answered before (by this coordinator, or by one that died before the ack)
            try:
                stored = await self.store.answers.lookup(rid)
            except AnswerLogUnavailable as exc:  # the record is checked again at answer time
                log.warning("answer_lookup_failed", request_id=rid, error=str(exc)[:200])
                stored = None
            if stored is not None:
                await self._answer_again(stored, req, message, now)
                return
        if req.request_id not in self.core.requests:
            try:
                self.core.collective.check(req)
            except GraphError as exc:
                err = InvalidRequest(ErrorCode.INVALID_GRAPH, str(exc), req.request_id)
                await self._reject(message, err, now, req)
                return
        hold_until = None
        if req.request_id not in self.core.requests:
            hold_until = self._unserved_hold_until(req.model, now)
            if hold_until is not None and hold_until <= now:
                await self._reject(message, self._not_served(req.model, req.request_id), now, req)
                return
            # checked at its first admission only: a redelivery (perhaps adopted from an
            # agent that runs it) or a request whose result is here is not refused now
            too_long = None if redelivered else self._beyond_engine_context(req)
            if too_long is not None and req.request_id not in self._orphans:
                await self._reject(message, too_long, now, req)
                return
        held = self.core.requests.get(req.request_id)
        previous = held.delivery if held is not None else None
        tracked, outcome = self.core.admit(
            req,
            message,
            reply_to=message.reply_to,
            correlation_id=message.correlation_id,
            received_at=now,
            redelivered=redelivered,
            result_held=req.request_id in self._orphans,
        )
        if outcome == "redelivered" and previous is not None and previous is not message:
            # The new delivery holds the request now. The one it replaces is gone with its
            # channel (a broker redelivery: this ack fails, locally) or, beside a refreshed
            # copy, still unacked on a live channel: settled, so one copy is left.
            self._spawn(self._ack_quietly(previous))
        if outcome in ("new", "redelivered") and tracked is not None:
            self._refresh_if_worn(message, refreshes or 0, producer)
        if outcome == "answered":
            # Already replied (an ack was lost): settle the copy without a second reply.
            await message.ack()
            return
        if outcome == "conflict":  # another tenant's request id: never its reply or its work
            err = InvalidRequest(
                ErrorCode.DUPLICATE_REQUEST_ID,
                "this request_id belongs to a request of another tenant; choose a unique id",
                req.request_id,
            )
            await self._reject(message, err, now, req)
            return
        if outcome == "duplicate":
            # The same id again while it is tracked: not run twice, and not held either (a
            # flood of copies must neither fill this consumer's prefetch nor count as queued
            # work). Its reply route, if new, is answered with the first.
            await message.ack()
            self.metrics.observe_duplicate()
            log.info("duplicate_request_acked", request_id=req.request_id)
            return
        if outcome == "cancelled":  # its cancel came first: answer it without running it
            await self._reply_cancelled_on_arrival(req, message, now)
            return
        if outcome == "overloaded":
            # Shed explicitly, like an invalid request: an error reply, a dead-letter copy with
            # the reason (the audit trail of what was refused, replayable once there is room),
            # the store row, then the ack. Never a silent drop, never left unacked (an unacked
            # copy would be redelivered into the same overload).
            shed = self.core.last_shed
            assert shed is not None  # admit() sets it with every "overloaded"
            self.metrics.observe_shed(shed.limit)
            err = InvalidRequest(
                ErrorCode.OVERLOADED, shed.message(), req.request_id, shed.details()
            )
            await self._reject(message, err, now, req)
            return
        self.ingested += 1
        if hold_until is not None and outcome == "new":
            self._held_unserved[req.request_id] = hold_until
        orphan = self._orphans.pop(req.request_id, None) if outcome == "new" else None
        if orphan is not None:  # its result came first (a takeover): answer it now
            self._spawn(self._complete(orphan[0], orphan[1]))
        if outcome == "new" and tracked is not None:
            self.store.record_received(
                request_id=req.request_id,
                model=req.model,
                slo_class=req.slo.slo_class,
                tenant=req.tenant,
                priority=req.priority,
                prompt_tokens=tracked.plan_view.prompt_tokens,
                max_tokens=req.max_tokens,
                submitted_at=tracked.submitted_at,
                queued_at=now,
                deadline=tracked.plan_view.deadline,
                ttft_deadline=tracked.plan_view.ttft_deadline,
            )
            self.metrics.observe_ingest_latency(time.time() - now)
            self.capacity.on_arrival(req.model, tracked.plan_view.prompt_tokens, now)
            if self.core.replan_wanted(now):
                self._schedule_replan()
        self._pump()

    def _refresh_if_worn(
        self, message: AbstractIncomingMessage, refreshes: int, producer: str | None
    ) -> None:
        """A tracked request whose delivery the broker has returned many times (connection
        losses count toward the delivery limit on RabbitMQ 3.x) gets a fresh copy before the
        limit dead-letters it (qlm/coordinator/refresh.py)."""
        if refreshes >= refresh.MAX_REFRESHES:
            return
        count = refresh.broker_count(message)
        if count < refresh.refresh_threshold(self.delivery_limit):
            return
        self._spawn(self._refresh(message, count, refreshes + 1, producer))

    async def _refresh(
        self, message: AbstractIncomingMessage, count: int, refreshes: int, producer: str | None
    ) -> None:
        assert self._pub is not None and self._conn is not None
        rid = clean_message_id(message)
        copy = refresh.fresh_copy(
            message, refreshes=refreshes, own_user=self._own_user, producer_user=producer
        )
        try:
            exchange = (
                await self._pub.get_exchange(message.exchange, ensure=False)
                if message.exchange
                else self._pub.default_exchange
            )
            # a confirm lost with the connection: published again (a second copy is settled
            # when it arrives, like the first)
            await qlm_amqp.publish_confirmed(
                self._conn,
                exchange,
                copy,
                message.routing_key or "",
                within_s=REPLY_REPUBLISH_S,
            )
        except Exception as exc:  # the worn delivery stays; its next redelivery tries again
            log.warning("refresh_failed", request_id=rid, error=repr(exc)[:200])
            return
        # The copy is on disk: it holds the request now (it arrives as a redelivery and takes
        # over the handle, or finds the answer on record). The worn delivery goes, whether or
        # not it is still the handle; one already acked with the answer fails here, locally.
        await self._ack_quietly(message)
        self.metrics.observe_refreshed()
        log.info(
            "delivery_refreshed",
            request_id=rid,
            count=count,
            refreshes=refreshes,
        )

    async def _reject(
        self,
        message: AbstractIncomingMessage,
        bad: InvalidRequest,
        now: float,
        req: RequestMessage | None = None,
    ) -> None:
        """Invalid input: error reply (when there is a reply_to), a dead-letter copy carrying
        the reason, then ack: the message can never succeed, so it must not be redelivered."""
        assert self._pub is not None and self._topology is not None
        log.warning(
            "request_rejected", request_id=bad.request_id, code=bad.code.value, reason=bad.message
        )
        # Only what can be published again: properties that are not UTF-8 on the wire are left
        # out (kept escaped in x-qlm-raw-properties), reserved headers dropped.
        props = dead_letter_properties(message)
        props["headers"][REASON_HEADER] = bad.code.value
        props["headers"][REASON_TEXT_HEADER] = bad.message[:1000]
        dead_copy = self._topology.dlx.publish(
            aio_pika.Message(message.body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, **props),
            routing_key="",
            mandatory=False,
        )
        reply_to, correlation_id = reply_route(message)
        # never into a queue its producer may not use (qlm's own, another tenant's)
        reply_to = self.identity.reply_route(reply_to, _user_id(message))
        if reply_to:
            err = ErrorMessage(
                request_id=bad.request_id, code=bad.code, message=bad.message, details=bad.details
            )
            # The same id for the same refused delivery: if a crash comes before the ack, the
            # redelivery's error reply is a copy the producer's client drops, not a second one.
            reply_id = hashlib.sha256(
                b"\0".join(
                    (
                        message.body,
                        reply_to.encode(),
                        (correlation_id or "").encode(),
                        bad.code.value.encode(),
                    )
                )
            ).hexdigest()[:32]
            reply = self._reply(reply_to, correlation_id or bad.request_id, err, reply_id=reply_id)
            # Both confirmed before the ack, awaited together: under overload this is the hot
            # path, and one confirm round trip instead of two sheds about twice as fast.
            await asyncio.gather(reply, dead_copy)
        else:
            await dead_copy
        await message.ack()
        self.store.record_rejected(
            bad.request_id, bad.code.value, now, {"message": bad.message, **(bad.details or {})}
        )
        self.metrics.observe_outcome("rejected")
        log_request_outcome(
            "rejected",
            request_id=bad.request_id,
            tenant=None if req is None else req.tenant,
            model=None if req is None else req.model,
            slo_class=None if req is None else req.slo.slo_class,
            latency_s=time.time() - now,
            met=False,
            code=bad.code.value,
        )

    async def _reply(
        self,
        reply_to: str,
        correlation_id: str | None,
        msg: ResultMessage | ErrorMessage | StoredAnswer,
        *,
        republish_within_s: float = 0.0,
        reply_id: str | None = None,
    ) -> None:
        """Publish one reply and wait for its confirm. With ``republish_within_s``, a reply
        whose confirm was lost with a connection is published again (same ``x-qlm-reply-id``,
        so the producer drops the copy if the first one got through) instead of failing.
        A :class:`StoredAnswer` is published as recorded, under its recorded reply id."""
        assert self._pub is not None and self._conn is not None
        rid: str | None
        if isinstance(msg, StoredAnswer):
            body, rid, kind, reply_id = msg.body, msg.request_id, msg.kind, msg.reply_id
        else:
            body, rid, kind = msg.model_dump_json(), msg.request_id, msg.type
        message = aio_pika.Message(
            body.encode(),
            content_type=CONTENT_TYPE,
            correlation_id=correlation_id,
            message_id=rid,
            type=kind,
            # one id per reply: tells a broker redelivery or a republish of this reply (same
            # id) from a second reply (a bug) at the producer
            headers={REPLY_ID_HEADER: reply_id or uuid.uuid4().hex},
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await qlm_amqp.publish_confirmed(
            self._conn,
            self._pub.default_exchange,
            message,
            reply_to,
            within_s=republish_within_s,
            mandatory=False,  # a producer that went away loses its reply, nothing else
        )

    # ------------------------------------------------------------------ dispatch
    def _pump(self) -> None:
        for order in self.core.next_dispatches(time.time()):
            self._spawn(self._dispatch(order))

    async def _dispatch(self, order: DispatchOrder) -> None:
        assert self._pub is not None
        t = order.tracked
        msg = Dispatch(
            dispatch_id=order.dispatch_id,
            instance_id=order.instance_id,
            attempt=t.attempts,
            request=t.request,
            submitted_at=t.submitted_at,
            queued_at=t.queued_at,
            dispatched_at=t.dispatched_at or time.time(),
            resume_token_ids=t.resume_token_ids,
            deadline=t.plan_view.deadline,
            # only a streamed request's agent learns where replies go: it publishes token
            # chunks there; the result itself still comes from here, exactly once
            reply_routes=(
                [ReplyRoute(reply_to=r, correlation_id=c) for r, c in t.reply_targets()]
                if t.request.stream
                else []
            ),
        )
        try:
            await self._to_agent(order.agent_id, msg.model_dump_json())
        except aio_pika.exceptions.PublishError:
            self._lost_agent(order.agent_id, "dispatch_unroutable")
            return
        except Exception as exc:
            # This coordinator's own channel or connection failed (the agent being gone shows
            # as a returned dispatch, above, or as missed heartbeats): the instance is fine.
            # The request goes back to its queue, and dispatching resumes after a pause
            # rather than spinning on a broken channel. If the agent got it after all, the
            # first result is answered and the second ignored.
            log.warning(
                "dispatch_failed_requeued",
                request_id=t.request_id,
                instance_id=order.instance_id,
                error=repr(exc)[:200],
            )
            if self.core.undo_dispatch(order, time.time()):
                self.metrics.observe_requeue("dispatch_failed")
            # the instance has its credit back even when the request was answered meanwhile:
            # the retry pump uses it without waiting for the liveness loop's
            self._spawn(self._pump_after(DISPATCH_RETRY_S))
            return
        self.store.record_status(
            t.request_id,
            RequestStatus.DISPATCHED,
            msg.dispatched_at,
            instance_id=order.instance_id,
            attempts=t.attempts,
        )

    async def _pump_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self._pump()

    async def _to_agent(self, agent_id: str, body: str) -> None:
        assert self._pub is not None
        exchange = await self._pub.get_exchange(CONTROL_EXCHANGE, ensure=False)
        await exchange.publish(
            aio_pika.Message(body.encode(), content_type=CONTENT_TYPE),
            routing_key=agent_routing_key(agent_id),
            mandatory=True,  # returned if the agent's queue died with its connection
        )

    async def _send_lso(
        self,
        models: list[ModelStateOrder],
        evictions: list[EvictOrder],
        caps: Sequence[BatchCapOrder] = (),
    ) -> None:
        """Carry out the plan's LSOs. Best effort: an order that does not arrive only leaves
        the instance as it was (the request keeps running; the model state and the batch cap
        are resent with the next plan that changes them), so nothing is lost or answered
        twice."""
        for c in caps:
            cap = BatchCap(instance_id=c.instance_id, max_in_engine=c.max_in_engine)
            try:
                await self._to_agent(c.agent_id, cap.model_dump_json())
                log.info("batch_cap_sent", instance_id=c.instance_id, cap=c.max_in_engine)
            except Exception as exc:
                inst = self.core.instances.get(c.instance_id)
                if inst is not None:
                    inst.cap_sent = CAP_UNKNOWN  # the next plan sends its cap again
                log.warning("batch_cap_failed", instance_id=c.instance_id, error=repr(exc))
        for m in models:
            body = ModelPlan(instance_id=m.instance_id, states=m.states)  # type: ignore[arg-type]
            try:
                await self._to_agent(m.agent_id, body.model_dump_json())
                log.info("model_plan_sent", instance_id=m.instance_id, states=m.states)
            except Exception as exc:
                self.core.instances[m.instance_id].model_states_sent = {}
                log.warning("model_plan_failed", instance_id=m.instance_id, error=repr(exc))
        for e in evictions:
            order = Evict(
                instance_id=e.instance_id,
                request_id=e.tracked.request_id,
                dispatch_id=e.dispatch_id,
                mode=e.mode,  # type: ignore[arg-type]
            )
            try:
                await self._to_agent(e.agent_id, order.model_dump_json())
                self.metrics.observe_eviction(e.mode)
                log.info(
                    "evict_sent",
                    request_id=e.tracked.request_id,
                    instance_id=e.instance_id,
                    mode=e.mode,
                )
            except Exception as exc:
                e.tracked.evict_requested = None
                log.warning("evict_failed", request_id=e.tracked.request_id, error=repr(exc))

    async def _stop_stale(self, stale: StaleAttempt) -> None:
        """Stop an attempt a woken agent still runs whose request went on without it (best
        effort: where the order is lost, the attempt runs on and its result is ignored)."""
        order = Evict(
            instance_id=stale.instance_id,
            request_id=stale.request_id,
            dispatch_id=stale.dispatch_id,
            reason="replaced",
        )
        try:
            await self._to_agent(stale.agent_id, order.model_dump_json())
            log.info(
                "stale_attempt_stopped",
                request_id=stale.request_id,
                instance_id=stale.instance_id,
                dispatch_id=stale.dispatch_id,
            )
        except Exception as exc:
            log.warning("stale_attempt_stop_failed", request_id=stale.request_id, error=repr(exc))

    async def _resync_streams(self, resync: StreamResyncOrder) -> None:
        """Ask an agent what the producers of the requests it reported running at its first
        heartbeat here have been streamed (docs/protocol.md, "Token streams"). Best effort:
        where the order or its answer is lost, such a request, should its agent be lost too,
        resumes from its last resume point, as before."""
        try:
            for at in range(0, len(resync.request_ids), MAX_RESYNC_REQUESTS):
                ids = resync.request_ids[at : at + MAX_RESYNC_REQUESTS]
                order = StreamResync(instance_id=resync.instance_id, request_ids=ids)
                await self._to_agent(resync.agent_id, order.model_dump_json())
            log.info(
                "stream_resync_sent",
                agent_id=resync.agent_id,
                instance_id=resync.instance_id,
                requests=len(resync.request_ids),
            )
        except Exception as exc:
            log.warning("stream_resync_failed", agent_id=resync.agent_id, error=repr(exc))

    # ------------------------------------------------------------------ stream tap
    async def _on_stream_tap(self, message: AbstractIncomingMessage) -> None:
        """A copy of a token-stream message an agent sent a producer (or a barrier of ours):
        the core follows each streamed request's output as its producer receives it. Best
        effort, like the chunks: a message that is not one is counted and dropped."""
        if message.type == TAP_BARRIER_TYPE:
            waiter = self._tap_waiters.pop(message.message_id or "", None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            return
        self.tap_messages += 1
        try:
            if len(message.body) > self.max_body_bytes:
                raise ValueError("body too large")
            chunks = decode_token_message(message.body, message.correlation_id)
        except (ValidationError, ValueError) as exc:
            self.tap_rejected += 1
            self.metrics.observe_stream_tap("dropped")
            log.warning("stream_tap_message_dropped", error=str(exc)[:300])
            return
        self.metrics.observe_stream_tap("read")
        for _, chunk in chunks:
            self.core.on_streamed(chunk.request_id, chunk.offset, chunk.token_ids, chunk.attempt)
        ended = (message.headers or {}).get(STREAM_END_HEADER)
        if isinstance(ended, list):
            for rid in ended[: len(chunks)]:
                self.core.on_stream_end(_text(rid))

    async def _tap_barrier(self, timeout_s: float = TAP_BARRIER_TIMEOUT_S) -> bool:
        """Wait until the tap has been read up to now: a marker published to its end comes back
        after every chunk routed there before it (one queue, one consumer, in order). False
        after ``timeout_s`` (a standby holds the tap, the broker is slow): go on without."""
        assert self._pub is not None
        marker = uuid.uuid4().hex
        waiter = self._tap_waiters[marker] = asyncio.get_running_loop().create_future()
        try:
            await self._pub.default_exchange.publish(
                aio_pika.Message(
                    b"", type=TAP_BARRIER_TYPE, message_id=marker, expiration=timeout_s
                ),
                routing_key=STREAM_TAP_QUEUE,
                mandatory=False,
            )
            await asyncio.wait_for(waiter, timeout_s)
            return True
        except Exception as exc:
            log.warning("stream_tap_barrier_missed", error=repr(exc)[:200])
            return False
        finally:
            self._tap_waiters.pop(marker, None)

    def _lost_agent(self, agent_id: str, reason: str) -> None:
        """An agent is gone: its work goes elsewhere. Where some of it streams, first read the
        chunks it sent before it went (the tap barrier), so that those requests resume after
        the tokens their producers have."""
        streaming = any(
            (t := self.core.requests.get(rid)) is not None and t.request.stream
            for inst in self.core.instances.values()
            if inst.info.agent_id == agent_id and inst.status != "lost"
            for rid in inst.running
        )
        if not streaming:
            self._lose_agent(agent_id, reason)
            return

        async def after_tap() -> None:
            await self._tap_barrier()
            self._lose_agent(agent_id, reason)

        self._spawn(after_tap())

    def _lose_agent(self, agent_id: str, reason: str) -> None:
        now = time.time()
        lost = [
            i.instance_id
            for i in self.core.instances.values()
            if i.info.agent_id == agent_id and i.status != "lost"
        ]
        moved = self._end_cancelled(self.core.lose_agent(agent_id, reason, now))
        for iid in lost:
            self._record_instance(iid, "lost", now)
        for t in moved:
            self.store.record_status(
                t.request_id, RequestStatus.REQUEUED, now, detail={"reason": reason}
            )
            self.metrics.observe_requeue(reason)
        self._pump()

    # ------------------------------------------------------------------ control
    async def _on_control(self, message: AbstractIncomingMessage) -> None:
        await self._guarded(message, self._control, requeue_on_error=False)

    async def _control(self, message: AbstractIncomingMessage) -> None:
        try:
            ctl = to_coordinator_adapter.validate_json(message.body)
        except ValidationError as exc:
            log.warning("bad_control_message", error=str(exc)[:500])
            await message.reject(requeue=False)
            return
        now = time.time()
        if self._active_since is None:
            self._active_since = now
        if isinstance(ctl, Heartbeat):
            for iid in self.core.on_heartbeat(ctl, now):
                self._record_instance(iid, "alive", now)
            await message.ack()
            self._pump()
            for stale in self.core.take_stale_attempts():
                self._spawn(self._stop_stale(stale))
            for resync in self.core.take_stream_resyncs():
                self._spawn(self._resync_streams(resync))
        elif isinstance(ctl, Pull):
            self.core.on_pull(ctl.instance_id, ctl.credit)
            await message.ack()
            self._pump()
        elif isinstance(ctl, Completion):
            # Ack the control message only once the reply is out: a crash before then leaves
            # the completion in the durable control queue for the next coordinator.
            self._spawn(self._complete(ctl, message))
        elif isinstance(ctl, Failure):
            self._spawn(self._fail(ctl, message))
        elif isinstance(ctl, Evicted):
            t = self.core.on_evicted(ctl, now)
            if t is not None and t.cancel_requested:
                self._spawn(self._answer_cancelled(t, message))
                return
            if t is not None:
                self.store.record_status(
                    t.request_id,
                    RequestStatus.REQUEUED,
                    now,
                    detail={"reason": ctl.reason, "resume_tokens": len(t.resume_token_ids)},
                )
                self.metrics.observe_requeue(ctl.reason)
            await message.ack()
            self._pump()
        elif isinstance(ctl, Goodbye):
            self._lost_agent(ctl.agent_id, "goodbye")
            await message.ack()

    async def _complete(self, c: Completion, ctl_msg: AbstractIncomingMessage) -> None:
        rid = c.request_id
        if rid not in self.core.requests and rid not in self.core.answered:
            # A result for a request not tracked here: answered already (a result left in
            # the control queue by a coordinator that died after answering), or its request
            # is yet to be redelivered (a takeover).
            try:
                stored = await self.store.answers.lookup(rid)
            except AnswerLogUnavailable:
                stored = None
            if stored is not None and rid not in self.core.requests:
                log.info("result_for_answered_request_dropped", request_id=rid)
                self.metrics.observe_answered_again("leftover_result")
                self.core.answered[rid] = None
                await ctl_msg.ack()
                return
        if rid not in self.core.requests and rid not in self.core.answered:
            previous = self._orphans.pop(rid, None)
            if previous is not None:
                with contextlib.suppress(Exception):
                    await previous[1].ack()
            if len(self._orphans) >= MAX_ORPHANS:  # bounded: the oldest's work is repeated
                oldest = min(self._orphans, key=lambda k: self._orphans[k][2])
                with contextlib.suppress(Exception):
                    await self._orphans.pop(oldest)[1].ack()
            self._orphans[rid] = (c, ctl_msg, time.monotonic())
            log.info("result_held_for_request", request_id=rid, instance_id=c.instance_id)
            return
        # accepted exactly once, judged and learned from in the core, as in the simulator
        done = self.core.complete(c)
        if done is None:
            log.info("duplicate_result_ignored", request_id=c.request_id, instance_id=c.instance_id)
            await ctl_msg.ack()
            return
        t, first_token_at, outcome = done
        result = ResultMessage(
            request_id=t.request_id,
            model=t.request.model,
            output_text=c.output_text,
            output_token_ids=c.output_token_ids,
            finish_reason=c.finish_reason,
            usage=Usage(prompt_tokens=c.prompt_tokens, completion_tokens=len(c.output_token_ids)),
            timestamps=Timestamps(
                submitted=t.submitted_at,
                queued=t.queued_at,
                started=c.started_at,
                first_token=first_token_at,
                finished=c.finished_at,
            ),
            slo=outcome,
            instance_id=c.instance_id,
            attempts=max(t.attempts, 1),
        )
        if not await self._answer(t, result, ctl_msg):
            return
        self.store.record_finished(
            t.request_id,
            RequestStatus.COMPLETED,
            time.time(),
            instance_id=c.instance_id,
            attempts=t.attempts,
            started_at=c.started_at,
            first_token_at=first_token_at,
            finished_at=c.finished_at,
            output_tokens=len(c.output_token_ids),
            slo_met=outcome.met,
        )
        self.metrics.observe_outcome("completed")
        self.metrics.observe_slo(t.request.slo.slo_class or "default", outcome.met)
        self.capacity.on_finished(t.request.model, outcome.met)
        if outcome.task_met is not None:
            self.metrics.observe_task(outcome.task_met)
        if t.dispatched_at is not None:
            self.metrics.observe_dispatch_latency(max(0.0, c.started_at - t.dispatched_at))
        self.metrics.observe_request(
            model=t.request.model,
            slo_class=t.request.slo.slo_class,
            tenant=t.request.tenant,
            queue_s=c.started_at - t.submitted_at,
            ttft_s=None if outcome.ttft_ms is None else outcome.ttft_ms / 1000,
            tpot_s=None if outcome.tbt_ms is None else outcome.tbt_ms / 1000,
            e2e_s=None if outcome.e2e_ms is None else outcome.e2e_ms / 1000,
        )
        request_log(
            "answered",
            t,
            instance_id=c.instance_id,
            latency_s=None if outcome.e2e_ms is None else outcome.e2e_ms / 1000,
            met=outcome.met,
        )

    async def _fail(self, f: Failure, ctl_msg: AbstractIncomingMessage) -> None:
        t = self.core.accept_result(f.request_id, f.dispatch_id)
        if t is None:
            await ctl_msg.ack()
            return
        err = ErrorMessage(request_id=t.request_id, code=ErrorCode.ENGINE_ERROR, message=f.message)
        self.core.collective.finished(t.request, 0, time.time())
        if not await self._answer(t, err, ctl_msg):
            return
        self.store.record_finished(
            t.request_id,
            RequestStatus.FAILED,
            time.time(),
            instance_id=f.instance_id,
            attempts=t.attempts,
            started_at=None,
            first_token_at=None,
            finished_at=None,
            output_tokens=0,
            slo_met=False,
            error_code=ErrorCode.ENGINE_ERROR.value,
        )
        self.metrics.observe_outcome("failed")
        request_log(
            "failed", t, instance_id=f.instance_id, met=False, code=ErrorCode.ENGINE_ERROR.value
        )

    # ------------------------------------------------------------------ unserved models
    def _unserved_hold_until(self, model: str, now: float) -> float | None:
        """None when ``model`` is served (or the rule is off); else until when a request for
        it may wait for an agent: the hold, and at least the grace after this start."""
        if self.unserved_model_hold_s is None or model in self.core.served_models():
            return None
        active = self._registering_since(now)
        return max(now + self.unserved_model_hold_s, active + self.unserved_model_grace_s)

    def _not_served(self, model: str, request_id: str | None) -> InvalidRequest:
        served = sorted(self.core.served_models())
        waited = f" within {self.unserved_model_hold_s:g} s" if self.unserved_model_hold_s else ""
        return InvalidRequest(
            ErrorCode.MODEL_NOT_SERVED,
            f"no live agent serves model {model!r}{waited}; served now: "
            f"{', '.join(served) or 'none'}",
            request_id,
            {"model": model, "served": served},
        )

    def _engine_context(self, model: str) -> int | None:
        """The most context (prompt + max_tokens) a live engine serving ``model`` takes: the
        largest max_model_len they report (vLLM's). None where one reports none (it takes
        what the catalog allows, which stands alone then) or none serves the model. Engines
        of one model may differ (--max-model-len per pool): the core places a request only
        where it fits (``CoordinatorCore._fits``), so it is refused only where none would."""
        reported = []
        for inst in self.core.served_models().get(model, ()):
            limit = inst.info.max_model_len.get(model)
            if limit is None:
                return None
            reported.append(limit)
        return max(reported) if reported else None

    def _beyond_engine_context(self, req: RequestMessage) -> InvalidRequest | None:
        """``prompt_too_long`` for a request the catalog allows but no live engine serving
        its model would take (all started with a shorter --max-model-len): said at
        admission, with the limit, rather than as an ``engine_error`` from an engine. The
        limit is the one GET /v1/models lists, the largest over the live engines."""
        limit = self._engine_context(req.model)
        if limit is None:
            return None
        prompt_tokens = req.prompt_tokens()
        if prompt_tokens + req.max_tokens <= limit:
            return None
        return InvalidRequest(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt ({prompt_tokens} tokens) + max_tokens ({req.max_tokens}) exceeds the "
            f"context of every engine serving {req.model} ({limit}: the largest "
            "--max-model-len among them, as GET /v1/models lists it)",
            req.request_id,
            {"max_model_len": limit, "prompt_tokens": prompt_tokens, "max_tokens": req.max_tokens},
        )

    def served_model_list(self) -> list[ServedModel]:
        """The catalog models live instances serve (a model an agent offers that the catalog
        lacks is refused `unknown_model`: left out), each with the most context a request can
        use: the largest any live instance's engine takes (engines started with a shorter
        --max-model-len take less; a longer request goes to one that takes it), never more
        than the catalog's max_context (the coordinator refuses beyond that, whatever the
        engines)."""
        served = []
        for model, instances in sorted(self.core.served_models().items()):
            if model not in self.catalog:
                continue
            limit = self.catalog.get(model).max_context
            engines = self._engine_context(model)
            if engines is not None:
                limit = min(limit, engines)
            served.append(ServedModel(id=model, max_model_len=limit, instances=len(instances)))
        return served

    def _announce_models(self, now: float) -> None:
        """Tell the gateways what is served: on a change, else every SERVED_MODELS_INTERVAL_S.
        Not while standing by, nor in the grace after becoming active, while agents are still
        registering: the gateways keep the last list (of the coordinator before this one)
        until it goes stale."""
        if (
            self._models_exchange is None
            or self._active_since is None  # a standby: the active coordinator announces
            or now < self._registering_since(now) + self.unserved_model_grace_s
        ):
            return
        models = self.served_model_list()
        if self._announced is not None:
            last, at = self._announced
            if last == models and now - at < SERVED_MODELS_INTERVAL_S:
                return
        self._announced = (models, now)
        msg = ServedModels(sent_at=now, valid_s=SERVED_MODELS_INTERVAL_S * 5, models=models)
        exchange = self._models_exchange

        async def send() -> None:
            try:
                await exchange.publish(
                    aio_pika.Message(msg.model_dump_json().encode(), content_type=CONTENT_TYPE),
                    routing_key="",
                    mandatory=False,
                )
            except Exception as exc:  # the next tick sends it again
                log.warning("served_models_not_sent", error=repr(exc)[:200])

        self._spawn(send())

    def _expire_unserved(self, now: float) -> None:
        """Held requests whose model is still not served when their hold ends are answered
        ``model_not_served``; those whose model came up (or that left the queue) are let be."""
        if not self._held_unserved:
            return
        served = self.core.served_models()
        for rid, until in list(self._held_unserved.items()):
            t = self.core.requests.get(rid)
            if t is None or t.request.model in served or until > now:
                if t is None or t.request.model in served:
                    del self._held_unserved[rid]
                continue
            del self._held_unserved[rid]
            withdrawn = self.core.withdraw(rid)
            if withdrawn is not None:
                self._spawn(self._answer_not_served(withdrawn))

    async def _answer_not_served(self, t: TrackedRequest) -> None:
        bad = self._not_served(t.request.model, t.request_id)
        err = ErrorMessage(
            request_id=t.request_id, code=bad.code, message=bad.message, details=bad.details
        )
        log.warning("request_not_served", request_id=t.request_id, model=t.request.model)
        self.core.collective.finished(t.request, 0, time.time())
        if not await self._answer(t, err, None):
            return
        self.store.record_finished(
            t.request_id,
            RequestStatus.REJECTED,
            time.time(),
            instance_id=None,
            attempts=t.attempts,
            started_at=None,
            first_token_at=None,
            finished_at=None,
            output_tokens=0,
            slo_met=False,
            error_code=bad.code.value,
        )
        self.metrics.observe_outcome("rejected")
        request_log("rejected", t, met=False, code=bad.code.value)
        self._pump()

    # ------------------------------------------------------------------ cancels
    async def _on_cancel(self, cancel: CancelMessage, message: AbstractIncomingMessage) -> None:
        rid = cancel.request_id
        try:
            tenant = self.identity.tenant_of(cancel.tenant, _user_id(message), rid)
        except InvalidRequest as bad:  # a cancel gets no reply: dead-lettered with the reason
            log.warning("cancel_refused", request_id=rid, code=bad.code.value)
            self.metrics.observe_cancel_refused()
            await message.ack()
            return
        outcome, t, order = self.core.cancel(rid, tenant)
        log.info("cancel_received", request_id=rid, outcome=outcome, reason=cancel.reason)
        if outcome == "refused":  # another tenant's request: cancels are the owner's alone
            self.metrics.observe_cancel_refused()
        if not await self._carry_out_cancel(rid, outcome, t, order, cancel.reason, message):
            await message.ack()

    async def _carry_out_cancel(
        self,
        rid: str,
        outcome: str,
        t: TrackedRequest | None,
        order: EvictOrder | None,
        reason: str | None,
        message: AbstractIncomingMessage | None,
    ) -> bool:
        """What ``core.cancel``'s outcome asks for: a waiting request is answered
        ``cancelled`` now (True: that answer acked ``message``), a running one is evicted."""
        if outcome == "cancelled" and t is not None:
            await self._answer_cancelled(t, message, reason)
            return True
        if order is not None:
            evict = Evict(
                instance_id=order.instance_id,
                request_id=rid,
                dispatch_id=order.dispatch_id,
                mode="evict",
            )
            try:
                await self._to_agent(order.agent_id, evict.model_dump_json())
            except Exception as exc:  # the agent is gone: liveness ends it, cancelled
                log.warning("cancel_evict_failed", request_id=rid, error=repr(exc))
        return False

    def _end_cancelled(self, moved: list[TrackedRequest]) -> list[TrackedRequest]:
        """Requests requeued from a lost instance: those cancelled while they ran are answered
        ``cancelled`` instead; the others are returned."""
        kept = []
        for t in moved:
            if t.cancel_requested and self.core.end_cancelled(t):
                self._spawn(self._answer_cancelled(t, None))
            else:
                kept.append(t)
        return kept

    async def _answer_cancelled(
        self, t: TrackedRequest, ctl_msg: AbstractIncomingMessage | None, reason: str | None = None
    ) -> None:
        err = ErrorMessage(
            request_id=t.request_id,
            code=ErrorCode.CANCELLED,
            message="cancelled by its producer" + (f": {reason}" if reason else ""),
        )
        self.core.collective.finished(t.request, 0, time.time())
        if not await self._answer(t, err, ctl_msg):
            return
        self.store.record_finished(
            t.request_id,
            RequestStatus.CANCELLED,
            time.time(),
            instance_id=t.instance_id,
            attempts=t.attempts,
            started_at=None,
            first_token_at=None,
            finished_at=None,
            output_tokens=0,
            slo_met=False,
            error_code=ErrorCode.CANCELLED.value,
        )
        self.metrics.observe_outcome("cancelled")
        request_log("cancelled", t, met=False, code=ErrorCode.CANCELLED.value)
        self._pump()

    async def _reply_cancelled_on_arrival(
        self, req: RequestMessage, message: AbstractIncomingMessage, now: float
    ) -> None:
        """A request whose cancel arrived first: one ``cancelled`` reply, then the ack."""
        err = ErrorMessage(
            request_id=req.request_id,
            code=ErrorCode.CANCELLED,
            message="cancelled by its producer before it was queued",
        )
        if message.reply_to:
            try:
                stored = await self._record_answer(req.request_id, req.tenant, err)
                await self._reply(
                    message.reply_to,
                    message.correlation_id,
                    stored,
                    republish_within_s=REPLY_REPUBLISH_S,
                )
            except Exception:
                log.exception("reply_failed", request_id=req.request_id)
                await message.nack(requeue=True)
                return
        self.core.finish(req.request_id)
        self.metrics.observe_outcome("cancelled")
        log_request_outcome(
            "cancelled",
            request_id=req.request_id,
            tenant=req.tenant,
            model=req.model,
            slo_class=req.slo.slo_class,
            latency_s=time.time() - now,
            met=False,
            code=ErrorCode.CANCELLED.value,
        )
        await message.ack()

    async def _record_answer(
        self, request_id: str, tenant: str | None, msg: ResultMessage | ErrorMessage
    ) -> StoredAnswer:
        """Commit the reply to the durable answer record before it is published; returns the
        answer on record (an earlier one if the request was answered before: then that one
        is published again, never a second answer)."""
        mine = StoredAnswer(
            request_id=request_id,
            reply_id=uuid.uuid4().hex,
            tenant=tenant,
            kind=msg.type,
            body=msg.model_dump_json(),
            answered_at=time.time(),
        )
        stored = await self.store.answers.record(mine)
        if stored.reply_id != mine.reply_id:
            log.warning("answer_already_recorded", request_id=request_id, kind=stored.kind)
            self.metrics.observe_answered_again("ran_twice")
        return stored

    async def _answer(
        self,
        t: TrackedRequest,
        msg: ResultMessage | ErrorMessage,
        ctl_msg: AbstractIncomingMessage | None,
    ) -> bool:
        """Record the one reply durably, publish it with a confirm, then ack the request's
        delivery (docs/architecture.md, "Exactly once")."""
        try:
            stored = await self._record_answer(t.request_id, t.request.tenant, msg)
        except AnswerLogUnavailable as exc:
            # Never publish an answer that is not on record: a restart could answer again.
            # The request stays unacked and runs again once the database is back.
            log.error("answer_not_recorded", request_id=t.request_id, error=str(exc)[:300])
            self.core.release_answering(t.request_id)
            self._pump()
            if ctl_msg is not None:
                with contextlib.suppress(Exception):
                    await ctl_msg.ack()
            return False
        if t.reply_to or t.duplicates:
            try:
                for reply_to, correlation_id in t.reply_targets():
                    # A reply that may have got through must not be followed by a second
                    # one from running the request again: publish the same reply again.
                    await self._reply(
                        reply_to, correlation_id, stored, republish_within_s=REPLY_REPUBLISH_S
                    )
            except Exception:
                log.exception("reply_failed", request_id=t.request_id)
                self.core.release_answering(t.request_id)
                self._pump()
                if ctl_msg is not None:
                    with contextlib.suppress(Exception):
                        await ctl_msg.ack()
                return False
        await self._ack_delivery(t)
        self.core.finish(t.request_id)
        if ctl_msg is not None:
            with contextlib.suppress(Exception):
                await ctl_msg.ack()
        return True

    async def _answer_again(
        self,
        stored: StoredAnswer,
        req: RequestMessage,
        message: AbstractIncomingMessage,
        now: float,
    ) -> None:
        """A request already answered (before a restart or takeover, or a producer's
        re-publish of its id): the recorded reply again, under its recorded reply id, which
        the producer's client drops if it has it; then the ack. Nothing runs."""
        if (stored.tenant or "") != (req.tenant or ""):
            err = InvalidRequest(
                ErrorCode.DUPLICATE_REQUEST_ID,
                "this request_id was answered for another tenant; choose a unique id",
                req.request_id,
            )
            await self._reject(message, err, now)
            return
        if message.reply_to:
            await self._reply(
                message.reply_to,
                message.correlation_id,
                stored,
                republish_within_s=REPLY_REPUBLISH_S,
            )
        await message.ack()
        self.core.finish(req.request_id)  # not tracked: only remembered as answered
        reason = "redelivered" if message.redelivered else "republished"
        self.metrics.observe_answered_again(reason)
        log.info("answered_from_record", request_id=req.request_id, reason=reason)
        held = self._orphans.pop(req.request_id, None)
        if held is not None:  # its result, left in the control queue, is a leftover
            with contextlib.suppress(Exception):
                await held[1].ack()

    async def _ack_once(self, message: AbstractIncomingMessage) -> None:
        """Ack a global-queue delivery; callers at the same time share one ``basic.ack``.
        aio-pika marks a message acked only once its ack is sent, so two tasks acking it
        together (the answer and a refresh, say) would send its delivery tag twice, and the
        broker closes the channel on an unknown tag, returning every other unacked delivery
        on it (counted toward the delivery limit)."""
        key = id(message)
        sending = self._acks.get(key)
        if sending is not None:  # another task is sending this very ack: wait for it
            await sending.wait()
            if not message.processed:
                raise RuntimeError("the ack of this delivery failed")
            return
        sending = self._acks[key] = asyncio.Event()
        try:  # the first caller sends it itself: no extra hop on the answer's path
            await message.ack()
        finally:
            del self._acks[key]
            sending.set()

    async def _ack_quietly(self, message: AbstractIncomingMessage) -> None:
        with contextlib.suppress(Exception):
            await self._ack_once(message)

    async def _ack_delivery(self, t: TrackedRequest) -> None:
        for _ in range(2):
            delivery = t.delivery
            try:
                await self._ack_once(delivery)
                return
            except Exception:
                # The channel that carried it is gone; if the broker already redelivered it,
                # admit() swapped in the new handle: ack that one. Otherwise the redelivery
                # will find the id in `answered` and be acked without a reply.
                if t.delivery is delivery:
                    return

    def _schedule_replan(self) -> None:
        """Replan soon, once: arrivals that ask for it while one is pending share it. A replan
        runs on the event loop, so automatic ones are spaced out: at least 1 s apart, at most
        ~20 % of the time (5x the last replan's duration), leaving the rest to ingest and
        dispatch; callers ask ``core.replan_wanted`` first (the policy wants one and the
        queues hold work). It is asked again on the next arrival or liveness tick."""
        if self._replan_pending or self._stopping:
            return
        if time.monotonic() - self._last_auto_replan < max(1.0, 5 * self._last_replan_s):
            return
        self._replan_pending = True

        async def run() -> None:
            await asyncio.sleep(0)  # let the current burst of deliveries be admitted first
            try:
                await self.replan()
            finally:
                self._replan_pending = False
                self._last_auto_replan = time.monotonic()

        self._spawn(run())

    # ------------------------------------------------------------------ liveness
    def _on_connection_lost(self, *_: Any) -> None:
        self._restoring = True

    def _on_reconnected(self, _: Any) -> None:
        now = time.time()
        self._restoring = False
        self._reconnected_at = now
        self.core.excuse_silence(now)
        log.info("coordinator_reconnected_agents_excused", instances=len(self.core.instances))

    def _registering_since(self, now: float) -> float:
        """Since when (unix s) agents register with this coordinator: since it became active
        (``now`` while standing by), or since its broker connection came back if later."""
        active = now if self._active_since is None else self._active_since
        return active if self._reconnected_at is None else max(active, self._reconnected_at)

    def _deaf(self) -> bool:
        """This coordinator cannot hear heartbeats now: its own connection is down, or back
        but its consumers not restored yet (after a quorum leader's loss the control queue's
        consumer came back 9 s after the transport: every instance was declared lost
        meanwhile, and requests arriving then were refused ``model_not_served``)."""
        conn = self._conn
        return conn is not None and (self._restoring or not conn.connected.is_set())

    async def _liveness_loop(self) -> None:
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(self.liveness_interval_s)
            tick = time.monotonic()
            gap, last_tick = tick - last_tick, tick
            lagged = gap > 2 * self.liveness_interval_s + 0.5
            now = time.time()
            if self.core.replan_wanted(now):
                self._schedule_replan()
            lifted = self.core.lapsed_cap_orders(now)
            if lifted:  # a cap whose reason lapsed goes without a replan
                self._spawn(self._send_lso([], [], lifted))
            if lagged:
                # This loop was blocked (e.g. a long replan): heartbeats that arrived meanwhile
                # are still waiting in the broker. Judge liveness on the next tick, not now.
                log.warning("liveness_check_skipped", lag_s=round(gap, 3))
                self._refresh_gauges()  # the metrics still follow the latest heartbeats
                continue
            if self._deaf():
                # No heartbeat can arrive while the connection is down: silence is this
                # coordinator's, not the agents' (after a node loss every agent would
                # otherwise be declared lost, its work requeued, its models unserved).
                self.core.excuse_silence(now)
            if self.core.promote_due(now):
                self._pump()
            self.core.collective.expire(now)
            for iid, moved in self.core.check_liveness(now):
                self._record_instance(iid, "lost", now)
                for t in self._end_cancelled(moved):
                    self.store.record_status(
                        t.request_id,
                        RequestStatus.REQUEUED,
                        now,
                        detail={"reason": "heartbeat_timeout"},
                    )
                    self.metrics.observe_requeue("heartbeat_timeout")
            await self._expire_orphans()
            self._expire_unserved(now)
            self._announce_models(now)
            if time.monotonic() - self._last_prune > ANSWER_PRUNE_INTERVAL_S:
                self._last_prune = time.monotonic()
                self._spawn(self._prune_answers())
            if self.core.instances:
                self._pump()
            self._refresh_gauges()

    async def _prune_answers(self) -> None:
        """Forget answers older than the retention: their requests were acked long ago."""
        try:
            n = await self.store.answers.prune(time.time() - self.answer_retention_s)
        except Exception as exc:
            log.warning("answer_prune_failed", error=repr(exc)[:200])
            return
        if n:
            log.info("answers_pruned", count=n, retention_s=self.answer_retention_s)

    async def _expire_orphans(self) -> None:
        """A held result whose request never came (it was answered before a restart and fell
        out of the answered set, or its request was dead-lettered) is dropped after a while."""
        cutoff = time.monotonic() - ORPHAN_TTL_S
        for rid, (_, msg, held_at) in list(self._orphans.items()):
            if held_at < cutoff:
                del self._orphans[rid]
                log.info("held_result_dropped", request_id=rid)
                with contextlib.suppress(Exception):
                    await msg.ack()

    def _record_instance(self, instance_id: str, status: str, at: float) -> None:
        info = self.core.instances[instance_id].info
        self.store.upsert_instance(
            instance_id=instance_id,
            agent_id=info.agent_id,
            engine=info.engine,
            gpu_type=info.gpu_type,
            gpu_memory_gb=info.gpu_memory_gb,
            models=info.models,
            kv_capacity_tokens=info.kv_capacity_tokens,
            max_batch_size=info.max_batch_size,
            status=status,
            at=at,
        )

    def _refresh_gauges(self) -> None:
        self.metrics.sync_core_counts(
            stream_resumes=self.core.stream_resumes,
            late_results_refused=self.core.late_results_refused,
            stale_attempts_stopped=self.core.stale_attempts_stopped,
        )
        for iid, depth in self.core.queue_depths().items():
            self.metrics.set_queue_depth(iid, depth)
        self.metrics.set_state_counts(self.core.state_counts())
        self.metrics.set_instances_alive(
            sum(1 for i in self.core.instances.values() if i.status != "lost")
        )
        self.metrics.set_unacked(len(self.core.requests))
        for iid, inst in self.core.instances.items():
            st = inst.last_status
            if inst.status == "lost" or st is None:
                self.metrics.remove_instance_engine(iid)
                continue
            cap = inst.info.kv_capacity_tokens
            self.metrics.set_instance_engine(
                iid,
                running=st.running,
                waiting=st.waiting,
                kv_usage=min(1.0, st.kv_used_tokens / cap) if cap > 0 else 0.0,
            )

    # ------------------------------------------------------------------ admin backend
    def list_instances(self) -> list[dict[str, Any]]:
        out = []
        for inst in self.core.instances.values():
            st = inst.last_status
            out.append(
                {
                    "instance_id": inst.instance_id,
                    "agent_id": inst.info.agent_id,
                    "engine": inst.info.engine,
                    "gpu_type": inst.info.gpu_type,
                    "models": list(inst.info.models),
                    "status": inst.status,
                    # draining because its engine does not answer (lifted when it does)
                    "engine_down": inst.engine_down,
                    "active_model": st.active_model if st else None,
                    "running": st.running if st else 0,
                    "waiting": st.waiting if st else 0,
                    "queued": len(inst.queue),
                    "kv_used_tokens": st.kv_used_tokens if st else 0,
                    "kv_capacity_tokens": inst.info.kv_capacity_tokens,
                    # per model, the context the engine takes, where it says: a request
                    # beyond it is never sent there
                    "max_model_len": dict(inst.info.max_model_len),
                    "last_seen": inst.last_seen,
                    # the pull protocol's state: a credit held at 0 while the agent says it
                    # granted some is a stall (docs/reliability.md)
                    "credit": inst.credit,
                    "credit_outstanding": st.credit_outstanding if st else None,
                    "dispatches_in_transit": inst.in_transit(st) if st else None,
                    # what the engine can do for the LSOs, and why something is off
                    "capabilities": dict(inst.info.capabilities),
                    "capability_notes": list(inst.info.capability_notes),
                    "warm_models": st.warm_models if st else None,
                    "model_states": dict(inst.model_states_sent),
                }
            )
        return out

    def list_queues(self, limit: int = 1000) -> list[dict[str, Any]]:
        out = []
        for iid in [*self.core.instances, None]:
            entries = []
            for pos, t in enumerate(self.core.queued_requests(iid)):
                if pos >= limit:
                    break
                v = t.plan_view
                entries.append(
                    {
                        "request_id": t.request_id,
                        "model": v.model,
                        "slo_class": v.slo_class,
                        "deadline": v.deadline,
                        "prompt_tokens": v.prompt_tokens,
                        "max_tokens": v.max_tokens,
                        "position": pos,
                    }
                )
            draining = iid is not None and self.core.instances[iid].status != "alive"
            out.append({"instance_id": iid, "draining": draining, "requests": entries})
        return out

    async def get_request(self, request_id: str) -> dict[str, Any] | None:
        record = await self.store.get_request(request_id)
        t = self.core.requests.get(request_id)
        if t is None:
            return record
        live = {
            "request_id": request_id,
            "state": t.state.value,
            "instance_id": t.instance_id,
            "attempts": t.attempts,
            "model": t.request.model,
        }
        return {**(record or {}), "live": live}

    async def replan(self) -> dict[str, Any]:
        """A full replan. The policy computes it in a worker thread, so the event loop keeps
        taking deliveries, heartbeats and results meanwhile (the core holds arrivals back from
        the policy until the plan is adopted: ``begin_plan``); one replan at a time."""
        async with self._replan_lock:
            start = time.perf_counter()
            now = time.time()
            before = dict(self.core.plan_arrivals)
            requests, instances = self.core.begin_plan()
            try:
                plan = await asyncio.to_thread(self.core.policy.plan, requests, instances, now)
            except BaseException:
                self.core.abort_plan(time.time())
                raise
            finally:
                after = self.core.plan_arrivals
                self.metrics.observe_plan_arrivals(
                    after["started"] - before["started"], after["waited"] - before["waited"]
                )
            self.core.adopt_plan(plan, time.time())
        duration = time.perf_counter() - start
        n = len(plan.assigned_ids()) + len(plan.unassigned)
        self.store.record_plan(
            plan_id=plan.plan_id,
            policy=plan.policy,
            created_at=now,
            duration_s=duration,
            n_requests=n,
            n_instances=len(plan.queues),
            summary={iid: len(ids) for iid, ids in plan.queues.items()},
        )
        self._last_plan_at = now
        self._last_replan_s = duration
        self.metrics.observe_plan(duration)
        self.capacity.on_plan(plan.meta)
        scale_up = plan.meta.get("scale_up") or {}
        self.metrics.set_scale_up(
            (scale_up.get("recommendation") or {}) if scale_up.get("needed") else {},
            # a plan that judged scaling (qlm's) says 0 for the GPU types it found enough of
            gpu_types={i.gpu_type for i in instances} if "scale_up" in plan.meta else (),
        )
        models, evictions = self.core.lso_orders(plan)
        caps = self.core.cap_orders(plan)
        if models or evictions or caps:
            self._spawn(self._send_lso(models, evictions, caps))
        self._pump()
        return {
            "plan_id": plan.plan_id,
            "policy": plan.policy,
            "duration_s": duration,
            "n_requests": n,
            "n_instances": len(plan.queues),
            # set by policies that can tell: which GPUs to add when no plan meets the SLOs
            "scale_up": plan.meta.get("scale_up"),
            "evictions": len(evictions),
            "model_plans": len(models),
        }

    def capacity_status(self) -> dict[str, Any] | None:
        return None if self.autoscaler is None else self.autoscaler.status()

    def latest_plan(self) -> dict[str, Any] | None:
        plan = self.core.last_plan
        if plan is None:
            return None
        meta = plan.meta
        return {
            "plan_id": plan.plan_id,
            "policy": plan.policy,
            "created_at": self._last_plan_at,
            "n_requests": len(plan.assigned_ids()) + len(plan.unassigned),
            "queues": {iid: len(ids) for iid, ids in plan.queues.items()},
            "feasible": meta.get("feasible"),
            "predicted_attainment": meta.get("predicted_attainment"),
            "scale_up": meta.get("scale_up"),
            "lso": {iid: d.to_dict() for iid, d in plan.lso.items()} or None,
        }

    async def drain(self, instance_id: str) -> dict[str, Any]:
        if instance_id not in self.core.instances:
            raise KeyError(instance_id)
        moved = self.core.drain(instance_id, time.time())
        self._record_instance(instance_id, "draining", time.time())
        self._pump()
        return {
            "instance_id": instance_id,
            "moved": moved,
            "status": self.core.instances[instance_id].status,
        }

    async def undrain(self, instance_id: str) -> dict[str, Any]:
        if instance_id not in self.core.instances:
            raise KeyError(instance_id)
        now = time.time()
        status = self.core.undrain(instance_id, now)
        if status == "alive":
            self._record_instance(instance_id, "alive", now)
            self._pump()
        return {"instance_id": instance_id, "status": status}

    async def cancel(self, request_id: str, reason: str | None = None) -> dict[str, Any]:
        """An operator's cancel: the producer's cancel path (one ``cancelled`` reply, or the
        result if it comes first), for a request of any tenant. KeyError: not tracked and
        never answered."""
        t = self.core.requests.get(request_id)
        if t is None and request_id not in self.core.answered:
            raise KeyError(request_id)  # not remembered for later, unlike a producer's cancel
        tenant = None if t is None else t.request.tenant
        outcome, t, order = self.core.cancel(request_id, tenant)
        log.info("admin_cancel", request_id=request_id, outcome=outcome)
        await self._carry_out_cancel(request_id, outcome, t, order, reason or "operator", None)
        return {"request_id": request_id, "outcome": outcome}

    def health(self) -> dict[str, Any]:
        connected = self._conn is not None and not self._conn.is_closed
        store_ok = self._store_healthy()
        return {
            "status": "ok" if connected and store_ok else "degraded",
            "broker_connected": connected,
            "store_ok": store_ok,
            "active": connected,
        }

    def _store_healthy(self) -> bool:
        """The store keeps up: no entries dropped, a bounded backlog, and no write failures
        since the last check without a successful commit in between."""
        st = self.store.stats
        failures, committed = self._store_seen
        self._store_seen = (st.failures, st.committed)
        failing = st.failures > failures and st.committed == committed
        return not failing and st.dropped_full == 0 and st.buffered < 100_000
