"""Refreshing the delivery count of a request that outlives connection losses.

The coordinator holds every queued request unacked until its reply is confirmed, for minutes or
hours. Each time its connection (or channel) to a global-queue shard is lost, RabbitMQ returns
those deliveries to the quorum queue, and RabbitMQ 3.x counts every return toward the queue's
delivery limit (``x-delivery-count``), the same as a nack after a handler failure. So a healthy
request that lived through ``QLM_DELIVERY_LIMIT`` reconnects (a flapping network, restarts,
broker node failures) was dead-lettered as if it were poison.

A redelivery whose count reached :func:`refresh_threshold` and that the coordinator has just
*handled* (validated and tracked: it is not poison for ingest) is therefore republished as a
fresh copy, with a publisher confirm, to the route it came by (same exchange and routing key:
the same shard), and the worn delivery is acked. The copy starts at count 0. It carries:

* :data:`REFRESHES_HEADER`: how many times the request was refreshed. Refreshing stops at
  :data:`MAX_REFRESHES`, so a message that passes ingest but then crashes the coordinator
  every time still reaches the delivery limit and is dead-lettered, after at least
  ``MAX_REFRESHES × refresh_threshold`` returns;
* :data:`USER_HEADER`: the original ``user_id`` (the producer's broker user, which the broker
  verified). The copy is published under the coordinator's own broker user, so a delivery
  that claims to be a copy is believed (its tenant taken from this header) only if its
  ``user_id`` is the coordinator's user, which the broker verifies in turn.

The copy is handled like a redelivery (an answered request is answered from the record, a
tracked one swaps its delivery handle), never as a new request and never as a duplicate to
ack at once: either way the request is held by exactly one unacked copy, and at most one reply
goes out (docs/architecture.md, "Exactly-once replies").
"""

from __future__ import annotations

from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

REFRESHES_HEADER = "x-qlm-refreshes"
USER_HEADER = "x-qlm-user-id"
MAX_REFRESHES = 8
# headers the broker sets on a delivery; a fresh copy must not carry them
_BROKER_HEADERS = frozenset(
    {
        "x-delivery-count",
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)


def refresh_threshold(delivery_limit: int) -> int:
    """The broker count at which a handled redelivery is refreshed: half the limit, so a
    copy is in place long before the count runs out, and at least 1."""
    return max(1, delivery_limit // 2)


def broker_count(message: AbstractIncomingMessage) -> int:
    """The broker's return count of this delivery; 0 on a first delivery (whatever a producer
    wrote in the header: only on a redelivery does the broker's own count replace it)."""
    if not message.redelivered:
        return 0
    count = (message.headers or {}).get("x-delivery-count")
    return count if isinstance(count, int) and count > 0 else 0


def refreshes_of(message: AbstractIncomingMessage, own_user: str | None) -> int | None:
    """How many times this delivery's request was refreshed, if it is the coordinator's own
    copy (published under ``own_user``); None for a producer's message."""
    n = (message.headers or {}).get(REFRESHES_HEADER)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    if own_user is None or message.user_id != own_user:
        return None
    return n


def original_user(message: AbstractIncomingMessage) -> str | None:
    """The producer's broker user of a copy (the header the coordinator wrote)."""
    value = (message.headers or {}).get(USER_HEADER)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value if isinstance(value, str) and value else None


def fresh_copy(
    message: AbstractIncomingMessage,
    *,
    refreshes: int,
    own_user: str | None,
    producer_user: str | None,
) -> aio_pika.Message:
    """The request of ``message`` as a new message: same body and properties, the broker's
    delivery headers dropped, :data:`REFRESHES_HEADER` and :data:`USER_HEADER` set. Not its
    ``expiration``: the request was taken in, and a copy must not expire in the queue while
    the coordinator reconnects."""
    headers: dict[str, Any] = {
        k: v for k, v in (message.headers or {}).items() if k not in _BROKER_HEADERS
    }
    headers[REFRESHES_HEADER] = refreshes
    headers.pop(USER_HEADER, None)
    if producer_user:
        headers[USER_HEADER] = producer_user
    return aio_pika.Message(
        message.body,
        headers=headers,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=message.priority,
        correlation_id=message.correlation_id,
        reply_to=message.reply_to,
        message_id=message.message_id,
        timestamp=message.timestamp,
        type=message.type,
        user_id=own_user,
        app_id=message.app_id,
    )
