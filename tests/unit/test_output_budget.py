"""SABER's maxTokens reading (qlm.admission.OutputBudget): a task's profiled mean output, not
the client's cap, and what the agent's gate takes from it."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from qlm import cli
from qlm.admission import OutputBudget, required_speed
from qlm.agents.agent import Agent
from qlm.agents.engine import EngineRequest
from qlm.agents.sim import SimEngine

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
