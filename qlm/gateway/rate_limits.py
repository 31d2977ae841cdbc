"""Per-tenant request rate limits at the gateway (requests per minute, OpenAI's ``RPM``).

A token bucket per tenant: it holds at most a minute's worth of requests, refills at the
limit's rate, and a call that finds it empty gets a 429 ``rate_limit_exceeded`` with
``Retry-After`` and OpenAI's ``x-ratelimit-*-requests`` headers, before its body is read or
anything is published. The buckets live in each gateway process: with N replicas behind a load
balancer a tenant gets up to N times its limit (a shared store would cost a round trip per
call). qlm's own admission limits (``QLM_MAX_QUEUED_PER_TENANT``) bound what a tenant holds
queued across every gateway; this bounds how fast one gateway lets it publish.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RateDecision:
    """What one call found: allowed or not, the limit, what is left after it, and the seconds
    until the bucket holds one more request (0 while it holds at least one)."""

    allowed: bool
    limit_rpm: int
    remaining: int
    retry_after_s: float

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers (``x-ratelimit-reset-requests`` as a duration)."""
        out = {
            "x-ratelimit-limit-requests": str(self.limit_rpm),
            "x-ratelimit-remaining-requests": str(self.remaining),
            "x-ratelimit-reset-requests": f"{self.retry_after_s:.3f}s",
        }
        if not self.allowed:
            out["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


class TenantRateLimits:
    """Requests per minute per tenant: ``default_rpm`` for every tenant (None: no limit) and
    ``per_tenant`` overrides (tenant -> rpm; qlm's default tenant, keys without one, is "").
    The limits are ``GatewaySettings``', which refuse any below 1 at start."""

    def __init__(
        self,
        default_rpm: int | None,
        per_tenant: Mapping[str, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._default = default_rpm
        self._limits = dict(per_tenant or {})
        self._clock = clock
        # tenant -> (tokens, time they were counted); tenants come from the API keys, so the
        # table is as small as the key table
        self._buckets: dict[str, tuple[float, float]] = {}

    def limit_of(self, tenant: str) -> int | None:
        return self._limits.get(tenant, self._default)

    def take(self, tenant: str) -> RateDecision | None:
        """Count one request of ``tenant``; None where it has no limit."""
        rpm = self.limit_of(tenant)
        if rpm is None:
            return None
        now = self._clock()
        per_s = rpm / 60.0
        tokens, at = self._buckets.get(tenant, (float(rpm), now))
        tokens = min(float(rpm), tokens + (now - at) * per_s)
        if tokens >= 1.0:
            tokens -= 1.0
            self._buckets[tenant] = (tokens, now)
            wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / per_s
            return RateDecision(True, rpm, int(tokens), wait)
        self._buckets[tenant] = (tokens, now)
        return RateDecision(False, rpm, 0, (1.0 - tokens) / per_s)
