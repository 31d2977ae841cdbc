"""A pool's engine token budget (``max_num_batched_tokens``): the simulated engines run it and,
for the run, the planner prices those engines at it, as the live coordinator prices engines
whose measured profiles it registered (qlm.engine_model.register_measured_profile)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from planner.evaluate import profile_for
from qlm.engine_model import (
    clear_measured_profiles,
    get_profile,
    measured_profiles,
    register_measured_profile,
)
from qlm.estimator import engine_profile
from qlm.tooling.simulator.cluster import InstanceSpec, instance_profiles
from qlm.tooling.simulator.runner import engine_settings_known, instance_specs
from qlm.tooling.simulator.scenario import ScenarioSpec

GPU, MODEL = "A100-80GB", "mistral-7b"


@pytest.fixture(autouse=True)
def _no_measured_profiles() -> Iterator[None]:
    clear_measured_profiles()
    yield
    clear_measured_profiles()


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
    spec = ScenarioSpec.model_validate(
        {
            "name": "t",
            "duration_s": 60,
            "pools": [{"gpu": GPU, "count": 2, "models": [MODEL], "max_num_batched_tokens": 512}],
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
    specs = instance_specs(spec)
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
