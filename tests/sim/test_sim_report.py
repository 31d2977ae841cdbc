"""`qlm bench sim` outputs: JSON, Markdown and console tables, PNG plots, atomic writes."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.tooling.simulator import report
from qlm.tooling.simulator.report import (
    MISSING,
    PALETTE,
    markdown_table,
    render_console_table,
    sweep_positions,
    validate_summary,
    write_outputs,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def sweep_summary() -> dict[str, Any]:
    return {
        "scenario": "wb",
        "description": "single model, mixed SLOs, arrival rate swept into overload",
        "command": "qlm bench sim --scenario wb",
        "seed": 0,
        "sweep": {
            "parameter": "streams.0.arrival.rate_rps",
            "label": "arrival rate (req/s)",
            "values": [2, 4, 8],
            "variants": ["2", "4", "8"],
        },
        "policies": {
            "qlm": {
                "slo_attainment": [1.0, 0.95, 0.8],
                "slo_attainment_by_class": {"interactive": [1.0, 0.9, 0.7], "batch": [1, 1, 0.9]},
                "throughput_rps": [2.0, 3.9, 6.5],
                "goodput_rps": [2.0, 3.7, 5.2],
                "gpu_utilisation": [0.3, 0.6, 0.99],
                "model_swaps": [0, 1, 3],
                "evictions": [0, 2, 10],
                "p99_latency_s": [5.0, 9.25, None],
                "requests": [100, 200, 400],
                "completed": [100, 200, 390],
                "planner_wall_s": [0.1, 0.2, 0.4],
            },
            "fcfs": {
                "slo_attainment": [1.0, 0.7, 0.3],
                "slo_attainment_by_class": {"interactive": [1.0, 0.5, 0.1], "batch": [1, 1, 0.6]},
                "throughput_rps": [2.0, 3.8, 5.0],
                "goodput_rps": [2.0, 2.7, 1.5],
                "gpu_utilisation": [0.3, 0.7, 1.0],
                "model_swaps": [0, 0, 0],
                "evictions": [0, 5, 40],
                "p99_latency_s": [4.0, 30.0, 99.0],
                "requests": [100, 200, 400],
                "completed": [100, 200, 380],
                "planner_wall_s": [0.0, 0.0, 0.0],
            },
        },
        "scatter": {
            "title": "RCT estimate vs simulated completion time",
            "x_label": "estimated (s)",
            "y_label": "simulated (s)",
            "x": [1.0, 2.0, 3.0, 4.0],
            "y": [1.1, 1.9, 3.2, 4.1],
            "r2": 0.97,
        },
        "misses": ["wb overload: qlm - fcfs = 35 points < 40 (target)"],
    }


def flat_summary() -> dict[str, Any]:
    return {
        "scenario": "mm",
        "description": "three models",
        "command": "qlm bench sim --scenario mm",
        "seed": 3,
        "sweep": None,
        "policies": {
            "qlm": {
                "slo_attainment": 0.93,
                "slo_attainment_by_class": {"interactive": 0.9, "batch": 1.0},
                "throughput_rps": 12.3,
                "gpu_utilisation": 0.71,
                "model_swaps": 3,
                "evictions": 10,
                "p99_latency_s": 41.0,
                "requests": 1000,
                "completed": 990,
                "planner_wall_s": 1.2,
                "replans": 7,
            },
            "edf": {
                "slo_attainment": None,
                "slo_attainment_by_class": {"interactive": 0.5},
                "throughput_rps": 10.0,
                "gpu_utilisation": 0.5,
                "model_swaps": 12,
                "evictions": 0,
                "p99_latency_s": None,
                "requests": 1000,
                "completed": 800,
                "planner_wall_s": 0.0,
                "replans": 0,
            },
            "fcfs": {
                "slo_attainment": 0.5,
                "slo_attainment_by_class": {"interactive": 0.25, "batch": 0.75},
                "throughput_rps": 9.5,
                "gpu_utilisation": 0.4,
                "model_swaps": 20,
                "evictions": 0,
                "p99_latency_s": 120.04,
                "requests": 1000,
                "completed": 700,
                "planner_wall_s": 0.0,
                "replans": 0,
            },
        },
    }


def table_rows(markdown: str) -> list[list[str]]:
    """The cells of every table line (header, alignment and body)."""
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in markdown.splitlines()
        if line.startswith("|")
    ]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def png_colours(path: Path) -> set[int]:
    """The image's colours as 0xRRGGBB."""
    from matplotlib.image import imread

    pixels = (imread(path)[:, :, :3] * 255).round().astype(np.int64)
    packed = (pixels[:, :, 0] << 16) | (pixels[:, :, 1] << 8) | pixels[:, :, 2]
    return {int(c) for c in np.unique(packed)}


