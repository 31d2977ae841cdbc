"""Producers cannot interfere with each other (docs/reliability.md, "Threat model").

Over the real broker with real broker users: the tenant comes from the broker-verified
``user_id`` (QLM_PRODUCER_IDENTITY=broker); replies go only where their producer may read;
cancels are honoured only from the request's tenant; a flood of copies of one request id is
acked and counted, never held; the client takes a reply only for the request it names.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import aio_pika
import pytest

from qlm.agents.agent import Agent
from qlm.agents.sim import SimEngine
from qlm.client import QlmClient
from qlm.coordinator import refresh
from qlm.coordinator.identity import IdentityMode, ProducerIdentity
from qlm.coordinator.service import Coordinator
from qlm.planner import create_policy
from qlm.store import Store
from qlm.topology import DEAD_LETTER_QUEUE, INGRESS_EXCHANGE, REASON_HEADER
from qlm.types import (
    CONTENT_TYPE,
    REPLY_ID_HEADER,
    SLO,
    ErrorCode,
    ErrorMessage,
    RequestMessage,
    ResultMessage,
)
from tests.builders import next_messages
from tests.e2e import producer_users

pytestmark = pytest.mark.broker

UNSERVED = "vicuna-13b"  # a model in the catalog that no agent of these tests serves


def _req(rid: str, *, model: str = "mistral-7b", tenant: str | None = None) -> RequestMessage:
    return RequestMessage(
        request_id=rid,
        model=model,
        prompt_token_ids=[1, 2, 3],
        max_tokens=4,
        slo=SLO(e2e_ms=60_000),
        tenant=tenant,
    )


@pytest.fixture
def tenants(isolated_amqp_url: str) -> Iterator[dict[str, str]]:
    """Broker users alice and bob, each allowed exactly what a producer needs."""
    with producer_users(isolated_amqp_url, "alice", "bob") as urls:
        yield urls


@pytest.fixture
async def coordinator(
    isolated_amqp_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Coordinator]:
    mode: IdentityMode = getattr(request, "param", "broker")
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    coord = Coordinator(
        amqp_url=isolated_amqp_url,
        policy=create_policy("edf"),
        store=store,
        shards=1,
        prefetch_per_shard=50,
        identity=ProducerIdentity(mode),
    )
    await coord.start()
    engine = SimEngine("A100-80GB", ["mistral-7b"], time_scale=100.0, seed=2)
    agent = Agent(isolated_amqp_url, [engine], agent_id="id", heartbeat_interval_s=0.2)
    await agent.start()
    try:
        yield coord
    finally:
        await agent.stop()
        await coord.stop()
        await store.close()


async def _wait(cond: Callable[[], bool], timeout: float = 15.0) -> None:  # noqa: ASYNC109
    async with asyncio.timeout(timeout):
        while not cond():  # noqa: ASYNC110 - polling state another task changes
            await asyncio.sleep(0.05)


async def _dead_letters(url: str, n: int) -> dict[str, str]:
    """message id -> reason of the next ``n`` dead letters."""
    out = {}
    async with await aio_pika.connect(url) as conn:
        ch = await conn.channel()
        dead = await ch.get_queue(DEAD_LETTER_QUEUE, ensure=False)
        for msg in await next_messages(dead, n):
            out[str(msg.message_id)] = str((msg.headers or {}).get(REASON_HEADER))
            await msg.ack()
    return out


async def test_the_tenant_is_the_broker_user_and_cannot_be_claimed(
    coordinator: Coordinator, tenants: dict[str, str], isolated_amqp_url: str
) -> None:
    alice = unquote(urlsplit(tenants["alice"]).username or "")
    async with QlmClient(tenants["alice"]) as client:
        assert client.reply_queue_name.startswith(f"qlm.reply.{alice}.")
        reply = await client.request(_req("a-1"), timeout=30)
        assert isinstance(reply, ResultMessage)
        await coordinator.store.flush()
        row = await coordinator.store.get_request("a-1")
        assert row is not None and row["tenant"] == alice
        # claiming another tenant in the body is refused
        claim = await client.request(_req("a-2", tenant="bob"), timeout=30)
        assert isinstance(claim, ErrorMessage) and claim.code == ErrorCode.TENANT_MISMATCH
    # a producer without user_id (the guest user here publishes without it) is refused
    async with await aio_pika.connect(isolated_amqp_url) as conn:
        ch = await conn.channel(publisher_confirms=True)
        ingress = await ch.get_exchange(INGRESS_EXCHANGE, ensure=False)
        await ingress.publish(
            aio_pika.Message(
                _req("anon").model_dump_json().encode(),
                content_type=CONTENT_TYPE,
                message_id="anon",
            ),
            routing_key="anon",
        )
    letters = await _dead_letters(isolated_amqp_url, 2)
    assert letters["a-2"] == ErrorCode.TENANT_MISMATCH.value
    assert letters["anon"] == ErrorCode.IDENTITY_REQUIRED.value


async def test_a_producer_cannot_pass_for_the_coordinators_refreshed_copy(
    coordinator: Coordinator, tenants: dict[str, str]
) -> None:
    """A refreshed copy (qlm/coordinator/refresh.py) names its producer in a header; only the
    coordinator's own broker user is believed to have written it. Alice writing it to speak
    for bob still speaks for alice."""
    alice = unquote(urlsplit(tenants["alice"]).username or "")
    bob = unquote(urlsplit(tenants["bob"]).username or "")
    async with await aio_pika.connect(tenants["alice"]) as conn:
        ch = await conn.channel(publisher_confirms=True)
        ingress = await ch.get_exchange(INGRESS_EXCHANGE, ensure=False)
        await ingress.publish(
            aio_pika.Message(
                _req("as-bob").model_dump_json().encode(),
                content_type=CONTENT_TYPE,
                message_id="as-bob",
                user_id=alice,
                headers={refresh.REFRESHES_HEADER: 1, refresh.USER_HEADER: bob},
            ),
            routing_key="as-bob",
        )
    await _wait(lambda: "as-bob" in coordinator.core.answered, timeout=30)
    await coordinator.store.flush()
    row = await coordinator.store.get_request("as-bob")
    assert row is not None and row["tenant"] == alice


async def test_replies_never_go_to_another_tenant_s_queue(
    coordinator: Coordinator, tenants: dict[str, str], isolated_amqp_url: str
) -> None:
    bob = unquote(urlsplit(tenants["bob"]).username or "")
    victim_queue = f"qlm.reply.{bob}.inbox"
    async with await aio_pika.connect(tenants["bob"]) as conn:
        ch = await conn.channel()
        inbox = await ch.declare_queue(victim_queue, durable=True)
    # alice aims her request's reply at bob's queue
    async with await aio_pika.connect(tenants["alice"]) as conn:
        alice = unquote(urlsplit(tenants["alice"]).username or "")
        ch = await conn.channel(publisher_confirms=True)
        ingress = await ch.get_exchange(INGRESS_EXCHANGE, ensure=False)
        await ingress.publish(
            aio_pika.Message(
                _req("forged").model_dump_json().encode(),
                content_type=CONTENT_TYPE,
                message_id="forged",
                correlation_id="bob-1",
                reply_to=victim_queue,
                user_id=alice,
            ),
            routing_key="forged",
        )
    letters = await _dead_letters(isolated_amqp_url, 1)
    assert letters == {"forged": ErrorCode.INVALID_REPLY_TO.value}
    async with await aio_pika.connect(tenants["bob"]) as conn:
        ch = await conn.channel()
        inbox = await ch.declare_queue(victim_queue, durable=True, passive=True)
        assert await inbox.get(fail=False) is None  # nothing reached bob


@pytest.mark.parametrize("coordinator", ["body"], indirect=True)
async def test_replies_never_go_to_qlm_s_own_queues(
    coordinator: Coordinator, isolated_amqp_url: str
) -> None:
    async with await aio_pika.connect(isolated_amqp_url) as conn:
        ch = await conn.channel(publisher_confirms=True)
        ingress = await ch.get_exchange(INGRESS_EXCHANGE, ensure=False)
        for i, target in enumerate(["qlm.global.0", "qlm.control.coordinator", DEAD_LETTER_QUEUE]):
            await ingress.publish(
                aio_pika.Message(
                    _req(f"own-{i}").model_dump_json().encode(),
                    content_type=CONTENT_TYPE,
                    message_id=f"own-{i}",
                    reply_to=target,
                ),
                routing_key=f"own-{i}",
            )
    letters = await _dead_letters(isolated_amqp_url, 3)
    assert set(letters.values()) == {ErrorCode.INVALID_REPLY_TO.value}
    await asyncio.sleep(0.5)
    assert not coordinator.core.requests  # nothing was queued, nothing bounced back in


async def test_a_cancel_from_another_tenant_is_ignored(
    coordinator: Coordinator, tenants: dict[str, str]
) -> None:
    async with QlmClient(tenants["alice"]) as alice, QlmClient(tenants["bob"]) as bob:
        fut = await alice.submit(_req("keep", model=UNSERVED))
        await _wait(lambda: "keep" in coordinator.core.requests)
        await bob.cancel("keep", "not mine")  # bob's broker identity is not alice's
        await _wait(lambda: "cancels_refused_total 1.0" in coordinator.metrics.render()[0].decode())
        assert "keep" in coordinator.core.requests and not fut.done()
        # bob cancelling before alice publishes does not cancel her request either
        await bob.cancel("later")
        later = await alice.submit(_req("later", model=UNSERVED))
        await _wait(lambda: "later" in coordinator.core.requests)
        await alice.cancel("keep")
        reply = await asyncio.wait_for(fut, 15)
        assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.CANCELLED
        assert not later.done()


@pytest.mark.parametrize("coordinator", ["body"], indirect=True)
async def test_a_flood_of_one_id_is_acked_and_counted_and_the_shard_keeps_delivering(
    coordinator: Coordinator, isolated_amqp_url: str
) -> None:
    copies = 3000  # 60x the shard's prefetch (50)
    async with await aio_pika.connect(isolated_amqp_url) as conn:
        ch = await conn.channel(publisher_confirms=True)
        ingress = await ch.get_exchange(INGRESS_EXCHANGE, ensure=False)
        body = _req("flood", model=UNSERVED).model_dump_json().encode()
        for start in range(0, copies, 500):
            await asyncio.gather(
                *(
                    ingress.publish(
                        aio_pika.Message(body, content_type=CONTENT_TYPE, message_id="flood"),
                        routing_key="flood",
                    )
                    for _ in range(start, min(copies, start + 500))
                )
            )
    async with QlmClient(isolated_amqp_url) as client:
        served = await client.request(_req("after-flood"), timeout=30)
        assert isinstance(served, ResultMessage)  # the shard kept delivering
        fut = await client.submit(_req("cancel-me", model=UNSERVED))
        await _wait(lambda: "cancel-me" in coordinator.core.requests)
        await client.cancel("cancel-me")
        cancelled = await asyncio.wait_for(fut, 15)
        assert isinstance(cancelled, ErrorMessage) and cancelled.code == ErrorCode.CANCELLED
    await _wait(lambda: coordinator.core.requests["flood"].duplicate_copies == copies - 1)
    metrics = coordinator.metrics.render()[0].decode()
    assert f"qlm_duplicate_requests_total {float(copies - 1)}" in metrics
    assert len(coordinator.core.requests) == 1  # only the first copy is tracked


async def test_the_client_takes_a_reply_only_for_the_request_it_names(
    isolated_amqp_url: str,
) -> None:
    async with QlmClient(isolated_amqp_url) as client:
        await client.ensure_topology(shards=1)
        fut = await client.submit(_req("mine", model=UNSERVED))
        forged = ResultMessage.model_validate(
            {
                "request_id": "theirs",
                "model": "mistral-7b",
                "output_text": "attacker's text",
                "output_token_ids": [1],
                "finish_reason": "stop",
                "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                "timestamps": {"submitted": 0, "queued": 0, "started": 0, "finished": 1},
                "slo": {"met": True},
                "instance_id": "x",
                "attempts": 1,
            }
        )
        async with await aio_pika.connect(isolated_amqp_url) as conn:
            ch = await conn.channel(publisher_confirms=True)
            await ch.default_exchange.publish(
                aio_pika.Message(
                    forged.model_dump_json().encode(),
                    correlation_id="mine",  # the victim's correlation id, guessed
                    headers={REPLY_ID_HEADER: "forged"},
                ),
                routing_key=client.reply_queue_name,
            )
        await _wait(lambda: len(client.unexpected) == 1)
        assert not fut.done()


@pytest.mark.parametrize("coordinator", ["body"], indirect=True)
async def test_direct_reply_to_addresses_are_used_and_a_bare_or_bogus_one_breaks_nothing(
    coordinator: Coordinator, isolated_amqp_url: str
) -> None:
    async with await aio_pika.connect(isolated_amqp_url) as conn:
        # a real direct reply-to consumer: the reply comes back on this very channel
        ch = await conn.channel(publisher_confirms=True)
        got: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        direct = await ch.get_queue("amq.rabbitmq.reply-to", ensure=False)
        await direct.consume(got.put, no_ack=True)
        ingress = await ch.get_exchange(INGRESS_EXCHANGE, ensure=False)
        for rid, reply_to in (
            ("bare", "amq.rabbitmq.reply-to"),  # subscribing name, not an address: refused
            ("bogus", "amq.rabbitmq.reply-to.not-a-real-address"),  # answered into nothing
            ("direct", "amq.rabbitmq.reply-to"),  # the broker fills in our real address
        ):
            await ingress.publish(
                aio_pika.Message(
                    _req(rid).model_dump_json().encode(),
                    content_type=CONTENT_TYPE,
                    message_id=rid,
                    correlation_id=rid,
                    reply_to=reply_to if rid != "bare" else "amq.rabbitmq.reply-to",
                ),
                routing_key=rid,
            )
        reply = await asyncio.wait_for(got.get(), 30)
    # "bare" was published on a channel consuming direct reply-to, so the broker rewrote it
    # into a real address too; both it and "direct" come back here, "bogus" goes nowhere
    assert reply.correlation_id in ("bare", "direct")
    async with QlmClient(isolated_amqp_url) as client:  # the coordinator still answers
        assert isinstance(await client.request(_req("after"), timeout=30), ResultMessage)


def test_a_bare_direct_reply_to_name_is_not_a_reply_address() -> None:
    body, broker = ProducerIdentity("body"), ProducerIdentity("broker")
    for mode in (body, broker):
        assert mode.reply_route("amq.rabbitmq.reply-to", "t") is None
        assert mode.reply_route("amq.rabbitmq.reply-to.", "t") is None
        assert (
            mode.reply_route("amq.rabbitmq.reply-to.g1h2AA", "t") == "amq.rabbitmq.reply-to.g1h2AA"
        )
    assert body.reply_route("qlm.reply.any.x", None) == "qlm.reply.any.x"
    assert body.reply_route("qlm.global.0", None) is None
    assert body.reply_route("my-own-queue", None) == "my-own-queue"
    assert broker.reply_route("qlm.reply.t.x", "t") == "qlm.reply.t.x"
    assert broker.reply_route("qlm.reply.u.x", "t") is None
    assert broker.reply_route("my-own-queue", "t") is None
