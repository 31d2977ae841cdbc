"""The Batch API's durable state: files, batches and batch lines (the OpenAI Batch API on the
durable queue, docs/gateway.md "Batch API").

Metadata lives in the database (tables ``files``, ``batches``, ``batch_lines``), so any
gateway replica on the same database serves any batch, and a restarted one resumes where the
last left off. An uploaded file's bytes go to a :class:`FileBodies` store: the database
(:class:`DatabaseBodies`, the default: nothing else to run) or a directory
(:class:`DirectoryBodies`, for one machine or a shared mount). An S3-compatible store would be
a third implementation of the same three methods.

Output and error files are not copies: their lines are the batch's answered lines, each written
once (``batch_lines`` primary key, unique ``custom_id``) as its reply comes, and rendered in
answer order when the file is read. So a result is in the output file the moment it is
recorded, and no crash can write it twice.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from qlm.store.models import Batch, BatchLine, FileBody, StoredFile

FILES = cast(sa.Table, StoredFile.__table__)
BODIES = cast(sa.Table, FileBody.__table__)
BATCHES = cast(sa.Table, Batch.__table__)
LINES = cast(sa.Table, BatchLine.__table__)

# batch statuses, as OpenAI names them
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")
# line states: waiting for the queue, on it, and the three ends
OPEN_STATES = ("pending", "published")

_INSERT_CHUNK = 1000  # rows per INSERT: bounded statement size on both databases


class FileNotFound(Exception):
    """No such file (or a body store lost its bytes)."""


class FileBodies(Protocol):
    """Where uploaded files' bytes are kept: put once, read many times, deleted once."""

    async def put(self, file_id: str, data: bytes) -> None: ...

    async def get(self, file_id: str) -> bytes: ...

    async def delete(self, file_id: str) -> None: ...


class DatabaseBodies:
    """File bytes in the database (table ``file_bodies``): shared by every replica for free."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def put(self, file_id: str, data: bytes) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(sa.insert(BODIES).values(file_id=file_id, body=data))

    async def get(self, file_id: str) -> bytes:
        async with self._engine.connect() as conn:
            body = (
                await conn.execute(sa.select(BODIES.c.body).where(BODIES.c.file_id == file_id))
            ).scalar_one_or_none()
        if body is None:
            raise FileNotFound(file_id)
        return bytes(body)

    async def delete(self, file_id: str) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(sa.delete(BODIES).where(BODIES.c.file_id == file_id))


class DirectoryBodies:
    """File bytes as files in a directory (one machine, or a mount every replica shares).
    Written to a temporary name, synced, then renamed: a crash leaves no half file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, file_id: str) -> Path:
        # file ids are made here (file-<hex>), never taken from a client as a path
        return self.directory / file_id

    async def put(self, file_id: str, data: bytes) -> None:
        def write() -> None:
            tmp = self._path(file_id).with_suffix(".part")
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self._path(file_id))

        await asyncio.to_thread(write)

    async def get(self, file_id: str) -> bytes:
        try:
            return await asyncio.to_thread(self._path(file_id).read_bytes)
        except FileNotFoundError:
            raise FileNotFound(file_id) from None

    async def delete(self, file_id: str) -> None:
        await asyncio.to_thread(self._path(file_id).unlink, missing_ok=True)


@dataclass(frozen=True)
class LineToPublish:
    line_no: int
    attempt: int
    request: str  # the RequestMessage JSON


@dataclass(frozen=True)
class Counts:
    total: int
    completed: int
    failed: int
    open: int  # pending or published: not answered yet
    pending: int = 0  # not published yet
    published: int = 0  # on the queue, not answered yet
    valid: int = 0  # lines that are requests (not refused when the batch was created)


