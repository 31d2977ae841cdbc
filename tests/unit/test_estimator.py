"""RCT estimator (§6): the equations against hand calculations, the max of n, validation."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.engine_model import get_profile
from qlm.estimator import (
    HardwareProfile,
    OutputLengthModel,
    RCTEstimator,
    hardware_profile,
    max_normal_moments,
    max_normal_quantile,
)
from qlm.planner.baselines import EDFPolicy
from qlm.planner.stochastic import QLMPolicy
from qlm.policy import PlanInstance, PlanRequest

HW = hardware_profile("A100-80GB", "mistral-7b", 400_000, 256, 512)


def test_profile_follows_the_engine_model() -> None:
    ep = get_profile("A100-80GB", "mistral-7b")
    assert HW.decode_token_s == pytest.approx(ep.decode_iteration_time(1, 512))
    assert HW.token_time_s == pytest.approx(ep.decode_iteration_time(HW.batch, 512))
    assert HW.throughput_tps == pytest.approx(ep.token_throughput(HW.batch, 512))
    assert HW.inefficiency >= 1.0
    assert HW.load_cold_s == pytest.approx(ep.load_time_from_disk())
    assert HW.load_warm_s == pytest.approx(ep.load_time_from_cpu())
    assert HW.load_warm_s < HW.load_cold_s
    assert HW.prefill_s(ep.max_num_batched_tokens) == pytest.approx(
        ep.prefill_time(ep.max_num_batched_tokens)
    )


@pytest.mark.parametrize("field", ["throughput_tps", "load_cold_s", "decode_token_s"])
@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_bad_profile_values_are_rejected(field: str, bad: float) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(HW, **{field: bad})


def test_single_request_hand_calculation() -> None:
    """n = 1: occupancy = prompt/Π + μ/Θ (eq. 2); completion = P + μ·ε·d (eqs. 1, 4)."""
    occ_m, occ_v, own_m, own_v = RCTEstimator.group_moments(HW, 1, 200, 100, 400)
    assert occ_m == pytest.approx(200 / HW.prefill_tps + 100 / HW.throughput_tps)
    assert occ_v == pytest.approx(400 / HW.throughput_tps**2)
    assert own_m == pytest.approx(
        HW.prefill_fixed_s + 200 * HW.prefill_s_per_token + 100 * HW.token_time_s
    )
    assert own_v == pytest.approx((HW.token_time_s * 20) ** 2)
    est = RCTEstimator().estimate_group(
        HW,
        n=1,
        prompt_sum=200,
        out_mean_sum=100,
        out_var_sum=400,
        ahead_tokens_mean=1000,
        ahead_tokens_var=0,
        switch_s=2.0,
    )
    assert est.waiting.mean == pytest.approx(1000 / HW.throughput_tps + 2.0)
    assert est.completion.mean == pytest.approx(est.waiting.mean + own_m)
    assert est.completion_quantiles[0.5] == pytest.approx(est.completion.mean)
    assert est.completion_quantiles[0.9] > est.completion.mean


def test_max_of_n_known_values_and_monotone() -> None:
    mean, var = max_normal_moments(np.array([1, 2, 10, 1000]))
    assert mean[0] == 0 and var[0] == 1
    assert mean[1] == pytest.approx(0.564, abs=0.05)  # E[max of 2 N(0,1)] = 1/sqrt(pi)
    assert mean[2] == pytest.approx(1.539, abs=0.02)
    assert np.all(np.diff(mean) > 0) and np.all(np.diff(var) < 0)
    q = max_normal_quantile(0.9, np.array([1, 2, 10, 100]))
    assert q[0] == pytest.approx(1.2816, abs=1e-3) and np.all(np.diff(q) > 0)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 2000), mu=st.floats(1, 2000), cv=st.floats(0, 2), ahead=st.floats(0, 1e6))
def test_group_completion_is_the_max_not_the_mean(
    n: int, mu: float, cv: float, ahead: float
) -> None:
    """A group finishes no earlier than one of its members alone, and later behind more work."""
    var = (cv * mu) ** 2
    est = RCTEstimator()
    one = est.estimate_group(
        HW,
        n=1,
        prompt_sum=100,
        out_mean_sum=mu,
        out_var_sum=var,
        ahead_tokens_mean=ahead,
        ahead_tokens_var=0,
    )
    grp = est.estimate_group(
        HW,
        n=n,
        prompt_sum=100 * n,
        out_mean_sum=mu * n,
        out_var_sum=var * n,
        ahead_tokens_mean=ahead,
        ahead_tokens_var=0,
    )
    later = est.estimate_group(
        HW,
        n=n,
        prompt_sum=100 * n,
        out_mean_sum=mu * n,
        out_var_sum=var * n,
        ahead_tokens_mean=ahead + 500,
        ahead_tokens_var=0,
    )
    assert grp.completion.mean >= one.completion.mean - 1e-9
    assert later.completion.mean > grp.completion.mean
    assert grp.completion_quantiles[0.99] >= grp.completion_quantiles[0.5]


def test_output_lengths_prior_truncation_and_online_update() -> None:
    m = OutputLengthModel("sharegpt", prior_weight=10)
    mean, var = m.predict("x", None, np.array([1, 50, 100_000]))
    assert mean[0] == 1 and var[0] == 0  # max_tokens=1 leaves no doubt
    assert mean[1] <= 50 and mean[2] > mean[1] and var[2] > 0
    for _ in range(1000):
        m.observe("x", "chat", 7)
    learned, lvar = m.predict("x", "chat", np.array([100_000]))
    assert learned[0] < 0.05 * mean[2] + 7 and m.history_size("x", "chat") == 1000
    assert m.predict("x", "other", np.array([100_000]))[0][0] == pytest.approx(mean[2])
    worst = OutputLengthModel("max_tokens").predict("x", None, np.array([300]))
    assert worst[0][0] == 300 and worst[1][0] == 0
    with pytest.raises(ValueError):
        OutputLengthModel("nope")
    with pytest.raises(ValueError):
        m.observe("x", None, -1)


def test_preemption_mode_follows_insight_2() -> None:
    assert HW.preemption_mode(2000, None) in {"swap", "evict"}
    assert HW.preemption_mode(2000, cpu_free_bytes=0.0) == "evict"
    slow_link = dataclasses.replace(HW, kv_transfer_s_per_token=1.0)
    assert slow_link.preemption_mode(2000, None) == "evict"
    fast_link = dataclasses.replace(HW, kv_transfer_s_per_token=0.0)
    assert fast_link.preemption_mode(2000, None) == "swap"
    assert isinstance(HW, HardwareProfile) and math.isfinite(HW.recompute_s_per_token)


def test_the_batch_actually_run_and_the_prefill_it_carries() -> None:
    """The KV share the agent fills gives a smaller batch than the whole cache (hence a
    faster token, a lower throughput); the prompt chunks interleaved with the decode add
    the mixed iteration's extra over a pure decode one (the roofline), less than a whole
    prefill's time per chunk."""
    ep = get_profile("A100-80GB", "mistral-7b")
    full = hardware_profile("A100-80GB", "mistral-7b", 469_664, 256, 2355)
    filled = hardware_profile("A100-80GB", "mistral-7b", 469_664, 256, 2355, 0.0, 0.9)
    assert filled.batch == int(469_664 * 0.9) // 2355 < full.batch
    assert filled.token_time_s < full.token_time_s
    assert filled.throughput_tps < full.throughput_tps
    mixed = hardware_profile("A100-80GB", "mistral-7b", 469_664, 256, 2355, 4.6, 0.9)
    b = mixed.batch
    chunk = ep.max_num_batched_tokens - b
    decode = ep.decode_iteration_time(b, 2355)
    extra = ep.iteration_time(chunk, b, b * 2355) - decode
    assert mixed.token_time_s == pytest.approx(decode + b * 4.6 / chunk * extra)
    linear = b * 4.6 * ep.prefill_time(ep.max_num_batched_tokens) / ep.max_num_batched_tokens
    assert filled.token_time_s < mixed.token_time_s < decode + linear


