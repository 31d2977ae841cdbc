"""Shared helpers for end-to-end tests: a real coordinator and real agent processes on a
private vhost of the real broker."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import httpx

from qlm.store import Store
from qlm.tooling import localbroker
from qlm.tooling.demo import LocalCluster
from qlm.topology import INGRESS_EXCHANGE


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


@contextlib.contextmanager
def producer_users(amqp_url: str, *names: str) -> Iterator[dict[str, str]]:
    """A broker user per name (a random suffix added), each allowed exactly what a producer
    needs: publish to qlm.ingress, declare and read its own reply queues (the threat model's
    permissions). Yields name -> AMQP URL as that user; the users are deleted afterwards."""
    parts = urlsplit(amqp_url)
    vhost = quote(unquote(parts.path[1:]), safe="")
    api, admin = localbroker.management_url(amqp_url), ("guest", "guest")
    urls: dict[str, str] = {}
    try:
        with httpx.Client(base_url=api, auth=admin) as http:
            for name in names:
                user, password = f"{name}-{secrets.token_hex(3)}", secrets.token_hex(8)
                http.put(
                    f"api/users/{user}", json={"password": password, "tags": ""}
                ).raise_for_status()
                urls[name] = parts._replace(
                    netloc=f"{user}:{password}@{parts.hostname}:{parts.port}"
                ).geturl()
                own = rf"^qlm\.reply\.{user}\."
                http.put(
                    f"api/permissions/{vhost}/{user}",
                    json={"configure": own, "write": rf"^{INGRESS_EXCHANGE}$", "read": own},
                ).raise_for_status()
        yield urls
    finally:
        with httpx.Client(base_url=api, auth=admin) as http:
            for url in urls.values():
                http.delete(f"api/users/{unquote(urlsplit(url).username or '')}")


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
