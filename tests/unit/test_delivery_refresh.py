"""The rules of a refreshed delivery (qlm/coordinator/refresh.py): when a worn delivery is
refreshed, which deliveries count as the coordinator's own copies, and what a copy carries."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import aio_pika

from qlm.coordinator import refresh


def _delivery(
    headers: dict[str, Any] | None = None, *, redelivered: bool = False, user_id: str | None = None
) -> Any:
    return SimpleNamespace(
        headers=headers,
        redelivered=redelivered,
        user_id=user_id,
        body=b'{"request_id":"r1"}',
        content_type="application/json",
        content_encoding=None,
        priority=3,
        correlation_id="c1",
        reply_to="amq.rabbitmq.reply-to.abc",
        message_id="r1",
        timestamp=None,
        type="request",
        app_id="bench",
        expiration=60,
    )


def test_the_threshold_is_half_the_limit_and_at_least_one() -> None:
    assert refresh.refresh_threshold(20) == 10
    assert refresh.refresh_threshold(3) == 1
    assert refresh.refresh_threshold(1) == 1


def test_only_the_brokers_count_of_a_redelivery_counts() -> None:
    # a producer can write the header on a first delivery: it is not the broker's count
    assert refresh.broker_count(_delivery({"x-delivery-count": 99})) == 0
    assert refresh.broker_count(_delivery({"x-delivery-count": 7}, redelivered=True)) == 7
    assert refresh.broker_count(_delivery(None, redelivered=True)) == 0
    assert refresh.broker_count(_delivery({"x-delivery-count": "7"}, redelivered=True)) == 0


def test_a_copy_is_believed_only_under_the_coordinators_own_user() -> None:
    headers = {refresh.REFRESHES_HEADER: 2, refresh.USER_HEADER: "alice"}
    assert refresh.refreshes_of(_delivery(headers, user_id="qlm"), "qlm") == 2
    # a producer (another broker user, which the broker verifies) claiming to be a copy
    assert refresh.refreshes_of(_delivery(headers, user_id="mallory"), "qlm") is None
    assert refresh.refreshes_of(_delivery(headers), "qlm") is None
    # malformed counts are not copies
    for bad in (0, -1, True, "2", None):
        forged = {refresh.REFRESHES_HEADER: bad}
        assert refresh.refreshes_of(_delivery(forged, user_id="qlm"), "qlm") is None


def test_a_fresh_copy_keeps_the_request_and_drops_the_brokers_headers() -> None:
    worn = _delivery(
        {
            "x-delivery-count": 10,
            "x-death": [{"reason": "rejected"}],
            "traceparent": "00-abc-def-01",
            refresh.USER_HEADER: "forged",
        },
        redelivered=True,
        user_id="alice",
    )
    copy = refresh.fresh_copy(worn, refreshes=3, own_user="qlm", producer_user="alice")
    assert isinstance(copy, aio_pika.Message)
    assert copy.body == worn.body
    assert copy.headers == {
        "traceparent": "00-abc-def-01",
        refresh.REFRESHES_HEADER: 3,
        refresh.USER_HEADER: "alice",
    }
    assert (copy.message_id, copy.correlation_id, copy.reply_to) == (
        "r1",
        "c1",
        "amq.rabbitmq.reply-to.abc",
    )
    assert copy.user_id == "qlm"  # the broker checks it against the coordinator's connection
    assert copy.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert copy.expiration is None  # taken in: it must not expire while queued again
    assert (copy.content_type, copy.priority, copy.type) == ("application/json", 3, "request")
    # a copy of a producer without a broker user (body identity) carries none
    bare = refresh.fresh_copy(worn, refreshes=1, own_user="qlm", producer_user=None)
    assert refresh.USER_HEADER not in (bare.headers or {})
    assert refresh.original_user(_delivery(copy.headers, user_id="qlm")) == "alice"
