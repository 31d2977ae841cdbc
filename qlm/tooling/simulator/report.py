"""Output of ``qlm bench sim``: the summary as JSON, a Markdown table, a console table, PNG plots.

The summary (built by :func:`qlm.tooling.simulator.runner.run_scenario`) is a JSON-ready dict::

    {"scenario": str, "description": str, "command": str, "seed": int,
     "clairvoyant_max_tokens": bool,  # max_tokens was the true output (labelled everywhere)
     "sweep": None | {"parameter": str, "label": str, "values": [...], "variants": [str, ...]},
     "policies": {name: {metric: value, "slo_attainment_by_class": {class: value}}},
     "scatter": {"title", "x_label", "y_label", "x": [...], "y": [...], "r2"},   # optional
     "scatters": [{"name", "point", "estimate", ...as "scatter"}, ...],         # optional
     "misses": [str, ...]}                                                     # optional

``"scatter"`` is the ``rct`` target's figure: the estimates made at dispatch against the
simulated completions, at the first sweep point; ``"scatters"`` the other estimates of the run
(the last plan's before dispatch, and those at the other points), each with its R².

``"hindsight"`` (qlm/tooling/simulator/hindsight.py) holds the upper bound on attainment at each
point:
``slo_attainment``, ``met``, ``requests``, ``lp_value``, ``solo_infeasible``, ``unconstrained``
and the LP's sizes and times under ``lp``.

Without a sweep every metric is a scalar; with one, a list aligned with ``sweep["values"]``.
A run over several seeds (:func:`aggregate_seeds`) holds the mean over seeds in ``policies``,
the sample standard deviation in ``sd`` (same shape) and each seed's ``policies`` in
``per_seed``; tables then show ``mean ± sd``. The hindsight bound keeps its own ``sd`` and
``per_seed`` inside ``"hindsight"``.
Metrics may be ``None`` (or NaN): tables show "–", plots leave a gap, the JSON says ``null``.

:func:`write_outputs` is all-or-nothing: everything is rendered into a temporary directory next
to the destination (same filesystem), then moved into place with ``os.replace``; a failure at
any point restores the files it had replaced and leaves no file of the run behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import tempfile
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = structlog.get_logger(__name__)

MISSING = "–"
BY_CLASS = "slo_attainment_by_class"
HINDSIGHT = "hindsight"  # summary["hindsight"]: the upper bound on attainment (hindsight.py)
SUMMARY_JSON = "summary.json"
RESULTS_MD = "results.md"
# matplotlib's tab10, fixed here so that a policy keeps its colour (by its position among the
# summary's policies) in every plot of a run.
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
CLAIRVOYANT_LABEL = "clairvoyant: every request's max_tokens is its true output length"
FIGURE_SIZE_IN = (6.0, 4.0)
FIGURE_DPI = 120


# --------------------------------------------------------------------------------- validation


def validate_summary(summary: Mapping[str, Any]) -> None:
    """Raise ValueError naming the offending key when the summary cannot be rendered."""
    for key in ("scenario", "policies"):
        if key not in summary:
            raise ValueError(f"summary has no {key!r}")
    policies = summary["policies"]
    if not isinstance(policies, Mapping):
        raise ValueError("summary['policies'] must map policy names to their metrics")
    for name, entry in policies.items():
        if not isinstance(entry, Mapping):
            raise ValueError(f"summary['policies'][{name!r}] must be a mapping of metrics")
        by_class = entry.get(BY_CLASS, {})
        if not isinstance(by_class, Mapping):
            raise ValueError(f"summary['policies'][{name!r}][{BY_CLASS!r}] must be a mapping")
    _validate_sweep(summary)
    _validate_scatter(summary)


def _validate_sweep(summary: Mapping[str, Any]) -> None:
    sweep = summary.get("sweep")
    if sweep is None:
        return
    if not isinstance(sweep, Mapping) or not _is_list(sweep.get("values")):
        raise ValueError("summary['sweep']['values'] must be a list")
    n = len(sweep["values"])
    variants = sweep.get("variants")
    if variants is not None and (not _is_list(variants) or len(variants) != n):
        raise ValueError(
            f"summary['sweep']['variants'] must be a list of {n} labels, like 'values'"
        )
    for name, entry in summary["policies"].items():
        for key, value in entry.items():
            if key == BY_CLASS:
                for cls, per_point in value.items():
                    _check_length(per_point, n, f"summary['policies'][{name!r}][{key!r}][{cls!r}]")
            else:
                _check_length(value, n, f"summary['policies'][{name!r}][{key!r}]")


def _check_length(value: Any, n: int, where: str) -> None:
    if _is_list(value) and len(value) != n:
        raise ValueError(f"{where} has {len(value)} entries, summary['sweep']['values'] has {n}")


def _validate_scatter(summary: Mapping[str, Any]) -> None:
    extra = summary.get("scatters")
    if extra is not None and not _is_list(extra):
        raise ValueError("summary['scatters'] must be a list of scatters")
    named = [("summary['scatter']", summary.get("scatter"))]
    named += [(f"summary['scatters'][{k}]", sc) for k, sc in enumerate(extra or ())]
    for where, scatter in named:
        if scatter is None:
            continue
        if not isinstance(scatter, Mapping) or not (
            _is_list(scatter.get("x")) and _is_list(scatter.get("y"))
        ):
            raise ValueError(f"{where} needs lists 'x' and 'y'")
        if len(scatter["x"]) != len(scatter["y"]):
            raise ValueError(f"{where}['x'] and ['y'] differ in length")


def scatters(summary: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The summary's scatters: ``scatter`` (the target's), then ``scatters``."""
    out = [summary["scatter"]] if isinstance(summary.get("scatter"), Mapping) else []
    extra = summary.get("scatters")
    if isinstance(extra, list | tuple):
        out += [sc for sc in extra if isinstance(sc, Mapping)]
    return out


