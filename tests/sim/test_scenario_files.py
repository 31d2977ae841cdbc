"""The shipped scenario files (``qlm/tooling/simulator/scenarios/*.yaml``): one per preset, each
valid and
in the exact form ``qlm bench sim --dump`` prints (comments aside), with spot checks of the
paper's numbers. They were generated from the Python dicts that built the presets before, and
compared equal to them, spec by spec and sweep point by sweep point."""

from __future__ import annotations

from importlib import resources

import pytest
from typer.testing import CliRunner

from qlm.cli import app
from qlm.tooling.bench_sim import dump
from qlm.tooling.simulator.presets import PRESETS, load_preset, shortened
from qlm.tooling.simulator.scenario import ScenarioSpec

SCENARIOS = resources.files("qlm.tooling.simulator").joinpath("scenarios")


def _text(name: str) -> str:
    return SCENARIOS.joinpath(f"{name}.yaml").read_text(encoding="utf-8")


def _uncommented(text: str) -> str:
    """The file as YAML sees it, less its comment and blank lines (the files use no others)."""
    kept = [
        line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]
    return "\n".join(kept) + "\n"


def _rates(streams: list) -> dict[str, float]:
    return {s.name: s.arrival.rate_rps for s in streams}


def test_every_preset_has_a_file_and_every_file_a_preset() -> None:
    files = {p.name.removesuffix(".yaml") for p in SCENARIOS.iterdir() if p.name.endswith(".yaml")}
    assert files == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_file_is_what_dump_prints(name: str) -> None:
    """Canonical form: every default written out, keys in the model's order, so a file is what
    `--dump` prints and an edit shows as a one-line diff; the CLI prints it unpolluted."""
    spec = load_preset(name)
    assert spec.name == name
    text = _uncommented(_text(name))
    assert dump(spec) == text
    assert _uncommented(_text(name)) != _text(name)  # each file says why, in comments
    result = CliRunner().invoke(app, ["bench", "sim", "--scenario", name, "--dump"])
    assert result.exit_code == 0, result.output
    assert result.stdout == text + "\n"  # typer.echo adds the newline


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_sweep_point_validates(name: str) -> None:
    spec = PRESETS[name].spec()
    points = spec.sweep_points()
    assert all(isinstance(point, ScenarioSpec) for _, point in points)
    if spec.sweep is not None:
        assert [label for label, _ in points] == spec.sweep.variants


def test_wb_is_40_60_interactive_batch_at_4_to_20_rps_with_20_and_300_s_slos() -> None:
    spec = PRESETS["wb"].spec()
    assert spec.sweep is not None and spec.sweep.variants == ["4", "8", "12", "16", "20"]
    assert [p.gpu for p in spec.pools] == ["A100-80GB"] and spec.pools[0].count == 2
    for total, (_, point) in zip([4, 8, 12, 16, 20], spec.sweep_points(), strict=True):
        streams = {s.name: s for s in point.streams}
        assert streams["interactive"].e2e_slo_s == 20.0
        assert streams["batch"].e2e_slo_s == 300.0
        rates = _rates(point.streams)
        assert rates["interactive"] == pytest.approx(0.4 * total)
        assert rates["batch"] == pytest.approx(0.6 * total)
    # delta and rct are W_B at 12 req/s
    for name in ("delta", "rct"):
        assert _rates(PRESETS[name].spec().streams) == _rates(spec.sweep_points()[2][1].streams)


def test_wa_sweeps_the_tail_rate_over_six_models_on_four_a100s() -> None:
    spec = PRESETS["wa"].spec()
    assert spec.pools[0].count == 4 and len(spec.pools[0].models) == 6
    tails = [_rates(point.streams)["tail"] for _, point in spec.sweep_points()]
    assert tails == [0.25, 0.5, 1.0, 2.0]
    assert all(_rates(p.streams)["interactive"] == 1.5 for _, p in spec.sweep_points())


def test_hetero_sweeps_zero_to_five_a10s_of_six_gpus() -> None:
    for a10, (_, point) in enumerate(PRESETS["hetero"].spec().sweep_points()):
        counts = {pool.gpu: pool.count for pool in point.pools}
        assert counts.get("A10", 0) == a10 and sum(counts.values()) == 6


def test_shortened_cuts_duration_and_sweep_points_and_says_so() -> None:
    data = shortened("agentic", 40.0, [4.0, 12.0])
    spec = ScenarioSpec.model_validate(data)
    full = PRESETS["agentic"].spec()
    assert spec.duration_s == 40.0
    assert spec.sweep is not None and spec.sweep.variants == ["4", "12"]
    assert spec.sweep_points()[1][1].streams == full.sweep_points()[2][1].streams
    assert spec.streams == full.streams  # the first point kept is the first point
    assert spec.description.endswith("(shortened: 40 s; arrival rate (calls/s) 4, 12)")
    assert shortened("wb")["description"] == PRESETS["wb"].spec().description
    with pytest.raises(ValueError, match=r"no sweep point \['5'\]"):
        shortened("wb", rates=[4.0, 5.0])
