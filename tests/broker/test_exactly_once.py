"""Exactly once across a coordinator restart with no standby: the durable answer record.

The lone coordinator dies at each point of the answer sequence (record → publish with a
confirm → ack the request → ack the result's control message); a new coordinator on the same
store and broker takes over. Every request is answered, none twice: a reply that may have got
through is sent again only under its recorded reply id, which the client drops as a copy.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import create_async_engine

from qlm.agents.agent import Agent
from qlm.agents.sim import SimEngine
from qlm.client import QlmClient
from qlm.coordinator.service import Coordinator
from qlm.planner import create_policy
from qlm.store import AnswerLogUnavailable, Store, StoredAnswer, answers
from qlm.types import SLO, RequestMessage, ResultMessage


def _answer(rid: str, reply_id: str, tenant: str | None = None) -> StoredAnswer:
    return StoredAnswer(rid, reply_id, tenant, "result", f'{{"id":"{rid}"}}', 1.0)


# ---------------------------------------------------------------- the record itself
async def test_a_sqlite_file_commits_answers_on_its_own_engine_that_the_store_reads(
    tmp_path: Path,
) -> None:
    # one thread hop per transaction (qlm/store/answers.py); what it commits is the same file
    url = f"sqlite+aiosqlite:///{tmp_path}/qlm.db"
    store = await Store.open(url)
    try:
        assert isinstance(store.answers._engine, Engine)
        await store.answers.record(_answer("on-file", "a"))
        async with store.engine.connect() as conn:
            rows = await conn.execute(sa.text("SELECT reply_id FROM answers"))
            assert [r[0] for r in rows] == ["a"]
    finally:
        await store.close()
    again = await Store.open(url)
    try:
        assert (await again.answers.record(_answer("on-file", "b"))).reply_id == "a"
    finally:
        await again.close()
    # an in-memory database is not shared by a second engine: the log keeps the store's
    memory = await Store.open("sqlite+aiosqlite:///:memory:", migrate=False)
    try:
        assert memory.answers._engine is memory.engine
    finally:
        await memory.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_the_first_answer_recorded_wins_and_is_found_again(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (
        f"sqlite+aiosqlite:///{tmp_path}/qlm.db"
        if backend == "sqlite"
        else request.getfixturevalue("isolated_postgres_url")
    )
    store = await Store.open(url)
    try:
        log = store.answers
        first = await log.record(_answer("r1", "a"))
        assert first.reply_id == "a"
        # a second answer for the same request (it ran twice) gets the first one back
        assert (await log.record(_answer("r1", "b"))).reply_id == "a"
        # concurrent records share transactions; one per id wins, the others see it
        got = await asyncio.gather(
            *(log.record(_answer(f"c{i % 50}", f"x{i}")) for i in range(500))
        )
        winners = {a.request_id: a.reply_id for a in got}
        assert len(winners) == 50
        assert all(a.reply_id == winners[a.request_id] for a in got)
        assert log.commits < 500 // 2  # group commit: far fewer transactions than records
        found = await asyncio.gather(log.lookup("r1"), log.lookup("c7"), log.lookup("nope"))
        assert found[0] == first and found[1] is not None and found[2] is None
        assert (await log.recent_ids(10))[-1] in winners
        assert await log.prune(older_than=2.0) == 51
        assert await log.lookup("r1") is None
    finally:
        await store.close()


async def test_a_store_that_cannot_record_refuses_instead_of_answering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    monkeypatch.setattr(answers, "RETRY_DELAYS_S", (0.01, 0.01))
    # a database that refuses every connection (nothing listens on port 1)
    dead = create_async_engine("postgresql+asyncpg://qlm:qlm@127.0.0.1:1/qlm")
    monkeypatch.setattr(store.answers, "_engine", dead)
    try:
        with pytest.raises(AnswerLogUnavailable):
            await store.answers.record(_answer("r", "a"))
        with pytest.raises(AnswerLogUnavailable):
            await store.answers.lookup("r")
    finally:
        await dead.dispose()
        await store.close()


async def test_a_database_that_comes_back_is_tried_again_and_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    monkeypatch.setattr(answers, "RETRY_DELAYS_S", (0.01, 0.01))
    real = store.answers._engine
    dead = create_async_engine("postgresql+asyncpg://qlm:qlm@127.0.0.1:1/qlm")
    monkeypatch.setattr(store.answers, "_engine", dead)
    retries: list[dict[str, Any]] = []

    class ComesBackOnRetry:
        """The module's logger, whose retry line brings the database back before the wait."""

        def warning(self, event: str, **fields: Any) -> None:
            assert event == "answer_log_retry"
            retries.append(fields)
            store.answers._engine = real

    monkeypatch.setattr(answers, "log", ComesBackOnRetry())
    try:
        recorded = await store.answers.record(_answer("back", "a"))
        assert recorded.reply_id == "a"
        assert [r["attempt"] for r in retries] == [1]
        assert "ConnectionRefusedError" in retries[0]["error"]
        assert retries[0]["records"] == 1 and store.answers.commits == 1
        assert (await store.answers.lookup("back")) == recorded
    finally:
        await dead.dispose()
        await store.close()


# ---------------------------------------------------------------- killed mid-answer
def _req(i: int) -> RequestMessage:
    return RequestMessage(
        request_id=f"eo-{i}",
        model="mistral-7b",
        prompt_token_ids=list(range(32)),
        max_tokens=16,
        slo=SLO(e2e_ms=120_000),
    )


