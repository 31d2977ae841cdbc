"""Capacity planning (issue 8 item 2): SageServe's ILP on hand-checkable cases and against brute
force, the LT-I/LT-U/LT-UA modes, the reactive and CATO baselines, QLM's scale-up signal, bad
input, and the solve-time benchmark."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from qlm.capacity.forecast import TokenForecast
from qlm.planner.capacity.policies import (
    CAPACITY_POLICIES,
    CapacityObservation,
    CapacitySpec,
    CatoPolicy,
    Cell,
    InstanceProfile,
    PoolKey,
    ReactivePolicy,
    SageServePolicy,
    cato_counts_violation,
    create_capacity_policy,
    scale_up_from_plan,
    solve_capacity_ilp,
)
from qlm.tooling.capacity.bench import bench_capacity_ilp

M, P = "m", "p"
K = PoolKey(M, P)
A, B = Cell(M, "A100", P), Cell(M, "H100", P)


def spec(
    *,
    a_tpm: float = 1000.0,
    a_cost: float = 3.0,
    a_start: float = 600.0,
    b_tpm: float = 2500.0,
    b_cost: float = 6.0,
    b_start: float = 600.0,
    **kw: object,
) -> CapacitySpec:
    return CapacitySpec(
        profiles=(
            InstanceProfile(M, "A100", a_tpm, 1, a_start),
            InstanceProfile(M, "H100", b_tpm, 1, b_start),
        ),
        gpu_cost_per_hour={"A100": a_cost, "H100": b_cost},
        **kw,  # type: ignore[arg-type]
    )


def covered(s: CapacitySpec, targets: dict[Cell, int], key: PoolKey) -> float:
    total = 0.0
    for c, n in targets.items():
        p = s.profile(c.model, c.gpu_type)
        if (c.model, c.pool) == key and p is not None:
            total += n * p.tpm
    return total


def forecast(target: float, *, origin: float = 0.0, path: float | None = None) -> TokenForecast:
    v = target if path is None else path
    return TokenForecast(M, P, origin, (v,) * 60, peak_tpm=target, buffer_tpm=0.0, method="arima")


# ------------------------------------------------------------------------------------------ ILP


def test_cheapest_gpu_type_per_token_is_chosen() -> None:
    # 5,000 tpm: 2 × H100 = 12 $/h + 2 × 1 $ start-up = 14; 5 × A100 = 15 + 2.5; mixes cost more
    res = solve_capacity_ilp(spec(), {K: 5000.0}, {})
    assert res.status == "optimal"
    assert res.targets == {A: 0, B: 2}
    assert res.holding_cost == pytest.approx(12.0)
    assert res.startup_cost == pytest.approx(2.0)
    # same throughput, different price: the cheaper one, 3 of them for 2,500 tpm
    res = solve_capacity_ilp(spec(b_tpm=1000.0, b_cost=4.0), {K: 2500.0}, {})
    assert res.targets == {A: 3, B: 0}


def test_releases_what_the_demand_no_longer_needs() -> None:
    res = solve_capacity_ilp(spec(), {K: 1500.0}, {A: 5})
    assert res.status == "optimal"
    assert res.targets[A] == 2 and res.deltas[A] == -3 and res.targets[B] == 0
    assert res.startup_cost == 0.0


def test_startup_penalty_prevents_churn() -> None:
    # one H100 (6 $/h) holds 900 tpm; one A100 (3 $/h) would too. Swapping saves 3 $ over the
    # hour; it pays only when starting the A100 costs less than that
    cheap_start = solve_capacity_ilp(spec(a_start=600.0), {K: 900.0}, {B: 1})
    assert cheap_start.targets == {A: 1, B: 0}  # 3 + 0.5 < 6
    slow_start = solve_capacity_ilp(spec(a_start=7200.0), {K: 900.0}, {B: 1})
    assert slow_start.targets == {A: 0, B: 1}  # 3 + 6 > 6: keep what runs
    assert slow_start.deltas == {A: 0, B: 0}


def test_uncoverable_demand_is_a_capped_result_not_an_exception() -> None:
    s = spec(gpu_limits={("A100", P): 2, ("H100", P): 1})
    res = solve_capacity_ilp(s, {K: 10_000.0}, {})
    assert res.status == "capped"
    assert "capacity cap reached" in res.message
    assert res.targets == {A: 2, B: 1}  # everything the limits allow
    assert res.shortfall_tpm == {K: pytest.approx(10_000 - 4500)}
    assert res.to_dict()["shortfall_tpm"] == {"m/p": pytest.approx(5500.0)}


def test_contradictory_bounds_change_nothing() -> None:
    s = spec(gpu_limits={("A100", P): 1, ("H100", P): 0}, min_instances={K: 3})
    res = solve_capacity_ilp(s, {K: 100.0}, {A: 1})
    assert res.status == "infeasible"
    assert res.deltas == {A: 0, B: 0} and res.targets == {A: 1, B: 0}


def test_instance_bounds_are_respected() -> None:
    s = spec(min_instances={K: 2}, max_instances={K: 3})
    assert sum(solve_capacity_ilp(s, {K: 0.0}, {}).targets.values()) == 2
    capped = solve_capacity_ilp(s, {K: 100_000.0}, {})
    assert capped.status == "capped" and sum(capped.targets.values()) == 3


def test_scale_up_signal_forces_one_more_instance() -> None:
    plain = solve_capacity_ilp(spec(), {K: 500.0}, {A: 1})
    assert plain.targets == {A: 1, B: 0}
    forced = solve_capacity_ilp(spec(), {K: 500.0}, {A: 1}, scale_up={K: 1})
    assert forced.status == "optimal"
    assert sum(forced.targets.values()) == 2 and forced.targets[A] == 2  # cheapest step
    # no room for it: capped, and the unmet part is reported
    s = spec(gpu_limits={("A100", P): 1, ("H100", P): 0})
    res = solve_capacity_ilp(s, {K: 500.0}, {A: 1}, scale_up={K: 1})
    assert res.status == "capped" and res.unmet_scale_up == {K: 1}


def test_rerouting_share_epsilon() -> None:
    # ε = 0.5: pool p must cover half its 3,000 tpm locally (2 A100 allowed there), the rest
    # may be served from q
    q = PoolKey(M, "q")
    s = CapacitySpec(
        profiles=(InstanceProfile(M, "A100", 1000.0),),
        gpu_cost_per_hour={"A100": 3.0},
        gpu_limits={("A100", P): 2},
        epsilon=0.5,
    )
    res = solve_capacity_ilp(s, {K: 3000.0, q: 0.0}, {})
    assert res.status == "optimal"
    assert res.targets[A] * 1000 >= 1500
    assert sum(res.targets.values()) * 1000 >= 3000
    assert res.targets[Cell(M, "A100", "q")] >= 1
    assert res.shortfall_tpm == {}  # rerouted, not short
    # q capped too: the model's total is short, reported under the pool "*"
    s2 = CapacitySpec(
        profiles=s.profiles,
        gpu_cost_per_hour=s.gpu_cost_per_hour,
        gpu_limits={("A100", P): 2, ("A100", "q"): 0},
        epsilon=0.5,
    )
    capped = solve_capacity_ilp(s2, {K: 3000.0, q: 0.0}, {})
    assert capped.status == "capped"
    assert capped.shortfall_tpm == {PoolKey(M, "*"): pytest.approx(1000.0)}


@pytest.mark.parametrize(
    ("demand", "current", "match"),
    [
        ({K: -1.0}, {}, "finite rate"),
        ({K: math.nan}, {}, "finite rate"),
        ({K: 1.0}, {A: -1}, "non-negative integer"),
        ({K: 1.0}, {Cell(M, "TPU", P): 1}, "no profile"),
        ({PoolKey("other", P): 1.0}, {}, "no instance profile"),
    ],
)
def test_bad_input_is_a_value_error(demand: dict, current: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        solve_capacity_ilp(spec(), demand, current)


def test_bad_specs_are_rejected() -> None:
    with pytest.raises(ValueError, match="tpm"):
        InstanceProfile(M, "A100", 0.0)
    with pytest.raises(ValueError, match="gpu_cost_per_hour"):
        CapacitySpec(profiles=(InstanceProfile(M, "A100", 1.0),), gpu_cost_per_hour={})
    with pytest.raises(ValueError, match="epsilon"):
        spec(epsilon=0.0)
    with pytest.raises(ValueError, match="bounds"):
        spec(min_instances={K: 3}, max_instances={K: 2})


def brute_force(s: CapacitySpec, demand: float, cur: dict[Cell, int]) -> float:
    best = math.inf
    for a, b in itertools.product(range(28), repeat=2):  # 27 × 300 tpm ≥ the 8,000 drawn
        if a * s.profiles[0].tpm + b * s.profiles[1].tpm < demand:
            continue
        tg = {A: a, B: b}
        cost = 0.0
        for c, prof in ((A, s.profiles[0]), (B, s.profiles[1])):
            cost += s.cost_per_hour(prof) * tg[c] + s.startup_cost(prof) * max(
                0, tg[c] - cur.get(c, 0)
            )
        best = min(best, cost)
    return best


@settings(max_examples=40, deadline=None)
@given(
    a_tpm=st.floats(300, 3000),
    b_tpm=st.floats(300, 3000),
    a_cost=st.floats(1, 10),
    b_cost=st.floats(1, 10),
    a_start=st.floats(0, 7200),
    demand=st.floats(0, 8000),
    cur_a=st.integers(0, 5),
    cur_b=st.integers(0, 5),
)
def test_ilp_matches_brute_force_and_covers_demand(
    a_tpm: float,
    b_tpm: float,
    a_cost: float,
    b_cost: float,
    a_start: float,
    demand: float,
    cur_a: int,
    cur_b: int,
) -> None:
    # rates in (0, 1e-3) tpm sit at the solver's feasibility tolerance: not a real demand
    assume(demand == 0 or demand >= 1e-3)
    s = spec(a_tpm=a_tpm, b_tpm=b_tpm, a_cost=a_cost, b_cost=b_cost, a_start=a_start)
    cur = {A: cur_a, B: cur_b}
    res = solve_capacity_ilp(s, {K: demand}, cur)
    assert res.status == "optimal"
    assert all(n >= 0 for n in res.targets.values())
    assert all(res.targets[c] == cur.get(c, 0) + res.deltas[c] for c in res.targets)
    assert covered(s, res.targets, K) >= demand - 1e-6
    # the search stops within 0.1 % of the whole cost
    assert res.objective == pytest.approx(brute_force(s, demand, cur), rel=1.1e-3, abs=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    demands=st.lists(st.floats(0, 20_000), min_size=2, max_size=2),
    limit_a=st.integers(0, 12),
    limit_b=st.integers(0, 4),
    cur=st.lists(st.integers(0, 3), min_size=4, max_size=4),
)
def test_ilp_respects_limits_and_reports_shortfall(
    demands: list[float], limit_a: int, limit_b: int, cur: list[int]
) -> None:
    pools = ("p", "q")
    s = spec(
        gpu_limits={("A100", p): limit_a for p in pools} | {("H100", p): limit_b for p in pools}
    )
    current = {
        Cell(M, g, p): min(n, limit_a if g == "A100" else limit_b)
        for (g, p), n in zip(itertools.product(("A100", "H100"), pools), cur, strict=True)
    }
    demand = {PoolKey(M, p): d for p, d in zip(pools, demands, strict=True)}
    res = solve_capacity_ilp(s, demand, current)
    assert res.status in ("optimal", "capped")
    for p in pools:
        assert res.targets[Cell(M, "A100", p)] <= limit_a
        assert res.targets[Cell(M, "H100", p)] <= limit_b
        assert min(res.targets.values()) >= 0
        got = covered(s, res.targets, PoolKey(M, p))
        if res.status == "optimal":
            assert got >= demand[PoolKey(M, p)] - 1e-6
        else:
            short = res.shortfall_tpm.get(PoolKey(M, p), 0.0)
            assert got + short >= demand[PoolKey(M, p)] - 1e-6
    if res.status == "capped":
        assert res.shortfall_tpm and all(v > 0 for v in res.shortfall_tpm.values())


# ------------------------------------------------------------------------------------- policies


def obs(now: float, instances: dict[Cell, int], **kw: object) -> CapacityObservation:
    return CapacityObservation(now=now, instances=instances, **kw)  # type: ignore[arg-type]


def test_lt_i_applies_the_plan_at_once_and_replans_each_hour() -> None:
    pol = SageServePolicy(spec(), "LT-I")
    d = pol.decide(obs(10.0, {A: 1}, forecasts={K: forecast(5000.0)}))
    assert d.plan is not None and d.plan.status == "optimal"
    assert d.deltas == {A: -1, B: 2} and d.targets[B] == 2
    # same hour, already applied: nothing more (the plan is not re-solved)
    again = pol.decide(obs(1000.0, {B: 2}, forecasts={K: forecast(100.0)}))
    assert again.deltas == {} and again.plan is d.plan
    # next hour: the new forecast counts
    nxt = pol.decide(obs(3700.0, {B: 2}, forecasts={K: forecast(2000.0)}))
    assert nxt.plan is not d.plan and nxt.deltas == {B: -1}


def test_a_failed_plan_changes_nothing_and_is_retried() -> None:
    s = spec(gpu_limits={("A100", P): 1, ("H100", P): 0}, min_instances={K: 3})
    pol = SageServePolicy(s, "LT-I")
    d = pol.decide(obs(0.0, {A: 1}, forecasts={K: forecast(100.0)}))
    assert d.deltas == {} and "no plan (infeasible)" in d.reasons[K]
    assert pol.decide(obs(30.0, {A: 1}, forecasts={K: forecast(100.0)})).plan is d.plan
    assert pol.decide(obs(61.0, {A: 1}, forecasts={K: forecast(100.0)})).plan is not d.plan


def test_missing_forecast_holds_capacity() -> None:
    pol = SageServePolicy(spec(), "LT-I")
    d = pol.decide(obs(0.0, {B: 2}, utilisation={K: 0.1}))
    assert d.deltas == {}


def test_lt_u_is_gated_by_utilisation_and_stops_at_the_plan() -> None:
    pol = SageServePolicy(spec(a_cost=100.0), "LT-U")  # H100 only: plan 4 for 10,000 tpm
    f = {K: forecast(10_000.0)}
    assert pol.decide(obs(0.0, {B: 2}, forecasts=f, utilisation={K: 0.5})).deltas == {}
    assert pol.decide(obs(1.0, {B: 2}, forecasts=f, utilisation={K: 0.8})).deltas == {B: 1}
    # cooldown: 15 s between steps
    d = pol.decide(obs(5.0, {B: 3}, forecasts=f, utilisation={K: 0.8}))
    assert d.deltas == {} and "cooldown" in d.reasons[K]
    assert pol.decide(obs(17.0, {B: 3}, forecasts=f, utilisation={K: 0.8})).deltas == {B: 1}
    # at the plan's count: no more, however high the utilisation
    assert pol.decide(obs(40.0, {B: 4}, forecasts=f, utilisation={K: 0.99})).deltas == {}
    # scale in only below 30 %, only down to the plan
    assert pol.decide(obs(60.0, {B: 6}, forecasts=f, utilisation={K: 0.5})).deltas == {}
    assert pol.decide(obs(80.0, {B: 6}, forecasts=f, utilisation={K: 0.2})).deltas == {B: -1}
    assert pol.decide(obs(100.0, {B: 4}, forecasts=f, utilisation={K: 0.1})).deltas == {}
    # no utilisation reported: hold
    d = pol.decide(obs(120.0, {B: 2}, forecasts=f))
    assert d.deltas == {} and "no utilisation" in d.reasons[K]


def test_lt_ua_corrects_past_the_plan_in_the_last_20_minutes() -> None:
    pol = SageServePolicy(spec(a_cost=100.0), "LT-UA")
    f = {K: forecast(5000.0, path=1000.0)}  # plan: 2 H100; this minute's forecast 1,000 tpm
    hot = {K: 0.9}
    burst = {K: 6000.0}  # 6× the forecast for this minute
    # 10 minutes into the hour: the plan is a hard stop
    assert (
        pol.decide(obs(600.0, {B: 2}, forecasts=f, utilisation=hot, observed_tpm=burst)).deltas
        == {}
    )
    # 45 minutes in: keep scaling out
    d = pol.decide(obs(2700.0, {B: 2}, forecasts=f, utilisation=hot, observed_tpm=burst))
    assert d.deltas == {B: 1} and "past plan" in d.reasons[K]
    # a 2× surprise is not enough
    d = pol.decide(obs(2800.0, {B: 3}, forecasts=f, utilisation=hot, observed_tpm={K: 2000.0}))
    assert d.deltas == {}
    # lull: ≤ 0.5× the forecast and low utilisation → below the plan
    d = pol.decide(obs(2900.0, {B: 2}, forecasts=f, utilisation={K: 0.1}, observed_tpm={K: 400.0}))
    assert d.deltas == {B: -1}
    # LT-U never goes past its plan
    lt_u = SageServePolicy(spec(a_cost=100.0), "LT-U")
    assert (
        lt_u.decide(obs(2700.0, {B: 2}, forecasts=f, utilisation=hot, observed_tpm=burst)).deltas
        == {}
    )


def test_reactive_thresholds_and_cooldown() -> None:
    s = spec(min_instances={K: 1}, gpu_limits={("A100", P): 3, ("H100", P): 0})
    pol = ReactivePolicy(s)
    assert pol.decide(obs(0.0, {A: 1}, utilisation={K: 0.8})).deltas == {A: 1}
    assert pol.decide(obs(5.0, {A: 2}, utilisation={K: 0.8})).deltas == {}  # cooldown
    assert pol.decide(obs(16.0, {A: 2}, utilisation={K: 0.8})).deltas == {A: 1}
    d = pol.decide(obs(32.0, {A: 3}, utilisation={K: 0.95}))
    assert d.deltas == {} and "capacity cap reached" in d.reasons[K]
    assert pol.decide(obs(48.0, {A: 3}, utilisation={K: 0.5})).deltas == {}
    assert pol.decide(obs(64.0, {A: 3}, utilisation={K: 0.2})).deltas == {A: -1}
    d = pol.decide(obs(80.0, {A: 1}, utilisation={K: 0.0}))
    assert d.deltas == {} and "minimum" in d.reasons[K]


def test_reactive_scales_out_on_the_cheapest_per_token_and_in_from_the_dearest() -> None:
    pol = ReactivePolicy(spec())  # H100: 2.4e-3 $/token-min; A100: 3e-3
    assert pol.decide(obs(0.0, {A: 1}, utilisation={K: 0.9})).deltas == {B: 1}
    assert pol.decide(obs(100.0, {A: 1, B: 1}, utilisation={K: 0.1})).deltas == {A: -1}


def test_cato_violation_counter() -> None:
    pol = CatoPolicy(spec(a_cost=100.0), window_s=60.0, max_replicas=4)
    # one violation: not above the threshold of 1
    assert pol.decide(obs(0.0, {B: 1}, sla_violations={K: 1})).deltas == {}
    # three within the window, none idle: +3, capped at 4 replicas → +3
    d = pol.decide(obs(10.0, {B: 1}, sla_violations={K: 2}))
    assert d.deltas == {B: 3} and pol.exceeded_times(K) == 0  # counter reset
    # idle replicas absorb violations
    assert pol.decide(obs(20.0, {B: 4}, sla_violations={K: 2}, idle_instances={K: 2})).deltas == {}
    # the window slides: old violations no longer count
    pol2 = CatoPolicy(spec(a_cost=100.0))
    pol2.decide(obs(0.0, {B: 1}, sla_violations={K: 1}))
    assert pol2.decide(obs(61.0, {B: 1}, sla_violations={K: 1})).deltas == {}
    assert pol2.exceeded_times(K) == 1
    # the cap
    pol3 = CatoPolicy(spec(a_cost=100.0), max_replicas=2)
    d = pol3.decide(obs(0.0, {B: 1}, sla_violations={K: 5}))
    assert d.deltas == {B: 1}


def test_cato_removes_idle_instances_after_the_timeout() -> None:
    pol = CatoPolicy(spec(a_cost=100.0, min_instances={K: 1}), idle_timeout_s=300.0)
    assert pol.decide(obs(0.0, {B: 3}, idle_instances={K: 1})).deltas == {}
    assert pol.decide(obs(299.0, {B: 3}, idle_instances={K: 1})).deltas == {}
    assert pol.decide(obs(300.0, {B: 3}, idle_instances={K: 1})).deltas == {B: -1}
    # busy again resets the clock
    pol.decide(obs(310.0, {B: 2}, idle_instances={K: 0}))
    assert pol.decide(obs(400.0, {B: 2}, idle_instances={K: 1})).deltas == {}


def test_cato_violation_rule() -> None:
    def late(proportion: float) -> bool:
        return cato_counts_violation(
            remaining_completion_s=5.0,
            remaining_slack_s=2.0,
            last_elapsed_s=1.5,
            node_target_s=1.0,
            max_exceeded_proportion=proportion,
        )

    assert late(0.0) and late(0.5)  # a 50 % overrun
    assert not late(1.0)
    assert not cato_counts_violation(
        remaining_completion_s=1.0, remaining_slack_s=2.0, last_elapsed_s=9.0, node_target_s=1.0
    )
    # already late with idle replicas: not a capacity problem
    assert not cato_counts_violation(
        remaining_completion_s=5.0,
        remaining_slack_s=-1.0,
        last_elapsed_s=9.0,
        node_target_s=1.0,
        idle_replicas=1,
    )


def test_scale_up_signal_from_the_planner_meta() -> None:
    meta = {
        "groups": 3,
        "scale_up": {
            "needed": True,
            "recommendation": {"gpu_type": "A100", "models": [M], "count": 3},
        },
    }
    assert scale_up_from_plan(meta, P) == {K: 1}
    assert scale_up_from_plan(meta["scale_up"], P) == {K: 1}  # type: ignore[arg-type]
    assert scale_up_from_plan({"scale_up": {"needed": False}}, P) == {}
    assert scale_up_from_plan({"scale_up": {"needed": True, "recommendation": None}}, P) == {}
    assert scale_up_from_plan({}, P) == {}


@pytest.mark.parametrize("name", sorted(CAPACITY_POLICIES))
def test_every_policy_honours_the_scale_up_signal_once_per_hold(name: str) -> None:
    pol = create_capacity_policy(name, spec(), scale_up_hold_s=600.0)
    f = {K: forecast(500.0)}
    base = dict(forecasts=f, utilisation={K: 0.5}, observed_tpm={K: 500.0})
    d = pol.decide(obs(0.0, {A: 1}, scale_up={K: 1}, **base))
    assert sum(d.deltas.values()) >= 1
    assert sum(d.targets.values()) >= 2
    held = pol.decide(obs(100.0, {A: 2}, scale_up={K: 1}, **base))
    assert sum(held.deltas.values()) <= 0
    later = pol.decide(obs(700.0, {A: 2}, scale_up={K: 1}, **base))
    assert sum(later.deltas.values()) >= 1


@pytest.mark.parametrize("name", sorted(CAPACITY_POLICIES))
def test_no_policy_undoes_a_scale_up_during_its_hold(name: str) -> None:
    pol = create_capacity_policy(name, spec(), scale_up_hold_s=600.0)
    quiet = dict(forecasts={K: forecast(500.0)}, utilisation={K: 0.05}, observed_tpm={K: 10.0})
    pol.decide(obs(0.0, {A: 1}, **quiet))  # LT modes: the plan for this hour is 1 A100
    assert sum(pol.decide(obs(10.0, {A: 1}, scale_up={K: 1}, **quiet)).deltas.values()) == 1
    for t in (40.0, 300.0):  # low utilisation, idle, plan of 1: still no scale-in
        d = pol.decide(obs(t, {A: 2}, idle_instances={K: 1}, **quiet))
        assert sum(d.deltas.values()) >= 0, d.reasons
    # the hold is over: back to the policy's own logic (plan of 1 / low EMU / idle 960 s)
    after = pol.decide(obs(1000.0, {A: 2}, idle_instances={K: 1}, **quiet))
    assert sum(after.deltas.values()) == -1, after.reasons


@pytest.mark.parametrize("name", sorted(CAPACITY_POLICIES))
def test_policy_conformance(name: str) -> None:
    """Every policy: targets = instances + deltas, never negative, JSON-able with its inputs."""
    pol = create_capacity_policy(name, spec(min_instances={K: 1}))
    assert pol.name == name
    for t, u, v in [(0.0, 0.9, 3), (20.0, 0.1, 0), (40.0, 0.5, 0), (3700.0, 0.0, 1)]:
        o = obs(
            t,
            {A: 1, B: 1},
            forecasts={K: forecast(3000.0, origin=t)},
            utilisation={K: u},
            observed_tpm={K: 3000.0},
            sla_violations={K: v},
        )
        d = pol.decide(o)
        assert d.observation is o and d.policy == name
        for c in set(d.targets) | set(o.instances):
            assert d.targets.get(c, 0) == o.instances.get(c, 0) + d.deltas.get(c, 0)
            assert d.targets.get(c, 0) >= 0
        assert sum(d.targets.values()) >= 1  # the minimum
        json.dumps(d.to_dict())


def test_factory_and_observation_validation() -> None:
    with pytest.raises(ValueError, match="unknown capacity policy"):
        create_capacity_policy("nope", spec())
    with pytest.raises(ValueError, match="utilisation"):
        obs(0.0, {}, utilisation={K: math.nan})
    with pytest.raises(ValueError, match="observed_tpm"):
        obs(0.0, {}, observed_tpm={K: -1.0})
    with pytest.raises(ValueError, match="non-negative integer"):
        ReactivePolicy(spec()).decide(obs(0.0, {A: -2}))


def test_the_benchmark_runs_at_the_issue_size() -> None:
    # the solve-time target itself is measured by `qlm bench capacity-ilp`, not asserted here
    out = bench_capacity_ilp(solves=8, seed=1)
    assert out["integer_variables"] == 24
    assert sum(out["statuses"].values()) == 8
    assert set(out["statuses"]) <= {"optimal", "capped"}
    assert out["median_s"] <= out["p95_s"] <= out["max_s"]
