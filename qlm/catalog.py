"""Model and GPU catalog: the static facts every component agrees on.

Model shapes come from the models' published configs (Hugging Face ``config.json``; more models
from a models file or a config.json, :mod:`qlm.model_config`); GPU figures from the vendors'
data sheets, kept as data in ``qlm/data/gpus.yaml`` (:mod:`qlm.gpu_table`), which cites each
one. The coordinator validates
requests against ``ModelSpec.max_context``/``max_output_tokens``; the engine performance model
(:mod:`qlm.engine_model`) derives timings and KV capacity from the same records.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from qlm.gpu_table import GPUTable, load_gpu_table, merge, shipped_gpu_table


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params_b: float  # parameters, billions
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_context: int  # prompt + output tokens the model accepts
    max_output_tokens: int  # server-side cap on max_tokens
    dtype_bytes: int = 2  # fp16/bf16 weights and KV

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, every layer, every KV head.
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gb: float  # device memory as nvidia-smi reports it, in GB (1e9 bytes)
    bf16_tflops: float  # dense tensor-core peak
    mem_bw_gbs: float  # HBM bandwidth, GB/s
    pcie_gbs: float  # host<->device bandwidth, GB/s, one direction, achievable
    # GPU<->GPU bandwidth for tensor parallelism (NVLink), GB/s one direction; None: PCIe
    interconnect_gbs: float | None = None


# Shapes: Mistral-7B-v0.1, Llama-2-13b (Vicuna-13B has the same shape), Llama-2-70b configs.
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("mistral-7b", 7.24, 32, 4096, 32, 8, 128, 8192, 4096),
        ModelSpec("vicuna-13b", 13.0, 40, 5120, 40, 40, 128, 4096, 4096),
        ModelSpec("llama-2-70b", 69.0, 80, 8192, 64, 8, 128, 4096, 4096),
        # The tiny Llama that the vLLM tests and `make demo BACKEND=vllm` generate
        # (agents/tiny_model.py).
        ModelSpec("tiny-llama", 0.0005, 2, 128, 4, 2, 32, 2048, 1024),
    )
}


def _specs(table: GPUTable) -> dict[str, GPUSpec]:
    return {name: GPUSpec(name=name, **figures) for name, figures in table.entries.items()}


# The shipped table (qlm/data/gpus.yaml, data-sheet figures with their sources); use_gpu_table
# adds a user's. Both dicts are updated in place: modules that imported them see the change.
_TABLE = shipped_gpu_table()
GPUS: dict[str, GPUSpec] = _specs(_TABLE)
GPU_ALIASES: dict[str, str] = dict(_TABLE.aliases)


def use_gpu_table(path: str | Path) -> list[str]:
    """Merge a user GPU table (``QLM_GPU_TABLE`` / ``--gpu-table``) over the shipped one, for
    this process; returns the GPU names it defines. Raises GPUTableError naming the problem."""
    global _TABLE
    extra = load_gpu_table(path)
    _TABLE = merge(_TABLE, extra, f"GPU table {path}")
    GPUS.clear()
    GPUS.update(_specs(_TABLE))
    GPU_ALIASES.clear()
    GPU_ALIASES.update(_TABLE.aliases)
    return sorted(extra.entries)


def canonical_gpu(name: str) -> str:
    """The table's name for ``name`` (an alias resolved); an unknown name is returned as is
    (a CPU host or a GPU only a measured profile knows)."""
    return GPU_ALIASES.get(name, name)


class UnknownModelError(KeyError):
    pass


VARIANT_SEPARATOR = "@"


def resolve_model(name: str) -> ModelSpec:
    """The spec of a catalog model or of a variant ``base@tag`` (a fine-tune of ``base``: same
    shape and timings, different weights, so it is a distinct model to load and to group).
    Unknown names raise KeyError listing the known ones."""
    spec = MODELS.get(name)
    if spec is not None:
        return spec
    base, sep, tag = name.partition(VARIANT_SEPARATOR)
    if sep and tag and base in MODELS:
        return replace(MODELS[base], name=name)
    raise KeyError(
        f"unknown model {name!r}; known: {sorted(MODELS)} (or a variant 'base@tag' of one)"
    )


class ModelCatalog:
    """The set of models the coordinator accepts requests for."""

    def __init__(self, models: dict[str, ModelSpec] | None = None) -> None:
        self._models = dict(MODELS if models is None else models)

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def get(self, name: str) -> ModelSpec:
        try:
            return self._models[name]
        except KeyError:
            raise UnknownModelError(name) from None

    def names(self) -> list[str]:
        return sorted(self._models)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelCatalog:
        """The built-ins plus the models of a models file (a JSON list of ModelSpec fields or
        ``{"name", "config"}`` entries) or of one model directory / ``config.json``: see
        :func:`qlm.model_config.load_models_file` (docs/engine-model.md has the format)."""
        from qlm.model_config import load_models_file  # it builds on this module

        return cls.with_models(load_models_file(path))

    @classmethod
    def with_models(cls, specs: Iterable[ModelSpec]) -> ModelCatalog:
        """The built-ins plus ``specs`` (a spec replaces a built-in of the same name)."""
        models = dict(MODELS)
        models.update((s.name, s) for s in specs)
        return cls(models)


def register_models(specs: Iterable[ModelSpec]) -> None:
    """Make ``specs`` known process-wide, as the built-ins are: the engine model
    (:func:`qlm.engine_model.get_profile`), the sim engine and the planner's estimates look
    models up by name in :data:`MODELS`. Called at start by the commands that load models
    from files, before anything caches a profile."""
    MODELS.update((s.name, s) for s in specs)


def gpu(name: str) -> GPUSpec:
    """The spec of a GPU type, by name or alias; KeyError listing the known ones."""
    try:
        return GPUS[canonical_gpu(name)]
    except KeyError:
        raise KeyError(
            f"unknown GPU type {name!r}; known: {sorted(GPUS)} (aliases: {sorted(GPU_ALIASES)}; "
            "more with QLM_GPU_TABLE)"
        ) from None