def test_the_history_stays_sorted_without_resorting() -> None:
    """Observations update the sorted sample in place (a window of 50 here): predictions equal
    those of a sample rebuilt from scratch."""
    rng = np.random.default_rng(3)
    model = OutputLengthModel("max_tokens", prior_weight=0.0, history_limit=50)
    window: list[float] = []
    caps = np.array([10.0, 300.0, 5000.0])
    for i in range(400):
        value = int(rng.integers(1, 1000))
        model.observe("m", None, value)
        window = [*window, float(value)][-50:]
        if i % 3 == 0:
            fresh = OutputLengthModel("max_tokens", prior_weight=0.0, history_limit=50)
            for v in window:
                fresh.observe("m", None, int(v))
            got, want = model.predict("m", None, caps), fresh.predict("m", None, caps)
            # the window, sorted: the values moved in place equal a sort of the window
            np.testing.assert_array_equal(model._samples[("m", None)].values, sorted(window))
            np.testing.assert_allclose(got[0], want[0])
            np.testing.assert_allclose(got[1], want[1], atol=1e-6)
    bound = model.upper_bound("m", None, caps, 0.9)
    assert (bound <= caps).all() and bound[2] > model.predict("m", None, caps)[0][2]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 5000), min_size=1, max_size=300),
    st.lists(st.integers(1, 6000), min_size=1, max_size=4),
    st.integers(1, 64),
)
def test_one_caps_prediction_between_completions_is_the_rebuilt_samples_to_the_bit(
    outputs: list[int], caps: list[int], window: int
) -> None:
    """place() prices each arrival at its one cap between completions from running totals of
    the window (whole token counts: exact sums), not rebuilt prefix sums: the same floats as a
    sample rebuilt from the window, and mean_and_bounds_at() (one request, Python floats) as
    predict() and upper_bound()."""
    model = OutputLengthModel("sharegpt", history_limit=window)
    for k, out in enumerate(outputs):
        model.observe("m", "c", out)
        if k % 7 and k != len(outputs) - 1:
            continue
        fresh = OutputLengthModel("sharegpt", history_limit=window)
        for v in outputs[max(0, k + 1 - window) : k + 1]:
            fresh.observe("m", "c", v)
        for cap in caps:
            one = np.array([float(cap)])
            got, want = model.predict("m", "c", one), fresh.predict("m", "c", one)
            assert got[0][0] == want[0][0] and got[1][0] == want[1][0]
            at, (a90, a05) = model.mean_and_bounds_at("m", "c", cap, [0.9, 0.05])
            assert at == got[0][0]
            assert a90 == model.upper_bound("m", "c", one, 0.9)[0]
            assert a05 == model.upper_bound("m", "c", one, 0.05)[0]
        several = np.array([float(c) for c in caps])
        got, want = model.predict("m", "c", several), fresh.predict("m", "c", several)
        assert (got[0] == want[0]).all() and (got[1] == want[1]).all()
    assert model.version == len(outputs) and model.per_group


