"""Prometheus metrics of one coordinator, exposed by the admin API at ``GET /metrics``.

Each :class:`CoordinatorMetrics` owns its own ``CollectorRegistry`` (never the process-global
one) so that several coordinators can live in one process, as they do in tests. The coordinator
calls the ``set_*``/``observe_*`` methods on its hot path; each is a dict lookup plus one
locked update inside ``prometheus_client``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# Final fates of a request; a typo in the coordinator should fail loudly, not add a series.
OUTCOMES: frozenset[str] = frozenset(
    {"completed", "failed", "rejected", "dead_lettered", "cancelled"}
)

# Broker delivery -> engine start spans sub-millisecond (idle cluster) to seconds (backlog).
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# The stochastic planner may take seconds on large backlogs; EDF takes microseconds.
PLAN_BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

# ``slo_class`` is a free-form producer label: cap its cardinality so that a misbehaving
# producer cannot grow the registry (and every scrape) without bound.
MAX_SLO_CLASSES = 64
DEFAULT_SLO_CLASS = "default"
OVERFLOW_SLO_CLASS = "other"
MAX_REQUEUE_REASONS = 32
OVERFLOW_REQUEUE_REASON = "other"


class CoordinatorMetrics:
    """The coordinator's metrics, in a private registry."""

    def __init__(self, namespace: str = "qlm") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._queue_depth = Gauge(
            f"{namespace}_virtual_queue_depth",
            "Requests waiting in the instance's virtual queue",
            ["instance"],
            registry=r,
        )
        self._requests = Gauge(
            f"{namespace}_requests_in_state",
            "Requests currently held by the coordinator, by lifecycle state",
            ["state"],
            registry=r,
        )
        self._outcomes = Counter(
            f"{namespace}_requests",
            "Requests that reached a final outcome",
            ["outcome"],
            registry=r,
        )
        self._slo = Counter(
            f"{namespace}_slo",
            "Finished requests by SLO class and whether their SLO was met",
            ["slo_class", "met"],
            registry=r,
        )
        self._tasks = Counter(
            f"{namespace}_tasks",
            "Task chains ended (their last call answered), by whether the task met its SLA",
            ["met"],
            registry=r,
        )
        self._dispatch_latency = Histogram(
            f"{namespace}_dispatch_latency_seconds",
            "Broker delivery to engine start",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self._ingest_latency = Histogram(
            f"{namespace}_ingest_latency_seconds",
            "Broker delivery to placement in a virtual queue",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self._instances_alive = Gauge(
            f"{namespace}_instances_alive",
            "Instances with a recent heartbeat",
            registry=r,
        )
        self._replans = Counter(
            f"{namespace}_replans", "Plans computed by the queue policy", registry=r
        )
        self._plan_duration = Histogram(
            f"{namespace}_plan_duration_seconds",
            "Wall time of one planning run",
            buckets=PLAN_BUCKETS_S,
            registry=r,
        )
        self._requeued = Counter(
            f"{namespace}_requeued",
            "Requests put back into a virtual queue, by reason",
            ["reason"],
            registry=r,
        )
        self._shed = Counter(
            f"{namespace}_shed_requests",
            "New requests refused with an 'overloaded' error, by the limit hit (global | tenant)",
            ["limit"],
            registry=r,
        )
        self._shed_children = {k: self._shed.labels(limit=k) for k in ("global", "tenant")}
        for child in self._shed_children.values():
            child.inc(0)
        self._duplicates = Counter(
            f"{namespace}_duplicate_requests",
            "Copies of a request id published while it was tracked: acked at once, not run",
            registry=r,
        )
        self._answered_again = Counter(
            f"{namespace}_answered_again",
            "Requests answered from the durable answer record instead of being run again, by "
            "why (redelivered | republished | leftover_result | ran_twice)",
            ["reason"],
            registry=r,
        )
        self._cancels_refused = Counter(
            f"{namespace}_cancels_refused",
            "Cancels ignored because they came from another tenant than the request's",
            registry=r,
        )
        self._evictions = Counter(
            f"{namespace}_evictions",
            "Running requests the plan evicted to resume later, by mode (evict | swap)",
            ["mode"],
            registry=r,
        )
        self._eviction_children = {m: self._evictions.labels(mode=m) for m in ("evict", "swap")}
        self._unacked = Gauge(
            f"{namespace}_unacked_deliveries",
            "Broker deliveries held unacked by this coordinator",
            registry=r,
        )
        self._scale_up = Gauge(
            f"{namespace}_scale_up_recommended_instances",
            "Instances to add so the plan meets the SLOs (0 when it already does), by GPU type",
            ["gpu_type"],
            registry=r,
        )
        self._scale_up_types: set[str] = set()
        self._capacity_decisions = Counter(
            f"{namespace}_capacity_decisions",
            "Autoscaler decisions that changed an instance count, by policy and what the driver "
            "did (applied, dry_run, failed)",
            ["policy", "outcome"],
            registry=r,
        )
        self._capacity_target = Gauge(
            f"{namespace}_capacity_target_instances",
            "Instances the autoscaler's latest decision wants, per model, GPU type and pool",
            ["model", "gpu_type", "pool"],
            registry=r,
        )
        self._capacity_utilisation = Gauge(
            f"{namespace}_capacity_utilisation",
            "Effective memory utilisation the autoscaler saw (KV used / KV capacity), per model "
            "and pool",
            ["model", "pool"],
            registry=r,
        )
        # Label children are cached: ``labels()`` takes a lock and builds a tuple each call.
        self._depth_children: dict[str, Gauge] = {}
        self._state_children: dict[str, Gauge] = {}
        self._outcome_children = {o: self._outcomes.labels(outcome=o) for o in OUTCOMES}
        self._slo_children: dict[tuple[str, bool], Counter] = {}
        self._slo_classes: set[str] = set()
        self._requeue_children: dict[str, Counter] = {}
        for outcome in OUTCOMES:  # export zeros so rate() works from the first scrape
            self._outcome_children[outcome].inc(0)

    # ---- gauges -------------------------------------------------------------------------

    def set_queue_depth(self, instance_id: str, n: int) -> None:
        child = self._depth_children.get(instance_id)
        if child is None:
            child = self._depth_children[instance_id] = self._queue_depth.labels(
                instance=instance_id
            )
        child.set(n)

    def remove_instance(self, instance_id: str) -> None:
        """Drop a lost/removed instance's series; a no-op for an instance never seen."""
        if self._depth_children.pop(instance_id, None) is not None:
            self._queue_depth.remove(instance_id)

    def set_state_counts(self, counts: Mapping[str, int]) -> None:
        """Set the current count per state; a state missing from ``counts`` is set to 0."""
        for state, stale in self._state_children.items():
            if state not in counts:
                stale.set(0)
        for state, n in counts.items():
            child = self._state_children.get(state)
            if child is None:
                child = self._state_children[state] = self._requests.labels(state=state)
            child.set(n)

    def set_instances_alive(self, n: int) -> None:
        self._instances_alive.set(n)

    def set_unacked(self, n: int) -> None:
        self._unacked.set(n)

    def set_scale_up(self, recommendation: Mapping[str, Any]) -> None:
        """The planner's advice (``{"gpu_type": ..., "count": ...}``); empty clears it."""
        for gpu_type in self._scale_up_types:  # reset every GPU type advised before
            self._scale_up.labels(gpu_type=gpu_type).set(0)
        if recommendation.get("gpu_type"):
            gpu_type = str(recommendation["gpu_type"])
            self._scale_up_types.add(gpu_type)
            self._scale_up.labels(gpu_type=gpu_type).set(float(recommendation.get("count", 0)))

    def set_capacity(
        self,
        targets: Mapping[tuple[str, str, str], int],
        utilisation: Mapping[tuple[str, str], float],
    ) -> None:
        """The autoscaler's latest targets ((model, gpu_type, pool) → instances) and EMU."""
        for (model, gpu_type, pool), n in targets.items():
            self._capacity_target.labels(model=model, gpu_type=gpu_type, pool=pool).set(n)
        for (model, pool), u in utilisation.items():
            self._capacity_utilisation.labels(model=model, pool=pool).set(u)

    def observe_capacity_decision(self, policy: str, outcome: str) -> None:
        self._capacity_decisions.labels(policy=policy, outcome=outcome).inc()

    # ---- counters -----------------------------------------------------------------------

    def observe_outcome(self, outcome: str) -> None:
        child = self._outcome_children.get(outcome)
        if child is None:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {sorted(OUTCOMES)}")
        child.inc()

    def observe_task(self, met: bool) -> None:
        self._tasks.labels(met="true" if met else "false").inc()

    def observe_slo(self, slo_class: str | None, met: bool) -> None:
        label = slo_class or DEFAULT_SLO_CLASS
        if label not in self._slo_classes and len(self._slo_classes) >= MAX_SLO_CLASSES:
            label = OVERFLOW_SLO_CLASS
        child = self._slo_children.get((label, met))
        if child is None:
            self._slo_classes.add(label)
            child = self._slo.labels(slo_class=label, met="true" if met else "false")
            self._slo_children[(label, met)] = child
        child.inc()

    def observe_requeue(self, reason: str) -> None:
        child = self._requeue_children.get(reason)
        if child is None:
            if len(self._requeue_children) >= MAX_REQUEUE_REASONS:
                reason = OVERFLOW_REQUEUE_REASON
            child = self._requeue_children.get(reason)
            if child is None:
                child = self._requeue_children[reason] = self._requeued.labels(reason=reason)
        child.inc()

    def observe_shed(self, limit: str) -> None:
        child = self._shed_children.get(limit)
        if child is not None:
            child.inc()

    def observe_duplicate(self) -> None:
        self._duplicates.inc()

    def observe_answered_again(self, reason: str) -> None:
        self._answered_again.labels(reason=reason).inc()

    def observe_cancel_refused(self) -> None:
        self._cancels_refused.inc()

    def observe_eviction(self, mode: str) -> None:
        child = self._eviction_children.get(mode)
        if child is not None:
            child.inc()

    def observe_plan(self, duration_s: float) -> None:
        self._replans.inc()
        self._plan_duration.observe(max(0.0, duration_s))

    # ---- histograms ---------------------------------------------------------------------

    def observe_dispatch_latency(self, seconds: float) -> None:
        # Wall clocks of two hosts can disagree slightly; a negative sample would corrupt _sum.
        self._dispatch_latency.observe(max(0.0, seconds))

    def observe_ingest_latency(self, seconds: float) -> None:
        self._ingest_latency.observe(max(0.0, seconds))

    # ---- read side ----------------------------------------------------------------------

    def slo_attainment(self) -> dict[str, float]:
        """Fraction of finished requests that met their SLO, per SLO class (from the counters)."""
        met: dict[str, float] = {}
        total: dict[str, float] = {}
        for family in self._slo.collect():
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue  # skip the _created samples
                cls = sample.labels["slo_class"]
                total[cls] = total.get(cls, 0.0) + sample.value
                if sample.labels["met"] == "true":
                    met[cls] = met.get(cls, 0.0) + sample.value
        return {cls: met.get(cls, 0.0) / n for cls, n in sorted(total.items()) if n > 0}

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this registry, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
