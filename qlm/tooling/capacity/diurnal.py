"""A day of diurnal load built from the shipped Azure LLM inference traces (2023).

The Azure traces cover one hour each (conversation: ≈ 19.4 k requests, 5.4 req/s; code:
≈ 8.8 k, 2.4 req/s), which is too short to show a daily cycle. The capacity scenario needs a
day, so one is built from the hour, keeping what the hour has (its burstiness at the scale of
seconds to minutes and its joint prompt/output lengths) and adding what it lacks (the slow
daily swing SageServe plans for):

1. *Tiles.* The hour is laid end to end ``ceil(hours)`` times. In tile ``h`` the trace is
   circularly shifted by a random offset, so tiles do not repeat one another minute by minute.
2. *Copies.* When the peak rate asked for is above the trace's own rate, ``k`` independently
   shifted copies are superposed in every tile (``k = ceil(peak / trace rate)``).
3. *Thinning.* Each candidate arrival at time ``t`` is kept with probability
   ``rate(t) / (k · trace rate)``, where ``rate(t)`` is a raised cosine between
   ``trough_ratio · peak`` and ``peak``, highest at ``peak_hour`` (Lewis-Shedler thinning:
   the result is the trace's arrival process modulated by the daily curve).

A request keeps the trace row's prompt and output tokens. Nothing here simulates: it returns
:class:`~qlm.tooling.simulator.workload.SimRequest` rows (sorted by arrival) and the per-minute
input
token counts of the hour *before* the day, which prime a forecaster as a live system's history
would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qlm.tooling.simulator.workload import SimRequest, _load_trace

HOUR_S = 3600.0
DAY_H = 24.0


@dataclass(frozen=True)
class DiurnalLoad:
    """One stream of the day: requests of ``model`` drawn from an Azure trace (``conv`` or
    ``code``) or a trace CSV, following a raised-cosine daily curve."""

    model: str
    peak_rps: float
    trace: str = "conv"
    trough_ratio: float = 0.25
    peak_hour: float = 14.0  # local time of the daily peak
    start_hour: float = 0.0  # local time at t = 0
    e2e_slo_s: float | None = None
    ttft_slo_s: float | None = None
    slo_class: str = "interactive"
    name: str = "day"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.peak_rps) and self.peak_rps > 0):
            raise ValueError("peak_rps must be a positive number")
        if not 0 < self.trough_ratio <= 1:
            raise ValueError("trough_ratio must be in (0, 1]")
        for v in (self.e2e_slo_s, self.ttft_slo_s):
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError("SLOs must be positive numbers of seconds")

    def rate(self, t_s: np.ndarray | float) -> np.ndarray:
        """Arrival rate (req/s) at ``t_s`` seconds after the start."""
        hour = self.start_hour + np.asarray(t_s, dtype=np.float64) / HOUR_S
        swing = 0.5 * (1.0 + np.cos(2.0 * np.pi * (hour - self.peak_hour) / DAY_H))
        return self.peak_rps * (self.trough_ratio + (1.0 - self.trough_ratio) * swing)


def _arrivals(
    load: DiurnalLoad, start_s: float, end_s: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(arrival times, trace row indices) in ``[start_s, end_s)``, sorted."""
    trace = _load_trace(load.trace)
    n = len(trace.arrival_s)
    if n == 0:
        raise ValueError(f"{load.trace}: the trace has no rows")
    span = float(trace.arrival_s[-1]) + 1e-9
    span = max(span, 1.0)
    trace_rate = n / span
    copies = max(1, math.ceil(load.peak_rps / trace_rate))
    times: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    first = math.floor(start_s / span)
    last = math.ceil(end_s / span)
    for tile in range(first, last):
        for _ in range(copies):
            offset = rng.uniform(0.0, span)
            t = tile * span + np.mod(trace.arrival_s + offset, span)
            keep = rng.random(n) < load.rate(t) / (copies * trace_rate)
            keep &= (t >= start_s) & (t < end_s)
            times.append(t[keep])
            rows.append(np.nonzero(keep)[0])
    t_all = np.concatenate(times)
    r_all = np.concatenate(rows)
    order = np.argsort(t_all, kind="stable")
    return t_all[order], r_all[order]


def diurnal_requests(
    loads: list[DiurnalLoad], *, hours: float = DAY_H, seed: int = 0
) -> list[SimRequest]:
    """The requests of every stream over ``hours`` hours, sorted by arrival."""
    if not (math.isfinite(hours) and hours > 0):
        raise ValueError("hours must be a positive number")
    out: list[SimRequest] = []
    for k, load in enumerate(loads):
        rng = np.random.default_rng([seed, k])
        trace = _load_trace(load.trace)
        t, rows = _arrivals(load, 0.0, hours * HOUR_S, rng)
        prompt = trace.prompt_tokens[rows]
        output = np.maximum(trace.output_tokens[rows], 1)
        for j in range(len(t)):
            o = int(output[j])
            out.append(
                SimRequest(
                    request_id=f"{load.name}-{j}",
                    model=load.model,
                    arrival_s=float(t[j]),
                    prompt_tokens=max(1, int(prompt[j])),
                    output_tokens=o,
                    max_tokens=o,
                    slo_class=load.slo_class,
                    e2e_slo_s=load.e2e_slo_s,
                    ttft_slo_s=load.ttft_slo_s,
                    stream=load.name,
                )
            )
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out


def history_tpm(load: DiurnalLoad, *, minutes: int = 60, seed: int = 0) -> np.ndarray:
    """Input tokens per minute in the ``minutes`` before t = 0, drawn from the same process
    (not served): what a forecaster would have measured the hour before the day starts."""
    rng = np.random.default_rng([seed, 10_000])
    trace = _load_trace(load.trace)
    start = -minutes * 60.0
    t, rows = _arrivals(load, start, 0.0, rng)
    per_minute = np.zeros(minutes)
    idx = np.clip(((t - start) // 60.0).astype(np.int64), 0, minutes - 1)
    np.add.at(per_minute, idx, trace.prompt_tokens[rows])
    return per_minute