async def _die(coord: Coordinator) -> None:
    """What a SIGKILL leaves: connections gone (the broker requeues every unacked delivery),
    nothing flushed, nothing acked, no goodbye."""
    coord._stopping = True
    if coord._liveness is not None:
        coord._liveness.cancel()
    me = asyncio.current_task()
    for task in list(coord._tasks):  # every other piece of work in flight dies with it
        if task is not me:
            task.cancel()
    for conn in (coord._events_conn, coord._conn):
        if conn is not None:
            await conn.close()


def _kill_at(coord: Coordinator, point: str, nth: int) -> asyncio.Event:
    """Make ``coord`` die at ``point`` of its ``nth`` answer; returns an event set then."""
    died = asyncio.Event()
    calls = 0

    def hit() -> bool:
        nonlocal calls
        calls += 1
        return calls == nth

    async def die() -> None:
        died.set()
        await _die(coord)
        raise asyncio.CancelledError  # this coroutine ends here, as the process would

    def wrap(real: Callable[..., Awaitable[Any]], *, after: bool) -> Callable[..., Any]:
        async def hooked(*args: Any, **kwargs: Any) -> Any:
            if died.is_set():
                raise asyncio.CancelledError
            if not after and hit():
                await die()
            result = await real(*args, **kwargs)
            if after and hit():
                await die()
            return result

        return hooked

    if point == "before_record":
        coord.store.answers.record = wrap(coord.store.answers.record, after=False)  # type: ignore[method-assign]
    elif point == "after_record":
        coord.store.answers.record = wrap(coord.store.answers.record, after=True)  # type: ignore[method-assign]
    elif point == "after_confirm":  # the reply is out; the request is not acked
        coord._ack_delivery = wrap(coord._ack_delivery, after=False)  # type: ignore[method-assign]
    elif point == "after_ack":  # the request is acked; the result's control message is not
        coord._ack_delivery = wrap(coord._ack_delivery, after=True)  # type: ignore[method-assign]
    else:
        raise ValueError(point)
    return died


@pytest.mark.broker
@pytest.mark.parametrize("point", ["before_record", "after_record", "after_confirm", "after_ack"])
async def test_a_lone_coordinator_killed_mid_answer_loses_and_doubles_nothing(
    point: str, isolated_amqp_url: str, tmp_path: Path
) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path}/qlm.db"
    n = 24

    async def coordinator(store: Store) -> Coordinator:
        coord = Coordinator(
            amqp_url=isolated_amqp_url,
            policy=create_policy("edf"),
            store=store,
            shards=1,
            heartbeat_timeout_s=2.0,
        )
        await coord.start()
        return coord

    store_a = await Store.open(db)
    first = await coordinator(store_a)
    died = _kill_at(first, point, nth=6)
    engine = SimEngine("A100-80GB", ["mistral-7b"], time_scale=20.0, seed=3)
    agent = Agent(isolated_amqp_url, [engine], agent_id="eo", heartbeat_interval_s=0.2)
    second: Coordinator | None = None
    store_b: Store | None = None
    try:
        async with QlmClient(isolated_amqp_url) as client:
            futures = [await client.submit(_req(i)) for i in range(n)]
            await agent.start()
            await asyncio.wait_for(died.wait(), 60)
            store_b = await Store.open(db)
            second = await coordinator(store_b)  # the restart, on the same store
            replies = await asyncio.wait_for(asyncio.gather(*futures), 90)
            assert all(isinstance(r, ResultMessage) for r in replies)
            await asyncio.sleep(3)  # room for a second answer to show up
            assert client.outstanding() == 0
            assert client.duplicate_count() == 0, client.duplicates
            assert not client.unexpected
            # the record was used: the redelivered request was answered from it, not rerun
            metrics = second.metrics.render()[0].decode()
            if point in ("after_record", "after_confirm"):
                again = re.search(
                    r'qlm_answered_again_total\{reason="redelivered"\} (\S+)', metrics
                )
                assert again is not None and float(again.group(1)) >= 1
    finally:
        await agent.stop()
        if second is not None:
            await second.stop()
        await store_a.answers.close()
        await store_a.engine.dispose()
        if store_b is not None:
            await store_b.close()


@pytest.mark.broker
async def test_a_dispatch_lost_on_this_side_is_retried_and_the_instance_kept(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    """The coordinator's own publish of a dispatch fails (its channel broke, as after a
    broker node dies): the agent is not to blame, so its instance stays alive and the
    request is dispatched again."""
    import aio_pika

    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    coord = Coordinator(
        amqp_url=isolated_amqp_url, policy=create_policy("edf"), store=store, shards=1
    )
    real = coord._to_agent
    failed = 0

    async def flaky(agent_id: str, body: str) -> None:
        nonlocal failed
        if '"request"' in body and failed < 3:  # the first three dispatches
            failed += 1
            raise aio_pika.exceptions.ChannelInvalidStateError("channel closed")
        await real(agent_id, body)

    coord._to_agent = flaky  # type: ignore[method-assign]
    await coord.start()
    engine = SimEngine("A100-80GB", ["mistral-7b"], time_scale=20.0, seed=3)
    agent = Agent(isolated_amqp_url, [engine], agent_id="dl", heartbeat_interval_s=0.2)
    await agent.start()
    try:
        async with QlmClient(isolated_amqp_url) as client:
            futures = [await client.submit(_req(i)) for i in range(5)]
            replies = await asyncio.wait_for(asyncio.gather(*futures), 60)
            assert all(isinstance(r, ResultMessage) for r in replies)
            assert client.duplicate_count() == 0
        assert failed == 3
        assert all(i.status == "alive" for i in coord.core.instances.values())
        metrics = coord.metrics.render()[0].decode()
        assert 'qlm_requeued_total{reason="dispatch_failed"} 3.0' in metrics
    finally:
        await agent.stop()
        await coord.stop()
        await store.close()
