"""The ``sim`` engine backend: a real-time emulation of a vLLM V1-like continuous-batching engine.

Each iteration follows vLLM V1's scheduler: running requests first (one decode token each, or
the next chunk of an unfinished prefill), then, if nothing was preempted, waiting requests in
FCFS order while the batch-size limit, the per-iteration token budget (chunked prefill) and the
paged KV cache (blocks of 16 tokens) allow. The iteration then "runs" for
``EngineProfile.iteration_time(...) / time_scale`` wall seconds (``asyncio.sleep``). When a
running request needs a KV block and none is free, the most recently admitted running request
is preempted by recompute: its KV is freed, it goes back to the front of the waiting queue,
and on re-admission its prompt and generated tokens are prefilled again.

One model is resident at a time. When the running batch is empty and the head of the waiting
queue needs another model, the engine switches: the first load of a model costs
``load_time_from_disk()``, later ones ``load_time_from_cpu()`` (warm start). Requests of
another model are never admitted while a batch of the resident model runs (strict FCFS).

The sim ignores EOS: every request generates exactly ``max_tokens`` tokens, ids drawn from a
generator seeded by (engine seed, request id, request seed). Producers replaying a trace set
``max_tokens`` to the trace's output length. Timestamps are wall clock (``clock()``); with
``time_scale > 1`` the engine runs that many times faster than the modelled GPU.
See docs/engine-model.md for what is and is not emulated.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import structlog

from agents.engine import (
    EngineBackend,
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
    ModelState,
    OutputCallback,
)
from qlm.engine_model import KV_BLOCK_TOKENS, EngineProfile, get_profile

log = structlog.get_logger(__name__)

VOCAB_SIZE = 32_000  # range of the emulated token ids
WANTS_AT_MOST = 8  # requests wants() asks for at once, so pulled work stays ordered upstream
KV_SATURATED_FRACTION = 0.9  # wants() returns 0 above this KV usage
TOKENS_PER_S_ALPHA = 0.05  # EWMA weight of the latest iteration
# When the event loop falls behind the modelled iteration ends, the engine runs iterations back
# to back to catch up, but never by more than this much wall time (a stalled process does not
# get a burst of free iterations afterwards).
MAX_CATCH_UP_S = 0.01


class _State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class _SimRequest:
    request: EngineRequest
    prompt_len: int
    started_at: float
    token_seed: int  # token i is a function of (this, i): a resumed request continues exactly
    generated: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    kv_blocks: int = 0
    first_token_at: float | None = None
    preemptions: int = 0
    state: _State = _State.WAITING

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.generated)


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
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        tp: int | None = None,
        profiles: dict[str, EngineProfile] | None = None,
    ) -> None:
        """``profiles`` replaces the roofline profile of some models (e.g. measured ones);
        ``tp=None`` uses the largest TP degree any of the models needs, since the models share
        one GPU group. ``kv_capacity_tokens`` and ``max_batch_size`` override every model's."""
        if not models:
            raise ValueError("SimEngine needs at least one model")
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        given = dict(profiles or {})
        if tp is None:
            tp = max(given[m].tp if m in given else get_profile(gpu_type, m).tp for m in models)
        self._profiles = {m: given.get(m) or get_profile(gpu_type, m, tp=tp) for m in models}
        self._kv_blocks_total = {
            m: (p.kv_capacity_tokens if kv_capacity_tokens is None else kv_capacity_tokens)
            // KV_BLOCK_TOKENS
            for m, p in self._profiles.items()
        }
        if any(blocks < 1 for blocks in self._kv_blocks_total.values()):
            raise ValueError(f"kv_capacity_tokens must hold at least {KV_BLOCK_TOKENS} tokens")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self._max_batch = {
            m: p.max_batch_size if max_batch_size is None else max_batch_size
            for m, p in self._profiles.items()
        }
        self.gpu_type = gpu_type
        self.time_scale = time_scale
        self._seed = seed
        self._clock = clock
        self._log = log.bind(gpu=gpu_type, models=list(models))

        self._requests: dict[str, _SimRequest] = {}
        self._waiting: deque[_SimRequest] = deque()
        self._running: list[_SimRequest] = []
        self._kv_blocks_used = 0
        self._active_model: str | None = None
        self._loading_model: str | None = None
        self._loaded_before: set[str] = set()  # models with a copy in host memory
        self._preload: str | None = None  # the plan's next model, loaded when idle
        self._plan: dict[_SimRequest, int] = {}  # the iteration in flight

        self._on_output: OutputCallback | None = None
        self._outputs: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._delivery_task: asyncio.Task[None] | None = None
        self._deadline = 0.0  # event-loop time at which the modelled iteration ends
        self._ewma_tokens = 0.0
        self._ewma_seconds = 0.0

        self.iterations = 0
        self.preemptions_total = 0
        self.model_loads: list[ModelLoad] = []

    # ---- EngineBackend ------------------------------------------------------------------

    @property
    def models(self) -> list[str]:
        return list(self._profiles)

    @property
    def active_model(self) -> str | None:
        return self._active_model

    @property
    def kv_capacity_tokens(self) -> int:
        return self._kv_blocks_total[self._current_model()] * KV_BLOCK_TOKENS

    @property
    def max_batch_size(self) -> int:
        return self._max_batch[self._current_model()]

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
        sim = _SimRequest(
            request=request, prompt_len=prompt_len, started_at=now, token_seed=token_seed
        )
        # an evicted request resumes like a preempted one: its earlier output is prefilled
        # again and generation continues after it
        sim.generated = list(request.resume_token_ids)
        self._requests[request.request_id] = sim
        self._waiting.append(sim)
        self._wakeup.set()

    async def abort(self, request_id: str) -> list[int]:
        """Remove a waiting or running request and return its generated token ids; no output
        is reported for it. Unknown or finished ids return []."""
        sim = self._requests.pop(request_id, None)
        if sim is None:
            return []
        self._remove(sim)
        return list(sim.generated)

    def stats(self) -> EngineStats:
        return EngineStats(
            active_model=self._active_model,
            running=len(self._running),
            waiting=len(self._waiting),
            kv_used_tokens=self._kv_blocks_used * KV_BLOCK_TOKENS,
            kv_capacity_tokens=self.kv_capacity_tokens,
            tokens_per_s=self._tokens_per_s(),
            in_flight=list(self._requests),
            warm_models=sorted(self._loaded_before - {self._active_model}),
        )

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            exact_resume=True,
            prefix_caching=False,
            kv_offload=False,
            sleep_mode=True,
            notes=("sim: an evicted request's KV is recomputed on resume (no KV offload)",),
        )

    async def set_model_states(self, states: Mapping[str, ModelState]) -> None:
        """Warm models keep a host copy (the next switch to them is a warm start), cold ones
        lose it (the next load is from disk). The active model is loaded ahead of its
        requests when the engine is idle."""
        for model, state in states.items():
            if model not in self._profiles:
                continue
            if state == "cold" and model != self._active_model:
                self._loaded_before.discard(model)
            elif state == "warm":
                self._loaded_before.add(model)
            elif state == "active" and model != self._active_model:
                self._loaded_before.add(model)
                self._preload = model
                self._wakeup.set()

    def wants(self) -> int:
        if self._loop_task is None or self._waiting or self._loading_model is not None:
            return 0
        model = self._current_model()
        if self._kv_blocks_used > KV_SATURATED_FRACTION * self._kv_blocks_total[model]:
            return 0
        return max(0, min(WANTS_AT_MOST, self._max_batch[model] - len(self._running)))

    # ---- the engine loop ----------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        busy = False
        while True:
            if not self._waiting and not self._running:
                busy = False
                preload, self._preload = self._preload, None
                if preload is not None and preload != self._active_model:
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
                victims = list(self._plan) or self._running[:1] or list(self._waiting)[:1]
                for sim in victims:
                    self._fail(sim, f"engine iteration failed: {exc!r}")
            finally:
                self._plan = {}

    async def _step(self) -> None:
        if not self._running and self._waiting[0].request.model != self._active_model:
            await self._load(self._waiting[0].request.model)
            return
        had_waiting = bool(self._waiting)
        self._plan = self._schedule()
        if had_waiting and not self._waiting:
            self._capacity_changed()  # the waiting queue drained: room for more credit
        if not self._plan:
            # Cannot happen for requests that passed _reject_reason; never spin on it.
            stuck = self._running[0] if self._running else self._waiting[0]
            self._fail(stuck, "request cannot be scheduled")
            return
        model = self._current_model()
        prefill_tokens = decode_batch = context_tokens = 0
        attention_pairs = 0.0
        for sim, n_new in self._plan.items():
            if n_new == 1 and sim.num_computed > 0:
                decode_batch += 1
                context_tokens += sim.num_computed + 1
            else:
                prefill_tokens += n_new
                attention_pairs += n_new * sim.num_computed + n_new * (n_new + 1) / 2
        seconds = self._profiles[model].iteration_time(
            prefill_tokens,
            decode_batch,
            context_tokens,
            prefill_attention_pairs=attention_pairs,
        )
        await self._sleep_engine(seconds)
        self._commit(self._plan, seconds)
        self.iterations += 1

    def _schedule(self) -> dict[_SimRequest, int]:
        """One vLLM V1 scheduling step: {request: tokens to compute this iteration}."""
        model = self._current_model()
        budget = self._profiles[model].max_num_batched_tokens
        plan: dict[_SimRequest, int] = {}
        preempted = False
        index = 0
        while index < len(self._running) and budget > 0:
            sim = self._running[index]
            n_new = min(sim.num_tokens - sim.num_computed, budget)
            while not self._allocate(sim, sim.num_computed + n_new):
                victim = self._running[-1]  # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is sim:
                    break
            if sim.state is not _State.RUNNING:
                break  # it preempted itself: nothing after it in `running` is left either
            plan[sim] = n_new
            budget -= n_new
            index += 1
        if preempted:
            return plan
        max_batch = self._max_batch[model]
        while self._waiting and len(self._running) < max_batch and budget > 0:
            sim = self._waiting[0]
            if sim.request.model != model:
                break  # strict FCFS: no other model's request while this model is resident
            n_new = min(sim.num_tokens - sim.num_computed, budget)
            if not self._allocate(sim, sim.num_computed + n_new):
                break
            self._waiting.popleft()
            sim.state = _State.RUNNING
            self._running.append(sim)
            plan[sim] = n_new
            budget -= n_new
        return plan

    def _commit(self, plan: dict[_SimRequest, int], seconds: float) -> None:
        now = self._clock()
        generated = 0
        for sim, n_new in plan.items():
            if sim.state is not _State.RUNNING:
                continue  # aborted while the iteration ran
            try:
                sim.num_computed += n_new
                if sim.num_computed < sim.num_tokens:
                    continue  # a prefill chunk; the request samples when its prefill completes
                sim.generated.append(self._next_token(sim))
                generated += 1
                if sim.first_token_at is None:
                    sim.first_token_at = now
                if len(sim.generated) >= sim.request.max_tokens:
                    self._finish(sim, now)
            except Exception as exc:
                self._log.exception("sim_request_failed", request_id=sim.request.request_id)
                self._fail(sim, f"engine failed the request: {exc!r}")
        self._record_throughput(generated, seconds / self.time_scale)

    def _next_token(self, sim: _SimRequest) -> int:
        return _mix64(sim.token_seed, len(sim.generated)) % VOCAB_SIZE

    # ---- KV cache and request bookkeeping -----------------------------------------------

    def _allocate(self, sim: _SimRequest, tokens: int) -> bool:
        """Grow ``sim``'s KV to hold ``tokens`` tokens; False when too few blocks are free."""
        need = math.ceil(tokens / KV_BLOCK_TOKENS) - sim.kv_blocks
        if need <= 0:
            return True
        if self._kv_blocks_used + need > self._kv_blocks_total[self._current_model()]:
            return False
        sim.kv_blocks += need
        self._kv_blocks_used += need
        return True

    def _free_kv(self, sim: _SimRequest) -> None:
        self._kv_blocks_used -= sim.kv_blocks
        sim.kv_blocks = 0

    def _preempt(self, sim: _SimRequest) -> None:
        """Preempt by recompute (vLLM V1): free the KV, keep the generated tokens, requeue first."""
        self._running.remove(sim)
        self._free_kv(sim)
        sim.num_computed = 0
        sim.state = _State.WAITING
        sim.preemptions += 1
        self.preemptions_total += 1
        self._waiting.appendleft(sim)
        self._log.debug(
            "sim_request_preempted",
            request_id=sim.request.request_id,
            generated=len(sim.generated),
        )

    def _remove(self, sim: _SimRequest) -> None:
        if sim.state is _State.RUNNING:
            self._running.remove(sim)
        elif sim.state is _State.WAITING:
            self._waiting.remove(sim)
        self._free_kv(sim)
        sim.state = _State.DONE

    def _finish(self, sim: _SimRequest, now: float) -> None:
        self._requests.pop(sim.request.request_id, None)
        self._remove(sim)
        self._outputs.put_nowait(
            EngineOutput(
                request_id=sim.request.request_id,
                output_token_ids=list(sim.generated),
                output_text=" ".join(f"t{token}" for token in sim.generated),
                finish_reason="length",
                prompt_tokens=sim.prompt_len,
                started_at=sim.started_at,
                first_token_at=sim.first_token_at,
                finished_at=now,
                preemptions=sim.preemptions,
            )
        )

    def _fail(self, sim: _SimRequest, message: str) -> None:
        if sim.state is _State.DONE:
            return
        self._requests.pop(sim.request.request_id, None)
        self._remove(sim)
        output = _error_output(sim.request, sim.prompt_len, sim.started_at, self._clock(), message)
        output.output_token_ids = list(sim.generated)
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
        # A request's KV peaks at prompt + max_tokens - 1 tokens (the last token is never fed).
        capacity = self._kv_blocks_total[request.model] * KV_BLOCK_TOKENS
        if total - 1 > capacity:
            return f"prompt + max_tokens = {total} exceeds the KV cache of {capacity} tokens"
        return None

    # ---- time, model loads, delivery ----------------------------------------------------

    def _current_model(self) -> str:
        return self._active_model or self._loading_model or self.models[0]

    async def _sleep_engine(self, engine_seconds: float) -> None:
        """Sleep until the modelled end of this much engine time. Deadlines accumulate, so the
        loop's own overhead does not stretch the emulated timeline."""
        now = asyncio.get_running_loop().time()
        self._deadline = (
            max(self._deadline, now - MAX_CATCH_UP_S) + engine_seconds / self.time_scale
        )
        await asyncio.sleep(max(0.0, self._deadline - now))

    async def _load(self, model: str) -> None:
        profile = self._profiles[model]
        cold = model not in self._loaded_before
        seconds = profile.load_time_from_disk() if cold else profile.load_time_from_cpu()
        started = self._clock()
        self._loading_model, previous = model, self._active_model
        self._active_model = None  # the old weights are going; nothing is resident meanwhile
        try:
            await self._sleep_engine(seconds)
        finally:
            self._loading_model = None
        self._active_model = model
        self._loaded_before.add(model)
        load = ModelLoad(model, "disk" if cold else "cpu", seconds, started, self._clock())
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
