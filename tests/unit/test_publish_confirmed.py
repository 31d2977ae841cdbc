"""``qlm.amqp.publish_confirmed``'s retry rule against a fake channel: a publish whose channel
is closed under it (its confirm rejected with CancelledError or a bare ChannelClosed, as aiormq
does when another publish's nack renews the channel) is published again; a cancellation of the
publishing task itself, a returned message and another channel error are not."""

from __future__ import annotations

import asyncio
from typing import Any

import aio_pika
import aiormq
import pytest

from qlm.amqp import publish_confirmed


class FakeConnection:
    def __init__(self) -> None:
        self.connected = asyncio.Event()
        self.connected.set()


class FakeExchange:
    """Raises each of ``failures`` in turn on publish, then confirms."""

    name = "qlm.ingress"

    def __init__(self, *failures: BaseException) -> None:
        self.failures = list(failures)
        self.published = 0

    async def publish(self, message: Any, routing_key: str, mandatory: bool = True) -> None:
        self.published += 1
        if self.failures:
            raise self.failures.pop(0)


def message() -> aio_pika.Message:
    return aio_pika.Message(b"{}", message_id="r1")


@pytest.mark.parametrize(
    "closed",
    [asyncio.CancelledError(), aiormq.exceptions.ChannelClosed(None, None)],
    ids=["confirm-rejected", "close-ok"],
)
async def test_a_publish_whose_channel_closed_under_it_is_published_again(
    closed: BaseException,
) -> None:
    exchange = FakeExchange(closed)
    await publish_confirmed(FakeConnection(), exchange, message(), "r1", within_s=5)  # type: ignore[arg-type]
    assert exchange.published == 2


@pytest.mark.parametrize(
    "error",
    [
        # a basic.return (built bare: its constructor reads the returned message)
        aiormq.exceptions.PublishError.__new__(aiormq.exceptions.PublishError),
        aiormq.exceptions.ChannelNotFoundEntity(404, "no exchange"),
    ],
    ids=["returned", "channel-error"],
)
async def test_a_returned_message_or_a_channel_error_raises_at_once(error: BaseException) -> None:
    exchange = FakeExchange(error)
    with pytest.raises(type(error)):
        await publish_confirmed(FakeConnection(), exchange, message(), "r1", within_s=5)  # type: ignore[arg-type]
    assert exchange.published == 1


async def test_cancelling_the_publishing_task_still_cancels_it() -> None:
    class Hanging(FakeExchange):
        async def publish(self, message: Any, routing_key: str, mandatory: bool = True) -> None:
            self.published += 1
            await asyncio.sleep(60)

    exchange = Hanging()
    task = asyncio.create_task(
        publish_confirmed(FakeConnection(), exchange, message(), "r1", within_s=5)  # type: ignore[arg-type]
    )
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert exchange.published == 1


async def test_it_gives_up_after_its_window() -> None:
    exchange = FakeExchange(*(asyncio.CancelledError() for _ in range(100)))
    with pytest.raises(asyncio.CancelledError):
        await publish_confirmed(FakeConnection(), exchange, message(), "r1", within_s=0.3)  # type: ignore[arg-type]
    assert exchange.published > 1
