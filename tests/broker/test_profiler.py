"""`qlm profile` against the sim backend, whose true engine model is known: the profiler must
recover it. (The same profiler on real vLLM: tests/vllm/test_vllm_profile.py.)"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qlm.agents.engine import EngineRequest
from qlm.agents.profiler import ProfilingError, concurrency_levels, profile_engine
from qlm.agents.sim import SimEngine
from qlm.cli import app
from qlm.engine_model import get_profile
from qlm.store import Store
from qlm.tooling.simulator.scenario import load_profile
from tests.broker.test_migrations import fresh_postgres_database

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
    assert result.usl.r_squared is not None and result.usl.r_squared > 0.9
    assert result.measurements["fit_median_relative_error"] < 0.1

    # the RCT estimator's constants as measured, against the sim's own model at the sweep's
    # context. Measured on this machine: P slope and d within 2 %, Θ within 1 % up to L = 32.
    # From L = 64 the 64-token prompts of the level (4+ chunks of 2048) are prefilled inside
    # the decode batch, so the measured Θ is lower than pure decode (8 % at 64, 16 % at 128):
    # the sim's real behaviour, checked as a bound
    est = result.measurements["estimator"]
    ctx = est["context_tokens"]
    true_slope = (true.prefill_time(2048) - true.prefill_time(64)) / (2048 - 64)
    assert est["prefill_s_per_token"] == pytest.approx(true_slope, rel=0.1)
    assert est["decode_token_s"] == pytest.approx(true.decode_iteration_time(1, ctx), rel=0.05)
    for level, measured in est["by_concurrency"].items():
        pure = int(level) / true.decode_iteration_time(int(level), ctx)
        if int(level) <= 32:
            assert measured["throughput_tps"] == pytest.approx(pure, rel=0.05)
        else:
            assert 0.75 * pure <= measured["throughput_tps"] <= 1.02 * pure
    # one model, kept resident: no switch to time, and the file says why
    m = result.measurements
    assert m["load_cold_s"] is None and m["load_warm_s"] is None and "resident" in m["load_note"]
    assert fitted.measured_load_from_disk_s is None


def test_concurrency_levels() -> None:
    assert concurrency_levels(1) == [1]
    assert concurrency_levels(16) == [1, 2, 4, 8, 16]
    assert concurrency_levels(24) == [1, 2, 4, 8, 16, 24]
    with pytest.raises(ProfilingError, match=">= 1"):
        concurrency_levels(0)


class _FailingSim(SimEngine):
    """The engine fake: a sim that breaks after ``ok`` requests, the way a crashed engine
    reports (an error output), or by raising from submit."""

    def __init__(self, ok: int, how: str) -> None:
        super().__init__(GPU, [MODEL], time_scale=50.0)
        self._ok, self._how = ok, how

    def submit(self, request: EngineRequest) -> None:
        self._ok -= 1
        if self._ok < 0 and self._how == "raise":
            raise RuntimeError("engine core died")
        if self._ok < 0:
            request.max_tokens = 10**9  # the sim rejects it with an error output
        super().submit(request)


@pytest.mark.parametrize(("how", "message"), [("raise", "engine core died"), ("error", "exceeds")])
async def test_an_engine_failing_mid_profile_is_a_profiling_error(how: str, message: str) -> None:
    engine = _FailingSim(ok=3, how=how)
    with pytest.raises(ProfilingError, match=message):
        await profile_engine(engine, MODEL, GPU, concurrency=(1, 2, 4))
    assert engine.stats().in_flight == []  # stopped


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    if request.param == "sqlite":
        s = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
        try:
            yield s
        finally:
            await s.close()
        return
    async with fresh_postgres_database(request.getfixturevalue("postgres_url")) as url:
        s = await Store.open(url)
        try:
            yield s
        finally:
            await s.close()


async def test_hardware_profiles_keep_every_run(store: Store) -> None:
    assert await store.latest_hardware_profile(GPU, MODEL) is None
    first = await store.save_hardware_profile(GPU, MODEL, "sim", {"run": 1})
    second = await store.save_hardware_profile(GPU, MODEL, "vllm", {"run": 2})
    other = await store.save_hardware_profile("cpu", "tiny-llama", "vllm", {"run": 3})
    assert len({first, second, other}) == 3
    latest = await store.latest_hardware_profile(GPU, MODEL)
    assert latest is not None and latest["id"] == second and latest["body"] == {"run": 2}
    sim = await store.latest_hardware_profile(GPU, MODEL, engine="sim")
    assert sim is not None and sim["body"] == {"run": 1}
    assert [r["id"] for r in await store.list_hardware_profiles()] == [other, second, first]
    assert [r["id"] for r in await store.list_hardware_profiles(engine="vllm")] == [other, second]
    got = await store.get_hardware_profile(first)
    assert got is not None and (got["gpu_type"], got["model"], got["engine"]) == (GPU, MODEL, "sim")
    assert await store.get_hardware_profile(10**6) is None


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
            "run",
            "--engine",
            "sim",
            "--model",
            MODEL,
            "--gpu-type",
            GPU,
            "--time-scale",
            "20",
            "--max-concurrency",
            "16",
            "--max-num-batched-tokens",
            "512",
            "--out",
            str(out),
            "--store-url",
            db,
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["source"] == "measured:qlm-profile" and set(data["usl"]) >= {"lam", "sigma"}
    loaded = load_profile(str(out))  # what a scenario's pools[].profiles entry does
    assert loaded.model.name == MODEL and loaded.kv_capacity_tokens > 0
    # the engine ran with the agent's token budget, and the profile prices it so
    assert data["max_num_batched_tokens"] == 512 and loaded.max_num_batched_tokens == 512

    async def stored() -> dict[str, object] | None:
        store = await Store.open(db)
        try:
            return await store.get_profile(GPU, MODEL)
        finally:
            await store.close()

    import asyncio

    row = asyncio.run(stored())
    assert row is not None and row["params"] == data  # the profile the coordinator uses
    assert [int(n) for n in data["measurements"]["engine_tokens_per_s"]] == [1, 2, 4, 8, 16]

    # the run is kept in hardware_profiles: list, show and export read it back
    runner = CliRunner()
    listed = runner.invoke(app, ["profile", "list", "--store-url", db])
    assert listed.exit_code == 0, listed.output
    assert re.search(rf"^\s+1\s.*{GPU}\s+{MODEL}\s+sim\s", listed.output, re.M), listed.output
    shown = runner.invoke(app, ["profile", "show", "1", "--store-url", db])
    assert shown.exit_code == 0, shown.output
    run = json.loads(shown.output)
    assert (run["id"], run["engine"], run["body"]) == (1, "sim", data)
    exported = tmp_path / "exported.json"
    latest = ["--gpu-type", GPU, "--model", MODEL, "--store-url", db]
    done = runner.invoke(app, ["profile", "export", "--out", str(exported), *latest])
    assert done.exit_code == 0, done.output
    assert json.loads(exported.read_text()) == data
    assert load_profile(str(exported)) == loaded
    missing = runner.invoke(app, ["profile", "show", "7", "--store-url", db])
    assert missing.exit_code == 1 and "no hardware profile 7" in missing.output


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
    sim = ["profile", "run", "--engine", "sim", "--model", MODEL, "--gpu-type", GPU]
    for args, words in [
        (["--max-concurrency", "0"], "must be >= 3"),
        (["--concurrency", "0,1,2"], "needs >= 3 distinct levels, each >= 1"),
        (["--concurrency", "1,2,x"], "--prompts/--concurrency"),
        (["--out", str(tmp_path)], "is a folder"),
        (["--out", "/proc/qlm-profile.json"], "cannot write"),  # even as root
        (["--max-concurrency", "512"], "exceeds the engine's batch cap of 256"),
    ]:
        bad = runner.invoke(app, [*sim, *args])
        assert bad.exit_code != 0 and words in _flat(bad.output), (args, bad.output)
        assert "Traceback" not in bad.output and isinstance(bad.exception, SystemExit)
    no_store = runner.invoke(app, [*sim, "--store-url", "nosuchdb://x"])
    assert no_store.exit_code == 1 and "cannot open the store" in no_store.output


def test_cli_engine_failing_mid_profile_exits_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import qlm.cli

    monkeypatch.setattr(qlm.cli, "_make_engines", lambda *a, **k: [_FailingSim(3, "raise")])
    out = tmp_path / "p.json"
    result = CliRunner().invoke(
        app, ["profile", "run", "--engine", "sim", "--model", MODEL, "--out", str(out)]
    )
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert (
        "profiling failed: the engine failed a profiling request: RuntimeError: engine core "
        "died" in _flat(result.output)
    )
    assert not out.exists() and not list(tmp_path.iterdir())  # no partial or probe file


def test_a_stored_profile_replaces_the_roofline_for_the_planner(tmp_path: Path) -> None:
    """What the coordinator does at start: stored `qlm profile` results become the profiles
    get_profile (and so the estimator and planner) use, also for hardware the catalog lacks."""
    import asyncio

    from qlm.cli import _use_measured_profiles
    from qlm.engine_model import clear_measured_profiles, profile_from_dict

    data = json.loads((Path(__file__).parents[1] / "data" / "tiny-cpu-profile.json").read_text())

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
