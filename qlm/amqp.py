"""Connecting to RabbitMQ: one broker URL, or several nodes of a cluster.

``QLM_AMQP_URL`` may list the nodes of a cluster separated by commas
(``amqp://u:p@host1:5672/,amqp://u:p@host2:5672/``). Every qlm process then keeps one robust
connection (aio-pika reconnects it and restores its channels, queues and consumers) and, when the
node it was connected to dies, tries the next node in the list, round robin. With quorum queues
the messages live on every node, so a surviving node serves them as soon as a new leader is
elected. A single URL behaves exactly like ``aio_pika.connect_robust``.

TLS: an ``amqps://`` URL connects with TLS; its query carries aio-pika's options, e.g.
``amqps://u:p@host:5671/?cafile=/path/ca.pem`` (verify the server against that CA) plus
``certfile``/``keyfile`` for a client certificate. See docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractExchange, AbstractRobustConnection
from aio_pika.robust_connection import RobustConnection
from yarl import URL

log = structlog.get_logger(__name__)

# Publish failures worth publishing again once reconnected: the connection or channel went away
# before the confirm, or the broker nacked the message (e.g. a quorum queue between leaders).
# A returned (unroutable) message is not among them: aiormq's PublishError is caught first.
REPUBLISHABLE: tuple[type[BaseException], ...] = (
    ConnectionError,  # includes aiormq's AMQPConnectionError
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.DeliveryError,
)

# Seconds between reconnection attempts (aio-pika's default is 5): a dead node's successor is
# tried quickly, and a restarted broker is found again within a second.
RECONNECT_INTERVAL_S = 1.0


def split_urls(url: str) -> list[str]:
    """The broker URLs in ``url`` (comma-separated), each checked: scheme amqp or amqps and a
    host. Raises ValueError with the offending entry (its password masked)."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise ValueError("the AMQP URL is empty")
    for u in urls:
        parts = urlsplit(u)
        if parts.scheme not in ("amqp", "amqps") or not parts.hostname:
            raise ValueError(f"not an amqp:// or amqps:// URL with a host: {mask_password(u)!r}")
    return urls


def mask_password(url: str) -> str:
    """``url`` with its password replaced, for logs and error messages."""
    masked = []
    for u in url.split(","):
        parsed = URL(u.strip())
        masked.append(str(parsed.with_password("***")) if parsed.password else u.strip())
    return ",".join(masked)


def vhost_of(url: str) -> str:
    """The virtual host named by ``url`` (the first node's, when it lists several)."""
    path = urlsplit(split_urls(url)[0]).path
    return unquote(path[1:]) or "/"


def with_vhost(url: str, vhost: str) -> str:
    """``url`` (each node of it) pointed at ``vhost`` instead."""
    out = []
    for u in split_urls(url):
        parts = urlsplit(u)
        out.append(parts._replace(path="/" + quote(vhost, safe="")).geturl())
    return ",".join(out)


class MultiNodeConnection(RobustConnection):
    """A robust connection that moves to the next node of a cluster at each new attempt.

    aio-pika clears ``transport`` before every connection attempt (and when the connection is
    closed for good); each attempt goes to the next URL, so a connection that drops is retried
    on another node first.
    """

    def __init__(self, urls: list[str], **kwargs: Any) -> None:
        super().__init__(URL(urls[0]), **kwargs)
        self._qlm_urls = [URL(u) for u in urls]
        self._qlm_next = 0

    @property
    def transport(self) -> Any:
        return self.__dict__.get("_qlm_transport")

    @transport.setter
    def transport(self, value: Any) -> None:
        urls = self.__dict__.get("_qlm_urls")
        if value is None and urls and not self._close_in_progress:
            self.url = urls[self._qlm_next % len(urls)]  # a new attempt: this node's turn
            self._qlm_next += 1
        self.__dict__["_qlm_transport"] = value


async def connect(url: str, *, name: str, timeout: float | None = 30.0) -> AbstractRobustConnection:
    """A robust connection named ``name`` (shown in the management UI) to the broker at
    ``url``, or to the first reachable node when ``url`` lists several."""
    urls = split_urls(url)
    props: dict[str, Any] = {"connection_name": name}
    if len(urls) == 1:
        return await aio_pika.connect_robust(
            urls[0],
            client_properties=props,
            reconnect_interval=RECONNECT_INTERVAL_S,
            timeout=timeout,
        )
    conn = MultiNodeConnection(
        urls,
        client_properties=props,
        reconnect_interval=RECONNECT_INTERVAL_S,
        # the first attempt may meet a dead node: keep trying the others instead of failing
        fail_fast="0",
    )
    try:
        await asyncio.wait_for(conn.connect(timeout=timeout), timeout)
    except TimeoutError:
        await conn.close()
        raise ConnectionError(
            f"no broker node answered within {timeout} s: {mask_password(url)}"
        ) from None
    return conn


async def publish_confirmed(
    connection: AbstractRobustConnection,
    exchange: AbstractExchange,
    message: aio_pika.Message,
    routing_key: str,
    *,
    within_s: float,
    mandatory: bool = True,
) -> None:
    """Publish ``message`` on a publisher-confirms channel and return once confirmed.

    A publish whose confirm was lost with the connection may or may not have reached its queue;
    the only way to know it did is to publish it again and let the consumer drop the copy (by
    its request id or reply id). So on a connection loss or a nack this waits for the robust
    connection to come back and publishes the same message again, for up to ``within_s``
    seconds, then raises the last error. A returned (unroutable) message raises at once.
    """
    deadline = time.monotonic() + within_s
    retries = 0
    while True:
        try:
            await exchange.publish(message, routing_key=routing_key, mandatory=mandatory)
            return
        except aiormq.exceptions.PublishError:
            raise
        except REPUBLISHABLE as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            retries += 1
            (log.warning if retries == 1 else log.debug)(
                "publish_unconfirmed_retrying",
                message_id=message.message_id,
                routing_key=routing_key,
                error=type(exc).__name__,
                retry=retries,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(connection.connected.wait(), left)
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
