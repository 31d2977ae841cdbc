"""Results at a glance: one row per scenario, from the ``summary.json`` of each run.

A row sets qlm against the strongest baseline of that run at the point where qlm fares worst
against it (the point that decides the target). The row also gives the hindsight bound there,
the target, and whether it was met. The target is the one every scenario shares (issue 17):
at every point, qlm meets at least as many SLOs as every baseline less one point, on the mean
over seeds. A scenario's own checks (qlm/tooling/simulator/targets.py, evaluated on the
run's figures here, so a target added since the run counts) must pass too. The "why" column
says in words where the decision fell; docs/benchmarks.md explains it.

Scenarios whose columns are not policies (ablations, engine settings, the delta sweep) compare
qlm with itself: they get their own checks only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlm.tooling.simulator.report import HINDSIGHT, SUMMARY_JSON
from qlm.tooling.simulator.targets import baselines, evaluate

SLACK_POINTS = 1.0  # qlm may trail a baseline by this much (sampling noise between policies)
# A run named RUN + this suffix, made with --clairvoyant, is RUN's clairvoyant twin: qlm alone,
# told every true output length as max_tokens. It splits RUN's distance to the hindsight bound
# into what knowing the lengths is worth and the rest; it has no row of its own.
CLAIRVOYANT_TWIN = "-clairvoyant"
SPEED_RATIO_MAX = 2.0  # issue 17: qlm's simulator wall time at most this times EDF's
QLM = "qlm"


@dataclass(frozen=True)
class GlanceRow:
    scenario: str
    seeds: int
    point: str  # the deciding point's label ("" without a sweep)
    qlm: float | None  # attainment %, mean over seeds
    baseline: str | None  # the strongest other policy at that point
    baseline_value: float | None
    bound: float | None  # hindsight bound %, at that point
    target: str
    met: bool
    why: str
    inputs: str = "caps"  # max_tokens: clients' caps, the true output, or an older run


def _inputs(summary: Mapping[str, Any]) -> str:
    """What the run's policies were told: clients' caps (the default since issue 17), the true
    output (a labelled clairvoyant run), or a run from before the simulator drove the product's
    core, when every max_tokens was the true output."""
    flag = summary.get("clairvoyant_max_tokens")
    if flag is None:
        return "older run, clairvoyant"
    return "clairvoyant" if flag else "caps"


def _at(value: Any, k: int | None) -> Any:
    return value[k] if k is not None and isinstance(value, list) else value


def _pct(value: Any) -> float | None:
    return None if value is None else 100.0 * float(value)


def _labels(summary: Mapping[str, Any]) -> list[str]:
    sweep = summary.get("sweep")
    if not sweep:
        return [""]
    variants = sweep.get("variants")
    if variants:
        return [str(v) for v in variants]
    return [str(v) for v in sweep.get("values", [])]


def _points(summary: Mapping[str, Any], labels: Sequence[str]) -> list[int | None]:
    """The indices of the sweep's points, or [None] for a run without a sweep."""
    return list(range(len(labels))) if summary.get("sweep") else [None]


