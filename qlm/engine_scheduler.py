"""The one engine scheduler: the step rules of a vLLM V1-like continuous-batching engine.

Both engines that emulate vLLM use this class and nothing else to decide what runs: the
``sim`` agent backend (:mod:`qlm.agents.sim`, real time: it sleeps through every iteration) and
the cluster simulator's instance (:mod:`qlm.tooling.simulator.instance`, simulated time: it jumps
over whole decode runs). Each caller owns its clock, its I/O and its timings' bookkeeping;
:class:`EngineScheduler` owns the waiting queue, the running batch, the KV accounting and
every decision about them. The costs of what it decides come from :mod:`qlm.engine_model`
(:meth:`Step.seconds`, :meth:`~qlm.engine_model.EngineProfile.decode_segment_time`).

The rules (docs/engine-model.md, section 5):

* **One iteration** (:meth:`EngineScheduler.plan`): every decoding request computes one
  token; the requests still prefilling (a new prompt, a recompute after preemption, a resumed
  request's earlier output) get the next chunk of their prefill, in admission order, within
  the per-iteration token budget (``max_num_batched_tokens``: chunked prefill); then, unless
  something was preempted, waiting requests of the resident model join in FCFS order while the
  batch limit, the token budget and the KV cache allow. A decode token is never starved by a
  prefill chunk; vLLM V1 walks its running list in admission order instead, which is the same
  whenever the one unfinished prefill is the newest request, as it is under FCFS admission.
* **KV** is counted in tokens: a request holds the KV of the tokens it has computed. (vLLM
  allocates blocks of 16 tokens; the rounding, < 16 tokens per running request, is ignored, so
  that a decode run's KV growth stays linear and can be jumped over in closed form.)
* **Preemption by recompute** (vLLM V1): when the batch's next tokens do not fit, the most
  recently admitted running request loses its KV and goes back to the front of the waiting
  queue, its generated tokens kept; re-admitted, it prefills prompt and output again.
* **Swap**: a request whose KV an engine copied to host memory (the planner's ``swap``
  eviction, :attr:`EngineSeq.swapped_on`) is re-admitted with that KV restored; the copy-back
  is charged to the iteration (:attr:`Step.restored`).
* **Model switches**: one model is resident at a time; when the batch is empty and the head of
  the waiting queue needs another model, that model is loaded (:meth:`model_to_load`), never
  earlier (strict FCFS across models). :class:`ModelResidency` decides what a load costs: from
  host memory (a warm copy: vLLM's sleep mode level 1) or from disk.
* **Static batching** (``static_batch``, the SHEPHERD baseline): a whole batch is formed at
  once and nothing joins until every member finished.
* **Admission signal** (:meth:`EngineScheduler.wants`): how many requests the agent pulls now.

Decoding requests are not touched one by one per iteration: the scheduler keeps a *decode
clock* (iterations so far) and, for the decoding set, the sum of their contexts as an affine
function of it and a heap of the clock values at which each finishes. A prefill iteration
costs O(requests being prefilled); a decode run O(log batch). :meth:`EngineScheduler.sync`
brings one request's counts up to date when a caller needs them.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from qlm.engine_model import EngineProfile

# The agent's admission control: pull at most this many requests at once (so pulled work stays
# ordered upstream, in the coordinator's virtual queue), and only while the engine's waiting
# queue is empty and its KV usage is at most this fraction of the cache. The pull size is the
# agent's setting (`qlm agent --pull-at-most`, a pool's `pull_at_most` in a scenario); this is
# its default. Smaller pulls spread prompts over more iterations (docs/benchmarks.md,
# "Pull size").
WANTS_AT_MOST = 8
KV_SATURATED_FRACTION = 0.9

_entry_seq = itertools.count()


@dataclass(slots=True, eq=False, kw_only=True)
class EngineSeq:
    """One request inside an engine. Callers subclass it with what they keep besides.

    While the request decodes its counts advance implicitly with the scheduler's decode clock;
    ``generated`` and ``computed`` are brought up to date whenever it stops decoding (finish,
    preemption, removal) or on :meth:`EngineScheduler.sync`."""

    request_id: str = ""
    model: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0  # tokens it generates in all (the sim ignores EOS)
    # the request as an admission speed model sees it in the running mix: its prompt and token
    # budget when it was dispatched (an evicted request comes back as prompt + generated)
    mix_prompt_tokens: int = 0
    max_tokens: int = 0
    generated: int = 0
    computed: int = 0  # tokens whose KV is in the cache of the engine running it
    preemptions: int = 0  # preemptions for KV space (recompute)
    swapped_on: str | None = None  # engine whose host memory holds its KV (swap eviction)
    swapped_tokens: int = 0
    # decode bookkeeping: the decode clock and `generated` when decoding began
    decoding: bool = False
    t0: int = 0
    g0: int = 0
    entry: list[Any] | None = None  # its entry in the scheduler's finish heap

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        return self.output_tokens - self.generated


S = TypeVar("S", bound=EngineSeq)


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """The resident model's limits (from its :class:`~qlm.engine_model.EngineProfile`, or a
    caller's overrides)."""

    kv_capacity_tokens: int
    max_batch_size: int
    max_num_batched_tokens: int

    @classmethod
    def of(cls, profile: EngineProfile) -> EngineLimits:
        return cls(
            profile.kv_capacity_tokens, profile.max_batch_size, profile.max_num_batched_tokens
        )


