"""One simulated serving instance: a vLLM V1-like continuous-batching engine on a simulated clock.

What runs in each iteration, KV accounting, preemption, swap restores and model switches are
decided by the one engine scheduler (:mod:`qlm.engine_scheduler`), the same one the ``sim``
engine backend (:mod:`qlm.agents.sim`) uses, and the timings come from the same engine performance
model (:mod:`qlm.engine_model`); what differs is time. The backend sleeps through every
iteration in real time; this class jumps:

* an iteration that prefills (a new or resumed request, a prefill chunk) is one event;
* a run of pure decode iterations with an unchanged batch is *one* event, timed in closed form
  by :meth:`EngineProfile.decode_segment_time`, lasting until the first request of the batch
  finishes or the KV cache is full, whichever is first;
* when something arrives mid-run (a dispatched request, an eviction order), the run is cut at
  the next iteration boundary, as continuous batching admits new work between iterations.

A request the planner evicts either loses its KV (``evict``) or has it copied to host memory
over PCIe (``swap``) and copied back when it resumes on the same instance.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from qlm.engine_model import EngineProfile
from qlm.engine_scheduler import (
    WANTS_AT_MOST,
    EngineLimits,
    EngineScheduler,
    EngineSeq,
    ModelResidency,
    Step,
)
from qlm.policy import PlanInstance, PlanRequest
from qlm.tooling.simulator.workload import SimRequest


@dataclass(slots=True, eq=False, kw_only=True)
class SimJob(EngineSeq):
    """A request's life in the simulated cluster: its engine state (:class:`EngineSeq`) and
    what the coordinator keeps about it."""

    req: SimRequest
    view: PlanRequest
    instance_id: str | None = None  # where it runs (None while queued)
    queue_id: str | None = None  # virtual queue it waits in (None while running / unassigned)
    first_token_s: float | None = None
    started_s: float | None = None
    finished_s: float | None = None
    evictions: int = 0  # planner evictions (recompute or swap)
    dispatch_id: str = ""  # the coordinator's id of its current attempt

    def __post_init__(self) -> None:
        req = self.req
        self.request_id = req.request_id
        self.model = req.model
        self.prompt_tokens = req.prompt_tokens
        self.output_tokens = req.output_tokens
        self.mix_prompt_tokens = self.view.prompt_tokens
        self.max_tokens = self.view.max_tokens


class SimInstance:
    """An engine: one model resident at a time, FCFS waiting queue, continuous (or, for the
    SHEPHERD baseline, static) batching, all decided by an :class:`EngineScheduler`; this class
    keeps the simulated clock. ``schedule(t, instance, version)`` asks the simulator for an
    event at ``t``; ``on_finish(job, t)`` reports a finished request."""

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
        pull_at_most: int = WANTS_AT_MOST,
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
        # the cluster starts with its first model loaded
        self.engine: EngineScheduler[SimJob] = EngineScheduler(
            instance_id,
            EngineLimits.of(profiles[models[0]]),
            active_model=models[0],
            static_batch=static_batch,
            pull_at_most=pull_at_most,
        )
        # host-memory copies of model weights (the whole host budget: warm models and
        # swapped KV; the plan's warm list replaces the current one)
        self.residency = ModelResidency(profiles, budget_bytes=cpu_memory_bytes, enabled=warm_start)
        self.version = 0
        self._busy_until: float | None = None
        self._segment: tuple[float, int, int, int] | None = None  # start, batch, context, steps
        self._step: Step[SimJob] | None = None
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
        self.evictions = 0
        self.swaps = 0
        self.iterations = 0
        self.evicted_out: list[SimJob] = []

    # ------------------------------------------------------------------ views
    @property
    def active_model(self) -> str | None:
        return self.engine.active_model

    @property
    def loading(self) -> str | None:
        return self.engine.loading

    @property
    def running(self) -> dict[SimJob, None]:
        return self.engine.running

    @property
    def waiting(self) -> deque[SimJob]:
        return self.engine.waiting

    @property
    def warm(self) -> dict[str, float]:
        """Models with weights in host memory -> time the copy is complete."""
        return self.residency.warm

    @property
    def preemptions(self) -> int:
        return self.engine.preemptions

    @property
    def profile(self) -> EngineProfile:
        return self.profiles[self.active_model or self.loading or self.models[0]]

    @property
    def kv_capacity(self) -> int:
        return self.engine.limits.kv_capacity_tokens

    @property
    def max_batch(self) -> int:
        return self.engine.limits.max_batch_size

    @property
    def kv_used(self) -> int:
        return self.engine.kv_used

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

    def decode_speed(self, running: int, candidate: SimJob | None = None) -> float:
        """f(L): per-request tokens/s with ``running`` requests of the current mix, the engine
        performance model standing in for SABER's measured USL fit. Like a fit measured on
        the workload mix, it includes the prefills that continuous batching interleaves: in
        steady state L / mean-output requests finish, and as many prompts are prefilled, per
        decode iteration."""
        engine = self.engine
        n = len(engine.running)
        tokens, prompts, outputs = engine.kv_used + n, engine.prompt_sum, engine.max_tokens_sum
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
        return self.engine.wants()

    # ------------------------------------------------------------------ inputs
    def enqueue(self, jobs: list[SimJob], now: float) -> None:
        for job in jobs:
            job.instance_id = self.instance_id
            job.queue_id = None
            if job.started_s is None:
                job.started_s = now
            # the view as dispatched: an evicted job's was replaced by its resume (prompt +
            # generated, the rest of its budget)
            job.mix_prompt_tokens, job.max_tokens = job.view.prompt_tokens, job.view.max_tokens
            self.engine.add(job)
        self._view = None
        self._wake(now)

    def evict(self, jobs: list[SimJob], mode: str, now: float) -> None:
        """Planner eviction (``mode`` "evict" or "swap"): carried out at the next iteration
        boundary; the jobs then come back through ``evicted_out``."""
        self._pending_evictions.extend((j, mode) for j in jobs)
        self._wake(now)

    def apply_model_states(self, states: dict[str, str], now: float) -> None:
        """The coordinator's model plan, as the ``sim`` agent backend applies it (the one
        rule: :meth:`ModelResidency.apply_states`). Loading the planned model ahead of its
        requests is the backend's alone: here the switch happens when its requests come."""
        self.residency.apply_states(states, self.active_model, now)
        self._view = None

    def set_warm(self, models: list[str], now: float) -> None:
        """Keep these models' weights in host memory (in this order, within the budget):
        newly warm ones become usable once read from disk."""
        self.residency.set_warm(models, now)
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
            self.engine.end_load()
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
        engine = self.engine
        if engine.idle:
            return
        model = engine.model_to_load()
        if model is not None:
            self._load(model, now)
            return
        step = engine.plan()
        if step.preempted:
            self._view = None
        profile = self.profile
        if step.prefill:
            for tokens in step.restored:  # one by one: the same float sums as any caller's
                self._pending_delay += profile.kv_transfer_time(tokens)
            self._step = step
            self._begin(now, step.seconds(profile) + self._take_delay())
            return
        if not step.decode_batch:
            raise RuntimeError(f"{self.instance_id}: work queued but nothing schedulable")
        # pure decode: jump to the first completion or the KV limit
        batch = step.decode_batch
        steps = engine.decode_steps(self.max_decode_run)
        context = step.context_tokens
        delay = self._take_delay()  # swap transfers first, then the decode run
        self._segment = (now + delay, batch, context, steps)
        seconds = profile.decode_segment_time(batch, context, steps)
        self._begin(now, delay + seconds)

    def _take_delay(self) -> float:
        delay, self._pending_delay = self._pending_delay, 0.0
        return delay

    def _begin(self, now: float, seconds: float) -> None:
        self._step_start = now
        self._busy_until = now + seconds
        self.version += 1
        self._schedule(self._busy_until, self, self.version)

    def _commit_step(self, now: float) -> None:
        assert self._step is not None
        duration = now - self._step_start
        kv_before = self.kv_used
        result = self.engine.commit(self._step)
        for job in result.sampled:
            if job.first_token_s is None:
                job.first_token_s = now
        self._finished(result.finished, now)
        self._account(duration, kv_before)
        self.iterations += 1
        self._step = None

    def _commit_segment(self, now: float) -> None:
        assert self._segment is not None
        start, batch, context, steps = self._segment
        kv_before = self.kv_used
        result = self.engine.advance(steps)
        self._finished(result.finished, now)
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

    # ------------------------------------------------------------------ requests
    def _finished(self, jobs: list[SimJob], now: float) -> None:
        if jobs:
            self._view = None
        for job in jobs:
            job.finished_s = now
            self._on_finish(job, now)

    def _apply_evictions(self, now: float) -> None:
        pending, self._pending_evictions = self._pending_evictions, []
        for job, mode in pending:
            if job.instance_id != self.instance_id or job.finished_s is not None:
                continue
            was_running = job in self.engine.running
            if not self.engine.remove(job):
                continue
            if was_running:
                if mode == "swap" and job.computed:
                    job.swapped_on, job.swapped_tokens = self.instance_id, job.computed
                    self._pending_delay += self.profile.kv_transfer_time(job.computed)
                    self.swaps += 1
                job.computed = 0
            job.instance_id = None
            job.evictions += 1
            self.evictions += 1
            self.evicted_out.append(job)
        if pending:
            self._view = None

    # ------------------------------------------------------------------ model switches
    def _load(self, model: str, now: float) -> None:
        seconds, source = self.residency.load(model, self.active_model, now)
        if source == "disk":
            self.cold_loads += 1
        self.model_swaps += 1
        self.loading_s += seconds
        self.engine.begin_load(model, EngineLimits.of(self.profiles[model]))
        self._view = None
        self._begin(now, seconds)
