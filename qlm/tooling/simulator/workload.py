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

from qlm.engine_model import get_profile
from qlm.tooling.simulator.scenario import (
    ArrivalSpec,
    LengthSpec,
    ScenarioError,
    ScenarioSpec,
    StreamSpec,
)
from qlm.trace import (
    AZURE_FILES,
    TraceRecord,
    load_azure_trace,
    load_request_lengths,
    load_trace_csv,
)
from qlm.types import StageInfo

log = structlog.get_logger(__name__)

IntArray = np.ndarray  # int64 token counts, one per request


@dataclass(slots=True)
class SimRequest:
    request_id: str  # f"{stream}-{k}", k in the stream's arrival order
    model: str
    arrival_s: float  # seconds from the simulation start
    prompt_tokens: int
    output_tokens: int  # what the engine generates: the true length, unknown to policies
    # what the producer asked for (>= output_tokens): the stream's cap or the model's limit,
    # never the true output, except in a scenario run with clairvoyant_max_tokens
    max_tokens: int
    slo_class: str
    e2e_slo_s: float | None
    ttft_slo_s: float | None
    stream: str
    tbt_slo_s: float | None = None  # streaming: mean time between tokens at most this
    # a call of a program (ProgramSpec): it is issued think_s after the last of ``after``
    # finished (arrival_s is then only the program's start); its task's or program's SLO
    after: tuple[str, ...] = ()
    think_s: float = 0.0
    program_id: str | None = None
    program_slo_s: float | None = None  # the whole program's, from its first call's arrival
    task_slo_s: float | None = None  # chain: the task SLA every step carries (qlm/chains.py)
    remaining_s: float = 0.0  # chain: the producer's expected time of the steps after it
    stage: StageInfo | None = None  # tree: its stage (qlm/collective.py)


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
    scaled so their mean rate is ``rate_rps`` if given, shifted to begin at ``start_s``;
    burst: ``count`` arrivals at ``start_s``.
    """
    if spec.process == "trace":
        return _trace_window(spec, start_s, end_s)[0]
    if spec.process == "burst":
        assert spec.count is not None  # the scenario validates it
        return np.full(spec.count if start_s < end_s else 0, start_s)
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
    cap: int | None = None,
    clairvoyant: bool = False,
    prompt_cap: int | None = None,
    output_cap: int | None = None,
) -> tuple[IntArray, IntArray, IntArray]:
    """(prompt, output, max_tokens) fitted to the caps and to the model.

    The true lengths first: token counts are at least 1 and at most ``prompt_cap`` /
    ``output_cap``; the output at most the model's ``max_output_tokens``; when prompt + output
    exceeds ``max_context`` the prompt is cut first, to no less than ``max_context // 2``, then
    the output.

    Then what the client asks for, which cannot depend on the output it has not seen yet:
    ``max_tokens`` is the stream's ``cap`` (None: as much as the model allows, what vLLM's
    OpenAI server fills in when a client sends none), clipped to ``max_output_tokens`` and to
    the context left after the prompt. An output longer than its ``max_tokens`` is cut there,
    as the engine stops at ``max_tokens``. ``clairvoyant``: ``max_tokens`` is the true output
    instead (the old, leaking behaviour, kept only as a labelled variant).
    """
    prompt = np.clip(prompt, 1, prompt_cap).astype(np.int64)
    output = np.clip(output, 1, output_cap).astype(np.int64)
    context = np.asarray(max_context, dtype=np.int64)
    output = np.minimum(output, np.minimum(max_output_tokens, context - 1))
    over = prompt + output > context
    if over.any():
        cut = np.maximum(context - output, np.minimum(prompt, context // 2))
        prompt = np.where(over, cut, prompt)
        output = np.minimum(output, context - prompt)
    # what fits after the prompt: at least the (fitted) output, so no cap below 1
    limit = np.minimum(max_output_tokens, context - prompt)
    max_tokens = limit if cap is None else np.minimum(limit, cap)
    output = np.minimum(output, max_tokens)
    if clairvoyant:
        max_tokens = output
    return prompt, output, np.broadcast_to(max_tokens, output.shape).astype(np.int64)


# --- requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StreamDraw:
    requests: list[SimRequest]
    arrival_s: np.ndarray


def _stream_requests(spec: ScenarioSpec, index: int, stream: StreamSpec) -> _StreamDraw:
    # the first three children are the same whatever the count: adding the program generator
    # left every earlier stream's draws unchanged
    seeds = np.random.SeedSequence([spec.seed, index]).spawn(4)
    arrival_rng, length_rng, model_rng, program_rng = (np.random.default_rng(s) for s in seeds)
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
    specs = [spec.model_spec(m) for m in stream.models]
    if stream.program is not None:
        picks = _model_picks(stream, len(specs), n, model_rng)
        calls = _program_requests(spec, stream, times, picks, length_rng, program_rng)
        return _StreamDraw(calls, np.fromiter((c.arrival_s for c in calls), np.float64))
    prompt, output = _sample_lengths(stream.lengths, n, length_rng, trace_rows)

    picks = _model_picks(stream, len(specs), n, model_rng)
    context = np.asarray([s.max_context for s in specs], dtype=np.int64)[picks]
    output_limit = np.asarray([s.max_output_tokens for s in specs], dtype=np.int64)[picks]
    prompt, output, max_tokens = fit_lengths(
        prompt,
        output,
        max_context=context,
        max_output_tokens=output_limit,
        cap=stream.max_tokens_cap,
        clairvoyant=spec.clairvoyant_max_tokens,
        prompt_cap=stream.lengths.max_prompt_tokens,
        output_cap=stream.lengths.max_output_tokens,
    )

    name, slo_class = stream.name, stream.slo_class
    e2e, ttft = stream.e2e_slo_s, stream.ttft_slo_s
    models = np.asarray(stream.models, dtype=object)[picks].tolist()
    requests = [
        SimRequest(f"{name}-{k}", model, t, p, o, m, slo_class, e2e, ttft, name, stream.tbt_slo_s)
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


def _model_picks(stream: StreamSpec, n_models: int, n: int, rng: np.random.Generator) -> IntArray:
    if n_models == 1:
        return np.zeros(n, dtype=np.int64)
    weights = np.asarray(stream.model_weights or [1.0] * n_models, dtype=np.float64)
    return rng.choice(n_models, size=n, p=weights / weights.sum())


# --- programs of dependent calls -------------------------------------------------------------


def _default_step_s(spec: ScenarioSpec, stream: StreamSpec, model: str) -> float:
    """The producer's profile of one chain step: think time plus the engine model's latency of
    a mean-sized call running alone on the first pool serving the model."""
    program = stream.program
    assert program is not None
    pool = next(p for p in spec.pools if model in p.models)
    profile = get_profile(pool.gpu, spec.model_spec(model), tp=pool.tp)
    prompt, output = _length_table_means(stream.lengths)
    solo = profile.prefill_time(prompt) + profile.decode_segment_time(1, prompt, output)
    return program.think_s + solo


def _length_table_means(lengths: LengthSpec) -> tuple[int, int]:
    if lengths.source == "fixed":
        assert lengths.prompt_tokens is not None and lengths.output_tokens is not None
        return lengths.prompt_tokens, lengths.output_tokens
    prompt, output = _length_table(lengths.source)
    prompt = np.clip(prompt, 1, lengths.max_prompt_tokens)
    output = np.clip(output, 1, lengths.max_output_tokens)
    return int(prompt.mean()), int(output.mean())


def _program_requests(
    spec: ScenarioSpec,
    stream: StreamSpec,
    starts: np.ndarray,
    picks: IntArray,
    length_rng: np.random.Generator,
    rng: np.random.Generator,
) -> list[SimRequest]:
    """The calls of every program of a program stream (ProgramSpec), in program order."""
    program = stream.program
    assert program is not None
    n = len(starts)
    stages = rng.integers(program.stages[0], program.stages[1] + 1, n)
    fan_lo, fan_hi = program.fanout
    shapes = [rng.integers(fan_lo, fan_hi + 1, int(s)).tolist() for s in stages]
    total = sum(sum(f) for f in shapes)
    seg_prompt, seg_output = _sample_lengths(stream.lengths, total, length_rng, None)
    seg_prompt = np.clip(seg_prompt, 1, stream.lengths.max_prompt_tokens)
    seg_output = np.clip(seg_output, 1, stream.lengths.max_output_tokens)
    thinks = (
        rng.exponential(program.think_s, total) if program.think_s > 0 else np.zeros(total)
    ).tolist()
    model_names = [stream.models[int(k)] for k in picks]
    step_s = {
        m: program.step_s if program.step_s is not None else _default_step_s(spec, stream, m)
        for m in set(model_names)
    }
    app_type = program.app_type or stream.name
    chain = program.shape == "chain"
    out: list[SimRequest] = []
    k = 0  # the next call's row in the sampled lengths
    for p, (start, fanouts, model) in enumerate(
        zip(starts.tolist(), shapes, model_names, strict=True)
    ):
        mspec = spec.model_spec(model)
        pid = f"{stream.name}-{p}"
        n_stages = len(fanouts)
        program_slo = program.slo_s * (n_stages if program.slo_per_stage else 1)
        previous: list[SimRequest] = []
        for stage, fanout in enumerate(fanouts):
            current: list[SimRequest] = []
            info = None  # the stage every call of it carries (trees)
            if not chain:
                info = StageInfo(
                    program_id=pid,
                    app_type=app_type,
                    stage_id=f"s{stage}",
                    after=[f"s{stage - 1}"] if stage else [],
                    program_slo_ms=max(1, round(program_slo * 1000)),
                    last_stage=stage == n_stages - 1,
                )
            for call in range(fanout):
                prompt, output = int(seg_prompt[k]), int(seg_output[k])
                think = thinks[k] if stage else 0.0
                k += 1
                if previous and program.context == "accumulate":
                    parent = previous[call % len(previous)]
                    prompt += parent.prompt_tokens + parent.output_tokens
                p_arr, o_arr, m_arr = fit_lengths(
                    np.asarray([prompt]),
                    np.asarray([output]),
                    max_context=mspec.max_context,
                    max_output_tokens=mspec.max_output_tokens,
                    cap=stream.max_tokens_cap,
                    clairvoyant=spec.clairvoyant_max_tokens,
                )
                rid = f"{pid}.{stage}" if chain else f"{pid}.{stage}.{call}"
                current.append(
                    SimRequest(
                        rid,
                        model,
                        start,
                        int(p_arr[0]),
                        int(o_arr[0]),
                        int(m_arr[0]),
                        stream.slo_class,
                        stream.e2e_slo_s,
                        stream.ttft_slo_s,
                        stream.name,
                        stream.tbt_slo_s,
                        after=tuple(r.request_id for r in previous),
                        think_s=think,
                        program_id=pid,
                        program_slo_s=program_slo,
                        task_slo_s=program_slo if chain else None,
                        remaining_s=(n_stages - 1 - stage) * step_s[model] if chain else 0.0,
                        stage=info,
                    )
                )
            out.extend(current)
            previous = current
    return out


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