@dataclass(slots=True)
class Step(Generic[S]):
    """One planned iteration: the prefill part (request, tokens to compute) and the decoding
    batch, with what the engine model needs to time it."""

    prefill: list[tuple[S, int]]
    decode_batch: int
    context_tokens: int  # over the decoding requests: the context each attends to
    preempted: list[S] = field(default_factory=list)
    restored: list[int] = field(default_factory=list)  # KV tokens copied back from host memory

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)

    @property
    def attention_pairs(self) -> float:
        """Query-key pairs of the prefill chunks: each chunk attends to the KV already
        computed and causally to itself."""
        return sum(n * seq.computed + n * (n + 1) / 2 for seq, n in self.prefill)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode_batch

    def seconds(self, profile: EngineProfile) -> float:
        """The iteration's duration (the KV copy-back of swapped requests not included)."""
        return profile.iteration_time(
            self.prefill_tokens,
            self.decode_batch,
            self.context_tokens,
            prefill_attention_pairs=self.attention_pairs,
        )

    def restore_seconds(self, profile: EngineProfile) -> float:
        return sum(profile.kv_transfer_time(tokens) for tokens in self.restored)


@dataclass(slots=True)
class StepResult(Generic[S]):
    """What an iteration (or a decode run) produced."""

    sampled: list[S]  # prefills that completed and sampled a token
    finished: list[S]  # requests that generated their last token
    tokens: int  # tokens generated


