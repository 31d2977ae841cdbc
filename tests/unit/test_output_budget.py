"""SABER's maxTokens reading (qlm.admission.OutputBudget): a task's profiled mean output, not
the client's cap, and what the agent's gate takes from it."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from qlm import cli
from qlm.admission import LEARN_MIN, LEARN_WINDOW, OutputBudget, required_speed
from qlm.agents.agent import Agent
from qlm.agents.engine import EngineRequest
from qlm.agents.sim import SimEngine
from qlm.control import Dispatch
from qlm.types import SLO, RequestMessage, SamplingParams
from tests.builders import wait_until

MODEL = "mistral-7b"


def test_a_class_with_a_mean_needs_its_mean_and_others_their_cap() -> None:
    budget = OutputBudget({"qna": 23.6, "generation": 208.0})
    assert budget.tokens_left(128, 0, "qna") == 24  # the mean, rounded up, below the cap
    assert budget.tokens_left(16, 0, "qna") == 16  # never more than the cap leaves
    assert budget.tokens_left(1000, 50, "generation") == 158  # its mean less what it generated
    assert budget.tokens_left(1000, 300, "generation") == 1  # past its mean: one more token
    assert budget.tokens_left(1000, 0, "summary") == 1000  # no mean: the cap
    assert budget.tokens_left(1000, 0, None) == 1000
    assert OutputBudget().tokens_left(64, 10, "qna") == 64


@given(
    expected=st.floats(min_value=0.5, max_value=1e5),
    cap_left=st.integers(min_value=1, max_value=10**5),
    generated=st.integers(min_value=0, max_value=10**5),
)
def test_what_is_left_is_between_one_token_and_the_cap(
    expected: float, cap_left: int, generated: int
) -> None:
    left = OutputBudget({"c": expected}).tokens_left(cap_left, generated, "c")
    assert 1 <= left <= cap_left


def test_the_cli_form_parses_and_bad_items_are_named() -> None:
    assert OutputBudget.parse("qna=24, generation=208.5,").expected == {
        "qna": 24.0,
        "generation": 208.5,
    }
    for text, message in [
        ("qna", "expected CLASS=TOKENS"),
        ("=5", "expected CLASS=TOKENS"),
        ("qna=many", "not a number"),
        ("qna=0", "finite and > 0"),
        ("qna=inf", "finite and > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            OutputBudget.parse(text)


def test_the_agent_gate_takes_a_request_at_its_class_mean() -> None:
    engine = SimEngine("A100-80GB", [MODEL], time_scale=1000.0, seed=1)
    agent = Agent(
        "amqp://unused/", [engine], agent_id="b", output_budget=OutputBudget({"chat": 50.0})
    )
    need = agent.instances["b-gpu0"].admission.need
    now = time.time()

    def request(slo_class: str | None, resumed: int = 0) -> EngineRequest:
        return EngineRequest(
            request_id="r",
            model=MODEL,
            prompt_token_ids=[1, 2],
            prompt_tokens=2,
            prompt_text=None,
            max_tokens=1000,
            resume_token_ids=list(range(resumed)),
            deadline=now + 10,
            slo_class=slo_class,
        )

    assert need(request("chat"), now) == pytest.approx(required_speed(50, now + 10, now))
    assert need(request("chat", resumed=20), now) == pytest.approx(3.0)  # 30 tokens left / 10 s
    assert need(request("batch"), now) == pytest.approx(100.0)  # its cap: 1,000 / 10 s
    plain = Agent("amqp://unused/", [engine], agent_id="p").instances["p-gpu0"].admission.need
    assert plain(request("chat"), now) == pytest.approx(100.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--saber-expected-tokens", "qna=24"], "needs --admission saber"),
        (
            ["--admission", "saber", "--usl", "100,0.1,0", "--saber-expected-tokens", "qna"],
            "expected CLASS=TOKENS",
        ),
    ],
)
def test_the_agent_cli_names_a_bad_budget(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli.app, ["agent", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_a_learning_budget_takes_each_class_mean_over_its_recent_completions() -> None:
    budget = OutputBudget.parse("auto, qna=24")
    assert budget.learn and budget.expected == {"qna": 24.0}
    for _ in range(LEARN_MIN - 1):
        budget.observe("qna", 100)
        budget.observe("chat", 10)
    assert budget.expected == {"qna": 24.0}  # the given mean holds until LEARN_MIN are seen
    budget.observe("qna", 100)
    budget.observe("chat", 10)
    budget.observe(None, 5)  # no class: nothing to learn
    assert budget.expected == {"qna": 100.0, "chat": 10.0}
    for _ in range(LEARN_WINDOW):
        budget.observe("chat", 30)
    assert budget.expected["chat"] == 30.0  # the oldest left the window
    budget.observe("chat", 30 + LEARN_WINDOW)
    assert budget.expected["chat"] == pytest.approx(31.0)
    fixed = OutputBudget({"qna": 24.0})
    fixed.observe("qna", 1000)
    assert fixed.expected == {"qna": 24.0}  # only a learning budget learns


async def test_the_agent_feeds_its_learning_budget_every_completion() -> None:
    engine = SimEngine("A100-80GB", [MODEL], time_scale=1000.0, seed=1)
    budget = OutputBudget(learn=True)
    agent = Agent("amqp://unused/", [engine], agent_id="l", output_budget=budget)
    inst = agent.instances["l-gpu0"]
    reported: list[str] = []  # request ids, in the order their completions were reported

    async def report(msg: Any) -> None:  # the broker side is not what this is about
        reported.append(msg.request_id)

    agent._report = report  # type: ignore[method-assign]
    await engine.start(agent._make_output_handler(inst))
    try:
        now = time.time()
        for k in range(LEARN_MIN):
            request = RequestMessage(
                request_id=f"r{k}",
                model=MODEL,
                prompt_token_ids=list(range(8)),
                max_tokens=6,
                sampling=SamplingParams(ignore_eos=True),
                slo=SLO(e2e_ms=60_000, slo_class="chat"),
            )
            agent._start_dispatch(
                inst,
                Dispatch(
                    dispatch_id=f"d{k}",
                    instance_id="l-gpu0",
                    attempt=1,
                    request=request,
                    submitted_at=now,
                    queued_at=now,
                    dispatched_at=now,
                    deadline=now + 60,
                ),
            )
        await wait_until(lambda: len(reported) == LEARN_MIN)
        assert budget.expected == {"chat": 6.0}
    finally:
        await engine.stop()
