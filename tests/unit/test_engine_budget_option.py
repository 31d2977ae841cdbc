"""The engine's token budget per iteration (`qlm agent --max-num-batched-tokens`) reaches the
sim engine's scheduler and the in-process vLLM engine's arguments (the command line's part:
test_pull_options_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qlm.agents.sim import SimEngine
from qlm.agents.vllm import VllmEngine, VllmSettings


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