def glance_row(summary: Mapping[str, Any]) -> GlanceRow:
    policies: Mapping[str, Any] = summary.get("policies", {})
    labels = _labels(summary)
    points = _points(summary, labels)
    seeds = len(summary.get("seeds") or [summary.get("seed", 0)])
    own_checks = current_checks(summary)
    own_ok = all(bool(c.get("met")) for c in own_checks)
    others = baselines(policies)
    bound_series = (summary.get(HINDSIGHT) or {}).get("slo_attainment")
    if QLM not in policies or not others:
        met = own_ok
        return GlanceRow(
            scenario=str(summary.get("scenario", "?")),
            seeds=seeds,
            point="",
            qlm=None,
            baseline=None,
            baseline_value=None,
            bound=None,
            target="its own checks",
            met=met,
            why=_own_why(own_checks),
            inputs=_inputs(summary),
        )
    worst: tuple[float, int | None, str, float, float] | None = None
    for k in points:
        q = _pct(_at(policies[QLM].get("slo_attainment"), k))
        if q is None:
            continue
        best_name, best = max(
            ((p, _pct(_at(policies[p].get("slo_attainment"), k)) or 0.0) for p in others),
            key=lambda item: item[1],
        )
        margin = q - best
        if worst is None or margin < worst[0]:
            worst = (margin, k, best_name, best, q)
    if worst is None:
        raise ValueError(f"{summary.get('scenario')}: qlm has no attainment")
    margin, k, best_name, best, q = worst
    shared_ok = margin >= -SLACK_POINTS
    bound = _pct(_at(bound_series, k)) if bound_series is not None else None
    label = labels[k] if k is not None else ""
    where = f" at {label}" if label else ""
    if shared_ok:
        why = f"qlm {margin:+.1f} points against {best_name}{where}, its closest point"
    else:
        why = f"qlm trails {best_name} by {-margin:.1f} points{where}"
    if not own_ok:
        why += "; " + _own_why(own_checks)
    return GlanceRow(
        scenario=str(summary.get("scenario", "?")),
        seeds=seeds,
        point=label,
        qlm=q,
        baseline=best_name,
        baseline_value=best,
        bound=bound,
        target=f"qlm ≥ every baseline − {SLACK_POINTS:g} at every point"
        + (" and its own checks" if own_checks else ""),
        met=shared_ok and own_ok,
        why=why,
        inputs=_inputs(summary),
    )


