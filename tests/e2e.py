"""Shared helpers for end-to-end tests: a real coordinator and real agent processes on a
private vhost of the real broker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from qlm.store import Store
from qlm.tooling.demo import LocalCluster


@contextlib.asynccontextmanager
async def running_cluster(
    amqp_url: str, tmp_path: Path, agents: list[dict[str, Any]], **kw: Any
) -> AsyncIterator[LocalCluster]:
    extra_env = {"QLM_HEARTBEAT_TIMEOUT_S": "2.0", "QLM_LOG_LEVEL": "info"}
    extra_env.update(kw.pop("extra_env", None) or {})
    cluster = LocalCluster(amqp_url, agents=agents, workdir=tmp_path, extra_env=extra_env, **kw)
    try:
        await cluster.start(timeout=60)
        yield cluster
    except BaseException:
        print("---- coordinator log (tail) ----\n", cluster.logs("coordinator")[-4000:])
        raise
    finally:
        cluster.stop()


async def store_counts(database_url: str) -> dict[str, int]:
    store = await Store.open(database_url)
    try:
        return await store.count_by_status()
    finally:
        await store.close()


async def store_record(database_url: str, request_id: str) -> dict[str, Any]:
    store = await Store.open(database_url)
    try:
        record = await store.get_request(request_id)
    finally:
        await store.close()
    assert record is not None, request_id
    return record


async def gather_replies(futures: list[asyncio.Future[Any]], timeout: float) -> list[Any]:
    return list(await asyncio.wait_for(asyncio.gather(*futures), timeout=timeout))
