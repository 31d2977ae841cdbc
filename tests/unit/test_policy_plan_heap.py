"""``QueuePolicy.plan`` finds each request's least-loaded instance with one heap per model
(lazy deletion); it must choose exactly what comparing every instance
(``QueuePolicy.choose_instance``) chooses, ties and all."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.planner import create_policy
from qlm.planner.baselines import EDFPolicy, FCFSPolicy
from qlm.policy import PlanInstance, PlanRequest, QueuePolicy
from tests.builders import make_plan_request

MODELS = ("mistral-7b", "vicuna-13b", "unknown-model")
GPUS = ("A100-80GB", "H100-80GB", "A10G")


class _Scans(QueuePolicy):
    """``choose_instance`` overridden (to itself): plan() takes the scan over every instance,
    the rule as written."""

    def choose_instance(
        self,
        request: PlanRequest,
        instances: Sequence[PlanInstance],
        load: Mapping[str, float],
    ) -> PlanInstance | None:
        return super().choose_instance(request, instances, load)


class _ScanningEDF(_Scans, EDFPolicy):
    pass


class _ScanningFCFS(_Scans, FCFSPolicy):
    pass


instances_st = st.lists(
    st.builds(
        lambda models, gpu, active, running, draining: (models, gpu, active, running, draining),
        st.sets(st.sampled_from(MODELS), min_size=1, max_size=3),
        st.sampled_from(GPUS),
        st.sampled_from((None, *MODELS)),
        st.integers(0, 3),  # few values: ties on load are broken by the later fields
        st.booleans(),
    ),
    min_size=2,
    max_size=12,
)
requests_st = st.lists(
    st.tuples(
        st.sampled_from(MODELS),
        st.integers(0, 2_000),
        st.integers(0, 2_000),
        st.floats(0, 100),
        st.one_of(st.none(), st.floats(0, 500)),
    ),
    max_size=120,
)


def _build(
    raw_instances: list[tuple[set[str], str, str | None, int, bool]],
    raw_requests: list[tuple[str, int, int, float, float | None]],
) -> tuple[list[PlanInstance], list[PlanRequest]]:
    instances = [
        PlanInstance(
            f"i{n:02d}",
            tuple(sorted(models)),
            gpu,
            100_000,
            256,
            active_model=active,
            running=running,
            draining=draining,
        )
        for n, (models, gpu, active, running, draining) in enumerate(raw_instances)
    ]
    requests = [
        make_plan_request(
            f"r{n}",
            model=model,
            prompt=prompt,
            out=out,
            arrival=arrival,
            deadline=None if deadline is None else arrival + deadline,
            seq=n,
        )
        for n, (model, prompt, out, arrival, deadline) in enumerate(raw_requests)
    ]
    return instances, requests


@settings(max_examples=300, deadline=None)
@given(instances_st, requests_st)
def test_the_heaps_choose_what_the_scan_chooses(
    raw_instances: list[tuple[set[str], str, str | None, int, bool]],
    raw_requests: list[tuple[str, int, int, float, float | None]],
) -> None:
    instances, requests = _build(raw_instances, raw_requests)
    for fast, scanning in ((EDFPolicy(), _ScanningEDF()), (FCFSPolicy(), _ScanningFCFS())):
        got = fast.plan(requests, instances, 0.0)
        want = scanning.plan(requests, instances, 0.0)
        assert got.queues == want.queues
        assert got.unassigned == want.unassigned


def test_equal_loads_go_to_the_matching_model_then_fewer_running_then_the_smaller_id() -> None:
    instances = [
        PlanInstance("b", ("m",), "A100-80GB", 10_000, 256, active_model="other", running=0),
        PlanInstance("c", ("m",), "A100-80GB", 10_000, 256, active_model="m", running=2),
        PlanInstance("a", ("m",), "A100-80GB", 10_000, 256, active_model="m", running=2),
        PlanInstance("d", ("m",), "A100-80GB", 10_000, 256, active_model="m", running=1),
    ]
    requests = [make_plan_request(f"r{n}", arrival=float(n), deadline=None) for n in range(5)]
    plan = create_policy("fcfs").plan(requests, instances, 0.0)
    # empty queues: d (its model matches, one running), then a and c (two running; a's id
    # is smaller), then b (another model active, but no load yet); then every queue holds
    # one request's load and d wins again
    assert plan.queues == {"b": ["r3"], "c": ["r2"], "a": ["r1"], "d": ["r0", "r4"]}


def test_a_subclass_with_its_own_choice_keeps_it() -> None:
    class FirstServing(EDFPolicy):
        def choose_instance(
            self,
            request: PlanRequest,
            instances: Sequence[PlanInstance],
            load: Mapping[str, float],
        ) -> PlanInstance | None:
            return next((i for i in instances if i.serves(request.model)), None)

    instances = [PlanInstance(f"i{n}", ("m",), "A100-80GB", 10_000, 256) for n in range(3)]
    requests = [make_plan_request(f"r{n}", arrival=0.0, deadline=float(n)) for n in range(4)]
    plan = FirstServing().plan(requests, instances, 0.0)
    assert plan.queues == {"i0": ["r0", "r1", "r2", "r3"], "i1": [], "i2": []}
