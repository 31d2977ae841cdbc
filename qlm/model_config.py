"""A model's architecture from its Hugging Face ``config.json``.

Given a model directory (or its ``config.json``, or a Hugging Face cache entry
``models--org--name`` or any path inside one), :func:`spec_from_config` derives the
:class:`~qlm.catalog.ModelSpec` that the coordinator validates requests against and the engine
model (:mod:`qlm.engine_model`) times: parameter count, layer and head shape (hence KV bytes
per token), context length and dtype. docs/engine-model.md, "Models from config.json", gives
the rules; what cannot be derived is an error naming the file and the missing fields.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from qlm.catalog import ModelCatalog, ModelSpec, register_models

CONFIG_FILE = "config.json"
# Multimodal and composite configs keep the language model's fields under one of these.
_NESTED = ("text_config", "llm_config", "language_config")
# field -> the names configs use for it, the Hugging Face name first (GPT-2, Falcon, MPT ... use
# their own)
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "num_key_value_heads": (
        "num_key_value_heads",
        "num_kv_heads",
        "n_head_kv",
        "multi_query_group_num",
    ),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "max_position_embeddings": (
        "max_position_embeddings",
        "n_positions",
        "max_sequence_length",
        "seq_length",
        "max_seq_len",
    ),
}
REQUIRED = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)
# Bytes per weight and KV element as vLLM serves the checkpoint with its default --dtype auto:
# fp32 checkpoints are served in fp16 (vLLM's documented rule), so they count 2 bytes too.
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "half": 2, "float32": 2, "float": 2}
# Architectures whose MLP is a plain up/down projection (2 matrices); the rest (Llama, Mistral,
# Qwen, Gemma, Phi-3, ...) use a gated one (gate, up, down: 3 matrices).
_UNGATED = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "mpt", "phi", "starcoder2"}


class ModelConfigError(ValueError):
    """A config.json that cannot describe a model; the message names the file."""


def find_config(path: str | Path) -> Path:
    """The ``config.json`` that ``path`` means: the file itself, the one in the directory, or
    for a Hugging Face cache entry (``.../models--org--name``) the snapshot ``refs/main``
    points at (else the only snapshot)."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if (p / CONFIG_FILE).is_file():
        return p / CONFIG_FILE
    snapshots = p / "snapshots"
    if snapshots.is_dir():
        ref = p / "refs" / "main"
        if ref.is_file() and (snapshots / ref.read_text().strip() / CONFIG_FILE).is_file():
            return snapshots / ref.read_text().strip() / CONFIG_FILE
        found = sorted(snapshots.glob(f"*/{CONFIG_FILE}"))
        if len(found) == 1:
            return found[0]
        if found:
            raise ModelConfigError(
                f"{p}: {len(found)} snapshots and no refs/main; name one: {found[0].parent}"
            )
    if not p.exists():
        raise ModelConfigError(f"{p}: no such file or directory")
    raise ModelConfigError(f"{p}: no {CONFIG_FILE} there (expected a model directory)")


