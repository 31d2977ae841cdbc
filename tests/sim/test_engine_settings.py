"""A pool's engine token budget (``max_num_batched_tokens``): the simulated engines run it and,
for the run, the planner prices those engines at it, as the live coordinator prices engines
whose measured profiles it registered (qlm.engine_model.register_measured_profile)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from planner.evaluate import profile_for
from qlm.engine_model import (
    clear_measured_profiles,
    get_profile,
    measured_profiles,
    register_measured_profile,
)
from qlm.engine_scheduler import WANTS_AT_MOST, EngineLimits, EngineScheduler
from qlm.estimator import engine_profile
from qlm.planner import create_policy
from qlm.tooling.simulator.cluster import (
    ClusterSimulator,
    InstanceSpec,
    SimConfig,
    SimResult,
    instance_profiles,
)
from qlm.tooling.simulator.instance import SimInstance
from qlm.tooling.simulator.runner import engine_settings_known, instance_specs, sim_config
from qlm.tooling.simulator.scenario import ScenarioSpec
from qlm.tooling.simulator.workload import SimRequest

GPU, MODEL = "A100-80GB", "mistral-7b"


@pytest.fixture(autouse=True)
def _no_measured_profiles() -> Iterator[None]:
    clear_measured_profiles()
    yield
    clear_measured_profiles()


def _one_pool(**pool: Any) -> ScenarioSpec:
    """A scenario of one pool of GPU/MODEL with these fields, and one chat stream."""
    return ScenarioSpec.model_validate(
        {
            "name": "t",
            "duration_s": 60,
            "pools": [{"gpu": GPU, "models": [MODEL], **pool}],
            "streams": [
                {
                    "name": "chat",
                    "models": [MODEL],
                    "slo_class": "interactive",
                    "e2e_slo_s": 20,
                    "arrival": {"process": "poisson", "rate_rps": 2.0},
                    "lengths": {"source": "sharegpt"},
                }
            ],
        }
    )


def _instance(iid: str, budget: int | None) -> InstanceSpec:
    return InstanceSpec(iid, GPU, (MODEL,), max_num_batched_tokens=budget)


def test_a_registered_profile_reaches_the_estimators_and_planners_cached_lookups() -> None:
    default = engine_profile(GPU, MODEL).max_num_batched_tokens
    assert profile_for(GPU, MODEL).max_num_batched_tokens == default == 2048  # now cached
    register_measured_profile(get_profile(GPU, MODEL, max_num_batched_tokens=512))
    assert engine_profile(GPU, MODEL).max_num_batched_tokens == 512
    assert profile_for(GPU, MODEL).max_num_batched_tokens == 512
    clear_measured_profiles()
    assert engine_profile(GPU, MODEL).max_num_batched_tokens == 2048
    assert profile_for(GPU, MODEL).max_num_batched_tokens == 2048


def test_a_pools_token_budget_is_its_engines_and_its_scenario_field() -> None:
    specs = instance_specs(_one_pool(count=2, max_num_batched_tokens=512))
    assert [s.max_num_batched_tokens for s in specs] == [512, 512]
    assert instance_profiles(specs[0], {})[MODEL].max_num_batched_tokens == 512
    assert instance_profiles(_instance("x", None), {})[MODEL].max_num_batched_tokens == 2048


def test_the_planner_prices_a_pools_budget_for_the_run_only() -> None:
    other = get_profile("H100-80GB", MODEL, max_num_batched_tokens=1024)
    register_measured_profile(other)  # what an operator stored before: kept
    with engine_settings_known([_instance("a", 512), _instance("b", 512)]):
        assert engine_profile(GPU, MODEL).max_num_batched_tokens == 512
        assert get_profile("H100-80GB", MODEL) == other
    assert engine_profile(GPU, MODEL).max_num_batched_tokens == 2048
    assert measured_profiles() == {("H100-80GB", MODEL): other}
    with engine_settings_known([_instance("a", None)]):  # nothing set: nothing registered
        assert measured_profiles() == {("H100-80GB", MODEL): other}


def test_instances_of_one_gpu_type_and_model_must_share_a_budget() -> None:
    with (
        pytest.raises(ValueError, match="every pool must run one max_num_batched_tokens"),
        engine_settings_known([_instance("a", 512), _instance("b", None)]),
    ):
        pass  # pragma: no cover
    assert measured_profiles() == {}


# ------------------------------------------------------------------ the agents' pull size


def _burst(n: int) -> list[SimRequest]:
    return [
        SimRequest(
            request_id=f"r{k}",
            model=MODEL,
            arrival_s=0.0,
            prompt_tokens=600,
            output_tokens=20,
            max_tokens=1024,
            slo_class="interactive",
            e2e_slo_s=60.0,
            ttft_slo_s=None,
            stream="chat",
        )
        for k in range(n)
    ]


def _handed_between_iterations(
    instance: InstanceSpec, policy: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[ClusterSimulator, SimResult, list[int]]:
    """Twelve prompts at once: the run, and how many requests the agent handed the engine
    between two iteration starts."""
    handed: list[int] = [0]
    enqueue, start_next = SimInstance.enqueue, SimInstance._start_next

    def recording_enqueue(self: SimInstance, jobs: list[Any], now: float) -> None:
        handed[-1] += len(jobs)
        enqueue(self, jobs, now)

    def recording_start(self: SimInstance, now: float) -> None:
        handed.append(0)
        start_next(self, now)

    monkeypatch.setattr(SimInstance, "enqueue", recording_enqueue)
    monkeypatch.setattr(SimInstance, "_start_next", recording_start)
    sim = ClusterSimulator([instance], create_policy(policy), _burst(12), SimConfig())
    return sim, sim.run(), handed


@pytest.mark.parametrize("pull", [None, 1, 3])
def test_a_pools_pull_size_bounds_what_its_engines_are_handed_at_once(
    pull: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent hands its engine at most ``pull`` of twelve prompts between two iteration
    starts (WANTS_AT_MOST without the pool's field), and all are served."""
    (instance,) = instance_specs(_one_pool(count=1, pull_at_most=pull))
    assert instance.pull_at_most == pull
    sim, result, handed = _handed_between_iterations(instance, "fcfs", monkeypatch)
    assert sim.instances[instance.instance_id].engine.pull_at_most == (pull or WANTS_AT_MOST)
    assert len(result.outcomes) == 12 and sum(handed) == 12
    # at most one pull between two iterations; a whole one but for the first request of a
    # pull, which may start an iteration of its own
    size = pull or WANTS_AT_MOST
    assert size - 1 <= max(handed) <= size


