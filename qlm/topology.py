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

Sharding exists because one consumer can hold at most 65,535 unacked deliveries (AMQP's
prefetch is 16 bits) and the coordinator keeps every queued request unacked until its result is
confirmed; N shards let it hold N × 65,535.
"""

from __future__ import annotations

from dataclasses import dataclass

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue

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

# The coordinator's list of served models (control.ServedModels), to every gateway: a fanout
# exchange, each gateway's exclusive queue bound to it. Transient messages: a stale list is
# worthless, the next one comes within seconds.
MODELS_EXCHANGE = "qlm.models"
SERVED_MODELS_INTERVAL_S = 1.0

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
    for i in range(shards):
        q = await channel.declare_queue(
            shard_queue(i),
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-single-active-consumer": True,
                "x-delivery-limit": delivery_limit,
                "x-dead-letter-exchange": DLX_EXCHANGE,
            },
        )
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
    return Topology(ingress, dlx, control, shard_queues, dead, coordinator, live)


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