def scatter_line(scatter: Mapping[str, Any]) -> str:
    """``title: R² = 0.951 over 7,169 requests``."""
    n = len(scatter["x"]) if _is_list(scatter.get("x")) else 0
    title = scatter.get("title") or "scatter"
    return f"{title}: R² = {_r2_text(scatter.get('r2'))} over {n:,} requests"


def _is_list(value: Any) -> bool:
    return isinstance(value, list | tuple)


def _number(value: Any) -> float | None:
    """The value as a finite float; None for None, NaN, infinities, booleans and non-numbers."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


# ------------------------------------------------------------------------------ several seeds


def _mean_sd(values: Sequence[Any]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the finite numbers among ``values``."""
    xs = [x for x in (_number(v) for v in values) if x is not None]
    if not xs:
        return None, None
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return mean, None
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def _aggregate_metric(values: Sequence[Any]) -> tuple[Any, Any]:
    """(mean, sd) of one metric over seeds, point by point when it is a sweep's list; a
    non-numeric value is the first seed's, with no sd."""
    first = values[0]
    if _is_list(first):
        pairs = [_aggregate_metric([v[k] for v in values]) for k in range(len(first))]
        return [m for m, _ in pairs], [d for _, d in pairs]
    if not all(_is_numeric_cell(v) for v in values):
        return first, None
    return _mean_sd(values)


def aggregate_seeds(summaries: Sequence[Mapping[str, Any]], seeds: Sequence[int]) -> dict:
    """One summary from runs of the same scenario and columns over ``seeds``: the first run's
    keys, every metric the mean over seeds (``sd``: the sample standard deviation, ``None``
    for one seed or a metric with fewer than two values), ``per_seed``: each run's policies."""
    if not summaries or len(summaries) != len(seeds):
        raise ValueError("aggregate_seeds needs one summary per seed")
    out = dict(summaries[0])
    out["seed"] = seeds[0]
    out["seeds"] = list(seeds)
    policies: dict[str, dict[str, Any]] = {}
    spread: dict[str, dict[str, Any]] = {}
    for name, entry in summaries[0]["policies"].items():
        runs = [s["policies"][name] for s in summaries]
        mean_entry: dict[str, Any] = {}
        sd_entry: dict[str, Any] = {}
        for key, value in entry.items():
            if key == BY_CLASS or (isinstance(value, Mapping) and key.endswith("_by_class")):
                mean_entry[key], sd_entry[key] = {}, {}
                for cls in value:
                    m, d = _aggregate_metric([r.get(key, {}).get(cls) for r in runs])
                    mean_entry[key][cls], sd_entry[key][cls] = m, d
                continue
            mean_entry[key], sd_entry[key] = _aggregate_metric([r.get(key) for r in runs])
        policies[name], spread[name] = mean_entry, sd_entry
    out["policies"] = policies
    out["sd"] = spread
    out["per_seed"] = {str(seed): s["policies"] for seed, s in zip(seeds, summaries, strict=True)}
    bounds = [s.get(HINDSIGHT) for s in summaries]
    if all(isinstance(b, Mapping) for b in bounds):
        out[HINDSIGHT] = _aggregate_hindsight(bounds, seeds)
    return out


