"""The agent's result and goodbye publishes are tried again with backoff: each retry is counted
and logged, the count reaches the agent's ``/metrics``, a result is never given up, a goodbye
is given up after ``goodbye_within_s``, and a cancellation is never retried.

The broker publish is replaced by a scripted one: no broker can be made to fail exactly twice
and then recover on cue (tests/broker/test_chaos.py covers real broker failures)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiormq
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

import qlm.agents.agent as agent_module
from qlm.agents.agent import Agent
from qlm.agents.health import AgentMetrics
from qlm.agents.sim import SimEngine
from qlm.control import Completion, Dispatch, ReplyRoute
from tests.builders import make_completion, make_request

MODEL = "mistral-7b"


class ScriptedPublish:
    """Stands in for ``Agent._publish``: raises the given errors in turn, then succeeds (or,
    with ``forever``, raises the last one on every call)."""

    def __init__(self, *errors: BaseException, forever: bool = False) -> None:
        self.errors = list(errors)
        self.forever = forever
        self.calls: list[float] = []  # monotonic time of each call
        self.third_call = asyncio.Event()

    async def __call__(self, body: str, *, persistent: bool = False, live: bool = False) -> None:
        assert persistent and not live  # results and goodbyes go to the durable queue
        self.calls.append(time.monotonic())
        if len(self.calls) == 3:
            self.third_call.set()
        if self.forever:
            raise self.errors[-1]
        if self.errors:
            raise self.errors.pop(0)


@pytest.fixture
def logs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    with structlog.testing.capture_logs() as captured:
        # a fresh logger: the module's one may be cached from an earlier configure_logging()
        monkeypatch.setattr(agent_module, "log", structlog.get_logger("qlm.agents.agent"))
        yield captured


def _agent(publish: ScriptedPublish) -> Agent:
    agent = Agent("amqp://unused/", [SimEngine("A100-80GB", [MODEL])], agent_id="rt")
    agent._publish = publish  # type: ignore[method-assign]
    return agent


def _completion(rid: str = "r1") -> Completion:
    return make_completion(
        agent_id="rt",
        instance_id="rt-gpu0",
        request_id=rid,
        output_text="ab",
        prompt_tokens=3,
        started_at=1.0,
        first_token_at=1.1,
        finished_at=1.2,
    )


def _events(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event]


async def test_a_report_that_fails_twice_is_retried_with_backoff_and_counted(
    logs: list[dict[str, Any]],
) -> None:
    publish = ScriptedPublish(ConnectionError("broker away"), aiormq.exceptions.DeliveryError)
    agent = _agent(publish)
    await agent._report(_completion())
    assert len(publish.calls) == 3
    gaps = [b - a for a, b in zip(publish.calls, publish.calls[1:], strict=False)]
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2  # 0.1 s, then doubled
    assert agent.report_retries == 2
    assert agent.completed == 1 and agent.reports["completion"] == 1
    retries = _events(logs, "report_retry")
    assert [e["request_id"] for e in retries] == ["r1", "r1"]
    assert "broker away" in retries[0]["error"] and "DeliveryError" in retries[1]["error"]
    text = AgentMetrics(agent).render()[0].decode()
    exported = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert exported["qlm_agent_report_retries_total"] == 2.0


async def test_a_cancelled_report_is_not_retried(logs: list[dict[str, Any]]) -> None:
    publish = ScriptedPublish(asyncio.CancelledError())
    agent = _agent(publish)
    with pytest.raises(asyncio.CancelledError):
        await agent._report(_completion())
    assert len(publish.calls) == 1
    assert agent.report_retries == 0 and agent.completed == 0
    assert not _events(logs, "report_retry")


async def test_cancelling_a_report_between_tries_stops_it_at_once(
    logs: list[dict[str, Any]],
) -> None:
    publish = ScriptedPublish(ConnectionError("down"), forever=True)
    agent = _agent(publish)
    task = asyncio.create_task(agent._report(_completion()))
    await publish.third_call.wait()  # the third try fails: the 0.4 s wait comes next
    task.cancel()
    t0 = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - t0 < 0.1
    assert len(publish.calls) == 3 and agent.completed == 0


async def test_a_reconnect_goodbye_is_retried_then_announced(
    logs: list[dict[str, Any]],
) -> None:
    publish = ScriptedPublish(ConnectionError("channel closed"))
    agent = _agent(publish)
    agent.reconnects = 1
    await agent._announce_new_session()
    assert len(publish.calls) == 2
    assert len(_events(logs, "reconnect_goodbye_retry")) == 1
    assert _events(logs, "agent_reconnected")[0]["reconnects"] == 1
    assert not _events(logs, "reconnect_goodbye_failed")


async def test_a_reconnect_stops_the_token_streams_of_the_work_it_had(
    logs: list[dict[str, Any]],
) -> None:
    # the goodbye moves every attempt the agent was running, each resumed elsewhere after
    # what was streamed: chunks of the old attempts would contradict the new ones
    publish = ScriptedPublish()
    agent = _agent(publish)
    now = time.time()
    agent.token_streams.open(
        Dispatch(
            dispatch_id="d1",
            instance_id="rt-gpu0",
            attempt=1,
            request=make_request(request_id="s1", stream=True),
            submitted_at=now,
            queued_at=now,
            dispatched_at=now,
            reply_routes=[ReplyRoute(reply_to="gw", correlation_id="c1")],
        )
    )
    assert agent.token_streams.streaming("s1")
    agent._on_reconnected()
    assert not agent.token_streams.streaming("s1") and agent.token_streams.fenced == 1
    assert _events(logs, "token_streams_fenced")[0]["reason"] == "reconnected"
    await asyncio.gather(*agent._side_tasks)
    assert len(publish.calls) == 1  # and the goodbye went out


async def test_a_reconnect_goodbye_is_given_up_after_its_deadline(
    logs: list[dict[str, Any]],
) -> None:
    publish = ScriptedPublish(ConnectionError("still down"), forever=True)
    agent = _agent(publish)
    agent.goodbye_within_s = 0.25
    t0 = time.monotonic()
    await agent._announce_new_session()
    # tries at 0, 0.1, 0.3 s: the third failure is past the deadline
    assert len(publish.calls) == 3 and time.monotonic() - t0 < 1.0
    assert len(_events(logs, "reconnect_goodbye_retry")) == 2
    [failed] = _events(logs, "reconnect_goodbye_failed")
    assert "still down" in failed["error"]
    assert not _events(logs, "agent_reconnected")
