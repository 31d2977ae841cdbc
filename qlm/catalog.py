"""Model and GPU catalog: the static facts every component agrees on.

Model shapes come from the models' published configs (Hugging Face ``config.json``); GPU figures
from the vendors' datasheets. ``docs/engine-model.md`` cites each one. The coordinator validates
requests against ``ModelSpec.max_context``/``max_output_tokens``; the engine performance model
(:mod:`qlm.engine_model`) derives timings and KV capacity from the same records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


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

GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        # "80 GB" cards have 81,920 MiB = 85.9e9 bytes; the A10 has 23,028 MiB = 24.1e9 bytes.
        GPUSpec("A10", 24.1, 125, 600, 25),
        GPUSpec("A100-80GB", 85.9, 312, 2039, 25),
        GPUSpec("H100-80GB", 85.9, 989, 3350, 50),
    )
}


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
        """Load extra models from a JSON list of ModelSpec fields, on top of the built-ins."""
        models = dict(MODELS)
        for entry in json.loads(Path(path).read_text()):
            spec = ModelSpec(**entry)
            models[spec.name] = spec
        return cls(models)


def gpu(name: str) -> GPUSpec:
    try:
        return GPUS[name]
    except KeyError:
        raise KeyError(f"unknown GPU type {name!r}; known: {sorted(GPUS)}") from None
