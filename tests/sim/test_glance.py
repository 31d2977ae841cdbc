"""Results at a glance (qlm/tooling/simulator/glance.py): the deciding point, the target, the
page."""

from __future__ import annotations

from pathlib import Path

import pytest

from qlm.tooling.simulator.glance import (
    BEGIN,
    END,
    attainment_markdown,
    bound_gap_markdown,
    glance_markdown,
    glance_row,
    glance_rows,
    speed_markdown,
    write_attainment_blocks,
    write_bound_block,
    write_into,
    write_speed_block,
)


def summary(qlm: list[float], edf: list[float], fcfs: list[float], **extra: object) -> dict:
    return {
        "scenario": "s",
        "seeds": [0, 1, 2],
        "sweep": {"values": [1, 2], "variants": ["4", "8"]},
        "policies": {
            "qlm": {"slo_attainment": qlm},
            "edf": {"slo_attainment": edf},
            "fcfs": {"slo_attainment": fcfs},
        },
        "hindsight": {"slo_attainment": [1.0, 0.9]},
        **extra,
    }


def test_the_row_is_decided_where_qlm_fares_worst_against_the_strongest_baseline() -> None:
    row = glance_row(summary([0.9, 0.6], [0.85, 0.65], [0.95, 0.5]))
    # at "4" qlm trails fcfs by 5, at "8" edf by 5: the first worst margin wins the tie
    assert (row.point, row.baseline) == ("4", "fcfs")
    assert row.qlm == pytest.approx(90.0) and row.baseline_value == pytest.approx(95.0)
    assert row.bound == pytest.approx(100.0) and row.seeds == 3
    assert not row.met and "trails fcfs by 5.0" in row.why


def test_a_point_within_the_slack_is_met_unless_its_own_checks_miss() -> None:
    close = summary([0.9, 0.7], [0.905, 0.6], [0.5, 0.4])
    assert glance_row(close).met
    checks = [{"target": "x", "measured": "y", "met": False}]
    row = glance_row({**close, "checks": checks})
    assert not row.met and "missed its check 'x'" in row.why


def test_a_clairvoyant_twin_has_no_row_of_its_own() -> None:
    run = summary([0.9, 0.6], [0.85, 0.65], [0.95, 0.5], clairvoyant_max_tokens=False)
    twin = {"policies": {"qlm": {"slo_attainment": [1.0, 0.8]}}, "clairvoyant_max_tokens": True}
    capped = {**twin, "clairvoyant_max_tokens": False}  # not a clairvoyant run: a run like any
    rows = glance_rows({"run": run, "run-clairvoyant": twin, "x-clairvoyant": twin})
    assert [r.scenario for r in rows] == ["run", "x-clairvoyant"]  # x has no run to be twin of
    rows = glance_rows({"run": run, "run-clairvoyant": capped})
    assert [r.scenario for r in rows] == ["run", "run-clairvoyant"]


def test_runs_without_baselines_are_judged_by_their_own_checks() -> None:
    ablation = {"scenario": "a", "policies": {"qlm": {"slo_attainment": 0.5}}, "checks": []}
    row = glance_row(ablation)
    assert row.met and row.baseline is None and row.target == "its own checks"


def test_the_table_replaces_only_the_marked_block(tmp_path: Path) -> None:
    page = tmp_path / "b.md"
    page.write_text(f"# title\n{BEGIN}\nold\n{END}\nrest\n")
    table = glance_markdown([glance_row(summary([0.9, 0.6], [0.8, 0.5], [0.7, 0.4]))])
    write_into(page, table)
    text = page.read_text()
    assert text.startswith("# title\n") and text.endswith(f"{END}\nrest\n")
    assert "\nold\n" not in text and "| s | older run, clairvoyant | 3 |" in text
    with pytest.raises(ValueError, match="no"):
        write_into(_unmarked(tmp_path), table)


def _unmarked(tmp_path: Path) -> Path:
    page = tmp_path / "plain.md"
    page.write_text("nothing here\n")
    return page


def test_a_runs_attainment_table_has_qlm_first_mean_sd_and_the_bound(tmp_path: Path) -> None:
    s = summary([0.9, 0.6], [0.85, 0.65], [0.95, 0.5])
    s["sweep"]["label"] = "rate"
    s["sd"] = {"qlm": {"slo_attainment": [0.01, 0.02]}}
    table = attainment_markdown(s)
    assert table.splitlines()[0] == "| rate | qlm | edf | fcfs | bound |"
    assert "| 4 | 90.0 ± 1.0 | 85.0 | 95.0 | 100.0 |" in table  # no sd recorded: the mean
    page = tmp_path / "b.md"
    page.write_text(
        "a\n<!-- attainment:wb:begin -->\nold\n<!-- attainment:wb:end -->\nb\n"
        "<!-- attainment:gone:begin -->\nkeep\n<!-- attainment:gone:end -->\n"
    )
    assert write_attainment_blocks(page, {"wb": s}) == ["wb"]
    text = page.read_text()
    assert "old" not in text and "| 8 | 60.0 ± 2.0 | 65.0 | 50.0 | 90.0 |" in text
    assert "keep" in text  # a block whose run is not given stays as it was


