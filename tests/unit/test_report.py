"""Reports from hand-built (request, reply) pairs: attainment, throughput, percentiles, tables."""

from __future__ import annotations

import json

import pytest

from qlm.client import ReplayResult
from qlm.tooling.report import Report, format_comparison, slo_met
from qlm.types import (
    SLO,
    ErrorCode,
    ErrorMessage,
    RequestMessage,
    ResultMessage,
    SLOOutcome,
    Timestamps,
    Usage,
)

T0 = 1_700_000_000.0


def req(
    rid: str, *, cls: str | None, e2e_ms: int | None = None, ttft_ms: int | None = None
) -> RequestMessage:
    return RequestMessage(
        request_id=rid,
        model="mistral-7b",
        prompt_token_ids=[1] * 10,
        max_tokens=20,
        slo=SLO(e2e_ms=e2e_ms, ttft_ms=ttft_ms, slo_class=cls),
    )


def done(
    r: RequestMessage, *, at: float, ttft: float, e2e: float, tokens: int = 20, met: bool = True
) -> ResultMessage:
    return ResultMessage(
        request_id=r.request_id,
        model=r.model,
        output_text="",
        output_token_ids=[0] * tokens,
        finish_reason="length",
        usage=Usage(prompt_tokens=10, completion_tokens=tokens),
        timestamps=Timestamps(
            submitted=T0 + at,
            queued=T0 + at,
            started=T0 + at,
            first_token=T0 + at + ttft,
            finished=T0 + at + e2e,
        ),
        slo=SLOOutcome(met=met),
        instance_id="i0",
        attempts=1,
    )


def error(r: RequestMessage, code: ErrorCode) -> ErrorMessage:
    return ErrorMessage(request_id=r.request_id, code=code, message="no")


def sample_pairs() -> list[tuple[RequestMessage, ResultMessage | ErrorMessage | None]]:
    chat = [req(f"c{i}", cls="chat", e2e_ms=2_000) for i in range(4)]
    batch = [req(f"b{i}", cls="batch", e2e_ms=60_000, ttft_ms=5_000) for i in range(3)]
    plain = req("p0", cls=None, ttft_ms=500)
    return [
        (chat[0], done(chat[0], at=0.0, ttft=0.1, e2e=1.0)),  # met
        (chat[1], done(chat[1], at=1.0, ttft=0.2, e2e=2.5, met=False)),  # late
        (chat[2], error(chat[2], ErrorCode.PROMPT_TOO_LONG)),
        (chat[3], None),  # lost
        (batch[0], done(batch[0], at=2.0, ttft=1.0, e2e=8.0, tokens=40)),  # met
        (batch[1], done(batch[1], at=3.0, ttft=6.0, e2e=7.0)),  # TTFT missed, coordinator says met
        (batch[2], error(batch[2], ErrorCode.ENGINE_ERROR)),
        (plain, done(plain, at=4.0, ttft=0.4, e2e=6.0)),  # met (TTFT only)
    ]


def test_counts_attainment_and_errors() -> None:
    report = Report.build(sample_pairs(), duplicates=1)
    data = report.to_json()
    assert (data["requests_sent"], data["replies"], data["errors"], data["lost"]) == (8, 7, 2, 1)
    assert data["completed"] == 5 and data["duplicates"] == 1
    assert data["errors_by_code"] == {"engine_error": 1, "prompt_too_long": 1}
    assert data["slo_attainment"] == {"batch": 1 / 3, "chat": 1 / 4, "default": 1.0}
    assert data["slo_attainment_overall"] == pytest.approx(3 / 8)
    assert data["classes"]["chat"] == {
        "requests": 4,
        "completed": 2,
        "met": 1,
        "errors": 1,
        "lost": 1,
        "attainment": 0.25,
        "latency_s": {"p50": 1.75, "p99": pytest.approx(2.485), "mean": 1.75},
    }
    # batch[1] missed its TTFT deadline although the reply said met.
    assert data["slo_disagreements"] == 1
    json.dumps(data)  # serialisable as is


def test_throughput_and_latency_percentiles() -> None:
    report = Report.build(sample_pairs())
    # Window: first submission (T0) to last finish (T0 + 10.0, batch[0] and batch[1]).
    assert report.window_s == pytest.approx(10.0)
    assert report.throughput_rps == pytest.approx(5 / 10.0)
    assert report.output_tokens_per_s == pytest.approx((20 * 4 + 40) / 10.0)
    e2e = sorted([1.0, 2.5, 8.0, 7.0, 6.0])
    assert report.e2e_s.p50 == pytest.approx(6.0)
    # linear interpolation between the two largest: 7.0 + 0.96 * (8.0 - 7.0)
    assert report.e2e_s.p99 == pytest.approx(7.96)
    assert report.e2e_s.mean == pytest.approx(sum(e2e) / 5)
    assert report.ttft_s.p50 == pytest.approx(0.4)
    assert report.to_json()["latency_s"]["p50"] == pytest.approx(6.0)
    assert Report.build(sample_pairs(), window_s=20.0).throughput_rps == pytest.approx(0.25)


def test_slo_met_checks_both_deadlines() -> None:
    r = req("x", cls="c", e2e_ms=1000, ttft_ms=100)
    assert slo_met(r, done(r, at=0, ttft=0.1, e2e=1.0))
    assert not slo_met(r, done(r, at=0, ttft=0.1001, e2e=0.5))
    assert not slo_met(r, done(r, at=0, ttft=0.05, e2e=1.001))


def test_empty_report() -> None:
    data = Report.build([]).to_json()
    assert data["requests_sent"] == 0 and data["throughput_rps"] == 0.0
    assert data["latency_s"] == {"p50": None, "p99": None, "mean": None}
    assert data["slo_attainment"] == {} and data["slo_attainment_overall"] is None
    assert "requests sent" in Report.build([]).format_table()


def test_from_replay_uses_the_replay_window_and_skips_unconfirmed() -> None:
    pairs = sample_pairs()
    unconfirmed = req("never-sent", cls="chat", e2e_ms=1)
    sent_at = {r.request_id: T0 for r, _ in pairs}
    result = ReplayResult(
        sent=8,
        replies=7,
        errors=2,
        duplicates=3,
        lost=1,
        publish_failures=1,
        started_at=T0,
        finished_at=T0 + 20.0,
        max_send_lag_s=0.0,
        results=[*pairs, (unconfirmed, None)],
        sent_at=sent_at,
    )
    report = Report.from_replay(result)
    assert (report.requests_sent, report.lost, report.duplicates) == (8, 1, 3)
    assert report.publish_failures == 1
    assert report.window_s == 20.0 and report.throughput_rps == pytest.approx(5 / 20)


def test_tables_show_every_class_and_policy_side_by_side() -> None:
    a = Report.build(sample_pairs())
    b = Report.build(sample_pairs()[:2])
    table = a.format_table()
    assert "SLO attained: chat" in table and "25.0 % (1/4)" in table
    assert "  prompt_too_long" in table
    both = format_comparison({"fcfs": b, "edf": a})
    lines = both.splitlines()
    assert lines[0].split() == ["metric", "fcfs", "edf"]
    row = next(line for line in lines if line.startswith("SLO attained: batch"))
    assert row.split()[3:] == ["-", "33.3", "%", "(1/3)"]  # fcfs had no batch requests
    sent = next(line for line in lines if line.startswith("requests sent"))
    assert sent.split()[-2:] == ["2", "8"]
    # every row has the same label width, so the columns line up
    assert len({len(line) for line in lines[2:]}) == 1
