"""Collective requests (Tempo): stage deadlines from graph matching, cycles refused, programs
that never finish forgotten - and, over the real broker, a program served end to end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from qlm.client import QlmClient
from qlm.collective import (
    PROGRAM_GRACE_S,
    CollectiveTracker,
    GraphError,
    StageGraph,
    StageGraphLibrary,
)
from qlm.coordinator.core import CoordinatorCore
from qlm.planner import create_policy
from qlm.types import SLO, ErrorCode, ErrorMessage, RequestMessage, ResultMessage, StageInfo
from tests.builders import heartbeat
from tests.e2e import running_cluster


def call(
    rid: str,
    stage: str,
    after: tuple[str, ...] = (),
    *,
    program: str = "p1",
    slo_ms: int = 60_000,
    last: bool = False,
    prompt_words: int = 50,
    e2e_ms: int | None = None,
    started: float | None = 1000.0,
) -> RequestMessage:
    return RequestMessage(
        request_id=rid,
        model="mistral-7b",
        prompt="word " * prompt_words,
        max_tokens=16,
        slo=SLO(e2e_ms=e2e_ms or slo_ms),  # a call's own SLO is required; the program's here
        stage=StageInfo(
            program_id=program,
            app_type="tot",
            stage_id=stage,
            after=list(after),
            program_slo_ms=slo_ms,
            program_started_at=started,
            last_stage=last,
        ),
    )


def test_matching_picks_the_most_similar_longer_history_and_budgets_by_its_ratios() -> None:
    lib = StageGraphLibrary()
    # two finished 3-stage programs: small first stage with a long last one, and the opposite
    lib.add(StageGraph("tot", (50, 50, 50), (100, 100, 100), (1.0, 1.0, 8.0)))
    lib.add(StageGraph("tot", (5000, 50, 50), (8000, 100, 100), (8.0, 1.0, 1.0)))
    lib.add(StageGraph("rag", (50,), (100,), (1.0,)))  # other application: never matched
    graph, sim = lib.match("tot", [60.0], [110.0]) or (None, 0.0)
    assert graph is not None and graph.durations == (1.0, 1.0, 8.0) and 0.5 < sim <= 1.0
    assert lib.match("tot", [1.0] * 3, [1.0] * 3) is None  # no history with more stages
    assert lib.match("chat", [], []) is None

    tracker = CollectiveTracker(lib)
    first = tracker.admit(call("a1", "s1", prompt_words=400), 1000.0, 1000.0)
    # no stage done yet: the latest longer history, whose first stage takes 8 of 10 s
    assert first.matched and first.deadline == pytest.approx(1000.0 + 60.0 * 0.8)
    assert first.program_deadline == 1060.0
    tracker.finished(call("a1", "s1"), 5000, 1010.0)  # a big first stage, like the 2nd history
    second = tracker.admit(call("a2", "s2", ("s1",), prompt_words=6000), 1010.0, 1010.0)
    # matched to (8, 1, 1): stage 2 gets 1 of the 2 s left in ratio → half of the 50 s left
    assert second.matched and second.deadline == pytest.approx(1010.0 + 50.0 * 0.5)
    # a second call of the same stage shares its deadline
    again = tracker.admit(call("a3", "s2", ("s1",)), 1012.0, 1012.0)
    assert again.deadline == second.deadline


def test_without_history_a_stage_gets_the_programs_remaining_time_and_history_is_learnt() -> None:
    tracker = CollectiveTracker()
    s1 = tracker.admit(call("b1", "s1"), 1000.0, 1000.0)
    assert not s1.matched and s1.deadline == 1060.0
    assert tracker.finished(call("b1", "s1"), 40, 1004.0) is None  # not the last stage
    tracker.admit(call("b2", "s2", ("s1",), last=True), 1004.0, 1004.0)
    assert tracker.finished(call("b2", "s2", last=True), 20, 1010.0) is True  # met: ≤ 1060
    [graph] = tracker.library.graphs("tot")
    assert graph.nodes == (40, 20) and graph.durations == (4.0, 6.0)
    assert "p1" not in tracker.programs and tracker.finished_programs == 1
    # the next program of the same application is budgeted from it
    nxt = tracker.admit(call("c1", "s1", program="p2"), 1000.0, 1000.0)
    assert nxt.matched and nxt.deadline == pytest.approx(1000.0 + 60.0 * 0.4)


def test_cycles_and_redeclared_stages_are_refused() -> None:
    tracker = CollectiveTracker()
    with pytest.raises(GraphError, match="after itself"):
        tracker.check(call("x", "s1", ("s1",)))
    tracker.admit(call("y1", "a", ("c",)), 1000.0, 1000.0)  # after a stage not seen yet: fine
    tracker.admit(call("y2", "b", ("a",)), 1000.0, 1000.0)
    with pytest.raises(GraphError, match="cycle"):
        tracker.check(call("y3", "c", ("b",)))  # c → a → b → c
    with pytest.raises(GraphError, match="declared"):
        tracker.check(call("y4", "b", ("c",)))
    tracker.check(call("y5", "b", ("a",)))  # the same stage again, same parents: fine
    with pytest.raises(ValueError, match="not both"):
        RequestMessage.model_validate(
            {
                **call("z", "s1").model_dump(exclude_none=True),
                "task": {"task_id": "t", "task_slo_ms": 1000},
            }
        )


def test_a_program_whose_last_stage_never_comes_is_forgotten_after_its_deadline() -> None:
    tracker = CollectiveTracker()
    tracker.admit(call("e1", "s1"), 1000.0, 1000.0)
    tracker.finished(call("e1", "s1"), 10, 1001.0)
    assert tracker.expire(1060.0 + PROGRAM_GRACE_S - 1) == []
    assert tracker.expire(1060.0 + PROGRAM_GRACE_S + 1) == ["p1"]
    assert tracker.library.graphs("tot") == []  # nothing learnt from it
    assert tracker.finished(call("e1", "s1"), 10, 2000.0) is None  # a late answer: ignored


def test_the_coordinator_gives_stage_calls_their_shared_deadline() -> None:
    core = CoordinatorCore(create_policy("edf"))
    core.on_heartbeat(heartbeat("a", 1), now=0.0)
    own_earlier = call("f2", "s1", e2e_ms=5_000)
    t1, _ = core.admit(
        call("f1", "s1"), object(), reply_to="r", correlation_id="f1", received_at=1000.0
    )
    t2, _ = core.admit(own_earlier, object(), reply_to="r", correlation_id="f2", received_at=1000.0)
    assert t1 is not None and t2 is not None
    assert t1.plan_view.deadline == 1060.0 and t1.chain is not None
    assert t1.chain.task_deadline == 1060.0
    assert t2.plan_view.deadline == 1005.0  # its own SLO is earlier than the stage's


@pytest.mark.broker
@pytest.mark.slow
async def test_a_collective_program_end_to_end(isolated_amqp_url: str, tmp_path: Path) -> None:
    agents = [{"agent_id": "co", "models": ["mistral-7b"], "time_scale": 50.0}]
    async with running_cluster(isolated_amqp_url, tmp_path, agents) as cluster:
        async with QlmClient(isolated_amqp_url) as client:
            stage1 = [
                await client.submit(call(f"g1-{k}", "s1", program="g", started=None))
                for k in range(3)
            ]
            first = await asyncio.wait_for(asyncio.gather(*stage1), timeout=30)
            stage2 = [
                await client.submit(
                    call(f"g2-{k}", "s2", ("s1",), program="g", last=True, started=None)
                )
                for k in range(2)
            ]
            bad = await client.submit(call("g-bad", "s9", ("s9",), program="g", started=None))
            second = await asyncio.wait_for(asyncio.gather(*stage2, bad), timeout=30)
        assert cluster.coordinator is not None and cluster.coordinator.poll() is None
    assert all(isinstance(r, ResultMessage) and r.slo.task_met is None for r in first)
    results = [r for r in second if isinstance(r, ResultMessage)]
    assert len(results) == 2
    # the call that ended the program reports whether the whole program met its deadline
    assert [r.slo.task_met for r in results].count(True) == 1
    [err] = [r for r in second if isinstance(r, ErrorMessage)]
    assert err.code == ErrorCode.INVALID_GRAPH and "after itself" in err.message
