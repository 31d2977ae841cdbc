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

``--stream`` measures token streaming instead: ``concurrency`` SSE streams at once (closed
loop) through the gateway, each request ``max_tokens`` long. Per stream, the client's TTFT
(POST to the first text event) less the engine's (the request's submission to the engine's
first token, the result's ``qlm.ttft_ms``) is the streaming path's overhead: the agent's
batching and publish, the broker, the gateway's reassembly and SSE, the HTTP read. Inter-token
gaps: the gaps between the client's text events, and the mean time between tokens at the
client ((last - first text event) / (tokens - 1)) against the engine's (``qlm.tbt_ms``).
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import structlog

from qlm.types import SLO, RequestMessage, ResultMessage, SamplingParams

log = structlog.get_logger(__name__)

TARGET_P50_MS = 5.0
# streaming: client TTFT less engine TTFT
TARGET_STREAM_OVERHEAD_P50_MS = 10.0
TARGET_STREAM_OVERHEAD_P99_MS = 50.0
_BENCH_KEY = "qlm-bench-gateway-key-0000000000"
PROMPT_TOKENS = 32  # the default prompt: token ids 1..32


def _prompt(tokens: int) -> list[int]:
    return [1 + k % 32 for k in range(tokens)]


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q * 100)) if xs else float("nan")


def _summary(ms: list[float]) -> dict[str, float]:
    return {
        "p50": round(_pct(ms, 0.5), 3),
        "p95": round(_pct(ms, 0.95), 3),
        "mean": round(statistics.fmean(ms), 3) if ms else float("nan"),
    }


