"""Broker topology: names and declarations of every exchange and queue qlm uses.

::

    producers ──► qlm.ingress (x-consistent-hash on routing key = request_id)
                      ├─► qlm.global.0  (quorum, single-active-consumer, delivery limit, DLX)
                      └─► qlm.global.N-1
    qlm.dlx (fanout) ──► qlm.dead          poison, rejected and invalid messages (+ reason headers)
    qlm.control (direct)
        "coordinator"   ──► qlm.control.coordinator (quorum, SAC): completions, failures,
                                                    goodbyes: what must survive a crash
        "coordinator.live" ─► qlm.control.live (classic, transient, SAC): heartbeats and
                                                    pulls, which are worthless once stale
        "agent.<id>"    ──► qlm.agent.<id> (exclusive, auto-delete): dispatches to that agent
    results ──► default exchange, routing key = the request's reply_to
    qlm.models (fanout) ──► each gateway's exclusive queue: the coordinator's served models
    token chunks ──► default exchange, routing key = the request's reply_to, and (BCC)
                     qlm.streams.tap (classic, transient, SAC): the coordinator follows what
                     each stream's producer received

Sharding exists because one consumer can hold at most 65,535 unacked deliveries (AMQP's
prefetch is 16 bits) and the coordinator keeps every queued request unacked until its result is
confirmed; N shards let it hold N × 65,535.

For the same reason the shards carry their own consumer timeout (``x-consumer-timeout``, 7 days):
RabbitMQ closes a channel whose delivery stays unacked longer than its consumer timeout (default
30 min), and a per-queue timeout (RabbitMQ >= 3.12) spares a shared broker the broker-wide
``consumer_timeout`` that older brokers need. See "Broker fit" in docs/reliability.md.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue

from qlm.logging import LibraryLogger

# silent unless the program configures logging: this module runs in users' programs
log = LibraryLogger(__name__)

INGRESS_EXCHANGE = "qlm.ingress"
DLX_EXCHANGE = "qlm.dlx"
DEAD_LETTER_QUEUE = "qlm.dead"
CONTROL_EXCHANGE = "qlm.control"
COORDINATOR_QUEUE = "qlm.control.coordinator"
COORDINATOR_ROUTING_KEY = "coordinator"
# Heartbeats and credit are re-sent continuously and rebuilt on re-registration, so they skip
# the quorum queue: its confirms wait for a disk fsync, which put credit (and so dispatch
# latency) at the mercy of the disk.
LIVE_QUEUE = "qlm.control.live"
LIVE_ROUTING_KEY = "coordinator.live"

# Every token-stream message an agent publishes goes to its reply queue and, as a blind copy
# (the BCC header: one publish, routed to both or neither), here: the coordinator reads what a
# stream's producer received, and a request that loses its agent resumes after those tokens.
# Transient like the chunks themselves; bounded, as nobody may be reading it.
STREAM_TAP_QUEUE = "qlm.streams.tap"
STREAM_TAP_MAX_LENGTH = 100_000
STREAM_TAP_TTL_MS = 60_000
# A token message's header naming the requests whose last tokens it carries (the engine
# finished them): the coordinator then never resumes such a request after its streamed
# tokens (that would generate past the answer's end); producers may ignore it.
STREAM_END_HEADER = "x-qlm-stream-end"

# The coordinator's list of served models (control.ServedModels), to every gateway: a fanout
# exchange, each gateway's exclusive queue bound to it. Transient messages: a stale list is
# worthless, the next one comes within seconds.
MODELS_EXCHANGE = "qlm.models"
SERVED_MODELS_INTERVAL_S = 1.0
# How long the coordinator may hold a shard's delivery unacked (ms). A request waits in the
# coordinator's virtual queues (batch-tier requests for up to their deadline) while its delivery
# stays unacked, so this bounds how long a request may wait; 7 days as the broker-wide setting
# it replaces did.
CONSUMER_TIMEOUT_ARG = "x-consumer-timeout"
CONSUMER_TIMEOUT_MS = 7 * 24 * 3600 * 1000
# The first RabbitMQ release that honours x-consumer-timeout / the consumer-timeout policy key.
# Older brokers accept the argument and ignore it (3.10.8 checked), so they still need the
# broker-wide consumer_timeout.
PER_QUEUE_CONSUMER_TIMEOUT_SINCE = (3, 12, 0)

# Headers the coordinator adds when it dead-letters a message itself.
REASON_HEADER = "x-qlm-error-code"
REASON_TEXT_HEADER = "x-qlm-error-message"


def shard_queue(index: int) -> str:
    return f"qlm.global.{index}"


def agent_queue(agent_id: str) -> str:
    return f"qlm.agent.{agent_id}"


def agent_routing_key(agent_id: str) -> str:
    return f"agent.{agent_id}"


@dataclass
class Topology:
    ingress: AbstractExchange
    dlx: AbstractExchange
    control: AbstractExchange
    shards: list[AbstractQueue]
    dead: AbstractQueue
    coordinator: AbstractQueue
    live: AbstractQueue
    stream_tap: AbstractQueue


async def declare_topology(
    channel: AbstractChannel, shards: int, delivery_limit: int = 20
) -> Topology:
    """Declare (idempotently) everything but the per-agent queues."""
    ingress = await channel.declare_exchange(
        INGRESS_EXCHANGE, type="x-consistent-hash", durable=True
    )
    dlx = await channel.declare_exchange(DLX_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
    dead = await channel.declare_queue(
        DEAD_LETTER_QUEUE, durable=True, arguments={"x-queue-type": "quorum"}
    )
    await dead.bind(dlx)
    shard_queues = []
    base = {
        "x-queue-type": "quorum",
        "x-single-active-consumer": True,
        "x-delivery-limit": delivery_limit,
        "x-dead-letter-exchange": DLX_EXCHANGE,
    }
    underlay = await channel.get_underlay_channel()
    warn_if_no_per_queue_timeout(underlay.connection.server_properties)
    for i in range(shards):
        arguments = await shard_arguments(_probe_declare(underlay.connection), shard_queue(i), base)
        q = await channel.declare_queue(shard_queue(i), durable=True, arguments=arguments)
        # Equal weights: the consistent-hash exchange spreads request ids evenly.
        await q.bind(ingress, routing_key="1")
        shard_queues.append(q)
    control = await channel.declare_exchange(
        CONTROL_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
    )
    coordinator = await channel.declare_queue(
        COORDINATOR_QUEUE,
        durable=True,
        arguments={"x-queue-type": "quorum", "x-single-active-consumer": True},
    )
    await coordinator.bind(control, routing_key=COORDINATOR_ROUTING_KEY)
    live = await channel.declare_queue(
        LIVE_QUEUE, durable=False, arguments={"x-single-active-consumer": True}
    )
    await live.bind(control, routing_key=LIVE_ROUTING_KEY)
    stream_tap = await channel.declare_queue(
        STREAM_TAP_QUEUE,
        durable=False,
        arguments={
            "x-single-active-consumer": True,
            "x-max-length": STREAM_TAP_MAX_LENGTH,
            "x-overflow": "drop-head",
            "x-message-ttl": STREAM_TAP_TTL_MS,
        },
    )
    return Topology(ingress, dlx, control, shard_queues, dead, coordinator, live, stream_tap)


async def declare_agent_queue(channel: AbstractChannel, agent_id: str) -> AbstractQueue:
    """The agent's private dispatch queue: it vanishes with the agent's connection, so a
    dispatch published with ``mandatory=True`` to a dead agent comes back to the coordinator."""
    control = await channel.declare_exchange(
        CONTROL_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
    )
    q = await channel.declare_queue(agent_queue(agent_id), exclusive=True, auto_delete=True)
    await q.bind(control, routing_key=agent_routing_key(agent_id))
    return q


async def declare_models_exchange(channel: AbstractChannel) -> AbstractExchange:
    """Idempotent; both the coordinator and the gateways declare it, whichever starts first."""
    return await channel.declare_exchange(
        MODELS_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
    )


# --- the shards' consumer timeout ---------------------------------------------------------------

ProbeDeclare = Callable[[str, dict[str, Any]], Awaitable[None]]


def _probe_declare(connection: aiormq.abc.AbstractConnection) -> ProbeDeclare:
    """Declare on a throwaway channel: a refused declaration closes that channel only, not the
    caller's (a robust channel would reopen and replay its declarations meanwhile)."""

    async def declare(name: str, arguments: dict[str, Any]) -> None:
        ch = await connection.channel()
        try:
            await ch.queue_declare(name, durable=True, arguments=arguments)
        finally:
            if not ch.is_closed:
                await ch.close()

    return declare


