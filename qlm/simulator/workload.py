"""The requests of a scenario: arrival times, token counts, models and SLOs of every stream.

Everything is drawn with numpy, vectorised per stream; building the :class:`SimRequest`
objects is the only per-request Python work (a million requests take a few seconds). Each
stream has its own random generator seeded from ``(scenario seed, stream index)``, split into
independent generators for arrivals, lengths and models, so adding a stream or changing one
stream's model mix leaves the other draws unchanged.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import numpy as np
import structlog

from qlm.simulator.scenario import ArrivalSpec, LengthSpec, ScenarioError, ScenarioSpec, StreamSpec
from qlm.trace import (
    AZURE_FILES,
    TraceRecord,
    load_azure_trace,
    load_request_lengths,
    load_trace_csv,
)

log = structlog.get_logger(__name__)

IntArray = np.ndarray  # int64 token counts, one per request


@dataclass(slots=True)
class SimRequest:
    request_id: str  # f"{stream}-{k}", k in the stream's arrival order
    model: str
    arrival_s: float  # seconds from the simulation start
    prompt_tokens: int
    output_tokens: int  # what the engine generates: the true length, unknown to policies
    max_tokens: int  # what the producer asked for (>= output_tokens)
    slo_class: str
    e2e_slo_s: float | None
    ttft_slo_s: float | None
    stream: str


@dataclass(frozen=True)
class _Trace:
    arrival_s: np.ndarray  # sorted, seconds since the first row
    prompt_tokens: IntArray
    output_tokens: IntArray


# A trace and the rows of it that gave a stream its arrivals.
_TraceRows = tuple[_Trace, IntArray]


def _as_trace(records: list[TraceRecord]) -> _Trace:
    arrival = np.fromiter((r.arrival_s for r in records), dtype=np.float64, count=len(records))
    prompt = np.fromiter((r.prompt_tokens for r in records), dtype=np.int64, count=len(records))
    output = np.fromiter((r.output_tokens for r in records), dtype=np.int64, count=len(records))
    if len(arrival):
        arrival = arrival - arrival[0]  # generic CSVs keep their own origin
    return _Trace(arrival, prompt, output)


@cache
def _azure_trace(kind: str) -> _Trace:
    return _as_trace(load_azure_trace(kind))  # type: ignore[arg-type]


@lru_cache(maxsize=8)
def _csv_trace(path: str, mtime_ns: int, size: int) -> _Trace:
    # mtime and size are in the key so an edited file is read again.
    try:
        records = load_trace_csv(path)
    except (ValueError, KeyError, TypeError, csv.Error) as e:
        message = str(e)
        raise ScenarioError(message if path in message else f"{path}: {message}") from e
    if not records:
        raise ScenarioError(f"{path}: the trace has no rows")
    return _as_trace(records)


def _load_trace(trace: str) -> _Trace:
    """A shipped Azure trace ("conv", "code") or a trace CSV, cached."""
    if trace in AZURE_FILES:
        return _azure_trace(trace)
    try:
        stat = Path(trace).stat()
    except OSError as e:
        raise ScenarioError(f"{trace}: cannot read the trace: {e.strerror or e}") from e
    return _csv_trace(str(Path(trace).resolve()), stat.st_mtime_ns, stat.st_size)


@cache
def _length_table(source: str) -> tuple[IntArray, IntArray]:
    """(prompt, output) columns of a length table; rows are sampled whole."""
    if source.startswith("azure-"):
        trace = _azure_trace(source.removeprefix("azure-"))
        return trace.prompt_tokens, trace.output_tokens
    rows = np.asarray(load_request_lengths(source), dtype=np.int64)  # type: ignore[arg-type]
    return rows[:, 0].copy(), rows[:, 1].copy()


# --- arrivals --------------------------------------------------------------------------------


class _GapSampler:
    def __init__(self, spec: ArrivalSpec, rng: np.random.Generator) -> None:
        assert spec.rate_rps is not None  # the scenario validates it
        self.process = spec.process
        self.rate = spec.rate_rps
        self.shape = 1.0 / spec.cv**2  # gamma: cv^2 = 1 / shape
        self.rng = rng

    def __call__(self, n: int) -> np.ndarray:
        if self.process == "poisson":
            return self.rng.exponential(1.0 / self.rate, n)
        # Mean shape * scale = 1 / rate.
        return self.rng.gamma(self.shape, 1.0 / (self.rate * self.shape), n)


def _renewal_times(
    draw_gaps: _GapSampler, rate: float, start_s: float, end_s: float, cv: float
) -> np.ndarray:
    """Arrivals of a renewal process in [start_s, end_s): cumulative sums of i.i.d. gaps."""
    span = end_s - start_s
    if span <= 0:
        return np.empty(0)
    expected = rate * span
    # Enough gaps to pass end_s nearly always (the count's sd is about cv * sqrt(expected)).
    batch = int(expected + 8 * cv * math.sqrt(expected) + 16)
    chunks = []
    t = start_s
    while t < end_s:
        times = t + np.cumsum(draw_gaps(batch))
        chunks.append(times)
        t = float(times[-1])
    times = np.concatenate(chunks)
    return times[times < end_s]


def _trace_window(spec: ArrivalSpec, start_s: float, end_s: float) -> tuple[np.ndarray, IntArray]:
    """Replayed arrivals in [start_s, end_s) and the trace rows they come from."""
    assert spec.trace is not None
    trace = _load_trace(spec.trace)
    first = int(np.searchsorted(trace.arrival_s, spec.start_s, side="left"))
    relative = trace.arrival_s[first:] - spec.start_s
    rows = np.arange(first, len(trace.arrival_s))
    if spec.rate_rps is not None and len(relative) >= 2:
        span = float(relative[-1] - relative[0])
        if span > 0:
            native_rate = (len(relative) - 1) / span
            relative = relative * (native_rate / spec.rate_rps)
    times = start_s + relative
    keep = times < end_s
    if len(times) and keep.all():
        log.info(
            "trace_exhausted",
            trace=spec.trace,
            last_arrival_s=round(float(times[-1]), 3),
            window_end_s=end_s,
        )
    return times[keep], rows[keep]


def arrival_times(
    spec: ArrivalSpec, start_s: float, end_s: float, rng: np.random.Generator
) -> np.ndarray:
    """Sorted arrival times in [start_s, end_s).

    poisson: exponential gaps; gamma: gamma gaps with mean 1/rate and the given cv;
    trace: the trace's timestamps relative to its first row (from ``spec.start_s`` into it),
    scaled so their mean rate is ``rate_rps`` if given, shifted to begin at ``start_s``.
    """
    if spec.process == "trace":
        return _trace_window(spec, start_s, end_s)[0]
    sampler = _GapSampler(spec, rng)
    cv = 1.0 if spec.process == "poisson" else spec.cv
    return _renewal_times(sampler, sampler.rate, start_s, end_s, cv)


# --- lengths ---------------------------------------------------------------------------------


def _sample_lengths(
    lengths: LengthSpec, n: int, rng: np.random.Generator, trace_rows: _TraceRows | None
) -> tuple[IntArray, IntArray]:
    if lengths.source == "fixed":
        assert lengths.prompt_tokens is not None and lengths.output_tokens is not None
        return (
            np.full(n, lengths.prompt_tokens, dtype=np.int64),
            np.full(n, lengths.output_tokens, dtype=np.int64),
        )
    if lengths.source == "trace":
        assert trace_rows is not None  # the scenario requires trace arrivals
        trace, rows = trace_rows
        return trace.prompt_tokens[rows], trace.output_tokens[rows]
    prompt, output = _length_table(lengths.source)
    picks = rng.integers(0, len(prompt), n)  # prompt and output of the same row
    return prompt[picks], output[picks]


def fit_lengths(
    prompt: IntArray,
    output: IntArray,
    *,
    max_context: IntArray | int,
    max_output_tokens: IntArray | int,
    slack: float = 1.0,
    prompt_cap: int | None = None,
    output_cap: int | None = None,
) -> tuple[IntArray, IntArray, IntArray]:
    """(prompt, output, max_tokens) fitted to the caps and to the model.

    Token counts are at least 1 and at most the caps; ``max_tokens = ceil(output * slack)``,
    at most the model's ``max_output_tokens``. When prompt + max_tokens exceeds
    ``max_context`` the prompt is cut first, to no less than ``max_context // 2``, then
    max_tokens; ``output`` never exceeds ``max_tokens``.
    """
    prompt = np.clip(prompt, 1, prompt_cap).astype(np.int64)
    output = np.clip(output, 1, output_cap).astype(np.int64)
    context = np.asarray(max_context, dtype=np.int64)
    max_tokens = np.ceil(output * slack).astype(np.int64)
    max_tokens = np.minimum(max_tokens, np.minimum(max_output_tokens, context - 1))
    over = prompt + max_tokens > context
    if over.any():
        cut = np.maximum(context - max_tokens, np.minimum(prompt, context // 2))
        prompt = np.where(over, cut, prompt)
        max_tokens = np.minimum(max_tokens, context - prompt)
    output = np.minimum(output, max_tokens)
    return prompt, output, max_tokens


# --- requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StreamDraw:
    requests: list[SimRequest]
    arrival_s: np.ndarray


def _stream_requests(spec: ScenarioSpec, index: int, stream: StreamSpec) -> _StreamDraw:
    seeds = np.random.SeedSequence([spec.seed, index]).spawn(3)
    arrival_rng, length_rng, model_rng = (np.random.default_rng(s) for s in seeds)
    start = stream.start_s
    end = min(stream.end_s if stream.end_s is not None else spec.duration_s, spec.duration_s)
    trace_rows: _TraceRows | None = None
    try:
        if stream.arrival.process == "trace":
            assert stream.arrival.trace is not None
            times, rows = _trace_window(stream.arrival, start, end)
            trace_rows = (_load_trace(stream.arrival.trace), rows)
        else:
            times = arrival_times(stream.arrival, start, end, arrival_rng)
    except ScenarioError as e:
        raise ScenarioError(f"streams.{index}.arrival.trace: {e}") from e
    n = len(times)
    prompt, output = _sample_lengths(stream.lengths, n, length_rng, trace_rows)

    specs = [spec.model_spec(m) for m in stream.models]
    if len(specs) == 1:
        picks = np.zeros(n, dtype=np.int64)
    else:
        weights = np.asarray(stream.model_weights or [1.0] * len(specs), dtype=np.float64)
        picks = model_rng.choice(len(specs), size=n, p=weights / weights.sum())
    context = np.asarray([s.max_context for s in specs], dtype=np.int64)[picks]
    output_limit = np.asarray([s.max_output_tokens for s in specs], dtype=np.int64)[picks]
    prompt, output, max_tokens = fit_lengths(
        prompt,
        output,
        max_context=context,
        max_output_tokens=output_limit,
        slack=stream.max_tokens_slack,
        prompt_cap=stream.lengths.max_prompt_tokens,
        output_cap=stream.lengths.max_output_tokens,
    )

    name, slo_class = stream.name, stream.slo_class
    e2e, ttft = stream.e2e_slo_s, stream.ttft_slo_s
    models = np.asarray(stream.models, dtype=object)[picks].tolist()
    requests = [
        SimRequest(f"{name}-{k}", model, t, p, o, m, slo_class, e2e, ttft, name)
        for k, (model, t, p, o, m) in enumerate(
            zip(
                models,
                times.tolist(),
                prompt.tolist(),
                output.tolist(),
                max_tokens.tolist(),
                strict=True,
            )
        )
    ]
    return _StreamDraw(requests, times)


def build_requests(spec: ScenarioSpec) -> list[SimRequest]:
    """Every stream's requests, sorted by (arrival_s, request_id); deterministic in spec.seed."""
    draws = [_stream_requests(spec, i, stream) for i, stream in enumerate(spec.streams)]
    requests = [r for draw in draws for r in draw.requests]
    if not requests:
        log.warning("workload_empty", scenario=spec.name)
        return []
    times = np.concatenate([draw.arrival_s for draw in draws])
    order = np.argsort(times, kind="stable")
    ordered = order.tolist()
    _break_ties(ordered, times[order], requests)
    log.info("workload_built", scenario=spec.name, requests=len(requests), streams=len(draws))
    return [requests[k] for k in ordered]


def _break_ties(order: list[int], sorted_times: np.ndarray, requests: list[SimRequest]) -> None:
    """Order equal arrival times by request id (ties are rare: only replayed traces have them)."""
    tied = np.flatnonzero(sorted_times[1:] == sorted_times[:-1]).tolist()
    runs: list[list[int]] = []
    for k in tied:
        if runs and runs[-1][1] == k:
            runs[-1][1] = k + 1
        else:
            runs.append([k, k + 1])
    for first, last in runs:
        order[first : last + 1] = sorted(
            order[first : last + 1], key=lambda j: requests[j].request_id
        )
