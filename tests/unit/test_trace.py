"""Trace loading (the shipped Azure 2023 trace and generic CSVs) and request building."""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.catalog import ModelCatalog, UnknownModelError
from qlm.trace import (
    SLOClassSpec,
    TraceRecord,
    load_azure_trace,
    load_jsonl_requests,
    load_request_lengths,
    load_trace_csv,
    poisson_trace,
    prompt_token_ids,
    to_requests,
)
from qlm.types import SLO, RequestMessage

CATALOG = ModelCatalog()
CLASSES = [
    SLOClassSpec(name="interactive", weight=0.8, e2e_ms=10_000),
    SLOClassSpec(name="batch", weight=0.2, e2e_ms=600_000, ttft_ms=60_000),
]


def _seconds_between(a: str, b: str) -> Decimal:
    """Exact seconds between two Azure timestamps (7 fractional digits)."""
    (wa, fa), (wb, fb) = a.split("."), b.split(".")
    whole = (datetime.fromisoformat(wb) - datetime.fromisoformat(wa)).total_seconds()
    return Decimal(int(whole)) + Decimal(f"0.{fb}") - Decimal(f"0.{fa}")


# --- the shipped Azure trace -----------------------------------------------------------------


def test_conv_trace_has_every_row_in_order_from_zero() -> None:
    records = load_azure_trace("conv")
    assert len(records) == 19_366
    # first and last data rows of AzureLLMInferenceTrace_conv.csv
    assert records[0] == TraceRecord(0.0, 374, 44)
    last = _seconds_between("2023-11-16 18:15:46.6805900", "2023-11-16 19:14:08.4025270")
    assert records[-1].arrival_s == pytest.approx(float(last), abs=1e-7)
    assert (records[-1].prompt_tokens, records[-1].output_tokens) == (197, 183)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(records, records[1:], strict=False))


def test_code_trace_window_is_rebased_to_its_start() -> None:
    full = load_azure_trace("code")
    assert len(full) == 8_819
    window = load_azure_trace("code", start_s=600, duration_s=60)
    expected = [r for r in full if 600 <= r.arrival_s < 660]
    assert len(window) == len(expected) > 0
    for w, r in zip(window, expected, strict=True):
        assert w.arrival_s == pytest.approx(r.arrival_s - 600)
        assert (w.prompt_tokens, w.output_tokens) == (r.prompt_tokens, r.output_tokens)
    assert all(0 <= w.arrival_s < 60 for w in window)
    with pytest.raises(ValueError, match="unknown Azure trace"):
        load_azure_trace("chat")  # type: ignore[arg-type]


def test_packaged_data_is_read_from_the_package_not_from_shared() -> None:
    import qlm

    data = Path(qlm.__file__).parent / "data"
    for folder in ("azure-llm-inference-2023", "request-lengths"):
        assert (data / folder / "LICENSE").is_file()
        assert (data / folder / "README.md").is_file()
    assert "Splitwise" in (data / "azure-llm-inference-2023" / "README.md").read_text()


def test_request_length_sets_and_poisson_arrivals() -> None:
    sharegpt = load_request_lengths("sharegpt")
    assert len(sharegpt) == 30_731 and sharegpt[0] == (74, 918)
    assert len(load_request_lengths("arxiv")) == 28_257
    trace = poisson_trace(sharegpt, rate_rps=4.0, count=4000, seed=3)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:], strict=False)]
    assert all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.06)
    assert poisson_trace(sharegpt, rate_rps=4.0, count=50, seed=3) == trace[:50]


# --- generic CSVs ----------------------------------------------------------------------------


def test_azure_schema_csv_keeps_all_seven_fraction_digits(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.0000001,10,1\n"
        "2023-11-17 00:00:01.0000000,20,2\n"
        "2023-11-17 00:00:01.9999999,30,3\n"
    )
    records = load_trace_csv(path)
    assert [r.arrival_s for r in records] == [0.0, 1.9999999, 2.9999998]
    assert [(r.prompt_tokens, r.output_tokens) for r in records] == [(10, 1), (20, 2), (30, 3)]


def test_generic_csv_is_sorted_and_validated(tmp_path: Path) -> None:
    path = tmp_path / "generic.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n2.5,100,10\n0.5,50,5\n0.5,60,6\n")
    assert load_trace_csv(path) == [
        TraceRecord(0.5, 50, 5),
        TraceRecord(0.5, 60, 6),
        TraceRecord(2.5, 100, 10),
    ]
    bad_columns = tmp_path / "bad.csv"
    bad_columns.write_text("when,prompt,output\n1,2,3\n")
    with pytest.raises(ValueError, match="unknown trace columns"):
        load_trace_csv(bad_columns)
    negative = tmp_path / "negative.csv"
    negative.write_text("arrival_s,prompt_tokens,output_tokens\n1,-2,3\n")
    with pytest.raises(ValueError, match="negative prompt_tokens"):
        load_trace_csv(negative)


# --- building requests -----------------------------------------------------------------------


def test_requests_get_unique_ids_round_robin_models_and_weighted_classes() -> None:
    records = [TraceRecord(i * 0.01, 100 + i % 50, 10 + i % 7) for i in range(10_000)]
    timed = to_requests(
        records,
        models=["mistral-7b", "vicuna-13b"],
        slo_classes=CLASSES,
        seed=7,
        catalog=CATALOG,
    )
    assert len({req.request_id for _, req in timed}) == 10_000
    assert timed[0][1].request_id == "req-0"
    assert [req.model for _, req in timed[:4]] == ["mistral-7b", "vicuna-13b"] * 2
    assert [t for t, _ in timed] == [r.arrival_s for r in records]
    shares = Counter(req.slo.slo_class for _, req in timed)
    assert shares["interactive"] / 10_000 == pytest.approx(0.8, abs=0.02)
    assert {req.slo for _, req in timed} == {
        SLO(e2e_ms=10_000, slo_class="interactive"),
        SLO(e2e_ms=600_000, ttft_ms=60_000, slo_class="batch"),
    }
    for (_, req), rec in zip(timed, records, strict=True):
        assert req.prompt_tokens() == rec.prompt_tokens
        assert req.max_tokens == rec.output_tokens
        assert req.sampling.ignore_eos
    assert timed.clipped == 0


def test_same_seed_same_workload_other_seed_other_classes() -> None:
    records = load_azure_trace("code", duration_s=120)
    kw = {"models": ["mistral-7b", "vicuna-13b"], "slo_classes": CLASSES, "catalog": CATALOG}
    a = to_requests(records, seed=1, model_choice="random", **kw)  # type: ignore[arg-type]
    b = to_requests(records, seed=1, model_choice="random", **kw)  # type: ignore[arg-type]
    c = to_requests(records, seed=2, model_choice="random", **kw)  # type: ignore[arg-type]
    assert a == b
    assert [r.slo for _, r in a] != [r.slo for _, r in c]
    assert [r.model for _, r in a] != [r.model for _, r in c]


def test_the_full_code_trace_is_clipped_to_fit_a_4k_model() -> None:
    records = load_azure_trace("code")
    spec = CATALOG.get("vicuna-13b")
    timed = to_requests(
        records, models=["vicuna-13b"], slo_classes=CLASSES, seed=0, catalog=CATALOG
    )
    too_long = sum(r.prompt_tokens + r.output_tokens > spec.max_context for r in records)
    assert too_long > 1000  # the trace has long code-completion prompts
    assert timed.clipped == too_long
    for (_, req), rec in zip(timed, records, strict=True):
        assert req.prompt_tokens() + req.max_tokens <= spec.max_context
        assert req.max_tokens == min(rec.output_tokens, spec.max_output_tokens)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.builds(
            TraceRecord,
            arrival_s=st.floats(0, 1e4, allow_nan=False),
            prompt_tokens=st.integers(0, 20_000),
            output_tokens=st.integers(0, 10_000),
        ),
        min_size=1,
        max_size=20,
    ),
    st.sampled_from(sorted(CATALOG.names())),
)
def test_every_built_request_fits_its_model(records: list[TraceRecord], model: str) -> None:
    spec = CATALOG.get(model)
    timed = to_requests(records, models=[model], slo_classes=CLASSES, seed=0, catalog=CATALOG)
    changed = 0
    for (_, req), rec in zip(timed, records, strict=True):
        assert 1 <= req.max_tokens <= spec.max_output_tokens
        assert req.prompt_tokens() >= 1 and req.prompt_tokens() + req.max_tokens <= spec.max_context
        changed += (req.prompt_tokens(), req.max_tokens) != (rec.prompt_tokens, rec.output_tokens)
    assert timed.clipped == changed


def test_bad_arguments_fail_early() -> None:
    records = [TraceRecord(0, 10, 10)]
    with pytest.raises(UnknownModelError):
        to_requests(records, models=["gpt-17"], slo_classes=CLASSES, seed=0, catalog=CATALOG)
    with pytest.raises(ValueError):
        to_requests(records, models=[], slo_classes=CLASSES, seed=0, catalog=CATALOG)
    with pytest.raises(ValueError, match="needs e2e_ms and/or ttft_ms"):
        SLOClassSpec(name="none", weight=1.0)
    with pytest.raises(ValueError, match="weight"):
        SLOClassSpec(name="zero", weight=0.0, e2e_ms=1)


def test_prompt_ids_are_deterministic_and_differ_between_requests() -> None:
    assert prompt_token_ids(5, 300) == prompt_token_ids(5, 300)
    assert prompt_token_ids(5, 100) == prompt_token_ids(5, 300)[:100]
    assert prompt_token_ids(5, 300) != prompt_token_ids(6, 300)
    assert len(prompt_token_ids(0, 10_000)) == 10_000
    assert all(0 < t < 32_000 for t in prompt_token_ids(9, 500))


# --- JSONL for `qlm submit` ------------------------------------------------------------------


def test_jsonl_requests(tmp_path: Path) -> None:
    reqs = [
        RequestMessage(
            request_id=f"j-{i}", model="mistral-7b", prompt="hi", max_tokens=4, slo=SLO(e2e_ms=9)
        )
        for i in range(2)
    ]
    path = tmp_path / "r.jsonl"
    path.write_text(reqs[0].model_dump_json() + "\n\n" + reqs[1].model_dump_json() + "\n")
    assert load_jsonl_requests(path) == reqs
    path.write_text(reqs[0].model_dump_json() + "\n" + json.dumps({"request_id": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"r\.jsonl:2"):
        load_jsonl_requests(path)