class EngineScheduler(Generic[S]):
    """The waiting queue, the running batch and the KV cache of one engine, and the rules that
    move requests between them (module docstring). ``engine_id`` names the engine for swapped
    KV (:attr:`EngineSeq.swapped_on`)."""

    def __init__(
        self,
        engine_id: str,
        limits: EngineLimits,
        *,
        active_model: str | None,
        static_batch: int | None = None,
        pull_at_most: int = WANTS_AT_MOST,
    ) -> None:
        if pull_at_most < 1:
            raise ValueError(f"pull_at_most must be >= 1, got {pull_at_most}")
        self.engine_id = engine_id
        self.limits = limits
        self.active_model = active_model
        self.loading: str | None = None
        self.static_batch = static_batch
        self.pull_at_most = pull_at_most
        self.running: dict[S, None] = {}  # admission order (the last is preempted first)
        self.prefilling: dict[S, None] = {}  # running, prompt (or recompute) not done
        self.waiting: deque[S] = deque()
        self.clock = 0  # decode clock: iterations so far
        self.n_dec = 0
        self._dec_base = 0  # sum over decoding requests of computed - clock
        self._kv_prefill = 0  # sum of computed over prefilling requests
        self._finishes: list[list[Any]] = []  # [finish clock, seq, request, alive]
        # the running mix, for an admission speed model (SABER)
        self.prompt_sum = 0
        self.max_tokens_sum = 0
        self.preemptions = 0

    # ------------------------------------------------------------------ views
    @property
    def kv_used(self) -> int:
        return self._dec_base + self.n_dec * self.clock + self._kv_prefill

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def __contains__(self, seq: S) -> bool:
        return seq in self.running or seq in self.waiting

    def wants(self) -> int:
        """How many requests the agent pulls now: none while a model loads or requests wait;
        for a static batch, a whole batch once the last one finished; otherwise up to
        ``pull_at_most`` free batch slots while the KV cache is not saturated."""
        if self.loading is not None or self.waiting:
            return 0
        if self.static_batch is not None:
            return self.static_batch if not self.running else 0
        limits = self.limits
        if self.kv_used > KV_SATURATED_FRACTION * limits.kv_capacity_tokens:
            return 0
        return max(0, min(self.pull_at_most, limits.max_batch_size - len(self.running)))

    # ------------------------------------------------------------------ inputs
    def add(self, seq: S) -> None:
        self.waiting.append(seq)

    def remove(self, seq: S) -> bool:
        """Take a request out (abort, eviction), its counts brought up to date and its KV
        freed (``computed`` keeps what it held). False when it is not in this engine."""
        if seq in self.running:
            self._stop_decoding(seq)
            self._leave_running(seq)
            return True
        try:
            self.waiting.remove(seq)
        except ValueError:
            return False
        return True

    def sync(self, seq: S) -> None:
        """Bring a decoding request's ``generated`` and ``computed`` up to date (it keeps
        decoding)."""
        if seq.decoding:
            advanced = self.clock - seq.t0
            seq.generated = seq.g0 + advanced
            seq.computed = seq.prompt_tokens + seq.g0 - 1 + advanced

    # ------------------------------------------------------------------ model switches
    def model_to_load(self) -> str | None:
        """The model to switch to now: the waiting head's, once the batch is empty."""
        if self.running or not self.waiting or self.loading is not None:
            return None
        model = self.waiting[0].model
        return None if model == self.active_model else model

    def begin_load(self, model: str, limits: EngineLimits) -> None:
        """The old weights are going: nothing is resident until :meth:`end_load`."""
        self.loading, self.active_model = model, None
        self.limits = limits

    def end_load(self) -> None:
        if self.loading is not None:
            self.active_model, self.loading = self.loading, None

    # ------------------------------------------------------------------ one iteration
    def plan(self) -> Step[S]:
        """The next iteration (module docstring). Admits, preempts and restores as it plans;
        the tokens are computed by :meth:`commit` once the caller has run the iteration."""
        limits = self.limits
        capacity = limits.kv_capacity_tokens
        step: Step[S] = Step([], 0, 0)
        prefill = step.prefill
        running = self.running
        if self.static_batch is not None and not running:
            # SHEPHERD: the whole fixed batch is formed at once; its prompts are then
            # prefilled chunk by chunk below, and nothing joins until every member finished
            reserved = self.kv_used
            while self.waiting and len(running) < self.static_batch:
                seq = self.waiting[0]
                if seq.model != self.active_model:
                    break
                if reserved + seq.num_tokens > capacity and running:
                    break
                reserved += seq.num_tokens
                self.waiting.popleft()
                self._admit(seq, restore=0)
        preempted = step.preempted
        while self.n_dec and self.kv_used + self.n_dec > capacity:
            victim = next(reversed(running))
            self._preempt(victim)
            preempted.append(victim)
        budget = limits.max_num_batched_tokens - self.n_dec
        planned = 0
        for seq in list(self.prefilling):
            if budget <= 0:
                break
            if seq not in running:
                continue  # preempted just now to make room for one ahead of it
            n_new = min(seq.num_tokens - seq.computed, budget)
            gone = False
            while self.kv_used + self.n_dec + planned + n_new > capacity:
                victim = next(reversed(running))
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    gone = True
                    break
            if gone:
                break  # it preempted itself: nothing after it in `running` is left either
            prefill.append((seq, n_new))
            planned += n_new
            budget -= n_new
        if not preempted and self.static_batch is None:
            while self.waiting and len(running) < limits.max_batch_size and budget > 0:
                seq = self.waiting[0]
                if seq.model != self.active_model:
                    break  # strict FCFS: no other model's request while this one is resident
                restore = 0
                if seq.swapped_on == self.engine_id and seq.swapped_tokens:
                    restore = seq.swapped_tokens
                n_new = min(seq.num_tokens - restore, budget)
                if self.kv_used + self.n_dec + planned + restore + n_new > capacity:
                    break
                self.waiting.popleft()
                if restore:
                    step.restored.append(restore)
                self._admit(seq, restore)
                prefill.append((seq, n_new))
                planned += n_new
                budget -= n_new
        step.decode_batch = self.n_dec
        step.context_tokens = self._dec_base + self.n_dec * (self.clock + 1)
        return step

    def commit(self, step: Step[S]) -> StepResult[S]:
        """The planned iteration ran: every decoding request got its token, the prefill chunks
        are computed. Requests removed meanwhile (aborts) are skipped."""
        self.clock += 1
        sampled: list[S] = []
        finished: list[S] = []
        tokens = step.decode_batch
        for seq, n_new in step.prefill:
            if seq not in self.prefilling:
                continue
            seq.computed += n_new
            self._kv_prefill += n_new
            if seq.computed < seq.num_tokens:
                continue  # a prefill chunk; it samples once its whole prefill is done
            seq.generated += 1
            tokens += 1
            sampled.append(seq)
            if seq.remaining <= 0:
                self._leave_running(seq)
                finished.append(seq)
                continue
            del self.prefilling[seq]
            self._kv_prefill -= seq.computed
            self._start_decoding(seq)
        self._finish_due(finished)
        return StepResult(sampled, finished, tokens)

    # ------------------------------------------------------------------ decode runs
    def decode_steps(self, limit: int | None = None) -> int:
        """How many pure decode iterations can run back to back from here: until the first
        request finishes or the KV cache is full (at least 1), at most ``limit``."""
        if not self.n_dec:
            raise RuntimeError(f"{self.engine_id}: no decoding batch")
        steps = self._next_finish() - self.clock
        room = (self.limits.kv_capacity_tokens - self.kv_used) // self.n_dec
        return max(1, min(steps, room, limit or steps))

    def decode_context(self) -> int:
        """Context tokens of the next decode iteration (the run's first)."""
        return self._dec_base + self.n_dec * (self.clock + 1)

    def advance(self, steps: int) -> StepResult[S]:
        """``steps`` pure decode iterations ran (:meth:`decode_steps`)."""
        tokens = self.n_dec * steps
        self.clock += steps
        finished: list[S] = []
        self._finish_due(finished)
        return StepResult([], finished, tokens)

    # ------------------------------------------------------------------ bookkeeping
    def _admit(self, seq: S, restore: int) -> None:
        seq.computed = restore
        seq.swapped_on, seq.swapped_tokens = None, 0
        self.running[seq] = None
        self.prefilling[seq] = None
        self._kv_prefill += restore
        self.prompt_sum += seq.mix_prompt_tokens
        self.max_tokens_sum += seq.max_tokens

    def _preempt(self, seq: S) -> None:
        """KV-space preemption by recompute (vLLM V1): free the KV, keep the generated tokens,
        requeue first."""
        self._stop_decoding(seq)
        self._leave_running(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _start_decoding(self, seq: S) -> None:
        """From now on the request gains a token per decode-clock tick (computed = tokens - 1)."""
        seq.decoding, seq.t0, seq.g0 = True, self.clock, seq.generated
        self.n_dec += 1
        self._dec_base += seq.computed - self.clock
        seq.entry = [self.clock + seq.remaining, next(_entry_seq), seq, True]
        heapq.heappush(self._finishes, seq.entry)

    def _stop_decoding(self, seq: S) -> None:
        """Bring the request's counts up to date and take it out of the decoding aggregates."""
        if not seq.decoding:
            return
        advanced = self.clock - seq.t0
        seq.generated = seq.g0 + advanced
        computed_at_start = seq.prompt_tokens + seq.g0 - 1
        self._dec_base -= computed_at_start - seq.t0
        seq.computed = computed_at_start + advanced
        self.n_dec -= 1
        seq.decoding = False
        if seq.entry is not None:
            seq.entry[3] = False
            seq.entry = None

    def _next_finish(self) -> int:
        heap = self._finishes
        while not heap[0][3]:
            heapq.heappop(heap)
        return int(heap[0][0])

    def _finish_due(self, finished: list[S]) -> None:
        heap = self._finishes
        while heap and heap[0][0] <= self.clock:
            _, _, seq, alive = heapq.heappop(heap)
            if alive:
                self._stop_decoding(seq)
                self._leave_running(seq)
                finished.append(seq)

    def _leave_running(self, seq: S) -> None:
        """Take a request (no longer decoding) out of the running set and its KV out of the
        cache."""
        del self.running[seq]
        if seq in self.prefilling:
            del self.prefilling[seq]
            self._kv_prefill -= seq.computed
        self.prompt_sum -= seq.mix_prompt_tokens
        self.max_tokens_sum -= seq.max_tokens


class ModelResidency:
    """Which models' weights sit in host memory, and what a model switch costs.

    A warm copy (vLLM's sleep mode level 1) makes the next load of that model a copy from host
    memory (:meth:`~qlm.engine_model.EngineProfile.load_time_from_cpu`); otherwise it is read
    from disk. A copy a caller asks for is usable once it has been read from disk; on a switch
    the outgoing model's weights go to host memory (when ``keep_outgoing``), if they fit in
    ``budget_bytes`` (None: no limit). With ``enabled`` False every load is from disk (the
    simulator's no-warm-start configuration)."""

    def __init__(
        self,
        profiles: Mapping[str, EngineProfile],
        *,
        budget_bytes: float | None = None,
        enabled: bool = True,
        keep_outgoing: bool = True,
    ) -> None:
        self.profiles = profiles
        self.budget_bytes = budget_bytes
        self.enabled = enabled
        self.keep_outgoing = keep_outgoing
        self.warm: dict[str, float] = {}  # model -> time its host copy is complete

    def set_warm(self, models: Iterable[str], now: float) -> None:
        """Keep these models' weights in host memory (in this order, within the budget);
        newly warm ones become usable once read from disk. Others lose their copy."""
        keep: dict[str, float] = {}
        budget = self.budget_bytes
        for m in models:
            if m not in self.profiles or m in keep:
                continue
            profile = self.profiles[m]
            if budget is not None:
                size = profile.model.weight_bytes
                if size > budget:
                    continue
                budget -= size
            keep[m] = self.warm.get(m, now + profile.load_time_from_disk())
        self.warm = keep

    def apply_states(self, states: Mapping[str, str], active: str | None, now: float) -> str | None:
        """A coordinator's model plan (model -> "active" | "warm" | "cold"): warm models keep
        a host copy (the next switch to them is a warm start, once the copy is read from
        disk), cold ones lose it; the planned active model stays warm too. Returns the model
        to load ahead of its requests (the planned active one, if not resident), else None."""
        warm = dict.fromkeys(self.warm)
        preload = None
        for model, state in states.items():
            if model not in self.profiles:
                continue
            if state == "cold" and model != active:
                warm.pop(model, None)
            elif state == "warm":
                warm[model] = None
            elif state == "active" and model != active:
                warm[model] = None
                preload = model
        self.set_warm(warm, now)
        return preload

    def load(self, model: str, outgoing: str | None, now: float) -> tuple[float, str]:
        """Switch to ``model`` at ``now``: (seconds, "cpu" | "disk")."""
        profile = self.profiles[model]
        ready = self.warm.get(model)
        if self.enabled and ready is not None and ready <= now:
            seconds, source = profile.load_time_from_cpu(), "cpu"
        else:
            seconds, source = profile.load_time_from_disk(), "disk"
        if self.enabled and self.keep_outgoing and outgoing is not None:
            # sleep mode level 1: the outgoing model's weights go to host memory, if they fit
            self.set_warm([outgoing, *[m for m in self.warm if m != outgoing]], now)
            if outgoing in self.warm:
                self.warm[outgoing] = now
        return seconds, source
