"""CoordinatorMetrics: private registries, exposition, SLO attainment and label caps."""

from __future__ import annotations

import math

import prometheus_client
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from qlm.metrics import (
    MAX_REQUEUE_REASONS,
    MAX_SLO_CLASSES,
    OUTCOMES,
    OVERFLOW_SLO_CLASS,
    CoordinatorMetrics,
)


def samples(m: CoordinatorMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Parse the rendered text (as Prometheus would) into {(sample name, labels): value}."""
    body, _ = m.render()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: CoordinatorMetrics, name: str, **labels: str) -> float | None:
    return samples(m).get((name, frozenset(labels.items())))


def test_registries_are_private_and_independent() -> None:
    a, b = CoordinatorMetrics(), CoordinatorMetrics()
    a.observe_outcome("completed")
    a.set_queue_depth("gpu-0", 7)
    assert value(a, "qlm_requests_total", outcome="completed") == 1
    assert value(b, "qlm_requests_total", outcome="completed") == 0
    assert value(b, "qlm_virtual_queue_depth", instance_id="gpu-0") is None
    global_names = {f.name for f in prometheus_client.REGISTRY.collect()}
    assert not any(n.startswith("qlm_") for n in global_names)


def test_every_documented_metric_is_exposed_and_parseable() -> None:
    m = CoordinatorMetrics()
    m.set_queue_depth("gpu-0", 3)
    m.set_state_counts({"queued": 3, "dispatched": 1})
    m.observe_outcome("completed")
    m.observe_slo("interactive", True)
    m.observe_dispatch_latency(0.002)
    m.observe_ingest_latency(0.0001)
    m.set_instances_alive(2)
    m.observe_plan(0.03)
    m.observe_requeue("instance_lost")
    m.set_unacked(4)
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    s = samples(m)
    assert s[("qlm_virtual_queue_depth", frozenset({("instance_id", "gpu-0")}))] == 3
    assert s[("qlm_requests_in_state", frozenset({("state", "dispatched")}))] == 1
    assert s[("qlm_slo_total", frozenset({("slo_class", "interactive"), ("met", "true")}))] == 1
    assert s[("qlm_dispatch_latency_seconds_count", frozenset())] == 1
    assert s[("qlm_ingest_latency_seconds_count", frozenset())] == 1
    assert s[("qlm_instances_alive", frozenset())] == 2
    assert s[("qlm_replans_total", frozenset())] == 1
    assert s[("qlm_plan_duration_seconds_sum", frozenset())] == pytest.approx(0.03)
    assert s[("qlm_requeued_total", frozenset({("reason", "instance_lost")}))] == 1
    assert s[("qlm_unacked_deliveries", frozenset())] == 4


def test_outcome_counters_start_at_zero_and_reject_unknown_outcomes() -> None:
    m = CoordinatorMetrics()
    for outcome in OUTCOMES:
        assert value(m, "qlm_requests_total", outcome=outcome) == 0
    m.observe_outcome("dead_lettered")
    m.observe_outcome("dead_lettered")
    assert value(m, "qlm_requests_total", outcome="dead_lettered") == 2
    with pytest.raises(ValueError, match="unknown outcome"):
        m.observe_outcome("complete")  # typo must not create a new series
    assert value(m, "qlm_requests_total", outcome="complete") is None


def test_state_counts_zero_states_that_disappear() -> None:
    m = CoordinatorMetrics()
    m.set_state_counts({"queued": 5, "dispatched": 2})
    m.set_state_counts({"dispatched": 1})
    assert value(m, "qlm_requests_in_state", state="queued") == 0
    assert value(m, "qlm_requests_in_state", state="dispatched") == 1


def test_remove_instance_drops_its_series() -> None:
    m = CoordinatorMetrics()
    m.set_queue_depth("gpu-0", 1)
    m.set_queue_depth("gpu-1", 2)
    m.remove_instance("gpu-0")
    m.remove_instance("never-seen")  # no-op, no error
    assert value(m, "qlm_virtual_queue_depth", instance_id="gpu-0") is None
    assert value(m, "qlm_virtual_queue_depth", instance_id="gpu-1") == 2
    m.set_queue_depth("gpu-0", 9)  # an instance that comes back gets a fresh series
    assert value(m, "qlm_virtual_queue_depth", instance_id="gpu-0") == 9


def test_scale_up_advice_reads_zero_for_every_gpu_type_the_plan_had() -> None:
    m = CoordinatorMetrics()
    name = "qlm_scale_up_recommended_instances"
    m.set_scale_up({})  # a policy that does not advise: no series
    assert not [k for k in samples(m) if k[0] == name]
    m.set_scale_up({}, gpu_types={"A100-80GB"})  # advised nothing: enough A100s
    assert value(m, name, gpu_type="A100-80GB") == 0
    m.set_scale_up({"gpu_type": "H100-80GB", "count": 3}, gpu_types={"A100-80GB"})
    assert value(m, name, gpu_type="H100-80GB") == 3
    assert value(m, name, gpu_type="A100-80GB") == 0
    m.set_scale_up({})  # the next plan needs nothing: every type seen reads 0 again
    assert value(m, name, gpu_type="H100-80GB") == 0
    assert value(m, name, gpu_type="A100-80GB") == 0


def test_latency_buckets_span_half_a_millisecond_to_ten_seconds() -> None:
    m = CoordinatorMetrics()
    m.observe_dispatch_latency(0.0004)
    m.observe_dispatch_latency(12.0)
    m.observe_dispatch_latency(-0.01)  # clock skew between hosts: clamped, _sum stays sane
    assert value(m, "qlm_dispatch_latency_seconds_bucket", le="0.0005") == 2
    assert value(m, "qlm_dispatch_latency_seconds_bucket", le="10.0") == 2
    assert value(m, "qlm_dispatch_latency_seconds_bucket", le="+Inf") == 3
    assert value(m, "qlm_dispatch_latency_seconds_sum") == pytest.approx(12.0004)


@given(
    st.lists(
        st.tuples(st.sampled_from(["interactive", "batch", "x", None]), st.booleans()),
        max_size=60,
    )
)
def test_slo_attainment_matches_a_tally(events: list[tuple[str | None, bool]]) -> None:
    m = CoordinatorMetrics()
    tally: dict[str, list[int]] = {}
    for slo_class, met in events:
        m.observe_slo(slo_class, met)
        t = tally.setdefault(slo_class or "default", [0, 0])
        t[0 if met else 1] += 1
    expected = {c: met / (met + missed) for c, (met, missed) in tally.items()}
    got = m.slo_attainment()
    assert got.keys() == expected.keys()
    for c, v in expected.items():
        assert math.isclose(got[c], v)


def test_slo_class_cardinality_is_capped_without_losing_counts() -> None:
    m = CoordinatorMetrics()
    n = MAX_SLO_CLASSES + 40
    for i in range(n):
        m.observe_slo(f"class-{i}", met=i % 2 == 0)
    m.observe_slo("class-0", met=True)  # a class seen before the cap keeps its own series
    attained = m.slo_attainment()
    assert len(attained) <= MAX_SLO_CLASSES + 1
    assert OVERFLOW_SLO_CLASS in attained
    total = sum(v for (name, _), v in samples(m).items() if name == "qlm_slo_total")
    assert total == n + 1
    assert value(m, "qlm_slo_total", slo_class="class-0", met="true") == 2


def test_requeue_reason_cardinality_is_capped() -> None:
    m = CoordinatorMetrics()
    for i in range(MAX_REQUEUE_REASONS + 10):
        m.observe_requeue(f"reason-{i}")
    reasons = {
        dict(labels)["reason"] for (name, labels) in samples(m) if name == "qlm_requeued_total"
    }
    assert len(reasons) == MAX_REQUEUE_REASONS + 1
    assert value(m, "qlm_requeued_total", reason="other") == 10


def test_request_histograms_carry_model_slo_class_and_a_capped_tenant() -> None:
    from qlm.metrics import MAX_TENANTS, NO_TENANT, OVERFLOW_LABEL, TTFT_BUCKETS_S

    m = CoordinatorMetrics()
    for i in range(MAX_TENANTS + 5):
        m.observe_request(
            model="mistral-7b",
            slo_class="chat",
            tenant=f"t{i}",
            queue_s=0.1,
            ttft_s=0.2,
            tpot_s=0.02,
            e2e_s=1.0,
        )
    m.observe_request(
        model="mistral-7b", slo_class=None, tenant=None, queue_s=None, ttft_s=-1.0, tpot_s=None,
        e2e_s=2.0,
    )  # fmt: skip
    s = samples(m)

    def count(name: str, tenant: str, slo: str = "chat") -> float | None:
        labels = {("model_name", "mistral-7b"), ("slo_class", slo), ("tenant", tenant)}
        return s.get((f"{name}_count", frozenset(labels)))

    assert count("qlm_time_to_first_token_seconds", "t0") == 1
    assert count("qlm_time_to_first_token_seconds", f"t{MAX_TENANTS - 1}") == 1
    assert count("qlm_time_to_first_token_seconds", f"t{MAX_TENANTS}") is None
    assert count("qlm_e2e_request_latency_seconds", OVERFLOW_LABEL) == 5
    # no tenant, no class: "none" and "default"; a negative span (clock skew) counts as 0
    assert count("qlm_time_to_first_token_seconds", NO_TENANT, "default") == 1
    assert count("qlm_request_queue_time_seconds", NO_TENANT, "default") is None
    le = {
        dict(labels)["le"]
        for (name, labels) in s
        if name == "qlm_time_to_first_token_seconds_bucket"
    }
    assert len(le) == len(TTFT_BUCKETS_S) + 1  # vLLM's layout, plus +Inf


def test_instance_engine_gauges_and_their_removal() -> None:
    m = CoordinatorMetrics()
    m.set_instance_engine("a-gpu0", running=3, waiting=1, kv_usage=0.5)
    assert value(m, "qlm_instance_num_requests_running", instance_id="a-gpu0") == 3
    assert value(m, "qlm_instance_num_requests_waiting", instance_id="a-gpu0") == 1
    assert value(m, "qlm_instance_kv_cache_usage_perc", instance_id="a-gpu0") == 0.5
    m.remove_instance("a-gpu0")
    assert value(m, "qlm_instance_num_requests_running", instance_id="a-gpu0") is None
    m.remove_instance_engine("never-seen")  # a no-op