def _aggregate_hindsight(bounds: Sequence[Any], seeds: Sequence[int]) -> dict[str, Any]:
    """The seeds' hindsight bounds: numbers as mean over seeds, ``sd`` the sample standard
    deviation, ``per_seed`` each seed's entry; the LP sizes of the first seed."""
    mean: dict[str, Any] = {}
    sd: dict[str, Any] = {}
    for key, value in bounds[0].items():
        if key == "lp":
            mean[key] = value
            continue
        mean[key], sd[key] = _aggregate_metric([b.get(key) for b in bounds])
    mean["sd"] = sd
    mean["per_seed"] = {str(seed): dict(b) for seed, b in zip(seeds, bounds, strict=True)}
    return mean


# ------------------------------------------------------------------------------------- tables


def _percent(value: Any) -> str:
    x = _number(value)
    return MISSING if x is None else f"{x * 100:.1f}"


def _fixed(decimals: int) -> Callable[[Any], str]:
    def fmt(value: Any) -> str:
        x = _number(value)
        return MISSING if x is None else f"{x:.{decimals}f}"

    return fmt


def _count(value: Any) -> str:
    x = _number(value)
    if x is None:
        return MISSING
    return str(int(x)) if x.is_integer() else f"{x:.1f}"


def _general(value: Any) -> str:
    x = _number(value)
    if x is None:
        return MISSING
    return str(int(x)) if isinstance(value, int) else f"{x:.3g}"


@dataclass(frozen=True)
class _Column:
    key: str
    header: str
    compact: str  # the console table's shorter header
    fmt: Callable[[Any], str]


_LEADING = (_Column("slo_attainment", "attainment (%)", "att %", _percent),)
_TRAILING = (
    _Column("throughput_rps", "throughput (req/s)", "req/s", _fixed(2)),
    _Column("gpu_utilisation", "GPU util (%)", "gpu %", _percent),
    _Column("model_swaps", "model swaps", "swaps", _count),
    _Column("evictions", "evictions", "evict", _count),
    _Column("p99_latency_s", "p99 latency (s)", "p99 s", _fixed(1)),
)
_PLANNER = _Column("planner_wall_s", "planner wall (s)", "plan s", _fixed(2))
# completed/requests share one column; the by-class dict gets one column per class.
_KNOWN_KEYS = {c.key for c in (*_LEADING, *_TRAILING, _PLANNER)} | {
    "completed",
    "requests",
    BY_CLASS,
}


def _extra_column(key: str) -> _Column:
    """A column for a metric this module does not know, formatted by its name's suffix."""
    if key.endswith("_latency_s"):
        base, unit, fmt = key[: -len("_s")], "s", _fixed(1)
    elif key.endswith("_s"):
        base, unit, fmt = key[: -len("_s")], "s", _fixed(2)
    elif key.endswith("_rps"):
        base, unit, fmt = key[: -len("_rps")], "req/s", _fixed(2)
    elif "utilisation" in key or "attainment" in key:
        base, unit, fmt = key, "%", _percent
    else:
        base, unit, fmt = key, "", _general
    label = base.replace("_", " ")
    header = f"{label} ({unit})" if unit else label
    return _Column(key, header, header, fmt)


def _is_numeric_cell(value: Any) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def _extra_keys(summary: Mapping[str, Any]) -> list[str]:
    """Numeric metrics beyond the known ones, in the order they first appear; a metric no
    policy has at any point (None everywhere, e.g. task attainment without programs) gets no
    column."""
    keys: list[str] = []
    present: set[str] = set()
    for entry in summary["policies"].values():
        for key, value in entry.items():
            if key in _KNOWN_KEYS:
                continue
            values = value if _is_list(value) else [value]
            if not all(_is_numeric_cell(v) for v in values):
                continue
            if key not in keys:
                keys.append(key)
            if any(v is not None for v in values):
                present.add(key)
    return [k for k in keys if k in present]


def _classes(summary: Mapping[str, Any]) -> list[str]:
    found: set[str] = set()
    for entry in summary["policies"].values():
        found.update(str(c) for c in entry.get(BY_CLASS, {}))
    return sorted(found)


def _at(value: Any, point: int | None) -> Any:
    """A metric at one sweep point (a scalar in a swept summary applies to every point)."""
    if point is not None and _is_list(value):
        return value[point]
    return value


def _point_labels(sweep: Mapping[str, Any]) -> list[str]:
    variants = sweep.get("variants")
    if variants is not None:
        return [str(v) for v in variants]
    return [str(v) for v in sweep["values"]]


