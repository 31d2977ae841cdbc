"""Scenario files for the cluster simulator: the GPUs, the request streams, the options, a sweep.

A scenario is a pydantic model validated as a whole: unknown keys, unknown GPUs or models, and
models that do not fit their GPUs are rejected before anything runs. Every problem is reported
as a :class:`ScenarioError` whose message starts with the path of the offending field
(``pools.0.gpu: unknown GPU type 'X'; known: [...]``), so a mistake in a long YAML file is easy
to find. Model names are catalog models, variants ``base@tag`` (see
:func:`qlm.catalog.resolve_model`) or aliases declared in the scenario's ``models`` mapping.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import structlog
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from qlm.catalog import GPUS, MODELS, ModelSpec, canonical_gpu, resolve_model
from qlm.engine_model import (
    EngineProfile,
    InsufficientMemoryError,
    get_profile,
    profile_from_dict,
)
from qlm.trace import AZURE_FILES

log = structlog.get_logger(__name__)

_FIELD_ERROR = "scenario_field"


class ScenarioError(ValueError):
    """A scenario that cannot be run; the message names the field (``streams.0.arrival: ...``)."""


@cache
def load_profile(path: str) -> EngineProfile:
    """An engine profile from a JSON file (``engine_model.profile_to_dict``)."""
    return profile_from_dict(json.loads(Path(path).read_text()))


def _field_error(field: str, message: str) -> PydanticCustomError:
    # A model validator's error is reported at the model's location; carrying the field in the
    # context lets format_validation_error() append it, so the message names the exact field.
    return PydanticCustomError(_FIELD_ERROR, "{message}", {"field": field, "message": message})


def format_validation_error(error: ValidationError) -> str:
    """One ``path: message`` line per problem."""
    lines = []
    for item in error.errors():
        loc = [str(part) for part in item["loc"]]
        message = item["msg"]
        ctx = item.get("ctx") or {}
        if item["type"] == _FIELD_ERROR:
            loc.append(str(ctx["field"]))
        elif item["type"] == "value_error":
            message = str(ctx.get("error", message))
        path = ".".join(part for part in loc if part)
        lines.append(f"{path}: {message}" if path else message)
    return "\n".join(lines)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PoolSpec(_Strict):
    """A group of identical instances, one engine each (a TP group counts as one instance)."""

    gpu: str
    count: int = Field(ge=0)
    models: list[str] = Field(min_length=1)
    tp: int | None = Field(default=None, ge=1)  # None: engine_model.get_profile picks
    cpu_memory_gb: float = Field(default=256.0, gt=0)  # host RAM: warm models and swapped KV
    name: str | None = Field(default=None, min_length=1)  # instance ids are f"{name}-{k}"
    # Measured engine profiles (JSON written by engine_model.profile_to_dict, e.g. by
    # `qlm profile`): each replaces the roofline profile of its model on this pool's GPUs.
    profiles: list[str] = Field(default_factory=list)
    # the engine's cap on running requests (vLLM --max-num-seqs); None: the engine model's
    # default for the GPU (256 on an A100)
    max_num_seqs: int | None = Field(default=None, ge=1)
    # the engine's per-iteration token budget, which is also its chunked-prefill chunk (vLLM
    # --max-num-batched-tokens); None: vLLM's default for the GPU (2048 on an A100)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    # the pool's agents pull at most this many requests at once (qlm agent --pull-at-most);
    # None: the agent's default, qlm.engine_scheduler.WANTS_AT_MOST (8)
    pull_at_most: int | None = Field(default=None, ge=1)
    # the pool's agents hand their engine at most this many prompt tokens each time it wants
    # work (about once an iteration; at least one request), holding the rest of a pull (qlm
    # agent --feed-tokens); None: a whole pull at once
    feed_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _profiles_match(self) -> Self:
        for k, path in enumerate(self.profiles):
            try:
                profile = load_profile(path)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise _field_error(f"profiles.{k}", f"{path}: {e}") from None
            if profile.gpu.name != self.gpu:
                raise _field_error(
                    f"profiles.{k}", f"{path} profiles a {profile.gpu.name}, not a {self.gpu}"
                )
            if profile.model.name not in self.models:
                raise _field_error(
                    f"profiles.{k}",
                    f"{path} profiles {profile.model.name!r}, not one of {self.models}",
                )
        return self

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        if canonical_gpu(value) not in GPUS:
            raise ValueError(f"unknown GPU type {value!r}; known: {sorted(GPUS)}")
        return canonical_gpu(value)  # an alias (H100) names the table's entry (H100-80GB)

    @property
    def instance_prefix(self) -> str:
        return self.name or self.gpu


class ArrivalSpec(_Strict):
    # burst: ``count`` requests at once, at the stream's start_s (a static queue)
    process: Literal["poisson", "gamma", "trace", "burst"]
    # poisson/gamma: the mean rate. trace: optional target mean rate (timestamps are scaled).
    rate_rps: float | None = Field(default=None, gt=0)
    cv: float = Field(default=1.0, gt=0)  # gamma: coefficient of variation of the gaps
    trace: str | None = None  # trace: "conv" | "code" (shipped Azure traces) or a CSV path
    start_s: float = Field(default=0.0, ge=0)  # trace: offset into the trace
    count: int | None = Field(default=None, ge=1)  # burst: how many requests

    @model_validator(mode="after")
    def _process_fields(self) -> Self:
        if self.process in ("poisson", "gamma") and self.rate_rps is None:
            raise _field_error("rate_rps", f"required for a {self.process} process")
        burst = self.process == "burst"
        if burst and self.count is None:
            raise _field_error("count", "required for a burst")
        if not burst and self.count is not None:
            raise _field_error("count", f"only for process 'burst', not {self.process!r}")
        if burst and self.rate_rps is not None:
            raise _field_error("rate_rps", "a burst has no rate: give its count")
        if self.process == "trace":
            if self.trace is None:
                raise _field_error(
                    "trace", f"required for a trace process: {sorted(AZURE_FILES)} or a CSV path"
                )
            if self.trace not in AZURE_FILES and not Path(self.trace).is_file():
                raise _field_error(
                    "trace",
                    f"{self.trace!r} is neither a shipped trace {sorted(AZURE_FILES)} "
                    "nor an existing file",
                )
        elif self.trace is not None:
            raise _field_error("trace", f"only for process 'trace', not {self.process!r}")
        return self


class LengthSpec(_Strict):
    # "trace": the token counts of the rows that gave the arrivals (needs trace arrivals).
    source: Literal["sharegpt", "arxiv", "azure-conv", "azure-code", "trace", "fixed"]
    prompt_tokens: int | None = Field(default=None, ge=1)  # fixed only
    output_tokens: int | None = Field(default=None, ge=1)  # fixed only
    max_prompt_tokens: int | None = Field(default=None, ge=1)  # samples are clipped to these
    max_output_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _fixed_fields(self) -> Self:
        for name in ("prompt_tokens", "output_tokens"):
            given = getattr(self, name) is not None
            if self.source == "fixed" and not given:
                raise _field_error(name, "required for source 'fixed'")
            if self.source != "fixed" and given:
                raise _field_error(name, f"only for source 'fixed', not {self.source!r}")
        return self


class ProgramSpec(_Strict):
    """Each arrival of the stream starts a program of dependent LLM calls instead of one call.

    ``chain`` (CATO's agentic task): ``stages`` calls one after another; a step is issued
    ``think_s`` (exponential, this mean: tool or user time) after the previous one finished.
    Every call carries the task's SLA (``slo_s`` from the task's first call) and, as
    ``remaining_s``, the producer's profile of the steps after it (``step_s`` per step).

    ``tree`` (Tempo's collective request, e.g. tree-of-thought): ``stages`` stages of
    ``fanout`` calls each; every call of a stage waits for all calls of the stage before it.
    The program's deadline is ``slo_s`` (× the number of stages with ``slo_per_stage``); its
    stages' deadlines come from matching against finished programs of the same ``app_type``
    (qlm/collective.py, the live coordinator's code).

    ``context: accumulate``: a later call's prompt is its parent call's prompt and output
    followed by its own sampled prompt (an agent's growing context); ``fresh``: sampled only.
    """

    shape: Literal["chain", "tree"]
    stages: tuple[int, int] = Field(description="min and max stages (chain: steps)")
    fanout: tuple[int, int] = (1, 1)  # tree: min and max calls per stage
    think_s: float = Field(default=0.0, ge=0)
    slo_s: float = Field(gt=0)
    slo_per_stage: bool = False
    step_s: float | None = Field(default=None, gt=0)  # chain: None -> the engine model's
    app_type: str | None = Field(default=None, min_length=1)  # tree: default the stream's name
    context: Literal["accumulate", "fresh"] = "accumulate"

    @model_validator(mode="after")
    def _ranges(self) -> Self:
        for name in ("stages", "fanout"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise _field_error(name, f"needs 1 <= min <= max, got [{lo}, {hi}]")
        if self.shape == "chain" and self.fanout != (1, 1):
            raise _field_error("fanout", "a chain has one call per step: only for shape 'tree'")
        return self


class StreamSpec(_Strict):
    """One stream of requests: one arrival process, one SLO class."""

    name: str = Field(min_length=1)
    models: list[str] = Field(min_length=1)
    model_weights: list[float] | None = None  # same length as models; default uniform
    slo_class: str = Field(min_length=1)
    e2e_slo_s: float | None = Field(default=None, gt=0)
    ttft_slo_s: float | None = Field(default=None, gt=0)
    # streaming: the mean time between output tokens (after the first) at most this
    tbt_slo_s: float | None = Field(default=None, gt=0)
    arrival: ArrivalSpec
    lengths: LengthSpec
    # the max_tokens every request of the stream asks for (a chat app's 1024, a summariser's
    # 512): the output is cut there. None: lengths.max_output_tokens when given (outputs are
    # cut there already, as a client's cap cuts them), else as much as the model allows
    max_tokens: int | None = Field(default=None, ge=1)
    start_s: float = Field(default=0.0, ge=0)
    end_s: float | None = Field(default=None, gt=0)  # default: the scenario's duration
    # each arrival starts a program of dependent calls (ProgramSpec); arrivals count programs
    program: ProgramSpec | None = None

    @property
    def max_tokens_cap(self) -> int | None:
        """The cap its requests send (None: the model's limit after the prompt)."""
        return self.max_tokens if self.max_tokens is not None else self.lengths.max_output_tokens

    @model_validator(mode="before")
    @classmethod
    def _no_slack(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_tokens_slack" in data:
            # it set max_tokens from the true output, telling every policy the answer
            raise _field_error(
                "max_tokens_slack",
                "removed: it derived max_tokens from the true output length; give the stream "
                "a max_tokens cap, or set the scenario's clairvoyant_max_tokens: true",
            )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.model_weights is not None:
            if len(self.model_weights) != len(self.models):
                raise _field_error(
                    "model_weights",
                    f"has {len(self.model_weights)} entries but models has {len(self.models)}",
                )
            for k, weight in enumerate(self.model_weights):
                if not weight > 0:
                    raise _field_error(f"model_weights.{k}", f"must be > 0, got {weight}")
        if self.e2e_slo_s is None and self.ttft_slo_s is None and self.program is None:
            raise _field_error(
                "e2e_slo_s", "a stream needs e2e_slo_s and/or ttft_slo_s (or a program's slo_s)"
            )
        if self.program is not None and self.lengths.source == "trace":
            raise _field_error("lengths.source", "a program stream samples its calls' lengths")
        if self.lengths.source == "trace" and self.arrival.process != "trace":
            raise _field_error(
                "lengths.source",
                f"'trace' needs trace arrivals, but arrival.process is {self.arrival.process!r}",
            )
        if self.end_s is not None and self.end_s <= self.start_s:
            raise _field_error("end_s", f"must be > start_s ({self.start_s}), got {self.end_s}")
        return self


class LSOSpec(_Strict):
    # eviction and KV swap: off by default, as the live QLM_LSO_EVICTION; they never paid in
    # the ablations (docs/benchmarks.md, wa-ablation and wb-ablation)
    eviction: bool = False
    swap: bool = False
    warm_start: bool = True
    # the SLO-aware pull gate (qlm.admission): off by default, as the live agent's
    # `--admission none`; with clients' max_tokens caps its required speeds are far above what
    # requests need, and it throttles the batch (docs/simulator.md, LSOs)
    slo_pull: bool = False
    # the plan's batch caps (InstanceLSO.max_in_engine), as the live QLM_LSO_BATCH_CAP
    batch_cap: bool = True


class SimOptions(_Strict):
    replan_interval_s: float = Field(default=5.0, gt=0)
    decision_delay: Literal["none", "measured"] = "none"
    drain_s: float = Field(default=600.0, ge=0)  # simulated time after the last arrival
    lso: LSOSpec = Field(default_factory=LSOSpec)
    # The LSOs are QLM's; baselines run without them (the paper's baselines have none).
    lso_policies: list[str] = Field(default_factory=lambda: ["qlm"])
    # a task-chain call whose task is already late: promoted (CATO) or demoted (SABER), as
    # the live coordinator's QLM_LATE_TASK_RULE
    late_task_rule: Literal["promote", "demote"] = "promote"


class VariantSpec(_Strict):
    """One column of a run: a policy of the scenario with its own engine-side settings, e.g.
    ``{name: mns=8, policy: fcfs, max_num_seqs: 8}`` or ``{name: saber, policy: fcfs,
    admission: saber}``. A policy with variants runs as those columns instead of once."""

    name: str = Field(min_length=1)
    policy: str = Field(min_length=1)
    # every instance's engine cap for this column (overrides pools.*.max_num_seqs)
    max_num_seqs: int | None = Field(default=None, ge=1)
    # the agents' admission in front of the engine: "none" (pull while the engine has room),
    # "saber" (SABER's Algorithm 1 with a USL f(L) profiled on the simulated engine), "qlm"
    # (qlm's SLO-aware pull); unset: what options.lso says for the policy
    admission: Literal["none", "saber", "qlm"] | None = None
    # saber: how its f(L) is profiled on the simulated engine before the run: "decode" (qlm
    # profile's concurrency sweep of decode speed) or "e2e" (SABER's paper: each request's
    # tokens / execution time under open-loop load at several rates)
    speed_profile: Literal["decode", "e2e"] = "decode"
    # saber: its maxTokens (the tokens it takes a request to need): "max_tokens" (the
    # request's) or "task_mean" (each SLO class's mean output, profiled on the workload before
    # the run, as SABER's paper allows: "an estimate of the average output length per task")
    saber_tokens: Literal["max_tokens", "task_mean"] = "max_tokens"
    # the coordinator's rule for calls of late tasks in this column (default: options')
    late_task_rule: Literal["promote", "demote"] | None = None
    overrides: dict[str, Any] = Field(default_factory=dict)  # policy constructor arguments


class SweepSpec(_Strict):
    # Dotted path into the scenario, list indices as numbers: "streams.1.arrival.rate_rps".
    parameter: str = Field(min_length=1)
    values: list[Any] = Field(min_length=1)
    label: str | None = None  # axis label for plots (default: parameter)
    variants: list[str] | None = None  # display names, one per value

    @model_validator(mode="after")
    def _variants_match(self) -> Self:
        if self.variants is not None and len(self.variants) != len(self.values):
            raise _field_error(
                "variants",
                f"has {len(self.variants)} entries but values has {len(self.values)}",
            )
        return self


@cache
def _fit_problem(gpu: str, model: ModelSpec, tp: int | None) -> str | None:
    """Why ``model`` cannot run on ``gpu`` (at ``tp``), or None. Cached: sweeps re-check."""
    try:
        get_profile(gpu, model, tp=tp)
    except InsufficientMemoryError as e:
        return str(e)
    except ValueError as e:  # e.g. a tp that does not divide the attention heads
        return str(e)
    return None


class ScenarioSpec(_Strict):
    name: str = Field(min_length=1)
    description: str = ""
    duration_s: float = Field(gt=0)  # arrivals in [0, duration_s)
    seed: int = Field(default=0, ge=0)
    # run the whole scenario once per seed and report mean ± sd (``qlm bench sim --seeds``
    # overrides it); None: the single ``seed`` above
    seeds: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)
    # alias -> catalog model, e.g. "mistral-ft-3": "mistral-7b"; aliases may not shadow
    # catalog names.
    models: dict[str, str] = Field(default_factory=dict)
    pools: list[PoolSpec] = Field(min_length=1)
    streams: list[StreamSpec] = Field(min_length=1)
    # Names only: the planner's registry is not importable from qlm's core.
    policies: list[str] = Field(default_factory=lambda: ["qlm", "edf", "fcfs", "shepherd"])
    options: SimOptions = Field(default_factory=SimOptions)
    sweep: SweepSpec | None = None
    # engine-setting columns of the policies above (see VariantSpec); default: one per policy
    variants: list[VariantSpec] | None = None
    # every request's max_tokens is its true output length: policies are told the answer.
    # Only for a labelled comparison (reports say "clairvoyant"); clients cannot do this
    clairvoyant_max_tokens: bool = False

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ScenarioError(format_validation_error(e)) from e

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        """pydantic's model_validate, raising :class:`ScenarioError` for a bad scenario."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as e:
            raise ScenarioError(format_validation_error(e)) from e

    # ---- models -------------------------------------------------------------------------

    def model_spec(self, name: str) -> ModelSpec:
        """The catalog spec of a model name, an alias resolved and renamed to the alias."""
        try:
            if name in self.models:
                return replace(resolve_model(self.models[name]), name=name)
            return resolve_model(name)
        except KeyError:
            raise ScenarioError(
                f"unknown model {name!r}; known: {self._known_models()} "
                "(or a variant 'base@tag' of a catalog model)"
            ) from None

    def model_names(self) -> list[str]:
        """Every model the scenario names, pools first, in order of first appearance."""
        names: dict[str, None] = {}
        for pool in self.pools:
            names.update(dict.fromkeys(pool.models))
        for stream in self.streams:
            names.update(dict.fromkeys(stream.models))
        return list(names)

    def _known_models(self) -> list[str]:
        return sorted(MODELS) + sorted(self.models)

    # ---- sweeps -------------------------------------------------------------------------

    def with_value(self, path: str, value: Any) -> ScenarioSpec:
        """A copy with the field at dotted ``path`` set to ``value``, validated again."""
        data = self.model_dump(mode="python")
        _set_path(data, path, value)
        return ScenarioSpec.model_validate(data)

    def run_seeds(self) -> list[int]:
        """The seeds a run covers: ``seeds`` if given, else the single ``seed``."""
        return list(self.seeds) if self.seeds else [self.seed]

    def with_seed(self, seed: int) -> ScenarioSpec:
        """A copy drawing its requests from ``seed`` (and running that seed alone)."""
        return self.model_copy(update={"seed": seed, "seeds": None})

    def sweep_points(self) -> list[tuple[str, ScenarioSpec]]:
        """(label, scenario) for each sweep value, the sweep applied and removed; without a
        sweep, the scenario itself under the label ``""``."""
        if self.sweep is None:
            return [("", self)]
        sweep = self.sweep
        base = self.model_dump(mode="python")
        base["sweep"] = None
        points = []
        for k, value in enumerate(sweep.values):
            data = copy.deepcopy(base)
            _set_path(data, sweep.parameter, copy.deepcopy(value))
            points.append((_point_label(sweep, k), ScenarioSpec.model_validate(data)))
        return points

    # ---- whole-scenario checks ----------------------------------------------------------

    @model_validator(mode="after")
    def _check_scenario(self) -> Self:
        self._check_aliases()
        self._check_pools()
        self._check_streams()
        self._check_variants()
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            raise _field_error("seeds", f"repeats a seed: {self.seeds}")
        if self.sweep is not None:
            self._check_sweep(self.sweep)
        return self

    def _check_aliases(self) -> None:
        for alias, target in self.models.items():
            try:
                resolve_model(alias)
            except KeyError:
                pass
            else:
                raise _field_error(f"models.{alias}", "an alias may not shadow a catalog model")
            try:
                resolve_model(target)
            except KeyError:
                raise _field_error(
                    f"models.{alias}",
                    f"unknown model {target!r}; known: {sorted(MODELS)} "
                    "(or a variant 'base@tag' of one)",
                ) from None

    def _resolve(self, name: str, field: str) -> ModelSpec:
        try:
            return self.model_spec(name)
        except ScenarioError as e:
            raise _field_error(field, str(e)) from None

    def _check_pools(self) -> None:
        seen: dict[str, int] = {}
        # (GPU type, model) -> (the first pool serving it, its token budget): the planner
        # prices a GPU type and model once (runner.engine_settings_known)
        budgets: dict[tuple[str, str], tuple[int, int | None]] = {}
        for i, pool in enumerate(self.pools):
            prefix = pool.instance_prefix
            if prefix in seen:
                raise _field_error(
                    f"pools.{i}.name",
                    f"instance name {prefix!r} is also pools.{seen[prefix]}'s; "
                    "give the pools distinct names",
                )
            seen[prefix] = i
            for j, name in enumerate(pool.models):
                spec = self._resolve(name, f"pools.{i}.models.{j}")
                problem = _fit_problem(pool.gpu, spec, pool.tp)
                if problem is not None:
                    raise _field_error(
                        f"pools.{i}", f"model {name!r} does not fit on {pool.gpu}: {problem}"
                    )
                first, budget = budgets.setdefault(
                    (pool.gpu, name), (i, pool.max_num_batched_tokens)
                )
                if budget != pool.max_num_batched_tokens:
                    raise _field_error(
                        f"pools.{i}.max_num_batched_tokens",
                        f"{name!r} on {pool.gpu} runs {budget} in pools.{first}: pools serving "
                        "one model on one GPU type share a token budget (the planner prices "
                        "it once)",
                    )
        if sum(pool.count for pool in self.pools) < 1:
            raise _field_error("pools", "the scenario needs at least one instance (count >= 1)")

    def _check_streams(self) -> None:
        served = {name for pool in self.pools for name in pool.models}
        seen: set[str] = set()
        for i, stream in enumerate(self.streams):
            if stream.name in seen:
                raise _field_error(f"streams.{i}.name", f"duplicate stream name {stream.name!r}")
            seen.add(stream.name)
            for j, name in enumerate(stream.models):
                self._resolve(name, f"streams.{i}.models.{j}")
                if name not in served:
                    raise _field_error(
                        f"streams.{i}.models.{j}",
                        f"model {name!r} is in no pool's models; pools serve {sorted(served)}",
                    )
            if stream.start_s >= self.duration_s:
                raise _field_error(
                    f"streams.{i}.start_s",
                    f"{stream.start_s} is not before duration_s ({self.duration_s})",
                )

    def _check_variants(self) -> None:
        seen: set[str] = set()
        for i, variant in enumerate(self.variants or []):
            if variant.policy not in self.policies:
                raise _field_error(
                    f"variants.{i}.policy",
                    f"{variant.policy!r} is not one of the scenario's policies {self.policies}",
                )
            if variant.name in seen:
                raise _field_error(f"variants.{i}.name", f"duplicate variant {variant.name!r}")
            seen.add(variant.name)
        with_variants = {v.policy for v in self.variants or []}
        for i, variant in enumerate(self.variants or []):
            if variant.name in self.policies and variant.name not in with_variants:
                raise _field_error(
                    f"variants.{i}.name",
                    f"{variant.name!r} is also a policy run as its own column; rename it",
                )

    def _check_sweep(self, sweep: SweepSpec) -> None:
        base = self.model_dump(mode="python")
        base["sweep"] = None
        for k, value in enumerate(sweep.values):
            data = copy.deepcopy(base)
            try:
                _set_path(data, sweep.parameter, copy.deepcopy(value))
            except ScenarioError as e:
                raise _field_error("sweep.parameter", str(e)) from None
            try:
                ScenarioSpec.model_validate(data)
            except ScenarioError as e:
                raise _field_error(f"sweep.values.{k}", str(e).replace("\n", "; ")) from None


def _point_label(sweep: SweepSpec, k: int) -> str:
    if sweep.variants is not None:
        return sweep.variants[k]
    value = sweep.values[k]
    if isinstance(value, dict | list):
        return f"{sweep.label or sweep.parameter} #{k}"
    return str(value)


def _set_path(data: dict[str, Any], path: str, value: Any) -> None:
    """Set the dotted ``path`` in a dumped scenario. Every step must exist, except a new alias
    under ``models``; list steps are indices."""
    parts = path.split(".")
    if not path or any(not part for part in parts):
        raise ScenarioError(f"{path!r}: not a dotted path")
    node: Any = data
    for depth, part in enumerate(parts):
        here = ".".join(parts[: depth + 1])
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ScenarioError(f"{here}: no index {part!r} (the list has {len(node)} items)")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            new_alias = depth == 1 and parts[0] == "models"
            if part not in node and not new_alias:
                raise ScenarioError(f"{here}: no field {part!r}; fields: {sorted(node)}")
            if last:
                node[part] = value
            else:
                node = node[part]
        else:
            raise ScenarioError(f"{here}: {'.'.join(parts[:depth])} is a value, not a mapping")


def load_scenario(path: str | Path) -> ScenarioSpec:
    """Read a scenario from YAML (``.yaml``/``.yml``) or JSON (``.json``)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ScenarioError(f"{path}: scenario files are .yaml, .yml or .json, not {suffix!r}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ScenarioError(f"{path}: cannot read: {e.strerror or e}") from e
    data: Any
    try:
        data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ScenarioError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise ScenarioError(f"{where}: invalid YAML: {problem}") from e
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario is a mapping, got {type(data).__name__}")
    try:
        spec = ScenarioSpec.model_validate(data)
    except ScenarioError as e:
        raise ScenarioError(f"{path}: {e}") from e
    log.debug("scenario_loaded", path=str(path), name=spec.name)
    return spec
