"""The GPU table: the shipped data file, user extensions and their validation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import qlm.catalog as catalog
from qlm.catalog import GPU_ALIASES, GPUS, canonical_gpu, gpu, use_gpu_table
from qlm.engine_model import get_profile, profile_from_dict, profile_to_dict
from qlm.gpu_table import GPUTableError, load_gpu_table, shipped_gpu_table


@pytest.fixture
def restore_table() -> Iterator[None]:
    saved = (catalog._TABLE, dict(GPUS), dict(GPU_ALIASES))
    yield
    catalog._TABLE = saved[0]
    GPUS.clear()
    GPUS.update(saved[1])
    GPU_ALIASES.clear()
    GPU_ALIASES.update(saved[2])


def test_shipped_table_has_the_data_center_gpus_with_sources() -> None:
    names = {"A10", "L4", "L40S", "A100-40GB", "A100-80GB", "H100-80GB", "H200", "B200"}
    assert names <= set(GPUS)
    text = (Path(catalog.__file__).parent / "data" / "gpus.yaml").read_text()
    for name, entry in yaml.safe_load(text).items():
        assert "data sheet" in entry["source"], name
    assert gpu("H100") is GPUS["H100-80GB"] and canonical_gpu("A100") == "A100-80GB"
    assert canonical_gpu("cpu") == "cpu"  # not in the table: left as is


def test_figures_the_engine_model_was_fitted_with_are_unchanged() -> None:
    # docs/engine-model.md's fit and every benchmark use these; the table must not move them
    assert (GPUS["A10"].memory_gb, GPUS["A10"].bf16_tflops, GPUS["A10"].mem_bw_gbs) == (
        24.1,
        125,
        600,
    )
    assert GPUS["A100-80GB"].interconnect_gbs == 300 and GPUS["A100-80GB"].mem_bw_gbs == 2039
    h100 = GPUS["H100-80GB"]
    assert (h100.memory_gb, h100.bf16_tflops, h100.mem_bw_gbs, h100.pcie_gbs) == (
        85.9,
        989,
        3350,
        50,
    )
    assert h100.interconnect_gbs == 450 and GPUS["A10"].interconnect_gbs is None


def test_every_shipped_gpu_serves_a_catalog_model() -> None:
    for name in GPUS:
        assert get_profile(name, "mistral-7b").kv_capacity_tokens > 0, name
    h200, h100 = (get_profile(g, "llama-2-70b", tp=2) for g in ("H200", "H100-80GB"))
    # same compute, more and faster memory: a larger KV cache and faster decode steps
    assert h200.kv_capacity_tokens > 2 * h100.kv_capacity_tokens
    assert h200.decode_iteration_time(64, 1000) < h100.decode_iteration_time(64, 1000)


def test_user_table_adds_and_replaces_entries(tmp_path: Path, restore_table: None) -> None:
    path = tmp_path / "gpus.yaml"
    path.write_text(
        "MI300X:\n  memory_gb: 206\n  mem_bw_gbs: 5300\n  bf16_tflops: 1307\n  pcie_gbs: 50\n"
        "  interconnect_gbs: 448\n  aliases: [mi300x]\n"
        "A10:\n  memory_gb: 24.1\n  mem_bw_gbs: 600\n  bf16_tflops: 100\n  pcie_gbs: 25\n"
    )
    assert use_gpu_table(path) == ["A10", "MI300X"]
    assert gpu("mi300x").memory_gb == 206 and GPUS["A10"].bf16_tflops == 100
    assert gpu("H100").name == "H100-80GB"  # the shipped aliases stay
    assert get_profile("mi300x", "llama-2-70b").gpu.name == "MI300X"


def test_user_table_as_json(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    path.write_text('{"X1": {"memory_gb": 16, "mem_bw_gbs": 1, "bf16_tflops": 1, "pcie_gbs": 1}}')
    assert set(load_gpu_table(path).entries) == {"X1"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected a mapping"),
        ("- A10\n", "expected a mapping"),
        (
            "X: {memory_gb: 16, mem_bw_gbs: 1, bf16_tflops: 1}\n",
            "GPU 'X': pcie_gbs: Field required",
        ),
        (
            "X: {memory_gb: -1, mem_bw_gbs: 1, bf16_tflops: 1, pcie_gbs: 1}\n",
            "GPU 'X': memory_gb: Input should be greater than 0",
        ),
        (
            "X: {memory_gb: 1, mem_bw: 1, mem_bw_gbs: 1, bf16_tflops: 1, pcie_gbs: 1}\n",
            "GPU 'X': mem_bw: Extra inputs are not permitted",
        ),
        ("X: [1, 2\n", "not YAML or JSON (line"),
        (
            "X: {memory_gb: 1, mem_bw_gbs: 1, bf16_tflops: 1, pcie_gbs: 1, aliases: [H100]}\n",
            "alias 'H100' already names 'H100-80GB'",
        ),
        (
            "X: {memory_gb: 1, mem_bw_gbs: 1, bf16_tflops: 1, pcie_gbs: 1, aliases: [A10]}\n",
            "are GPU names and aliases at once",
        ),
    ],
)
def test_bad_user_tables_name_file_and_problem(
    tmp_path: Path, restore_table: None, text: str, message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(GPUTableError) as err:
        use_gpu_table(path)
    assert str(path) in str(err.value) and message in str(err.value)
    assert set(GPUS) == set(shipped_gpu_table().entries)  # nothing half-applied


def test_missing_user_table_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(GPUTableError, match="No such file"):
        load_gpu_table(tmp_path / "absent.yaml")


def test_old_profile_dicts_keep_their_nvlink() -> None:
    profile = get_profile("H100-80GB", "llama-2-70b", tp=4)
    data = profile_to_dict(profile)
    del data["gpu"]["interconnect_gbs"]  # a profile stored before the field existed
    assert profile_from_dict(data).gpu.interconnect_gbs == 450
    assert profile_from_dict(profile_to_dict(profile)) == profile
