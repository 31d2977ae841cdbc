"""BatchWriter: the write-behind buffer and its flusher task, behind :class:`qlm.store.Store`.

``append`` is a plain call that puts one entry (a request row change, a history event, an
instance or a plan) on an in-memory list. The flusher task writes the oldest entries in one
transaction every ``flush_interval_s``, or at once when ``flush_events`` entries are waiting
(a backlog goes out in transactions of up to ``max_batch`` entries).

Ordering: one task writes, oldest first. Within a transaction the request rows are coalesced
(applying the changes in order, the last write of each column wins) and upserted before the
events, which are inserted in recorded order; so ``request_events.id`` orders a history.

Failures: a transaction that fails for a transient reason (database down, locked) leaves its
entries at the head of the buffer and is retried with exponential backoff (50 ms to 2 s). One
that fails because of its values (too long, not JSON) is redone one entry per transaction, and
only the entries the database refuses are dropped, each logged as an error. The buffer holds at
most ``max_buffered`` entries; beyond that, new entries are dropped, counted and logged loudly,
so a long database outage cannot exhaust the coordinator's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import sqlalchemy as sa
import structlog
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from qlm.store.engines import in_transaction
from qlm.store.models import Instance, Plan, Request, RequestEvent

log = structlog.get_logger(__name__)

REQUESTS = cast(sa.Table, Request.__table__)
EVENTS = cast(sa.Table, RequestEvent.__table__)
INSTANCES = cast(sa.Table, Instance.__table__)
PLANS = cast(sa.Table, Plan.__table__)

# Entry kinds. An entry is (kind, key, columns), key being the row's primary key.
ROW, EVENT, INSTANCE, PLAN = 0, 1, 2, 3
_TABLE_OF_KIND = (REQUESTS, EVENTS, INSTANCES, PLANS)
Entry = tuple[int, str, dict[str, Any]]

_MAX_RETRY_DELAY_S = 2.0

InsertFactory = Callable[[sa.Table], Any]


def dialect_insert(engine: AsyncEngine | Engine) -> InsertFactory:
    """The dialect's ``insert`` that supports ``on_conflict_do_update`` (SQLite or PostgreSQL)."""
    name = engine.dialect.name
    if name == "sqlite":
        return cast(InsertFactory, sqlite_dialect.insert)
    if name == "postgresql":
        return cast(InsertFactory, pg_dialect.insert)
    raise ValueError(f"unsupported database {name!r}: use sqlite or postgresql")


@dataclass(frozen=True, slots=True)
class StoreStats:
    recorded: int  # entries accepted into the buffer since open
    committed: int  # entries written (or, for refused values, given up on) since open
    buffered: int  # entries waiting now
    dropped_full: int  # entries refused because the buffer was full
    dropped_invalid: int  # entries the database refused because of their values
    batches: int  # committed transactions
    failures: int  # failed write attempts


