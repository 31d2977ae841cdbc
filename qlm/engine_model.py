"""Engine performance model: the one source of truth for how long a vLLM-like engine takes.

Pure and deterministic (no clocks, no asyncio): the ``sim`` engine backend sleeps for these
durations, and the cluster simulator and planner can call the same functions millions of times.

The model is a roofline per engine iteration (one forward pass of a continuous batch):

    t = max(FLOPs / (tp * peak * mfu), bytes / (tp * hbm_bw * bw_eff)) + tp_comm + overhead

FLOPs are 2 * params per token plus attention (4 * layers * heads * head_dim per query-key
pair); bytes are one pass over the weights plus the KV cache read and written. Efficiencies and
overhead are fitted to NVIDIA aiconfigurator's vLLM tables for Llama-3.1-8B on H100 SXM and
assumed to carry over to the other GPUs. ``docs/engine-model.md`` gives every equation, constant,
source and residual. A measured profile (``source="measured:..."``) replaces the fitted
efficiencies and, where measured, the KV capacity and load times.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any

from qlm.catalog import GPUS, MODELS, GPUSpec, ModelSpec, canonical_gpu, resolve_model
from qlm.catalog import gpu as gpu_spec

# vLLM paged KV cache: a block holds 16 tokens on CUDA (the default --block-size).
KV_BLOCK_TOKENS = 16
# vLLM's API-server defaults for --max-num-seqs / --max-num-batched-tokens (the per-iteration
# token budget, i.e. the chunked-prefill chunk). GPUs with >= 70 GiB other than A100 get larger
# ones: see vllm_batch_defaults.
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
LARGE_GPU_MAX_NUM_SEQS = 1024
LARGE_GPU_MAX_NUM_BATCHED_TOKENS = 8192

# Fitted to aiconfigurator (vLLM, Llama-3.1-8B, H100 SXM, TP1); see docs/engine-model.md.
PREFILL_MFU = 0.78  # achieved / peak dense bf16 tensor FLOPs
DECODE_BW_EFFICIENCY = 0.86  # achieved / peak HBM bandwidth
ITERATION_OVERHEAD_S = 1.1e-3  # scheduler, sampling, kernel launches per iteration

# Memory vLLM keeps out of the KV cache on every GPU: CUDA context, NCCL and CUDA-graph pools.
RUNTIME_RESERVE_BYTES_PER_GPU = 1.0e9
# Peak activation of the profiling forward pass, per token per hidden unit, in dtype elements:
# MLP gate+up (~7x hidden), activation output (~3.5x), QKV, attention output and residuals.
ACTIVATION_ELEMENTS_PER_HIDDEN = 16

# Model loading. NVMe sequential read (datacenter Gen4 drive, achieved with safetensors).
NVME_READ_GBS = 2.0
# Fixed cost of bringing a model in or out beyond the copy (vLLM sleep-mode wake-up of a
# 0.6B model takes 0.26 s, nearly all fixed cost; vLLM blog "sleep mode", v0.11, A100).
MODEL_LOAD_FIXED_S = 0.3

# Tensor parallelism: two all-reduces per layer over the GPUs' interconnect (GPUSpec's
# interconnect_gbs, NVLink, from qlm/data/gpus.yaml; PCIe where a GPU has none).
ALLREDUCE_LATENCY_S = 10e-6

TP_DEGREES = (1, 2, 4, 8)
_SOURCE_RE = re.compile(r"^(roofline|measured:.+)$")


class InsufficientMemoryError(ValueError):
    """The model's weights and runtime reserve leave no room for a KV cache on these GPUs."""


