"""`qlm profile` against the sim backend, whose true engine model is known: the profiler must
recover it. (The same profiler on real vLLM: tests/test_vllm_profile.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agents.profiler import ProfilingError, profile_engine
from agents.sim import SimEngine
from qlm.cli import app
from qlm.engine_model import get_profile
from qlm.simulator.scenario import load_profile
from qlm.store import Store

MODEL, GPU = "mistral-7b", "A100-80GB"


async def test_profiling_the_sim_recovers_its_engine_model() -> None:
    # time_scale 2: the event loop's own lag, multiplied by the scale, stays small next to
    # the modelled iteration times (a large scale would profile asyncio, not the model)
    engine = SimEngine(GPU, [MODEL], time_scale=2.0)
    result = await profile_engine(
        engine, MODEL, GPU, prompts=(64, 512, 2048), concurrency=(1, 8, 32, 64, 128)
    )
    fitted, true = result.profile, get_profile(GPU, MODEL)
    # measured within 20 %: each timing is one iteration of a real-time loop, and the
    # requests of a concurrency level are decoded together after staggered prefills
    for n in (64, 512, 2048):
        assert fitted.prefill_time(n) == pytest.approx(true.prefill_time(n), rel=0.2)
    for batch in (1, 32, 128):
        assert fitted.decode_iteration_time(batch, 600) == pytest.approx(
            true.decode_iteration_time(batch, 600), rel=0.2
        )
    assert fitted.kv_capacity_tokens == engine.kv_capacity_tokens
    assert result.usl.lam == pytest.approx(1 / true.decode_iteration_time(1, 96), rel=0.2)
    assert result.usl(128) < result.usl(1)  # speed per request falls with concurrency
    assert result.measurements["fit_median_relative_error"] < 0.1


async def test_profiling_rejects_what_cannot_be_measured() -> None:
    engine = SimEngine(GPU, [MODEL], time_scale=50.0)
    with pytest.raises(ProfilingError, match="does not serve"):
        await profile_engine(engine, "vicuna-13b", GPU)
    with pytest.raises(ProfilingError, match="distinct levels"):
        await profile_engine(engine, MODEL, GPU, concurrency=(1, 1, 2))


def test_cli_writes_a_profile_the_simulator_loads_and_stores_it(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    db = f"sqlite+aiosqlite:///{tmp_path}/qlm.db"
    result = CliRunner().invoke(
        app,
        [
            "profile",
            "--engine",
            "sim",
            "--model",
            MODEL,
            "--gpu-type",
            GPU,
            "--time-scale",
            "20",
            "--concurrency",
            "1,4,16",
            "--out",
            str(out),
            "--database-url",
            db,
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["source"] == "measured:qlm-profile" and set(data["usl"]) >= {"lam", "sigma"}
    loaded = load_profile(str(out))  # what a scenario's pools[].profiles entry does
    assert loaded.model.name == MODEL and loaded.kv_capacity_tokens > 0

    async def stored() -> dict[str, object] | None:
        store = await Store.open(db)
        try:
            return await store.get_profile(GPU, MODEL)
        finally:
            await store.close()

    import asyncio

    row = asyncio.run(stored())
    assert row is not None and row["params"] == data


def _flat(text: str) -> str:
    """Typer's error box wraps lines; compare the words."""
    return re.sub(r"[\s│╭╮╰╯─]+", " ", text)


def test_cli_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(
        app, ["profile", "--engine", "sim", "--model", MODEL, "--out", str(tmp_path / "no/x.json")]
    )
    assert missing.exit_code != 0 and "does not exist" in _flat(missing.output)
    unknown = runner.invoke(
        app, ["profile", "--engine", "sim", "--model", "gpt-17", "--gpu-type", GPU]
    )
    assert unknown.exit_code != 0 and "unknown model" in _flat(unknown.output)
    no_path = runner.invoke(app, ["profile", "--engine", "vllm", "--model", "tiny-llama"])
    assert no_path.exit_code != 0


def test_a_stored_profile_replaces_the_roofline_for_the_planner(tmp_path: Path) -> None:
    """What the coordinator does at start: stored `qlm profile` results become the profiles
    get_profile (and so the estimator and planner) use, also for hardware the catalog lacks."""
    import asyncio

    from qlm.cli import _use_measured_profiles
    from qlm.engine_model import clear_measured_profiles, profile_from_dict

    data = json.loads((Path(__file__).parent / "data" / "tiny-cpu-profile.json").read_text())

    async def go() -> None:
        store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
        try:
            await store.save_profile("cpu", "tiny-llama", "measured:qlm-profile", data)
            await _use_measured_profiles(store)
        finally:
            await store.close()

    try:
        asyncio.run(go())
        measured = get_profile("cpu", "tiny-llama")
        assert measured == profile_from_dict(data) and measured.source == "measured:qlm-profile"
        assert get_profile(GPU, MODEL).source == "roofline"  # others keep the roofline
    finally:
        clear_measured_profiles()
    with pytest.raises(KeyError, match="unknown GPU type"):
        get_profile("cpu", "tiny-llama")
