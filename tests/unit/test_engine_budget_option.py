"""`qlm agent --max-num-batched-tokens`: the engine's token budget per iteration reaches the
sim engine's scheduler and the in-process vLLM engine's arguments; with `--backend http` it is
the server's setting and is refused before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from qlm.agents.sim import SimEngine
from qlm.agents.vllm import VllmEngine, VllmSettings
from qlm.cli import app


def test_the_sim_engine_schedules_with_the_budget_it_is_given() -> None:
    default = SimEngine("A100-80GB", ["mistral-7b"])
    small = SimEngine("A100-80GB", ["mistral-7b"], max_num_batched_tokens=512)
    assert default._limits["mistral-7b"].max_num_batched_tokens == 2048  # vLLM's A100 default
    assert small._limits["mistral-7b"].max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SimEngine("A100-80GB", ["mistral-7b"], max_num_batched_tokens=0)


def test_the_vllm_engine_passes_the_budget_to_its_engine_args(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    # a local directory (nothing is loaded: the arguments are only built)
    engine = VllmEngine({"tiny": str(tmp_path)}, VllmSettings(max_num_batched_tokens=256))
    args = engine._engine_args(engine._models["tiny"])
    assert args.max_num_batched_tokens == 256
    unset = VllmEngine({"tiny": str(tmp_path)})
    assert unset._engine_args(unset._models["tiny"]).max_num_batched_tokens is None
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        VllmSettings(max_num_batched_tokens=0)


def test_the_agent_cli_hands_the_budget_to_its_sim_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import qlm.cli as cli

    seen: list[SimEngine] = []

    async def run_agent(*args: Any) -> None:
        seen.extend(args[2])  # the engines

    monkeypatch.setattr(cli, "_run_agent", run_agent)
    # nothing of the process's logging or collector changes for the tests that follow
    monkeypatch.setattr(cli, "_setup_logging", lambda *args: None)
    args = ["agent", "--backend", "sim", "--gpus", "2", "--max-num-batched-tokens", "512"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert [e._limits["mistral-7b"].max_num_batched_tokens for e in seen] == [512, 512]


def test_the_http_backend_leaves_the_budget_to_the_server() -> None:
    args = [
        "agent",
        "--backend",
        "http",
        "--server",
        "m=http://127.0.0.1:9",
        "--max-num-batched-tokens",
        "512",
    ]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "the server's setting with --backend http" in " ".join(result.output.split())