async def _measure(
    amqp_url: str,
    *,
    requests: int,
    warmup: int,
    model: str,
    max_tokens: int,
    timeout_s: float,
    progress: bool = False,
    prompt_tokens: int = PROMPT_TOKENS,
) -> dict[str, Any]:
    import httpx

    from qlm.catalog import ModelCatalog
    from qlm.client import QlmClient
    from qlm.gateway.app import ApiKeys, GatewaySettings, serve_gateway
    from qlm.tooling.progress import counting

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
    done = 0
    prompt = _prompt(prompt_tokens)
    body = {
        "model": model,
        "prompt": prompt,
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
            counting("request pairs", warmup + requests, lambda: done, enabled=progress),
        ):
            for i in range(warmup + requests):
                req = RequestMessage(
                    request_id=f"bench-direct-{i}",
                    model=model,
                    prompt_token_ids=prompt,
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
                done = i + 1
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


def _spawn_gateway(amqp_url: str, timeout_s: float) -> tuple[str, subprocess.Popen[bytes]]:
    """`qlm gateway` on a free loopback port, as its own process."""
    import json
    import os
    import sys

    from qlm.tooling.ports import free_loopback_port

    port = free_loopback_port()
    env = {
        **os.environ,
        "QLM_AMQP_URL": amqp_url,
        "QLM_LOG_LEVEL": "warning",
        "QLM_GATEWAY_API_KEYS": json.dumps({_BENCH_KEY: "bench"}),
        "QLM_GATEWAY_TIMEOUT_S": str(timeout_s),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "qlm.cli", "gateway", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    return f"http://127.0.0.1:{port}", proc


async def _start_gateway_process(
    amqp_url: str, timeout_s: float
) -> tuple[str, subprocess.Popen[bytes]]:
    import asyncio

    import httpx

    url, proc = _spawn_gateway(amqp_url, timeout_s)
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(timeout=2) as http:
        while True:
            try:
                if (await http.get(url + "/healthz")).status_code == 200:
                    return url, proc
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the gateway process did not start")
            await asyncio.sleep(0.1)


async def _sse_post(
    host: str, port: int, path: str, body: bytes, key: str
) -> AsyncIterator[tuple[int, bytes]]:
    """POST ``body`` and yield (status, data) of each SSE event as it arrives. A bare HTTP/1.1
    client (one connection per call, chunked body): httpx costs more CPU per event than the
    gateway does, and a client that cannot keep up with 50 streams would measure its own lag."""
    import asyncio

    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        pending = b""
        while True:
            if chunked:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                data = await reader.readexactly(size + 2)
                pending += data[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
                pending += data
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield status, event[6:]
    finally:
        writer.close()


def _dist(xs: list[float]) -> dict[str, float]:
    return {
        "p50": round(_pct(xs, 0.5), 3),
        "p90": round(_pct(xs, 0.9), 3),
        "p99": round(_pct(xs, 0.99), 3),
        "mean": round(statistics.fmean(xs), 3) if xs else float("nan"),
    }


async def _measure_stream(
    amqp_url: str,
    *,
    requests: int,
    concurrency: int,
    model: str,
    max_tokens: int,
    timeout_s: float,
    progress: bool = False,
    prompt_tokens: int = PROMPT_TOKENS,
) -> dict[str, Any]:
    import asyncio
    import json

    from qlm.tooling.progress import counting

    # The gateway runs as its own process (as `qlm gateway` does): 50 streams of SSE events
    # are as much work for an HTTP client as for the gateway, and one event loop doing both
    # measures its own queueing, not the path's.
    gateway_url, gateway = await _start_gateway_process(amqp_url, timeout_s)
    body = {
        "model": model,
        "prompt": _prompt(prompt_tokens),
        "max_tokens": max_tokens,
        "temperature": 0,
        "qlm_slo_ms": 600_000,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    overhead_ms: list[float] = []
    client_ttft_ms: list[float] = []
    engine_ttft_ms: list[float] = []
    gaps_ms: list[float] = []
    client_tbt_ms: list[float] = []
    engine_tbt_ms: list[float] = []
    chunk_tokens: list[float] = []
    errors = 0
    slots = asyncio.Semaphore(concurrency)

    host, port = gateway_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()

    async def one() -> None:
        nonlocal errors
        async with slots:
            t0 = time.perf_counter()
            times: list[float] = []
            tokens = 0
            info: dict[str, Any] | None = None
            try:
                async for status, data in _sse_post(
                    host, int(port), "/v1/completions", payload, _BENCH_KEY
                ):
                    if status != 200 or not data.startswith(b"{"):
                        continue
                    event = json.loads(data)
                    if event.get("choices") and event["choices"][0]["text"]:
                        times.append(time.perf_counter())
                    if event.get("qlm"):
                        info = event["qlm"]
                    if event.get("usage"):  # stream_options.include_usage: the last event
                        tokens = int(event["usage"]["completion_tokens"])
            except Exception as exc:  # noqa: BLE001 - counted, the run goes on
                log.warning("bench_stream_failed", error=repr(exc))
                errors += 1
                return
            # tokens from the usage event, not the text: a real tokenizer's token is not a word
            # (and a random model's may decode to nothing, so events can be fewer than tokens)
            if not times or info is None or info.get("ttft_ms") is None or tokens < 1:
                log.warning(
                    "bench_stream_incomplete",
                    text_events=len(times),
                    tokens=tokens,
                    engine_ttft=None if info is None else info.get("ttft_ms"),
                )
                errors += 1
                return
            ttft = (times[0] - t0) * 1000
            client_ttft_ms.append(ttft)
            engine_ttft_ms.append(info["ttft_ms"])
            overhead_ms.append(ttft - info["ttft_ms"])
            gaps_ms.extend((b - a) * 1000 for a, b in zip(times, times[1:], strict=False))
            chunk_tokens.append(tokens / len(times))
            if tokens > 1 and info.get("tbt_ms") is not None:
                client_tbt_ms.append((times[-1] - times[0]) * 1000 / (tokens - 1))
                engine_tbt_ms.append(info["tbt_ms"])

    try:
        async with counting(
            "streams", requests, lambda: len(client_ttft_ms) + errors, enabled=progress
        ):
            await asyncio.wait_for(asyncio.gather(*(one() for _ in range(requests))), timeout_s * 2)
    finally:
        gateway.terminate()
        try:
            gateway.wait(timeout=20)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait()
    p50, p99 = _pct(overhead_ms, 0.5), _pct(overhead_ms, 0.99)
    return {
        "mode": "stream",
        "requests": requests,
        "concurrency": concurrency,
        "model": model,
        "max_tokens": max_tokens,
        "errors": errors,
        "ttft_overhead_ms": _dist(overhead_ms),
        "client_ttft_ms": _dist(client_ttft_ms),
        "engine_ttft_ms": _dist(engine_ttft_ms),
        "client_event_gap_ms": _dist(gaps_ms),
        "tokens_per_event": _dist(chunk_tokens),
        "client_tbt_ms": _dist(client_tbt_ms),
        "engine_tbt_ms": _dist(engine_tbt_ms),
        "target_overhead_ms": {
            "p50": TARGET_STREAM_OVERHEAD_P50_MS,
            "p99": TARGET_STREAM_OVERHEAD_P99_MS,
        },
        "target_met": p50 <= TARGET_STREAM_OVERHEAD_P50_MS and p99 <= TARGET_STREAM_OVERHEAD_P99_MS,
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
    stream: bool = False,
    concurrency: int = 50,
    progress: bool = False,
    pull_at_most: int | None = None,
    feed_tokens: int | None = None,
    prompt_tokens: int = PROMPT_TOKENS,
) -> dict[str, Any]:
    """p50/p95 latency of ``requests`` calls through the gateway and as many direct
    ``QlmClient`` requests, and the difference (``added_ms``), in milliseconds.

    ``amqp_url``: a running stack (a coordinator and agents serving ``model``) to measure
    against. None: a private one on a fresh vhost of the local broker (``QLM_AMQP_URL`` or the
    private node): a coordinator and one sim H100 agent at ``time_scale``, stopped afterwards.
    ``progress``: a bar of the requests done on stderr, on a terminal only. ``pull_at_most``:
    the private agent's pull size (``qlm agent --pull-at-most``; None: its default);
    ``feed_tokens`` its feed budget (``--feed-tokens``). ``prompt_tokens``: every request's
    prompt length.
    """
    if requests < 1 or warmup < 0 or concurrency < 1 or prompt_tokens < 1:
        raise ValueError("requests, concurrency and prompt tokens must be ≥ 1 and warmup ≥ 0")

    async def measure(url: str) -> dict[str, Any]:
        if stream:
            return await _measure_stream(
                url,
                requests=requests,
                concurrency=concurrency,
                model=model,
                max_tokens=max_tokens,
                timeout_s=timeout_s,
                progress=progress,
                prompt_tokens=prompt_tokens,
            )
        return await _measure(
            url,
            requests=requests,
            warmup=warmup,
            model=model,
            max_tokens=max_tokens,
            timeout_s=timeout_s,
            progress=progress,
            prompt_tokens=prompt_tokens,
        )

    if amqp_url is not None:
        return await measure(amqp_url)

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
                    "extra_args": [
                        *([] if pull_at_most is None else ["--pull-at-most", str(pull_at_most)]),
                        *([] if feed_tokens is None else ["--feed-tokens", str(feed_tokens)]),
                    ],
                }
            ],
        )
        try:
            await cluster.start()
            result = await measure(url)
        finally:
            cluster.stop()
    result["time_scale"] = time_scale
    result["pull_at_most"] = pull_at_most
    result["feed_tokens"] = feed_tokens
    result["prompt_tokens"] = prompt_tokens
    return result