def rgb(hex_colour: str) -> int:
    return int(hex_colour.lstrip("#"), 16)


def listing(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


# ------------------------------------------------------------------------------ written output


@pytest.fixture(scope="module")
def written_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("sweep")
    paths = write_outputs(sweep_summary(), root / "out", root / "elsewhere" / "wb.json")
    return root, paths


@pytest.fixture(scope="module")
def written_flat(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("flat")
    return root, write_outputs(flat_summary(), root / "out", None)


def test_sweep_writes_every_file_and_nothing_else(written_sweep: tuple[Path, list[Path]]) -> None:
    root, paths = written_sweep
    expected = {
        "summary.json",
        "results.md",
        "attainment.png",
        "throughput.png",
        "p99_latency.png",
        "attainment_batch.png",
        "attainment_interactive.png",
        "scatter.png",
    }
    assert {p.name for p in (root / "out").iterdir()} == expected
    assert {p.name for p in root.iterdir()} == {"out", "elsewhere"}  # no temp dir left
    assert [p.name for p in (root / "elsewhere").iterdir()] == ["wb.json"]
    assert set(paths) == {root / "out" / n for n in expected} | {root / "elsewhere" / "wb.json"}


def test_flat_writes_bar_charts_only(written_flat: tuple[Path, list[Path]]) -> None:
    root, paths = written_flat
    names = {"summary.json", "results.md", "attainment.png", "throughput.png"}
    assert {p.name for p in (root / "out").iterdir()} == names
    assert {p.name for p in paths} == names


def test_pngs_are_valid_and_sized(
    written_sweep: tuple[Path, list[Path]], written_flat: tuple[Path, list[Path]]
) -> None:
    pngs = [p for p in (*written_sweep[1], *written_flat[1]) if p.suffix == ".png"]
    assert len(pngs) == 8
    for path in pngs:
        assert png_size(path) == (720, 480)  # 6 x 4 in at 120 dpi
        assert path.stat().st_size > 10_000


def test_policies_keep_their_colour_in_every_plot(
    written_sweep: tuple[Path, list[Path]], written_flat: tuple[Path, list[Path]]
) -> None:
    out = written_sweep[0] / "out"
    for name in ("attainment.png", "throughput.png", "attainment_batch.png"):
        colours = png_colours(out / name)
        assert rgb(PALETTE[0]) in colours and rgb(PALETTE[1]) in colours, name
        assert rgb(PALETTE[2]) not in colours, name  # only two policies
    flat = png_colours(written_flat[0] / "out" / "throughput.png")
    assert {rgb(c) for c in PALETTE[:3]} <= flat


def test_colour_is_keyed_by_policy_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.colors import to_hex

    seen: dict[str, dict[str, str]] = {}
    real_save = report._save_figure

    def record(figure: Any, path: Path) -> Path:
        axes = figure.axes[0]
        colours = {line.get_label(): to_hex(line.get_color()) for line in axes.get_lines()}
        for bars in axes.containers:
            colours[bars.get_label()] = to_hex(bars.patches[0].get_facecolor())
        seen[path.name] = colours
        return real_save(figure, path)

    monkeypatch.setattr(report, "_save_figure", record)
    summary = sweep_summary()
    summary["policies"] = {"fcfs": summary["policies"]["fcfs"], "qlm": summary["policies"]["qlm"]}
    write_outputs(summary, tmp_path / "sweep", None)
    del seen["scatter.png"]
    assert len(seen) == 5
    for name, colours in seen.items():
        assert colours == {"fcfs": PALETTE[0], "qlm": PALETTE[1]}, name
    seen.clear()
    write_outputs(flat_summary(), tmp_path / "flat", None)
    assert sorted(seen) == ["attainment.png", "throughput.png"]
    for name, colours in seen.items():
        assert colours == {"qlm": PALETTE[0], "edf": PALETTE[1], "fcfs": PALETTE[2]}, name


def test_json_round_trips(written_sweep: tuple[Path, list[Path]]) -> None:
    root, _ = written_sweep
    assert json.loads((root / "out" / "summary.json").read_text()) == sweep_summary()
    assert json.loads((root / "elsewhere" / "wb.json").read_text()) == sweep_summary()


def test_json_is_strict_non_finite_become_null(tmp_path: Path) -> None:
    summary = flat_summary()
    summary["policies"]["qlm"]["gpu_utilisation"] = math.nan
    summary["policies"]["qlm"]["throughput_rps"] = np.float64(math.inf)
    summary["policies"]["qlm"]["evictions"] = np.int64(4)
    write_outputs(summary, None, tmp_path / "s.json")
    text = (tmp_path / "s.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    qlm = json.loads(text)["policies"]["qlm"]
    assert qlm["gpu_utilisation"] is None and qlm["throughput_rps"] is None
    assert qlm["evictions"] == 4
    assert list(tmp_path.iterdir()) == [tmp_path / "s.json"]


def test_results_md_has_context_table_misses_and_plot_links(
    written_sweep: tuple[Path, list[Path]],
) -> None:
    text = (written_sweep[0] / "out" / "results.md").read_text()
    assert text.startswith("# qlm bench sim: wb\n")
    assert "`qlm bench sim --scenario wb`" in text
    assert markdown_table(sweep_summary()) in text
    assert "R² = 0.970" in text
    assert "![scatter](scatter.png)" in text and "![attainment](attainment.png)" in text


def test_a_clairvoyant_run_says_so_everywhere() -> None:
    summary = {**sweep_summary(), "clairvoyant_max_tokens": True}
    assert "clairvoyant: every request's max_tokens is its true output length" in (
        render_console_table(summary)
    )
    text = report.results_markdown(summary)
    assert text.startswith("# qlm bench sim: wb (clairvoyant)\n")
    assert "max_tokens is its true output length" in text
    assert "clairvoyant" not in render_console_table(sweep_summary())


# ----------------------------------------------------------------------------------- tables


def test_flat_markdown_table() -> None:
    rows = table_rows(markdown_table(flat_summary()))
    header, align, *body = rows
    assert header == [
        "policy",
        "attainment (%)",
        "attainment batch (%)",
        "attainment interactive (%)",
        "throughput (req/s)",
        "GPU util (%)",
        "model swaps",
        "evictions",
        "p99 latency (s)",
        "completed/requests",
        "planner wall (s)",
        "replans",
    ]
    assert align[:2] == ["---", "---:"]
    assert body == [
        [
            "qlm",
            "93.0",
            "100.0",
            "90.0",
            "12.30",
            "71.0",
            "3",
            "10",
            "41.0",
            "990/1000",
            "1.20",
            "7",
        ],
        [
            "edf",
            MISSING,
            MISSING,
            "50.0",
            "10.00",
            "50.0",
            "12",
            "0",
            MISSING,
            "800/1000",
            "0.00",
            "0",
        ],
        [
            "fcfs",
            "50.0",
            "75.0",
            "25.0",
            "9.50",
            "40.0",
            "20",
            "0",
            "120.0",
            "700/1000",
            "0.00",
            "0",
        ],
    ]
    assert "Misses" not in markdown_table(flat_summary())


def test_sweep_markdown_table_rows_per_point_and_policy() -> None:
    text = markdown_table(sweep_summary())
    header, _, *body = table_rows(text)
    assert header[:3] == ["arrival rate (req/s)", "policy", "attainment (%)"]
    assert header[-1] == "goodput (req/s)"  # an extra numeric key gets a column
    assert [row[:2] for row in body] == [[v, p] for v in ("2", "4", "8") for p in ("qlm", "fcfs")]
    qlm_at_8 = dict(zip(header, body[4], strict=True))
    assert qlm_at_8["attainment (%)"] == "80.0"
    assert qlm_at_8["attainment interactive (%)"] == "70.0"
    assert qlm_at_8["p99 latency (s)"] == MISSING
    assert qlm_at_8["completed/requests"] == "390/400"
    assert qlm_at_8["goodput (req/s)"] == "5.20"
    assert text.endswith("\n**Misses**\n\n- wb overload: qlm - fcfs = 35 points < 40 (target)\n")


def test_markdown_escapes_pipes() -> None:
    summary = flat_summary()
    summary["policies"] = {"a|b": summary["policies"]["qlm"]}
    header, _, row = table_rows(markdown_table(summary).replace("\\|", "¦"))
    assert row[0] == "a¦b" and len(row) == len(header)


def test_console_table_is_plain_and_complete() -> None:
    text = render_console_table(sweep_summary())
    assert "\x1b[" not in text
    assert "arrival rate (req/s)" in text and "interactive %" in text
    body = [line.split() for line in text.splitlines() if line.split()[:1] in (["8"],)]
    assert [row[:3] for row in body] == [["8", "qlm", "80.0"], ["8", "fcfs", "30.0"]]
    assert MISSING in body[0]
    assert text.splitlines()[-1].strip() == "- wb overload: qlm - fcfs = 35 points < 40 (target)"
    flat = render_console_table(flat_summary())
    assert flat.splitlines()[0].startswith("mm: three models")
    assert all(name in flat for name in ("qlm", "edf", "fcfs"))


@settings(max_examples=40, deadline=None)
@given(
    policies=st.lists(
        st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4, unique=True
    ),
    classes=st.lists(st.sampled_from(["a", "b", "c"]), max_size=3, unique=True),
    points=st.integers(1, 5),
    data=st.data(),
)
def test_table_shape_for_any_sweep(
    policies: list[str], classes: list[str], points: int, data: st.DataObject
) -> None:
    metric = st.one_of(st.none(), st.floats(0, 1), st.just(math.nan))
    summary = {
        "scenario": "s",
        "sweep": {"parameter": "p", "values": list(range(points))},
        "policies": {
            p: {
                "slo_attainment": data.draw(st.lists(metric, min_size=points, max_size=points)),
                "slo_attainment_by_class": {
                    c: data.draw(st.lists(metric, min_size=points, max_size=points))
                    for c in classes
                },
                "requests": points,  # a scalar in a swept summary applies to every point
            }
            for p in policies
        },
    }
    header, _, *body = table_rows(markdown_table(summary))
    assert header[0] == "p"
    assert len(header) == 10 + len(classes)
    assert len(body) == points * len(policies)
    assert all(len(row) == len(header) for row in body)
    for row in body:
        assert row[2] == MISSING or 0.0 <= float(row[2]) <= 100.0
        assert row[-2] == f"{MISSING}" or row[-2].endswith(f"/{points}")


# ------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("key", ["scenario", "policies"])
def test_missing_top_level_key_is_named(key: str) -> None:
    summary = flat_summary()
    del summary[key]
    with pytest.raises(ValueError, match=key):
        markdown_table(summary)


def test_sweep_list_of_wrong_length_is_named(tmp_path: Path) -> None:
    summary = sweep_summary()
    summary["policies"]["fcfs"]["evictions"] = [0, 5]
    with pytest.raises(ValueError, match=r"'fcfs'\]\['evictions'\] has 2 entries.* has 3"):
        write_outputs(summary, tmp_path / "out", None)
    assert list(tmp_path.iterdir()) == []
    summary = sweep_summary()
    summary["policies"]["qlm"]["slo_attainment_by_class"]["batch"] = [1.0]
    with pytest.raises(ValueError, match=r"'slo_attainment_by_class'\]\['batch'\]"):
        validate_summary(summary)
    summary = sweep_summary()
    summary["sweep"]["variants"] = ["2", "4"]
    with pytest.raises(ValueError, match="variants"):
        render_console_table(summary)


# -------------------------------------------------------------------------- categorical sweep


def test_sweep_positions_numeric_or_categorical() -> None:
    assert sweep_positions({"values": [2, 4.5, 8]}) == ([2.0, 4.5, 8.0], None)
    assert sweep_positions({"values": [0.5, "auto", 2], "variants": ["δ=0.5", "auto", "δ=2"]}) == (
        [0.0, 1.0, 2.0],
        ["δ=0.5", "auto", "δ=2"],
    )
    assert sweep_positions({"values": [True, False]}) == ([0.0, 1.0], ["True", "False"])


def test_categorical_sweep_plots(tmp_path: Path) -> None:
    summary = sweep_summary()
    del summary["scatter"]
    # Mixed numbers and strings: matplotlib alone would refuse these as x values.
    summary["sweep"] = {"parameter": "grouping.delta", "values": [0.5, "auto", 2]}
    paths = write_outputs(summary, tmp_path / "out", None)
    assert len([p for p in paths if p.suffix == ".png"]) == 5
    assert all(png_size(p) == (720, 480) for p in paths if p.suffix == ".png")
    header, _, *body = table_rows((tmp_path / "out" / "results.md").read_text())
    assert header[0] == "grouping.delta"
    assert [row[0] for row in body[::2]] == ["0.5", "auto", "2"]


# --------------------------------------------------------------------------------- atomicity


def failing_after(calls: int, real: Any) -> Any:
    seen = {"n": 0}

    def fail(*args: Any, **kwargs: Any) -> Any:
        seen["n"] += 1
        if seen["n"] > calls:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    return fail


def test_render_failure_leaves_out_dir_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "summary.json").write_text("previous run")
    before = listing(out)
    monkeypatch.setattr(report, "_save_figure", failing_after(2, report._save_figure))
    with pytest.raises(RuntimeError, match="boom"):
        write_outputs(sweep_summary(), out, tmp_path / "x.json")
    assert listing(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp dir, no x.json


def test_render_failure_does_not_create_out_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "_scatter_plot", failing_after(0, report._scatter_plot))
    with pytest.raises(RuntimeError):
        write_outputs(sweep_summary(), tmp_path / "new", None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("moves_before_failure", [0, 3, 7])
def test_move_failure_rolls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moves_before_failure: int
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "summary.json").write_text("previous run")
    (out / "attainment.png").write_bytes(b"old png")
    (tmp_path / "x.json").write_text("old json")
    before = listing(out)
    monkeypatch.setattr(report, "_move", failing_after(moves_before_failure, report._move))
    with pytest.raises(RuntimeError, match="boom"):
        write_outputs(flat_summary(), out, tmp_path / "x.json")
    assert listing(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "x.json"]
    assert (tmp_path / "x.json").read_text() == "old json"


def test_move_failure_removes_the_out_dir_it_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "_move", failing_after(2, report._move))
    with pytest.raises(RuntimeError):
        write_outputs(flat_summary(), tmp_path / "new", None)
    assert list(tmp_path.iterdir()) == []


def test_rewrite_replaces_own_files_and_keeps_unrelated_ones(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "summary.json").write_text("previous run")
    write_outputs(flat_summary(), out, None)
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "summary.json").read_text())["scenario"] == "mm"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_refuses_to_replace_a_directory(tmp_path: Path) -> None:
    (tmp_path / "x.json").mkdir()
    (tmp_path / "x.json" / "keep").write_text("k")
    with pytest.raises(IsADirectoryError):
        write_outputs(flat_summary(), None, tmp_path / "x.json")
    assert (tmp_path / "x.json" / "keep").read_text() == "k"
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_importing_the_module_does_not_import_matplotlib() -> None:
    import subprocess
    import sys

    code = "import sys, qlm.tooling.simulator.report; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr
