"""The engine backend interface: what an agent needs from an inference engine.

Three implementations: ``qlm.agents.sim`` (a real-time continuous-batching emulator driven by
:mod:`qlm.engine_model`), ``qlm.agents.vllm`` (an in-process vLLM ``AsyncLLM``) and
``qlm.agents.http`` (an existing vLLM OpenAI server, by URL). The agent only talks to this
interface, so everything above it is tested on the sim backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

ModelState = Literal["active", "warm", "cold"]


@dataclass
class EngineRequest:
    request_id: str
    model: str
    prompt_token_ids: list[int] | None  # exact prompt when the producer sent token ids
    prompt_tokens: int  # prompt length (estimated when only text was sent)
    prompt_text: str | None
    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    priority: int = 0
    # Exact resume after an eviction: the tokens this request already generated in an earlier
    # attempt. The engine continues after them (prompt + resume ids as its prompt, max_tokens -
    # len(resume ids) new tokens) and reports them as the start of ``output_token_ids``, so the
    # output equals an uninterrupted run's (greedy sampling).
    resume_token_ids: list[int] = field(default_factory=list)
    deadline: float | None = None  # unix s by which the request should finish (None: none)
    slo_class: str | None = None  # its SLO class (SABER's task type: OutputBudget)
    # the producer reads the output as it is generated: a streaming backend reports this
    # request's TokenDeltas (others' it may skip, as nobody reads them)
    stream: bool = False


@dataclass
class EngineOutput:
    request_id: str
    output_token_ids: list[int]  # includes the request's resume_token_ids
    output_text: str
    finish_reason: str  # "length" | "stop" | "abort"
    prompt_tokens: int
    started_at: float  # wall clock, unix s: the engine accepted the request
    first_token_at: float | None
    finished_at: float
    preemptions: int = 0
    error: str | None = None  # set when the engine failed this request
    # with ``error``: the failure was the engine's (it died or restarted), not the request's,
    # so the request is requeued (with its output so far) instead of answered with an error
    retryable: bool = False


@dataclass
class EngineStats:
    active_model: str | None
    running: int
    waiting: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    tokens_per_s: float
    in_flight: list[str] = field(default_factory=list)
    warm_models: list[str] | None = None  # models ready in host memory; None: not tracked
    # False while the engine does not answer (an http backend's server died or is restarting):
    # its work is better placed elsewhere until it answers again
    serving: bool = True


@dataclass(frozen=True)
class EngineCapabilities:
    """What a backend can do beyond serving, detected when it starts. The planner's LSOs fall
    back when one is missing: no ``sleep_mode`` -> model switches are cold loads, no
    ``kv_offload`` -> evictions recompute. ``notes`` says why something is off."""

    exact_resume: bool = True  # abort() returns the generated ids and resume_token_ids work
    prefix_caching: bool = False  # a resumed request's earlier KV blocks are reused
    kv_offload: bool = False  # evicted requests' KV is kept in host memory and reloaded
    sleep_mode: bool = False  # a model can sleep in host memory (level 1) and wake fast
    token_streaming: bool = False  # TokenDelta reported as tokens are generated
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    """Tokens a request generated since the backend last reported it (per-token streaming).

    ``offset`` is the index in the request's ``output_token_ids`` (resume ids included) of the
    first token here, so a consumer that saw tokens up to some offset can drop what it already
    has after a failover or an exact resume."""

    request_id: str
    offset: int
    token_ids: list[int]
    text: str  # the detokenized text of these tokens ("" when the backend has no tokenizer)
    # the engine finished the request with these tokens: nothing follows them (the chunk that
    # carries them tells the coordinator that a producer may hold the whole answer)
    final: bool = False


OutputCallback = Callable[[EngineOutput], Awaitable[None]]
# Called from the engine's loop for every step that produced tokens; it must not block (the
# agent buffers the deltas and publishes them every few milliseconds).
TokenCallback = Callable[[TokenDelta], None]


class EngineBackend(ABC):
    """One engine instance (one GPU or TP group) serving one or more models."""

    @property
    @abstractmethod
    def models(self) -> list[str]: ...

    @property
    @abstractmethod
    def kv_capacity_tokens(self) -> int: ...

    @property
    @abstractmethod
    def max_batch_size(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int | None:
        """The engine's token budget per iteration (prompt chunks and decode tokens), where the
        backend knows it; None: the engine's default, unknown here. `qlm profile` records it in
        the measured profile, which the coordinator then prices the engine with."""
        return None

    @property
    def max_model_len(self) -> Mapping[str, int]:
        """Per served model, the context (prompt + output tokens) the engine accepts, as the
        engine itself says once it runs; a model it says nothing of is left out (the sim's:
        the catalog's limit then stands alone)."""
        return {}

    @abstractmethod
    async def start(self, on_output: OutputCallback) -> None:
        """Start the engine; every finished (or failed) request is reported to ``on_output``."""

    @abstractmethod
    async def stop(self) -> None: ...

    @abstractmethod
    def submit(self, request: EngineRequest) -> None:
        """Queue a request on the engine (non-blocking)."""

    @abstractmethod
    async def abort(self, request_id: str) -> list[int]:
        """Stop a request and return its output token ids so far (resume ids included); no
        output is reported for it afterwards. Unknown or finished ids return []."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities()

    async def set_model_states(self, states: Mapping[str, ModelState]) -> None:
        """Carry out the plan's model placement: the ``active`` model resident (loaded and
        awake), ``warm`` ones kept ready in host memory, ``cold`` ones released. Models not
        named keep their state. A backend without the mechanism ignores what it cannot do."""
        return None

    def set_capacity_listener(self, listener: Callable[[], None]) -> None:
        """Register a callback the engine calls when ``wants()`` may have grown (it admitted
        waiting requests, or finished some): the agent then grants credit at once instead of
        at its next polling tick. Optional: without it the agent still polls."""
        self._capacity_listener = listener

    def set_token_listener(self, listener: TokenCallback | None) -> None:
        """Register a callback for tokens as they are generated (``TokenDelta``). Backends
        that stream call ``_emit_tokens`` and say ``token_streaming`` in their capabilities;
        others report tokens only in the final ``EngineOutput``."""
        self._token_listener = listener

    def _emit_tokens(self, delta: TokenDelta) -> None:
        listener = getattr(self, "_token_listener", None)
        if listener is not None and delta.token_ids:
            listener(delta)

    def _capacity_changed(self) -> None:
        listener = getattr(self, "_capacity_listener", None)
        if listener is not None:
            listener()

    @abstractmethod
    def wants(self) -> int:
        """How many more requests the engine should be given now (0 when it is saturated:
        its waiting queue is non-empty or its KV cache is nearly full)."""
