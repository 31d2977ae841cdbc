"""Model specs from Hugging Face config.json files and from models files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qlm.catalog import MODELS, ModelCatalog
from qlm.model_config import (
    REQUIRED,
    ModelConfigError,
    find_config,
    load_models_file,
    parse_model_config_arg,
    spec_from_config,
    spec_from_dict,
)

# The published configs (the fields qlm reads) of models the catalog also knows by hand.
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
LLAMA_2_13B = {  # no num_key_value_heads: multi-head attention
    "model_type": "llama",
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "max_position_embeddings": 4096,
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "torch_dtype": "float16",
    "vocab_size": 32000,
}


def _write(directory: Path, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_mistral_matches_the_hand_written_catalog_entry() -> None:
    spec = spec_from_dict(MISTRAL_7B, "mistral-7b", "x")
    ref = MODELS["mistral-7b"]
    assert spec.params_b == pytest.approx(ref.params_b, rel=0.005)
    for field in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "dtype_bytes"):
        assert getattr(spec, field) == getattr(ref, field), field
    assert spec.kv_bytes_per_token == ref.kv_bytes_per_token == 131072
    assert spec.max_context == 32768 and spec.max_output_tokens == 32768


def test_missing_kv_heads_means_multi_head_attention() -> None:
    spec = spec_from_dict(LLAMA_2_13B, "vicuna-13b", "x")
    assert (
        spec.n_kv_heads == 40 and spec.kv_bytes_per_token == MODELS["vicuna-13b"].kv_bytes_per_token
    )
    assert spec.params_b == pytest.approx(13.0, rel=0.01)


def test_text_config_of_a_multimodal_model_is_used() -> None:
    config = {
        "model_type": "llava",
        "torch_dtype": "bfloat16",
        "vision_config": {"hidden_size": 1024, "num_hidden_layers": 24},
        "text_config": {**MISTRAL_7B, "torch_dtype": None},
    }
    spec = spec_from_dict(config, "llava", "x")
    assert spec.n_layers == 32 and spec.hidden_size == 4096 and spec.dtype_bytes == 2


def test_explicit_head_dim_and_tied_embeddings() -> None:
    # Gemma-style: head_dim is not hidden_size / heads, and the LM head is the embedding
    config = {**MISTRAL_7B, "head_dim": 256, "tie_word_embeddings": True, "num_key_value_heads": 1}
    spec = spec_from_dict(config, "g", "x")
    assert spec.head_dim == 256 and spec.kv_bytes_per_token == 2 * 32 * 1 * 256 * 2
    untied = spec_from_dict({**config, "tie_word_embeddings": False}, "g", "x")
    assert (untied.params_b - spec.params_b) * 1e9 == pytest.approx(32000 * 4096)


def test_gpt2_style_names_and_ungated_mlp() -> None:
    config = {
        "model_type": "gpt2",
        "n_layer": 12,
        "n_embd": 768,
        "n_head": 12,
        "n_inner": None,
        "n_positions": 1024,
        "vocab_size": 50257,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    spec = spec_from_dict(config, "gpt2", "x")
    assert spec.params_b == pytest.approx(0.124, rel=0.02)  # GPT-2 small: 124M
    assert spec.max_context == 1024 and spec.dtype_bytes == 2  # vLLM serves fp32 as fp16


def test_mixture_of_experts_counts_every_expert() -> None:
    mixtral = {**MISTRAL_7B, "model_type": "mixtral", "num_local_experts": 8}
    assert spec_from_dict(mixtral, "mixtral", "x").params_b == pytest.approx(46.7, rel=0.01)


@pytest.mark.parametrize("field", REQUIRED)
def test_each_missing_field_is_named_with_the_file(tmp_path: Path, field: str) -> None:
    config = {k: v for k, v in MISTRAL_7B.items() if k != field}
    _write(tmp_path / "m", config)
    with pytest.raises(ModelConfigError) as err:
        spec_from_config(tmp_path / "m")
    assert str(tmp_path / "m" / "config.json") in str(err.value)
    assert f"missing {field}" in str(err.value)


def test_all_missing_fields_are_listed_at_once() -> None:
    with pytest.raises(ModelConfigError, match="x: missing " + ", ".join(REQUIRED)):
        spec_from_dict({"model_type": "llama"}, "m", "x")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": 0}, "not positive integers: num_hidden_layers=0"),
        ({"hidden_size": "4096"}, "hidden_size='4096'"),
        ({"num_key_value_heads": 5}, "num_key_value_heads=5 must be a positive divisor"),
        ({"torch_dtype": "int4"}, "torch_dtype='int4'"),
        ({"num_local_experts": -2}, "num_local_experts=-2"),
    ],
)
def test_bad_values_are_clear_errors(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match="^x: .*" + message.replace("(", r"\(")):
        spec_from_dict({**MISTRAL_7B, **change}, "m", "x")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


@given(
    st.dictionaries(
        st.sampled_from([*MISTRAL_7B, "head_dim", "text_config", "num_local_experts", "dtype"]),
        json_values,
    )
)
def test_any_config_gives_a_spec_or_a_model_config_error(config: dict[str, Any]) -> None:
    try:
        spec = spec_from_dict(config, "m", "cfg.json")
    except ModelConfigError as exc:
        assert str(exc).startswith("cfg.json: ")
        return
    assert spec.params_b > 0 and spec.kv_bytes_per_token > 0
    assert 0 < spec.max_output_tokens <= spec.max_context


@given(st.fixed_dictionaries({f: st.integers(-3, 2**20) for f in REQUIRED}))
def test_integer_fields_are_checked(values: dict[str, int]) -> None:
    try:
        spec = spec_from_dict({**values, "num_key_value_heads": 1}, "m", "x")
    except ModelConfigError:
        assert min(values.values()) <= 0 or values["hidden_size"] < values["num_attention_heads"]
        return
    assert spec.n_layers == values["num_hidden_layers"]


def test_hugging_face_cache_layout(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--mistralai--Mistral-7B-v0.1"
    old = _write(repo / "snapshots" / "aaa", {**MISTRAL_7B, "max_position_embeddings": 8})
    new = _write(repo / "snapshots" / "bbb", MISTRAL_7B)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbb\n")
    assert find_config(repo) == new / "config.json"
    spec = spec_from_config(repo)
    assert spec.name == "mistralai/Mistral-7B-v0.1" and spec.max_context == 32768
    assert spec_from_config(old / "config.json").max_context == 8  # a snapshot named directly
    (repo / "refs" / "main").unlink()
    with pytest.raises(ModelConfigError, match="2 snapshots and no refs/main"):
        find_config(repo)


def test_paths_that_hold_no_config(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="no such file or directory"):
        spec_from_config(tmp_path / "absent")
    with pytest.raises(ModelConfigError, match="no config.json there"):
        spec_from_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ModelConfigError, match="config.json: not JSON"):
        spec_from_config(tmp_path)


def test_model_config_argument(tmp_path: Path) -> None:
    _write(tmp_path / "my-model", MISTRAL_7B)
    assert parse_model_config_arg(str(tmp_path / "my-model")).name == "my-model"
    assert parse_model_config_arg(f"custom={tmp_path / 'my-model'}").name == "custom"
    with pytest.raises(ModelConfigError, match="expected NAME=PATH or PATH"):
        parse_model_config_arg("custom=")


def test_models_file_mixes_written_specs_and_configs(tmp_path: Path) -> None:
    _write(tmp_path / "weights" / "m7", MISTRAL_7B)
    written = {
        "name": "tiny",
        "params_b": 0.001,
        "n_layers": 2,
        "hidden_size": 64,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 16,
        "max_context": 512,
        "max_output_tokens": 256,
    }
    models = tmp_path / "models.json"
    models.write_text(
        json.dumps([written, {"name": "m7", "config": "weights/m7", "max_output_tokens": 4096}])
    )
    catalog = ModelCatalog.from_file(models)
    assert {"tiny", "m7", "mistral-7b"} <= set(catalog.names())
    assert catalog.get("m7").max_output_tokens == 4096 and catalog.get("tiny").dtype_bytes == 2
    # a model directory or a config.json is a models file of one model
    assert [s.name for s in load_models_file(tmp_path / "weights" / "m7")] == ["m7"]
    assert [s.name for s in load_models_file(tmp_path / "weights" / "m7" / "config.json")] == ["m7"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "not JSON"),
        ("3", "expected a JSON list of models"),
        ("[3]", "entry 0: expected a JSON object"),
        ('[{"name": "x"}]', "entry 0: missing params_b, n_layers"),
        ('[{"name": "x", "params": 7}]', "entry 0: unknown fields ['params']"),
        ('[{"name": "x", "config": "nowhere"}]', "no such file or directory"),
        ('[{"name": "x", "config": "m", "n_layers": 3}]', "takes name and max_output_tokens only"),
        ('[{"name": "x", "config": "m", "max_output_tokens": 0}]', "max_output_tokens must be"),
        ('[{"config": "m"}, {"config": "m"}]', "['m'] defined more than once"),
    ],
)
def test_bad_models_files_name_file_and_entry(tmp_path: Path, content: str, message: str) -> None:
    _write(tmp_path / "m", MISTRAL_7B)
    path = tmp_path / "models.json"
    path.write_text(content)
    with pytest.raises(ModelConfigError) as err:
        load_models_file(path)
    assert message in str(err.value)
    assert str(path) in str(err.value) or "nowhere" in str(err.value)


def test_written_spec_with_a_bad_value(tmp_path: Path) -> None:
    entry = dict(
        name="x",
        params_b=-1,
        n_layers=2,
        hidden_size=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        max_context=512,
        max_output_tokens=256,
    )
    path = tmp_path / "models.json"
    path.write_text(json.dumps([entry]))
    with pytest.raises(ModelConfigError, match="entry 0: params_b must be positive"):
        load_models_file(path)


# --- the command line ------------------------------------------------------------------------


def test_cli_loads_model_configs_and_registers_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qlm.cli import _catalog
    from qlm.config import Settings
    from qlm.engine_model import get_profile

    _write(tmp_path / "from-env", MISTRAL_7B)
    _write(tmp_path / "from-flag", LLAMA_2_13B)
    monkeypatch.setenv("QLM_MODEL_CONFIGS", f"env-model={tmp_path / 'from-env'}")
    saved = dict(MODELS)
    try:
        catalog = _catalog(Settings(), [str(tmp_path / "from-flag")])
        assert {"env-model", "from-flag", "mistral-7b"} <= set(catalog.names())
        # known process-wide: the sim engine and the planner time it like a built-in
        assert get_profile("H200", "from-flag").model.n_kv_heads == 40
    finally:
        MODELS.clear()
        MODELS.update(saved)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["coordinator", "--model-config", "nowhere"], "nowhere: no such file or directory"),
        (["agent", "--model-config", "{bad}"], "missing num_hidden_layers"),
        (["agent", "--gpu-table", "{table}"], "GPU 'X': pcie_gbs: Field required"),
    ],
)
def test_cli_refuses_bad_model_configs_and_gpu_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    from typer.testing import CliRunner

    import qlm.cli
    from qlm.cli import app

    # no process-wide logging set-up (nor GC-pause hooks) from inside the test session
    monkeypatch.setattr(qlm.cli, "_setup_logging", lambda s, component: None)
    _write(tmp_path / "bad", {"model_type": "llama"})
    (tmp_path / "gpus.yaml").write_text("X: {memory_gb: 1, mem_bw_gbs: 1, bf16_tflops: 1}\n")
    args = [a.format(bad=tmp_path / "bad", table=tmp_path / "gpus.yaml") for a in args]
    # wide enough that the error box does not wrap the message (it holds a tmp path whose
    # length varies from run to run)
    result = CliRunner().invoke(app, args, env={"QLM_ADMIN_TOKEN": "t" * 32, "COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
