"""The gateway's per-tenant request rate limits (qlm/gateway/rate_limits.py): token buckets on a
fake clock, and the settings that refuse a limit below one request a minute."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from qlm.gateway.app import GatewaySettings
from qlm.gateway.rate_limits import TenantRateLimits


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_minute_s_worth_in_a_burst_then_the_limit_s_rate() -> None:
    clock = _Clock()
    limits = TenantRateLimits(60, clock=clock)
    taken = [limits.take("a") for _ in range(61)]
    assert all(d is not None and d.allowed for d in taken[:60])
    assert [d.remaining for d in taken[:3] if d] == [59, 58, 57]
    refused = taken[60]
    assert refused is not None and not refused.allowed
    assert refused.remaining == 0 and refused.retry_after_s == pytest.approx(1.0)
    assert refused.headers()["Retry-After"] == "1"
    assert refused.headers()["x-ratelimit-limit-requests"] == "60"
    clock.now += 0.5  # half a request's worth: still refused, the wait halved
    again = limits.take("a")
    assert again is not None and not again.allowed
    assert again.retry_after_s == pytest.approx(0.5)
    clock.now += 0.5
    later = limits.take("a")
    assert later is not None and later.allowed
    clock.now += 3_600  # a quiet hour refills to a minute's worth, no more
    assert sum(bool((d := limits.take("a")) and d.allowed) for _ in range(70)) == 60


def test_tenants_have_their_own_buckets_and_overrides() -> None:
    clock = _Clock()
    limits = TenantRateLimits(None, {"small": 1, "": 2}, clock=clock)
    assert limits.take("unlimited") is None  # no default: a tenant not named has no limit
    first = limits.take("small")
    assert first is not None and first.allowed and first.retry_after_s == pytest.approx(60.0)
    refused = limits.take("small")
    assert refused is not None and not refused.allowed
    assert refused.headers()["Retry-After"] == "60"
    assert "Retry-After" not in first.headers()
    default_tenant = [limits.take("") for _ in range(3)]  # keys without a tenant
    assert [bool(d and d.allowed) for d in default_tenant] == [True, True, False]
    assert TenantRateLimits(5, {"big": 100}).limit_of("other") == 5


@pytest.mark.parametrize("bad", [0, -3, 1.5])
def test_a_limit_below_one_request_a_minute_is_refused_at_start(bad: object) -> None:
    with pytest.raises(ValidationError, match="rate limit|greater than or equal to 1|integer"):
        GatewaySettings(tenant_rate_limits={"t": bad})
    with pytest.raises(ValidationError):
        GatewaySettings(rate_limit_rpm=bad)
