"""The ``sim`` engine backend: a real-time emulation of a vLLM V1-like continuous-batching engine.

What runs in each iteration (continuous batching, chunked prefill, the KV cache, preemption by
recompute, model switches, the admission signal ``wants()``) is decided by the one engine
scheduler, :class:`qlm.engine_scheduler.EngineScheduler`, the same one the cluster simulator's
instances use (docs/engine-model.md). This class owns real time and I/O: each iteration
"runs" for ``EngineProfile.iteration_time(...) / time_scale`` wall seconds (``asyncio.sleep``),
then its outputs are delivered. A model switch costs ``load_time_from_disk()``, or
``load_time_from_cpu()`` when the model's weights are in host memory
(:class:`qlm.engine_scheduler.ModelResidency`: a model the engine switched away from, or one
the coordinator asked to keep warm once it has been read from disk).

The sim ignores EOS: every request generates exactly ``max_tokens`` tokens, ids drawn from a
generator seeded by (engine seed, request id, request seed), so token ``i`` of a request is a
function of ``i`` alone and a preempted or resumed request continues exactly. Producers
replaying a trace set ``max_tokens`` to the trace's output length. Timestamps are wall clock
(``clock()``); with ``time_scale > 1`` the engine runs that many times faster than the
modelled GPU. See docs/engine-model.md for what is and is not emulated.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import structlog

from qlm.agents.engine import (
    EngineBackend,
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
    ModelState,
    OutputCallback,
    TokenDelta,
)
from qlm.engine_model import KV_BLOCK_TOKENS, EngineProfile, get_profile
from qlm.engine_scheduler import (
    WANTS_AT_MOST,
    EngineLimits,
    EngineScheduler,
    EngineSeq,
    ModelResidency,
    Step,
)

log = structlog.get_logger(__name__)

VOCAB_SIZE = 32_000  # range of the emulated token ids
TOKENS_PER_S_ALPHA = 0.05  # EWMA weight of the latest iteration
# When the event loop falls behind the modelled iteration ends, the engine runs iterations back
# to back to catch up, but never by more than this much wall time (a stalled process does not
# get a burst of free iterations afterwards).
MAX_CATCH_UP_S = 0.01


@dataclass(slots=True, eq=False, kw_only=True)
class _SimRequest(EngineSeq):
    """A request in the engine: the scheduler's state plus what its output needs."""

    request: EngineRequest
    started_at: float
    token_seed: int  # token i is a function of (this, i): a resumed request continues exactly
    resumed: list[int] = field(default_factory=list)  # resume_token_ids: its first tokens
    first_token_at: float | None = None
    done: bool = False
    streamed: int = 0  # output tokens reported as TokenDeltas so far (resume ids count)


@dataclass(frozen=True)
class ModelLoad:
    """One model switch, for observability and tests."""

    model: str
    source: str  # "disk" (first load) | "cpu" (warm start)
    engine_seconds: float  # modelled duration, before time_scale
    started_at: float  # wall clock
    finished_at: float