@dataclass(frozen=True)
class EngineProfile:
    """Timing and memory of one engine: a model on ``tp`` GPUs of one type."""

    gpu: GPUSpec
    model: ModelSpec
    tp: int = 1
    gpu_memory_utilization: float = 0.9
    prefill_mfu: float = PREFILL_MFU
    decode_bw_efficiency: float = DECODE_BW_EFFICIENCY
    iteration_overhead_s: float = ITERATION_OVERHEAD_S
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    disk_read_gbs: float = NVME_READ_GBS
    source: str = "roofline"  # "roofline" | "measured:<what>"
    # Set by a measured profile; None means: derive from the roofline.
    measured_kv_capacity_tokens: int | None = None
    measured_load_from_disk_s: float | None = None
    measured_load_from_cpu_s: float | None = None

    def __post_init__(self) -> None:
        if self.tp < 1 or self.model.n_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} must be >= 1 and divide {self.model.name}'s "
                f"{self.model.n_heads} attention heads"
            )
        for name in ("gpu_memory_utilization", "prefill_mfu", "decode_bw_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name}={value} must be in (0, 1]")
        if self.iteration_overhead_s < 0:
            raise ValueError("iteration_overhead_s must be >= 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not _SOURCE_RE.match(self.source):
            raise ValueError(f"source={self.source!r} must be 'roofline' or 'measured:<what>'")
        if self.kv_capacity_tokens <= 0:
            budget = self.gpu_memory_utilization * self.gpu.memory_gb
            raise InsufficientMemoryError(
                f"{self.model.name} on {self.tp}x{self.gpu.name}: weights "
                f"{self.weights_bytes_per_gpu / 1e9:.1f} GB/GPU + reserve "
                f"{self.activation_reserve_bytes_per_gpu / 1e9:.1f} GB/GPU leave no KV cache in "
                f"{budget:.1f} GB/GPU; use a larger tp"
            )

    # ---- memory -------------------------------------------------------------------------

    @cached_property
    def weights_bytes_per_gpu(self) -> float:
        return self.model.weight_bytes / self.tp

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token occupies across the TP group. KV heads are split over the GPUs;
        when tp exceeds the KV heads each GPU keeps a replica of one head (as vLLM does)."""
        m = self.model
        heads_per_gpu = math.ceil(m.n_kv_heads / self.tp)
        return 2 * m.n_layers * heads_per_gpu * m.head_dim * m.dtype_bytes * self.tp

    @cached_property
    def activation_reserve_bytes_per_gpu(self) -> float:
        activation = (
            self.max_num_batched_tokens
            * self.model.hidden_size
            * self.model.dtype_bytes
            * ACTIVATION_ELEMENTS_PER_HIDDEN
            / self.tp
        )
        return RUNTIME_RESERVE_BYTES_PER_GPU + activation

    @cached_property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds, a whole number of blocks (<= 0: the model does not fit)."""
        if self.measured_kv_capacity_tokens is not None:
            return self.measured_kv_capacity_tokens
        budget = self.tp * (
            self.gpu_memory_utilization * self.gpu.memory_gb * 1e9
            - self.weights_bytes_per_gpu
            - self.activation_reserve_bytes_per_gpu
        )
        tokens = math.floor(budget / self.kv_bytes_per_token)
        return tokens // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS if tokens > 0 else tokens

    @property
    def max_batch_size(self) -> int:
        return self.max_num_seqs

    # ---- iteration timing ---------------------------------------------------------------

    @cached_property
    def _flops_per_s(self) -> float:
        return self.tp * self.gpu.bf16_tflops * 1e12 * self.prefill_mfu

    @cached_property
    def _bytes_per_s(self) -> float:
        return self.tp * self.gpu.mem_bw_gbs * 1e9 * self.decode_bw_efficiency

    @cached_property
    def _attention_flops_per_pair(self) -> float:
        # QK^T and PV: 2 FLOPs per multiply-add, 2 matmuls, every layer and query head.
        m = self.model
        return 4.0 * m.n_layers * m.n_heads * m.head_dim

    def _tp_comm_time(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        link_gbs = self.gpu.interconnect_gbs or self.gpu.pcie_gbs
        # Ring all-reduce moves 2(tp-1)/tp of the activation per GPU; two per layer.
        size = tokens * self.model.hidden_size * self.model.dtype_bytes
        per_allreduce = ALLREDUCE_LATENCY_S + size * 2 * (self.tp - 1) / self.tp / (link_gbs * 1e9)
        return 2 * self.model.n_layers * per_allreduce

    def iteration_time(
        self,
        prefill_tokens: int,
        decode_batch: int,
        context_tokens: int,
        *,
        prefill_attention_pairs: float | None = None,
    ) -> float:
        """Seconds for one continuous-batching step: ``prefill_tokens`` prompt tokens (any
        number of sequences) and one token for each of ``decode_batch`` running sequences, in
        one pass over the weights.

        ``context_tokens`` is the total sequence length the decode batch attends to (the sum
        over its sequences, each including its new token). ``prefill_attention_pairs`` is the
        number of causal query-key pairs of the prefill part, summed over sequences; the
        default treats the prefill as one sequence, ``n (n + 1) / 2``.
        """
        if prefill_tokens < 0 or decode_batch < 0 or context_tokens < 0:
            raise ValueError("token and batch counts must be >= 0")
        if prefill_tokens == 0 and decode_batch == 0:
            return 0.0
        if prefill_attention_pairs is None:
            prefill_attention_pairs = prefill_tokens * (prefill_tokens + 1) / 2
        tokens = prefill_tokens + decode_batch
        flops = 2.0 * self.model.params_b * 1e9 * tokens + self._attention_flops_per_pair * (
            prefill_attention_pairs + context_tokens
        )
        # Weights once; decode reads its contexts' KV; prefill writes its tokens' KV.
        traffic = self.model.weight_bytes + self.kv_bytes_per_token * (
            context_tokens + prefill_tokens
        )
        roofline = max(flops / self._flops_per_s, traffic / self._bytes_per_s)
        return roofline + self._tp_comm_time(tokens) + self.iteration_overhead_s

    def prefill_time(self, n_tokens: int) -> float:
        """Seconds to prefill one ``n_tokens`` prompt alone (time to first token, no queueing)."""
        return self.iteration_time(n_tokens, 0, 0)

    def decode_iteration_time(self, batch_size: int, context_tokens: int) -> float:
        """Seconds for one decode step of ``batch_size`` sequences, each ``context_tokens`` long."""
        return self.iteration_time(0, batch_size, batch_size * context_tokens)

    def decode_segment_time(self, batch_size: int, context_tokens: int, iterations: int) -> float:
        """Seconds for ``iterations`` consecutive decode steps of a fixed batch: the exact sum
        of ``iteration_time(0, batch_size, context_tokens + j * batch_size)`` for j < iterations,
        in closed form (each step adds one token to each of the ``batch_size`` sequences).

        Each step's time is ``max(compute, memory) + constant`` with both terms linear in the
        context, so the sum splits at the step where the bound changes into two arithmetic
        series. The cluster simulator jumps over whole segments with it instead of ticking
        every token."""
        if iterations <= 0 or batch_size <= 0:
            return 0.0
        b, n = batch_size, iterations
        # compute(j) = f0 + fs*j ; memory(j) = m0 + ms*j  (seconds), j = 0..n-1
        fs = self._attention_flops_per_pair * b / self._flops_per_s
        f0 = (
            2.0 * self.model.params_b * 1e9 * b + self._attention_flops_per_pair * context_tokens
        ) / self._flops_per_s
        ms = self.kv_bytes_per_token * b / self._bytes_per_s
        m0 = (
            self.model.weight_bytes + self.kv_bytes_per_token * context_tokens
        ) / self._bytes_per_s
        constant = self._tp_comm_time(b) + self.iteration_overhead_s

        def series(a: float, s: float, j0: int, j1: int) -> float:
            k = j1 - j0
            return k * a + s * k * (j0 + j1 - 1) / 2 if k > 0 else 0.0

        # d(j) = compute - memory; the larger term switches at most once (both are linear)
        d0, ds = f0 - m0, fs - ms
        if ds == 0:
            split = 0 if d0 >= 0 else n  # compute-bound on [0, split)
        else:
            crossing = -d0 / ds
            if ds > 0:  # memory-bound before the crossing, compute-bound after
                first_compute = min(n, max(0, math.ceil(crossing)))
                return (
                    series(m0, ms, 0, first_compute)
                    + series(f0, fs, first_compute, n)
                    + n * constant
                )
            split = min(n, max(0, math.floor(crossing) + 1))  # compute-bound up to crossing
        return series(f0, fs, 0, split) + series(m0, ms, split, n) + n * constant

    def decode_iterations_within(
        self, batch_size: int, context_tokens: int, seconds: float, limit: int
    ) -> int:
        """The most decode steps (at most ``limit``) of a fixed batch that finish within
        ``seconds``: the inverse of :meth:`decode_segment_time`, by bisection."""
        lo, hi = 0, max(0, limit)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.decode_segment_time(batch_size, context_tokens, mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def token_throughput(self, batch_size: int, context: int) -> float:
        """Output tokens per second of a steady decode batch of ``context``-token sequences."""
        if batch_size == 0:
            return 0.0
        return batch_size / self.decode_iteration_time(batch_size, context)

    def recompute_time(self, tokens: int) -> float:
        """Seconds to rebuild an evicted request's KV: a prefill of its tokens."""
        return self.prefill_time(tokens)

    # ---- transfers ----------------------------------------------------------------------

    def load_time_from_disk(self) -> float:
        """Cold start: weights from NVMe (the bottleneck) through host memory onto the GPUs."""
        if self.measured_load_from_disk_s is not None:
            return self.measured_load_from_disk_s
        disk = self.model.weight_bytes / (self.disk_read_gbs * 1e9)
        pcie = self.weights_bytes_per_gpu / (self.gpu.pcie_gbs * 1e9)
        return MODEL_LOAD_FIXED_S + max(disk, pcie)

    def load_time_from_cpu(self) -> float:
        """Warm start: weights from pinned host memory, each GPU its shard over its own PCIe."""
        if self.measured_load_from_cpu_s is not None:
            return self.measured_load_from_cpu_s
        return MODEL_LOAD_FIXED_S + self.weights_bytes_per_gpu / (self.gpu.pcie_gbs * 1e9)

    def kv_transfer_time(self, tokens: int) -> float:
        """Seconds to move ``tokens`` tokens of KV between GPU and host memory (one direction)."""
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        return tokens * self.kv_bytes_per_token / (self.tp * self.gpu.pcie_gbs * 1e9)


def vllm_batch_defaults(gpu: GPUSpec) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that vLLM's API server picks for this GPU
    (``EngineArgs.get_batch_defaults``: larger on >= 70 GiB devices, except A100 where a larger
    token budget lowered throughput, vLLM PR #17885)."""
    if gpu.memory_gb * 1e9 >= 70 * 2**30 and "a100" not in gpu.name.lower():
        return LARGE_GPU_MAX_NUM_BATCHED_TOKENS, LARGE_GPU_MAX_NUM_SEQS
    return DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS


# Measured profiles (`qlm profile`) registered by the coordinator at start: get_profile returns
# them instead of the roofline for their (GPU type, model). The estimator and the planner cache
# what they derive from profiles; each such cache is cleared whenever the registered set
# changes (profile_caches), so a change holds for the next plan.
_MEASURED: dict[tuple[str, str], EngineProfile] = {}
_CACHE_CLEARS: list[Callable[[], None]] = []


def profile_caches(*clears: Callable[[], None]) -> None:
    """Register caches of values derived from :func:`get_profile` (their ``cache_clear``):
    they are cleared whenever a measured profile is registered or the registered ones are
    cleared."""
    _CACHE_CLEARS.extend(clears)


def _profiles_changed() -> None:
    for clear in _CACHE_CLEARS:
        clear()


def register_measured_profile(profile: EngineProfile) -> None:
    """Use ``profile`` for its (GPU type, model) from now on, e.g. a GPU type or a CPU host
    the catalog does not know, or measured hardware instead of the roofline."""
    _MEASURED[(profile.gpu.name, profile.model.name)] = profile
    _profiles_changed()


def clear_measured_profiles() -> None:
    _MEASURED.clear()
    _profiles_changed()


def measured_profiles() -> dict[tuple[str, str], EngineProfile]:
    """The registered profiles by (GPU type, model): a copy."""
    return dict(_MEASURED)


def get_profile(
    gpu_type: str, model: str | ModelSpec, tp: int | None = None, **overrides: Any
) -> EngineProfile:
    """The profile of ``model`` on ``gpu_type``: a registered measured one
    (:func:`register_measured_profile`), else the roofline with vLLM's batch defaults for that
    GPU (``overrides`` sets any other field, and always gives the roofline). With ``tp=None``,
    the smallest TP degree in (1, 2, 4, 8) whose KV cache holds at least one full-context
    sequence (vLLM refuses to start otherwise); failing that, the smallest one with any KV
    cache at all."""
    name = model if isinstance(model, str) else model.name
    measured = _MEASURED.get((gpu_type, name)) or _MEASURED.get((canonical_gpu(gpu_type), name))
    if measured is not None and tp in (None, measured.tp) and not overrides:
        return measured
    gpu = gpu_spec(gpu_type)  # KeyError naming the known types
    spec = resolve_model(model) if isinstance(model, str) else model
    batched_tokens, num_seqs = vllm_batch_defaults(gpu)
    overrides.setdefault("max_num_batched_tokens", batched_tokens)
    overrides.setdefault("max_num_seqs", num_seqs)
    if tp is not None:
        return EngineProfile(gpu=gpu, model=spec, tp=tp, **overrides)
    fitting: list[EngineProfile] = []
    for degree in TP_DEGREES:
        if spec.n_heads % degree:
            continue
        try:
            profile = EngineProfile(gpu=gpu, model=spec, tp=degree, **overrides)
        except InsufficientMemoryError:
            continue
        if profile.kv_capacity_tokens >= spec.max_context:
            return profile
        fitting.append(profile)
    if fitting:
        return fitting[0]
    raise InsufficientMemoryError(
        f"{spec.name} does not fit on {max(TP_DEGREES)}x{gpu_type} (tp degrees {TP_DEGREES})"
    )


def profile_to_dict(profile: EngineProfile) -> dict[str, Any]:
    """A JSON-ready dict with the full GPU and model specs, so it loads without the catalog."""
    out = {f.name: getattr(profile, f.name) for f in fields(profile)}
    out["gpu"] = asdict(profile.gpu)
    out["model"] = asdict(profile.model)
    return out


PROFILE_FILE_EXTRAS = ("usl", "measurements")


def profile_from_dict(data: dict[str, Any]) -> EngineProfile:
    """Inverse of :func:`profile_to_dict`; ``gpu``/``model`` may also be catalog names."""
    known = {f.name for f in fields(EngineProfile)}
    # what `qlm profile` writes beside the profile (the USL speed model, raw measurements)
    data = {k: v for k, v in data.items() if k not in PROFILE_FILE_EXTRAS}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown engine profile fields: {sorted(unknown)}")
    values = dict(data)
    gpu, model = values.pop("gpu"), values.pop("model")
    if isinstance(gpu, dict) and "interconnect_gbs" not in gpu:
        # written before the GPU table had the field: the link is the table's, as it was then
        # (a hard-coded NVLink table), or PCIe for a GPU the table does not know
        table = GPUS.get(canonical_gpu(str(gpu.get("name"))))
        gpu = {**gpu, "interconnect_gbs": table.interconnect_gbs if table else None}
    gpu_figures = gpu_spec(gpu) if isinstance(gpu, str) else GPUSpec(**gpu)
    model_spec = MODELS[model] if isinstance(model, str) else ModelSpec(**model)
    return EngineProfile(gpu=gpu_figures, model=model_spec, **values)