def test_place_keeps_an_arrivals_lengths_only_until_a_completion_is_learnt() -> None:
    pol = QLMPolicy()
    r = PlanRequest("r", "m", 100, 1024, 0.0, 30.0, None, slo_class="c")
    lengths = pol.estimator.lengths
    first = pol._lengths_of(r)
    assert pol._lengths_of(r) == first  # kept
    for out in (20, 30, 40) * 20:
        lengths.observe("m", "c", out)
    learnt = pol._lengths_of(r)
    assert learnt[0] < first[0]  # short answers seen: a new fit
    cap = np.array([1024.0])
    mean, _ = lengths.predict("m", "c", cap)
    bound = float(lengths.upper_bound("m", "c", cap, pol._feasible_q)[0])
    shot = float(lengths.upper_bound("m", "c", cap, 0.05)[0])
    assert learnt == (float(mean[0]), bound, min(shot, bound))


def test_the_odds_gates_moments_are_kept_only_until_a_completion_is_learnt() -> None:
    pol = QLMPolicy()
    r = PlanRequest("r", "m", 100, 1024, 0.0, 30.0, None, slo_class="c")
    lengths = pol.estimator.lengths
    cap = np.array([1024.0])
    for out in (200, 300, 400) * 20:
        lengths.observe("m", "c", out)
    first = pol._length_moments(r)
    mean, var = lengths.predict("m", "c", cap, prompt_tokens=np.array([100.0]))
    assert first == (float(mean[0]), float(var[0]))  # the prediction, to the bit
    assert pol._length_moments(r) is first  # kept
    pol._lengths_of(r)  # the other answers kept per group do not clear it
    assert pol._length_moments(r) is first
    lengths.observe("m", "c", 1000)
    learnt = pol._length_moments(r)
    mean, var = lengths.predict("m", "c", cap, prompt_tokens=np.array([100.0]))
    assert learnt == (float(mean[0]), float(var[0])) and learnt[0] > first[0]


