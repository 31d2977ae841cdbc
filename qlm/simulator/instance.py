"""One simulated serving instance: a vLLM V1-like continuous-batching engine on a simulated clock.

The scheduling rules are those of the ``sim`` engine backend (:mod:`agents.sim`), and the timings
come from the same engine performance model (:mod:`qlm.engine_model`); what differs is time.
The backend sleeps through every iteration in real time; this class jumps:

* an iteration that prefills (a new or resumed request, a prefill chunk) is one event;
* a run of pure decode iterations with an unchanged batch is *one* event, timed in closed form
  by :meth:`EngineProfile.decode_segment_time`, lasting until the first request of the batch
  finishes or the KV cache is full, whichever is first;
* when something arrives mid-run (a dispatched request, an eviction order), the run is cut at
  the next iteration boundary, as continuous batching admits new work between iterations.

KV usage is counted in tokens (vLLM allocates blocks of 16: the rounding, < 16 tokens per
running sequence, is ignored here). A request preempted for KV space loses its KV and is
recomputed on re-admission (vLLM V1); a request the planner evicts either loses its KV
(``evict``) or has it copied to host memory over PCIe (``swap``) and copied back when it resumes
on the same instance.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from qlm.engine_model import EngineProfile
from qlm.policy import PlanInstance, PlanRequest
from qlm.simulator.workload import SimRequest

# The agent's admission control (agents/sim.py): pull at most this many at once, and only while
# the engine's waiting queue is empty and its KV usage is under the threshold.
WANTS_AT_MOST = 8
KV_SATURATED_FRACTION = 0.9

_entry_seq = itertools.count()


@dataclass(slots=True, eq=False)
class SimJob:
    """A request's life in the simulated cluster.

    While a job decodes on an instance its token counts advance implicitly with the instance's
    decode clock (see :class:`SimInstance`); ``generated`` and ``computed`` are brought up to
    date whenever it stops decoding (finish, preemption, eviction)."""

    req: SimRequest
    view: PlanRequest
    generated: int = 0
    computed: int = 0  # tokens whose KV is in the cache of the instance running it
    instance_id: str | None = None  # where it runs (None while queued)
    queue_id: str | None = None  # virtual queue it waits in (None while running / unassigned)
    first_token_s: float | None = None
    started_s: float | None = None
    finished_s: float | None = None
    preemptions: int = 0  # engine preemptions for KV space (recompute)
    evictions: int = 0  # planner evictions (recompute or swap)
    swapped_on: str | None = None  # instance whose host memory holds its KV
    swapped_tokens: int = 0
    req_speed: float = 0.0  # SLO-aware pull: required tokens/s frozen at admission (0: none)
    # decode bookkeeping: the instance's decode clock and `generated` when decoding began
    decoding: bool = False
    t0: int = 0
    g0: int = 0
    entry: list | None = None  # its entry in the instance's finish heap

    @property
    def num_tokens(self) -> int:
        return self.req.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        return self.req.output_tokens - self.generated


class SimInstance:
    """An engine: one model resident at a time, FCFS waiting queue, continuous (or, for the
    SHEPHERD baseline, static) batching. ``schedule(t, instance, version)`` asks the simulator
    for an event at ``t``; ``on_finish(job, t)`` reports a finished request.

    Decoding requests are not touched one by one per iteration: the instance keeps a *decode
    clock* T (iterations so far) and, for the decoding set, the sum of their contexts as an
    affine function of T and a heap of the clock values at which each finishes. A prefill
    iteration costs O(requests being prefilled); a decode run O(log batch)."""

    def __init__(
        self,
        instance_id: str,
        gpu_type: str,
        models: list[str],
        profiles: dict[str, EngineProfile],
        *,
        cpu_memory_bytes: float,
        schedule: Callable[[float, SimInstance, int], None],
        on_finish: Callable[[SimJob, float], None],
        warm_start: bool = False,
        static_batch: int | None = None,
        max_decode_run: int | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.gpu_type = gpu_type
        self.models = list(models)
        self.profiles = profiles
        self.cpu_memory_bytes = cpu_memory_bytes
        self._schedule = schedule
        self._on_finish = on_finish
        self.warm_start = warm_start
        self.static_batch = static_batch
        # None: jump over whole decode runs; 1: one event per iteration (tests compare the two)
        self.max_decode_run = max_decode_run

        self.active_model: str | None = models[0]  # the cluster starts with its first model loaded
        self.loading: str | None = None
        self.running: dict[SimJob, None] = {}  # admission order (the last is preempted first)
        self.prefilling: dict[SimJob, None] = {}  # running, prompt (or recompute) not done
        self.waiting: deque[SimJob] = deque()
        self._clock = 0  # decode clock T
        self._n_dec = 0
        self._dec_base = 0  # sum over decoding jobs of computed - T
        self._kv_prefill = 0  # sum of computed over prefilling jobs
        self._finishes: list[list] = []  # [finish clock, seq, job, alive]
        self._prompt_sum = 0  # over running jobs, for the speed model
        self._max_tokens_sum = 0
        self._floor: list[tuple[float, int, SimJob]] = []  # max-heap of frozen required speeds
        # host-memory copies of model weights: model -> time the copy is complete
        self.warm: dict[str, float] = {}
        self.version = 0
        self._busy_until: float | None = None
        self._segment: tuple[float, int, int, int] | None = None  # start, batch, context, steps
        self._step: list[tuple[SimJob, int]] | None = None
        self._step_start = 0.0
        self._pending_delay = 0.0  # swap transfers charged to the next iteration
        self._pending_evictions: list[tuple[SimJob, str]] = []
        self._view: PlanInstance | None = None
        # statistics
        self.busy_s = 0.0
        self.loading_s = 0.0
        self.kv_token_s = 0.0
        self.model_swaps = 0
        self.cold_loads = 0
        self.preemptions = 0
        self.evictions = 0
        self.swaps = 0
        self.iterations = 0
        self.evicted_out: list[SimJob] = []

    # ------------------------------------------------------------------ views
    @property
    def profile(self) -> EngineProfile:
        return self.profiles[self.active_model or self.loading or self.models[0]]

    @property
    def kv_capacity(self) -> int:
        return self.profile.kv_capacity_tokens

    @property
    def max_batch(self) -> int:
        return self.profile.max_batch_size

    @property
    def kv_used(self) -> int:
        return self._dec_base + self._n_dec * self._clock + self._kv_prefill

    def plan_view(self) -> PlanInstance:
        """What a policy sees (cached until the instance changes)."""
        if self._view is None:
            self._view = PlanInstance(
                instance_id=self.instance_id,
                models=tuple(self.models),
                gpu_type=self.gpu_type,
                kv_capacity_tokens=self.kv_capacity,
                max_batch_size=self.static_batch or self.max_batch,
                active_model=self.active_model,
                running=len(self.running),
                warm_models=tuple(self.warm) if self.warm_start else (),
                # the whole host budget (warm models and swapped KV): the plan's warm list
                # replaces the current one
                cpu_memory_bytes=self.cpu_memory_bytes,
            )
        return self._view

    def speed_floor(self) -> float:
        """The highest frozen required speed among the requests running or waiting here."""
        heap = self._floor
        while heap:
            job = heap[0][2]
            if job.instance_id == self.instance_id and job.finished_s is None:
                return -heap[0][0]
            heapq.heappop(heap)
        return 0.0

    def decode_speed(self, running: int, candidate: SimJob | None = None) -> float:
        """f(L): per-request tokens/s with ``running`` requests of the current mix, the engine
        performance model standing in for SABER's measured USL fit. Like a fit measured on
        the workload mix, it includes the prefills that continuous batching interleaves: in
        steady state L / mean-output requests finish, and as many prompts are prefilled, per
        decode iteration."""
        n = len(self.running)
        tokens, prompts, outputs = self.kv_used + n, self._prompt_sum, self._max_tokens_sum
        if candidate is not None:
            n += 1
            tokens += candidate.view.prompt_tokens
            prompts += candidate.view.prompt_tokens
            outputs += candidate.view.max_tokens
        profile = self.profile
        if n == 0:
            return 1.0 / profile.decode_iteration_time(max(1, running), 1)
        chunk = profile.max_num_batched_tokens
        per_prefill_token = profile.prefill_time(chunk) / chunk
        iteration = profile.decode_iteration_time(max(1, running), max(1, tokens // n))
        iteration += running / max(1.0, outputs / n) * (prompts / n) * per_prefill_token
        return 1.0 / iteration

    def wants(self) -> int:
        """How many requests the agent pulls now (the live agent's admission control)."""
        if self.loading is not None or self.waiting:
            return 0
        if self.static_batch is not None:
            return self.static_batch if not self.running else 0
        if self.kv_used > KV_SATURATED_FRACTION * self.kv_capacity:
            return 0
        return max(0, min(WANTS_AT_MOST, self.max_batch - len(self.running)))

    # ------------------------------------------------------------------ inputs
    def enqueue(self, jobs: list[SimJob], now: float) -> None:
        for job in jobs:
            job.instance_id = self.instance_id
            job.queue_id = None
            if job.started_s is None:
                job.started_s = now
            if job.req_speed > 0:
                heapq.heappush(self._floor, (-job.req_speed, next(_entry_seq), job))
            self.waiting.append(job)
        self._view = None
        self._wake(now)

    def evict(self, jobs: list[SimJob], mode: str, now: float) -> None:
        """Planner eviction (``mode`` "evict" or "swap"): carried out at the next iteration
        boundary; the jobs then come back through ``evicted_out``."""
        self._pending_evictions.extend((j, mode) for j in jobs)
        self._wake(now)

    def set_warm(self, models: list[str], now: float) -> None:
        """Keep these models' weights in host memory (in this order, within the budget):
        newly warm ones become usable once read from disk."""
        keep: dict[str, float] = {}
        budget = self.cpu_memory_bytes
        for m in models:
            if m not in self.profiles or m in keep:
                continue
            size = self.profiles[m].model.weight_bytes
            if size > budget:
                continue
            budget -= size
            profile = self.profiles[m]
            keep[m] = self.warm.get(m, now + profile.load_time_from_disk())
        self.warm = keep
        self._view = None

    def _wake(self, now: float) -> None:
        if self._busy_until is None:
            self._start_next(now)
        elif self._segment is not None:
            self._cut_segment(now)

    # ------------------------------------------------------------------ events
    def on_event(self, now: float) -> None:
        """The current iteration, decode run or model load ended at ``now``."""
        self._busy_until = None
        if self.loading is not None:
            self.active_model, self.loading = self.loading, None
        elif self._segment is not None:
            self._commit_segment(now)
        elif self._step is not None:
            self._commit_step(now)
        self._view = None
        self._apply_evictions(now)

    def resume(self, now: float) -> None:
        """Start the next iteration (after the simulator has pulled new work)."""
        if self._busy_until is None:
            self._start_next(now)

    # ------------------------------------------------------------------ scheduling
    def _start_next(self, now: float) -> None:
        self._segment = None
        self._step = None
        if not self.running and not self.waiting:
            return
        if not self.running and self.waiting[0].req.model != self.active_model:
            self._load(self.waiting[0].req.model, now)
            return
        plan = self._plan_iteration()
        if plan:
            prefill = 0
            pairs = 0.0
            for job, n_new in plan:
                prefill += n_new
                pairs += n_new * job.computed + n_new * (n_new + 1) / 2
            context = self._dec_base + self._n_dec * (self._clock + 1)
            seconds = self.profile.iteration_time(
                prefill, self._n_dec, context, prefill_attention_pairs=pairs
            )
            self._step = plan
            self._begin(now, seconds + self._take_delay())
            return
        if not self._n_dec:
            raise RuntimeError(f"{self.instance_id}: work queued but nothing schedulable")
        # pure decode: jump to the first completion or the KV limit
        batch = self._n_dec
        steps = self._next_finish() - self._clock
        room = (self.kv_capacity - self.kv_used) // batch
        steps = max(1, min(steps, room, self.max_decode_run or steps))
        context = self._dec_base + batch * (self._clock + 1)
        delay = self._take_delay()  # swap transfers first, then the decode run
        self._segment = (now + delay, batch, context, steps)
        seconds = self.profile.decode_segment_time(batch, context, steps)
        self._begin(now, delay + seconds)

    def _take_delay(self) -> float:
        delay, self._pending_delay = self._pending_delay, 0.0
        return delay

    def _begin(self, now: float, seconds: float) -> None:
        self._step_start = now
        self._busy_until = now + seconds
        self.version += 1
        self._schedule(self._busy_until, self, self.version)

    def _next_finish(self) -> int:
        heap = self._finishes
        while not heap[0][3]:
            heapq.heappop(heap)
        return int(heap[0][0])

    def _plan_iteration(self) -> list[tuple[SimJob, int]]:
        """vLLM V1's scheduling step: running requests first (every decoding one a token, then
        the next chunk of each unfinished prefill), then, unless something was preempted,
        waiting ones of the resident model while the batch limit, the token budget and the
        KV cache allow. Returns the prefill part; an empty list means a pure decode step."""
        profile = self.profile
        capacity = profile.kv_capacity_tokens
        plan: list[tuple[SimJob, int]] = []
        if self.static_batch is not None and not self.running:
            # SHEPHERD: the whole fixed batch is formed at once; its prompts are then
            # prefilled chunk by chunk below, and nothing joins until every member finished
            reserved = self.kv_used
            while self.waiting and len(self.running) < self.static_batch:
                job = self.waiting[0]
                if job.req.model != self.active_model:
                    break
                if reserved + job.num_tokens > capacity and self.running:
                    break
                reserved += job.num_tokens
                self.waiting.popleft()
                self._admit(job, restore=0)
        preempted = False
        while self._n_dec and self.kv_used + self._n_dec > capacity:
            self._preempt(next(reversed(self.running)))
            preempted = True
        budget = profile.max_num_batched_tokens - self._n_dec
        planned = 0
        for job in list(self.prefilling):
            if budget <= 0:
                break
            if job not in self.running:
                continue  # preempted just now to make room for one ahead of it
            n_new = min(job.num_tokens - job.computed, budget)
            gone = False
            while self.kv_used + self._n_dec + planned + n_new > capacity:
                victim = next(reversed(self.running))
                self._preempt(victim)
                preempted = True
                if victim is job:
                    gone = True
                    break
            if gone:
                break  # it preempted itself: nothing after it in `running` is left either
            plan.append((job, n_new))
            planned += n_new
            budget -= n_new
        if preempted or self.static_batch is not None:
            return plan
        limit = profile.max_batch_size
        while self.waiting and len(self.running) < limit and budget > 0:
            job = self.waiting[0]
            if job.req.model != self.active_model:
                break
            restore = 0
            if job.swapped_on == self.instance_id and job.swapped_tokens:
                restore = job.swapped_tokens
            n_new = min(job.num_tokens - restore, budget)
            if self.kv_used + self._n_dec + planned + restore + n_new > capacity:
                break
            self.waiting.popleft()
            if restore:
                self._pending_delay += profile.kv_transfer_time(restore)
            self._admit(job, restore)
            plan.append((job, n_new))
            planned += n_new
            budget -= n_new
        return plan

    def _admit(self, job: SimJob, restore: int) -> None:
        job.computed = restore
        job.swapped_on, job.swapped_tokens = None, 0
        self.running[job] = None
        self.prefilling[job] = None
        self._kv_prefill += restore
        self._prompt_sum += job.view.prompt_tokens
        self._max_tokens_sum += job.view.max_tokens

    def _commit_step(self, now: float) -> None:
        assert self._step is not None
        duration = now - self._step_start
        kv_before = self.kv_used
        self._clock += 1  # every decoding job got its token
        for job, n_new in self._step:
            job.computed += n_new
            self._kv_prefill += n_new
            if job.computed < job.num_tokens:
                continue  # a prefill chunk; it samples once its whole prefill is done
            job.generated += 1
            if job.first_token_s is None:
                job.first_token_s = now
            if job.remaining <= 0:
                self._leave_running(job)
                self._finish(job, now)
                continue
            del self.prefilling[job]
            self._kv_prefill -= job.computed
            self._start_decoding(job)
        self._finish_due(now)
        self._account(duration, kv_before)
        self.iterations += 1
        self._step = None

    def _commit_segment(self, now: float) -> None:
        assert self._segment is not None
        start, batch, context, steps = self._segment
        kv_before = self.kv_used
        self._clock += steps
        self._finish_due(now)
        self._account(now - self._step_start, kv_before)
        self.iterations += steps
        self._segment = None

    def _cut_segment(self, now: float) -> None:
        """Shorten the current decode run to end at the first iteration boundary after ``now``."""
        assert self._segment is not None
        start, batch, context, steps = self._segment
        done = self.profile.decode_iterations_within(batch, context, now - start, steps)
        cut = min(steps, done + 1)
        if cut >= steps:
            return
        self._segment = (start, batch, context, cut)
        self._busy_until = start + self.profile.decode_segment_time(batch, context, cut)
        self.version += 1
        self._schedule(self._busy_until, self, self.version)

    def _account(self, duration: float, kv_before: int) -> None:
        self.busy_s += duration
        self.kv_token_s += duration * (kv_before + self.kv_used) / 2

    # ------------------------------------------------------------------ decode bookkeeping
    def _start_decoding(self, job: SimJob) -> None:
        """From now on the job gains a token per decode-clock tick (computed = tokens - 1)."""
        job.decoding, job.t0, job.g0 = True, self._clock, job.generated
        self._n_dec += 1
        self._dec_base += job.computed - self._clock
        job.entry = [self._clock + job.remaining, next(_entry_seq), job, True]
        heapq.heappush(self._finishes, job.entry)

    def _stop_decoding(self, job: SimJob) -> None:
        """Bring the job's counts up to date and take it out of the decoding aggregates."""
        if not job.decoding:
            return
        advanced = self._clock - job.t0
        job.generated = job.g0 + advanced
        computed_at_start = job.req.prompt_tokens + job.g0 - 1
        self._dec_base -= computed_at_start - job.t0
        job.computed = computed_at_start + advanced
        self._n_dec -= 1
        job.decoding = False
        if job.entry is not None:
            job.entry[3] = False
            job.entry = None

    def _finish_due(self, now: float) -> None:
        heap = self._finishes
        while heap and heap[0][0] <= self._clock:
            _, _, job, alive = heapq.heappop(heap)
            if alive:
                self._stop_decoding(job)
                self._leave_running(job)
                self._finish(job, now)

    def _leave_running(self, job: SimJob) -> None:
        """Take a job (no longer decoding) out of the running set and its KV out of the cache."""
        del self.running[job]
        if job in self.prefilling:
            del self.prefilling[job]
            self._kv_prefill -= job.computed
        self._prompt_sum -= job.view.prompt_tokens
        self._max_tokens_sum -= job.view.max_tokens
        self._view = None

    # ------------------------------------------------------------------ requests
    def _finish(self, job: SimJob, now: float) -> None:
        job.finished_s = now
        self._on_finish(job, now)

    def _preempt(self, job: SimJob) -> None:
        """KV-space preemption by recompute (vLLM V1): most recently admitted goes first."""
        self._stop_decoding(job)
        self._leave_running(job)
        job.computed = 0
        job.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(job)

    def _apply_evictions(self, now: float) -> None:
        pending, self._pending_evictions = self._pending_evictions, []
        for job, mode in pending:
            if job.instance_id != self.instance_id or job.finished_s is not None:
                continue
            if job in self.running:
                self._stop_decoding(job)
                self._leave_running(job)
                if mode == "swap" and job.computed:
                    job.swapped_on, job.swapped_tokens = self.instance_id, job.computed
                    self._pending_delay += self.profile.kv_transfer_time(job.computed)
                    self.swaps += 1
                job.computed = 0
            elif job in self.waiting:
                self.waiting.remove(job)
            else:
                continue
            job.instance_id = None
            job.evictions += 1
            self.evictions += 1
            self.evicted_out.append(job)
        if pending:
            self._view = None

    # ------------------------------------------------------------------ model switches
    def _load(self, model: str, now: float) -> None:
        profile = self.profiles[model]
        ready = self.warm.get(model)
        if self.warm_start and ready is not None and ready <= now:
            seconds = profile.load_time_from_cpu()
        else:
            seconds = profile.load_time_from_disk()
            self.cold_loads += 1
        if self.warm_start and self.active_model is not None:
            # sleep mode level 1: the outgoing model's weights go to host memory, if they fit
            order = [self.active_model, *[m for m in self.warm if m != self.active_model]]
            self.set_warm(order, now)
            if self.active_model in self.warm:
                self.warm[self.active_model] = now
        self.model_swaps += 1
        self.loading_s += seconds
        self.loading, self.active_model = model, None
        self._view = None
        self._begin(now, seconds)