@pytest.mark.parametrize("policy", ["fcfs", "qlm"])
@pytest.mark.parametrize(("feed_tokens", "per_round"), [(1, 1), (1_000, 1), (1_200, 2)])
def test_a_pools_feed_budget_bounds_what_its_engines_are_handed_per_iteration(
    feed_tokens: int, per_round: int, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default pull, the agent holds what it pulled and hands its engine only as many
    of twelve 600-token prompts between two iteration starts as fit ``feed_tokens`` (one
    always); all are served, none twice."""
    (instance,) = instance_specs(_one_pool(count=1, feed_tokens=feed_tokens))
    assert instance.feed_tokens == feed_tokens
    sim, result, handed = _handed_between_iterations(instance, policy, monkeypatch)
    assert sim.agents[instance.instance_id].feed_tokens == feed_tokens
    assert sorted(o.request_id for o in result.outcomes) == sorted(f"r{k}" for k in range(12))
    assert sum(handed) == 12 and max(handed) == per_round


def test_a_pull_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="pull_at_most"):
        EngineScheduler("e", EngineLimits(1000, 8, 2048), active_model=MODEL, pull_at_most=0)


@pytest.mark.parametrize("policy", ["vllm", "shepherd"])
def test_no_feed_budget_where_no_agent_holds_work(policy: str) -> None:
    """`vllm` has no agent (every request goes to the engine at arrival) and SHEPHERD's
    engines take whole static batches: a pool's feed budget leaves both as they are."""
    spec = _one_pool(count=1, feed_tokens=512)
    (instance,) = instance_specs(spec)
    chosen = create_policy(policy)
    sim = ClusterSimulator([instance], chosen, _burst(4), sim_config(spec, policy, chosen))
    assert sim.agents[instance.instance_id].feed_tokens is None
    assert len(sim.run().outcomes) == 4
