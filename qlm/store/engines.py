"""One transaction on either kind of engine the store uses.

The store's queries and migrations run on an async engine (aiosqlite or asyncpg). Its two
writers, the write-behind :class:`~qlm.store.writer.BatchWriter` and the exactly-once
:class:`~qlm.store.answers.AnswerLog`, run on a synchronous engine of their own where the
database is a SQLite file: through the async driver every statement, ``BEGIN`` and ``COMMIT``
is a round trip between the event loop and the driver's thread, and one small transaction cost
the coordinator about three times the CPU that the whole transaction in one worker-thread hop
does (2.4 against 0.7 ms on the development machine). PostgreSQL keeps the async engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine

T = TypeVar("T")


async def in_transaction(engine: AsyncEngine | Engine, work: Callable[[Connection], T]) -> T:
    """``work`` inside one transaction (committed when it returns, rolled back when it
    raises): on an async engine through its greenlet bridge, on a synchronous one in a
    worker thread."""
    if isinstance(engine, AsyncEngine):
        async with engine.begin() as conn:
            return await conn.run_sync(work)

    def in_thread() -> T:
        with engine.begin() as conn:
            return work(conn)

    return await asyncio.to_thread(in_thread)