def test_a_model_that_prices_each_request_is_asked_each_time() -> None:
    from qlm.length_forest import ForestLengthModel

    forest = ForestLengthModel()
    assert not forest.per_group
    with pytest.raises(TypeError):
        forest.mean_and_bounds_at("m", "c", 100, [0.9])


# ------------------------------------------------------------------ estimates at dispatch
A100, MISTRAL = "A100-80GB", "mistral-7b"


def _instance(running: int, active: str | None = MISTRAL, **kw: object) -> PlanInstance:
    ep = get_profile(A100, MISTRAL)
    return PlanInstance(
        "i0",
        (MISTRAL, "vicuna-13b"),
        A100,
        ep.kv_capacity_tokens,
        ep.max_batch_size,
        active_model=active,
        running=running,
        **kw,  # type: ignore[arg-type]
    )


def test_estimate_dispatched_hand_calculation() -> None:
    """Eq. 1 with what is left at dispatch: the wait still ahead + P + μ·ε·d; variance
    (ε·d)²·σ² (the wait is known)."""
    got = RCTEstimator().estimate_dispatched(
        HW, prompt_tokens=200, out_mean=100, out_var=400, wait_s=3.0
    )
    assert got.mean == pytest.approx(3.0 + HW.prefill_s(200) + 100 * HW.token_time_s)
    assert got.var == pytest.approx(HW.token_time_s**2 * 400)


@pytest.mark.parametrize(("prompt", "max_tokens"), [(64, 1024), (500, 256), (2000, 400)])
def test_at_dispatch_alone_it_is_the_engine_models_solo_time(prompt: int, max_tokens: int) -> None:
    """Alone on an instance (the core counts it in ``running``), the estimate is the engine
    model's time for its prompt and predicted output at batch 1, to 2 %: the profile's
    prefill is the affine fit through 1 token and a full chunk, and eq. 4 counts the first
    token (the prefill's) as a decode step too."""
    policy = QLMPolicy()
    lengths = policy.estimator.lengths
    predicted = lengths.predict(MISTRAL, "batch", np.array([float(max_tokens)]))[0][0]
    assert predicted == max_tokens  # the default prior: the cap the client allowed
    request = PlanRequest("r", MISTRAL, prompt, max_tokens, 40.0, 400.0, None, slo_class="batch")
    ep = get_profile(A100, MISTRAL)
    solo = ep.prefill_time(prompt) + ep.decode_segment_time(1, prompt + 1, max_tokens - 1)
    at = policy.dispatch_estimate(request, _instance(running=1), now=50.0)
    assert at is not None
    assert at - 50.0 == pytest.approx(solo, rel=0.02)
    # the queue wait before dispatch is a fact: later dispatch, later completion, same rest
    later = policy.dispatch_estimate(request, _instance(running=1), now=80.0)
    assert later == pytest.approx(at + 30.0)


def test_at_dispatch_a_busy_instance_decodes_slower_and_another_model_drains_first() -> None:
    policy = QLMPolicy()
    request = PlanRequest("r", MISTRAL, 500, 256, 0.0, 400.0, None, slo_class="batch")
    alone = policy.dispatch_estimate(request, _instance(running=1), now=0.0)
    busy = policy.dispatch_estimate(request, _instance(running=150), now=0.0)
    capped = policy.dispatch_estimate(request, _instance(running=150, max_in_engine=8), now=0.0)
    other = policy.dispatch_estimate(request, _instance(running=4, active="vicuna-13b"), now=0.0)
    assert alone is not None and busy is not None and capped is not None and other is not None
    ep = get_profile(A100, MISTRAL)
    # it decodes in a batch of 150: 149 sequences of the mix (before any plan or completion:
    # 1,024 tokens of context, no prompts interleaved) and itself (its prompt + half its output)
    ctx = (149 * 1024 + 500 + 128) / 150
    in_batch = ep.prefill_time(500) + 256 * ep.decode_iteration_time(150, round(ctx))
    assert busy == pytest.approx(in_batch, rel=0.02)
    assert busy > 2 * alone
    assert alone < capped < busy  # the batch cap bounds the batch it decodes in
    # vicuna's 4 requests finish, then mistral loads from host memory, then it runs alone
    assert other > alone + ep.load_time_from_cpu()


def test_policies_without_an_estimator_make_no_estimate_at_dispatch() -> None:
    request = PlanRequest("r", MISTRAL, 500, 256, 0.0, 400.0, None)
    assert EDFPolicy().dispatch_estimate(request, _instance(running=1), now=0.0) is None
