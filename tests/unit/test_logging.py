"""qlm/logging.py: JSON lines only on the process's streams, the per-request outcome line, the
GC-pause threshold, and the HiGHS banner turned into a log line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        check=True,
    )


def json_lines(text: str) -> list[dict[str, object]]:
    lines = [x for x in text.splitlines() if x.strip()]
    return [json.loads(x) for x in lines]  # every line is JSON, or this raises


def test_highs_banner_becomes_one_log_line_and_stdout_stays_clean() -> None:
    pytest.importorskip("highspy")
    pytest.importorskip("cvxpy")
    out = run(
        """
        from qlm.logging import configure_logging
        configure_logging()
        from qlm.planner.milp import GroupProblem  # noqa: F401 - the planner's MILP module
        from qlm.logging import absorb_highs_banner
        import cvxpy as cp
        absorb_highs_banner()
        x = cp.Variable(2, integer=True)
        cp.Problem(cp.Maximize(cp.sum(x)), [x <= 1.5, x >= 0]).solve(solver="HIGHS")
        absorb_highs_banner()  # a second call does nothing
        """
    )
    assert out.stdout == ""
    lines = json_lines(out.stderr)
    banners = [x for x in lines if x["event"] == "third_party_output"]
    assert len(banners) == 1 and "HiGHS" in str(banners[0]["text"])


def test_stdlib_logging_and_warnings_are_json_lines_too() -> None:
    out = run(
        """
        import logging, warnings
        from qlm.logging import configure_logging
        configure_logging()
        configure_logging()  # again (in-process CLI runs): still one handler
        logging.getLogger("aiormq").warning("connection %s lost", "x")
        warnings.warn("careful")
        """
    )
    lines = json_lines(out.stderr)
    assert [x["event"] for x in lines][0] == "connection x lost"
    assert lines[0]["logger"] == "aiormq" and lines[0]["level"] == "warning"
    assert "careful" in str(lines[1]["event"]) and len(lines) == 2


def test_request_outcome_line() -> None:
    out = run(
        """
        from qlm.logging import configure_logging, log_request_outcome
        configure_logging()
        log_request_outcome("answered", request_id="r1", tenant="t", model="m",
                            slo_class="chat", instance_id="a-gpu0", latency_s=0.25, met=True)
        log_request_outcome("failed", request_id="r2", code="engine_error", met=False)
        """
    )
    a, f = json_lines(out.stderr)
    assert a["event"] == "request_outcome" and a["outcome"] == "answered"
    assert (a["request_id"], a["tenant"], a["model"], a["slo_class"]) == ("r1", "t", "m", "chat")
    assert (a["instance_id"], a["latency_s"], a["met"]) == ("a-gpu0", 0.25, True)
    assert f["level"] == "warning" and f["code"] == "engine_error"
    with pytest.raises(ValueError):
        from qlm.logging import log_request_outcome

        log_request_outcome("exploded", request_id="r3")


@pytest.mark.parametrize(("threshold_ms", "logged"), [(0.0, False), (0.001, True), (1e6, False)])
def test_gc_pause_warnings_only_above_the_threshold(threshold_ms: float, logged: bool) -> None:
    out = run(
        f"""
        import gc
        from qlm.logging import configure_logging, watch_gc_pauses
        configure_logging()
        watch_gc_pauses({threshold_ms} / 1000)
        junk = [[i] for i in range(200_000)]
        gc.collect()
        """
    )
    events = [x["event"] for x in json_lines(out.stderr)]
    assert ("gc_pause" in events) is logged


def test_gc_pause_threshold_is_a_setting() -> None:
    from qlm.config import Settings

    assert Settings(gc_pause_warn_ms=5).gc_pause_warn_ms == 5
    assert Settings().gc_pause_warn_ms == 50.0
