"""The pull, feed and engine-budget options on the command line (`qlm agent`, `qlm bench
gateway`): refused before anything starts, or handed on."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from qlm.agents.sim import SimEngine
from qlm.cli import app


@pytest.fixture
def agent_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """`qlm agent` up to the point where it would run: the arguments of each run, kept."""
    import qlm.cli as cli

    runs: list[tuple[Any, ...]] = []

    async def run_agent(*args: Any) -> None:
        runs.append(args)

    monkeypatch.setattr(cli, "_run_agent", run_agent)
    # nothing of the process's logging or collector changes for the tests that follow
    monkeypatch.setattr(cli, "_setup_logging", lambda *args: None)
    return runs


def test_the_pull_size_is_the_private_stacks_not_a_running_ones() -> None:
    result = CliRunner().invoke(
        app,
        ["bench", "gateway", "--running", "--pull-at-most", "1", "--no-progress"],
        env={"COLUMNS": "200"},  # the error box on one line
    )
    assert result.exit_code == 2
    assert "not --running" in result.output


def test_a_pull_size_below_one_is_refused() -> None:
    result = CliRunner().invoke(app, ["bench", "gateway", "--pull-at-most", "0", "--no-progress"])
    assert result.exit_code == 2


def test_the_feed_budget_is_the_private_stacks_not_a_running_ones() -> None:
    result = CliRunner().invoke(
        app,
        ["bench", "gateway", "--running", "--feed-tokens", "512", "--no-progress"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 2
    assert "not --running" in result.output


def test_the_agent_refuses_a_feed_budget_with_saber_admission() -> None:
    args = ["agent", "--admission", "saber", "--usl", "100,0.1,0", "--feed-tokens", "512"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "--feed-tokens paces an agent without --admission saber" in " ".join(
        result.output.split()
    )


def test_the_agent_cli_hands_its_feed_budget_to_the_agent(
    agent_runs: list[tuple[Any, ...]],
) -> None:
    result = CliRunner().invoke(app, ["agent", "--backend", "sim", "--feed-tokens", "512"])
    assert result.exit_code == 0, result.output
    assert [run[-1] for run in agent_runs] == [512]


def test_the_agent_cli_hands_the_engine_budget_to_its_sim_engines(
    agent_runs: list[tuple[Any, ...]],
) -> None:
    args = ["agent", "--backend", "sim", "--gpus", "2", "--max-num-batched-tokens", "512"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (run,) = agent_runs
    engines: list[SimEngine] = run[2]
    assert [e._limits["mistral-7b"].max_num_batched_tokens for e in engines] == [512, 512]


def test_the_http_backend_leaves_the_engine_budget_to_the_server() -> None:
    args = ["agent", "--backend", "http", "--server", "m=http://127.0.0.1:9"]
    result = CliRunner().invoke(
        app, [*args, "--max-num-batched-tokens", "512"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 2
    assert "the server's setting with --backend http" in " ".join(result.output.split())


def test_a_sim_engine_takes_the_context_it_is_given_and_says_so(
    agent_runs: list[tuple[Any, ...]],
) -> None:
    """--max-model-len with the sim backend: reported like vLLM's (per model, never above
    the model's own context) and enforced; without it, the model's own and unreported."""
    args = ["agent", "--backend", "sim", "--models", "mistral-7b,vicuna-13b"]
    result = CliRunner().invoke(app, [*args, "--max-model-len", "3000"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    given, default = (run[2][0] for run in agent_runs)
    # vicuna-13b's own context is 4096 (the catalog's): 3000 is below both
    assert dict(given.max_model_len) == {"mistral-7b": 3000, "vicuna-13b": 3000}
    assert dict(default.max_model_len) == {}


def test_the_http_backend_leaves_the_context_to_the_server() -> None:
    args = ["agent", "--backend", "http", "--server", "m=http://127.0.0.1:9"]
    result = CliRunner().invoke(app, [*args, "--max-model-len", "4096"], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "--max-model-len is the server's setting" in " ".join(result.output.split())