@dataclass(frozen=True)
class _Table:
    headers: list[str]
    label_columns: int  # the leading text columns (sweep point, policy); the rest are numbers
    rows: list[list[str]]


def _build_table(summary: Mapping[str, Any], *, compact: bool) -> _Table:
    validate_summary(summary)
    classes = _classes(summary)
    extras = [] if compact else [_extra_column(k) for k in _extra_keys(summary)]
    sweep = summary.get("sweep")
    labels = ["policy"]
    if sweep is not None:
        labels.insert(0, str(sweep.get("label") or sweep.get("parameter") or "sweep"))
    bound = summary.get(HINDSIGHT)
    bound = bound if isinstance(bound, Mapping) else None
    headers = [
        *labels,
        *(c.compact if compact else c.header for c in _LEADING),
        *([("bound %" if compact else "hindsight bound (%)")] if bound is not None else []),
        *(f"{cls} %" if compact else f"attainment {cls} (%)" for cls in classes),
        *(c.compact if compact else c.header for c in _TRAILING),
        "done/req" if compact else "completed/requests",
        _PLANNER.compact if compact else _PLANNER.header,
        *(c.header for c in extras),
    ]

    sd_given = summary.get("sd")
    spread: Mapping[str, Any] = sd_given if isinstance(sd_given, Mapping) else {}

    def cells(name: str, entry: Mapping[str, Any], point: int | None) -> list[str]:
        by_class = entry.get(BY_CLASS, {})
        by_class_str = {str(k): v for k, v in by_class.items()}
        sd = spread.get(name, {})
        sd_class = {str(k): v for k, v in sd.get(BY_CLASS, {}).items()}
        completed = _count(_at(entry.get("completed"), point))
        requests = _count(_at(entry.get("requests"), point))

        def cell(fmt: Callable[[Any], str], value: Any, dev: Any) -> str:
            return _with_sd(fmt, _at(value, point), _at(dev, point))

        bound_cells = []
        if bound is not None:  # the same for every policy at a point: what none can beat
            given = bound.get("sd")
            bound_sd: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
            bound_cells = [
                cell(_percent, bound.get("slo_attainment"), bound_sd.get("slo_attainment"))
            ]
        return [
            *(cell(c.fmt, entry.get(c.key), sd.get(c.key)) for c in _LEADING),
            *bound_cells,
            *(cell(_percent, by_class_str.get(cls), sd_class.get(cls)) for cls in classes),
            *(cell(c.fmt, entry.get(c.key), sd.get(c.key)) for c in _TRAILING),
            MISSING if MISSING in (completed, requests) else f"{completed}/{requests}",
            _PLANNER.fmt(_at(entry.get(_PLANNER.key), point)),
            *(cell(c.fmt, entry.get(c.key), sd.get(c.key)) for c in extras),
        ]

    policies = summary["policies"]
    rows: list[list[str]] = []
    if sweep is None:
        rows = [[str(name), *cells(name, entry, None)] for name, entry in policies.items()]
    else:
        for point, label in enumerate(_point_labels(sweep)):
            rows += [
                [label, str(name), *cells(name, entry, point)] for name, entry in policies.items()
            ]
    return _Table(headers, len(labels), rows)


def _with_sd(fmt: Callable[[Any], str], value: Any, sd: Any) -> str:
    """``mean ± sd`` when a spread over seeds is known, else the value alone."""
    text = fmt(value)
    if _number(sd) is None or text == MISSING:
        return text
    return f"{text} ± {fmt(sd)}"


