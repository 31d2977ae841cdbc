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

Importing this module also makes pamqp's frame decoding tolerant of hostile property bytes
(:func:`install_tolerant_decoding`): see "Hostile AMQP properties" below.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import re
import struct
import time
import weakref
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import aio_pika
import aiormq
import pamqp.decode
from aio_pika.abc import AbstractExchange, AbstractRobustConnection
from aio_pika.robust_connection import RobustConnection
from yarl import URL

from qlm.logging import LibraryLogger, quiet_connect_failures

# silent unless the program configures logging: this module runs in users' programs
log = LibraryLogger(__name__)
# a failed connect raises to its caller; aiormq's own ERROR line for it would be a second
# report, printed into the user's program by logging's last-resort handler
quiet_connect_failures()


# ------------------------------------------------------------------ hostile AMQP properties
#
# AMQP short strings (content_type, message_id, correlation_id, reply_to, type, app_id, user_id,
# the routing key of a delivery, ...) and the keys of field tables (headers) are bytes on the
# wire; RabbitMQ passes them through unchecked. pamqp decodes them with strict UTF-8 and an
# out-of-range timestamp with datetime.fromtimestamp, and a failure anywhere in a frame makes
# aiormq drop the whole connection ("Could not unmarshal ContentHeader frame"). One message
# with a property that is not UTF-8 thus took the coordinator's connection down at each of its
# 21 deliveries, stalling every other request and losing the agents' heartbeats.
#
# The fix: the two decoders fall back to ``errors="surrogateescape"`` (each invalid byte 0xNN
# becomes the lone surrogate U+DCNN, which valid UTF-8 never decodes to, so the value is
# recognisable with :func:`has_raw_bytes` and the original bytes recoverable with
# ``value.encode("utf-8", "surrogateescape")``), and a timestamp beyond what datetime can hold
# decodes as None (it is informational; nothing in qlm reads it). Valid input decodes exactly as
# before: the original decoder runs first and the fallback only sees what it refused. Such a
# value cannot be encoded again (pamqp encodes strictly), so nothing may be published with it:
# the coordinator refuses the message (``invalid_property``) and dead-letters a sanitized copy
# (:func:`escape_raw`). The patch is checked against the pamqp versions it was written for.

_PAMQP_TESTED = ("3.", "4.")  # major versions whose decode.py has the shape patched below
_RAW_BYTE = re.compile("[\udc80-\udcff]")
_tolerant_installed = False


def has_raw_bytes(value: str) -> bool:
    """Whether a decoded AMQP string held bytes that are not UTF-8 (see above)."""
    return _RAW_BYTE.search(value) is not None


def escape_raw(value: str) -> str:
    """A printable, encodable form of a decoded AMQP string: bytes that were not UTF-8 are
    written ``\\xNN`` (so ``b"id\\xff"`` reads ``id\\xff``); valid text is unchanged."""
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _tolerant_short_str(
    strict: Callable[[bytes], tuple[int, Any]],
) -> Callable[[bytes], tuple[int, Any]]:
    def short_str(value: bytes) -> tuple[int, Any]:
        try:
            return strict(value)
        except UnicodeDecodeError:
            length = value[0]
            return length + 1, value[1 : length + 1].decode("utf-8", "surrogateescape")

    return short_str


def _tolerant_field_table(
    strict: Callable[[bytes], tuple[int, Any]],
) -> Callable[[bytes], tuple[int, Any]]:
    def field_table(value: bytes) -> tuple[int, Any]:
        try:
            return strict(value)
        except UnicodeDecodeError:
            pass
        # pamqp's loop (decode.field_table, pamqp 3.x/4.x), the key decoded tolerantly. A nested
        # table goes through TABLE_MAPPING[b"F"], i.e. this function again.
        try:
            (length,) = struct.unpack_from(">I", value, 0)
            offset, end, data = 4, 4 + length, {}
            if end > len(value):
                raise ValueError("Field table length exceeds available data")
            while offset < end:
                key_length = value[offset]
                offset += 1
                if offset + key_length > end:
                    raise ValueError("Field table key length exceeds data")
                key = value[offset : offset + key_length].decode("utf-8", "surrogateescape")
                offset += key_length
                consumed, result = pamqp.decode.embedded_value(value[offset:])
                offset += consumed
                data[key] = result
            return end, data
        except (struct.error, IndexError, TypeError) as err:
            raise ValueError("Could not unpack data") from err

    return field_table


def _tolerant_timestamp(
    strict: Callable[[bytes], tuple[int, Any]],
) -> Callable[[bytes], tuple[int, Any]]:
    def timestamp(value: bytes) -> tuple[int, Any]:
        try:
            return strict(value)
        except (OverflowError, OSError, ValueError):
            if len(value) < 8:
                raise
            return 8, None  # beyond datetime's range (year 9999): dropped, not fatal

    return timestamp


