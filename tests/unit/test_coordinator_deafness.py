"""While this coordinator's broker connection is lost, or back but its channels and consumers
not yet restored, it cannot hear heartbeats: it holds no agent lost for that silence."""

from __future__ import annotations

import asyncio
from pathlib import Path

from qlm.coordinator.service import Coordinator
from qlm.planner import create_policy
from qlm.store import Store


class FakeConnection:
    """What ``_deaf`` reads of aio-pika's robust connection: its transport's ``connected``."""

    def __init__(self) -> None:
        self.connected = asyncio.Event()
        self.connected.set()


async def test_the_coordinator_is_deaf_until_its_consumers_are_restored(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    try:
        coord = Coordinator(amqp_url="amqp://unused", policy=create_policy("edf"), store=store)
        conn = FakeConnection()
        coord._conn = conn  # type: ignore[assignment]
        assert not coord._deaf()
        coord._on_connection_lost(conn, RuntimeError("connection reset"))
        conn.connected.clear()
        assert coord._deaf()
        # the transport is back; the consumers (the control queue's among them) are not
        conn.connected.set()
        assert coord._deaf()
        coord._on_reconnected(conn)
        assert not coord._deaf()
        assert coord._reconnected_at is not None
    finally:
        await store.close()