class SimEngine(EngineBackend):
    def __init__(
        self,
        gpu_type: str,
        models: list[str],
        *,
        time_scale: float = 1.0,
        kv_capacity_tokens: int | None = None,
        max_batch_size: int | None = None,
        max_num_batched_tokens: int | None = None,
        pull_at_most: int = WANTS_AT_MOST,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        tp: int | None = None,
        profiles: dict[str, EngineProfile] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """``profiles`` replaces the roofline profile of some models (e.g. measured ones);
        ``tp=None`` uses the largest TP degree any of the models needs, since the models share
        one GPU group. ``kv_capacity_tokens``, ``max_batch_size`` and the token budget per
        iteration ``max_num_batched_tokens`` override every model's. ``max_model_len``: the
        context (prompt + output tokens) the engine takes for every model, reported like
        vLLM's --max-model-len and enforced as vLLM does (a request beyond it fails); None:
        the model's own context, unreported."""
        if not models:
            raise ValueError("SimEngine needs at least one model")
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        given = dict(profiles or {})
        if tp is None:
            tp = max(given[m].tp if m in given else get_profile(gpu_type, m).tp for m in models)
        self._profiles = {m: given.get(m) or get_profile(gpu_type, m, tp=tp) for m in models}
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        self._max_model_len = max_model_len
        self._limits: dict[str, EngineLimits] = {}
        for m, p in self._profiles.items():
            # the cache holds whole blocks of KV_BLOCK_TOKENS, as vLLM's does
            capacity = p.kv_capacity_tokens if kv_capacity_tokens is None else kv_capacity_tokens
            blocks = capacity // KV_BLOCK_TOKENS
            if blocks < 1:
                raise ValueError(f"kv_capacity_tokens must hold at least {KV_BLOCK_TOKENS} tokens")
            self._limits[m] = EngineLimits(
                blocks * KV_BLOCK_TOKENS,
                p.max_batch_size if max_batch_size is None else max_batch_size,
                p.max_num_batched_tokens
                if max_num_batched_tokens is None
                else max_num_batched_tokens,
            )
        self.gpu_type = gpu_type
        self.time_scale = time_scale
        self._seed = seed
        self._clock = clock
        self._log = log.bind(gpu=gpu_type, models=list(models))

        self._requests: dict[str, _SimRequest] = {}
        # requests whose producer streams: their new tokens are reported every iteration
        self._streaming: dict[str, _SimRequest] = {}
        # nothing is resident until start() loads the first model
        self._engine: EngineScheduler[_SimRequest] = EngineScheduler(
            f"sim-{gpu_type}",
            self._limits[models[0]],
            active_model=None,
            pull_at_most=pull_at_most,
        )
        self._residency = ModelResidency(self._profiles)
        self._preload: str | None = None  # the plan's next model, loaded when idle
        self._step_in_flight: Step[_SimRequest] | None = None

        self._on_output: OutputCallback | None = None
        self._outputs: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._delivery_task: asyncio.Task[None] | None = None
        self._deadline = 0.0  # event-loop time at which the modelled iteration ends
        self._ewma_tokens = 0.0
        self._ewma_seconds = 0.0

        self.iterations = 0
        self.model_loads: list[ModelLoad] = []

    # ---- EngineBackend ------------------------------------------------------------------

    @property
    def models(self) -> list[str]:
        return list(self._profiles)

    @property
    def active_model(self) -> str | None:
        return self._engine.active_model

    @property
    def kv_capacity_tokens(self) -> int:
        return self._engine.limits.kv_capacity_tokens

    @property
    def max_batch_size(self) -> int:
        return self._engine.limits.max_batch_size

    @property
    def max_num_batched_tokens(self) -> int | None:
        return self._engine.limits.max_num_batched_tokens

    @property
    def max_model_len(self) -> Mapping[str, int]:
        if self._max_model_len is None:
            return {}
        return {m: min(self._max_model_len, p.model.max_context) for m, p in self._profiles.items()}

    @property
    def preemptions_total(self) -> int:
        return self._engine.preemptions

    def profile(self, model: str) -> EngineProfile:
        return self._profiles[model]

    async def start(self, on_output: OutputCallback) -> None:
        """Load the first model from disk (taking its scaled load time), then start serving."""
        if self._loop_task is not None:
            raise RuntimeError("SimEngine already started")
        self._on_output = on_output
        self._delivery_task = asyncio.create_task(self._deliver(), name="sim-engine-delivery")
        self._deadline = asyncio.get_running_loop().time()
        await self._load(self.models[0])
        self._loop_task = asyncio.create_task(self._run(), name="sim-engine-loop")
        self._log.info("sim_engine_started", time_scale=self.time_scale)

    async def stop(self) -> None:
        """Stop iterating; outputs already finished are still delivered. Requests in flight
        are dropped without an output (``stats().in_flight`` lists them beforehand)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._delivery_task is not None:
            await self._outputs.join()
            self._delivery_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._delivery_task
        self._loop_task = self._delivery_task = None
        self._log.info("sim_engine_stopped", dropped=len(self._requests))
        for sim in list(self._requests.values()):
            self._remove(sim)
        self._requests.clear()

    def submit(self, request: EngineRequest) -> None:
        if self._loop_task is None:
            raise RuntimeError("SimEngine is not running")
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        prompt_len = (
            len(request.prompt_token_ids)
            if request.prompt_token_ids is not None
            else request.prompt_tokens
        )
        now = self._clock()
        problem = self._reject_reason(request, prompt_len)
        if problem is not None:
            self._log.warning("sim_request_rejected", request_id=request.request_id, reason=problem)
            self._outputs.put_nowait(_error_output(request, prompt_len, now, now, problem))
            return
        token_seed = zlib.crc32(f"{self._seed}:{request.request_id}:{request.seed}".encode())
        # an evicted request resumes like a preempted one: its earlier output is prefilled
        # again and generation continues after it
        resumed = list(request.resume_token_ids)
        sim = _SimRequest(
            request_id=request.request_id,
            model=request.model,
            prompt_tokens=prompt_len,
            output_tokens=request.max_tokens,
            mix_prompt_tokens=prompt_len,
            max_tokens=request.max_tokens,
            generated=len(resumed),
            request=request,
            started_at=now,
            token_seed=token_seed,
            resumed=resumed,
            streamed=len(resumed),  # a resumed request's first new token has this offset
        )
        self._requests[request.request_id] = sim
        if request.stream:
            self._streaming[request.request_id] = sim
        self._engine.add(sim)
        self._wakeup.set()

    async def abort(self, request_id: str) -> list[int]:
        """Remove a waiting or running request and return its generated token ids; no output
        is reported for it. Unknown or finished ids return []."""
        sim = self._requests.pop(request_id, None)
        if sim is None:
            return []
        self._remove(sim)
        return self._token_ids(sim)[0]

    def stats(self) -> EngineStats:
        engine = self._engine
        return EngineStats(
            active_model=engine.active_model,
            running=len(engine.running),
            waiting=len(engine.waiting),
            kv_used_tokens=engine.kv_used,
            kv_capacity_tokens=self.kv_capacity_tokens,
            tokens_per_s=self._tokens_per_s(),
            in_flight=list(self._requests),
            warm_models=sorted(set(self._residency.warm) - {engine.active_model}),
        )

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            exact_resume=True,
            prefix_caching=False,
            kv_offload=False,
            sleep_mode=True,
            token_streaming=True,
            notes=("sim: an evicted request's KV is recomputed on resume (no KV offload)",),
        )

    async def set_model_states(self, states: Mapping[str, ModelState]) -> None:
        """Warm models keep a host copy (the next switch to them is a warm start, once the
        copy has been read from disk), cold ones lose it (the next load is from disk). The
        active model is loaded ahead of its requests when the engine is idle."""
        preload = self._residency.apply_states(
            states, self._engine.active_model, self._engine_now()
        )
        if preload is not None:
            self._preload = preload
            self._wakeup.set()

    def wants(self) -> int:
        if self._loop_task is None:
            return 0
        return self._engine.wants()

    # ---- the engine loop ----------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        busy = False
        while True:
            if self._engine.idle:
                busy = False
                preload, self._preload = self._preload, None
                if preload is not None and preload != self._engine.active_model:
                    self._deadline = loop.time()
                    await self._load(preload)
                    continue
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not busy:
                busy = True
                self._deadline = loop.time()  # idle time is not catch-up budget
            try:
                await self._step()
            except Exception as exc:
                # Fail the requests of the broken iteration (or, if scheduling itself broke,
                # the head of the queue) so the loop makes progress instead of spinning.
                self._log.exception("sim_engine_step_failed")
                step = self._step_in_flight
                victims = [sim for sim, _ in step.prefill] if step is not None else []
                engine = self._engine
                victims = victims or list(engine.running)[:1] or list(engine.waiting)[:1]
                for sim in victims:
                    self._fail(sim, f"engine iteration failed: {exc!r}")
            finally:
                self._step_in_flight = None

    async def _step(self) -> None:
        engine = self._engine
        model = engine.model_to_load()
        if model is not None:
            await self._load(model)
            return
        had_waiting = bool(engine.waiting)
        step = self._step_in_flight = engine.plan()
        for sim in step.preempted:
            self._log.debug(
                "sim_request_preempted", request_id=sim.request_id, generated=sim.generated
            )
        if had_waiting and not engine.waiting:
            self._capacity_changed()  # the waiting queue drained: room for more credit
        if step.empty:
            # Cannot happen for requests that passed _reject_reason; never spin on it.
            stuck = next(iter(engine.running), None) or engine.waiting[0]
            self._fail(stuck, "request cannot be scheduled")
            return
        assert engine.active_model is not None
        seconds = step.seconds(self._profiles[engine.active_model])
        await self._sleep_engine(seconds)
        result = engine.commit(step)
        now = self._clock()
        for sim in result.sampled:
            if sim.first_token_at is None:
                sim.first_token_at = now
        if self._streaming:
            ended = {sim.request_id for sim in result.finished}
            for sim in list(self._streaming.values()):
                self._stream_tokens(sim, final=sim.request_id in ended)
        for sim in result.finished:
            self._finish(sim, now)
        self._record_throughput(result.tokens, seconds / self.time_scale)
        self.iterations += 1

    def _stream_tokens(self, sim: _SimRequest, final: bool = False) -> None:
        """Report the tokens a streamed request generated since the last report. The text
        pieces concatenate to the final ``output_text`` (tokens joined by spaces)."""
        self._engine.sync(sim)
        start, end = sim.streamed, sim.generated
        if end <= start:
            return
        try:
            ids = [self._token_at(sim, index) for index in range(start, end)]
        except Exception:
            return  # the sampler broke: the request's output reports the fault
        sim.streamed = end
        text = " ".join(f"t{token}" for token in ids)
        self._emit_tokens(
            TokenDelta(sim.request_id, start, ids, " " + text if start else text, final=final)
        )

    def _token_at(self, sim: _SimRequest, index: int) -> int:
        return _mix64(sim.token_seed, index) % VOCAB_SIZE

    def _token_ids(self, sim: _SimRequest) -> tuple[list[int], Exception | None]:
        """The request's output so far; the sampler's fault, if one broke it, and the tokens
        before it."""
        self._engine.sync(sim)
        tokens = list(sim.resumed[: sim.generated])
        try:
            for index in range(len(tokens), sim.generated):
                tokens.append(self._token_at(sim, index))
        except Exception as exc:
            return tokens, exc
        return tokens, None

    # ---- request bookkeeping ------------------------------------------------------------

    def _remove(self, sim: _SimRequest) -> None:
        self._streaming.pop(sim.request_id, None)
        if not sim.done:
            self._engine.remove(sim)
            sim.done = True

    def _finish(self, sim: _SimRequest, now: float) -> None:
        """Report a request the scheduler has finished."""
        sim.done = True
        self._requests.pop(sim.request_id, None)
        self._streaming.pop(sim.request_id, None)
        tokens, fault = self._token_ids(sim)
        if fault is not None:
            self._log.error("sim_request_failed", request_id=sim.request_id, error=repr(fault))
            self._report_error(sim, f"engine failed the request: {fault!r}")
            return
        self._outputs.put_nowait(
            EngineOutput(
                request_id=sim.request_id,
                output_token_ids=tokens,
                output_text=" ".join(f"t{token}" for token in tokens),
                finish_reason="length",
                prompt_tokens=sim.prompt_tokens,
                started_at=sim.started_at,
                first_token_at=sim.first_token_at,
                finished_at=now,
                preemptions=sim.preemptions,
            )
        )

    def _fail(self, sim: _SimRequest, message: str) -> None:
        if sim.done:
            return
        self._requests.pop(sim.request_id, None)
        self._remove(sim)
        self._report_error(sim, message)

    def _report_error(self, sim: _SimRequest, message: str) -> None:
        output = _error_output(
            sim.request, sim.prompt_tokens, sim.started_at, self._clock(), message
        )
        output.output_token_ids = self._token_ids(sim)[0]
        output.first_token_at = sim.first_token_at
        output.preemptions = sim.preemptions
        self._outputs.put_nowait(output)

    def _reject_reason(self, request: EngineRequest, prompt_len: int) -> str | None:
        """Why the engine would refuse this request (vLLM validates the same at admission)."""
        if request.model not in self._profiles:
            return f"model {request.model!r} is not served here (serves {self.models})"
        if prompt_len < 1:
            return "empty prompt"
        if request.max_tokens < 1:
            return "max_tokens must be >= 1"
        if len(request.resume_token_ids) >= request.max_tokens:
            return "resume_token_ids leave nothing to generate (>= max_tokens)"
        total = prompt_len + request.max_tokens
        max_context = self._profiles[request.model].model.max_context
        if total > max_context:
            return f"prompt + max_tokens = {total} exceeds the model's context of {max_context}"
        if self._max_model_len is not None and total > self._max_model_len:
            return (
                f"prompt + max_tokens = {total} exceeds the engine's context "
                f"(max_model_len) of {self._max_model_len}"
            )
        # A request's KV peaks at prompt + max_tokens - 1 tokens (the last token is never fed).
        capacity = self._limits[request.model].kv_capacity_tokens
        if total - 1 > capacity:
            return f"prompt + max_tokens = {total} exceeds the KV cache of {capacity} tokens"
        return None

    # ---- time, model loads, delivery ----------------------------------------------------

    def _engine_now(self) -> float:
        """Engine time (modelled seconds): when a host copy of weights is ready."""
        return asyncio.get_running_loop().time() * self.time_scale

    async def _sleep_engine(self, engine_seconds: float) -> None:
        """Sleep until the modelled end of this much engine time. Deadlines accumulate, so the
        loop's own overhead does not stretch the emulated timeline."""
        now = asyncio.get_running_loop().time()
        self._deadline = (
            max(self._deadline, now - MAX_CATCH_UP_S) + engine_seconds / self.time_scale
        )
        await asyncio.sleep(max(0.0, self._deadline - now))

    async def _load(self, model: str) -> None:
        engine = self._engine
        previous = engine.active_model
        seconds, source = self._residency.load(model, previous, self._engine_now())
        started = self._clock()
        engine.begin_load(model, self._limits[model])
        try:
            await self._sleep_engine(seconds)
        finally:
            engine.end_load()
        load = ModelLoad(model, source, seconds, started, self._clock())
        self.model_loads.append(load)
        self._log.info(
            "sim_model_loaded",
            model=model,
            previous=previous,
            source=load.source,
            engine_seconds=round(seconds, 3),
        )

    async def _deliver(self) -> None:
        while True:
            output = await self._outputs.get()
            try:
                if self._on_output is not None:
                    await self._on_output(output)
            except Exception:
                self._log.exception("sim_output_callback_failed", request_id=output.request_id)
            finally:
                self._outputs.task_done()

    def _record_throughput(self, tokens: int, wall_seconds: float) -> None:
        a = TOKENS_PER_S_ALPHA
        if self._ewma_seconds == 0.0:
            self._ewma_tokens, self._ewma_seconds = float(tokens), wall_seconds
        else:
            self._ewma_tokens = (1 - a) * self._ewma_tokens + a * tokens
            self._ewma_seconds = (1 - a) * self._ewma_seconds + a * wall_seconds

    def _tokens_per_s(self) -> float:
        return self._ewma_tokens / self._ewma_seconds if self._ewma_seconds > 0 else 0.0


def _mix64(seed: int, index: int) -> int:
    """SplitMix64 of (seed, index): a stable pseudo-random token per position, the same in
    every process (Python's hash() is salted per process)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def _error_output(
    request: EngineRequest, prompt_len: int, started_at: float, now: float, message: str
) -> EngineOutput:
    return EngineOutput(
        request_id=request.request_id,
        output_token_ids=[],
        output_text="",
        finish_reason="abort",
        prompt_tokens=prompt_len,
        started_at=started_at,
        first_token_at=None,
        finished_at=now,
        error=message,
    )
