"""Workload reports: SLO attainment, throughput, latency and errors from (request, reply) pairs.

Latencies count from the request's submission (``timestamps.submitted``: the producer's
``submitted_at`` when it set one, else the coordinator's receipt) to the last token (e2e) and to
the first token (TTFT), from the timestamps in each reply. Whether an SLO was met is computed
here from the request's own deadlines, independently of the coordinator's ``slo.met`` verdict;
the number of disagreements is reported as a consistency check.

A request counts against its class's attainment whatever happened to it: an error reply or no
reply at all is a missed SLO.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from qlm.types import ErrorMessage, RequestMessage, ResultMessage

if TYPE_CHECKING:
    from qlm.client import ReplayResult

Reply = ResultMessage | ErrorMessage
DEFAULT_CLASS = "default"  # requests whose SLO has no slo_class label


@dataclass(frozen=True)
class Percentiles:
    p50: float | None
    p99: float | None
    mean: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        if not values:
            return cls(None, None, None)
        arr = np.asarray(values, dtype=float)
        return cls(float(np.percentile(arr, 50)), float(np.percentile(arr, 99)), float(arr.mean()))

    def to_json(self) -> dict[str, float | None]:
        return {"p50": self.p50, "p99": self.p99, "mean": self.mean}


@dataclass
class ClassStats:
    requests: int = 0
    completed: int = 0
    met: int = 0
    errors: int = 0
    lost: int = 0
    e2e: list[float] = field(default_factory=list, repr=False)

    @property
    def attainment(self) -> float | None:
        return self.met / self.requests if self.requests else None

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "met": self.met,
            "errors": self.errors,
            "lost": self.lost,
            "attainment": self.attainment,
            "latency_s": Percentiles.of(self.e2e).to_json(),
        }


def slo_met(request: RequestMessage, reply: ResultMessage) -> bool:
    """Both of the request's deadlines (those it set) held, by the reply's timestamps."""
    t = reply.timestamps
    if request.slo.e2e_ms is not None and (
        t.finished is None or (t.finished - t.submitted) * 1000 > request.slo.e2e_ms
    ):
        return False
    return request.slo.ttft_ms is None or (
        t.first_token is not None and (t.first_token - t.submitted) * 1000 <= request.slo.ttft_ms
    )


@dataclass
class Report:
    requests_sent: int
    replies: int
    completed: int
    errors: int
    errors_by_code: dict[str, int]
    duplicates: int
    lost: int
    publish_failures: int
    window_s: float
    throughput_rps: float
    output_tokens_per_s: float
    e2e_s: Percentiles
    ttft_s: Percentiles
    classes: dict[str, ClassStats]
    slo_disagreements: int  # replies whose slo.met differs from what the timestamps say

    @property
    def slo_attainment(self) -> dict[str, float | None]:
        return {name: c.attainment for name, c in sorted(self.classes.items())}

    @property
    def slo_attainment_overall(self) -> float | None:
        total = sum(c.requests for c in self.classes.values())
        return sum(c.met for c in self.classes.values()) / total if total else None

    @classmethod
    def build(
        cls,
        pairs: Sequence[tuple[RequestMessage, Reply | None]],
        *,
        duplicates: int = 0,
        window_s: float | None = None,
        replies: int | None = None,
        publish_failures: int = 0,
    ) -> Report:
        """Summarise ``pairs`` (reply None: lost). ``window_s`` defaults to first submission
        → last finish; ``replies`` to the number of non-None replies."""
        classes: dict[str, ClassStats] = {}
        errors_by_code: Counter[str] = Counter()
        e2e: list[float] = []
        ttft: list[float] = []
        output_tokens = completed = disagreements = 0
        starts: list[float] = []
        ends: list[float] = []
        for request, reply in pairs:
            stats = classes.setdefault(request.slo.slo_class or DEFAULT_CLASS, ClassStats())
            stats.requests += 1
            if reply is None:
                stats.lost += 1
            elif isinstance(reply, ErrorMessage):
                stats.errors += 1
                errors_by_code[reply.code.value] += 1
            else:
                completed += 1
                stats.completed += 1
                output_tokens += reply.usage.completion_tokens
                t = reply.timestamps
                starts.append(t.submitted)
                met = slo_met(request, reply)
                stats.met += met
                disagreements += met != reply.slo.met
                if t.finished is not None:
                    ends.append(t.finished)
                    e2e.append(t.finished - t.submitted)
                    stats.e2e.append(t.finished - t.submitted)
                if t.first_token is not None:
                    ttft.append(t.first_token - t.submitted)
        if window_s is None:
            window_s = max(ends) - min(starts) if ends and starts else 0.0
        n_replies = sum(r is not None for _, r in pairs) if replies is None else replies
        return cls(
            requests_sent=len(pairs),
            replies=n_replies,
            completed=completed,
            errors=n_replies - completed,
            errors_by_code=dict(sorted(errors_by_code.items())),
            duplicates=duplicates,
            lost=len(pairs) - n_replies,
            publish_failures=publish_failures,
            window_s=window_s,
            throughput_rps=completed / window_s if window_s > 0 else 0.0,
            output_tokens_per_s=output_tokens / window_s if window_s > 0 else 0.0,
            e2e_s=Percentiles.of(e2e),
            ttft_s=Percentiles.of(ttft),
            classes=classes,
            slo_disagreements=disagreements,
        )

    @classmethod
    def from_replay(cls, result: ReplayResult) -> Report:
        """The replay window runs from the first scheduled arrival to the last reply."""
        confirmed = [
            (req, reply) for req, reply in result.results if req.request_id in result.sent_at
        ]
        return cls.build(
            confirmed,
            duplicates=result.duplicates,
            window_s=max(result.finished_at - result.started_at, 0.0),
            replies=result.replies,
            publish_failures=result.publish_failures,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "requests_sent": self.requests_sent,
            "replies": self.replies,
            "completed": self.completed,
            "errors": self.errors,
            "errors_by_code": self.errors_by_code,
            "duplicates": self.duplicates,
            "lost": self.lost,
            "publish_failures": self.publish_failures,
            "window_s": self.window_s,
            "throughput_rps": self.throughput_rps,
            "output_tokens_per_s": self.output_tokens_per_s,
            "latency_s": self.e2e_s.to_json(),
            "ttft_s": self.ttft_s.to_json(),
            "slo_attainment": self.slo_attainment,
            "slo_attainment_overall": self.slo_attainment_overall,
            "classes": {name: c.to_json() for name, c in sorted(self.classes.items())},
            "slo_disagreements": self.slo_disagreements,
        }

    def format_table(self) -> str:
        return format_comparison({"value": self})


# --- text tables -----------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def _rows(report: Report, class_names: list[str], codes: list[str]) -> list[tuple[str, str]]:
    r = report
    rows = [
        ("requests sent", str(r.requests_sent)),
        ("replies", str(r.replies)),
        ("completed", str(r.completed)),
        ("errors", str(r.errors)),
        *((f"  {code}", str(r.errors_by_code.get(code, 0))) for code in codes),
        ("duplicates", str(r.duplicates)),
        ("lost", str(r.lost)),
        ("window", f"{r.window_s:.1f} s"),
        ("throughput", f"{r.throughput_rps:.2f} req/s"),
        ("output tokens", f"{r.output_tokens_per_s:.0f} tok/s"),
        ("e2e latency p50", _secs(r.e2e_s.p50)),
        ("e2e latency p99", _secs(r.e2e_s.p99)),
        ("TTFT p50", _secs(r.ttft_s.p50)),
        ("TTFT p99", _secs(r.ttft_s.p99)),
    ]
    for name in class_names:
        c = r.classes.get(name)
        cell = "-" if c is None else f"{_pct(c.attainment)} ({c.met}/{c.requests})"
        rows.append((f"SLO attained: {name}", cell))
    rows.append(("SLO attained: all", _pct(r.slo_attainment_overall)))
    return rows


def format_comparison(reports: dict[str, Report]) -> str:
    """Several reports (e.g. one per policy) side by side, one column each."""
    class_names = sorted({n for r in reports.values() for n in r.classes})
    codes = sorted({c for r in reports.values() for c in r.errors_by_code})
    columns = {name: _rows(r, class_names, codes) for name, r in reports.items()}
    labels = [label for label, _ in next(iter(columns.values()), [])]
    label_w = max([len(x) for x in labels] + [6])
    widths = {name: max([len(name)] + [len(v) for _, v in rows]) for name, rows in columns.items()}
    header = "metric".ljust(label_w) + "".join(f"  {n.rjust(widths[n])}" for n in columns)
    lines = [header, "-" * len(header)]
    for i, label in enumerate(labels):
        cells = "".join(f"  {rows[i][1].rjust(widths[n])}" for n, rows in columns.items())
        lines.append(label.ljust(label_w) + cells)
    return "\n".join(lines)
