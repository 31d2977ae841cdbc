"""Named scenarios reproducing the QLM paper's evaluation (§8, appendix A), and their targets.

Every preset is a scenario file shipped with qlm, ``qlm/tooling/simulator/scenarios/NAME.yaml`` (an
ordinary :class:`ScenarioSpec`: ``qlm bench sim --scenario NAME --dump`` prints it, and a copy
can be edited and run with ``--file``). Each file's comments say why its constants were chosen;
docs/simulator.md has the overview. This module keeps what is code: the targets, the policy
columns that are not scenario fields (the δ sweep, rct's estimator settings) and the SLA
calibration of ``coding``. Common ground:

* GPUs are A100-80GB (the paper's testbed) unless the scenario is about heterogeneity;
* request lengths are sampled from the ShareGPT table (prompt and output of one row), or replay
  the Azure traces;
* "latency-sensitive" requests have a 20 s end-to-end SLO (the paper: < 30 s); "batch" ones
  300 s (the paper: minutes);
* multi-model workloads use fine-tuned variants (``base@tag``): same shape as the base model,
  distinct weights, so each is a separate model to load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from qlm.tooling.simulator.runner import PolicyFactory, PolicyVariant, simulate
from qlm.tooling.simulator.scenario import ScenarioError, ScenarioSpec


def load_preset(name: str) -> ScenarioSpec:
    """The shipped scenario file ``qlm/tooling/simulator/scenarios/NAME.yaml``."""
    # not load_scenario(): its debug log goes to stdout, into `--dump`'s YAML
    resource = resources.files("qlm.tooling.simulator").joinpath("scenarios", f"{name}.yaml")
    data = yaml.safe_load(resource.read_text(encoding="utf-8"))
    try:
        return ScenarioSpec.model_validate(data)
    except ScenarioError as e:
        raise ScenarioError(f"qlm/tooling/simulator/scenarios/{name}.yaml: {e}") from e


def shortened(
    name: str, duration_s: float | None = None, rates: list[float] | None = None
) -> dict[str, Any]:
    """Preset ``name`` as a scenario dict, cut to ``duration_s`` and/or to the sweep points of
    ``rates`` (the sweep's labels are its rates, ``f"{rate:g}"``): a run of seconds for tests
    and calibration. The description says what was cut."""
    data = load_preset(name).model_dump(mode="json", exclude_none=True)
    cuts = []
    if duration_s is not None:
        data["duration_s"] = duration_s
        cuts.append(f"{duration_s:g} s")
    if rates is not None:
        sweep = data["sweep"]
        labels = [f"{r:g}" for r in rates]
        missing = [label for label in labels if label not in sweep["variants"]]
        if missing or not labels:
            raise ValueError(f"{name}: no sweep point {missing}; points: {sweep['variants']}")
        keep = [sweep["variants"].index(label) for label in labels]
        sweep["values"] = [sweep["values"][k] for k in keep]
        sweep["variants"] = labels
        data["streams"] = sweep["values"][0]
        cuts.append(f"{sweep['label']} {', '.join(labels)}")
    if cuts:
        data["description"] += f" (shortened: {'; '.join(cuts)})"
    return data


@dataclass(frozen=True)
class Preset:
    name: str  # also the scenario file's name
    targets: str  # what the issue asks of this scenario, for the report
    policy_sweep: Callable[[], tuple[str, list[tuple[str, PolicyVariant]]]] | None = None
    policy_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    record_estimates: bool = False
    # the run's columns when they are not the scenario's policies (e.g. engine settings)
    variants: Callable[[], list[PolicyVariant]] | None = None

    def spec(self) -> ScenarioSpec:
        return load_preset(self.name)


def _delta_sweep() -> tuple[str, list[tuple[str, PolicyVariant]]]:
    points = []
    for d in (1, 2, 4, 8, 16):
        points.append((str(d), PolicyVariant("qlm", "qlm", {"grouping": {"delta": float(d)}})))
    return "group size cap δ", points


# ---------------------------------------------------------------------------- CATO's coding tasks
@dataclass(frozen=True)
class CodingTask:
    """One of CATO's four coding task types (digest B2.1), as ``coding.yaml`` streams it: its
    Pattern 1 share of the arrivals, which latency its SLA bounds, the SLA, and the length
    table that comes closest to its token shape."""

    name: str
    share: float
    slo_kind: str  # "ttft" (first token) or "e2e" (last token), both from the task's arrival
    sla_s: float
    lengths: dict[str, Any]


def _coding_tasks(spec: ScenarioSpec) -> list[CodingTask]:
    total = sum(s.arrival.rate_rps or 0.0 for s in spec.streams)
    tasks = []
    for s in spec.streams:
        ttft = s.ttft_slo_s is not None
        sla = s.ttft_slo_s if ttft else s.e2e_slo_s
        assert sla is not None  # a stream without a program has one of them
        # the file's rates are total x share: rounding drops the quotient's float noise
        share = round((s.arrival.rate_rps or 0.0) / total, 6)
        lengths = s.lengths.model_dump(exclude_none=True)
        tasks.append(CodingTask(s.name, share, "ttft" if ttft else "e2e", sla, lengths))
    return tasks


_CODING = load_preset("coding")
assert _CODING.sweep is not None and _CODING.sweep.variants is not None
CODING_RATES = [float(label) for label in _CODING.sweep.variants]
CODING_TASKS = _coding_tasks(_CODING)
# CATO's SLA rule: each SLA is the task's mean latency at this rate (coding.yaml says more)
CODING_CALIBRATION_RPS = 1.67


def coding(duration_s: float | None = None, rates: list[float] | None = None) -> dict[str, Any]:
    """CATO's RQ3 (``coding.yaml``: what is modelled, and why), optionally shortened."""
    return shortened("coding", duration_s, rates)


def coding_calibration(
    factory: PolicyFactory, duration_s: float | None = None, baseline: str = "power_of_two"
) -> dict[str, float]:
    """CATO's SLA rule on this simulator: per task, the mean TTFT (TTFT tasks) or end-to-end
    latency (the others) of the ``coding`` scenario at 1.67 req/s under ``baseline``, in s."""
    spec = ScenarioSpec.model_validate(coding(duration_s, [CODING_CALIBRATION_RPS]))
    point = spec.sweep_points()[0][1]
    result = simulate(point, PolicyVariant(baseline, baseline), factory)
    kinds = {task.name: task.slo_kind for task in CODING_TASKS}
    latencies: dict[str, list[float]] = {name: [] for name in kinds}
    for outcome in result.outcomes:
        end = outcome.first_token_s if kinds[outcome.slo_class] == "ttft" else outcome.finished_s
        if end is not None:  # the drain lets every request finish; never seen unfinished
            latencies[outcome.slo_class].append(end - outcome.arrival_s)
    return {name: sum(v) / len(v) for name, v in latencies.items() if v}


def agentic(duration_s: float | None = None, rates: list[float] | None = None) -> dict[str, Any]:
    """Chains and trees of dependent calls (``agentic.yaml``), optionally shortened."""
    return shortened("agentic", duration_s, rates)


# issue 17's targets for every multi-model scenario (qlm/tooling/simulator/targets.py)
MULTI_MODEL_TARGETS = (
    "; qlm >= SHEPHERD with <= 1.2x its model loads, throughput >= vllm and >= 0.97x fcfs"
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "wb",
            "qlm >= every baseline - 1 point; at 16/20 req/s >= vllm + 40 and >= the best of "
            "fcfs/edf/edf-shed + 5 points; throughput >= vllm and >= 0.97x fcfs",
        ),
        Preset(
            "wb-512",
            "wb with a 512-token engine budget: qlm >= every baseline - 1 point where the "
            "20-s class is mostly feasible",
        ),
        Preset(
            "wb-pull1",
            "wb with the agents pulling one request at a time: what the pull size is worth to "
            "every policy behind an agent",
        ),
        Preset(
            "wb-feed",
            "wb with the agents feeding 512 prompt tokens a round: the pace of wb-pull1 "
            "without a broker round trip per request",
        ),
        Preset(
            "wb-ablation",
            "removing each default LSO lowers attainment or throughput by > 1 sd; adding one "
            "that is off raises neither",
        ),
        Preset(
            "wa",
            "qlm throughput >= 3x fcfs and >= edf with >= 50 % tail models" + MULTI_MODEL_TARGETS,
        ),
        Preset("wa-share", "(Fig. 9) attainment vs latency-sensitive share" + MULTI_MODEL_TARGETS),
        Preset(
            "wa-ablation",
            "removing each default LSO lowers attainment or throughput by > 1 sd; adding one "
            "that is off raises neither",
        ),
        Preset("wc", "(Fig. 15) attainment with mega prompts" + MULTI_MODEL_TARGETS),
        Preset(
            "hetero",
            ">= 2x attainment or throughput of round-robin at 20-50 % A10" + MULTI_MODEL_TARGETS,
        ),
        Preset("delta", "(Fig. 18) attainment vs planner overhead", _delta_sweep),
        Preset("slo-scale", "(Fig. 20) attainment vs SLO scale" + MULTI_MODEL_TARGETS),
        Preset(
            "rct",
            "R^2 >= 0.95 between the completion times estimated at dispatch and the simulated "
            "ones at 12 req/s; the last plan's estimates and the static queue reported beside it",
            # the RCT mean; the output lengths profiled before the run, as the paper's
            # estimator assumes (§6): the ShareGPT table the streams draw from. With the
            # default prior (max_tokens) the static queue's one plan, made before any
            # completion, prices every output at its 1,024-token cap
            policy_overrides={"qlm": {"slo_quantile": 0.5, "output_prior": "sharegpt"}},
            record_estimates=True,
        ),
        Preset("trace", "Azure conv + code replay, two SLO classes"),
        Preset("trace-pull1", "trace with the agents pulling one request at a time"),
        Preset("trace-feed", "trace with the agents feeding 512 prompt tokens a round"),
        Preset("trace-512", "trace with a 512-token engine budget: every policy at that setting"),
        Preset(
            "mixed",
            "qlm (the default): service gain >= 1.3x fcfs and SLO goodput >= every baseline's "
            "at the overload points",
        ),
        Preset("mixed-pull1", "mixed with the agents pulling one request at a time"),
        Preset("mixed-feed", "mixed with the agents feeding 512 prompt tokens a round"),
        Preset("mixed-512", "mixed with a 512-token engine budget: every policy at that setting"),
        Preset("scale", "1 h of 100 GPUs (>= 1M requests) in <= 5 min, <= 4 GB"),
        Preset(
            "saber",
            "SABER's admission >= the best static max-num-seqs at every rate >= 5 req/s",
        ),
        Preset(
            "agentic",
            "task attainment per policy with chains and trees of calls; at every rate qlm's "
            "tasks met >= every baseline's, throughput >= vllm and >= 0.97x fcfs; +5 points "
            "over fcfs, edf, edf-shed where the calls offered are >= 1.2x capacity",
        ),
        Preset(
            "coding",
            "3.33 req/s: qlm's code-generation goodput and GPU utilisation above round-robin "
            "and power-of-two (CATO: 0.86 vs 0.70 / 0.78; utilisation +41 %); at every rate "
            "qlm's SLO goodput >= every baseline's, throughput >= vllm and >= 0.97x fcfs",
        ),
    )
}
