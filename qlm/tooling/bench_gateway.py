"""``qlm bench gateway``: the latency the OpenAI-compatible gateway adds over publishing directly
with ``qlm.client``.

The same stack (broker, coordinator, sim agent) answers both paths. Requests go one at a time,
alternating direct and gateway, so both see the same queue and the same engine state and the
difference is the gateway's: HTTP parsing and auth, the OpenAI → qlm translation, the
response rendering, and the HTTP round trip itself (an ``httpx`` client with one kept-alive
connection; the ``openai`` SDK's own client-side cost is not counted, as it is not the
gateway's). Engine time is kept small (1 output token on a sim engine running faster than real
time) so that it does not drown the difference in noise.

The gateway runs in this process's event loop on a loopback port, as ``qlm gateway`` does in
its own; the direct path uses its own ``QlmClient`` on the same broker.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import structlog

from qlm.types import SLO, RequestMessage, ResultMessage, SamplingParams

log = structlog.get_logger(__name__)

TARGET_P50_MS = 5.0
_BENCH_KEY = "qlm-bench-gateway-key-0000000000"
_PROMPT = list(range(1, 33))  # 32 prompt tokens


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _summary(ms: list[float]) -> dict[str, float]:
    return {
        "p50": round(_pct(ms, 0.5), 3),
        "p95": round(_pct(ms, 0.95), 3),
        "mean": round(statistics.fmean(ms), 3) if ms else float("nan"),
    }


async def _measure(
    amqp_url: str, *, requests: int, warmup: int, model: str, max_tokens: int, timeout_s: float
) -> dict[str, Any]:
    import httpx

    from qlm.catalog import ModelCatalog
    from qlm.client import QlmClient
    from qlm.gateway.app import ApiKeys, GatewaySettings, serve_gateway

    gateway = await serve_gateway(
        amqp_url,
        keys=ApiKeys({_BENCH_KEY: "bench"}),
        catalog=ModelCatalog(),
        settings=GatewaySettings(timeout_s=timeout_s),
        host="127.0.0.1",
        port=0,
    )
    direct_ms: list[float] = []
    gateway_ms: list[float] = []
    errors = 0
    body = {
        "model": model,
        "prompt": _PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "qlm_slo_ms": 60_000,
    }
    try:
        async with (
            QlmClient(amqp_url, app_id="qlm-bench") as direct,
            httpx.AsyncClient(
                base_url=gateway.url,
                headers={"Authorization": f"Bearer {_BENCH_KEY}"},
                timeout=timeout_s,
            ) as http,
        ):
            for i in range(warmup + requests):
                req = RequestMessage(
                    request_id=f"bench-direct-{i}",
                    model=model,
                    prompt_token_ids=_PROMPT,
                    max_tokens=max_tokens,
                    sampling=SamplingParams(temperature=0.0),
                    slo=SLO(e2e_ms=60_000),
                    tenant="bench",
                )
                # Alternate which path goes first, so neither always follows the other.
                order = ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")
                for path in order:
                    t0 = time.perf_counter()
                    if path == "direct":
                        reply = await direct.request(req, timeout=timeout_s)
                        ok = isinstance(reply, ResultMessage)
                    else:
                        resp = await http.post("/v1/completions", json=body)
                        ok = resp.status_code == 200
                    ms = (time.perf_counter() - t0) * 1000
                    if not ok:
                        errors += 1
                    elif i >= warmup:
                        (direct_ms if path == "direct" else gateway_ms).append(ms)
    finally:
        await gateway.stop()
    paired = [g - d for g, d in zip(gateway_ms, direct_ms, strict=False)]
    added_p50 = _pct(gateway_ms, 0.5) - _pct(direct_ms, 0.5)
    return {
        "requests": requests,
        "warmup": warmup,
        "model": model,
        "max_tokens": max_tokens,
        "errors": errors,
        "direct_ms": _summary(direct_ms),
        "gateway_ms": _summary(gateway_ms),
        "added_ms": {
            "p50": round(added_p50, 3),
            "p95": round(_pct(gateway_ms, 0.95) - _pct(direct_ms, 0.95), 3),
            "paired_median": round(statistics.median(paired), 3) if paired else float("nan"),
        },
        "target_p50_ms": TARGET_P50_MS,
        "target_met": added_p50 <= TARGET_P50_MS,
    }


async def run_gateway_bench(
    *,
    requests: int = 500,
    warmup: int = 50,
    amqp_url: str | None = None,
    model: str = "mistral-7b",
    max_tokens: int = 1,
    time_scale: float = 20.0,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """p50/p95 latency of ``requests`` calls through the gateway and as many direct
    ``QlmClient`` requests, and the difference (``added_ms``), in milliseconds.

    ``amqp_url``: a running stack (a coordinator and agents serving ``model``) to measure
    against. None: a private one on a fresh vhost of the local broker (``QLM_AMQP_URL`` or the
    private node): a coordinator and one sim H100 agent at ``time_scale``, stopped afterwards.
    """
    if requests < 1 or warmup < 0:
        raise ValueError("requests must be ≥ 1 and warmup ≥ 0")
    if amqp_url is not None:
        return await _measure(
            amqp_url,
            requests=requests,
            warmup=warmup,
            model=model,
            max_tokens=max_tokens,
            timeout_s=timeout_s,
        )

    from qlm.tooling.demo import LocalCluster
    from qlm.tooling.localbroker import ensure_broker, isolated_vhost

    with isolated_vhost(ensure_broker(), prefix="qlm-bench") as url:
        cluster = LocalCluster(
            url,
            agents=[
                {
                    "agent_id": "bench-gw",
                    "gpu_type": "H100-80GB",
                    "models": [model],
                    "time_scale": time_scale,
                }
            ],
        )
        try:
            await cluster.start()
            result = await _measure(
                url,
                requests=requests,
                warmup=warmup,
                model=model,
                max_tokens=max_tokens,
                timeout_s=timeout_s,
            )
        finally:
            cluster.stop()
    result["time_scale"] = time_scale
    return result
