"""What the coordinator serves, as the gateway's ``GET /v1/models`` lists it.

The coordinator fans :class:`~qlm.control.ServedModels` out on ``qlm.models`` every second and
on every change (docs/gateway.md, "Models"). Each gateway binds its own exclusive queue to it
and keeps the newest list; a list older than its ``valid_s`` is stale (no coordinator, or a
new one still in its start grace) and not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from pydantic import ValidationError

from qlm import amqp as qlm_amqp
from qlm.control import ServedModels
from qlm.topology import declare_models_exchange

log = structlog.get_logger(__name__)


class ServedModelsWatcher:
    """Keeps the newest fresh :class:`ServedModels` of the broker at ``amqp_url``."""

    def __init__(self, amqp_url: str) -> None:
        self.amqp_url = amqp_url
        self._conn: AbstractRobustConnection | None = None
        self._latest: tuple[ServedModels, float] | None = None  # and when it came (monotonic)
        self._changed = asyncio.Event()

    async def start(self) -> None:
        self._conn = await qlm_amqp.connect(self.amqp_url, name="qlm-gateway-models")
        channel = await self._conn.channel()
        exchange = await declare_models_exchange(channel)
        # only the newest list matters: the queue keeps one (x-max-length drops the older)
        queue = await channel.declare_queue(
            exclusive=True, auto_delete=True, arguments={"x-max-length": 1}
        )
        await queue.bind(exchange)
        await queue.consume(self._on_message, no_ack=True)

    async def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        try:
            served = ServedModels.model_validate_json(message.body)
        except ValidationError:
            log.warning("served_models_invalid", bytes=len(message.body))
            return
        self.update(served)

    def update(self, served: ServedModels) -> None:
        self._latest = (served, time.monotonic())
        self._changed.set()

    def current(self) -> ServedModels | None:
        """The newest list while it is fresh, else None. Freshness counts from its arrival
        here, so the coordinator's and the gateway's clocks need not agree."""
        if self._latest is None:
            return None
        served, arrived = self._latest
        return served if time.monotonic() - arrived <= served.valid_s else None

    async def wait(self, timeout_s: float) -> ServedModels | None:
        """The current list, waiting up to ``timeout_s`` for one if there is none yet (a
        gateway or coordinator that just started)."""
        deadline = time.monotonic() + timeout_s
        while (served := self.current()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return served
