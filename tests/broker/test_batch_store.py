"""The Batch API's store (qlm/store/batches.py) on SQLite and on PostgreSQL: the lease lets one
runner have a batch, a line is answered once, custom_ids are unique, a batch ends once."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from qlm.gateway.batch_runner import BatchRunner
from qlm.store import migrate
from qlm.store.batches import BatchStore, DirectoryBodies, FileNotFound
from qlm.types import RequestMessage
from tests.broker.test_migrations import fresh_postgres_database


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BatchStore]:
    async def opened(url: str) -> BatchStore:
        await asyncio.to_thread(migrate, url)
        return BatchStore(create_async_engine(url))

    if request.param == "sqlite":
        s = await opened(f"sqlite+aiosqlite:///{tmp_path}/b.db")
        yield s
        await s.engine.dispose()
        return
    async with fresh_postgres_database(request.getfixturevalue("postgres_url")) as url:
        s = await opened(url)
        yield s
        await s.engine.dispose()


def _batch(batch_id: str, n: int, now: float = 1000.0) -> tuple[dict, list[dict]]:
    row = {
        "batch_id": batch_id,
        "tenant": "t",
        "input_file_id": "file-x",
        "endpoint": "/v1/chat/completions",
        "completion_window": "1h",
        "window_s": 3600.0,
        "meta": None,
        "status": "in_progress",
        "errors": None,
        "total": n,
        "created_at": now,
        "expires_at": now + 3600,
        "in_progress_at": now,
    }
    lines = [
        {
            "batch_id": batch_id,
            "line_no": i,
            "custom_id": f"c{i}",
            "state": "pending",
            "request": "{}",
            "output": None,
            "done_at": None,
        }
        for i in range(1, n + 1)
    ]
    return row, lines


async def test_one_runner_holds_a_batch_until_its_lease_runs_out(store: BatchStore) -> None:
    await store.create_batch(*_batch("batch_a", 3))
    assert await store.claim("r1", 10.0, now=1000.0) == ["batch_a"]
    assert await store.claim("r2", 10.0, now=1005.0) == []  # r1's lease holds
    assert await store.claim("r1", 10.0, now=1005.0) == ["batch_a"]  # renewed to 1015
    assert await store.claim("r2", 10.0, now=1016.0) == ["batch_a"]  # r1 died: taken over
    await store.release("r2")
    assert await store.claim("r1", 10.0, now=1017.0) == ["batch_a"]


async def test_a_line_is_answered_once_and_the_batch_ends_once(store: BatchStore) -> None:
    await store.create_batch(*_batch("batch_b", 3))
    lines = await store.lines_to_publish("batch_b", 1000.0, 10, republish=False)
    assert [ln.line_no for ln in lines] == [1, 2, 3]
    await store.mark_published("batch_b", lines)
    assert await store.lines_to_publish("batch_b", 1000.0, 10, republish=False) == []
    again = await store.lines_to_publish("batch_b", 1000.0, 10, republish=True, after_line=1)
    assert [ln.line_no for ln in again] == [2, 3]
    assert await store.answer("batch_b", 2, 0, "done", '{"n":2}', 1001.0)
    assert not await store.answer("batch_b", 2, 0, "done", '{"n":"again"}', 1002.0)
    assert not await store.answer("batch_b", 1, 5, "done", "{}", 1002.0)  # another attempt's
    assert await store.retry_later("batch_b", 1, 0, at=2000.0)
    assert not await store.answer("batch_b", 1, 0, "done", "{}", 1003.0)  # the old attempt
    assert await store.lines_to_publish("batch_b", 1500.0, 10, republish=False) == []
    (retry,) = await store.lines_to_publish("batch_b", 2000.0, 10, republish=False)
    assert (retry.line_no, retry.attempt) == (1, 1)
    assert await store.answer("batch_b", 1, 1, "done", '{"n":1}', 1004.0)
    assert await store.answer("batch_b", 3, 0, "failed", '{"e":3}', 1005.0)
    counts = await store.counts("batch_b")
    assert (counts.total, counts.completed, counts.failed, counts.open) == (3, 2, 1, 0)
    assert await store.finalize("batch_b", "completed", "completed_at", 1006.0)
    assert not await store.finalize("batch_b", "completed", "completed_at", 1007.0)
    batch = await store.get_batch("batch_b")
    assert batch is not None and batch["status"] == "completed"
    out = await store.get_file(batch["output_file_id"])
    err = await store.get_file(batch["error_file_id"])
    assert out is not None and err is not None
    # in the order answered
    assert await store.file_content(out) == b'{"n":2}\n{"n":1}\n'
    assert out["bytes"] == len(b'{"n":2}\n{"n":1}\n') and out["lines"] == 2
    assert json.loads(await store.file_content(err)) == {"e": 3}


async def test_custom_ids_are_unique_within_a_batch(store: BatchStore) -> None:
    row, lines = _batch("batch_c", 2)
    lines[1]["custom_id"] = "c1"
    with pytest.raises(sa.exc.IntegrityError):
        await store.create_batch(row, lines)
    assert await store.get_batch("batch_c") is None  # all or nothing
    await store.create_batch(*_batch("batch_d", 2))  # the same custom_ids in another batch


async def test_file_bodies_in_the_database_and_in_a_directory(
    store: BatchStore, tmp_path: Path
) -> None:
    row = {
        "file_id": "file-1",
        "tenant": "t",
        "purpose": "batch",
        "filename": "in.jsonl",
        "bytes": 3,
        "lines": 1,
        "created_at": 1.0,
        "kind": "upload",
        "batch_id": None,
    }
    await store.create_file(row, b"{}\n")
    assert await store.file_content(row) == b"{}\n"
    await store.delete_file("file-1")
    assert await store.get_file("file-1") is None
    with pytest.raises(FileNotFound):
        await store.bodies.get("file-1")
    bodies = DirectoryBodies(tmp_path / "files")
    await bodies.put("file-2", b"abc")
    assert await bodies.get("file-2") == b"abc"
    await bodies.delete("file-2")
    with pytest.raises(FileNotFound):
        await bodies.get("file-2")


class _FakeClient:
    """What the runner publishes and cancels, without a broker."""

    def __init__(self) -> None:
        self.published: list[str] = []
        self.cancelled: list[str] = []

    async def publish_request(self, request: Any) -> None:
        self.published.append(request.request_id)

    async def cancel(self, request_id: str, reason: str, *, tenant: str | None = None) -> None:
        self.cancelled.append(request_id)


def _request_json() -> str:
    return RequestMessage(
        request_id="batch-0-0-0", model="m", prompt="p", max_tokens=1, slo={"e2e_ms": 1000}
    ).model_dump_json()


async def test_runner_releases_paced_then_expires_what_is_unanswered(store: BatchStore) -> None:
    now = time.time()
    row, lines = _batch("batch_e", 4, now=now - 10)
    for line in lines:
        line["request"] = _request_json()
    await store.create_batch(row, lines)
    client = _FakeClient()
    runner = BatchRunner(store, cast(Any, client), pace=0.75, max_in_flight=2)
    await runner.tick()
    # the in-flight window: 2 of 4 (10 s into a 1 h window, the pace asks for 1)
    assert client.published == ["batch-e-1-0", "batch-e-2-0"]
    assert await store.answer("batch_e", 1, 0, "done", '{"n":1}', now)
    await runner.tick()
    assert client.published[2:] == ["batch-e-3-0"]  # one answered: one more
    # the window passes with lines 2 and 3 on the queue and line 4 never sent
    await store.update_batch("batch_e", {"expires_at": now - 1})
    await runner.tick()
    assert sorted(client.cancelled) == ["batch-e-2-0", "batch-e-3-0"]
    batch = await store.get_batch("batch_e")
    assert batch is not None and batch["status"] == "expired" and batch["expired_at"]
    errors = await store.file_content(cast(dict, await store.get_file(batch["error_file_id"])))
    expired = [json.loads(x) for x in errors.splitlines()]
    assert sorted(e["custom_id"] for e in expired) == ["c2", "c3", "c4"]
    assert {e["error"]["code"] for e in expired} == {"batch_expired"}
    # a reply that comes after the expiry changes nothing
    assert not await store.answer("batch_e", 2, 0, "done", "{}", now)


async def test_runner_cancels_a_batch(store: BatchStore) -> None:
    now = time.time()
    row, lines = _batch("batch_f", 3, now=now)
    for line in lines:
        line["request"] = _request_json()
    await store.create_batch(row, lines)
    client = _FakeClient()
    runner = BatchRunner(store, cast(Any, client), pace=0.75, max_in_flight=1)
    await runner.tick()
    assert client.published == ["batch-f-1-0"]
    await store.update_batch("batch_f", {"status": "cancelling", "cancelling_at": now})
    await runner.tick()
    assert client.cancelled == ["batch-f-1-0"]
    assert (await store.get_batch("batch_f") or {})["status"] == "cancelling"  # line 1 open
    assert await store.close_one("batch_f", 1, 0, "cancelled", now)  # its `cancelled` reply
    await runner.tick()
    batch = await store.get_batch("batch_f")
    assert batch is not None and batch["status"] == "cancelled"
    assert batch["output_file_id"] is None and batch["error_file_id"] is None
    assert (await store.counts("batch_f")).open == 0