def install_tolerant_decoding() -> bool:
    """Make pamqp's decoding of short strings, field-table keys and timestamps tolerant (see
    above). Idempotent; returns whether the patch is in place. An untested pamqp version or a
    decode module of another shape is left alone, with a warning (tests/broker/test_hostile_input.py
    then fails, so an upgrade cannot drop the protection silently)."""
    global _tolerant_installed
    if _tolerant_installed:
        return True
    d = pamqp.decode
    version = importlib.metadata.version("pamqp")
    shaped = (
        d.METHODS.get("shortstr") is d.short_str
        and d.METHODS.get("table") is d.field_table
        and d.METHODS.get("timestamp") is d.timestamp
        and d.TABLE_MAPPING.get(b"F") is d.field_table
        and d.TABLE_MAPPING.get(b"T") is d.timestamp
    )
    if not version.startswith(_PAMQP_TESTED) or not shaped:
        log.warning("pamqp_tolerant_decoding_not_installed", pamqp_version=version, shaped=shaped)
        return False
    short_str = _tolerant_short_str(d.short_str)
    field_table = _tolerant_field_table(d.field_table)
    timestamp = _tolerant_timestamp(d.timestamp)
    d.short_str, d.field_table, d.timestamp = short_str, field_table, timestamp  # type: ignore[assignment]
    d.METHODS["shortstr"], d.METHODS["table"], d.METHODS["timestamp"] = (
        short_str,
        field_table,
        timestamp,
    )
    d.TABLE_MAPPING[b"F"], d.TABLE_MAPPING[b"T"] = field_table, timestamp
    _tolerant_installed = True
    return True


install_tolerant_decoding()

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


def username_of(url: str) -> str:
    """The broker user ``url`` logs in as (the first node's; ``guest`` when it names none)."""
    return unquote(urlsplit(split_urls(url)[0]).username or "guest")


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
        single = await aio_pika.connect_robust(
            urls[0],
            client_properties=props,
            reconnect_interval=RECONNECT_INTERVAL_S,
            timeout=timeout,
        )
        _log_reconnects(single, name)
        return single
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
    _log_reconnects(conn, name)
    return conn


def _log_reconnects(conn: AbstractRobustConnection, name: str) -> None:
    """One log line each time the connection is lost and each time it is back: an operator
    (and ``qlm chaos``) can see every reconnect, not only its effects."""

    def lost(_: Any, exc: BaseException | None = None) -> None:
        if exc is not None and not isinstance(exc, asyncio.CancelledError):  # else on purpose
            log.warning("amqp_connection_lost", connection=name, error=repr(exc)[:200])

    def back(_: Any) -> None:
        log.info("amqp_reconnected", connection=name)

    conn.close_callbacks.add(lost)
    conn.reconnect_callbacks.add(back)


# Robust channels reopened after a nack, and when: at most one reopen a second per channel (a
# nack fails every publish awaiting a confirm at once, each of which comes here).
_renewed_at: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
RENEW_AFTER_NACK_EVERY_S = 1.0


async def _renew_after_nack(exchange: AbstractExchange) -> None:
    """Reopen ``exchange``'s robust channel after the broker nacked a publish on it.

    RabbitMQ 3.10 (``rabbit_fifo_client:enqueue/3``) nacks every publish to a quorum queue, for
    as long as the channel lives, on a channel whose first publish to that queue met the
    queue's dead leader (docs/reliability.md, "Quorum leader killed"). Closing the channel's
    AMQP channel makes the robust channel reopen as a new one (consumers restored), which
    publishes to the new leader once one is recorded."""
    channel = getattr(exchange, "channel", None)
    if not isinstance(channel, aio_pika.RobustChannel):
        return
    now = time.monotonic()
    if now - _renewed_at.get(channel, float("-inf")) < RENEW_AFTER_NACK_EVERY_S:
        return
    _renewed_at[channel] = now
    with contextlib.suppress(Exception):
        await (await channel.get_underlay_channel()).close()
    log.warning("publish_channel_reopened_after_nack", exchange=exchange.name)


# what publish_confirmed catches: the republishable failures, and the two a closed channel
# raises (republished only when the channel was closed under the publish)
_REPUBLISHABLE_OR_CLOSED: tuple[type[BaseException], ...] = (
    *REPUBLISHABLE,
    asyncio.CancelledError,
    aiormq.exceptions.ChannelClosed,
)


def _closed_under_publish(exc: BaseException) -> bool:
    """The channel of a publish in flight was closed (a renewal after a nack on another publish
    of this channel, or the robust connection's own close): aiormq rejects the pending confirm
    with its default close reason, ``CancelledError``, or a bare ``ChannelClosed`` (close-ok).
    Not a cancellation of the publishing task itself, which must propagate."""
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is not None and task.cancelling() == 0
    return type(exc) is aiormq.exceptions.ChannelClosed


async def publish_confirmed(
    connection: AbstractRobustConnection,
    exchange: AbstractExchange,
    message: aio_pika.Message,
    routing_key: str,
    *,
    within_s: float,
    mandatory: bool = True,
    renew_on_nack: bool = False,
) -> None:
    """Publish ``message`` on a publisher-confirms channel and return once confirmed.

    A publish whose confirm was lost with the connection may or may not have reached its queue;
    the only way to know it did is to publish it again and let the consumer drop the copy (by
    its request id or reply id). So on a connection loss or a nack this waits for the robust
    connection to come back and publishes the same message again, for up to ``within_s``
    seconds, then raises the last error. The same when its channel is closed under it
    (:func:`_closed_under_publish`). A returned (unroutable) message raises at once.

    ``renew_on_nack``: after a nack, reopen the channel before publishing again (see
    :func:`_renew_after_nack`); for a channel whose other users tolerate that (its consumers
    are restored; a publish in flight on it fails and is retried by its caller).
    """
    deadline = time.monotonic() + within_s
    retries = 0
    while True:
        try:
            await exchange.publish(message, routing_key=routing_key, mandatory=mandatory)
            return
        except aiormq.exceptions.PublishError:
            raise
        except _REPUBLISHABLE_OR_CLOSED as exc:
            if not isinstance(exc, REPUBLISHABLE) and not _closed_under_publish(exc):
                raise
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
            if renew_on_nack and isinstance(exc, aiormq.exceptions.DeliveryError):
                await _renew_after_nack(exchange)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(connection.connected.wait(), left)
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
