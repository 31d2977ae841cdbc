"""``qlm bench sim`` end to end (in process): a small scenario file through every policy, the
outputs, and bad inputs that must fail with the field named and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from qlm.cli import app
from qlm.tooling.simulator.presets import PRESETS

runner = CliRunner()

SMALL = {
    "name": "small",
    "description": "two instances, one minute",
    "duration_s": 60,
    "seed": 1,
    "pools": [{"gpu": "A100-80GB", "count": 2, "models": ["mistral-7b", "mistral-7b@b"]}],
    "streams": [
        {
            "name": "chat",
            "models": ["mistral-7b", "mistral-7b@b"],
            "slo_class": "interactive",
            "e2e_slo_s": 20,
            "arrival": {"process": "poisson", "rate_rps": 3},
            "lengths": {"source": "sharegpt", "max_prompt_tokens": 2048},
        },
        {
            "name": "bulk",
            "models": ["mistral-7b"],
            "slo_class": "batch",
            "e2e_slo_s": 300,
            "arrival": {"process": "gamma", "rate_rps": 2, "cv": 3},
            "lengths": {"source": "arxiv"},
        },
    ],
    "policies": ["qlm", "edf", "fcfs", "shepherd"],
    "sweep": {"parameter": "streams.0.arrival.rate_rps", "values": [2, 4]},
}


def write(tmp_path: Path, data: dict, name: str = "scenario.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_policy_runs_on_a_scenario_file_and_writes_table_json_and_plots(tmp_path):
    out = tmp_path / "out"
    summary_path = tmp_path / "summary.json"
    result = runner.invoke(
        app,
        [
            "bench",
            "sim",
            "--file",
            str(write(tmp_path, SMALL)),
            "--out",
            str(out),
            "--json",
            str(summary_path),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(summary_path.read_text())
    assert summary["scenario"] == "small"
    assert summary["sweep"]["values"] == [2, 4]
    assert list(summary["policies"]) == ["qlm", "edf", "fcfs", "shepherd"]
    for metrics in summary["policies"].values():
        for key in ("slo_attainment", "throughput_rps", "gpu_utilisation", "model_swaps"):
            assert len(metrics[key]) == 2
        assert set(metrics["slo_attainment_by_class"]) == {"interactive", "batch"}
        assert all(0 <= a <= 1 for a in metrics["slo_attainment"])
        assert metrics["requests"][1] > metrics["requests"][0]  # the swept rate doubled
    names = {p.name for p in out.iterdir()}
    assert {"summary.json", "results.md", "attainment.png", "throughput.png"} <= names
    assert "| qlm |" in (out / "results.md").read_text().replace("  ", " ")
    assert "small" in result.output


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"bogus": 1}, "bogus"),
        ({"pools": [{"gpu": "Z9000", "count": 1, "models": ["mistral-7b"]}]}, "pools.0.gpu"),
        ({"pools": [{"gpu": "A10", "count": 1, "models": ["gpt-5"]}]}, "pools.0.models"),
        (
            {
                "streams": [
                    {**SMALL["streams"][0], "arrival": {"process": "poisson", "rate_rps": -1}}
                ]
            },
            "streams.0.arrival.rate_rps",
        ),
    ],
)
def test_bad_scenario_files_name_the_field_and_write_nothing(tmp_path, change, field):
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "bench",
            "sim",
            "--file",
            str(write(tmp_path, {**SMALL, **change})),
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    assert result.exit_code == 2
    assert field in result.output
    assert not out.exists()


def test_a_malformed_trace_csv_names_the_row_and_writes_nothing(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,10,5\n0.5,-3,5\n")
    data = {
        **SMALL,
        "sweep": None,
        "streams": [
            {
                **SMALL["streams"][0],
                "arrival": {"process": "trace", "trace": str(trace)},
                "lengths": {"source": "trace"},
            }
        ],
    }
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        ["bench", "sim", "--file", str(write(tmp_path, data)), "--out", str(out)],
        env={"COLUMNS": "250"},  # rich wraps the error box to the terminal's width
    )
    assert result.exit_code == 2
    assert "line 3" in result.output or "row" in result.output
    assert not out.exists()


def test_unknown_scenarios_and_policies_are_refused():
    result = runner.invoke(app, ["bench", "sim", "--scenario", "nope"])
    assert result.exit_code == 2 and "known" in result.output
    result = runner.invoke(app, ["bench", "sim", "--scenario", "wb", "--policies", "magic"])
    assert result.exit_code == 2 and "magic" in result.output


def test_every_preset_is_listed_and_dumps_to_a_loadable_file(tmp_path):
    result = runner.invoke(app, ["bench", "sim", "--list"])
    assert result.exit_code == 0
    for name in PRESETS:
        assert name in result.output
    dumped = runner.invoke(app, ["bench", "sim", "--scenario", "hetero", "--dump"])
    assert dumped.exit_code == 0
    path = tmp_path / "hetero.yaml"
    path.write_text(dumped.output)
    from qlm.tooling.simulator.scenario import load_scenario

    assert load_scenario(path) == PRESETS["hetero"].spec()


def test_clairvoyant_flag_sets_the_scenario_field():
    dumped = runner.invoke(app, ["bench", "sim", "--scenario", "wb", "--dump", "--clairvoyant"])
    assert dumped.exit_code == 0
    assert yaml.safe_load(dumped.output)["clairvoyant_max_tokens"] is True
    plain = runner.invoke(app, ["bench", "sim", "--scenario", "wb", "--dump"])
    assert yaml.safe_load(plain.output)["clairvoyant_max_tokens"] is False


def test_runs_are_reproducible_for_every_policy(tmp_path):
    """Same scenario, same seed: identical figures (the planners budget work, not wall time)."""
    data = {**SMALL, "sweep": None, "duration_s": 40}
    path = write(tmp_path, data)
    outs = []
    for k in range(2):
        json_path = tmp_path / f"s{k}.json"
        result = runner.invoke(
            app, ["bench", "sim", "--file", str(path), "--json", str(json_path), "--no-progress"]
        )
        assert result.exit_code == 0, result.output
        summary = json.loads(json_path.read_text())
        for metrics in summary["policies"].values():
            for key in ("planner_wall_s", "sim_wall_s"):
                metrics.pop(key)
        summary.pop("run")
        outs.append(summary["policies"])
    assert outs[0] == outs[1]


def test_a_measured_profile_replaces_the_roofline_of_its_model(tmp_path):
    from dataclasses import replace

    from qlm.engine_model import get_profile, profile_to_dict

    slow = replace(get_profile("A100-80GB", "mistral-7b"), prefill_mfu=0.2, source="measured:test")
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_to_dict(slow)))
    base = {**SMALL, "sweep": None, "policies": ["fcfs"], "duration_s": 30}
    p50 = []
    for profiles in ([], [str(path)]):
        pools = [{**SMALL["pools"][0], "profiles": profiles}]
        out = tmp_path / f"s{len(profiles)}.json"
        result = runner.invoke(
            app,
            [
                "bench",
                "sim",
                "--file",
                str(write(tmp_path, {**base, "pools": pools})),
                "--json",
                str(out),
            ],
        )
        assert result.exit_code == 0, result.output
        p50.append(json.loads(out.read_text())["policies"]["fcfs"]["p50_latency_s"])
    assert p50[1] > p50[0]  # prefill at a quarter of the fitted efficiency: slower
    h100 = replace(get_profile("H100-80GB", "mistral-7b"), source="measured:test")
    wrong = tmp_path / "h100.json"
    wrong.write_text(json.dumps(profile_to_dict(h100)))
    pools = [{**SMALL["pools"][0], "profiles": [str(wrong)]}]
    result = runner.invoke(
        app, ["bench", "sim", "--file", str(write(tmp_path, {**base, "pools": pools}))]
    )
    assert result.exit_code == 2 and "pools.0.profiles.0" in result.output
