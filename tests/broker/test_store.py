"""The write-behind Store against a real SQLite file and a real PostgreSQL.

Every test that takes ``store`` runs on both databases; the PostgreSQL variant gets a freshly
created database (see ``fresh_postgres_database``), so tests are independent.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlm.store import RequestEvent, RequestStatus, Store
from tests.broker.test_migrations import fresh_postgres_database

S = RequestStatus
T0 = 1_700_000_000.0


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path}/state/qlm.db"
        return
    async with fresh_postgres_database(request.getfixturevalue("postgres_url")) as url:
        yield url


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[Store]:
    s = await Store.open(db_url)
    try:
        yield s
    finally:
        await s.close()


def receive(store: Store, request_id: str, at: float = T0, **overrides: Any) -> None:
    fields: dict[str, Any] = {
        "request_id": request_id,
        "model": "mistral-7b",
        "slo_class": "interactive",
        "tenant": "t1",
        "priority": 3,
        "prompt_tokens": 120,
        "max_tokens": 64,
        "submitted_at": at - 0.01,
        "queued_at": at,
        "deadline": at + 10.0,
        "ttft_deadline": at + 1.0,
    }
    store.record_received(**(fields | overrides))


async def count_rows(store: Store, table: sa.Table | Any) -> int:
    async with store.engine.connect() as conn:
        return int((await conn.execute(sa.select(sa.func.count()).select_from(table))).scalar_one())


async def test_request_life_is_recorded_in_order(store: Store) -> None:
    receive(store, "req-1")
    store.record_status("req-1", S.QUEUED, T0 + 0.1, instance_id="i1")
    store.record_status("req-1", S.DISPATCHED, T0 + 0.2, instance_id="i1", attempts=1)
    store.record_status("req-1", S.REQUEUED, T0 + 0.3, detail={"reason": "instance_lost"})
    store.record_status("req-1", S.DISPATCHED, T0 + 0.4, instance_id="i2", attempts=2)
    store.record_finished(
        "req-1",
        S.COMPLETED,
        T0 + 1.5,
        instance_id="i2",
        attempts=2,
        started_at=T0 + 0.45,
        first_token_at=T0 + 0.6,
        finished_at=T0 + 1.5,
        output_tokens=64,
        slo_met=True,
    )
    await store.flush()

    got = await store.get_request("req-1")
    assert got is not None
    history = got.pop("history")
    assert [h["status"] for h in history] == [
        "received",
        "queued",
        "dispatched",
        "requeued",
        "dispatched",
        "completed",
    ]
    assert [h["at"] for h in history] == [T0, T0 + 0.1, T0 + 0.2, T0 + 0.3, T0 + 0.4, T0 + 1.5]
    assert [h["instance_id"] for h in history] == [None, "i1", "i1", None, "i2", "i2"]
    assert history[3]["detail"] == {"reason": "instance_lost"}
    assert got["status"] == "completed"
    assert got["model"] == "mistral-7b" and got["tenant"] == "t1" and got["priority"] == 3
    assert got["deadline"] == T0 + 10.0 and got["ttft_deadline"] == T0 + 1.0
    assert got["instance_id"] == "i2" and got["attempts"] == 2
    assert got["first_token_at"] == T0 + 0.6 and got["output_tokens"] == 64
    assert got["slo_met"] is True and got["error_code"] is None
    assert got["updated_at"] == T0 + 1.5


async def test_status_updates_across_batches_keep_earlier_columns(store: Store) -> None:
    receive(store, "req-2")
    await store.flush()
    store.record_status("req-2", S.DISPATCHED, T0 + 1, instance_id="i9", attempts=1)
    await store.flush()
    store.record_status("req-2", S.REQUEUED, T0 + 2)  # no instance/attempts: keep the old ones
    await store.flush()
    got = await store.get_request("req-2")
    assert got is not None
    assert (got["status"], got["instance_id"], got["attempts"]) == ("requeued", "i9", 1)
    assert got["model"] == "mistral-7b" and got["prompt_tokens"] == 120
    assert [h["status"] for h in got["history"]] == ["received", "dispatched", "requeued"]


async def test_failed_request_keeps_its_error_code(store: Store) -> None:
    receive(store, "req-3")
    store.record_finished(
        "req-3",
        S.FAILED,
        T0 + 2,
        instance_id="i1",
        attempts=3,
        started_at=T0 + 1,
        first_token_at=None,
        finished_at=T0 + 2,
        output_tokens=None,
        slo_met=False,
        error_code="engine_error",
    )
    await store.flush()
    got = await store.get_request("req-3")
    assert got is not None
    assert (got["status"], got["error_code"], got["slo_met"]) == ("failed", "engine_error", False)
    assert got["history"][-1]["detail"] == {"error_code": "engine_error"}


async def test_unknown_request_is_none(store: Store) -> None:
    receive(store, "known")
    await store.flush()
    assert await store.get_request("unknown") is None
    assert await store.get_request("known") is not None


async def test_record_rejected_without_a_usable_id(store: Store) -> None:
    no_id = store.record_rejected(None, "invalid_json", T0, detail={"bytes": 17})
    bad_id = store.record_rejected("has spaces and ünïcode", "schema_violation", T0 + 1)
    good_id = store.record_rejected("ok-id-1", "unknown_model", T0 + 2)
    await store.flush()

    assert no_id.startswith("invalid:") and bad_id.startswith("invalid:") and no_id != bad_id
    assert good_id == "ok-id-1"
    got = await store.get_request(no_id)
    assert got is not None
    assert (got["status"], got["error_code"], got["model"]) == ("rejected", "invalid_json", None)
    assert got["history"] == [
        {
            "status": "rejected",
            "at": T0,
            "instance_id": None,
            "detail": {"error_code": "invalid_json", "bytes": 17},
        }
    ]
    bad = await store.get_request(bad_id)
    assert bad is not None
    assert bad["history"][0]["detail"]["raw_request_id"] == repr("has spaces and ünïcode")
    good = await store.get_request("ok-id-1")
    assert good is not None and good["error_code"] == "unknown_model"
    counts = await store.count_by_status()
    assert counts["rejected"] == 3


async def test_instances_are_upserted(store: Store) -> None:
    common: dict[str, Any] = {
        "agent_id": "agent-a",
        "engine": "sim",
        "gpu_type": "A100-80GB",
        "gpu_memory_gb": 80.0,
        "kv_capacity_tokens": 200_000,
        "max_batch_size": 256,
    }
    store.upsert_instance(instance_id="a-0", models=["m1"], status="alive", at=T0, **common)
    await store.flush()
    # Two updates in one batch, plus a second instance: coalesced, first registration kept.
    store.upsert_instance(
        instance_id="a-0", models=["m1", "m2"], status="alive", at=T0 + 1, **common
    )
    store.upsert_instance(instance_id="a-1", models=["m2"], status="alive", at=T0 + 1.5, **common)
    store.upsert_instance(instance_id="a-0", models=["m2"], status="draining", at=T0 + 2, **common)
    store.upsert_instance(instance_id="a-1", models=["m2"], status="lost", at=T0 + 3, **common)
    await store.flush()

    instances = await store.list_instances()
    assert [i["instance_id"] for i in instances] == ["a-0", "a-1"]
    a0, a1 = instances
    assert (a0["status"], a0["models"], a0["registered_at"], a0["last_seen"]) == (
        "draining",
        ["m2"],
        T0,
        T0 + 2,
    )
    assert (a1["status"], a1["registered_at"], a1["last_seen"]) == ("lost", T0 + 1.5, T0 + 3)
    assert a0["kv_capacity_tokens"] == 200_000 and a0["gpu_type"] == "A100-80GB"

    with pytest.raises(ValueError, match="instance status"):
        store.upsert_instance(instance_id="a-2", models=[], status="zombie", at=T0, **common)


async def test_latest_plan(store: Store) -> None:
    assert await store.latest_plan() is None
    for i, created in enumerate([T0 + 5, T0 + 9, T0 + 7]):
        store.record_plan(
            plan_id=f"p{i}",
            policy="edf",
            created_at=created,
            duration_s=0.01 * i,
            n_requests=10 * i,
            n_instances=2,
            summary={"order": {"i1": [f"r{i}"]}, "i": i},
        )
    await store.flush()
    plan = await store.latest_plan()
    assert plan is not None
    assert (plan["plan_id"], plan["created_at"], plan["n_requests"]) == ("p1", T0 + 9, 10)
    assert plan["summary"] == {"order": {"i1": ["r1"]}, "i": 1}


async def test_engine_profiles(store: Store) -> None:
    assert await store.get_profile("H100", "llama-8b") is None
    await store.save_profile("H100", "llama-8b", "table", {"tpot_ms": 6.2})
    await store.save_profile("H100", "llama-8b", "measured", {"tpot_ms": 7.0})
    await store.save_profile("H100", "llama-8b", "table", {"tpot_ms": 6.5})  # replaces
    await store.save_profile("A100", "llama-8b", "table", {"tpot_ms": 9.0})

    table = await store.get_profile("H100", "llama-8b", source="table")
    assert table is not None and table["params"] == {"tpot_ms": 6.5}
    latest = await store.get_profile("H100", "llama-8b")
    assert latest is not None and latest["source"] == "table"  # saved last
    measured = await store.get_profile("H100", "llama-8b", source="measured")
    assert measured is not None and measured["params"] == {"tpot_ms": 7.0}
    a100 = await store.get_profile("A100", "llama-8b")
    assert a100 is not None and a100["params"] == {"tpot_ms": 9.0}
    assert await count_rows(store, sa.table("engine_profiles")) == 3


async def test_count_by_status(store: Store) -> None:
    finals = [
        S.COMPLETED,
        S.COMPLETED,
        S.FAILED,
        S.QUEUED,
        S.DISPATCHED,
        S.DEAD_LETTERED,
        S.RECEIVED,
    ]
    for i, final in enumerate(finals):
        receive(store, f"c{i}")
        if final is not S.RECEIVED:
            store.record_status(f"c{i}", final, T0 + 1)
    await store.flush()
    counts = await store.count_by_status()
    assert set(counts) == {s.value for s in S}
    for status in S:
        assert counts[status.value] == finals.count(status)


async def test_write_behind_batches_10k_events(store: Store, db_url: str) -> None:
    n_requests, per_request = 2_000, 5  # 10,000 history events
    lifecycle = [S.QUEUED, S.DISPATCHED, S.COMPLETED]
    record_s = 0.0
    start = time.perf_counter()
    for chunk in range(0, n_requests, 100):
        t = time.perf_counter()
        for i in range(chunk, chunk + 100):
            rid = f"bulk-{i}"
            receive(store, rid, at=T0 + i)
            for k, status in enumerate(lifecycle):
                store.record_status(rid, status, T0 + i + k + 1, instance_id=f"i{i % 4}")
            store.record_finished(
                rid,
                S.COMPLETED,
                T0 + i + 9,
                instance_id=f"i{i % 4}",
                attempts=1,
                started_at=T0 + i + 2,
                first_token_at=T0 + i + 3,
                finished_at=T0 + i + 9,
                output_tokens=i,
                slo_met=i % 2 == 0,
            )
        record_s += time.perf_counter() - t
        await asyncio.sleep(0)  # the coordinator yields between deliveries; so does this loop
    await store.flush()
    total_s = time.perf_counter() - start

    events = n_requests * per_request
    stats = store.stats
    backend = db_url.split(":", 1)[0]
    print(
        f"\n[{backend}] {events} events: {events / total_s:,.0f} events/s committed "
        f"({total_s:.2f} s), record calls {record_s / events * 1e6:.1f} us/event, "
        f"{stats.batches} transactions"
    )
    assert await count_rows(store, RequestEvent.__table__) == events
    assert stats.buffered == 0 and stats.committed == stats.recorded
    # Batched: far fewer transactions than events (each holds ~1000 entries or 50 ms of them).
    assert stats.batches <= events // 50
    counts = await store.count_by_status()
    assert counts["completed"] == n_requests
    sample = await store.get_request("bulk-1234")
    assert sample is not None
    assert [h["status"] for h in sample["history"]] == [
        "received",
        "queued",
        "dispatched",
        "completed",
        "completed",
    ]
    assert (sample["output_tokens"], sample["slo_met"], sample["instance_id"]) == (1234, True, "i2")


async def test_buffer_is_bounded_and_counts_drops(db_url: str) -> None:
    store = await Store.open(db_url, max_buffered=10)
    try:
        for i in range(8):  # 2 entries each (row + event): 16 offered, 10 fit
            store.record_status(f"b{i}", S.QUEUED, T0 + i)
        assert store.stats.dropped_full == 6 and store.stats.buffered == 10
        await store.flush()
        assert await count_rows(store, RequestEvent.__table__) == 5
        store.record_status("b9", S.QUEUED, T0 + 9)  # room again after the flush
        await store.flush()
        assert await count_rows(store, RequestEvent.__table__) == 6
    finally:
        await store.close()


async def test_an_unstorable_entry_is_isolated_not_retried_forever(store: Store) -> None:
    receive(store, "good-1")
    receive(store, "bad-1")
    store.record_status("bad-1", S.QUEUED, T0 + 1, detail={"not_json": object()})
    store.record_status("good-1", S.QUEUED, T0 + 1)
    async with asyncio.timeout(10):
        await store.flush()
    assert store.stats.dropped_invalid == 1
    good = await store.get_request("good-1")
    bad = await store.get_request("bad-1")
    assert good is not None and [h["status"] for h in good["history"]] == ["received", "queued"]
    # The row update of the refused entry's call went through; only its event was dropped.
    assert bad is not None and bad["status"] == "queued"
    assert [h["status"] for h in bad["history"]] == ["received"]


async def test_flush_survives_a_locked_database(tmp_path: Path) -> None:
    """SQLite held locked by another writer: the store keeps the batch, retries, loses nothing."""
    path = tmp_path / "locked.db"
    store = await Store.open(
        f"sqlite+aiosqlite:///{path}", engine_kwargs={"connect_args": {"timeout": 0.05}}
    )
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        receive(store, "locked-1")
        store.record_status("locked-1", S.QUEUED, T0 + 1)
        await asyncio.sleep(0.5)
        assert store.stats.failures >= 1
        assert store.stats.committed == 0 and store.stats.buffered == 4
        store.record_status("locked-1", S.DISPATCHED, T0 + 2, instance_id="i1", attempts=1)
        blocker.execute("ROLLBACK")
        async with asyncio.timeout(10):
            await store.flush()
        got = await store.get_request("locked-1")
        assert got is not None
        assert [h["status"] for h in got["history"]] == ["received", "queued", "dispatched"]
    finally:
        blocker.close()
        await store.close()


async def test_records_after_close_are_refused(db_url: str) -> None:
    store = await Store.open(db_url)
    receive(store, "last")
    await store.close()  # flushes
    with pytest.raises(RuntimeError):
        store.record_status("last", S.QUEUED, T0 + 1)
    reopened = await Store.open(db_url, migrate=False)
    try:
        got = await reopened.get_request("last")
        assert got is not None and got["status"] == "received"
    finally:
        await reopened.close()


_statuses = st.sampled_from(list(S))


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
async def test_any_interleaving_keeps_each_history_in_recorded_order(
    store: Store, data: st.DataObject
) -> None:
    per_request = data.draw(st.lists(st.lists(_statuses, min_size=1, max_size=8), max_size=5))
    slots = [i for i, statuses in enumerate(per_request) for _ in statuses]
    order = data.draw(st.permutations(slots))
    prefix = f"h{time.monotonic_ns()}-"  # one store serves every example: fresh ids each time
    cursors = [0] * len(per_request)
    for i in order:
        status = per_request[i][cursors[i]]
        cursors[i] += 1
        # Timestamps drawn at random: the history must follow recording order, not clock order.
        at = T0 + data.draw(st.floats(0, 100, allow_nan=False))
        store.record_status(f"{prefix}{i}", status, at, detail={"n": cursors[i]})
        if data.draw(st.integers(0, 4)) == 0:
            await asyncio.sleep(0)  # sometimes let the flusher split the sequence across batches
    await store.flush()
    for i, statuses in enumerate(per_request):
        got = await store.get_request(f"{prefix}{i}")
        assert got is not None
        assert [h["status"] for h in got["history"]] == [s.value for s in statuses]
        assert [h["detail"]["n"] for h in got["history"]] == list(range(1, len(statuses) + 1))
        assert got["status"] == statuses[-1].value


@pytest.mark.postgres
async def test_survives_postgres_killing_its_connections(postgres_url: str) -> None:
    """The server terminates every session of the store's database: nothing recorded is lost."""
    async with fresh_postgres_database(postgres_url) as url:
        store = await Store.open(url)
        try:
            receive(store, "kill-1")
            await store.flush()
            database = sa.engine.make_url(url).database
            async with store.engine.connect() as conn:  # a second pooled connection to kill too
                admin_url = sa.engine.make_url(postgres_url)
                admin = await asyncpg.connect(
                    admin_url.set(drivername="postgresql").render_as_string(hide_password=False)
                )
                try:
                    killed = await admin.fetchval(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = $1 AND pid <> pg_backend_pid()",
                        database,
                    )
                finally:
                    await admin.close()
                assert killed >= 1
                with pytest.raises(sa.exc.DBAPIError):
                    await conn.execute(sa.text("SELECT 1"))
            store.record_status("kill-1", S.QUEUED, T0 + 1)
            store.record_status("kill-1", S.DISPATCHED, T0 + 2, instance_id="i1", attempts=1)
            async with asyncio.timeout(10):
                await store.flush()
            got = await store.get_request("kill-1")
            assert got is not None
            assert [h["status"] for h in got["history"]] == ["received", "queued", "dispatched"]
        finally:
            await store.close()


async def test_close_gives_up_after_drain_s_while_the_database_is_locked(tmp_path: Path) -> None:
    path = tmp_path / "stuck.db"
    store = await Store.open(
        f"sqlite+aiosqlite:///{path}", engine_kwargs={"connect_args": {"timeout": 0.05}}
    )
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        receive(store, "stuck-1")
        waiter = asyncio.create_task(store.flush())
        t = time.perf_counter()
        await store.close(drain_s=0.3)
        assert 0.3 <= time.perf_counter() - t < 5
        assert store.stats.committed == 0 and store.stats.buffered == 2
        with pytest.raises(RuntimeError, match="closed"):
            await waiter  # a pending flush() learns that its entries were not written
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
