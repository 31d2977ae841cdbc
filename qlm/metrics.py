"""Prometheus metrics of qlm's processes: the coordinator (admin API ``GET /metrics``), the
gateway (its own ``GET /metrics``); the agent's are in ``qlm/agents/health.py``.

Each metrics object owns its own ``CollectorRegistry`` (never the process-global one) so that
several coordinators or gateways can live in one process, as they do in tests. The coordinator
calls the ``set_*``/``observe_*`` methods on its hot path; each is a dict lookup plus one
locked update inside ``prometheus_client``.

Naming (docs/metrics.md): qlm's own metrics are ``qlm_*``; where one means what a vLLM metric
means, it takes vLLM's name after the prefix (``vllm:time_to_first_token_seconds`` ->
``qlm_time_to_first_token_seconds``), vLLM's ``model_name`` label and vLLM's bucket layout, so
that a dashboard built for one reads the other. No label is called ``instance``: Prometheus
sets that label to the scrape target and would rename ours to ``exported_instance``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics import MetricWrapperBase

# Final fates of a request; a typo in the coordinator should fail loudly, not add a series.
OUTCOMES: frozenset[str] = frozenset(
    {"completed", "failed", "rejected", "dead_lettered", "cancelled"}
)

# Coordinator dispatch -> engine start spans sub-millisecond (idle cluster) to seconds (backlog).
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

# vLLM's bucket layouts (vllm/v1/metrics/buckets.py), copied so that qlm's histograms and the
# engine's line up bucket for bucket: end to end and queue time ...
REQUEST_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# ... time to first token ...
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# ... and time per output token (vLLM's inter-token latency buckets).
TPOT_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# HTTP calls of the gateway: a /v1/models call takes a millisecond, a long generation minutes.
HTTP_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
)  # fmt: skip

# Per-request histograms carry model_name x slo_class x tenant. Tenants are unbounded (every
# API key is one), so the first MAX_TENANTS distinct tenants a process sees get a series of
# their own and every later one is counted under "other"; a request without a tenant is
# "none". Models are bounded by the catalog, but capped too against a misbehaving producer.
MAX_TENANTS = 32
MAX_MODELS = 64
NO_TENANT = "none"
OVERFLOW_LABEL = "other"
# Request label sets (model_name, slo_class, tenant) of the per-request histograms.
REQUEST_LABELS = ("model_name", "slo_class", "tenant")


@dataclass(frozen=True)
class MetricDef:
    """One metric family as exposed: its name as PromQL uses it (counters with ``_total``),
    type, label names and HELP text. docs/metrics.md lists exactly these (a test checks)."""

    name: str
    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str

    def sample_names(self) -> tuple[str, ...]:
        """Every sample name a query may use for this family."""
        if self.kind == "histogram":
            base = self.name
            return (base, f"{base}_bucket", f"{base}_sum", f"{base}_count", f"{base}_created")
        if self.kind == "counter":
            return (self.name, self.name.removesuffix("_total") + "_created")
        return (self.name,)


def counter_by(
    name: str, documentation: str, label: str, values: Iterable[str], registry: CollectorRegistry
) -> tuple[Counter, dict[str, Any]]:
    """A counter with one label whose values are known, and each value's series, created at 0
    so that a rate is defined before the first event."""
    counter = Counter(name, documentation, [label], registry=registry)
    children = {v: counter.labels(**{label: v}) for v in values}
    for child in children.values():
        child.inc(0)
    return counter, children


def wrapper_defs(metrics: Iterable[Any]) -> list[MetricDef]:
    """The :class:`MetricDef` of each prometheus_client metric object among ``metrics``.

    Reads the wrappers' ``_name``/``_type``/``_labelnames``/``_documentation``: a registry's
    exposition omits the label names of a family with no series yet, and the docs test must
    see them all from a fresh registry."""
    out = []
    for m in metrics:
        if not isinstance(m, MetricWrapperBase):
            continue
        kind = str(m._type)
        name = m._name + ("_total" if kind == "counter" else "")
        out.append(MetricDef(name, kind, tuple(m._labelnames), m._documentation))
    return sorted(out, key=lambda d: d.name)


class LabelCap:
    """A bounded label: the first ``limit`` distinct values pass, later ones become
    ``overflow``; an empty value is ``empty``, which (like ``overflow``) always passes."""

    def __init__(self, limit: int, *, empty: str, overflow: str = OVERFLOW_LABEL) -> None:
        self.limit = limit
        self.empty = empty
        self.overflow = overflow
        self._seen: set[str] = set()

    def __call__(self, value: str | None) -> str:
        label = value or self.empty
        if label in self._seen or label == self.empty or label == self.overflow:
            return label
        if len(self._seen) >= self.limit:
            return self.overflow
        self._seen.add(label)
        return label


class CoordinatorMetrics:
    """The coordinator's metrics, in a private registry."""

    def __init__(self, namespace: str = "qlm", *, max_tenants: int = MAX_TENANTS) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._queue_depth = Gauge(
            f"{namespace}_virtual_queue_depth",
            "Requests waiting in the instance's virtual queue",
            ["instance_id"],
            registry=r,
        )
        # Per instance, from its agent's heartbeats (vLLM's names: the same meaning, engine-side)
        self._inst_running = Gauge(
            f"{namespace}_instance_num_requests_running",
            "Requests running in the instance's engine, as its last heartbeat said",
            ["instance_id"],
            registry=r,
        )
        self._inst_waiting = Gauge(
            f"{namespace}_instance_num_requests_waiting",
            "Requests waiting inside the instance's engine, as its last heartbeat said",
            ["instance_id"],
            registry=r,
        )
        self._inst_kv = Gauge(
            f"{namespace}_instance_kv_cache_usage_perc",
            "KV-cache usage of the instance's engine (1 means 100 percent), as its last "
            "heartbeat said",
            ["instance_id"],
            registry=r,
        )
        # Per finished request (answered with a result), by model, SLO class and tenant.
        self._queue_time = Histogram(
            f"{namespace}_request_queue_time_seconds",
            "Submission to the start of the engine attempt that answered the request",
            REQUEST_LABELS,
            buckets=REQUEST_LATENCY_BUCKETS_S,
            registry=r,
        )
        self._ttft = Histogram(
            f"{namespace}_time_to_first_token_seconds",
            "Submission to the first output token, earliest across attempts",
            REQUEST_LABELS,
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self._tpot = Histogram(
            f"{namespace}_request_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request with two or more",
            REQUEST_LABELS,
            buckets=TPOT_BUCKETS_S,
            registry=r,
        )
        self._e2e = Histogram(
            f"{namespace}_e2e_request_latency_seconds",
            "Submission to the last output token",
            REQUEST_LABELS,
            buckets=REQUEST_LATENCY_BUCKETS_S,
            registry=r,
        )
        self._tenant_label = LabelCap(max_tenants, empty=NO_TENANT)
        self._model_label = LabelCap(MAX_MODELS, empty="unknown")
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
            "Coordinator dispatch (order sent to the agent) to engine start on the agent; "
            "two hosts' wall clocks",
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
        self._shed, self._shed_children = counter_by(
            f"{namespace}_shed_requests",
            "New requests refused with an 'overloaded' error, by the limit hit (global | tenant)",
            "limit",
            ("global", "tenant"),
            r,
        )
        self._stream_tap, self._stream_tap_children = counter_by(
            f"{namespace}_stream_tap_messages",
            "Token-stream messages read from the stream tap, by outcome (read | dropped)",
            "outcome",
            ("read", "dropped"),
            r,
        )
        self._stream_resumes = Counter(
            f"{namespace}_stream_resumes",
            "Streamed requests whose lost attempt was resumed after the tokens their producer had",
            registry=r,
        )
        self._late_results_refused = Counter(
            f"{namespace}_late_results_refused",
            "Results of a replaced attempt ignored because they contradict their request's "
            "stream (the attempt that replaced it answers)",
            registry=r,
        )
        self._stale_attempts_stopped = Counter(
            f"{namespace}_stale_attempts_stopped",
            "Attempts an agent declared lost still ran when it came back, stopped because "
            "another attempt replaced them or their request was answered",
            registry=r,
        )
        # the coordinator core's own counts, as these counters last had them
        self._core_counts_seen: dict[str, int] = {}
        self._duplicates = Counter(
            f"{namespace}_duplicate_requests",
            "Copies of a request id published while it was tracked: acked at once, not run",
            registry=r,
        )
        self._refreshed = Counter(
            f"{namespace}_deliveries_refreshed",
            "Requests republished as a fresh copy because connection losses wore their "
            "delivery count toward the quorum queue's delivery limit",
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
        self._plan_arrivals, self._plan_arrival_children = counter_by(
            f"{namespace}_plan_arrivals",
            "Requests placed while a plan was computed, by outcome (started: sent at once to a "
            "free batch slot | waited: placed when the plan was in)",
            "outcome",
            ("started", "waited"),
            r,
        )
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
        self._engine_instances: dict[str, tuple[Gauge, Gauge, Gauge]] = {}
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
                instance_id=instance_id
            )
        child.set(n)

    def remove_instance(self, instance_id: str) -> None:
        """Drop a lost/removed instance's series; a no-op for an instance never seen."""
        if self._depth_children.pop(instance_id, None) is not None:
            self._queue_depth.remove(instance_id)
        self.remove_instance_engine(instance_id)

    def remove_instance_engine(self, instance_id: str) -> None:
        """Drop the engine-stat series of an instance no longer heard from."""
        if self._engine_instances.pop(instance_id, None) is not None:
            for gauge in (self._inst_running, self._inst_waiting, self._inst_kv):
                gauge.remove(instance_id)

    def set_instance_engine(
        self, instance_id: str, *, running: int, waiting: int, kv_usage: float
    ) -> None:
        """The engine stats of an instance's latest heartbeat (``kv_usage`` in 0..1)."""
        children = self._engine_instances.get(instance_id)
        if children is None:
            children = self._engine_instances[instance_id] = (
                self._inst_running.labels(instance_id=instance_id),
                self._inst_waiting.labels(instance_id=instance_id),
                self._inst_kv.labels(instance_id=instance_id),
            )
        children[0].set(running)
        children[1].set(waiting)
        children[2].set(kv_usage)

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

    def set_scale_up(
        self, recommendation: Mapping[str, Any], gpu_types: Iterable[str] = ()
    ) -> None:
        """The planner's advice (``{"gpu_type": ..., "count": ...}``); empty clears it.
        ``gpu_types``: the GPU types the plan had, each exported (0 unless advised), so that a
        cluster that needs nothing more reads 0 on the dashboard, not "no data"."""
        self._scale_up_types.update(gpu_types)
        for gpu_type in self._scale_up_types:  # reset every GPU type seen or advised before
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

    def observe_stream_tap(self, outcome: str) -> None:
        self._stream_tap_children[outcome].inc()

    def sync_core_counts(
        self, *, stream_resumes: int, late_results_refused: int, stale_attempts_stopped: int
    ) -> None:
        """Bring the counters the coordinator core keeps as plain totals up to them."""
        for name, total, counter in (
            ("stream_resumes", stream_resumes, self._stream_resumes),
            ("late_results_refused", late_results_refused, self._late_results_refused),
            ("stale_attempts_stopped", stale_attempts_stopped, self._stale_attempts_stopped),
        ):
            new = total - self._core_counts_seen.get(name, 0)
            if new > 0:
                counter.inc(new)
                self._core_counts_seen[name] = total

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

    def observe_refreshed(self) -> None:
        self._refreshed.inc()

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

    def observe_plan_arrivals(self, started: int, waited: int) -> None:
        """Requests placed while one plan was computed: sent to a free slot, or held for it."""
        self._plan_arrival_children["started"].inc(max(0, started))
        self._plan_arrival_children["waited"].inc(max(0, waited))

    # ---- histograms ---------------------------------------------------------------------

    def observe_request(
        self,
        *,
        model: str,
        slo_class: str | None,
        tenant: str | None,
        queue_s: float | None,
        ttft_s: float | None,
        tpot_s: float | None,
        e2e_s: float | None,
    ) -> None:
        """The latencies of one request answered with a result (None: not known)."""
        labels = self.request_labels(model, slo_class, tenant)
        for hist, seconds in (
            (self._queue_time, queue_s),
            (self._ttft, ttft_s),
            (self._tpot, tpot_s),
            (self._e2e, e2e_s),
        ):
            if seconds is not None:
                hist.labels(*labels).observe(max(0.0, seconds))

    def request_labels(
        self, model: str, slo_class: str | None, tenant: str | None
    ) -> tuple[str, str, str]:
        """(model_name, slo_class, tenant) label values, each capped (see MAX_TENANTS)."""
        slo = slo_class or DEFAULT_SLO_CLASS
        if slo not in self._slo_classes and len(self._slo_classes) >= MAX_SLO_CLASSES:
            slo = OVERFLOW_SLO_CLASS
        return self._model_label(model), slo, self._tenant_label(tenant)

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

    def definitions(self) -> list[MetricDef]:
        return wrapper_defs(vars(self).values())


# ---- the gateway --------------------------------------------------------------------------

# The gateway's routes as a bounded label: anything else (a scanner's probes) is "other".
GATEWAY_ROUTES: frozenset[str] = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model}",
        "/healthz",
        "/readyz",
        "/metrics",
    }
)


