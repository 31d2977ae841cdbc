"""The broker topology on a real RabbitMQ (3.10 here): sharding, poison handling and redelivery.

Each test gets its own vhost (``isolated_amqp_url``), so queues never leak between tests.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import aio_pika
import httpx
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from qlm.tooling import localbroker
from qlm.topology import (
    CONSUMER_TIMEOUT_ARG,
    CONSUMER_TIMEOUT_MS,
    COORDINATOR_QUEUE,
    DEAD_LETTER_QUEUE,
    PER_QUEUE_CONSUMER_TIMEOUT_SINCE,
    Topology,
    broker_version,
    declare_topology,
    shard_queue,
)

pytestmark = pytest.mark.broker

SHARDS = 2


def persistent(body: bytes, message_id: str) -> aio_pika.Message:
    return aio_pika.Message(
        body, message_id=message_id, delivery_mode=aio_pika.DeliveryMode.PERSISTENT
    )


async def message_counts(channel: AbstractChannel, names: list[str]) -> dict[str, int]:
    counts = {}
    for name in names:
        queue = await channel.declare_queue(name, passive=True)
        count = queue.declaration_result.message_count
        assert count is not None
        counts[name] = count
    return counts


async def wait_for_total(
    channel: AbstractChannel, names: list[str], total: int, wait_s: float = 5.0
) -> dict[str, int]:
    """Message counts once they add up to ``total`` (quorum queue counts can lag confirms)."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        counts = await message_counts(channel, names)
        if sum(counts.values()) == total or asyncio.get_running_loop().time() > deadline:
            return counts
        await asyncio.sleep(0.05)


async def shard_holding_one(channel: AbstractChannel, topo: Topology) -> AbstractQueue:
    counts = await wait_for_total(channel, [q.name for q in topo.shards], 1)
    assert sorted(counts.values()) == [0] * (SHARDS - 1) + [1], counts
    name = next(n for n, c in counts.items() if c == 1)
    return next(q for q in topo.shards if q.name == name)


async def next_delivery(queue: AbstractQueue, wait_s: float) -> AbstractIncomingMessage | None:
    async with queue.iterator() as it:
        try:
            return await asyncio.wait_for(it.__anext__(), wait_s)
        except TimeoutError:
            return None


async def test_declaring_the_topology_twice_is_idempotent(isolated_amqp_url: str) -> None:
    async with await aio_pika.connect(isolated_amqp_url) as conn:
        channel = await conn.channel()
        first = await declare_topology(channel, shards=SHARDS)
        second = await declare_topology(channel, shards=SHARDS)
        assert [q.name for q in second.shards] == [shard_queue(i) for i in range(SHARDS)]
        assert [q.name for q in first.shards] == [q.name for q in second.shards]
        # A redeclaration with different arguments closes the channel (406); this one did not.
        assert not channel.is_closed
        await message_counts(channel, [*(shard_queue(i) for i in range(SHARDS)), DEAD_LETTER_QUEUE])


async def test_a_changed_delivery_limit_is_refused_on_redeclaration(isolated_amqp_url: str) -> None:
    """Quorum queue arguments are fixed at creation: changing QLM_DELIVERY_LIMIT on an existing
    deployment makes declare_topology fail instead of silently keeping the old limit."""
    async with await aio_pika.connect(isolated_amqp_url) as conn:
        await declare_topology(await conn.channel(), shards=SHARDS, delivery_limit=20)
        with pytest.raises(aio_pika.exceptions.ChannelPreconditionFailed):
            await declare_topology(await conn.channel(), shards=SHARDS, delivery_limit=5)


