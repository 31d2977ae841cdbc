"""Pure parts of the Batch API: request ids of lines, completion windows, release pacing."""

from __future__ import annotations

from typing import Any, cast

import pytest

from qlm.gateway.app import GatewayError
from qlm.gateway.batch_runner import BatchRunner, line_request_id, parse_line_request_id
from qlm.gateway.batches import BatchSettings, default_reply_queue, window_seconds
from qlm.store.batches import Counts
from qlm.types import RequestMessage


def test_line_request_ids_round_trip_and_are_protocol_request_ids() -> None:
    rid = line_request_id("batch_0123abcd", 42, 3)
    assert rid == "batch-0123abcd-42-3"
    assert parse_line_request_id(rid) == ("batch_0123abcd", 42, 3)
    RequestMessage(request_id=rid, model="m", prompt="p", max_tokens=1, slo={"e2e_ms": 1})
    for other in ("gw-1234", "batch-x-1", "batch-a-b-c", ""):
        assert parse_line_request_id(other) is None


def test_completion_windows() -> None:
    s = BatchSettings()
    assert window_seconds("24h", s) == 86_400
    assert window_seconds("1h", s) == 3_600
    assert window_seconds("30m", s) == 1_800
    assert window_seconds("2d", s) == 172_800
    for bad in ("24", "0h", "h", "8d", "1.5h", "24 h", "-1h"):
        with pytest.raises(GatewayError) as err:
            window_seconds(bad, s)
        assert err.value.body.error.code == "invalid_completion_window"


def test_the_reply_queue_is_per_database_and_ignores_the_password() -> None:
    amqp = "amqp://gw:secret@broker:5672/"
    a = default_reply_queue(amqp, "postgresql+asyncpg://u:one@db/qlm")
    assert a.startswith("qlm.reply.gw.batches.")
    assert a == default_reply_queue(amqp, "postgresql+asyncpg://u:two@db/qlm")
    assert a != default_reply_queue(amqp, "postgresql+asyncpg://u:one@db/other")


def _runner(**kw: Any) -> BatchRunner:
    return BatchRunner(cast(Any, None), cast(Any, None), **kw)


def test_release_is_windowed_and_paced() -> None:
    r = _runner(pace=0.75, max_in_flight=500)
    batch = {"created_at": 1000.0, "window_s": 3600.0}
    spread = 0.75 * 3600

    def counts(pending: int, published: int, valid: int = 10_000) -> Counts:
        return Counts(
            total=valid, completed=0, failed=0, open=pending + published,
            pending=pending, published=published, valid=valid,
        )  # fmt: skip

    # at the start: the in-flight window
    assert r._allowed(batch, counts(10_000, 0), 1000.0) == 500
    # the window is full and nothing is due by the pace yet
    assert r._allowed(batch, counts(9_500, 500), 1001.0) == 0
    # 200 answered: 200 more
    assert r._allowed(batch, counts(9_300, 300), 1002.0) == 200
    # half way along the pace line, the cluster answering nothing: the pace wins
    assert r._allowed(batch, counts(9_500, 500), 1000.0 + spread / 2) == 4_500
    # past the pace's end: everything
    assert r._allowed(batch, counts(9_500, 500), 1000.0 + spread) == 9_500
    assert _runner(pace=0)._allowed(batch, counts(10_000, 0), 1000.0) is None