def _misses(summary: Mapping[str, Any]) -> list[str]:
    misses = summary.get("misses")
    return [str(m) for m in misses] if isinstance(misses, list | tuple) else []


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(summary: Mapping[str, Any]) -> str:
    """A GitHub table (one row per policy, or per sweep value × policy), then the misses."""
    table = _build_table(summary, compact=False)
    align = ["---"] * table.label_columns + ["---:"] * (len(table.headers) - table.label_columns)
    lines = [
        "| " + " | ".join(_md_cell(h) for h in table.headers) + " |",
        "| " + " | ".join(align) + " |",
        *("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table.rows),
    ]
    misses = _misses(summary)
    if misses:
        lines += ["", "**Misses**", "", *(f"- {_md_cell(m)}" for m in misses)]
    return "\n".join(lines) + "\n"


def speed_model_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    """SABER columns: the USL fit of f(L) each used (column, point, instance, model, how it
    was profiled, lam, sigma, kappa, R², points), from ``summary["speed_models"]``."""
    rows: list[list[str]] = []
    models = summary.get("speed_models")
    if not isinstance(models, Mapping):
        return rows
    for column, per_point in models.items():
        for point, per_instance in per_point.items():
            for iid, per_model in per_instance.items():
                for model, fit in per_model.items():
                    rows.append(
                        [
                            str(column),
                            str(point),
                            str(iid),
                            str(model),
                            str(fit.get("method", "")),
                            _fixed(1)(fit.get("lam")),
                            _fixed(4)(fit.get("sigma")),
                            _general(fit.get("kappa")),
                            _fixed(3)(fit.get("r_squared")),
                            _count(fit.get("points")),
                            _expected_output(fit.get("expected_output_tokens")),
                        ]
                    )
    return rows


SPEED_MODEL_HEADERS = [
    "column",
    "point",
    "instance",
    "model",
    "profiled by",
    "λ (tok/s)",
    "σ",
    "κ",
    "R²",
    "points",
    "maxTokens",
]


def _expected_output(expected: Any) -> str:
    """A SABER column's maxTokens reading: each task's mean output, or the requests' own."""
    if not isinstance(expected, Mapping) or not expected:
        return "max_tokens"
    return ", ".join(f"{k} {v:g}" for k, v in expected.items())


def render_console_table(summary: Mapping[str, Any]) -> str:
    """A compact plain-text table for the terminal (no colour codes), then the misses."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = _build_table(summary, compact=True)
    title = str(summary["scenario"])
    if summary.get("clairvoyant_max_tokens"):
        title += f" [{CLAIRVOYANT_LABEL}]"
    if summary.get("description"):
        title += f": {summary['description']}"
    rich_table = Table(title=Text(title), box=box.SIMPLE_HEAD, title_justify="left")
    for i, header in enumerate(table.headers):
        rich_table.add_column(Text(header), justify="left" if i < table.label_columns else "right")
    for row in table.rows:
        rich_table.add_row(*(Text(c) for c in row))
    # Wide enough that rich never wraps a cell; it does not pad a table to the console's width.
    widths = [max([len(h), *(len(r[i]) for r in table.rows)]) for i, h in enumerate(table.headers)]
    buffer = io.StringIO()
    console = Console(file=buffer, width=max(80, sum(widths) + 3 * len(widths) + 4), no_color=True)
    console.print(rich_table)
    lines = [line.rstrip() for line in buffer.getvalue().splitlines()]
    fits = speed_model_rows(summary)
    if fits:
        lines += ["SABER f(L) = lam / (1 + sigma (L-1) + kappa L (L-1)), USL fits:"]
        lines += [
            "  " + " ".join(f"{h}={c}" for h, c in zip(SPEED_MODEL_HEADERS, r, strict=True))
            for r in fits
        ]
    misses = _misses(summary)
    if misses:
        lines += ["misses:", *(f"  - {m}" for m in misses)]
    return "\n".join(lines).strip("\n")


def results_markdown(summary: Mapping[str, Any], plots: Sequence[str] = ()) -> str:
    """The ``results.md`` document: what ran, the table, the misses, links to the plots."""
    lines = [f"# qlm bench sim: {summary['scenario']}", ""]
    if summary.get("clairvoyant_max_tokens"):
        lines[0] += " (clairvoyant)"
    if summary.get("description"):
        lines += [str(summary["description"]), ""]
    if summary.get("clairvoyant_max_tokens"):
        lines += [f"**{CLAIRVOYANT_LABEL}**: not what a real client can send.", ""]
    if summary.get("command"):
        lines.append(f"- command: `{summary['command']}`")
    seeds = summary.get("seeds")
    if isinstance(seeds, list | tuple) and len(seeds) > 1:
        listed = ", ".join(str(x) for x in seeds)
        lines.append(f"- seeds: {listed} (every figure: mean ± sample sd over the seeds)")
    elif summary.get("seed") is not None:
        lines.append(f"- seed: {summary['seed']}")
    sweep = summary.get("sweep")
    if sweep is not None:
        label = sweep.get("label") or sweep.get("parameter")
        lines.append(f"- sweep: {label} (`{sweep.get('parameter')}`)")
    if isinstance(summary.get(HINDSIGHT), Mapping):
        lines.append(
            "- hindsight bound: no scheduler, even one knowing every output length, could have "
            "met more than this share of the requests (an LP relaxation, docs/simulator.md)"
        )
    if isinstance(summary.get("targets"), str):
        lines.append(f"- targets: {summary['targets']}")
    lines += [f"- {scatter_line(sc)}" for sc in scatters(summary)]
    run = summary.get("run")
    if isinstance(run, Mapping):
        lines.append("- run: " + ", ".join(f"{k} = {v}" for k, v in run.items()))
    lines += ["", markdown_table(summary).rstrip("\n")]
    fits = speed_model_rows(summary)
    if fits:
        lines += [
            "",
            "## SABER's speed model",
            "",
            "f(L) = λ / (1 + σ (L − 1) + κ L (L − 1)), fitted (USL) to a profiling of the "
            "simulated engine before each run; R² on the profiled points.",
            "",
            "| " + " | ".join(SPEED_MODEL_HEADERS) + " |",
            "| " + " | ".join(["---"] * 5 + ["---:"] * 5 + ["---"]) + " |",
            *("| " + " | ".join(_md_cell(c) for c in r) + " |" for r in fits),
        ]
    if plots:
        lines += ["", "## Plots", "", *(f"![{Path(p).stem}]({p})" for p in plots)]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------- plots


def policy_colours(summary: Mapping[str, Any]) -> dict[str, str]:
    """Each policy's colour: the palette, in the order the policies appear in the summary."""
    return {str(name): PALETTE[i % len(PALETTE)] for i, name in enumerate(summary["policies"])}


def sweep_positions(sweep: Mapping[str, Any]) -> tuple[list[float], list[str] | None]:
    """x positions of the sweep points, and tick labels when the values are not all numbers
    (then the points sit at 0, 1, 2, ... labelled with the variants)."""
    values = list(sweep["values"])
    numbers = [_number(v) for v in values]
    if values and all(x is not None for x in numbers):
        return [x for x in numbers if x is not None], None
    return [float(i) for i in range(len(values))], _point_labels(sweep)


def _series(value: Any, n: int, scale: float = 1.0) -> list[float]:
    """A metric over the sweep's n points as floats, NaN where missing (a gap in the line)."""
    points = list(value) if _is_list(value) else [value] * n
    out = []
    for v in points:
        x = _number(v)
        out.append(math.nan if x is None else x * scale)
    return out


def _plot_name(summary: Mapping[str, Any]) -> str:
    name = str(summary["scenario"])
    return f"{name} (clairvoyant)" if summary.get("clairvoyant_max_tokens") else name


def _new_axes(title: str) -> tuple[Figure, Axes]:
    # The Agg canvas is attached to a bare Figure: no pyplot, so no global backend switch and
    # no figure registry to leak into; importing matplotlib here keeps importing us cheap.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.set_title(title)
    return figure, axes


def _save_figure(figure: Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=FIGURE_DPI)
    return path


def _file_stems(classes: Sequence[str]) -> dict[str, str]:
    """A filename-safe, distinct stem per class."""
    stems: dict[str, str] = {}
    for cls in classes:
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", cls).strip("._") or "class"
        candidate, k = stem, 2
        while candidate in stems.values():
            candidate, k = f"{stem}_{k}", k + 1
        stems[cls] = candidate
    return stems


def _sweep_line_plot(
    path: Path,
    summary: Mapping[str, Any],
    title: str,
    y_label: str,
    series: Mapping[str, list[float]],
    *,
    percent: bool = False,
    bound: list[float] | None = None,
) -> Path:
    sweep = summary["sweep"]
    x, ticks = sweep_positions(sweep)
    colours = policy_colours(summary)
    figure, axes = _new_axes(f"{_plot_name(summary)}: {title}")
    for name, ys in series.items():
        axes.plot(x, ys, marker="o", color=colours[name], label=name)
    if bound is not None:
        axes.plot(x, bound, linestyle="--", color="black", label="hindsight bound")
    if ticks is not None:
        axes.set_xticks(x, labels=ticks)
    axes.set_xlabel(str(sweep.get("label") or sweep.get("parameter") or "sweep"))
    axes.set_ylabel(y_label)
    if percent:
        axes.set_ylim(0, 105)
    else:
        axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(title="policy")
    return _save_figure(figure, path)


def _bound_series(summary: Mapping[str, Any], n: int) -> list[float] | None:
    bound = summary.get(HINDSIGHT)
    if not isinstance(bound, Mapping):
        return None
    return _series(bound.get("slo_attainment"), n, 100.0)


def _sweep_plots(summary: Mapping[str, Any], dest: Path) -> list[Path]:
    n = len(summary["sweep"]["values"])
    policies = {str(k): v for k, v in summary["policies"].items()}

    def metric(key: str, scale: float = 1.0) -> dict[str, list[float]]:
        return {name: _series(entry.get(key), n, scale) for name, entry in policies.items()}

    paths = [
        _sweep_line_plot(
            dest / "attainment.png",
            summary,
            "SLO attainment",
            "SLO attainment (%)",
            metric("slo_attainment", 100.0),
            percent=True,
            bound=_bound_series(summary, n),
        ),
        _sweep_line_plot(
            dest / "throughput.png",
            summary,
            "throughput",
            "throughput (req/s)",
            metric("throughput_rps"),
        ),
        _sweep_line_plot(
            dest / "p99_latency.png",
            summary,
            "p99 latency",
            "p99 latency (s)",
            metric("p99_latency_s"),
        ),
    ]
    tasks = metric("task_attainment", 100.0)
    if any(math.isfinite(v) for values in tasks.values() for v in values):
        # scenarios with programs (task chains, collective programs): whole-program SLOs
        paths.append(
            _sweep_line_plot(
                dest / "task_attainment.png",
                summary,
                "task attainment",
                "programs within their SLO (%)",
                tasks,
                percent=True,
            )
        )
    for cls, stem in _file_stems(_classes(summary)).items():
        series = {}
        for name, entry in policies.items():
            by_class = {str(k): v for k, v in entry.get(BY_CLASS, {}).items()}
            if cls in by_class:  # a policy without the class gets no line, not a flat gap
                series[name] = _series(by_class[cls], n, 100.0)
        paths.append(
            _sweep_line_plot(
                dest / f"attainment_{stem}.png",
                summary,
                f"SLO attainment, class {cls}",
                f"SLO attainment of {cls} (%)",
                series,
                percent=True,
            )
        )
    return paths


def _bar_plots(summary: Mapping[str, Any], dest: Path) -> list[Path]:
    policies = {str(k): v for k, v in summary["policies"].items()}
    colours = policy_colours(summary)
    classes = _classes(summary)
    groups = ["overall", *classes]
    width = 0.8 / max(1, len(policies))

    figure, axes = _new_axes(f"{_plot_name(summary)}: SLO attainment")
    for i, (name, entry) in enumerate(policies.items()):
        by_class = {str(k): v for k, v in entry.get(BY_CLASS, {}).items()}
        heights = _series([entry.get("slo_attainment"), *(by_class.get(c) for c in classes)], 0)
        offset = (i - (len(policies) - 1) / 2) * width
        xs = [g + offset for g in range(len(groups))]
        axes.bar(xs, [h * 100 for h in heights], width, color=colours[name], label=name)
    axes.set_xticks(range(len(groups)), labels=groups)
    axes.set_ylabel("SLO attainment (%)")
    axes.set_ylim(0, 105)
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(title="policy")
    paths = [_save_figure(figure, dest / "attainment.png")]

    figure, axes = _new_axes(f"{_plot_name(summary)}: throughput")
    for i, (name, entry) in enumerate(policies.items()):
        height = _series([entry.get("throughput_rps")], 1)
        axes.bar([i], height, 0.8, color=colours[name], label=name)
    axes.set_xticks(range(len(policies)), labels=list(policies))
    axes.set_ylabel("throughput (req/s)")
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(title="policy")
    paths.append(_save_figure(figure, dest / "throughput.png"))
    return paths


def _r2_text(r2: Any) -> str:
    x = _number(r2)
    return MISSING if x is None else f"{x:.3f}"


def _scatter_plot(summary: Mapping[str, Any], scatter: Mapping[str, Any], path: Path) -> Path:
    title = scatter.get("title") or "scatter"
    # the titles name the estimate and the point: wrapped, or they run off a 6-inch figure
    full = f"{_plot_name(summary)}: {title} (R² = {_r2_text(scatter.get('r2'))})"
    figure, axes = _new_axes(textwrap.fill(full, 60))
    xs = _series(scatter["x"], 0)
    ys = _series(scatter["y"], 0)
    axes.scatter(xs, ys, s=6, alpha=0.5, color=PALETTE[0], label="requests")
    finite = [v for v in (*xs, *ys) if math.isfinite(v)]
    if finite:
        low, high = min(finite), max(finite)
        axes.plot([low, high], [low, high], linestyle="--", color="black", label="y = x")
    axes.set_xlabel(str(scatter.get("x_label") or "x"))
    axes.set_ylabel(str(scatter.get("y_label") or "y"))
    axes.grid(True, alpha=0.3)
    axes.legend()
    return _save_figure(figure, path)


def render_plots(summary: Mapping[str, Any], dest: Path) -> list[Path]:
    """Write the PNGs into ``dest`` (which must exist); the paths written."""
    validate_summary(summary)
    if summary.get("sweep") is not None:
        paths = _sweep_plots(summary, dest)
    else:
        paths = _bar_plots(summary, dest)
    if summary.get("scatter") is not None:
        paths.append(_scatter_plot(summary, summary["scatter"], dest / "scatter.png"))
    extra = summary.get("scatters") or []
    stems = _file_stems([str(sc.get("name") or k) for k, sc in enumerate(extra)])
    for k, sc in enumerate(extra):
        stem = stems[str(sc.get("name") or k)]
        paths.append(_scatter_plot(summary, sc, dest / f"scatter-{stem}.png"))
    return paths


# ------------------------------------------------------------------------------------ writing


def _jsonable(value: Any) -> Any:
    """The summary as strict JSON values: non-finite floats become None, numpy values lists and
    Python numbers."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return _jsonable(value.tolist())
    raise TypeError(f"summary holds a {type(value).__name__}, which JSON cannot hold")


def summary_json(summary: Mapping[str, Any]) -> str:
    return json.dumps(_jsonable(summary), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def _move(src: Path, dst: Path) -> None:
    os.replace(src, dst)


class _Staging:
    """Files rendered into temporary directories beside their destinations, then moved into
    place together; on any failure the destinations are put back as they were."""

    def __init__(self) -> None:
        self._temp_dirs: list[Path] = []
        self._moves: list[tuple[Path, Path]] = []

    def temp_dir_beside(self, target: Path) -> Path:
        parent = target.absolute().parent
        parent.mkdir(parents=True, exist_ok=True)
        temp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
        self._temp_dirs.append(temp)
        return temp

    def add(self, src: Path, dst: Path) -> None:
        self._moves.append((src, dst))

    def commit(self) -> list[Path]:
        for _, dst in self._moves:
            if dst.is_dir() and not dst.is_symlink():
                raise IsADirectoryError(f"{dst} is a directory; refusing to replace it")
        created_dirs: list[Path] = []
        done: list[tuple[Path, Path | None]] = []  # (destination, where its old file went)
        try:
            for src, dst in self._moves:
                if not dst.parent.is_dir():
                    dst.parent.mkdir()
                    created_dirs.append(dst.parent)
                backup = None
                if dst.exists() or dst.is_symlink():
                    backup = src.with_name(src.name + ".previous")
                    _move(dst, backup)
                done.append((dst, backup))
                _move(src, dst)
        except BaseException:
            self._roll_back(done, created_dirs)
            raise
        return [dst for _, dst in self._moves]

    @staticmethod
    def _roll_back(done: list[tuple[Path, Path | None]], created_dirs: list[Path]) -> None:
        for dst, backup in reversed(done):
            try:
                if backup is None:
                    dst.unlink(missing_ok=True)
                elif backup.exists() or backup.is_symlink():
                    os.replace(backup, dst)
            except OSError as exc:
                log.warning("sim_output_rollback_failed", path=str(dst), error=str(exc))
        for directory in reversed(created_dirs):
            # Not empty: something else wrote there meanwhile, so it stays.
            with contextlib.suppress(OSError):
                directory.rmdir()

    def clean_up(self) -> None:
        for temp in self._temp_dirs:
            shutil.rmtree(temp, ignore_errors=True)


def write_outputs(
    summary: Mapping[str, Any], out_dir: Path | None, json_path: Path | None
) -> list[Path]:
    """Write ``summary.json``, ``results.md`` and the PNGs into ``out_dir`` (created if missing)
    and/or the JSON to ``json_path``, all or nothing; the paths written."""
    validate_summary(summary)
    document = summary_json(summary)
    staging = _Staging()
    try:
        if out_dir is not None:
            out_dir = Path(out_dir)
            work = staging.temp_dir_beside(out_dir)
            (work / SUMMARY_JSON).write_text(document, encoding="utf-8")
            plots = [p.name for p in render_plots(summary, work)]
            (work / RESULTS_MD).write_text(results_markdown(summary, plots), encoding="utf-8")
            for name in (SUMMARY_JSON, RESULTS_MD, *plots):
                staging.add(work / name, out_dir / name)
        if json_path is not None:
            json_path = Path(json_path)
            work = staging.temp_dir_beside(json_path)
            (work / json_path.name).write_text(document, encoding="utf-8")
            staging.add(work / json_path.name, json_path)
        written = staging.commit()
    except BaseException as exc:
        log.warning("sim_outputs_not_written", scenario=summary["scenario"], error=repr(exc))
        raise
    finally:
        staging.clean_up()
    log.info("sim_outputs_written", scenario=summary["scenario"], files=len(written))
    return written