async def test_distinct_routing_keys_spread_over_all_shards(isolated_amqp_url: str) -> None:
    n = 200
    async with await aio_pika.connect(isolated_amqp_url) as conn:
        channel = await conn.channel()  # publisher confirms: publish returns once confirmed
        topo = await declare_topology(channel, shards=SHARDS)
        await asyncio.gather(
            *(
                topo.ingress.publish(persistent(b"{}", f"req-{i}"), routing_key=f"req-{i}")
                for i in range(n)
            )
        )
        counts = await wait_for_total(channel, [q.name for q in topo.shards], n)
    assert sum(counts.values()) == n, counts
    # Equal binding weights: each shard gets a fair share (binomial sd ~7 around 100).
    assert all(c >= n // 4 for c in counts.values()), counts


async def test_a_message_requeued_past_the_delivery_limit_is_dead_lettered(
    isolated_amqp_url: str,
) -> None:
    limit = 2
    async with await aio_pika.connect(isolated_amqp_url) as conn:
        channel = await conn.channel()
        await channel.set_qos(prefetch_count=1)
        topo = await declare_topology(channel, shards=SHARDS, delivery_limit=limit)
        await topo.ingress.publish(persistent(b"poison", "poison-1"), routing_key="poison-1")
        shard = await shard_holding_one(channel, topo)

        delivery_counts: list[Any] = []
        async with shard.iterator() as it:
            while True:
                try:
                    msg = await asyncio.wait_for(it.__anext__(), 1.0)
                except TimeoutError:
                    break
                delivery_counts.append(msg.headers.get("x-delivery-count"))
                await msg.nack(requeue=True)

        # RabbitMQ 3.10: the first delivery has no count, later ones count previous returns;
        # the return after delivery number limit+1 dead-letters the message.
        assert delivery_counts == [None, *range(1, limit + 1)]
        dead: AbstractIncomingMessage | None = None
        for _ in range(50):
            dead = await topo.dead.get(no_ack=False, fail=False)
            if dead is not None:
                break
            await asyncio.sleep(0.05)
        assert dead is not None, "nothing arrived in qlm.dead"
        assert dead.body == b"poison"
        assert dead.message_id == "poison-1"
        x_death = dead.headers["x-death"]
        assert isinstance(x_death, list)
        first = x_death[0]
        assert isinstance(first, dict)
        assert first["reason"] == "delivery_limit"
        assert first["queue"] == shard.name
        await dead.ack()
        counts = await message_counts(channel, [q.name for q in topo.shards])
        assert sum(counts.values()) == 0


async def test_an_unacked_delivery_returns_when_its_consumer_connection_closes(
    isolated_amqp_url: str,
) -> None:
    async with await aio_pika.connect(isolated_amqp_url) as conn:
        channel = await conn.channel()
        topo = await declare_topology(channel, shards=SHARDS)
        await topo.ingress.publish(persistent(b"hold me", "held-1"), routing_key="held-1")
        shard = await shard_holding_one(channel, topo)

    # A consumer (think: a coordinator) takes the delivery and dies without acking it.
    holder = await aio_pika.connect(isolated_amqp_url)
    held_channel = await holder.channel()
    first = await next_delivery(await held_channel.get_queue(shard.name), wait_s=5.0)
    assert first is not None
    assert first.redelivered is False
    assert "x-delivery-count" not in first.headers
    await holder.close()

    async with await aio_pika.connect(isolated_amqp_url) as conn:
        channel = await conn.channel()
        again = await next_delivery(await channel.get_queue(shard.name), wait_s=5.0)
        assert again is not None, "the unacked delivery was not returned to the queue"
        assert again.body == b"hold me"
        assert again.message_id == "held-1"
        assert again.redelivered is True
        assert again.headers["x-delivery-count"] == 1
        await again.ack()
        assert sum((await message_counts(channel, [shard.name])).values()) == 0


# --- the shards' own consumer timeout (docs/reliability.md, "Broker fit") --------------------


def _queue_info(amqp_url: str, name: str) -> dict[str, Any]:
    parts = urlsplit(amqp_url)
    vhost = quote(unquote(parts.path[1:]) or "/", safe="")
    resp = httpx.get(
        f"{localbroker.management_url(amqp_url)}api/queues/{vhost}/{quote(name, safe='')}",
        auth=(unquote(parts.username or "guest"), unquote(parts.password or "guest")),
    )
    resp.raise_for_status()
    info: dict[str, Any] = resp.json()
    return info


async def test_the_shards_carry_their_own_consumer_timeout(isolated_amqp_url: str) -> None:
    """The broker accepts the argument and keeps it on every shard (on < 3.12 it is stored but
    not enforced: that broker needs docker/rabbitmq-pre-3.12.conf)."""
    async with await aio_pika.connect(isolated_amqp_url) as conn:
        await declare_topology(await conn.channel(), shards=SHARDS)
    for i in range(SHARDS):
        args = _queue_info(isolated_amqp_url, shard_queue(i))["arguments"]
        assert args[CONSUMER_TIMEOUT_ARG] == CONSUMER_TIMEOUT_MS
        assert args["x-delivery-limit"] == 20  # the rest unchanged
    # The control queues hold nothing for long: they keep the broker's default.
    assert (
        CONSUMER_TIMEOUT_ARG not in _queue_info(isolated_amqp_url, COORDINATOR_QUEUE)["arguments"]
    )


async def test_shards_of_an_older_qlm_without_the_argument_keep_working(
    isolated_amqp_url: str,
) -> None:
    """A shard created before the argument existed: declare_topology neither fails nor
    changes it (a >= 3.12 broker refuses to add the argument; the policy does that)."""
    old_args = {
        "x-queue-type": "quorum",
        "x-single-active-consumer": True,
        "x-delivery-limit": 20,
        "x-dead-letter-exchange": "qlm.dlx",
    }
    async with await aio_pika.connect(isolated_amqp_url) as conn:
        setup = await conn.channel()
        for i in range(SHARDS):
            await setup.declare_queue(shard_queue(i), durable=True, arguments=old_args)
        channel = await conn.channel()
        topo = await declare_topology(channel, shards=SHARDS)
        assert not channel.is_closed
        await topo.ingress.publish(persistent(b"{}", "after-upgrade"), routing_key="after-upgrade")
        await wait_for_total(channel, [q.name for q in topo.shards], 1)
    for i in range(SHARDS):
        args = _queue_info(isolated_amqp_url, shard_queue(i))["arguments"]
        assert CONSUMER_TIMEOUT_ARG not in args  # as created: arguments never change
        assert args["x-delivery-limit"] == 20


async def test_a_short_per_queue_consumer_timeout_closes_the_holding_channel(
    isolated_amqp_url: str,
) -> None:
    """What the argument does: a consumer holding a delivery past the queue's timeout loses
    its channel and the delivery goes back to the queue, on this queue only."""
    async with await aio_pika.connect(isolated_amqp_url) as conn:
        assert conn.transport is not None
        version = broker_version(conn.transport.connection.server_properties)
        if version is None or version < PER_QUEUE_CONSUMER_TIMEOUT_SINCE:
            pytest.skip(f"RabbitMQ {version} ignores x-consumer-timeout (needs >= 3.12)")
        holder = await conn.channel()
        queue = await holder.declare_queue(
            "probe.timeout",
            durable=True,
            arguments={"x-queue-type": "quorum", CONSUMER_TIMEOUT_ARG: 1000},
        )
        held: list[AbstractIncomingMessage] = []
        await queue.consume(held.append, no_ack=False)
        await holder.default_exchange.publish(persistent(b"x", "held"), routing_key=queue.name)
        # The broker checks timeouts on its channel tick (every 60 s by default).
        try:
            await asyncio.wait_for(holder.closed(), 90)
        except TimeoutError:
            pytest.fail("the channel outlived the queue's consumer timeout")
        assert held, "the message was never delivered"
        assert not conn.is_closed  # the channel, not the connection
        counts = await wait_for_total(await conn.channel(), [queue.name], 1)
        assert counts == {queue.name: 1}  # the held delivery went back to the queue