class BatchStore:
    """Queries and updates of the Batch API's tables; every write is committed before it
    returns (none is write-behind: a batch's progress is what a restart resumes from)."""

    def __init__(self, engine: AsyncEngine, bodies: FileBodies | None = None) -> None:
        self.engine = engine
        self.bodies: FileBodies = bodies or DatabaseBodies(engine)

    # ---------------------------------------------------------------- files

    async def create_file(self, row: dict[str, Any], body: bytes | None) -> None:
        """A new file: its bytes first (an orphan body is harmless, a row without one is
        not), then its row."""
        if body is not None:
            await self.bodies.put(row["file_id"], body)
        async with self.engine.begin() as conn:
            await conn.execute(sa.insert(FILES).values(**row))

    async def get_file(self, file_id: str) -> dict[str, Any] | None:
        async with self.engine.connect() as conn:
            row = (
                (await conn.execute(sa.select(FILES).where(FILES.c.file_id == file_id)))
                .mappings()
                .first()
            )
        return dict(row) if row is not None else None

    async def list_files(self, tenant: str, limit: int) -> list[dict[str, Any]]:
        query = (
            sa.select(FILES)
            .where(FILES.c.tenant == tenant)
            .order_by(FILES.c.created_at.desc(), FILES.c.file_id.desc())
            .limit(limit)
        )
        async with self.engine.connect() as conn:
            return [dict(r) for r in (await conn.execute(query)).mappings()]

    async def delete_file(self, file_id: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(sa.delete(FILES).where(FILES.c.file_id == file_id))
        await self.bodies.delete(file_id)

    async def file_content(self, row: dict[str, Any]) -> bytes:
        """An upload's bytes; an output or error file's lines, in the order they were
        answered."""
        if row["kind"] == "upload":
            return await self.bodies.get(row["file_id"])
        return b"".join(line + b"\n" for line in await self._answered(row["batch_id"], row["kind"]))

    async def _answered(self, batch_id: str, kind: str) -> list[bytes]:
        state = "done" if kind == "output" else "failed"
        query = (
            sa.select(LINES.c.output)
            .where(LINES.c.batch_id == batch_id, LINES.c.state == state)
            .order_by(LINES.c.done_at, LINES.c.line_no)
        )
        async with self.engine.connect() as conn:
            return [str(o).encode() for o in (await conn.execute(query)).scalars()]

    # ---------------------------------------------------------------- batches

    async def create_batch(self, row: dict[str, Any], lines: Sequence[dict[str, Any]]) -> None:
        """The batch and all its lines, in one transaction: a batch exists whole or not at
        all."""
        async with self.engine.begin() as conn:
            await conn.execute(sa.insert(BATCHES).values(**row))
            for i in range(0, len(lines), _INSERT_CHUNK):
                await conn.execute(sa.insert(LINES), list(lines[i : i + _INSERT_CHUNK]))

    async def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        async with self.engine.connect() as conn:
            row = (
                (await conn.execute(sa.select(BATCHES).where(BATCHES.c.batch_id == batch_id)))
                .mappings()
                .first()
            )
        return dict(row) if row is not None else None

    async def list_batches(
        self, tenant: str, *, after: dict[str, Any] | None, limit: int
    ) -> list[dict[str, Any]]:
        """The tenant's batches, newest first, those older than ``after`` (a cursor batch)."""
        b = BATCHES
        query = sa.select(b).where(b.c.tenant == tenant)
        if after is not None:
            query = query.where(
                sa.or_(
                    b.c.created_at < after["created_at"],
                    sa.and_(
                        b.c.created_at == after["created_at"], b.c.batch_id < after["batch_id"]
                    ),
                )
            )
        query = query.order_by(b.c.created_at.desc(), b.c.batch_id.desc()).limit(limit)
        async with self.engine.connect() as conn:
            return [dict(r) for r in (await conn.execute(query)).mappings()]

    async def counts(self, batch_id: str) -> Counts:
        query = (
            sa.select(LINES.c.state, sa.func.count(), sa.func.count(LINES.c.request))
            .where(LINES.c.batch_id == batch_id)
            .group_by(LINES.c.state)
        )
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        by_state = {s: int(n) for s, n, _ in rows}
        return Counts(
            total=sum(by_state.values()),
            completed=by_state.get("done", 0),
            failed=by_state.get("failed", 0),
            open=sum(by_state.get(s, 0) for s in OPEN_STATES),
            pending=by_state.get("pending", 0),
            published=by_state.get("published", 0),
            valid=sum(int(v) for _, _, v in rows),
        )

    async def open_lines_of_tenant(self, tenant: str) -> int:
        """Lines of the tenant's batches still waiting for an answer (the per-tenant quota)."""
        query = (
            sa.select(sa.func.count())
            .select_from(LINES.join(BATCHES, LINES.c.batch_id == BATCHES.c.batch_id))
            .where(
                BATCHES.c.tenant == tenant,
                BATCHES.c.status.in_(ACTIVE),
                LINES.c.state.in_(OPEN_STATES),
            )
        )
        async with self.engine.connect() as conn:
            return int((await conn.execute(query)).scalar_one())

    async def update_batch(
        self, batch_id: str, values: dict[str, Any], *, only_if: Iterable[str] | None = None
    ) -> bool:
        """Set ``values`` on the batch (if its status is one of ``only_if``); whether it did."""
        stmt = sa.update(BATCHES).where(BATCHES.c.batch_id == batch_id).values(**values)
        if only_if is not None:
            stmt = stmt.where(BATCHES.c.status.in_(tuple(only_if)))
        async with self.engine.begin() as conn:
            return (await conn.execute(stmt)).rowcount == 1

    # ---------------------------------------------------------------- the runner's lease

    async def claim(self, owner: str, lease_s: float, now: float) -> list[str]:
        """Take (or renew) the lease of every active batch whose lease is free, expired or
        ours; return the ids now ours. One conditional UPDATE per batch: of two replicas that
        race for a batch, the database lets exactly one succeed."""
        b = BATCHES
        async with self.engine.connect() as conn:
            candidates = (
                await conn.execute(
                    sa.select(b.c.batch_id).where(
                        b.c.status.in_(ACTIVE),
                        sa.or_(
                            b.c.lease_owner.is_(None),
                            b.c.lease_owner == owner,
                            b.c.lease_until < now,
                        ),
                    )
                )
            ).scalars()
            ids = list(candidates)
        mine: list[str] = []
        for batch_id in ids:
            stmt = (
                sa.update(b)
                .where(
                    b.c.batch_id == batch_id,
                    b.c.status.in_(ACTIVE),
                    sa.or_(
                        b.c.lease_owner.is_(None),
                        b.c.lease_owner == owner,
                        b.c.lease_until < now,
                    ),
                )
                .values(lease_owner=owner, lease_until=now + lease_s)
            )
            async with self.engine.begin() as conn:
                if (await conn.execute(stmt)).rowcount == 1:
                    mine.append(batch_id)
        return mine

    async def release(self, owner: str) -> None:
        """Give up every lease of ``owner`` (a clean shutdown: another replica may take over
        at once instead of after the lease runs out)."""
        stmt = (
            sa.update(BATCHES)
            .where(BATCHES.c.lease_owner == owner)
            .values(lease_owner=None, lease_until=None)
        )
        async with self.engine.begin() as conn:
            await conn.execute(stmt)

    # ---------------------------------------------------------------- lines

    async def lines_to_publish(
        self, batch_id: str, now: float, limit: int, *, republish: bool, after_line: int = 0
    ) -> list[LineToPublish]:
        """Pending lines due now; with ``republish`` instead those published already and not
        answered (a runner that just took the batch over cannot know which of them reached
        the queue)."""
        states = ("published",) if republish else ("pending",)
        query = (
            sa.select(LINES.c.line_no, LINES.c.attempt, LINES.c.request)
            .where(
                LINES.c.batch_id == batch_id,
                LINES.c.line_no > after_line,
                LINES.c.state.in_(states),
                sa.or_(LINES.c.not_before.is_(None), LINES.c.not_before <= now),
            )
            .order_by(LINES.c.line_no)
            .limit(limit)
        )
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [LineToPublish(int(r[0]), int(r[1]), str(r[2])) for r in rows]

    async def mark_published(self, batch_id: str, lines: Sequence[LineToPublish]) -> None:
        """Mark lines as on the queue, *before* they are published: a crash after this and
        before the publish leaves them for the next runner, which re-publishes what is
        ``published`` and unanswered (the coordinator runs each request id once)."""
        if not lines:
            return
        stmt = (
            sa.update(LINES)
            .where(
                LINES.c.batch_id == batch_id,
                LINES.c.line_no.in_([ln.line_no for ln in lines]),
                LINES.c.state == "pending",
            )
            .values(state="published")
        )
        async with self.engine.begin() as conn:
            await conn.execute(stmt)

    async def answer(
        self, batch_id: str, line_no: int, attempt: int, state: str, output: str, now: float
    ) -> bool:
        """Record a line's one answer (``done`` or ``failed``, with its file line). False when
        it had one already, or the reply is for an earlier attempt: then nothing changes."""
        stmt = (
            sa.update(LINES)
            .where(
                LINES.c.batch_id == batch_id,
                LINES.c.line_no == line_no,
                LINES.c.attempt == attempt,
                LINES.c.state.in_(OPEN_STATES),
            )
            .values(state=state, output=output, done_at=now)
        )
        async with self.engine.begin() as conn:
            return (await conn.execute(stmt)).rowcount == 1

    async def close_one(
        self, batch_id: str, line_no: int, attempt: int, state: str, now: float
    ) -> bool:
        """End one open line without a file line (``cancelled``)."""
        stmt = (
            sa.update(LINES)
            .where(
                LINES.c.batch_id == batch_id,
                LINES.c.line_no == line_no,
                LINES.c.attempt == attempt,
                LINES.c.state.in_(OPEN_STATES),
            )
            .values(state=state, done_at=now)
        )
        async with self.engine.begin() as conn:
            return (await conn.execute(stmt)).rowcount == 1

    async def custom_id(self, batch_id: str, line_no: int) -> str | None:
        query = sa.select(LINES.c.custom_id).where(
            LINES.c.batch_id == batch_id, LINES.c.line_no == line_no
        )
        async with self.engine.connect() as conn:
            value = (await conn.execute(query)).scalar_one_or_none()
        return None if value is None else str(value)

    async def retry_later(self, batch_id: str, line_no: int, attempt: int, at: float) -> bool:
        """The line's request was refused for now (``overloaded``): publish it again from
        ``at``, as a new attempt (a new request id: the refusal is the old id's answer)."""
        stmt = (
            sa.update(LINES)
            .where(
                LINES.c.batch_id == batch_id,
                LINES.c.line_no == line_no,
                LINES.c.attempt == attempt,
                LINES.c.state.in_(OPEN_STATES),
            )
            .values(state="pending", attempt=attempt + 1, not_before=at)
        )
        async with self.engine.begin() as conn:
            return (await conn.execute(stmt)).rowcount == 1

    async def published_lines(self, batch_id: str) -> list[tuple[int, int]]:
        """(line_no, attempt) of the lines on the queue and not answered yet."""
        query = sa.select(LINES.c.line_no, LINES.c.attempt).where(
            LINES.c.batch_id == batch_id, LINES.c.state == "published"
        )
        async with self.engine.connect() as conn:
            return [(int(a), int(b)) for a, b in (await conn.execute(query)).all()]

    async def close_open_lines(
        self, batch_id: str, state: str, states: Sequence[str], output_for: Any = None
    ) -> int:
        """End every line in ``states`` as ``state`` (cancelled, or failed on expiry with the
        error line ``output_for(line_no, custom_id)``). Returns how many."""
        now = time.time()
        async with self.engine.begin() as conn:
            rows = (
                await conn.execute(
                    sa.select(LINES.c.line_no, LINES.c.custom_id).where(
                        LINES.c.batch_id == batch_id, LINES.c.state.in_(tuple(states))
                    )
                )
            ).all()
            for line_no, custom_id in rows:
                values: dict[str, Any] = {"state": state, "done_at": now}
                if output_for is not None:
                    values["output"] = output_for(int(line_no), custom_id)
                await conn.execute(
                    sa.update(LINES)
                    .where(
                        LINES.c.batch_id == batch_id,
                        LINES.c.line_no == line_no,
                        LINES.c.state.in_(tuple(states)),
                    )
                    .values(**values)
                )
        return len(rows)

    async def finalize(self, batch_id: str, status: str, at_field: str, now: float) -> bool:
        """End the batch as ``status``: its output file (if any line was answered) and its
        error file (if any line failed) are created, and the batch names them, in one
        transaction; only from an active status, so only once."""
        batch = await self.get_batch(batch_id)
        if batch is None or batch["status"] not in ACTIVE:
            return False
        counts = await self.counts(batch_id)
        files: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        rows = []
        for kind, n in (("output", counts.completed), ("error", counts.failed)):
            if n == 0:
                continue
            content = await self._answered(batch_id, kind)
            file_id = f"file-{batch_id.removeprefix('batch_')}{'o' if kind == 'output' else 'e'}"
            files[f"{kind}_file_id"] = file_id
            rows.append(
                {
                    "file_id": file_id,
                    "tenant": batch["tenant"],
                    "purpose": "batch_output",
                    "filename": f"{batch_id}_{kind}.jsonl",
                    "bytes": sum(len(c) + 1 for c in content),
                    "lines": len(content),
                    "created_at": now,
                    "kind": kind,
                    "batch_id": batch_id,
                }
            )
        async with self.engine.begin() as conn:
            done = await conn.execute(
                sa.update(BATCHES)
                .where(BATCHES.c.batch_id == batch_id, BATCHES.c.status.in_(ACTIVE))
                .values(
                    status=status,
                    lease_owner=None,
                    lease_until=None,
                    finalizing_at=now,
                    **files,
                    **{at_field: now},
                )
            )
            if done.rowcount != 1:
                return False
            for row in rows:
                await conn.execute(sa.insert(FILES).values(**row))
        return True
