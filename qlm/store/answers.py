"""AnswerLog: the durable record of what each request was answered, with group commit.

The coordinator's exactly-once rule (docs/architecture.md, "Exactly once"):

1. a reply is *recorded* here (committed) before it is published;
2. it is published with a confirm, under the recorded ``reply_id``;
3. only then is the request's delivery acked.

A crash between any two steps leaves the delivery unacked, so the broker redelivers it to the
next coordinator (a restart or a standby). That one finds the record and publishes the *same*
reply again under the same ``reply_id`` - which the producer's client drops as a copy if the
first one got through - instead of running the request and answering it a second time. A
request that ran twice anyway (a producer re-published its id after the in-memory window, a
result left in the control queue) cannot be answered twice either: :meth:`AnswerLog.record`
keeps the first answer and returns it to whoever records second.

The hot path calls :meth:`record` once per reply, so writes are group-committed: while one
transaction is in flight the next callers queue up, and the next transaction takes all of them
(one round trip for hundreds of replies under load, one short one when idle). Lookups of
redelivered requests are batched the same way (one ``SELECT ... IN`` per round).

On a SQLite file the log runs on a synchronous engine, each transaction in one worker-thread
hop (qlm/store/engines.py says why).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import sqlalchemy as sa
import structlog
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_chain,
    wait_fixed,
)

from qlm.store.engines import in_transaction
from qlm.store.models import Answer

log = structlog.get_logger(__name__)

ANSWERS = cast(sa.Table, Answer.__table__)

MAX_BATCH = 500  # answers (or lookups) per transaction
RETRY_DELAYS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0)  # a transient database failure, then give up


class AnswerLogUnavailable(Exception):
    """The database did not take the record: the caller must not publish the reply."""


@dataclass(frozen=True)
class StoredAnswer:
    request_id: str
    reply_id: str
    tenant: str | None
    kind: str  # "result" | "error"
    body: str  # the reply message's JSON
    answered_at: float

    def columns(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "reply_id": self.reply_id,
            "tenant": self.tenant,
            "kind": self.kind,
            "body": self.body,
            "answered_at": self.answered_at,
        }


def _from_row(row: Any) -> StoredAnswer:
    return StoredAnswer(
        request_id=row["request_id"],
        reply_id=row["reply_id"],
        tenant=row["tenant"],
        kind=row["kind"],
        body=row["body"],
        answered_at=row["answered_at"],
    )


class AnswerLog:
    """Group-committed answer records over a SQLAlchemy engine: an async one, or a
    synchronous one whose transactions run in a worker thread (module docstring)."""

    def __init__(self, engine: AsyncEngine | Engine, insert: Any) -> None:
        self._engine = engine
        self._insert = insert  # the dialect's insert (supports on_conflict_do_nothing)
        self._records: list[tuple[StoredAnswer, asyncio.Future[StoredAnswer]]] = []
        self._lookups: dict[str, list[asyncio.Future[StoredAnswer | None]]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.recorded = 0
        self.conflicts = 0  # records that found an earlier answer (a request ran twice)
        self.commits = 0

    # ---------------------------------------------------------------- public

    async def record(self, answer: StoredAnswer) -> StoredAnswer:
        """Commit ``answer`` unless its request already has one; return the one on record
        (``answer`` itself, or the earlier answer, which is then the one to publish).
        Raises :class:`AnswerLogUnavailable` when the database keeps failing."""
        fut: asyncio.Future[StoredAnswer] = asyncio.get_running_loop().create_future()
        self._records.append((answer, fut))
        self._kick()
        return await fut

    async def lookup(self, request_id: str) -> StoredAnswer | None:
        """The answer on record for ``request_id``, or None (batched with concurrent calls)."""
        fut: asyncio.Future[StoredAnswer | None] = asyncio.get_running_loop().create_future()
        self._lookups.setdefault(request_id, []).append(fut)
        self._kick()
        return await fut

    async def recent_ids(self, limit: int) -> list[str]:
        """The ids of the newest ``limit`` answers, oldest first (to seed a memory window)."""

        def newest(conn: Connection) -> list[str]:
            rows = conn.execute(
                sa.select(ANSWERS.c.request_id).order_by(ANSWERS.c.answered_at.desc()).limit(limit)
            )
            return [r[0] for r in rows][::-1]

        return await in_transaction(self._engine, newest)

    async def prune(self, older_than: float) -> int:
        """Forget answers recorded before ``older_than`` (unix seconds); returns how many."""

        def delete(conn: Connection) -> int:
            result = conn.execute(ANSWERS.delete().where(ANSWERS.c.answered_at < older_than))
            return int(result.rowcount or 0)

        return await in_transaction(self._engine, delete)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for _, fut in self._records:
            if not fut.done():
                fut.set_exception(AnswerLogUnavailable("answer log closed"))
        for futs in self._lookups.values():
            for f in futs:
                if not f.done():
                    f.set_exception(AnswerLogUnavailable("answer log closed"))
        self._records, self._lookups = [], {}

    # ---------------------------------------------------------------- the committer task

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="qlm-answer-log")
        self._wake.set()

    async def _run(self) -> None:
        while True:
            if not self._records and not self._lookups:
                self._wake.clear()
                await self._wake.wait()
            records, self._records = self._records[:MAX_BATCH], self._records[MAX_BATCH:]
            ids = list(self._lookups)[:MAX_BATCH]
            lookups = {rid: self._lookups.pop(rid) for rid in ids}
            try:
                stored = await self._round(records, list(lookups))
            except Exception as exc:  # every retry failed: the callers decide what to do
                error = AnswerLogUnavailable(f"answer log unavailable: {exc!r}"[:300])
                for _, fut in records:
                    if not fut.done():
                        fut.set_exception(error)
                for futs in lookups.values():
                    for f in futs:
                        if not f.done():
                            f.set_exception(error)
                continue
            for answer, fut in records:
                on_record = stored.get(answer.request_id, answer)
                if on_record.reply_id != answer.reply_id:
                    self.conflicts += 1
                else:
                    self.recorded += 1
                if not fut.done():
                    fut.set_result(on_record)
            for rid, futs in lookups.items():
                for f in futs:
                    if not f.done():
                        f.set_result(stored.get(rid))

    async def _round(
        self, records: Sequence[tuple[StoredAnswer, Any]], lookups: Sequence[str]
    ) -> dict[str, StoredAnswer]:
        """One transaction: insert the new answers (keeping any earlier one), then read back
        every other id involved. Transient failures are retried with backoff, then raised."""
        # two answers for one id in the same round: the first wins, like across rounds
        fresh: dict[str, StoredAnswer] = {}
        for answer, _ in records:
            fresh.setdefault(answer.request_id, answer)
        wanted = sorted(set(fresh) | set(lookups))

        def write_then_read(conn: Connection) -> dict[str, StoredAnswer]:
            found: dict[str, StoredAnswer] = {}
            if fresh:
                # RETURNING names the rows this insert wrote: those hold what was just given,
                # so only the others (an earlier answer kept, a lookup) are read back
                stmt = (
                    self._insert(ANSWERS)
                    .on_conflict_do_nothing(index_elements=["request_id"])
                    .returning(ANSWERS.c.request_id)
                )
                written = conn.execute(stmt, [a.columns() for a in fresh.values()]).scalars()
                found = {rid: fresh[rid] for rid in written}
            rest = [rid for rid in wanted if rid not in found]
            if rest:
                rows = conn.execute(sa.select(ANSWERS).where(ANSWERS.c.request_id.in_(rest)))
                found.update((r["request_id"], _from_row(r)) for r in rows.mappings())
            return found

        async def transaction() -> dict[str, StoredAnswer]:
            return await in_transaction(self._engine, write_then_read)

        def retrying(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            log.warning(
                "answer_log_retry",
                attempt=state.attempt_number,
                error=repr(error)[:200],
                records=len(fresh),
                lookups=len(lookups),
            )

        delays = RETRY_DELAYS_S  # the module's value at each round (tests shorten it)
        found: dict[str, StoredAnswer] = await AsyncRetrying(
            retry=retry_if_exception_type(Exception),  # never CancelledError: stop at once
            wait=wait_chain(*(wait_fixed(d) for d in delays)),
            stop=stop_after_attempt(len(delays) + 1),
            before_sleep=retrying,
            reraise=True,  # the database's own error, for AnswerLogUnavailable's message
        )(transaction)
        self.commits += 1
        return found