def current_checks(summary: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The run's checks under today's targets (qlm/tooling/simulator/targets.py) on its
    figures, so that a target added since the run counts without re-running it; the checks
    the run recorded where no target there applies (the capacity day's are its own)."""
    fresh = {k: v for k, v in summary.items() if k not in ("checks", "misses")}
    evaluate(fresh)
    return list(fresh.get("checks", summary.get("checks", [])))


def _own_why(checks: Sequence[Mapping[str, Any]]) -> str:
    missed = [str(c.get("target", "?")) for c in checks if not c.get("met")]
    if not checks:
        return "no checks of its own"
    if not missed:
        return f"its {len(checks)} checks met"
    if len(missed) == 1:
        return f"missed its check {missed[0]!r}"
    return f"missed {len(missed)} of its {len(checks)} checks"


def load_summaries(root: Path, runs: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """``root/<run>/summary.json`` by run folder (every folder holding one, sorted)."""
    names = runs or sorted(p.parent.name for p in root.glob(f"*/{SUMMARY_JSON}"))
    out = {}
    for name in names:
        path = root / name / SUMMARY_JSON
        if path.exists():
            out[name] = json.loads(path.read_text())
    return out


def clairvoyant_twin(
    summaries: Mapping[str, Mapping[str, Any]], name: str
) -> Mapping[str, Any] | None:
    """The clairvoyant twin of run ``name`` (:data:`CLAIRVOYANT_TWIN`), if there is one."""
    twin = summaries.get(name + CLAIRVOYANT_TWIN)
    return twin if twin is not None and twin.get("clairvoyant_max_tokens") else None


def _is_twin(summaries: Mapping[str, Mapping[str, Any]], name: str) -> bool:
    base = name.removesuffix(CLAIRVOYANT_TWIN)
    return base != name and base in summaries and clairvoyant_twin(summaries, base) is not None


def glance_rows(summaries: Mapping[str, Mapping[str, Any]]) -> list[GlanceRow]:
    """One row per run, named by its folder (a scenario can have several runs); a run's
    clairvoyant twin has none (it appears in the bound table)."""
    rows = []
    for name, summary in summaries.items():
        if _is_twin(summaries, name):
            continue
        row = glance_row(summary)
        rows.append(GlanceRow(**{**row.__dict__, "scenario": name}))
    return rows


BEGIN, END = "<!-- glance:begin -->", "<!-- glance:end -->"


def _spliced(text: str, begin: str, end: str, body: str) -> str | None:
    """``text`` with what lies between its ``begin`` and ``end`` markers replaced by ``body``;
    None when it has no such block."""
    if begin not in text or end not in text:
        return None
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}{end}{tail}"


def write_into(page: Path, table: str) -> None:
    """Replace what lies between the page's glance markers with ``table``."""
    text = _spliced(page.read_text(), BEGIN, END, table)
    if text is None:
        raise ValueError(f"{page} has no {BEGIN} ... {END} block")
    page.write_text(text)


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _mean_sd(mean: Any, sd: Any, k: int | None, seeds: int) -> str:
    m = _pct(_at(mean, k))
    if m is None:
        return "–"
    d = _pct(_at(sd, k)) if sd is not None else None
    return f"{m:.1f}" if seeds < 2 or d is None else f"{m:.1f} ± {d:.1f}"


def attainment_markdown(summary: Mapping[str, Any]) -> str:
    """One run's SLO attainment (%) at every point: qlm, then the other columns in the run's
    order, then the hindsight bound; mean ± sd over the seeds where there are several."""
    policies: Mapping[str, Any] = summary.get("policies", {})
    names = ([QLM] if QLM in policies else []) + [p for p in policies if p != QLM]
    sds: Mapping[str, Any] = summary.get("sd") or {}
    seeds = len(summary.get("seeds") or [summary.get("seed", 0)])
    hindsight = summary.get(HINDSIGHT) or {}
    labels = _labels(summary)
    points = _points(summary, labels)
    label = (summary.get("sweep") or {}).get("label") or "point"
    head = f"| {label} | " + " | ".join(names) + (" | bound |" if hindsight else " |")
    rule = "|---|" + "---:|" * (len(names) + (1 if hindsight else 0))
    rows = []
    for k in points:
        cells = [
            _mean_sd(
                policies[n].get("slo_attainment"),
                (sds.get(n) or {}).get("slo_attainment"),
                k,
                seeds,
            )
            for n in names
        ]
        if hindsight:
            cells.append(_fmt(_pct(_at(hindsight.get("slo_attainment"), k))))
        point = labels[k] if k is not None else "–"
        rows.append(f"| {point} | " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *rows]) + "\n"


def write_attainment_blocks(page: Path, summaries: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Replace every ``<!-- attainment:RUN:begin -->`` ... ``<!-- attainment:RUN:end -->``
    block of the page with RUN's attainment table; returns the runs written."""
    text = page.read_text()
    written = []
    for name, summary in summaries.items():
        begin, end = f"<!-- attainment:{name}:begin -->", f"<!-- attainment:{name}:end -->"
        spliced = _spliced(text, begin, end, attainment_markdown(summary))
        if spliced is not None:
            text = spliced
            written.append(name)
    page.write_text(text)
    return written


def glance_markdown(rows: Sequence[GlanceRow]) -> str:
    head = (
        "| scenario | max_tokens | seeds | deciding point | qlm % | best baseline % "
        "| hindsight bound % | target | met | why |\n"
        "|---|---|---:|---|---:|---|---:|---|---|---|\n"
    )
    lines = []
    for r in rows:
        base = "–" if r.baseline is None else f"{r.baseline} {_fmt(r.baseline_value)}"
        lines.append(
            f"| {r.scenario} | {r.inputs} | {r.seeds} | {r.point or '–'} | {_fmt(r.qlm)} | {base} "
            f"| {_fmt(r.bound)} | {r.target} | {'met' if r.met else '**missed**'} | {r.why} |"
        )
    return head + "\n".join(lines) + "\n"


SPEED_BEGIN, SPEED_END = "<!-- speed:begin -->", "<!-- speed:end -->"


def _total(value: Any) -> float | None:
    """A metric's sum over the points (each a mean over the seeds)."""
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if any(v is None for v in values):
        return None
    return float(sum(values))


def speed_markdown(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """Issue 17's speed target, per run that has both qlm and EDF: each one's simulator wall
    time over every point (mean over the seeds), qlm's planner share, and the ratio against
    the target (qlm at most SPEED_RATIO_MAX times EDF's)."""
    head = (
        "| scenario | qlm sim wall s | of it, qlm's planner s | EDF sim wall s | qlm / EDF "
        f"| target ≤ {SPEED_RATIO_MAX:g}× |\n"
        "|---|---:|---:|---:|---:|---|\n"
    )
    lines = []
    for name, summary in summaries.items():
        policies = summary.get("policies", {})
        if QLM not in policies or "edf" not in policies:
            continue
        qlm = _total(policies[QLM].get("sim_wall_s"))
        edf = _total(policies["edf"].get("sim_wall_s"))
        planner = _total(policies[QLM].get("planner_wall_s"))
        if qlm is None or edf is None or edf <= 0:
            continue
        ratio = qlm / edf
        lines.append(
            f"| {name} | {qlm:.1f} | {_fmt(planner)} | {edf:.1f} | {ratio:.1f}× "
            f"| {'met' if ratio <= SPEED_RATIO_MAX else '**missed**'} |"
        )
    return head + "\n".join(lines) + "\n"


def write_speed_block(page: Path, summaries: Mapping[str, Mapping[str, Any]]) -> bool:
    """Replace the page's speed block, if it has one."""
    return _write_block(page, SPEED_BEGIN, SPEED_END, speed_markdown(summaries))


def _write_block(page: Path, begin: str, end: str, body: str) -> bool:
    """Replace what lies between the page's ``begin`` and ``end`` markers with ``body``;
    False (the page untouched) when it has no such block."""
    text = _spliced(page.read_text(), begin, end, body)
    if text is None:
        return False
    page.write_text(text)
    return True


BOUND_BEGIN, BOUND_END = "<!-- bound:begin -->", "<!-- bound:end -->"
BOUND_GAP_MAX = 10.0  # issue 17: qlm within this many points of the hindsight bound everywhere


def bound_gap_markdown(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """Issue 17's distance to the limit, per run with qlm and a hindsight bound: at how many
    points qlm is within BOUND_GAP_MAX points of the bound, the point where it is farthest, and
    what the best column of the run (any policy) reached there. A best column as far from the
    bound as qlm says the distance is mostly the relaxation's (docs/simulator.md). Where the run
    has a clairvoyant twin, its qlm there too: what knowing every output length would close."""
    head = (
        "| scenario | points within "
        f"{BOUND_GAP_MAX:g} | farthest point | qlm % | best column there % "
        "| qlm told the lengths % | bound % "
        f"| qlm's gap | target ≤ {BOUND_GAP_MAX:g} |\n"
        "|---|---:|---|---:|---|---:|---:|---:|---|\n"
    )
    lines = []
    for name, summary in summaries.items():
        policies: Mapping[str, Any] = summary.get("policies", {})
        bound_series = (summary.get(HINDSIGHT) or {}).get("slo_attainment")
        others = baselines(policies)
        if QLM not in policies or not others or bound_series is None:
            continue  # ablations compare qlm with itself, as in the glance
        labels = _labels(summary)
        points = _points(summary, labels)
        gaps: list[tuple[float, int | None]] = []
        for k in points:
            q, b = _pct(_at(policies[QLM].get("slo_attainment"), k)), _pct(_at(bound_series, k))
            if q is not None and b is not None:
                gaps.append((b - q, k))
        if not gaps:
            continue
        gap, k = max(gaps, key=lambda item: item[0])
        best_name, best = max(
            ((p, _pct(_at(policies[p].get("slo_attainment"), k)) or 0.0) for p in policies),
            key=lambda item: item[1],
        )
        within = sum(1 for g, _ in gaps if g <= BOUND_GAP_MAX)
        label = labels[k] if k is not None else "–"
        twin = clairvoyant_twin(summaries, name)
        told = None
        if twin is not None and _labels(twin) == labels and QLM in twin.get("policies", {}):
            told = _pct(_at(twin["policies"][QLM].get("slo_attainment"), k))
        lines.append(
            f"| {name} | {within} of {len(gaps)} | {label} "
            f"| {_fmt(_pct(_at(policies[QLM].get('slo_attainment'), k)))} "
            f"| {best_name} {_fmt(best)} | {_fmt(told)} "
            f"| {_fmt(_pct(_at(bound_series, k)))} | {gap:.1f} "
            f"| {'met' if gap <= BOUND_GAP_MAX else '**missed**'} |"
        )
    return head + "\n".join(lines) + "\n"


def write_bound_block(page: Path, summaries: Mapping[str, Mapping[str, Any]]) -> bool:
    """Replace the page's hindsight-bound block, if it has one."""
    return _write_block(page, BOUND_BEGIN, BOUND_END, bound_gap_markdown(summaries))
