"""Several seeds per scenario (issue 17): ``seeds`` in a scenario or ``--seeds`` on the command
line, the summary's mean ± sd, and the tables that show it."""

from __future__ import annotations

import math

import pytest

from qlm.policy import QueuePolicy
from qlm.tooling.bench_sim import run_sim_bench
from qlm.tooling.simulator.report import aggregate_seeds, markdown_table, results_markdown
from qlm.tooling.simulator.scenario import ScenarioError, ScenarioSpec

TINY = {
    "name": "tiny",
    "duration_s": 20,
    "pools": [{"gpu": "A100-80GB", "count": 1, "models": ["mistral-7b"]}],
    "streams": [
        {
            "name": "chat",
            "models": ["mistral-7b"],
            "slo_class": "interactive",
            "e2e_slo_s": 20,
            "arrival": {"process": "poisson", "rate_rps": 2},
            "lengths": {"source": "sharegpt", "max_prompt_tokens": 1024},
        }
    ],
    "policies": ["fcfs"],
    "options": {"drain_s": 60},
}


def factory(name: str, overrides: object) -> QueuePolicy:
    from qlm.planner import create_policy

    return create_policy(name)


def test_scenario_seeds_field() -> None:
    assert ScenarioSpec(**TINY).run_seeds() == [0]
    assert ScenarioSpec(**{**TINY, "seed": 4}).run_seeds() == [4]
    spec = ScenarioSpec(**{**TINY, "seeds": [0, 1, 2]})
    assert spec.run_seeds() == [0, 1, 2]
    one = spec.with_seed(2)
    assert one.seed == 2 and one.run_seeds() == [2]
    with pytest.raises(ScenarioError, match="seeds"):
        ScenarioSpec(**{**TINY, "seeds": [1, 1]})
    with pytest.raises(ScenarioError, match="seeds"):
        ScenarioSpec(**{**TINY, "seeds": []})


def summary(att: list[float], thr: float, by_class: float) -> dict:
    return {
        "scenario": "s",
        "seed": 0,
        "sweep": {"parameter": "p", "label": "rate", "values": [1, 2], "variants": ["1", "2"]},
        "policies": {
            "edf": {
                "slo_attainment": att,
                "throughput_rps": [thr, thr],
                "task_attainment": [None, None],
                "slo_attainment_by_class": {"a": [by_class, None]},
            }
        },
    }


def test_aggregate_seeds_mean_and_sample_sd() -> None:
    out = aggregate_seeds(
        [summary([0.5, 0.7], 1.0, 0.2), summary([0.7, 0.7], 3.0, 0.4)], seeds=[0, 1]
    )
    edf, sd = out["policies"]["edf"], out["sd"]["edf"]
    assert edf["slo_attainment"] == pytest.approx([0.6, 0.7])
    assert sd["slo_attainment"][0] == pytest.approx(math.sqrt(0.02))
    assert sd["slo_attainment"][1] == pytest.approx(0.0)
    assert edf["throughput_rps"] == pytest.approx([2.0, 2.0])
    assert edf["task_attainment"] == [None, None] and sd["task_attainment"] == [None, None]
    assert edf["slo_attainment_by_class"]["a"][0] == pytest.approx(0.3)
    assert edf["slo_attainment_by_class"]["a"][1] is None
    assert out["seeds"] == [0, 1] and set(out["per_seed"]) == {"0", "1"}
    table = markdown_table(out)
    assert "60.0 ± 14.1" in table and "2.00 ± 1.41" in table
    assert "seeds: 0, 1" in results_markdown(out)
    with pytest.raises(ValueError):
        aggregate_seeds([summary([0.5, 0.7], 1.0, 0.2)], seeds=[0, 1])


def test_one_seed_keeps_the_old_summary() -> None:
    """No sd anywhere and no ± in the table: a single seed is the old behaviour."""
    lines: list[str] = []
    out = run_sim_bench(
        ScenarioSpec(**TINY), None, factory, command="", echo=lines.append, show_progress=False
    )
    assert "sd" not in out and "seeds" not in out and out["seed"] == 0
    assert "±" not in "\n".join(lines)


def test_several_seeds_average_and_show_mean_sd() -> None:
    lines: list[str] = []
    out = run_sim_bench(
        ScenarioSpec(**TINY),
        None,
        factory,
        command="",
        echo=lines.append,
        show_progress=False,
        seeds=[0, 1, 2],
    )
    per_seed = [out["per_seed"][s]["fcfs"]["requests"] for s in ("0", "1", "2")]
    assert len(set(per_seed)) > 1  # different seeds draw different workloads
    assert out["policies"]["fcfs"]["requests"] == pytest.approx(sum(per_seed) / 3)
    assert out["sd"]["fcfs"]["requests"] > 0
    assert "±" in "\n".join(lines)
    # the scenario file's own seeds, when the command line gives none
    spec = ScenarioSpec(**{**TINY, "seeds": [3, 4]})
    out2 = run_sim_bench(spec, None, factory, command="", echo=lines.append, show_progress=False)
    assert out2["seeds"] == [3, 4]


def test_cli_rejects_bad_seeds() -> None:
    from typer.testing import CliRunner

    from qlm.cli import app

    for bad in ("1,1", "a,b", "-1"):
        result = CliRunner().invoke(app, ["bench", "sim", "--scenario", "wb", "--seeds", bad])
        assert result.exit_code == 2, result.output
        assert "--seeds" in result.output