def test_the_speed_table_sets_qlms_wall_time_against_edfs(tmp_path: Path) -> None:
    fast = summary([0.9, 0.6], [0.85, 0.65], [0.95, 0.5])
    fast["policies"]["qlm"].update(sim_wall_s=[1.0, 2.0], planner_wall_s=[0.5, 0.5])
    fast["policies"]["edf"]["sim_wall_s"] = [1.0, 1.0]
    slow = summary([0.9, 0.6], [0.85, 0.65], [0.95, 0.5])
    slow["policies"]["qlm"]["sim_wall_s"] = 9.0
    slow["policies"]["edf"]["sim_wall_s"] = 1.5
    alone = {"policies": {"qlm": {"sim_wall_s": 1.0}}}  # no EDF: no row
    table = speed_markdown({"fast": fast, "slow": slow, "alone": alone})
    assert "| fast | 3.0 | 1.0 | 2.0 | 1.5× | met |" in table
    assert "| slow | 9.0 | – | 1.5 | 6.0× | **missed** |" in table
    assert "alone" not in table
    page = tmp_path / "b.md"
    page.write_text("a\n<!-- speed:begin -->\nold\n<!-- speed:end -->\nb\n")
    assert write_speed_block(page, {"fast": fast})
    assert "old" not in page.read_text() and "| fast |" in page.read_text()
    assert not write_speed_block(_unmarked(tmp_path), {"fast": fast})


def test_the_bound_table_gives_qlms_largest_gap_to_the_hindsight_bound(tmp_path: Path) -> None:
    # bound 100 / 90: qlm's gaps 10 and 30; edf reaches 65 at the farthest point
    run = summary([0.9, 0.6], [0.85, 0.65], [0.95, 0.5])
    close = summary([0.95, 0.85], [0.9, 0.8], [0.9, 0.8])
    ablation = {"policies": {"qlm": {"slo_attainment": 0.5}, "qlm-x": {"slo_attainment": 0.6}}}
    ablation["hindsight"] = {"slo_attainment": 1.0}
    unbounded = {"policies": {"qlm": {"slo_attainment": 0.5}, "edf": {"slo_attainment": 0.4}}}
    # run's clairvoyant twin: qlm alone, told the true lengths
    twin = {**summary([0.92, 0.7], [0, 0], [0, 0]), "clairvoyant_max_tokens": True}
    twin["policies"] = {"qlm": twin["policies"]["qlm"]}
    table = bound_gap_markdown(
        {
            "run": run,
            "run-clairvoyant": twin,
            "close": close,
            "ablation": ablation,
            "unbounded": unbounded,
        }
    )
    assert "| run | 1 of 2 | 8 | 60.0 | edf 65.0 | 70.0 | 90.0 | 30.0 | **missed** |" in table
    assert "| close | 2 of 2 | 4 | 95.0 | qlm 95.0 | – | 100.0 | 5.0 | met |" in table
    assert "run-clairvoyant" not in table
    assert "ablation" not in table and "unbounded" not in table  # no baseline / no bound
    page = tmp_path / "b.md"
    page.write_text("a\n<!-- bound:begin -->\nstale\n<!-- bound:end -->\nb\n")
    assert write_bound_block(page, {"run": run})
    assert "stale" not in page.read_text() and "| run |" in page.read_text()
    assert not write_bound_block(_unmarked(tmp_path), {"run": run})


def test_qlms_own_variants_are_not_baselines() -> None:
    """A column of qlm with a setting (``qlm-no-lanes``) is compared with qlm in the text: neither
    the glance row nor a scenario's own checks (targets.check_wb) count it as a baseline."""
    from qlm.tooling.simulator.targets import check_wb

    s = summary([0.9, 0.6], [0.85, 0.55], [0.8, 0.5])
    s["policies"]["qlm-no-lanes"] = {"slo_attainment": [0.99, 0.7]}
    row = glance_row(s)
    assert row.met and row.baseline == "edf"
    every = [c for c in check_wb(s) if "every baseline" in c[0]]
    assert every and all(met for _, _, met in every)