def gateway_route(path: str) -> str:
    if path in GATEWAY_ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


class GatewayMetrics:
    """The gateway's metrics, in a private registry (``GET /metrics`` of the gateway)."""

    def __init__(self, waiting: Callable[[], float] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter(
            "qlm_gateway_requests",
            "HTTP requests answered, by route and status code (499: the client went away)",
            ["route", "status"],
            registry=r,
        )
        self._duration = Histogram(
            "qlm_gateway_request_duration_seconds",
            "HTTP request arrival to the end of its response (a stream's last event)",
            ["route"],
            buckets=HTTP_BUCKETS_S,
            registry=r,
        )
        self._ttft = Histogram(
            "qlm_gateway_time_to_first_token_seconds",
            "Streamed calls: HTTP request arrival to the stream's first piece (its first "
            "tokens, or the whole answer) ready to send to the client",
            ["model_name"],
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self._waiting = Gauge(
            "qlm_gateway_requests_waiting",
            "Calls published and waiting for their reply",
            registry=r,
        )
        if waiting is not None:
            self._waiting.set_function(waiting)
        self._model_label = LabelCap(MAX_MODELS, empty="unknown")

    def observe_http(self, route: str, status: int, seconds: float) -> None:
        self._requests.labels(route=route, status=str(status)).inc()
        self._duration.labels(route=route).observe(max(0.0, seconds))

    def observe_stream_ttft(self, model: str, seconds: float) -> None:
        self._ttft.labels(model_name=self._model_label(model)).observe(max(0.0, seconds))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def definitions(self) -> list[MetricDef]:
        return wrapper_defs(vars(self).values())