def default_name(config_path: Path) -> str:
    """A model name for a config found at ``config_path``: ``org/name`` inside a Hugging Face
    cache entry (the id vLLM would serve it under), else the directory's name."""
    for parent in config_path.parents:
        if parent.name.startswith("models--"):
            return parent.name.removeprefix("models--").replace("--", "/")
    return config_path.parent.name


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: the nested text config over the top level (which keeps
    what composite configs state once, e.g. torch_dtype)."""
    for key in _NESTED:
        nested = config.get(key)
        if isinstance(nested, dict):
            return {**config, **{k: v for k, v in nested.items() if v is not None}}
    return config


def _field(config: dict[str, Any], name: str) -> Any:
    for alias in _ALIASES.get(name, (name,)):
        value = config.get(alias)
        if value is not None:
            return value
    return None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def spec_from_dict(
    config: dict[str, Any], name: str, where: str, *, max_output_tokens: int | None = None
) -> ModelSpec:
    """The ModelSpec of a parsed ``config.json``; ``where`` names it in errors."""
    if not isinstance(config, dict):
        raise ModelConfigError(f"{where}: expected a JSON object")
    c = _flatten(config)
    values = {f: _field(c, f) for f in REQUIRED}
    if (
        values["intermediate_size"] is None
        and c.get("model_type") == "gpt2"
        and values["hidden_size"]
    ):
        values["intermediate_size"] = 4 * values["hidden_size"]  # GPT-2: n_inner null = 4 x
    missing = [f for f in REQUIRED if values[f] is None]
    if missing:
        raise ModelConfigError(f"{where}: missing {', '.join(missing)}")
    bad = [f"{f}={values[f]!r}" for f in REQUIRED if not _positive_int(values[f])]
    if bad:
        raise ModelConfigError(f"{where}: not positive integers: {', '.join(bad)}")
    layers, hidden = values["num_hidden_layers"], values["hidden_size"]
    heads, inter = values["num_attention_heads"], values["intermediate_size"]
    vocab, context = values["vocab_size"], values["max_position_embeddings"]
    kv_heads = _field(c, "num_key_value_heads")
    if kv_heads is None:
        # absent: multi-head attention (every head its own K/V), unless flagged multi-query
        kv_heads = 1 if c.get("multi_query") else heads
    head_dim = c.get("head_dim") or c.get("kv_channels") or hidden // heads
    if not _positive_int(kv_heads) or heads % kv_heads:
        raise ModelConfigError(
            f"{where}: num_key_value_heads={kv_heads!r} must be a positive divisor of "
            f"num_attention_heads={heads}"
        )
    if not _positive_int(head_dim):
        raise ModelConfigError(f"{where}: head_dim={head_dim!r} is not a positive integer")
    dtype = c.get("torch_dtype") or c.get("dtype") or "bfloat16"
    if not isinstance(dtype, str) or dtype.removeprefix("torch.") not in _DTYPE_BYTES:
        raise ModelConfigError(
            f"{where}: torch_dtype={dtype!r}; qlm models {sorted(_DTYPE_BYTES)} (quantized "
            "checkpoints: write a models file with their params and dtype_bytes)"
        )
    dtype_bytes = _DTYPE_BYTES[dtype.removeprefix("torch.")]
    experts = c.get("num_local_experts") or c.get("num_experts") or 1
    if not _positive_int(experts):
        raise ModelConfigError(f"{where}: num_local_experts={experts!r} is not a positive integer")
    moe_inter = c.get("moe_intermediate_size") or inter
    gated = str(c.get("model_type", "")).lower() not in _UNGATED
    params = _parameter_count(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        mlp=(3 if gated else 2) * hidden * (moe_inter * experts if experts > 1 else inter),
        vocab=vocab,
        tied=bool(c.get("tie_word_embeddings", False)),
    )
    return ModelSpec(
        name=name,
        params_b=params / 1e9,
        n_layers=layers,
        hidden_size=hidden,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=context,
        # vLLM caps max_tokens only by the context; so does qlm unless told otherwise
        max_output_tokens=min(max_output_tokens or context, context),
        dtype_bytes=dtype_bytes,
    )


def _parameter_count(
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    mlp: int,
    vocab: int,
    tied: bool,
) -> int:
    """Weights of a decoder-only transformer: embeddings (and an untied LM head), per layer
    the Q/K/V/O projections, the MLP and two norms, and a final norm. Biases are left out
    (< 0.1 % of a 7B model). For a mixture of experts this counts every expert: the weights
    to load, though a token's FLOPs use only the active ones (the roofline is then slow)."""
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if tied else 2)
    return layers * per_layer + embeddings + hidden


def spec_from_config(
    path: str | Path, name: str | None = None, *, max_output_tokens: int | None = None
) -> ModelSpec:
    """The ModelSpec of the model whose config ``path`` means (see :func:`find_config`),
    named ``name`` (default: :func:`default_name`)."""
    config_path = find_config(path)
    try:
        data = json.loads(config_path.read_text())
    except OSError as exc:
        raise ModelConfigError(f"{config_path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{config_path}: not JSON ({exc})") from None
    return spec_from_dict(
        data,
        name or default_name(config_path),
        str(config_path),
        max_output_tokens=max_output_tokens,
    )