class BatchWriter:
    """Buffers entries and commits them in batches on ``engine``: an async one, or a
    synchronous one whose transactions run in a worker thread (qlm/store/engines.py)."""

    def __init__(
        self,
        engine: AsyncEngine | Engine,
        *,
        flush_interval_s: float = 0.05,
        flush_events: int = 1000,
        max_buffered: int = 1_000_000,
        max_batch: int = 20_000,
    ) -> None:
        self._engine = engine
        self._insert = dialect_insert(engine)
        self._interval = flush_interval_s
        self._flush_events = flush_events
        self._max_buffered = max_buffered
        self._max_batch = max_batch
        self._buffer: list[Entry] = []
        self._recorded = 0
        self._committed = 0
        self._dropped_full = 0
        self._dropped_invalid = 0
        self._batches = 0
        self._failures = 0
        self._flush_target = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._closed = False
        self._upserts: dict[tuple[str, ...], Any] = {}
        self._task = asyncio.get_running_loop().create_task(self._run(), name="qlm-store-flusher")

    @property
    def stats(self) -> StoreStats:
        return StoreStats(
            recorded=self._recorded,
            committed=self._committed,
            buffered=len(self._buffer),
            dropped_full=self._dropped_full,
            dropped_invalid=self._dropped_invalid,
            batches=self._batches,
            failures=self._failures,
        )

    def append(self, kind: int, key: str, columns: dict[str, Any]) -> None:
        """Queue one entry. Never blocks; must run on the event loop's thread."""
        if self._closing:
            raise RuntimeError("store is closing")
        if len(self._buffer) >= self._max_buffered:
            self._dropped_full += 1
            if self._dropped_full == 1 or self._dropped_full % 10_000 == 0:
                log.error(
                    "store_buffer_full_dropping",
                    dropped=self._dropped_full,
                    max_buffered=self._max_buffered,
                    failures=self._failures,
                )
            return
        self._buffer.append((kind, key, columns))
        self._recorded += 1
        if len(self._buffer) == self._flush_events:
            self._wake.set()

    async def flush(self) -> None:
        """Return once every entry appended before this call is committed."""
        target = self._recorded
        if self._committed >= target:
            return
        if self._closed:
            raise RuntimeError("store is closed")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, fut))
        self._flush_target = max(self._flush_target, target)
        self._wake.set()
        await fut

    async def close(self, drain_s: float) -> None:
        """Write what is buffered (for at most ``drain_s``), then stop the flusher."""
        if self._closed:
            return
        self._closing = True
        self._flush_target = self._recorded
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), drain_s)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            log.error("store_closed_unflushed", lost_entries=len(self._buffer))
        self._closed = True
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(RuntimeError("store closed before the flush completed"))
        self._waiters.clear()

    # ---------------------------------------------------------------- the flusher task

    async def _run(self) -> None:
        retry_delay = self._interval
        while True:
            idle = (
                len(self._buffer) < self._flush_events
                and self._committed >= self._flush_target
                and not self._closing
            )
            if idle:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._interval)
            if not self._buffer:
                if self._closing:
                    return
                continue
            if await self._write_oldest():
                retry_delay = self._interval
            else:
                await asyncio.sleep(retry_delay)
                retry_delay = min(retry_delay * 2, _MAX_RETRY_DELAY_S)

    async def _write_oldest(self) -> bool:
        """Write the oldest entries in one transaction. False: failed, entries kept for retry."""
        batch = self._buffer[: self._max_batch]
        try:
            await in_transaction(self._engine, partial(self._write, batch=batch))
        except Exception as exc:
            self._failures += 1
            if not _is_value_error(exc):
                log.error(
                    "store_flush_failed",
                    error=_describe(exc),
                    batch=len(batch),
                    buffered=len(self._buffer),
                    failures=self._failures,
                )
                return False
            log.error("store_batch_refused", error=_describe(exc), batch=len(batch))
            return await self._write_one_by_one(batch)
        self._batches += 1
        self._mark_committed(len(batch))
        return True

    async def _write_one_by_one(self, batch: Sequence[Entry]) -> bool:
        """Isolate the entries the database refuses; drop only those (each logged)."""
        for entry in batch:
            try:
                await in_transaction(self._engine, partial(self._write, batch=[entry]))
            except Exception as exc:
                if not _is_value_error(exc):
                    self._failures += 1
                    log.error(
                        "store_flush_failed", error=_describe(exc), buffered=len(self._buffer)
                    )
                    return False
                self._dropped_invalid += 1
                log.error(
                    "store_entry_dropped",
                    table=_TABLE_OF_KIND[entry[0]].name,
                    key=entry[1][:128],
                    error=_describe(exc),
                )
            else:
                self._batches += 1
            self._mark_committed(1)
        return True

    def _mark_committed(self, n: int) -> None:
        # Only this task removes entries, always from the head: appends meanwhile went after.
        del self._buffer[:n]
        self._committed += n
        if self._waiters:
            pending = []
            for target, fut in self._waiters:
                if self._committed >= target:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    pending.append((target, fut))
            self._waiters = pending

    def _write(self, conn: Connection, batch: Sequence[Entry]) -> None:
        # may run in a worker thread: it reads ``batch`` (a copy of the buffer's head, whose
        # entries are never changed once buffered) and the statement cache, nothing else
        rows: dict[str, dict[str, Any]] = {}
        events: list[dict[str, Any]] = []
        instances: dict[str, dict[str, Any]] = {}
        plans: dict[str, dict[str, Any]] = {}
        for kind, key, columns in batch:
            if kind == EVENT:
                events.append(columns)
            elif kind == ROW:
                merged = rows.get(key)
                if merged is None:
                    rows[key] = dict(columns)  # a copy: the entry must survive a failed batch
                else:
                    merged.update(columns)
            elif kind == INSTANCE:
                first = instances.get(key)
                instances[key] = (
                    columns
                    if first is None
                    else {**columns, "registered_at": first["registered_at"]}
                )
            else:
                plans[key] = columns
        # Rows before events: every event's request row must exist (foreign key). Rows with
        # the same set of changed columns share one executemany.
        by_columns: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for row in rows.values():
            by_columns.setdefault(tuple(sorted(row)), []).append(row)
        for columns_set, params in by_columns.items():
            conn.execute(self._upsert(REQUESTS, ("request_id",), columns_set), params)
        if events:
            conn.execute(EVENTS.insert(), events)
        if instances:
            params = list(instances.values())
            cols = tuple(c for c in params[0] if c != "registered_at")  # kept from the first write
            conn.execute(self._upsert(INSTANCES, ("instance_id",), cols), params)
        if plans:
            params = list(plans.values())
            conn.execute(self._upsert(PLANS, ("plan_id",), tuple(params[0])), params)

    def _upsert(self, table: sa.Table, key: tuple[str, ...], columns: tuple[str, ...]) -> Any:
        """``INSERT ... ON CONFLICT (key) DO UPDATE SET col = excluded.col`` for ``columns``."""
        cache_key = (table.name, *columns)
        stmt = self._upserts.get(cache_key)
        if stmt is None:
            ins = self._insert(table)
            updates = {c: ins.excluded[c] for c in columns if c not in key}
            stmt = ins.on_conflict_do_update(index_elements=list(key), set_=updates)
            self._upserts[cache_key] = stmt
        return stmt


def _is_value_error(exc: BaseException) -> bool:
    """True when retrying cannot help: the database (or the driver) refuses the values."""
    if isinstance(exc, sa_exc.IntegrityError | sa_exc.DataError):
        return True
    # A StatementError that is not a DBAPIError failed in Python while binding parameters
    # (e.g. a detail dict that is not JSON-serializable).
    return isinstance(exc, sa_exc.StatementError) and not isinstance(exc, sa_exc.DBAPIError)


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:500] + "..."
