"""``qlm bench sim``: run a named scenario (or a scenario file) through the cluster simulator for
every policy, print the table, write JSON / Markdown / plots. The CLI passes the policy factory
(``planner``), so this module stays inside qlm's core."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from qlm.tooling.simulator.presets import PRESETS, Preset
from qlm.tooling.simulator.report import (
    aggregate_seeds,
    render_console_table,
    scatter_line,
    scatters,
    write_outputs,
)
from qlm.tooling.simulator.runner import PolicyFactory, PolicyVariant, r_squared, run_scenario
from qlm.tooling.simulator.scenario import ScenarioSpec, load_scenario
from qlm.tooling.simulator.targets import evaluate


def resolve(scenario: str | None, file: Path | None) -> tuple[ScenarioSpec, Preset | None]:
    if (scenario is None) == (file is None):
        raise ValueError("give exactly one of --scenario NAME or --file PATH")
    if file is not None:
        return load_scenario(file), None
    assert scenario is not None
    preset = PRESETS.get(scenario)
    if preset is None:
        raise ValueError(f"unknown scenario {scenario!r}; known: {sorted(PRESETS)}")
    return preset.spec(), preset


def dump(spec: ScenarioSpec) -> str:
    # unicode kept: the shipped scenario files are this output, and "δ" reads better than "\u03B4"
    return yaml.safe_dump(
        spec.model_dump(mode="json", exclude_none=True), sort_keys=False, allow_unicode=True
    )


def run_sim_bench(
    spec: ScenarioSpec,
    preset: Preset | None,
    factory: PolicyFactory,
    *,
    command: str,
    policies: list[str] | None = None,
    out_dir: Path | None = None,
    json_path: Path | None = None,
    echo: Callable[[str], None] = print,
    show_progress: bool = True,
    seeds: list[int] | None = None,
) -> dict[str, Any]:
    """Run every column at every point, once per seed (``seeds``, else the scenario's
    ``seeds``, else its single ``seed``); over several seeds the summary holds the mean and
    the sample sd (:func:`qlm.tooling.simulator.report.aggregate_seeds`)."""
    overrides = preset.policy_overrides if preset else {}
    names = policies or list(spec.policies)
    variants = [PolicyVariant(p, p, overrides.get(p, {})) for p in names]
    if preset is not None and preset.variants is not None and not policies:
        variants = preset.variants()
    run_seeds = list(seeds) if seeds else spec.run_seeds()
    if len(set(run_seeds)) != len(run_seeds) or min(run_seeds) < 0:
        raise ValueError(f"seeds must be distinct and >= 0, got {run_seeds}")
    started = time.perf_counter()
    summaries = []
    with _ProgressBar(show_progress) as progress:
        for seed in run_seeds:
            tagged = progress
            if progress is not None and len(run_seeds) > 1:
                tagged = _tag_progress(progress, f"seed {seed}")
            summaries.append(
                run_scenario(
                    spec.with_seed(seed),
                    factory,
                    command=command,
                    variants=variants,
                    policy_sweep=preset.policy_sweep() if preset and preset.policy_sweep else None,
                    record_estimates=bool(preset and preset.record_estimates),
                    progress=tagged,
                )
            )
    summary = summaries[0] if len(summaries) == 1 else _combine(summaries, run_seeds)
    wall = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    summary["run"] = {"wall_s": round(wall, 1), "peak_rss_mb": round(peak_mb)}
    if preset is not None:
        summary["targets"] = preset.targets
        evaluate(summary)
    echo(render_console_table(summary))
    for check in summary.get("checks", []):
        echo(f"[{'met ' if check['met'] else 'MISS'}] {check['target']}: {check['measured']}")
    echo(f"wall {wall:.1f} s, peak RSS {peak_mb:.0f} MB")
    for scatter in scatters(summary):
        echo(scatter_line(scatter))
    if out_dir is not None or json_path is not None:
        for path in write_outputs(summary, out_dir, json_path):
            echo(f"wrote {path}")
    return summary


def _tag_progress(progress: Callable[[str, float], None], tag: str) -> Callable[[str, float], None]:
    return lambda name, fraction: progress(f"{name} ({tag})", fraction)


def _combine(summaries: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """The seeds' summaries as one: metrics averaged; each RCT scatter pooled over seeds;
    SABER's speed fits those of the first seed."""
    summary = aggregate_seeds(summaries, seeds)
    heads = [s["scatter"] for s in summaries if "scatter" in s]
    if heads:
        summary["scatter"] = _pooled(heads)
    named: dict[str, list[dict[str, Any]]] = {}
    for s in summaries:
        for sc in s.get("scatters", []):
            named.setdefault(sc["name"], []).append(sc)
    if named:
        summary["scatters"] = [_pooled(group) for group in named.values()]
    return summary


def _pooled(scatters: list[dict[str, Any]]) -> dict[str, Any]:
    """One scatter of several seeds' points, its R² over all of them."""
    pooled = dict(scatters[0])
    pooled["x"] = [x for sc in scatters for x in sc["x"]]
    pooled["y"] = [y for sc in scatters for y in sc["y"]]
    pooled["r2"] = r_squared(pooled["x"], pooled["y"])
    return pooled


class _ProgressBar:
    """A rich progress bar on stderr, one task per simulated run (quiet when not a TTY)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> Callable[[str, float], None] | None:
        if not self.enabled:
            return None
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            transient=False,
        )
        self._bar.start()
        return self._update

    def _update(self, name: str, fraction: float) -> None:
        task = self._tasks.get(name)
        if task is None:
            task = self._tasks[name] = self._bar.add_task(name, total=1.0)
        self._bar.update(task, completed=fraction)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