def parse_model_config_arg(item: str) -> ModelSpec:
    """``NAME=PATH`` or ``PATH`` (the name then from :func:`default_name`), as the
    ``--model-config`` flags and ``QLM_MODEL_CONFIGS`` take it."""
    name, sep, path = item.partition("=")
    if not sep:
        return spec_from_config(item)
    if not name.strip() or not path.strip():
        raise ModelConfigError(f"{item!r}: expected NAME=PATH or PATH")
    return spec_from_config(path.strip(), name.strip())


_SPEC_INT_FIELDS = (
    "n_layers",
    "hidden_size",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "max_context",
    "max_output_tokens",
    "dtype_bytes",
)


def _spec_from_entry(entry: dict[str, Any], where: str) -> ModelSpec:
    """A models-file entry written out in ModelSpec fields, checked field by field."""
    known = set(ModelSpec.__dataclass_fields__)
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ModelConfigError(f"{where}: unknown fields {unknown}; known: {sorted(known)}")
    required = [
        f for f, d in ModelSpec.__dataclass_fields__.items() if d.default is dataclasses.MISSING
    ]
    missing = [f for f in required if f not in entry]
    if missing:
        raise ModelConfigError(f"{where}: missing {', '.join(missing)}")
    if not isinstance(entry["name"], str) or not entry["name"]:
        raise ModelConfigError(f"{where}: name must be a non-empty string")
    bad = [f for f in _SPEC_INT_FIELDS if f in entry and not _positive_int(entry[f])]
    params = entry["params_b"]
    if isinstance(params, bool) or not isinstance(params, int | float) or not params > 0:
        bad.append("params_b")
    if bad:
        raise ModelConfigError(f"{where}: {', '.join(bad)} must be positive numbers")
    return ModelSpec(**entry)


def load_models_file(path: str | Path) -> list[ModelSpec]:
    """The models of ``QLM_MODELS_FILE``: a JSON list whose entries are either every
    ModelSpec field, or ``{"name": ..., "config": DIR_OR_CONFIG_JSON}`` (optionally with
    ``max_output_tokens``), a relative ``config`` being relative to the file; or a model
    directory / its ``config.json`` itself (one model, named as :func:`default_name` says)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return [spec_from_config(p)]
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ModelConfigError(f"models file {p}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"models file {p}: not JSON ({exc})") from None
    if isinstance(data, dict):  # a Hugging Face config.json, not a list of models
        return [spec_from_dict(data, default_name(p), str(p))]
    if not isinstance(data, list):
        raise ModelConfigError(f"models file {p}: expected a JSON list of models")
    specs: list[ModelSpec] = []
    for i, entry in enumerate(data):
        where = f"models file {p}, entry {i}"
        if not isinstance(entry, dict):
            raise ModelConfigError(f"{where}: expected a JSON object")
        if "config" in entry:
            extra = sorted(set(entry) - {"name", "config", "max_output_tokens"})
            if extra:
                raise ModelConfigError(
                    f"{where}: a 'config' entry takes name and max_output_tokens only, not {extra}"
                )
            cfg = Path(str(entry["config"])).expanduser()
            name, cap = entry.get("name"), entry.get("max_output_tokens")
            if cap is not None and not _positive_int(cap):
                raise ModelConfigError(f"{where}: max_output_tokens must be a positive integer")
            specs.append(
                spec_from_config(
                    cfg if cfg.is_absolute() else p.parent / cfg,
                    name if isinstance(name, str) and name else None,
                    max_output_tokens=cap,
                )
            )
        else:
            specs.append(_spec_from_entry(entry, where))
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ModelConfigError(f"models file {p}: {duplicates} defined more than once")
    return specs


def split_model_configs(value: str | None) -> list[str]:
    """``QLM_MODEL_CONFIGS``: comma-separated ``NAME=PATH`` or ``PATH`` items."""
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def load_catalog(
    models_file: str | None, model_configs: list[str] | None = None, *, register: bool = True
) -> ModelCatalog:
    """The catalog every qlm process builds the same way: the built-in models, then
    ``QLM_MODELS_FILE``, then each ``NAME=PATH`` config (a later one replaces an earlier
    model of the same name). ``register`` also makes them known process-wide
    (:func:`qlm.catalog.register_models`), which the engine model and the planner need."""
    specs = load_models_file(models_file) if models_file else []
    specs += [parse_model_config_arg(item) for item in model_configs or []]
    if register:
        register_models(specs)
    return ModelCatalog.with_models(specs)