async def shard_arguments(declare: ProbeDeclare, name: str, base: dict[str, Any]) -> dict[str, Any]:
    """The arguments to declare shard ``name`` with: ``base`` plus the consumer timeout, unless
    the queue already exists without it.

    A queue's arguments are fixed at creation, and a broker that checks x-consumer-timeout
    (>= 3.12) refuses a redeclaration that adds it (PRECONDITION_FAILED). A shard created by an
    older qlm thus keeps working without the argument; the operator gives it the timeout with
    a policy instead (docs/reliability.md, "Broker fit"), which applies to existing queues and
    needs no redeclaration. Any other mismatch (e.g. a changed delivery limit) still fails."""
    wanted = {**base, CONSUMER_TIMEOUT_ARG: CONSUMER_TIMEOUT_MS}
    try:
        await declare(name, wanted)
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        if CONSUMER_TIMEOUT_ARG not in str(exc):
            raise
        log.warning(
            "shard_without_consumer_timeout",
            queue=name,
            hint="created by an older qlm: apply the consumer-timeout policy of "
            "docs/reliability.md or keep the broker-wide consumer_timeout",
        )
        return dict(base)
    return wanted


def broker_version(server_properties: dict[str, Any]) -> tuple[int, ...] | None:
    """The broker's version from its connection properties (``"3.10.8"`` -> (3, 10, 8))."""
    raw = server_properties.get("version")
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    if not isinstance(raw, str) or (m := re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", raw)) is None:
        return None
    return tuple(int(part or 0) for part in m.groups())


_warned_old_broker = False


def warn_if_no_per_queue_timeout(server_properties: dict[str, Any]) -> None:
    """Log once per process when the broker ignores x-consumer-timeout: it then needs the
    broker-wide ``consumer_timeout`` (docker/rabbitmq.conf's fallback) or it closes the
    coordinator's channels after 30 minutes of holding a request."""
    global _warned_old_broker
    version = broker_version(server_properties)
    if _warned_old_broker or version is None or version >= PER_QUEUE_CONSUMER_TIMEOUT_SINCE:
        return
    _warned_old_broker = True
    log.warning(
        "broker_without_per_queue_consumer_timeout",
        version=".".join(map(str, version)),
        hint="RabbitMQ < 3.12 ignores x-consumer-timeout: set consumer_timeout = 604800000 "
        "in rabbitmq.conf (docs/reliability.md, Broker fit)",
    )
