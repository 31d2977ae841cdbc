"""The pull and feed options on the command line (`qlm agent`, `qlm bench gateway`): refused
before anything starts, or handed on."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from qlm.cli import app


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


def test_the_agent_cli_hands_its_feed_budget_to_the_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    import qlm.cli as cli

    seen: list[object] = []

    async def run_agent(*args: object) -> None:
        seen.append(args[-1])

    monkeypatch.setattr(cli, "_run_agent", run_agent)
    # nothing of the process's logging or collector changes for the tests that follow
    monkeypatch.setattr(cli, "_setup_logging", lambda *args: None)
    result = CliRunner().invoke(app, ["agent", "--backend", "sim", "--feed-tokens", "512"])
    assert result.exit_code == 0, result.output
    assert seen == [512]
