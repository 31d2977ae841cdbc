"""Ordering policies: the stochastic planner and the baselines (FCFS, EDF).

``create_policy`` is the one policy factory: the live coordinator (``qlm coordinator``), the
simulator (``qlm bench sim``, through :func:`simulation_policy`) and the benches build every
policy with it. What differs between live and simulated runs is an explicit parameter of it
(the planner's budget clock, its objective), not a second copy of the wiring.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from qlm.grouping import GroupingConfig
from qlm.planner.balancing import PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy
from qlm.planner.baselines import EDFPolicy, FCFSPolicy
from qlm.planner.edf_shed import EDFShedPolicy
from qlm.planner.gain_density import GainDensityPolicy
from qlm.planner.shepherd import SHEPHERDPolicy
from qlm.planner.stochastic import QLMPolicy
from qlm.planner.vllm_direct import VLLMDirectPolicy
from qlm.policy import QueuePolicy

POLICIES: dict[str, Callable[[], QueuePolicy]] = {
    "fcfs": FCFSPolicy,
    "edf": EDFPolicy,
    "edf-shed": EDFShedPolicy,
    "shepherd": SHEPHERDPolicy,
    "round_robin": RoundRobinPolicy,
    "random": RandomPolicy,
    "power_of_two": PowerOfTwoPolicy,
    "qlm": QLMPolicy,
    "gain_density": GainDensityPolicy,
    "vllm": VLLMDirectPolicy,
}


BudgetClock = Literal["wall", "work"]


def create_policy(
    name: str,
    *,
    budget_clock: BudgetClock = "wall",
    objective: str | None = None,
    cap_throughput_min: float | None = None,
    class_lanes: bool | None = None,
    improve_one_model: bool | None = None,
    **overrides: Any,
) -> QueuePolicy:
    """The policy called ``name`` (case-insensitive; ``ValueError`` names the known ones).

    * ``budget_clock`` - the planner's time budgets: ``"wall"`` (real seconds; the live
      coordinator) or ``"work"`` (a work counter, so that the same inputs give the same plan
      on any machine; the simulator). ``qlm`` and ``shepherd`` (its ILP's limit) use it;
      the others have no time budget;
    * ``objective`` - the planner's objective (``QLM_PLANNER_OBJECTIVE`` live): ``None`` keeps
      its default; policies without one ignore it;
    * ``cap_throughput_min`` - the share of full-batch throughput the planner's batch caps
      keep (``QLM_PLANNER_CAP_THROUGHPUT_MIN`` live); ``None`` keeps its default;
    * ``class_lanes`` - the planner's class lanes (``QLM_PLANNER_CLASS_LANES`` live);
      ``None`` keeps its default;
    * ``improve_one_model`` - whether the planner improves one model's group plan
      (``QLM_PLANNER_IMPROVE_ONE_MODEL`` live); ``None`` keeps its default;
    * ``overrides`` - constructor arguments (a scenario file's policy variants); the planner's
      ``grouping`` may be given as a mapping. They win over the arguments above.
    """
    key = name.lower()
    if key not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    if key == "shepherd":  # its ILP has a time limit: a node limit under a work budget
        return SHEPHERDPolicy(**{"budget_clock": budget_clock, **overrides})
    if key != "qlm":
        return POLICIES[key](**overrides)
    kwargs: dict[str, Any] = {"budget_clock": budget_clock}
    if objective is not None:
        kwargs["objective"] = objective
    if cap_throughput_min is not None:
        kwargs["cap_throughput_min"] = cap_throughput_min
    if class_lanes is not None:
        kwargs["class_lanes"] = class_lanes
    if improve_one_model is not None:
        kwargs["improve_one_model"] = improve_one_model
    kwargs.update(overrides)
    if isinstance(kwargs.get("grouping"), Mapping):  # from YAML/JSON
        kwargs["grouping"] = GroupingConfig(**kwargs["grouping"])
    return QLMPolicy(**kwargs)


def simulation_policy(name: str, overrides: Mapping[str, Any]) -> QueuePolicy:
    """:func:`create_policy` as the simulator calls it
    (``qlm.tooling.simulator.runner.PolicyFactory``):
    work-clock budgets, so that a published run is reproducible on any machine, unless the
    scenario variant's ``overrides`` say otherwise."""
    return create_policy(name, **{"budget_clock": "work", **overrides})


__all__ = [
    "POLICIES",
    "EDFPolicy",
    "EDFShedPolicy",
    "FCFSPolicy",
    "GainDensityPolicy",
    "PowerOfTwoPolicy",
    "QLMPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "BudgetClock",
    "SHEPHERDPolicy",
    "VLLMDirectPolicy",
    "create_policy",
    "simulation_policy",
]
