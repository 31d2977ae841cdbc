"""Tables and plots of the ``capacity`` scenario (``qlm bench sim --scenario capacity``).

Works on the summary dict ``qlm.tooling.capacity.sim.run_capacity_scenario`` returns, so
it needs
nothing from the planner: per policy ``instance_hours``, ``scaling_waste_hours``,
``p95_latency_s``, ``p95_ttft_s``, ``slo_attainment`` and the rest of the simulator's metrics;
``timelines`` (instances live and starting, arrival rate and EMU every 5 simulated minutes);
``checks`` (issue 8's targets).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qlm.tooling.simulator.report import FIGURE_DPI, policy_colours, summary_json

COLUMNS: list[tuple[str, str, str]] = [
    ("instance_hours", "instance-h", "{:.1f}"),
    ("scaling_waste_hours", "starting (h)", "{:.2f}"),
    ("instances_started", "started", "{:d}"),
    ("peak_instances", "peak", "{:d}"),
    ("slo_attainment", "SLO (%)", "pct"),
    ("p95_latency_s", "p95 e2e (s)", "{:.1f}"),
    ("p95_ttft_s", "p95 TTFT (s)", "{:.2f}"),
    ("p50_latency_s", "p50 e2e (s)", "{:.1f}"),
    ("gpu_utilisation", "GPU util (%)", "pct"),
    ("completed", "completed", "{:d}"),
    ("sim_wall_s", "sim wall (s)", "{:.1f}"),
]


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "pct":
        return f"{100 * float(value):.1f}"
    try:
        return fmt.format(int(value) if fmt == "{:d}" else float(value))
    except (TypeError, ValueError):
        return str(value)


def capacity_table(summary: Mapping[str, Any]) -> str:
    head = ["policy", *(label for _, label, _ in COLUMNS)]
    rows = [
        [name, *(_cell(metrics.get(key), fmt) for key, _, fmt in COLUMNS)]
        for name, metrics in summary["policies"].items()
    ]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def capacity_markdown(summary: Mapping[str, Any], plots: list[str]) -> str:
    out = [f"# qlm bench sim: {summary['scenario']}", "", summary.get("description", ""), ""]
    if summary.get("command"):
        out.append(f"- command: `{summary['command']}`")
    out.append(f"- seed: {summary.get('seed')}; requests: {summary.get('requests')}")
    for model, prof in summary.get("profiles", {}).items():
        out.append(
            f"- profile of {model}: {prof['rps_at_slo']} req/s per instance at the SLO "
            f"(θ = {prof['tpm']} input tokens/min, {prof['gpus']} GPUs per instance), "
            f"{prof['initial_instances']} instance(s) at t = 0"
        )
    out.append(f"- wall: {summary.get('wall_s')} s")
    out += ["", capacity_table(summary), ""]
    checks = summary.get("checks") or []
    if checks:
        out.append("## Targets")
        out.append("")
        for c in checks:
            out.append(f"- [{'met' if c['met'] else 'MISS'}] {c['target']}: {c['measured']}")
        out.append("")
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(out) + "\n"


def capacity_plots(summary: Mapping[str, Any], dest: Path) -> list[Path]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colours = policy_colours(summary)
    paths = []
    figure = Figure(figsize=(9, 6), dpi=FIGURE_DPI)
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True)
    rate_drawn = False
    for name, points in summary.get("timelines", {}).items():
        if not points:
            continue
        t = [p["t_h"] for p in points]
        top.step(
            t,
            [p["live"] + p["starting"] for p in points],
            where="post",
            color=colours[name],
            label=name,
        )
        if not rate_drawn:
            bottom.plot(t, [p["arrival_rps"] for p in points], color="black")
            rate_drawn = True
    top.set_ylabel("instances (live + starting)")
    top.set_title(f"{summary['scenario']}: instances over the day")
    top.grid(True, alpha=0.3)
    top.legend(title="policy")
    bottom.set_ylabel("arrivals (req/s, 5-min mean)")
    bottom.set_xlabel("hour")
    bottom.grid(True, alpha=0.3)
    figure.tight_layout()
    path = dest / "instances.png"
    figure.savefig(path, format="png", dpi=FIGURE_DPI)
    paths.append(path)

    figure = Figure(figsize=(9, 4), dpi=FIGURE_DPI)
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    names = list(summary["policies"])
    left.bar(
        names,
        [summary["policies"][n]["instance_hours"] for n in names],
        color=[colours[n] for n in names],
    )
    left.set_title("instance-hours")
    right.bar(
        names,
        [summary["policies"][n].get("p95_latency_s") or 0 for n in names],
        color=[colours[n] for n in names],
    )
    right.set_title("p95 end-to-end latency (s)")
    figure.tight_layout()
    path = dest / "instance_hours.png"
    figure.savefig(path, format="png", dpi=FIGURE_DPI)
    paths.append(path)
    return paths


def write_capacity_outputs(
    summary: Mapping[str, Any], out_dir: Path | None, json_path: Path | None
) -> list[Path]:
    written = []
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(summary_json(summary))
        written.append(json_path)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        plots = capacity_plots(summary, out_dir)
        (out_dir / "summary.json").write_text(summary_json(summary))
        (out_dir / "results.md").write_text(capacity_markdown(summary, [p.name for p in plots]))
        written += [out_dir / "summary.json", out_dir / "results.md", *plots]
    return written
