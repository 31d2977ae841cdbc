"""The sim engine backend: timing against the engine model, batching, preemption, model
switches, abort, admission signal, determinism and failure handling. Real asyncio, real time,
compressed by ``time_scale``."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest

from qlm.agents.engine import EngineOutput, EngineRequest, TokenDelta
from qlm.agents.sim import MAX_CATCH_UP_S, SimEngine, _SimRequest
from qlm.engine_model import EngineProfile, get_profile


class Outputs:
    """on_output callback that records outputs and lets a test wait for a number of them."""

    def __init__(self) -> None:
        self.by_id: dict[str, EngineOutput] = {}
        self.order: list[str] = []
        self._changed = asyncio.Event()

    async def __call__(self, output: EngineOutput) -> None:
        self.by_id[output.request_id] = output
        self.order.append(output.request_id)
        self._changed.set()

    async def wait_for(self, count: int) -> None:
        async with asyncio.timeout(10):
            while len(self.by_id) < count:
                self._changed.clear()
                await self._changed.wait()


def request(
    request_id: str, model: str = "tiny-llama", prompt: int = 32, max_tokens: int = 16
) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        model=model,
        prompt_token_ids=None,
        prompt_tokens=prompt,
        prompt_text="x " * prompt,
        max_tokens=max_tokens,
    )


@asynccontextmanager
async def running(engine: SimEngine) -> AsyncIterator[Outputs]:
    outputs = Outputs()
    await engine.start(outputs)
    try:
        yield outputs
    finally:
        await engine.stop()


def check_output(output: EngineOutput, max_tokens: int) -> None:
    assert output.error is None
    assert output.finish_reason == "length"
    assert len(output.output_token_ids) == max_tokens
    assert output.output_text == " ".join(f"t{t}" for t in output.output_token_ids)
    assert output.first_token_at is not None
    assert output.started_at <= output.first_token_at <= output.finished_at


# One asyncio.sleep may overshoot by milliseconds on a loaded machine (tests of other
# components run beside these); consecutive iterations do not add up their overshoots, since
# the engine sleeps to accumulated deadlines, catching up at most MAX_CATCH_UP_S.
WALL_JITTER_S = 0.010


def assert_wall_time_matches(
    wall: float, engine_seconds: float, scale: float, *, from_idle: bool = True
) -> None:
    expected = engine_seconds / scale
    lower = expected * 0.99 if from_idle else expected - MAX_CATCH_UP_S
    assert lower <= wall <= expected * 1.03 + WALL_JITTER_S, (wall, expected)


def quick_loading(gpu: str, model: str, **overrides: Any) -> dict[str, EngineProfile]:
    """A profile whose cold load is 1 s, so the start-up load does not dominate a test."""
    profile = replace(get_profile(gpu, model), measured_load_from_disk_s=1.0, **overrides)
    return {model: profile}


async def test_single_request_timing_follows_the_engine_model() -> None:
    # A10: one 2048-token prompt is one prefill iteration (vLLM's token budget there is 2048).
    scale, prompt, max_tokens = 5.0, 2048, 40
    profiles = quick_loading("A10", "mistral-7b")
    engine = SimEngine("A10", ["mistral-7b"], time_scale=scale, profiles=profiles)
    profile = engine.profile("mistral-7b")
    assert profile.max_num_batched_tokens == prompt
    async with running(engine) as outputs:
        engine.submit(request("r1", "mistral-7b", prompt, max_tokens))
        await outputs.wait_for(1)
    out = outputs.by_id["r1"]
    check_output(out, max_tokens)
    assert out.first_token_at is not None
    expected_ttft = profile.prefill_time(prompt)
    # Decode step k attends to the prompt and k tokens (the new one included).
    expected_e2e = expected_ttft + sum(
        profile.decode_iteration_time(1, prompt + k) for k in range(1, max_tokens)
    )
    assert_wall_time_matches(out.first_token_at - out.started_at, expected_ttft, scale)
    assert_wall_time_matches(out.finished_at - out.started_at, expected_e2e, scale)


async def test_batch_of_requests_all_complete_concurrently() -> None:
    engine = SimEngine("A100-80GB", ["tiny-llama"], time_scale=2.0)
    lengths = {f"r{i}": (16 + 37 * i, 5 + 3 * i) for i in range(24)}
    async with running(engine) as outputs:
        for rid, (prompt, max_tokens) in lengths.items():
            engine.submit(request(rid, prompt=prompt, max_tokens=max_tokens))
        await outputs.wait_for(len(lengths))
        stats = engine.stats()
    for rid, (prompt, max_tokens) in lengths.items():
        check_output(outputs.by_id[rid], max_tokens)
        assert outputs.by_id[rid].prompt_tokens == prompt
    # Continuous batching: the longest request bounds the iteration count, not the sum.
    assert engine.iterations < sum(m for _, m in lengths.values()) / 4
    assert stats.running == stats.waiting == stats.kv_used_tokens == 0
    assert stats.in_flight == []
    assert stats.tokens_per_s > 0
    # Shorter requests finish first.
    assert outputs.order.index("r0") < outputs.order.index("r23")


async def test_kv_pressure_preempts_and_every_request_still_completes() -> None:
    def make(kv_capacity_tokens: int | None) -> SimEngine:
        return SimEngine(
            "A10", ["tiny-llama"], time_scale=5.0, kv_capacity_tokens=kv_capacity_tokens, seed=7
        )

    wanted = {f"r{i}": (40 + i, 100) for i in range(6)}
    results: list[dict[str, EngineOutput]] = []
    engines = []
    for capacity in (256, None):
        engine = make(capacity)
        engines.append(engine)
        async with running(engine) as outputs:
            for rid, (prompt, max_tokens) in wanted.items():
                engine.submit(request(rid, prompt=prompt, max_tokens=max_tokens))
            peak = 0
            while len(outputs.by_id) < len(wanted):
                peak = max(peak, engine.stats().kv_used_tokens)
                assert peak <= engine.kv_capacity_tokens
                await asyncio.sleep(0)
            results.append(dict(outputs.by_id))
    small, large = engines
    assert small.kv_capacity_tokens == 256
    assert small.preemptions_total > 0
    assert large.preemptions_total == 0
    assert sum(o.preemptions for o in results[0].values()) == small.preemptions_total
    for rid, (_, max_tokens) in wanted.items():
        check_output(results[0][rid], max_tokens)
        # Preemption by recompute keeps the tokens already generated.
        assert results[0][rid].output_token_ids == results[1][rid].output_token_ids


async def test_preemption_victim_is_the_most_recently_admitted() -> None:
    engine = SimEngine("A10", ["tiny-llama"], time_scale=5.0, kv_capacity_tokens=256)
    async with running(engine) as outputs:
        engine.submit(request("first", prompt=100, max_tokens=100))  # peaks at 13 blocks
        engine.submit(request("second", prompt=40, max_tokens=100))  # peaks at 9 blocks
        await outputs.wait_for(2)
    assert outputs.by_id["first"].preemptions == 0
    assert outputs.by_id["second"].preemptions >= 1
    assert outputs.order == ["first", "second"]


async def test_model_switch_charges_load_times_and_blocks_fcfs() -> None:
    scale = 20.0
    engine = SimEngine("A10", ["tiny-llama", "mistral-7b"], time_scale=scale)
    tiny, mistral = engine.profile("tiny-llama"), engine.profile("mistral-7b")
    async with running(engine) as outputs:
        assert engine.stats().active_model == "tiny-llama"
        engine.submit(request("a1", "tiny-llama", max_tokens=20))
        engine.submit(request("b1", "mistral-7b", max_tokens=4))
        engine.submit(request("a2", "tiny-llama", max_tokens=4))
        await outputs.wait_for(3)
        engine.submit(request("b2", "mistral-7b", max_tokens=4))
        await outputs.wait_for(4)
    loads = [(m.model, m.source) for m in engine.model_loads]
    assert loads == [
        ("tiny-llama", "disk"),
        ("mistral-7b", "disk"),
        ("tiny-llama", "cpu"),
        ("mistral-7b", "cpu"),
    ]
    expected = [
        tiny.load_time_from_disk(),
        mistral.load_time_from_disk(),
        tiny.load_time_from_cpu(),
        mistral.load_time_from_cpu(),
    ]
    for load, seconds in zip(engine.model_loads, expected, strict=True):
        assert load.engine_seconds == seconds
        wall = load.finished_at - load.started_at
        assert_wall_time_matches(wall, seconds, scale, from_idle=False)
    # a2 queued behind b1: strict FCFS across models, so it waits for both switches.
    assert outputs.order[:3] == ["a1", "b1", "a2"]
    b1 = outputs.by_id["b1"]
    assert b1.first_token_at is not None
    assert (b1.first_token_at - b1.started_at) * scale >= mistral.load_time_from_disk()


async def test_abort_returns_generated_tokens() -> None:
    engine = SimEngine("A10", ["tiny-llama"], time_scale=1.0, max_batch_size=1, seed=3)
    async with running(engine) as outputs:
        engine.submit(request("long", max_tokens=1000))
        engine.submit(request("queued", max_tokens=10))
        await asyncio.sleep(0.05)
        assert engine.stats().in_flight == ["long", "queued"]
        assert await engine.abort("queued") == []
        partial = await engine.abort("long")
        assert await engine.abort("long") == []
        stats = engine.stats()
        await asyncio.sleep(0.01)
    assert 0 < len(partial) < 1000
    assert stats.in_flight == [] and stats.kv_used_tokens == 0
    assert outputs.by_id == {}  # aborted requests are not reported
    # The tokens are the prefix of the same request run to completion.
    again = SimEngine("A10", ["tiny-llama"], time_scale=20.0, seed=3)
    async with running(again) as outputs:
        again.submit(request("long", max_tokens=1000))
        await outputs.wait_for(1)
    assert outputs.by_id["long"].output_token_ids[: len(partial)] == partial


async def test_wants_goes_to_zero_when_saturated() -> None:
    engine = SimEngine("A10", ["tiny-llama"], time_scale=1.0, max_batch_size=4)
    assert engine.wants() == 0  # not started
    async with running(engine) as outputs:
        assert engine.wants() == 4
        engine.submit(request("r0", max_tokens=200))
        engine.submit(request("r1", max_tokens=200))
        assert engine.wants() == 0  # a waiting queue exists
        await asyncio.sleep(0.01)
        assert engine.stats().running == 2
        assert engine.wants() == 2
        engine.submit(request("r2", max_tokens=200))
        engine.submit(request("r3", max_tokens=200))
        await asyncio.sleep(0.01)
        assert engine.stats().running == 4
        assert engine.wants() == 0  # batch full
        for rid in ("r0", "r1", "r2", "r3"):
            await engine.abort(rid)
        assert engine.wants() == 4
        assert outputs.by_id == {}

    # KV above 90 % with free batch slots: saturated too.
    engine = SimEngine("A10", ["tiny-llama"], time_scale=1.0, kv_capacity_tokens=320)
    async with running(engine):
        engine.submit(request("big", prompt=300, max_tokens=20))
        await asyncio.sleep(0.01)
        stats = engine.stats()
        assert stats.waiting == 0 and stats.running == 1
        assert stats.kv_used_tokens > 0.9 * stats.kv_capacity_tokens
        assert engine.wants() == 0


async def test_wants_is_bounded_by_the_pull_size() -> None:
    engine = SimEngine("A10", ["tiny-llama"], time_scale=1.0, max_batch_size=4, pull_at_most=1)
    async with running(engine) as outputs:
        assert engine.wants() == 1
        engine.submit(request("r0", max_tokens=4))
        await outputs.wait_for(1)
        assert engine.wants() == 1


async def test_same_seed_same_outputs() -> None:
    async def run(seed: int) -> dict[str, list[int]]:
        engine = SimEngine("A100-80GB", ["tiny-llama"], time_scale=5.0, seed=seed)
        async with running(engine) as outputs:
            for i in range(5):
                engine.submit(request(f"r{i}", max_tokens=12))
            await outputs.wait_for(5)
        return {rid: o.output_token_ids for rid, o in outputs.by_id.items()}

    first, second, other = await run(1), await run(1), await run(2)
    assert first == second
    assert first != other
    assert len({tuple(tokens) for tokens in first.values()}) == 5  # per-request streams


async def test_chunked_prefill_keeps_decodes_running() -> None:
    scale = 10.0
    profiles = quick_loading("A10", "mistral-7b", max_num_batched_tokens=512)
    engine = SimEngine("A10", ["mistral-7b"], time_scale=scale, profiles=profiles)
    profile = engine.profile("mistral-7b")
    async with running(engine) as outputs:
        engine.submit(request("long", "mistral-7b", prompt=4000, max_tokens=2))
        await outputs.wait_for(1)
        engine.submit(request("decoder", "mistral-7b", prompt=16, max_tokens=30))
        await asyncio.sleep(0.02)  # the decoder is running
        engine.submit(request("long2", "mistral-7b", prompt=4000, max_tokens=2))
        await outputs.wait_for(3)
    long = outputs.by_id["long"]
    assert long.first_token_at is not None
    chunks = [512] * 7 + [4000 - 7 * 512]
    expected = sum(
        profile.iteration_time(c, 0, 0, prefill_attention_pairs=c * (i * 512) + c * (c + 1) / 2)
        for i, c in enumerate(chunks)
    )
    assert_wall_time_matches(long.first_token_at - long.started_at, expected, scale)
    # long: 8 chunk iterations + 1 decode. Then every iteration carries one decoder token
    # (30 of them), and long2's eight chunks ride along in eight of those iterations rather
    # than stalling the decoder.
    check_output(outputs.by_id["decoder"], 30)
    check_output(outputs.by_id["long2"], 2)
    assert engine.iterations == 9 + 30


async def test_invalid_requests_fail_without_stopping_the_engine() -> None:
    engine = SimEngine("A10", ["tiny-llama"], time_scale=5.0, kv_capacity_tokens=256)
    async with running(engine) as outputs:
        engine.submit(request("wrong-model", model="mistral-7b"))
        engine.submit(request("too-long", prompt=250, max_tokens=10))
        engine.submit(request("no-output", max_tokens=0))
        engine.submit(request("fine", max_tokens=5))
        with pytest.raises(ValueError, match="already in the engine"):
            engine.submit(request("fine"))
        await outputs.wait_for(4)
    assert "not served" in (outputs.by_id["wrong-model"].error or "")
    assert "KV cache" in (outputs.by_id["too-long"].error or "")
    assert "max_tokens" in (outputs.by_id["no-output"].error or "")
    check_output(outputs.by_id["fine"], 5)


async def test_an_engine_context_is_reported_and_enforced_as_vllm_does() -> None:
    """``max_model_len`` (qlm agent --max-model-len): what the engine says it takes, and a
    request beyond it fails at submission; the engine goes on serving."""
    engine = SimEngine("A10", ["tiny-llama"], time_scale=5.0, max_model_len=200)
    assert dict(engine.max_model_len) == {"tiny-llama": 200}
    async with running(engine) as outputs:
        engine.submit(request("beyond", prompt=195, max_tokens=10))
        engine.submit(request("within", prompt=190, max_tokens=10))
        await outputs.wait_for(2)
    assert "max_model_len) of 200" in (outputs.by_id["beyond"].error or "")
    check_output(outputs.by_id["within"], 10)
    with pytest.raises(ValueError, match="max_model_len"):
        SimEngine("A10", ["tiny-llama"], max_model_len=1)


class FaultyEngine(SimEngine):
    """Fault injection: the engine fails while sampling for one request."""

    def _token_at(self, sim: _SimRequest, index: int) -> int:
        if sim.request_id == "boom" and index == 3:
            raise RuntimeError("injected sampler fault")
        return super()._token_at(sim, index)


async def test_a_request_that_breaks_the_engine_gets_an_error_output() -> None:
    engine = FaultyEngine("A10", ["tiny-llama"], time_scale=5.0)
    calls: list[str] = []

    async def flaky_callback(output: EngineOutput) -> None:
        calls.append(output.request_id)
        if output.request_id == "ok1":
            raise RuntimeError("callback fault")  # must not stop later deliveries

    await engine.start(flaky_callback)
    outputs = Outputs()
    try:
        engine.submit(request("ok1", max_tokens=2))
        await asyncio.sleep(0.05)
        engine._on_output = outputs  # from here on, record
        engine.submit(request("boom", max_tokens=10))
        engine.submit(request("ok2", max_tokens=10))
        await outputs.wait_for(2)
        engine.submit(request("ok3", max_tokens=4))
        await outputs.wait_for(3)
    finally:
        await engine.stop()
    assert calls == ["ok1"]
    boom = outputs.by_id["boom"]
    assert boom.error is not None and "injected sampler fault" in boom.error
    assert len(boom.output_token_ids) == 3
    check_output(outputs.by_id["ok2"], 10)
    check_output(outputs.by_id["ok3"], 4)
    assert engine.stats().kv_used_tokens == 0


async def test_idle_engine_does_not_spin() -> None:
    engine = SimEngine("A10", ["tiny-llama"], time_scale=1.0)
    async with running(engine) as outputs:
        engine.submit(request("r", max_tokens=3))
        await outputs.wait_for(1)
        iterations = engine.iterations
        cpu_before = time.process_time()
        await asyncio.sleep(0.3)
        cpu_used = time.process_time() - cpu_before
        assert engine.iterations == iterations
        assert cpu_used < 0.05
        engine.submit(request("r2", max_tokens=3))  # and it wakes up again
        await outputs.wait_for(2)
    # Time spent idle is not banked: the first iteration after it takes its full time.
    r2 = outputs.by_id["r2"]
    assert r2.first_token_at is not None
    prefill = engine.profile("tiny-llama").prefill_time(32)
    assert_wall_time_matches(r2.first_token_at - r2.started_at, prefill, 1.0)


async def test_tokens_per_s_tracks_the_modelled_decode_rate() -> None:
    scale, batch = 20.0, 8
    engine = SimEngine("A10", ["mistral-7b"], time_scale=scale)
    profile = engine.profile("mistral-7b")
    async with running(engine) as outputs:
        for i in range(batch):
            engine.submit(request(f"r{i}", "mistral-7b", prompt=512, max_tokens=120))
        await outputs.wait_for(batch)
        measured = engine.stats().tokens_per_s
    modelled = profile.token_throughput(batch, 512 + 60) * scale
    assert measured == pytest.approx(modelled, rel=0.15)


async def test_random_workload_keeps_the_engine_invariants() -> None:
    rng = random.Random(11)
    engine = SimEngine(
        "A100-80GB",
        ["tiny-llama", "mistral-7b"],
        time_scale=200.0,
        kv_capacity_tokens=1024,
        max_batch_size=6,
    )
    wanted: dict[str, int] = {}
    aborted: set[str] = set()
    peak_kv = 0
    async with running(engine) as outputs:
        for i in range(40):
            rid = f"r{i}"
            model = rng.choice(engine.models)
            prompt, max_tokens = rng.randint(1, 400), rng.randint(1, 200)
            engine.submit(request(rid, model, prompt, max_tokens))
            wanted[rid] = max_tokens
            if rng.random() < 0.15:
                victim = rng.choice(sorted(wanted))
                if victim not in outputs.by_id and victim not in aborted:
                    generated = await engine.abort(victim)
                    assert len(generated) < wanted[victim]
                    aborted.add(victim)
            for _ in range(rng.randint(0, 30)):
                peak_kv = max(peak_kv, engine.stats().kv_used_tokens)
                await asyncio.sleep(0)
        while len(outputs.by_id) < len(wanted) - len(aborted):
            peak_kv = max(peak_kv, engine.stats().kv_used_tokens)
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        stats = engine.stats()
    assert set(outputs.by_id) == set(wanted) - aborted
    for rid, output in outputs.by_id.items():
        check_output(output, wanted[rid])
    assert peak_kv <= 1024
    assert stats.in_flight == [] and stats.kv_used_tokens == 0
    assert engine.preemptions_total > 0
    switched_to = [load.model for load in engine.model_loads]
    assert all(a != b for a, b in zip(switched_to, switched_to[1:], strict=False))
    assert [load.source for load in engine.model_loads[:2]] == ["disk", "disk"]
    assert {load.source for load in engine.model_loads[2:]} <= {"cpu"}


def test_constructor_validation() -> None:
    with pytest.raises(ValueError):
        SimEngine("A10", [])
    with pytest.raises(ValueError):
        SimEngine("A10", ["tiny-llama"], time_scale=0)
    with pytest.raises(ValueError):
        SimEngine("A10", ["tiny-llama"], kv_capacity_tokens=8)
    # Models sharing an engine share its TP group: the largest any of them needs.
    engine = SimEngine("A10", ["mistral-7b", "vicuna-13b"])
    assert engine.profile("mistral-7b").tp == engine.profile("vicuna-13b").tp == 2


async def test_streamed_requests_report_token_deltas_with_output_offsets() -> None:
    engine = SimEngine("A10", ["tiny-llama"], time_scale=5.0, seed=4)
    assert engine.capabilities().token_streaming
    deltas: list[TokenDelta] = []
    engine.set_token_listener(deltas.append)
    async with running(engine) as outputs:
        engine.submit(replace(request("s", max_tokens=40), stream=True))
        engine.submit(request("quiet", max_tokens=40))  # not streamed: nobody reads its tokens
        await outputs.wait_for(2)
    out = outputs.by_id["s"]
    assert {d.request_id for d in deltas} == {"s"}
    assert len(deltas) > 5  # per iteration, not one burst at the end
    at = 0
    for d in deltas:
        assert d.offset == at
        at += len(d.token_ids)
    assert [t for d in deltas for t in d.token_ids] == out.output_token_ids
    assert "".join(d.text for d in deltas) == out.output_text
    # the last tokens say the request ended with them, and no others do
    assert [d.final for d in deltas] == [False] * (len(deltas) - 1) + [True]

    # resumed after 15 tokens (elsewhere, with the same seed): its first new token has offset
    # 15, and the tokens are the uninterrupted run's
    resumed: list[TokenDelta] = []
    again = SimEngine("A10", ["tiny-llama"], time_scale=5.0, seed=4)
    again.set_token_listener(resumed.append)
    async with running(again) as outputs:
        head = out.output_token_ids[:15]
        again.submit(replace(request("s", max_tokens=40), stream=True, resume_token_ids=head))
        await outputs.wait_for(1)
    assert resumed[0].offset == 15
    assert [t for d in resumed for t in d.token_ids] == out.output_token_ids[15:]
    assert outputs.by_id["s"].output_text.endswith("".join(d.text for d in resumed))
