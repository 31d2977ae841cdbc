"""`qlm bench gateway` options that are refused before anything starts."""

from __future__ import annotations

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
