"""Ordering policies: the stochastic planner and the baselines (FCFS, EDF).

``create_policy(name)`` is the one factory the CLI and the simulator use.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.balancing import PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy
from planner.baselines import EDFPolicy, FCFSPolicy
from planner.edf_shed import EDFShedPolicy
from planner.gain_density import GainDensityPolicy
from planner.shepherd import SHEPHERDPolicy
from planner.stochastic import QLMPolicy
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
}


def create_policy(name: str) -> QueuePolicy:
    try:
        return POLICIES[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None


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
    "SHEPHERDPolicy",
    "create_policy",
]
