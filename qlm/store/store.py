"""Store: the durable record of every request's life, the instances and the plans.

The coordinator calls the ``record_*`` methods on its hot path (thousands of calls per second),
so they never touch the database: each is a plain call that appends to the write-behind buffer
of a :class:`~qlm.store.writer.BatchWriter`, which commits in batches (every 50 ms or 1000
entries, one transaction each). The queries read committed state, so they trail the record
calls by up to one flush interval; ``await store.flush()`` first when that matters.

Why lagging is safe: the broker holds each request (an unacked delivery) until its reply is
confirmed; the store is the *record*, not the source of truth. A crash loses at most the last
unflushed ~50 ms of history, never a request.

The ``record_*`` methods must be called from the event loop's thread.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, cast

import sqlalchemy as sa
from pydantic import TypeAdapter, ValidationError
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from qlm.store.answers import AnswerLog
from qlm.store.migrations import migrate as upgrade_to_head
from qlm.store.migrations import prepare_sqlite_path
from qlm.store.models import INSTANCE_STATUSES, EngineProfile, HardwareProfileRun, RequestStatus
from qlm.store.writer import (
    EVENT,
    EVENTS,
    INSTANCE,
    INSTANCES,
    PLAN,
    PLANS,
    REQUESTS,
    ROW,
    BatchWriter,
    StoreStats,
    dialect_insert,
)
from qlm.types import RequestId

PROFILES = cast(sa.Table, EngineProfile.__table__)
HARDWARE_PROFILES = cast(sa.Table, HardwareProfileRun.__table__)
_REQUEST_ID = TypeAdapter(RequestId)


class Store:
    """Write-behind state store over an async SQLAlchemy engine (SQLite or PostgreSQL)."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        flush_interval_s: float = 0.05,
        flush_events: int = 1000,
        max_buffered: int = 1_000_000,
        max_batch: int = 20_000,
        writers_engine: Engine | None = None,
    ) -> None:
        """Wrap an engine whose schema is current and start the flusher (needs a running loop).
        ``writers_engine``: a synchronous engine on the same database for the two writers, the
        write-behind buffer and the answer log (:meth:`open` makes one for a SQLite file, see
        qlm/store/engines.py), else they use ``engine``."""
        self._engine = engine
        self._writers_engine = writers_engine
        self._insert = dialect_insert(engine)
        self._writer = BatchWriter(
            writers_engine or engine,
            flush_interval_s=flush_interval_s,
            flush_events=flush_events,
            max_buffered=max_buffered,
            max_batch=max_batch,
        )
        # written *before* each reply, awaited (not write-behind): qlm/store/answers.py
        self.answers = AnswerLog(writers_engine or engine, self._insert)

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        migrate: bool = True,
        engine_kwargs: dict[str, Any] | None = None,
        flush_interval_s: float = 0.05,
        flush_events: int = 1000,
        max_buffered: int = 1_000_000,
        max_batch: int = 20_000,
    ) -> Store:
        """Create the engine, migrate to head (unless ``migrate=False``), start the flusher."""
        prepare_sqlite_path(url)
        if migrate:
            await asyncio.to_thread(upgrade_to_head, url)
        # a ping before each checkout finds a connection a database server dropped; a SQLite
        # file has none to drop, and the ping cost a thread round trip per transaction (the
        # answer log commits one per reply)
        sqlite = make_url(url).get_backend_name() == "sqlite"
        engine = create_async_engine(url, pool_pre_ping=not sqlite, **(engine_kwargs or {}))
        writers_engine = None
        if sqlite:
            sa_event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
            writers_engine = _sync_sqlite_engine(url, engine_kwargs or {})
        return cls(
            engine,
            flush_interval_s=flush_interval_s,
            flush_events=flush_events,
            max_buffered=max_buffered,
            max_batch=max_batch,
            writers_engine=writers_engine,
        )

    async def close(self, drain_s: float = 10.0) -> None:
        """Flush what is buffered (waiting at most ``drain_s``), stop the flusher, dispose.

        Entries still unwritten after ``drain_s`` (database down) are lost and logged.
        """
        await self._writer.close(drain_s)
        await self.answers.close()
        await self._engine.dispose()
        if self._writers_engine is not None:
            self._writers_engine.dispose()

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    @property
    def stats(self) -> StoreStats:
        return self._writer.stats

    async def flush(self) -> None:
        """Return once everything recorded before this call is committed.

        Waits through database outages; bound it with ``asyncio.timeout`` if needed.
        """
        await self._writer.flush()

    # ---------------------------------------------------------------- hot-path recording

    def record_received(
        self,
        *,
        request_id: str,
        model: str,
        slo_class: str | None,
        tenant: str | None,
        priority: int,
        prompt_tokens: int,
        max_tokens: int,
        submitted_at: float,
        queued_at: float,
        deadline: float | None,
        ttft_deadline: float | None,
    ) -> None:
        """A request arrived (or arrived again after a redelivery): its row and a history event."""
        status = RequestStatus.RECEIVED.value
        self._writer.append(
            ROW,
            request_id,
            {
                "request_id": request_id,
                "model": model,
                "slo_class": slo_class,
                "tenant": tenant,
                "priority": priority,
                "prompt_tokens": prompt_tokens,
                "max_tokens": max_tokens,
                "submitted_at": submitted_at,
                "queued_at": queued_at,
                "deadline": deadline,
                "ttft_deadline": ttft_deadline,
                "status": status,
                "updated_at": queued_at,
            },
        )
        self._append_event(request_id, status, queued_at, None, None)

    def record_status(
        self,
        request_id: str,
        status: RequestStatus,
        at: float,
        *,
        instance_id: str | None = None,
        attempts: int | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        """A status transition: appended to the history and set on the row.

        ``instance_id``/``attempts`` left as None keep the row's current values.
        """
        value = RequestStatus(status).value
        row: dict[str, Any] = {"request_id": request_id, "status": value, "updated_at": at}
        if instance_id is not None:
            row["instance_id"] = instance_id
        if attempts is not None:
            row["attempts"] = attempts
        self._writer.append(ROW, request_id, row)
        self._append_event(request_id, value, at, instance_id, detail)

    def record_finished(
        self,
        request_id: str,
        status: RequestStatus,
        at: float,
        *,
        instance_id: str | None,
        attempts: int,
        started_at: float | None,
        first_token_at: float | None,
        finished_at: float | None,
        output_tokens: int | None,
        slo_met: bool | None,
        error_code: str | None = None,
    ) -> None:
        """A terminal outcome (completed / failed / dead_lettered) with its timings."""
        value = RequestStatus(status).value
        self._writer.append(
            ROW,
            request_id,
            {
                "request_id": request_id,
                "status": value,
                "instance_id": instance_id,
                "attempts": attempts,
                "started_at": started_at,
                "first_token_at": first_token_at,
                "finished_at": finished_at,
                "output_tokens": output_tokens,
                "slo_met": slo_met,
                "error_code": error_code,
                "updated_at": at,
            },
        )
        detail = {"error_code": error_code} if error_code is not None else None
        self._append_event(request_id, value, at, instance_id, detail)

    def record_rejected(
        self,
        request_id: str | None,
        error_code: str,
        at: float,
        detail: dict[str, Any] | None = None,
    ) -> str:
        """A request refused as invalid. Returns the id it is stored under.

        A missing or unparseable id (not a protocol-v1 request id) is replaced by a synthetic
        ``invalid:<uuid hex>``; the raw value, truncated, goes into the event's detail.
        """
        stored_id = _valid_request_id(request_id)
        event_detail: dict[str, Any] = {"error_code": error_code, **(detail or {})}
        if stored_id is None:
            stored_id = f"invalid:{uuid.uuid4().hex}"
            if request_id is not None:
                event_detail["raw_request_id"] = repr(request_id)[:256]
        value = RequestStatus.REJECTED.value
        self._writer.append(
            ROW,
            stored_id,
            {
                "request_id": stored_id,
                "status": value,
                "error_code": error_code,
                "updated_at": at,
            },
        )
        self._append_event(stored_id, value, at, None, event_detail)
        return stored_id

    def upsert_instance(
        self,
        *,
        instance_id: str,
        agent_id: str,
        engine: str,
        gpu_type: str,
        gpu_memory_gb: float,
        models: list[str],
        kv_capacity_tokens: int,
        max_batch_size: int,
        status: str,
        at: float,
    ) -> None:
        """An instance registered, heartbeated or changed status; ``at`` becomes ``last_seen``.

        ``registered_at`` is set from ``at`` when the row is first written and kept afterwards.
        """
        if status not in INSTANCE_STATUSES:
            raise ValueError(f"instance status {status!r} not in {sorted(INSTANCE_STATUSES)}")
        self._writer.append(
            INSTANCE,
            instance_id,
            {
                "instance_id": instance_id,
                "agent_id": agent_id,
                "engine": engine,
                "gpu_type": gpu_type,
                "gpu_memory_gb": gpu_memory_gb,
                "models": list(models),
                "kv_capacity_tokens": kv_capacity_tokens,
                "max_batch_size": max_batch_size,
                "status": status,
                "registered_at": at,
                "last_seen": at,
            },
        )

    def record_plan(
        self,
        *,
        plan_id: str,
        policy: str,
        created_at: float,
        duration_s: float,
        n_requests: int,
        n_instances: int,
        summary: dict[str, Any],
    ) -> None:
        self._writer.append(
            PLAN,
            plan_id,
            {
                "plan_id": plan_id,
                "policy": policy,
                "created_at": created_at,
                "duration_s": duration_s,
                "n_requests": n_requests,
                "n_instances": n_instances,
                "summary": summary,
            },
        )

    def _append_event(
        self,
        request_id: str,
        status: str,
        at: float,
        instance_id: str | None,
        detail: dict[str, Any] | None,
    ) -> None:
        self._writer.append(
            EVENT,
            request_id,
            {
                "request_id": request_id,
                "status": status,
                "at": at,
                "instance_id": instance_id,
                "detail": detail,
            },
        )

    # ---------------------------------------------------------------- queries (committed state)

    async def get_request(self, request_id: str) -> dict[str, Any] | None:
        """The request's row plus ``history``: its events in recorded order; None if unknown."""
        async with self._engine.connect() as conn:
            row = (
                (await conn.execute(sa.select(REQUESTS).where(REQUESTS.c.request_id == request_id)))
                .mappings()
                .first()
            )
            if row is None:
                return None
            history = await conn.execute(
                sa.select(EVENTS.c.status, EVENTS.c.at, EVENTS.c.instance_id, EVENTS.c.detail)
                .where(EVENTS.c.request_id == request_id)
                .order_by(EVENTS.c.id)
            )
            result = dict(row)
            result["history"] = [dict(e) for e in history.mappings()]
            return result

    async def list_requests(
        self, *, status: RequestStatus | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """The most recently updated request rows (without history), optionally of one status."""
        query = sa.select(REQUESTS).order_by(REQUESTS.c.updated_at.desc()).limit(limit)
        if status is not None:
            query = query.where(REQUESTS.c.status == RequestStatus(status).value)
        async with self._engine.connect() as conn:
            return [dict(r) for r in (await conn.execute(query)).mappings()]

    async def count_by_status(self) -> dict[str, int]:
        """Number of requests in each status (every RequestStatus present, zeros included)."""
        counts = {s.value: 0 for s in RequestStatus}
        query = sa.select(REQUESTS.c.status, sa.func.count()).group_by(REQUESTS.c.status)
        async with self._engine.connect() as conn:
            for status, n in (await conn.execute(query)).all():
                counts[status] = int(n)
        return counts

    async def list_instances(self) -> list[dict[str, Any]]:
        async with self._engine.connect() as conn:
            result = await conn.execute(sa.select(INSTANCES).order_by(INSTANCES.c.instance_id))
            return [dict(r) for r in result.mappings()]

    async def latest_plan(self) -> dict[str, Any] | None:
        query = (
            sa.select(PLANS).order_by(PLANS.c.created_at.desc(), PLANS.c.plan_id.desc()).limit(1)
        )
        async with self._engine.connect() as conn:
            row = (await conn.execute(query)).mappings().first()
            return dict(row) if row is not None else None

    # ---------------------------------------------------------------- engine profiles (direct)

    async def save_profile(
        self, gpu_type: str, model: str, source: str, params: dict[str, Any]
    ) -> None:
        """Insert or replace the profile of (gpu_type, model, source); written immediately."""
        ins = self._insert(PROFILES).values(
            gpu_type=gpu_type, model=model, source=source, params=params, measured_at=time.time()
        )
        stmt = ins.on_conflict_do_update(
            index_elements=["gpu_type", "model", "source"],
            set_={"params": ins.excluded.params, "measured_at": ins.excluded.measured_at},
        )
        async with self._engine.begin() as conn:
            await conn.execute(stmt)

    async def list_profiles(self) -> list[dict[str, Any]]:
        """Every stored profile, oldest measurement first."""
        query = sa.select(PROFILES).order_by(PROFILES.c.measured_at, PROFILES.c.id)
        async with self._engine.connect() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [
            {k: r[k] for k in ("gpu_type", "model", "source", "params", "measured_at")}
            for r in rows
        ]

    async def get_profile(
        self, gpu_type: str, model: str, source: str | None = None
    ) -> dict[str, Any] | None:
        """The profile from ``source``, or the most recently measured one of any source."""
        query = (
            sa.select(PROFILES)
            .where(PROFILES.c.gpu_type == gpu_type, PROFILES.c.model == model)
            .order_by(PROFILES.c.measured_at.desc(), PROFILES.c.id.desc())
            .limit(1)
        )
        if source is not None:
            query = query.where(PROFILES.c.source == source)
        async with self._engine.connect() as conn:
            row = (await conn.execute(query)).mappings().first()
        if row is None:
            return None
        return {k: row[k] for k in ("gpu_type", "model", "source", "params", "measured_at")}

    # ---------------------------------------------------------------- hardware profiles (direct)

    async def save_hardware_profile(
        self, gpu_type: str, model: str, engine: str, body: dict[str, Any]
    ) -> int:
        """Record one profiling run (kept beside earlier ones); written immediately. Returns
        its id."""
        stmt = (
            sa.insert(HARDWARE_PROFILES)
            .values(
                gpu_type=gpu_type, model=model, engine=engine, created_at=time.time(), body=body
            )
            .returning(HARDWARE_PROFILES.c.id)
        )
        async with self._engine.begin() as conn:
            return int((await conn.execute(stmt)).scalar_one())

    async def get_hardware_profile(self, profile_id: int) -> dict[str, Any] | None:
        query = sa.select(HARDWARE_PROFILES).where(HARDWARE_PROFILES.c.id == profile_id)
        async with self._engine.connect() as conn:
            row = (await conn.execute(query)).mappings().first()
        return dict(row) if row is not None else None

    async def list_hardware_profiles(
        self,
        gpu_type: str | None = None,
        model: str | None = None,
        engine: str | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """Profiling runs, newest first, optionally of one GPU type, model and/or engine."""
        t = HARDWARE_PROFILES
        query = sa.select(t).order_by(t.c.created_at.desc(), t.c.id.desc())
        for column, value in ((t.c.gpu_type, gpu_type), (t.c.model, model), (t.c.engine, engine)):
            if value is not None:
                query = query.where(column == value)
        if limit is not None:
            query = query.limit(limit)
        async with self._engine.connect() as conn:
            return [dict(r) for r in (await conn.execute(query)).mappings()]

    async def latest_hardware_profile(
        self, gpu_type: str, model: str, engine: str | None = None
    ) -> dict[str, Any] | None:
        runs = await self.list_hardware_profiles(gpu_type, model, engine, limit=1)
        return runs[0] if runs else None


def _valid_request_id(request_id: object) -> str | None:
    if not isinstance(request_id, str):
        return None
    try:
        return _REQUEST_ID.validate_python(request_id)
    except ValidationError:
        return None


def _sync_sqlite_engine(url: str, engine_kwargs: dict[str, Any]) -> Engine | None:
    """The same SQLite file through the synchronous driver (the writers'), or None for
    an in-memory database, which a second engine would not share, and for a URI filename
    (``file:...``), which may name one."""
    parsed = make_url(url)
    database = parsed.database
    if not database or database == ":memory:" or database.startswith("file:") or parsed.query:
        return None
    # the same options (e.g. connect_args' lock timeout): sqlite3 takes what aiosqlite passes on
    engine = sa.create_engine(parsed.set(drivername="sqlite"), **engine_kwargs)
    sa_event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets queries read while the flusher writes; NORMAL sync is durable against process
    # crashes (the case that matters here); foreign keys match PostgreSQL's behaviour.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
