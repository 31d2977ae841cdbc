"""A queued request outlives more connection losses than the delivery limit allows returns.

RabbitMQ 3.x counts every return of an unacked delivery toward a quorum queue's delivery limit,
a lost consumer connection as much as a handler failure; the coordinator holds each request
unacked until it is answered. It refreshes a worn delivery (a fresh copy, then an ack of the
worn one: qlm/coordinator/refresh.py), so healthy work is not dead-lettered as poison, and it
is still answered once."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import aio_pika
import httpx
import pytest

from qlm.agents.agent import Agent
from qlm.agents.sim import SimEngine
from qlm.client import QlmClient
from qlm.coordinator.identity import IdentityMode, ProducerIdentity
from qlm.coordinator.service import Coordinator
from qlm.planner import create_policy
from qlm.store import Store
from qlm.tooling.localbroker import management_url
from qlm.topology import DEAD_LETTER_QUEUE
from qlm.types import SLO, RequestMessage, ResultMessage
from tests.e2e import producer_users

pytestmark = pytest.mark.broker

LIMIT = 2  # the quorum queue dead-letters at the third return
CUTS = 4  # connection losses, each a return of every queued request: one past the limit


def _req(i: int) -> RequestMessage:
    return RequestMessage(
        request_id=f"survivor-{i}",
        model="mistral-7b",
        prompt_token_ids=list(range(16)),
        max_tokens=8,
        slo=SLO(e2e_ms=300_000),
    )


async def _cut_coordinator(amqp_url: str) -> int:
    """Close the coordinator's broker connection from the broker's side (management API), as
    a network cut does; returns how many were closed."""
    vhost = unquote(urlsplit(amqp_url).path[1:]) or "/"
    async with httpx.AsyncClient(
        base_url=management_url(amqp_url), auth=("guest", "guest"), timeout=30
    ) as http:
        for _ in range(100):  # the management API lists a new connection with a delay
            conns = (await http.get("api/connections")).json()
            mine = [
                c["name"]
                for c in conns
                if c.get("vhost") == vhost
                and c.get("client_properties", {}).get("connection_name") == "qlm-coordinator"
            ]
            if mine:
                break
            await asyncio.sleep(0.1)
        for name in mine:
            (await http.delete(f"api/connections/{quote(name, safe='')}")).raise_for_status()
        return len(mine)


@pytest.fixture
def producer_url(isolated_amqp_url: str) -> Iterator[str]:
    """A broker user allowed what a producer needs, as a URL; deleted afterwards."""
    with producer_users(isolated_amqp_url, "alice") as urls:
        yield urls["alice"]


@pytest.mark.parametrize("mode", ["body", "broker"])
async def test_a_request_outlives_more_connection_losses_than_the_delivery_limit(
    mode: IdentityMode, isolated_amqp_url: str, producer_url: str, tmp_path: Path
) -> None:
    """In ``broker`` identity mode the tenant is the producer's broker user: a refreshed copy,
    published under the coordinator's user, still speaks for that producer."""
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    coord = Coordinator(
        amqp_url=isolated_amqp_url,
        policy=create_policy("edf"),
        store=store,
        shards=1,
        delivery_limit=LIMIT,
        identity=ProducerIdentity(mode),
    )
    client_url = producer_url if mode == "broker" else isolated_amqp_url
    await coord.start()
    agent: Agent | None = None
    stopped = False
    ids = [_req(i).request_id for i in range(3)]
    try:
        async with QlmClient(client_url) as client:
            futures = [await client.submit(_req(i)) for i in range(3)]
            for _ in range(200):  # no agent yet: they wait, tracked and unacked
                if all(rid in coord.core.requests for rid in ids):
                    break
                await asyncio.sleep(0.05)
            for _cut in range(CUTS):
                handles = {rid: coord.core.requests[rid].delivery for rid in ids}
                assert await _cut_coordinator(isolated_amqp_url) >= 1
                for _ in range(600):  # back: every request held by a new delivery
                    if all(
                        rid in coord.core.requests
                        and coord.core.requests[rid].delivery is not handles[rid]
                        for rid in ids
                    ):
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the requests were not delivered again")
                await asyncio.sleep(0.5)  # room for a refresh in flight to land
            async with await aio_pika.connect(isolated_amqp_url) as conn:
                ch = await conn.channel()
                dead = await ch.declare_queue(DEAD_LETTER_QUEUE, passive=True)
                assert dead.declaration_result.message_count == 0
            metrics = coord.metrics.render()[0].decode()
            refreshed = re.search(r"^qlm_deliveries_refreshed_total (\S+)$", metrics, re.M)
            assert refreshed is not None
            # at most once per request per cut: a copy is not itself returned (two acks of one
            # delivery tag would close the channel and return every copy on it)
            assert len(ids) <= float(refreshed.group(1)) <= CUTS * len(ids)
            # an agent comes: each request is answered, once
            engine = SimEngine("A100-80GB", ["mistral-7b"], time_scale=20.0, seed=1)
            agent = Agent(isolated_amqp_url, [engine], agent_id="rf", heartbeat_interval_s=0.2)
            await agent.start()
            replies = await asyncio.wait_for(asyncio.gather(*futures), 60)
            assert all(isinstance(r, ResultMessage) for r in replies), replies
            await asyncio.sleep(2)  # room for a second answer to show up
            assert client.outstanding() == 0
            assert client.duplicate_count() == 0, client.duplicates
            assert not client.unexpected
        if mode == "broker":  # every copy kept its producer's tenant
            await coord.store.flush()
            user = unquote(urlsplit(producer_url).username or "")
            for rid in ids:
                row = await coord.store.get_request(rid)
                assert row is not None and row["tenant"] == user, row
        # nothing is left behind: no copy in the queue, none dead-lettered, and none held
        # unacked (stopping the coordinator would return it to the queue)
        await agent.stop()
        agent = None
        await coord.stop()
        stopped = True
        async with await aio_pika.connect(isolated_amqp_url) as conn:
            ch = await conn.channel()
            for name in ("qlm.global.0", DEAD_LETTER_QUEUE):
                q = await ch.declare_queue(name, passive=True)
                assert q.declaration_result.message_count == 0, name
    finally:
        if agent is not None:
            await agent.stop()
        if not stopped:
            await coord.stop()
        await store.close()
