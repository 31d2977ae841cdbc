"""The engine performance model: physical sanity, calibration, profiles."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.catalog import GPUS, MODELS, ModelSpec
from qlm.engine_model import (
    KV_BLOCK_TOKENS,
    EngineProfile,
    InsufficientMemoryError,
    get_profile,
    profile_from_dict,
    profile_to_dict,
)

# meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128.
LLAMA_3_1_8B = ModelSpec("llama-3.1-8b", 8.03, 32, 4096, 32, 8, 128, 131072, 4096)

# NVIDIA aiconfigurator 0.12.0, vLLM backend, h100_sxm, TP1 (/work/shared/reference/
# infrastructure.md section 6): batch-1 TTFT by input length; TPOT by batch at input 1024,
# output 128 (mean context during decode: 1024 + 64).
AICONFIGURATOR_PREFILL_S = {128: 7.6e-3, 512: 12.0e-3, 2048: 43.5e-3, 8192: 199.7e-3}
AICONFIGURATOR_DECODE_S = {1: 6.2e-3, 8: 6.6e-3, 32: 8.4e-3, 128: 13.1e-3}
DECODE_CONTEXT = 1024 + 64
TOLERANCE = 0.25

ALL_PROFILES = [get_profile(g, m) for g in GPUS for m in MODELS]


@pytest.fixture(scope="module")
def h100_llama8b() -> EngineProfile:
    return EngineProfile(gpu=GPUS["H100-80GB"], model=LLAMA_3_1_8B)


@pytest.mark.parametrize("n_tokens,measured", sorted(AICONFIGURATOR_PREFILL_S.items()))
def test_prefill_matches_aiconfigurator(
    h100_llama8b: EngineProfile, n_tokens: int, measured: float
) -> None:
    predicted = h100_llama8b.prefill_time(n_tokens)
    assert abs(predicted / measured - 1) <= TOLERANCE, (n_tokens, predicted, measured)


@pytest.mark.parametrize("batch,measured", sorted(AICONFIGURATOR_DECODE_S.items()))
def test_decode_matches_aiconfigurator(
    h100_llama8b: EngineProfile, batch: int, measured: float
) -> None:
    predicted = h100_llama8b.decode_iteration_time(batch, DECODE_CONTEXT)
    assert abs(predicted / measured - 1) <= TOLERANCE, (batch, predicted, measured)


def test_calibration_rms_error_is_small(h100_llama8b: EngineProfile) -> None:
    log_errors = [
        math.log(h100_llama8b.prefill_time(n) / t) for n, t in AICONFIGURATOR_PREFILL_S.items()
    ] + [
        math.log(h100_llama8b.decode_iteration_time(b, DECODE_CONTEXT) / t)
        for b, t in AICONFIGURATOR_DECODE_S.items()
    ]
    rms = math.sqrt(sum(e * e for e in log_errors) / len(log_errors))
    assert rms < 0.10


profiles = st.sampled_from(ALL_PROFILES)


@settings(max_examples=200, deadline=None)
@given(profile=profiles, n=st.integers(1, 32_000), extra=st.integers(1, 4_000))
def test_prefill_time_increases_with_tokens(profile: EngineProfile, n: int, extra: int) -> None:
    assert 0 < profile.prefill_time(n) < profile.prefill_time(n + extra)


@settings(max_examples=200, deadline=None)
@given(
    profile=profiles,
    batch=st.integers(1, 256),
    more_batch=st.integers(0, 64),
    context=st.integers(1, 8_192),
    more_context=st.integers(0, 4_096),
)
def test_decode_time_non_decreasing_in_batch_and_context(
    profile: EngineProfile, batch: int, more_batch: int, context: int, more_context: int
) -> None:
    base = profile.decode_iteration_time(batch, context)
    assert base > 0
    assert profile.decode_iteration_time(batch + more_batch, context) >= base
    assert profile.decode_iteration_time(batch, context + more_context) >= base


@settings(max_examples=200, deadline=None)
@given(
    profile=profiles,
    prefill=st.integers(1, 8_192),
    batch=st.integers(1, 256),
    context=st.integers(1, 4_096),
)
def test_mixed_iteration_shares_one_weight_pass(
    profile: EngineProfile, prefill: int, batch: int, context: int
) -> None:
    alone_prefill = profile.prefill_time(prefill)
    alone_decode = profile.decode_iteration_time(batch, context)
    mixed = profile.iteration_time(prefill, batch, batch * context)
    assert max(alone_prefill, alone_decode) <= mixed < alone_prefill + alone_decode


@settings(max_examples=100, deadline=None)
@given(profile=profiles, batch=st.integers(1, 255), context=st.integers(1, 4_096))
def test_throughput_grows_with_batch(profile: EngineProfile, batch: int, context: int) -> None:
    assert profile.token_throughput(batch + 1, context) > profile.token_throughput(batch, context)


def test_decode_is_memory_bound_and_prefill_compute_bound(h100_llama8b: EngineProfile) -> None:
    # Doubling a small decode batch barely moves the step time; doubling a long prompt
    # nearly doubles it.
    assert h100_llama8b.decode_iteration_time(2, 512) / h100_llama8b.decode_iteration_time(
        1, 512
    ) == pytest.approx(1.0, abs=0.02)
    assert h100_llama8b.prefill_time(8192) / h100_llama8b.prefill_time(4096) > 1.9


def test_attention_term_uses_the_given_pairs(h100_llama8b: EngineProfile) -> None:
    # 16 prompts of 512 tokens attend to far fewer pairs than one 8192-token prompt.
    one_sequence = h100_llama8b.iteration_time(8192, 0, 0)
    sixteen = h100_llama8b.iteration_time(8192, 0, 0, prefill_attention_pairs=16 * 512 * 513 / 2)
    assert sixteen < one_sequence


@pytest.mark.parametrize("gpu", ["A100-80GB", "H100-80GB"])
@pytest.mark.parametrize("model", ["mistral-7b", "vicuna-13b"])
def test_kv_capacity_positive_on_one_gpu(gpu: str, model: str) -> None:
    profile = get_profile(gpu, model, tp=1)
    assert profile.kv_capacity_tokens > 0
    assert profile.kv_capacity_tokens % KV_BLOCK_TOKENS == 0
    # Capacity is what is left after weights and the reserve, in KV bytes per token.
    used = profile.kv_capacity_tokens * profile.kv_bytes_per_token + profile.model.weight_bytes
    assert used <= profile.gpu_memory_utilization * profile.gpu.memory_gb * 1e9


@pytest.mark.parametrize("gpu", ["A10", "A100-80GB", "H100-80GB"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_70b_fits_with_tensor_parallelism(gpu: str, tp: int) -> None:
    if gpu == "A10" and tp < 8:
        with pytest.raises(InsufficientMemoryError):
            get_profile(gpu, "llama-2-70b", tp=tp)
        return
    profile = get_profile(gpu, "llama-2-70b", tp=tp)
    assert profile.kv_capacity_tokens > 0
    assert profile.weights_bytes_per_gpu == pytest.approx(138e9 / tp)


def test_70b_on_one_a10_is_a_clear_error() -> None:
    with pytest.raises(InsufficientMemoryError, match=r"llama-2-70b on 1xA10.*larger tp"):
        get_profile("A10", "llama-2-70b", tp=1)


def test_more_tp_means_more_kv_and_faster_decode() -> None:
    tp1 = get_profile("A100-80GB", "vicuna-13b", tp=1)
    tp2 = get_profile("A100-80GB", "vicuna-13b", tp=2)
    assert tp2.kv_capacity_tokens > 2 * tp1.kv_capacity_tokens
    speedup = tp1.decode_iteration_time(8, 1024) / tp2.decode_iteration_time(8, 1024)
    assert 1.2 < speedup < 2.0  # all-reduces and the fixed overhead do not shrink


@pytest.mark.parametrize(
    "gpu,model,tp",
    [
        ("A10", "mistral-7b", 1),
        ("A10", "vicuna-13b", 2),
        ("A10", "llama-2-70b", 8),
        ("A100-80GB", "vicuna-13b", 1),
        ("A100-80GB", "llama-2-70b", 2),
        ("H100-80GB", "tiny-llama", 1),
    ],
)
def test_get_profile_picks_smallest_tp_holding_a_full_context(
    gpu: str, model: str, tp: int
) -> None:
    profile = get_profile(gpu, model)
    assert profile.tp == tp
    assert profile.kv_capacity_tokens >= profile.model.max_context


def test_kv_heads_are_replicated_beyond_their_count() -> None:
    two_kv_heads = ModelSpec("gqa-2", 1.0, 4, 1024, 8, 2, 128, 4096, 1024)
    profile = EngineProfile(gpu=GPUS["A100-80GB"], model=two_kv_heads, tp=4)
    assert profile.kv_bytes_per_token == 2 * two_kv_heads.kv_bytes_per_token
    assert EngineProfile(GPUS["A100-80GB"], two_kv_heads, tp=2).kv_bytes_per_token == (
        two_kv_heads.kv_bytes_per_token
    )


def test_tp_must_divide_heads() -> None:
    with pytest.raises(ValueError, match="divide"):
        EngineProfile(gpu=GPUS["A100-80GB"], model=MODELS["vicuna-13b"], tp=3)


def test_load_and_transfer_times() -> None:
    profile = get_profile("A100-80GB", "mistral-7b")
    cold, warm = profile.load_time_from_disk(), profile.load_time_from_cpu()
    assert cold > 5 * warm > 0
    # Warm start is a PCIe copy of the per-GPU shard: halving the shard shortens it.
    tp2 = get_profile("A100-80GB", "mistral-7b", tp=2)
    assert tp2.load_time_from_cpu() < warm
    assert profile.kv_transfer_time(0) == 0
    assert profile.kv_transfer_time(2000) == pytest.approx(2 * profile.kv_transfer_time(1000))
    # Swapping 1000 tokens of KV over PCIe is cheaper than recomputing them.
    assert profile.kv_transfer_time(1000) < profile.recompute_time(1000)
    assert profile.recompute_time(1000) == profile.prefill_time(1000)


def test_profile_round_trips_through_json() -> None:
    profile = get_profile("A10", "vicuna-13b")
    restored = profile_from_dict(json.loads(json.dumps(profile_to_dict(profile))))
    assert restored == profile
    assert restored.prefill_time(777) == profile.prefill_time(777)


def test_measured_profile_overrides_roofline() -> None:
    data = profile_to_dict(get_profile("A100-80GB", "mistral-7b"))
    data.update(
        gpu="A100-80GB",
        model="mistral-7b",
        source="measured:vllm-0.33 a100 2026-01-01",
        prefill_mfu=0.5,
        measured_kv_capacity_tokens=123_456,
        measured_load_from_cpu_s=1.5,
    )
    measured = profile_from_dict(data)
    roofline = get_profile("A100-80GB", "mistral-7b")
    assert measured.kv_capacity_tokens == 123_456
    assert measured.load_time_from_cpu() == 1.5
    assert measured.load_time_from_disk() == roofline.load_time_from_disk()
    assert measured.prefill_time(4096) > roofline.prefill_time(4096)


def test_profile_rejects_bad_fields() -> None:
    data = profile_to_dict(get_profile("A100-80GB", "mistral-7b"))
    with pytest.raises(ValueError, match="unknown engine profile fields"):
        profile_from_dict({**data, "turbo": True})
    with pytest.raises(ValueError, match="source"):
        profile_from_dict({**data, "source": "guess"})
    with pytest.raises(ValueError, match="prefill_mfu"):
        replace(get_profile("A100-80GB", "mistral-7b"), prefill_mfu=1.5)
    with pytest.raises(ValueError, match="must be >= 0"):
        get_profile("A100-80GB", "mistral-7b").iteration_time(-1, 0, 0)


def test_get_profile_uses_vllm_batch_defaults_per_gpu() -> None:
    h100 = get_profile("H100-80GB", "mistral-7b")
    assert (h100.max_num_batched_tokens, h100.max_batch_size) == (8192, 1024)
    for gpu in ("A100-80GB", "A10"):  # A100 is excluded from the large defaults by name
        profile = get_profile(gpu, "mistral-7b")
        assert (profile.max_num_batched_tokens, profile.max_batch_size) == (2048, 256)
    assert get_profile("H100-80GB", "mistral-7b", max_num_seqs=64).max_batch_size == 64
