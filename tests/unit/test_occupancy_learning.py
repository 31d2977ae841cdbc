"""qlm's long-shot credit in measured occupancy (``QLMConfig.occupancy_learning``): the scale is
the busy queues' time over the priced occupancy of what their engines finished between plans."""

from __future__ import annotations

import pytest

from qlm.planner import create_policy
from qlm.planner.stochastic import OCCUPANCY_MIN_S, QLMPolicy
from qlm.policy import PlanInstance, PlanRequest

MODEL = "mistral-7b"


def _queue(n: int) -> list[PlanRequest]:
    return [
        PlanRequest(f"r{k}", MODEL, 500, 1024, 0.0, 1e6, None, seq=k, slo_class="batch")
        for k in range(n)
    ]


def _engine(running: int) -> PlanInstance:
    return PlanInstance(
        "i0", (MODEL,), "A100-80GB", 400_000, 256, active_model=MODEL, running=running
    )


def _scale_after(finished_per_plan: int, plans: int, *, fill: int = 0) -> float:
    """Plans 10 s apart; between two, ``finished_per_plan`` requests leave the queue and the
    engine holds ``fill`` more than before (so it finished that many fewer)."""
    policy = create_policy("qlm", budget_clock="work", occupancy_learning=True)
    assert isinstance(policy, QLMPolicy)
    queue = _queue(3_000)
    held = 100
    policy.plan(queue, [_engine(held)], 0.0)
    gone = 0
    for step in range(1, plans + 1):
        gone += finished_per_plan + fill
        held += fill
        policy.plan(queue[gone:], [_engine(held)], 10.0 * step)
    return policy._occupancy_scale()


def test_no_scale_before_enough_busy_time() -> None:
    assert OCCUPANCY_MIN_S == 60.0
    assert _scale_after(50, 5) == 1.0  # 50 s of busy queue


def test_an_engine_serving_half_again_as_fast_scales_by_two_thirds() -> None:
    slow, fast = _scale_after(70, 12), _scale_after(105, 12)
    assert 0.5 < fast < slow < 1.0
    assert slow / fast == pytest.approx(1.5, rel=0.02)


def test_only_a_discount_is_learnt_and_at_most_half() -> None:
    """Busy queues also count time the price leaves out on purpose (model loads): an engine
    slower than priced keeps the price; one more than twice as fast is read as twice."""
    assert _scale_after(40, 12) == 1.0
    assert _scale_after(200, 12) == 0.5


def test_work_an_engine_takes_into_its_batch_is_not_counted_as_served() -> None:
    # here 20 more leave per plan, only to fill the engine's batch
    scale = _scale_after(100, 12)
    assert scale < 1.0
    assert _scale_after(100, 12, fill=20) == pytest.approx(scale, rel=0.02)


def test_on_by_default_and_can_be_turned_off() -> None:
    policy = create_policy("qlm")
    assert isinstance(policy, QLMPolicy) and policy.config.occupancy_learning
    off = create_policy("qlm", occupancy_learning=False)
    assert isinstance(off, QLMPolicy) and not off.config.occupancy_learning


def _charged(sure: float, shots: float, *, measured: bool = True) -> float:
    """A long shot's charge over its price with the engines measured at 3/4 of the price and
    ``sure`` / ``shots`` priced seconds of each kind arrived lately."""
    policy = create_policy("qlm", long_shot_measured_charge=measured)
    assert isinstance(policy, QLMPolicy)
    policy._occ_busy_s, policy._occ_priced_s = 90.0, 120.0
    assert policy._occupancy_scale() == pytest.approx(0.75)
    policy._sure_load = {60.0: [sure, sure, sure]}
    policy._shot_load = shots
    return policy._shot_charge_scale()


def test_a_long_shot_is_charged_the_measured_scale_by_the_sure_work_share() -> None:
    assert _charged(0.0, 50.0) == 1.0  # only long shots: the price keeps its margin
    assert _charged(50.0, 0.0) == pytest.approx(0.75)  # sure work absorbs what is off
    assert _charged(30.0, 10.0) == pytest.approx(1.0 - 0.75 * 0.25)
    assert _charged(0.0, 0.0) == 1.0
    assert _charged(30.0, 10.0, measured=False) == 1.0


def test_a_long_shot_charge_without_a_measured_scale_is_its_price() -> None:
    policy = create_policy("qlm")
    assert isinstance(policy, QLMPolicy)
    policy._sure_load = {60.0: [30.0, 30.0, 30.0]}
    assert policy._shot_charge_scale() == 1.0  # nothing measured yet
