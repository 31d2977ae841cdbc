"""Workload generation: arrival processes, trace replay, lengths fitted to the models, requests."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qlm.catalog import MODELS
from qlm.tooling.simulator.scenario import ArrivalSpec, ScenarioError, ScenarioSpec
from qlm.tooling.simulator.workload import arrival_times, build_requests, fit_lengths
from qlm.trace import load_azure_trace


def _stream(name: str = "chat", **extra: Any) -> dict[str, Any]:
    stream: dict[str, Any] = {
        "name": name,
        "models": ["mistral-7b"],
        "slo_class": "interactive",
        "e2e_slo_s": 20,
        "arrival": {"process": "poisson", "rate_rps": 20.0},
        "lengths": {"source": "sharegpt"},
    }
    stream.update(extra)
    return stream


def scenario(*streams: dict[str, Any], seed: int = 0, duration_s: float = 100) -> ScenarioSpec:
    return ScenarioSpec.model_validate(
        {
            "name": "w",
            "duration_s": duration_s,
            "seed": seed,
            "models": {"vicuna-ft": "vicuna-13b"},
            "pools": [
                {
                    "gpu": "A100-80GB",
                    "count": 2,
                    "models": ["mistral-7b", "vicuna-13b", "vicuna-ft", "llama-2-70b"],
                }
            ],
            "streams": list(streams) or [_stream()],
        }
    )


def _write_csv(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    lines = ["arrival_s,prompt_tokens,output_tokens"] + [f"{t},{p},{o}" for t, p, o in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


# --- arrival processes -----------------------------------------------------------------------


def test_poisson_rate_and_window() -> None:
    spec = ArrivalSpec(process="poisson", rate_rps=50.0)
    times = arrival_times(spec, 100.0, 2100.0, np.random.default_rng(1))
    assert times.min() >= 100.0 and times.max() < 2100.0
    assert np.all(np.diff(times) >= 0)
    assert len(times) / 2000.0 == pytest.approx(50.0, rel=0.02)
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)  # exponential: cv = 1
    assert times[0] - 100.0 < 1.0  # starts at the window, not at 0


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_cv_and_rate(cv: float) -> None:
    spec = ArrivalSpec(process="gamma", rate_rps=100.0, cv=cv)
    times = arrival_times(spec, 0.0, 2000.0, np.random.default_rng(2))
    assert times.min() >= 0.0 and times.max() < 2000.0
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)
    assert len(times) / 2000.0 == pytest.approx(100.0, rel=0.05)


def test_a_burst_arrives_at_once_at_the_window_start() -> None:
    spec = ArrivalSpec(process="burst", count=7)
    rng = np.random.default_rng(0)
    assert arrival_times(spec, 30.0, 60.0, rng).tolist() == [30.0] * 7
    assert arrival_times(spec, 60.0, 60.0, rng).tolist() == []  # an empty window: none


def test_arrivals_are_reproducible_from_the_generator() -> None:
    spec = ArrivalSpec(process="gamma", rate_rps=5.0, cv=2.0)
    a = arrival_times(spec, 0, 100, np.random.default_rng(7))
    b = arrival_times(spec, 0, 100, np.random.default_rng(7))
    c = arrival_times(spec, 0, 100, np.random.default_rng(8))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_trace_replay_keeps_the_gaps_and_offsets(tmp_path: Path) -> None:
    # Rows out of order and with their own origin (1000 s): replay sorts and rebases them.
    stamps = [1000.0, 1000.5, 1003.0, 1003.25, 1010.0, 1002.0]
    path = _write_csv(tmp_path / "t.csv", [(t, 10, 5) for t in stamps])
    spec = ArrivalSpec(process="trace", trace=str(path))
    times = arrival_times(spec, 20.0, 1000.0, np.random.default_rng(0))
    assert times.tolist() == [20.0, 20.5, 22.0, 23.0, 23.25, 30.0]
    # Clipped to the window's end.
    assert arrival_times(spec, 20.0, 23.0, np.random.default_rng(0)).tolist() == [20, 20.5, 22]
    # Offset into the trace: rows from 2.5 s after its first one, the offset moved to start_s.
    offset = ArrivalSpec(process="trace", trace=str(path), start_s=2.5)
    assert arrival_times(offset, 0.0, 100.0, np.random.default_rng(0)).tolist() == [
        0.5,
        0.75,
        7.5,
    ]


def test_trace_scaling_hits_the_target_rate(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    stamps = np.cumsum(rng.exponential(1.0, 2000))  # about 1 req/s, irregular
    path = _write_csv(tmp_path / "t.csv", [(float(t), 10, 5) for t in stamps])
    spec = ArrivalSpec(process="trace", trace=str(path), rate_rps=4.0)
    times = arrival_times(spec, 0.0, 1e9, rng)
    assert len(times) == 2000
    assert (len(times) - 1) / (times[-1] - times[0]) == pytest.approx(4.0, rel=1e-9)
    # The shape is kept: every gap shrinks by the same factor.
    ratio = np.diff(times) / np.diff(stamps)
    assert np.allclose(ratio, ratio[0])


def test_shipped_azure_trace_replay() -> None:
    records = load_azure_trace("conv", duration_s=300)
    spec = ArrivalSpec(process="trace", trace="conv")
    times = arrival_times(spec, 0.0, 300.0, np.random.default_rng(0))
    assert np.allclose(times, [r.arrival_s for r in records])
    doubled = ArrivalSpec(process="trace", trace="conv", rate_rps=2 * 19366 / 3501.72)
    fast = arrival_times(doubled, 0.0, 300.0, np.random.default_rng(0))
    assert len(load_azure_trace("conv", duration_s=600)) == pytest.approx(len(fast), abs=2)
    assert fast.max() < 300.0


# --- lengths ---------------------------------------------------------------------------------


def test_fit_lengths_cuts_the_prompt_first_then_the_output() -> None:
    ctx = MODELS["vicuna-13b"].max_context  # 4096
    prompt, output, max_tokens = fit_lengths(
        np.array([3000, 8000, 100, 0]),
        np.array([1500, 3000, 200, 0]),
        max_context=ctx,
        max_output_tokens=4096,
    )
    # 3000 + 1500 > 4096: the prompt is cut to fit (2596 >= 2048), the output is kept.
    # 8000 + 3000: the prompt is cut to 2048 (half the context), then the output to the rest.
    # 100 + 200 fits; zero counts become 1.
    assert prompt.tolist() == [2596, 2048, 100, 1]
    assert output.tolist() == [1500, 2048, 200, 1]
    # no cap: the client asks for what is left of the context, not for the true output
    assert max_tokens.tolist() == [1500, 2048, 3996, 4095]


def test_fit_lengths_clairvoyant_leaks_the_output() -> None:
    prompt, output, max_tokens = fit_lengths(
        np.array([3000, 8000, 100, 0]),
        np.array([1500, 3000, 200, 0]),
        max_context=4096,
        max_output_tokens=4096,
        clairvoyant=True,
    )
    assert prompt.tolist() == [2596, 2048, 100, 1]
    assert max_tokens.tolist() == output.tolist() == [1500, 2048, 200, 1]


def test_fit_lengths_cap_truncates_and_caps() -> None:
    prompt, output, max_tokens = fit_lengths(
        np.array([500, 500, 8000]),
        np.array([100, 7, 900]),
        max_context=8192,
        max_output_tokens=4096,
        cap=64,
        prompt_cap=300,
        output_cap=50,
    )
    assert prompt.tolist() == [300, 300, 300]
    assert output.tolist() == [50, 7, 50]
    assert max_tokens.tolist() == [64, 64, 64]
    # a cap below the drawn output cuts the output there (the engine stops at max_tokens)
    _, output, max_tokens = fit_lengths(
        np.array([10, 10]), np.array([100, 20]), max_context=8192, max_output_tokens=4096, cap=32
    )
    assert output.tolist() == [32, 20]
    assert max_tokens.tolist() == [32, 32]
    # a cap the context cannot hold is clipped to what is left after the prompt
    prompt, _, max_tokens = fit_lengths(
        np.array([8000]), np.array([100]), max_context=8192, max_output_tokens=4096, cap=1024
    )
    assert prompt.tolist() == [8000] and max_tokens.tolist() == [192]


@given(
    st.lists(st.tuples(st.integers(0, 20_000), st.integers(0, 20_000)), min_size=1, max_size=30),
    st.sampled_from([2048, 4096, 8192]),
    st.integers(1, 4096),
    st.one_of(st.none(), st.integers(1, 5000)),
    st.booleans(),
    st.one_of(st.none(), st.integers(1, 10_000)),
    st.one_of(st.none(), st.integers(1, 10_000)),
)
def test_fit_lengths_invariants(
    rows: list[tuple[int, int]],
    ctx: int,
    out_limit: int,
    cap: int | None,
    clairvoyant: bool,
    prompt_cap: int | None,
    output_cap: int | None,
) -> None:
    raw_prompt = np.array([p for p, _ in rows])
    raw_output = np.array([o for _, o in rows])
    prompt, output, max_tokens = fit_lengths(
        raw_prompt,
        raw_output,
        max_context=ctx,
        max_output_tokens=out_limit,
        cap=cap,
        clairvoyant=clairvoyant,
        prompt_cap=prompt_cap,
        output_cap=output_cap,
    )
    assert np.all(prompt >= 1) and np.all(output >= 1)
    assert np.all(output <= max_tokens)
    assert np.all(max_tokens <= min(out_limit, ctx - 1))
    assert np.all(prompt + max_tokens <= ctx)
    assert np.all(prompt <= np.maximum(raw_prompt, 1))
    if clairvoyant:
        assert np.array_equal(max_tokens, output)
    else:  # what the client asks for does not depend on the output
        limit = np.minimum(out_limit, ctx - prompt)
        assert np.array_equal(max_tokens, limit if cap is None else np.minimum(limit, cap))
    if cap is not None:
        assert np.all(output <= cap)
    if prompt_cap is not None:
        assert np.all(prompt <= prompt_cap)
    if output_cap is not None:
        assert np.all(output <= output_cap)
    # A request that already fits is left alone.
    fits = (
        (raw_prompt >= 1)
        & (raw_output >= 1)
        & (raw_prompt + raw_output <= ctx)
        & (raw_output <= out_limit)
        & (raw_output <= (cap or 10**9))
        & (raw_prompt <= (prompt_cap or 10**9))
        & (raw_output <= (output_cap or 10**9))
    )
    assert np.array_equal(prompt[fits], raw_prompt[fits])
    assert np.array_equal(output[fits], raw_output[fits])


# --- requests --------------------------------------------------------------------------------


def test_build_requests_deterministic_sorted_unique() -> None:
    streams = [
        _stream("chat"),
        _stream(
            "batch",
            models=["mistral-7b", "vicuna-ft"],
            slo_class="batch",
            e2e_slo_s=300,
            arrival={"process": "gamma", "rate_rps": 10.0, "cv": 2.0},
            lengths={"source": "arxiv"},
        ),
    ]
    first = build_requests(scenario(*streams, seed=4))
    assert first == build_requests(scenario(*streams, seed=4))
    other = build_requests(scenario(*streams, seed=5))
    assert [r.arrival_s for r in other] != [r.arrival_s for r in first]
    assert [(r.arrival_s, r.request_id) for r in first] == sorted(
        (r.arrival_s, r.request_id) for r in first
    )
    assert len({r.request_id for r in first}) == len(first)
    assert all(0 <= r.arrival_s < 100 for r in first)
    # Ids count each stream's requests in arrival order.
    for name in ("chat", "batch"):
        mine = [r for r in first if r.stream == name]
        assert [r.request_id for r in mine] == [f"{name}-{k}" for k in range(len(mine))]
    batch = [r for r in first if r.stream == "batch"]
    assert {r.slo_class for r in batch} == {"batch"}
    assert {r.e2e_slo_s for r in batch} == {300.0}
    assert {r.ttft_slo_s for r in batch} == {None}
    assert {r.model for r in batch} == {"mistral-7b", "vicuna-ft"}


def test_adding_a_stream_leaves_the_others_alone() -> None:
    one = build_requests(scenario(_stream("chat")))
    two = build_requests(scenario(_stream("chat"), _stream("more", slo_class="batch")))
    assert [r for r in two if r.stream == "chat"] == one


def test_requests_fit_their_model() -> None:
    stream = _stream(
        models=["mistral-7b", "vicuna-13b", "vicuna-ft", "llama-2-70b"],
        lengths={"source": "arxiv", "max_output_tokens": 3000},
    )
    spec = scenario(stream)
    requests = build_requests(spec)
    assert len(requests) > 1000
    for r in requests:
        model = spec.model_spec(r.model)
        assert r.prompt_tokens >= 1 and r.output_tokens >= 1
        assert r.output_tokens <= r.max_tokens <= model.max_output_tokens
        assert r.prompt_tokens + r.max_tokens <= model.max_context
        assert r.output_tokens <= 3000
        # the lengths' clip is the cap, whatever the output (within the model's limits)
        limit = min(model.max_output_tokens, model.max_context - r.prompt_tokens)
        assert r.max_tokens == min(3000, limit)


def test_max_tokens_is_not_the_output_unless_clairvoyant() -> None:
    """The default workload does not tell the policies the true output length through
    max_tokens; a stream's cap is what every request asks for and cuts the output; the
    clairvoyant variant leaks it, and draws the same prompts and outputs."""
    realistic = build_requests(scenario(_stream()))
    assert len(realistic) > 1000
    assert sum(r.max_tokens == r.output_tokens for r in realistic) < len(realistic) / 100
    # mistral-7b's limit, or what its 8192-token context leaves after a long prompt
    assert all(r.max_tokens == min(4096, 8192 - r.prompt_tokens) for r in realistic)
    spec = scenario(_stream()).with_value("clairvoyant_max_tokens", True)
    clairvoyant = build_requests(spec)
    assert all(r.max_tokens == r.output_tokens for r in clairvoyant)
    assert [(r.prompt_tokens, r.output_tokens) for r in clairvoyant] == [
        (r.prompt_tokens, r.output_tokens) for r in realistic
    ]
    capped = build_requests(scenario(_stream(max_tokens=256)))
    # the cap, or less where a long prompt leaves less of the context
    assert all(c.max_tokens == min(256, 8192 - c.prompt_tokens) for c in capped)
    assert all(
        c.output_tokens == min(r.output_tokens, 256) for c, r in zip(capped, realistic, strict=True)
    )
    # an output clip on the lengths is the cap the stream's client sends
    clipped = build_requests(
        scenario(_stream(lengths={"source": "sharegpt", "max_output_tokens": 300}))
    )
    assert all(c.max_tokens == min(300, 8192 - c.prompt_tokens) for c in clipped)


def test_model_weights_are_respected() -> None:
    stream = _stream(models=["mistral-7b", "vicuna-13b"], model_weights=[3, 1])
    counts = Counter(r.model for r in build_requests(scenario(stream, duration_s=1000)))
    share = counts["mistral-7b"] / sum(counts.values())
    assert share == pytest.approx(0.75, abs=0.02)


def test_stream_window_and_fixed_lengths() -> None:
    stream = _stream(
        start_s=30,
        end_s=60,
        lengths={"source": "fixed", "prompt_tokens": 3584, "output_tokens": 512},
    )
    requests = build_requests(scenario(stream))
    assert requests and all(30 <= r.arrival_s < 60 for r in requests)
    assert {(r.prompt_tokens, r.output_tokens, r.max_tokens) for r in requests} == {
        (3584, 512, 4096)
    }
    late = _stream(start_s=90, end_s=500)  # end_s past the scenario is cut at its duration
    assert all(90 <= r.arrival_s < 100 for r in build_requests(scenario(late)))


def test_trace_lengths_come_from_the_arrival_rows(tmp_path: Path) -> None:
    rows = [(0.0, 11, 1), (1.0, 12, 2), (1.5, 13, 3), (4.0, 14, 4)]
    path = _write_csv(tmp_path / "t.csv", rows)
    stream = _stream(
        arrival={"process": "trace", "trace": str(path), "start_s": 1.0},
        lengths={"source": "trace"},
    )
    requests = build_requests(scenario(stream))
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests] == [
        (0.0, 12, 2),
        (0.5, 13, 3),
        (3.0, 14, 4),
    ]


def test_ties_are_ordered_by_request_id(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "t.csv", [(0.0, 10, 5)] * 11 + [(1.0, 10, 5)])
    trace = {"process": "trace", "trace": str(path)}
    streams = [_stream("b", arrival=trace), _stream("a", arrival=copy.deepcopy(trace))]
    ids = [r.request_id for r in build_requests(scenario(*streams))]
    first_second = sorted(f"{s}-{k}" for s in "ab" for k in range(11))
    assert ids == first_second + ["a-11", "b-11"]


def test_azure_lengths_and_trace_replay_together() -> None:
    streams = [
        _stream("conv", arrival={"process": "trace", "trace": "conv"}, lengths={"source": "trace"}),
        _stream("code", lengths={"source": "azure-code"}),
    ]
    requests = build_requests(scenario(*streams, duration_s=60))
    conv = [r for r in requests if r.stream == "conv"]
    records = load_azure_trace("conv", duration_s=60)
    assert len(conv) == len(records)
    ctx = MODELS["mistral-7b"].max_context
    for r, x in zip(conv, records, strict=True):
        assert r.arrival_s == pytest.approx(x.arrival_s)
        if x.prompt_tokens + x.output_tokens <= ctx:  # rows that fit are replayed as recorded
            assert (r.prompt_tokens, r.output_tokens) == (x.prompt_tokens, x.output_tokens)
    code = [r for r in requests if r.stream == "code"]
    assert len(code) == pytest.approx(20 * 60, rel=0.1)
    assert max(r.output_tokens for r in code) > 100  # lengths from the code trace, not fixed


def test_malformed_trace_csv_names_the_row(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "bad.csv", [(0.0, 10, 5), (1.0, -4, 5)])
    stream = _stream(arrival={"process": "trace", "trace": str(path)})
    with pytest.raises(ScenarioError) as caught:
        build_requests(scenario(stream))
    message = str(caught.value)
    assert "streams.0.arrival.trace" in message
    assert str(path) in message
    assert "line 3" in message
    columns = tmp_path / "columns.csv"
    columns.write_text("when,prompt,output\n0,1,1\n")
    stream = _stream(arrival={"process": "trace", "trace": str(columns)})
    with pytest.raises(ScenarioError, match="unknown trace columns"):
        build_requests(scenario(stream))
