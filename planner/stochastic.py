"""QLMPolicy: the stochastic planner (QLM §4, §6, §7), policy name ``qlm``.

One replan (``plan``):

1. predict each request's output length (mean, variance, and a Δ-quantile bound) from the
   workload profile (:class:`qlm.estimator.OutputLengthModel`, or the per-request forest), and
   price it on every instance that serves its model at the batch that instance actually runs
   (the KV share the agent fills, at the duration-weighted context of the queued mix);
2. per request and instance: its *occupancy* (what it adds to the wait of everyone behind it,
   eq. 2) and its *latest start*: the deadline minus its own prefill and decode at the length
   bound (eqs. 1, 4). A request that misses even if it started now is hopeless: it goes
   straight to the best-effort tail;
3. candidate orders: request-level EDF on latest starts (each request to the instance where it
   starts first, model switches priced), and the group plan (:func:`qlm.grouping.build_groups`,
   Algorithm 1; greedy incumbent, local search, rolling-horizon MILP, :mod:`qlm.planner.milp`) that
   decides placement and model runs;
4. every candidate is walked queue by queue with per-request feasibility (Moore-Hodgson): a
   request predicted to miss where it stands either displaces the costliest request of the
   same model run ahead of it (when that lets it in: one for one, cheaper work kept) or is
   demoted to the best-effort tail, so work that can no longer make its deadline stops
   consuming capacity that feasible work needs;
5. the candidate with the most requests predicted to meet their SLO wins; ties go to fewer
   model switches, then the shorter makespan (a tie no longer hands the drain to EDF).

The queue of an instance is its kept requests in order, then the tail: first the requests
displaced but still able to make it (by latest start), then the hopeless ones (FCFS). Also in
the plan's ``meta``: ``lso`` (per instance: active/warm/cold models, whether the head should
preempt the running batch and by swap or eviction) and ``scale_up`` (how many more instances of
which GPU type would make the plan feasible). ``place`` decides an arrival in O(instances ·
log n): its latest start against the planned work due before it on each instance; feasible, it
sorts at its EDF position within its model's run (never into another model's), ahead of the
tail; infeasible, into the tail, and a replan is asked for when one could make room for it.
Between replans, kept work whose latest start has passed is moved to the tail as it reaches
the head of its queue (``stale_key``).
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from heapq import heappush
from itertools import repeat
from math import sqrt
from typing import Any

import numpy as np
import structlog
from scipy.special import ndtr

from qlm.engine_scheduler import KV_SATURATED_FRACTION
from qlm.estimator import HardwareProfile, OutputLengthModel, RCTEstimator, normal_quantile
from qlm.grouping import GroupingConfig, build_groups, load_clustering
from qlm.planner.group_search import WorkClock, iterated_local_search, local_search
from qlm.planner.milp import (
    GroupProblem,
    budget_limits,
    evaluate_queues,
    greedy_assign,
    head_order_scores,
    queue_times,
    solve_slots,
)
from qlm.policy import (
    CompletionObservation,
    InstanceLSO,
    Plan,
    PlanInstance,
    PlanRequest,
    QueuePolicy,
)
from qlm.service_gain import W_IN, W_OUT

log = structlog.get_logger(__name__)

FEASIBLE, TAIL = 0, 1  # first element of a sort key: kept work, then the best-effort tail
ALIVE, HOPELESS = 0, 1  # second element of a tail key
PENDING_MAX = 64  # arrivals since the plan kept apart per instance before being merged in
LENGTHS_SEEN_MAX = 4096  # (model, class, max_tokens) answers kept between completions
ARRIVAL_KEYS_MAX = 65_536  # arrival sort keys remembered (only needed right after place())
FLOW_WINDOW = 2048.0  # completions the served mix is averaged over (exponential decay)
FLOW_MIN = 32.0  # completions of a model before its served mix replaces the queued one
DISPATCH_MEMORY = 1024  # requests per instance remembered after they left its queue
LOAD_WINDOW_S = 60.0  # the sure work's arrival rate is averaged over about this long
RECENT_S = 10.0  # ...and whether it still arrives is judged over about this long
CREDIT_MAX_S = 30.0  # long-shot credit is capped at this many seconds of each instance
# long_shot_density: the prices of this many recent long shots give the range the threshold
# moves in (its 5th and 95th percentiles, read again every SHOT_PRICES_EVERY long shots), and
# the gate waits for SHOT_PRICES_MIN of them
SHOT_PRICES_KEPT = 512
SHOT_PRICES_MIN = 64
SHOT_PRICES_EVERY = 64
SHOT_PRICE_QUANTILES = (0.05, 0.95)
# long_shot_odds: each sure arrival's weight in the running mean of sure arrivals' prices (about
# the last 500 arrivals)
SURE_PRICE_WEIGHT = 0.002
# occupancy_learning: the engines' measured occupancy is averaged over about this long, and
# counts once this many instance-seconds of busy queues were seen; the scale stays within
# [OCCUPANCY_SCALE_MIN, 1] of the model's price: only a discount is learnt. Busy queues also
# count time the sure work's price leaves out on purpose (model loads, which the plan prices
# as switches; engines short of KV for their batch): on hetero the ratio read 1.3-2.5, and
# charging the sure work that much cost 2.5 points where long shots still paid off
OCCUPANCY_WINDOW_S = 120.0
OCCUPANCY_MIN_S = 60.0
OCCUPANCY_SCALE_MIN = 0.5
# batch caps tried, as shares of the batch a full instance runs (largest first), and the
# smallest cap ever set: below it the weights' pass dominates an iteration and a smaller
# batch no longer decodes much faster
CAP_SHARES = (0.9, 0.875, 0.8125, 0.75, 0.5, 0.375, 0.25, 0.1875, 0.125)
CAP_MIN = 16
CAP_HOLD_S = 60.0  # a cap stays while latency-bound work was seen this recently
CAP_TTFT_S = 10.0  # a TTFT SLO this short: the work cannot wait long for a slot
# class_lanes: a class is "tight" while its decayed mean of (own time at the length bound) /
# (e2e SLO) is at least LANE_TIGHT (its decode takes most of its SLO, so another class's
# prefills beside it make it miss), "slack" while at most LANE_SLACK (minutes to spare); the
# mean moves by LANE_CLASS_ALPHA per arrival. An instance's mix is counted over about
# LANE_WINDOW_S, as the share of the other kind among its recent lane arrivals, in
# LANE_BUCKETS steps (instances of one step are told apart by their load, not their mix:
# otherwise the one instance with the least of the other kind takes every arrival of a
# kind); tight work skips an instance that took more than LANE_CROWD times the mean share
# of the lane arrivals (a tight lane grows by taking another instance, not by a bigger
# batch on one: with many instances, one would take all of it); slack work waits up
# to LANE_WAIT of its slack on a slack instance before it joins tight work; lanes hold while
# the arrivals' load is below LANE_MAX_LOAD of the fleet
LANE_TIGHT = 0.5
LANE_SLACK = 0.25
LANE_CLASS_ALPHA = 0.02
LANE_WINDOW_S = 60.0
LANE_BUCKETS = 4
LANE_CROWD = 1.25
LANE_WAIT = 0.5
LANE_MAX_LOAD = 0.95
LANE_RESCALE_AT = 460.0  # the forward-decay exponent (weight ~1e200) where counts scale back
_SUITS = (False, False, False, 0)  # a lane rank's best (no switch, not late, not crowded, own lane)
# the request-level EDF walk scans up to this many candidate instances of a model; more are
# kept sorted by start (the same choice, found without computing every lane's start)
SCAN_LANES_UP_TO = 8


def _spread_s(slo_s: float | None) -> float:
    """The time an arrival's occupancy is spread over in the sure load: its SLO, rounded
    down to LOAD_WINDOW_S times a power of two (a handful of decayed sums), at least
    LOAD_WINDOW_S."""
    if slo_s is None or not slo_s > 2 * LOAD_WINDOW_S or not math.isfinite(slo_s):
        return LOAD_WINDOW_S
    return LOAD_WINDOW_S * 2.0 ** math.floor(math.log2(slo_s / LOAD_WINDOW_S))


@dataclass(frozen=True)
class QLMConfig:
    slo_quantile: float = 0.9  # Δ of eq. 12; also the quantile of the output-length bound
    grouping: GroupingConfig = field(default_factory=GroupingConfig)
    # Until completions are observed, assume each request may use its whole max_tokens (the
    # conservative prior); "sharegpt" etc. use a shipped length table instead.
    output_prior: str = "max_tokens"
    # "normal": the per-group fit above; "forest": per-request quantile regression forest once
    # it has 256 completions of a model (qlm/length_forest.py, docs/length-bound.md)
    length_model: str = "normal"
    # keep max_tokens out of the forest's features: the simulator derives it from the true
    # output (max_tokens = ceil(output × slack)), which would leak the answer
    length_cap_feature: bool = True
    time_budget_s: float = 0.3  # improvement phases stop here (measured from plan() start)
    scale_up_budget_s: float = 0.05
    head_groups: int = 6  # rolling horizon: groups per queue ordered exactly by the MILP
    milp_time_limit_s: float = 0.15
    # with budget_clock "work": the MILP stops after this many branch-and-bound nodes, and
    # its wall-clock limit (milp_time_limit_s × WORK_SAFETY_FACTOR) is only a safety net.
    # The heads solve at the root node (wb-512, wa: every solve); their wall time, up to
    # 0.11 s on a loaded machine, came close to the 0.15-s limit a published run must not
    # depend on
    milp_node_limit: int = 200
    max_milp_queues: int = 8
    # heads this short are ordered by scoring every order (6! = 720 rows at once), not by the
    # MILP: exact over the whole queue, where the MILP orders the head alone, and a few ms
    # where building the MILP in cvxpy took ~0.1 s
    enumerate_up_to: int = 6
    local_search_max_groups: int = 400
    ils_max_groups: int = 60  # iterated local search (perturb + descend) up to this many groups
    solver: str = "HIGHS"
    # "wall": budgets are wall-clock seconds (live); "work": a WorkClock, so the same inputs
    # give the same plan on any machine (the simulator's default)
    budget_clock: str = "wall"
    max_plan_age_s: float = 30.0
    # Overdue by more than this × its own SLO: served first, ahead of work that can still
    # meet its SLO. Off by default: every request served late in sustained overload displaces
    # one that could have made it, and once the feasible work is done the tail is served
    # oldest first anyway; a finite factor bounds the wait of hopeless requests at that cost
    starvation_factor: float = math.inf
    scale_up_max: int = 256
    # what the plan maximises: "attainment" (requests meeting their SLO, the QLM paper) or
    # "service-gain" (Tempo: w_in·prompt + w_out·output tokens of the requests meeting it)
    objective: str = "attainment"
    # Share of the KV cache the running batch fills: the agent stops pulling above the
    # engine's saturation threshold, so the batch it runs is this share of the cache over the
    # context a running sequence holds, not the whole cache (the batch the per-token time and
    # Θ are taken at)
    kv_fill: float = KV_SATURATED_FRACTION
    # Per-request feasibility (Moore-Hodgson displacement, best-effort tail). False keeps
    # every request in its candidate's order (the comparison point for what demotion buys)
    demote: bool = True
    # Candidate orders from the group plan (greedy, local search, MILP) beside request-level
    # EDF; they decide model runs where instances serve several models
    group_candidates: bool = True
    # Improve the group plan (local search, rolling-horizon MILP) also when every queued
    # request is of one model. Off: 40-75 % less planner time in such runs, and up to 2
    # points lost where the improved plan won its ties (trace; docs/planner.md, 5)
    improve_one_model: bool = True
    # The output-length quantile at which a request counts as able to meet its SLO in the
    # per-request walk (None: Δ). Clients send caps, not lengths, so a request's length is
    # known only as a distribution: a Δ-quantile calls every interactive request of a typical
    # mix hopeless, although its short outputs would meet if served first.
    feasible_quantile: float | None = None
    # Long shots (None: off): a request that misses at feasible_quantile even if started now,
    # but not at this lower quantile, may still meet if its output is short. It is walked at
    # this quantile's latest start and worth its chance P(output fits the time left), so it
    # is kept where it only uses slack: work worth more per second of occupancy displaces it
    # (the walk maximises expected attainment), and below this chance it is hopeless.
    long_shot_quantile: float | None = 0.05
    # Long shots may borrow capacity beyond the spare capacity saved up: the sure work queued
    # behind them then waits longer. They may owe at most this fraction of the shortest SLO
    # among the sure arrivals of the last LOAD_WINDOW_S, per instance: work with minutes of
    # slack (a batch class) lends minutes, work with seconds lends seconds. 0: spare only
    long_shot_borrow: float = 0.5
    # The fraction instead while the sure work's measured load is below the capacity (its own
    # queue does not grow, so its slack is not eaten by its own backlog and more of it can be
    # lent). None: long_shot_borrow always (docs/planner.md, "Long shots")
    long_shot_borrow_stable: float | None = 0.75
    # Which long shots spend the borrowed capacity: an online knapsack (Zhou, Chakrabarty and
    # Lukose, WINE 2008). A long shot is worth its chance, which its class's length
    # distribution sets alike for every arrival of the class, and costs its charge (mostly
    # its prompt), so a cheaper one buys more chance per second of debt: while long shots owe
    # nothing any is taken, as the debt nears its floor only those priced near the cheapest
    # recent ones. Off by default: it pays where long shots seldom meet (wb, trace x3) and
    # costs where they mostly do (wb-512; docs/planner.md, "Long shots"). False: any long
    # shot the credit allows, first come, first served
    long_shot_density: bool = False
    # Which long shots may add to the debt: while long shots owe (the credit below 0), one is
    # taken only if its chance of meeting, per second of its priced occupancy, is at least
    # this fraction of a sure arrival's (1 per the mean priced occupancy of recent sure
    # arrivals), scaled by how deep the debt is (0 at no debt, 1 at its floor). Its chance is
    # P(output fits the time left) at the fastest eligible instance with nothing ahead, from
    # the length model's mean and variance: an optimistic figure, so the bar is below 1. In
    # overload this keeps the debt for long shots that mostly meet (wb 16: +1.4 points, trace
    # x3 +1.0; docs/planner.md, "Long shots"). None: any long shot the credit allows
    long_shot_odds: float | None = 0.4
    # Batch caps (the LSO InstanceLSO.max_in_engine): where an instance's queue holds work
    # whose decode at the full batch takes much of its SLO, the smallest batch at which the
    # sure work still keeps up (its arrival rate and the backlog's deadlines), so that the
    # latency-bound requests decode faster. False: never cap
    batch_cap: bool = True
    # Run consolidation: in the chosen plan, a model run is moved to join a later run of its
    # model (or to the end of its queue) when every request predicted to meet still meets:
    # one model load less each time, and arrivals of that model join the run meanwhile.
    # False keeps the candidates' runs as walked
    consolidate_runs: bool = True
    # the sure work's load on an instance at the capped batch, at most (1: all of it), where
    # the instance carries it uncapped: a cap may not tip it into an overload (in one
    # already, cap_throughput_min alone bounds what a cap costs)
    cap_load_max: float = 1.0
    # The sure work's rate in the engines' measured occupancy: scaled by (instance-seconds of
    # queues that stayed busy between two plans) / (the priced occupancy of what their engines
    # finished meanwhile), so a price that is off (prompts prefilled beside a decode batch cost
    # less than a standalone prefill) does not leave long shots less capacity, or more, than
    # the sure work leaves. False: the price as modelled (docs/planner.md, "Long shots")
    occupancy_learning: bool = True
    # With occupancy_learning, a long shot's charge moves from its price towards the measured
    # scale by the sure work's share of the occupancy that arrived lately. Sure work with
    # slack absorbs a long shot that costs more than charged; where nearly all work is long
    # shots nothing does, and the price's margin keeps them from crowding each other out
    # (charged at the scale itself, trace x3 lost 6 points). False: charged their price
    long_shot_measured_charge: bool = True
    # a cap costs throughput: at least this share of the full batch's is kept. Lower it to
    # trade throughput for latency-bound requests met (docs/planner.md, "Batch caps")
    cap_throughput_min: float = 0.98
    # Class lanes: while the fleet is below capacity, an arrival of a class
    # whose decode takes most of its SLO ("tight") goes, among the instances where it meets
    # its deadline, to one that took the least slack-rich work lately, and work with minutes
    # to spare ("slack") to one that took the least tight work, so that the slack work's
    # prefills do not slow the tight work's decode. A placement rule: replans may still mix
    # them (docs/planner.md, "Class lanes")
    class_lanes: bool = True

    def __post_init__(self) -> None:
        if not 0.5 <= self.slo_quantile < 1:
            raise ValueError("slo_quantile (Δ) must be in [0.5, 1)")
        if self.feasible_quantile is not None and not 0 < self.feasible_quantile < 1:
            raise ValueError("feasible_quantile must be in (0, 1)")
        if self.long_shot_quantile is not None and not 0 < self.long_shot_quantile < 1:
            raise ValueError("long_shot_quantile must be in (0, 1)")
        if not 0 <= self.long_shot_borrow <= 1:
            raise ValueError("long_shot_borrow must be in [0, 1]")
        if self.long_shot_odds is not None and self.long_shot_odds < 0:
            raise ValueError("long_shot_odds must be >= 0")
        if self.long_shot_borrow_stable is not None and not 0 <= self.long_shot_borrow_stable <= 1:
            raise ValueError("long_shot_borrow_stable must be in [0, 1]")
        if self.budget_clock not in ("wall", "work"):
            raise ValueError("budget_clock must be 'wall' or 'work'")
        if self.time_budget_s < 0 or self.head_groups < 1:
            raise ValueError("time_budget_s must be >= 0 and head_groups >= 1")
        if self.objective not in ("attainment", "service-gain"):
            raise ValueError("objective must be 'attainment' or 'service-gain'")
        if not 0 < self.kv_fill <= 1:
            raise ValueError("kv_fill must be in (0, 1]")
        if not 0 < self.cap_throughput_min <= 1 or self.cap_load_max <= 0:
            raise ValueError("cap_throughput_min must be in (0, 1] and cap_load_max > 0")


@dataclass
class _Priced:
    """Per-request arrays of one replan, in canonical order."""

    reqs: list[PlanRequest]
    model_idx: np.ndarray
    prompt: np.ndarray
    out_mean: np.ndarray
    out_var: np.ndarray
    out_bound: np.ndarray  # the Δ-quantile of the output length (the feasibility bound)
    out_shot: np.ndarray  # the long-shot quantile of it (out_bound where long shots are off)
    deadline: np.ndarray  # effective e2e deadline, s from now (inf: none)
    e2e: np.ndarray  # e2e deadline only, s from now
    ttft: np.ndarray  # ttft deadline, s from now
    seq: np.ndarray
    # what meeting each request's SLO is worth: 1 (attainment), or its expected service gain
    # over the mean one (service-gain; normalised so the tie-break weights keep their scale);
    # times its chance of meeting for a long shot (set by _tables)
    value: np.ndarray


@dataclass(frozen=True)
class _Rate:
    """One (instance, model)'s timing at the batch it runs: what place() needs."""

    token_s: float  # seconds per output token of one request inside the batch (ε·d)
    prefill_fixed_s: float
    prefill_s_per_token: float
    inv_prefill_tps: float  # 1/Π
    inv_tps: float  # 1/Θ
    switch_s: float  # loading the model (warm or cold)

    @classmethod
    def of(cls, capacity: HardwareProfile, latency: HardwareProfile, switch_s: float) -> _Rate:
        """Occupancy from the full batch's throughput, own time from the batch run now."""
        return cls(
            latency.token_time_s,
            latency.prefill_fixed_s,
            latency.prefill_s_per_token,
            1.0 / capacity.prefill_tps,
            1.0 / capacity.throughput_tps,
            switch_s,
        )


@dataclass
class _Tables:
    """Per request × instance timing of one replan (seconds; s from now for the starts).

    The (n, C) tables hold one column per *lane class*: instances with the same profiles for
    every model (one GPU shape serving one set of models) have identical columns, so they
    share one. Instance ``g``'s column is ``col[g]``. A fleet of 32 instances of a few shapes
    holds a few columns, not 32 (100k requests: 36 MB instead of 180 MB per replan)."""

    occ: np.ndarray  # (n, C) occupancy: what it adds to the wait of those behind it (eq. 2)
    occ_var: np.ndarray  # (n, C) its variance
    own: np.ndarray  # (n, C) prefill + decode at the length bound, once started (eqs. 1, 4)
    # (n, C) the same at the mean length: what the plan predicts (RCT), while feasibility and
    # the order are judged at the bound
    own_mean: np.ndarray
    lst: np.ndarray  # (n, C) latest start that meets every deadline (-inf: not served there)
    switch: np.ndarray  # (I, M) loading each model
    swap: np.ndarray  # (I, M) a new run of each model: the drain before it and the load
    drain: np.ndarray  # (I,) until the running batch has finished (before a model switch)
    first_slot: np.ndarray  # (I,) until a running request frees a slot (0: one is free)
    evict: np.ndarray  # (I,) evicting the running batch: recomputing (or swapping) its KV
    init_model: np.ndarray  # (I,) model index loaded now, -1: none or unknown
    prio: np.ndarray  # (n,) starving: kept first, whatever it costs
    cost: np.ndarray  # (n,) displacement order: occupancy per unit of value (largest goes)
    has_deadline: np.ndarray  # (n,)
    model_idx: np.ndarray  # (n,)
    col: list[int]  # (I,) each instance's column in the (n, C) tables

    def served(self, k: int) -> list[int]:
        """The instances that serve request ``k`` (a finite occupancy there), in order."""
        finite = np.isfinite(self.occ[k])
        return [g for g, c in enumerate(self.col) if finite[c]]


@dataclass(slots=True)
class _Lane:
    """One instance's queue while a candidate order is walked (slots: the walks read and
    write its fields once per request)."""

    t: float = 0.0  # when the next request of the current run would start
    var: float = 0.0  # variance of t (sum of the occupancies' variances)
    model: int = -1  # model of the current run (-1: none yet)
    run_end: float = 0.0  # latest completion in the current run: a switch waits for it
    sd: float = 0.0  # sqrt(var), kept beside it: read for every request the walk places
    heap: list[tuple[float, int]] = field(default_factory=list)  # (-cost, k): this run's kept
    kept: list[int] = field(default_factory=list)
    later: list[int] = field(default_factory=list)  # no-deadline requests displaced: still met
    switches: int = 0


@dataclass
class _Walk:
    """A candidate after the feasibility walk."""

    lanes: list[_Lane]
    tail: list[int]  # demoted (displaced or hopeless), not yet on an instance
    met: int
    worth: float
    switches: int
    makespan: float


@dataclass
class _LaneState:
    """What place() knows of an instance's queue since the last plan: the planned kept work
    sorted by key (latest start, running max) with its work tokens, and the arrivals since."""

    due: np.ndarray  # running max of the kept requests' latest starts (absolute s)
    tokens: np.ndarray  # work tokens of each kept request
    cum: np.ndarray  # prefix sums of tokens (len + 1)
    slack: np.ndarray  # suffix minimum of the kept requests' slack (s), len + 1 (inf at end)
    s_per_token: float  # occupancy seconds per work token on this instance
    placed: float  # work tokens planned or placed here since the plan (kept and tail)
    models: set[str] = field(default_factory=set)  # models it holds work of, or has loaded
    ranks: dict[str, int] = field(default_factory=dict)  # model -> its run in the tail
    swap_s: float = 0.0  # a new model run here: the drain before it (the load is per model)
    pending_due: list[float] = field(default_factory=list)  # arrivals since the plan, sorted
    pending_tokens: list[float] = field(default_factory=list)
    added_s: float = 0.0  # occupancy of feasible arrivals since the plan
    # the plan's model runs over the kept work, in order: (model, first key, last key)
    runs: list[tuple[str, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # bisect and scalar reads on Python lists: on numpy arrays each comparison boxes a
        # numpy scalar, several times slower, and place() runs once per instance per arrival
        self._due: list[float] = self.due.tolist()
        self._cum: list[float] = self.cum.tolist()
        self._slack: list[float] = self.slack.tolist()

    @classmethod
    def empty(cls, s_per_token: float, swap_s: float = 0.0) -> _LaneState:
        return cls(
            np.zeros(0),
            np.zeros(0),
            np.zeros(1),
            np.full(1, np.inf),
            s_per_token,
            0.0,
            swap_s=swap_s,
        )

    def ahead_tokens(self, due: float, load: float) -> float:
        """Work tokens still queued here ahead of a request whose key is ``due``: the kept
        work due no later, less what was dispatched since (the head goes first), plus the
        arrivals since the plan that sort before it, plus any queued work this state does not
        know (queued without place(), or before the first plan), counted as ahead."""
        if load <= 0.0:
            return 0.0  # nothing queued here
        dispatched = max(0.0, self.placed - load)
        unknown = max(0.0, load - self.placed)
        ahead = max(0.0, self._cum[bisect.bisect_right(self._due, due)] - dispatched)
        if not self.pending_due:
            return unknown + ahead
        k = bisect.bisect_right(self.pending_due, due)
        return unknown + ahead + sum(self.pending_tokens[:k])

    def sort_due(self, model: str, due: float, load: float) -> tuple[float, float | None]:
        """The key an arrival of ``model`` whose latest start is ``due`` sorts at, and a
        second one to try where it misses at the first (or None): its EDF position in the run
        the engine serves now (the first planned run not yet dispatched) when that is of its
        model; else within its model's next planned run; else a new run after all the planned
        work (the arrivals of its model that follow join it there), or, where it misses
        there, right after the current run. Sorted into another model's run, it would switch
        the engine mid-run: a drain it waits for, and a load back afterwards."""
        runs = self.runs
        dispatched = max(0.0, self.placed - load)
        current = 0
        while current < len(runs):
            last = runs[current][2]
            if self._cum[bisect.bisect_right(self._due, last)] > dispatched:
                break
            current += 1
        if current == len(runs) or runs[current][0] == model:
            return due, None
        for m, first, last in runs[current + 1 :]:
            if m == model:
                return min(max(due, first), last), None
        return max(due, runs[-1][2]), max(due, runs[current][2])

    def slack_after(self, due: float) -> float:
        """The least slack among the kept requests that sort after a key ``due``."""
        return self._slack[min(bisect.bisect_right(self._due, due), len(self._slack) - 1)]

    def add_pending(self, due: float, tokens: float) -> None:
        k = bisect.bisect_right(self.pending_due, due)
        self.pending_due.insert(k, due)
        self.pending_tokens.insert(k, tokens)
        if len(self.pending_due) > PENDING_MAX:
            self._merge()

    def _merge(self) -> None:
        """Fold the arrivals into the sorted arrays (amortised: once every PENDING_MAX)."""
        pos = np.searchsorted(self.due, self.pending_due, side="right")
        self.due = np.insert(self.due, pos, self.pending_due)
        self.tokens = np.insert(self.tokens, pos, self.pending_tokens)
        self.cum = np.concatenate(([0.0], np.cumsum(self.tokens)))
        self.slack = np.insert(self.slack, pos, np.inf)
        self.slack = np.minimum.accumulate(self.slack[::-1])[::-1]
        self._due, self._cum, self._slack = (
            self.due.tolist(),
            self.cum.tolist(),
            self.slack.tolist(),
        )
        self.pending_due, self.pending_tokens = [], []


class QLMPolicy(QueuePolicy):
    name = "qlm"
    keeps_state = (
        "the last plan's sort keys, lanes and timings (sort_key and place read them), the output-"
        "length model and arrival statistics (observe_completion and place write them)"
    )

    def __init__(self, config: QLMConfig | None = None, **overrides: Any) -> None:
        cfg = config or QLMConfig()
        if overrides:
            from dataclasses import replace

            cfg = replace(cfg, **overrides)
        self.config = cfg
        load_clustering()  # seconds of imports, here and not in the first replan
        self.z = normal_quantile(cfg.slo_quantile)
        self._clock: Callable[[], float] = (
            WorkClock() if cfg.budget_clock == "work" else time.perf_counter
        )
        self._forest_lengths = cfg.length_model == "forest"
        if cfg.length_model == "forest":
            from qlm.length_forest import ForestLengthModel, QuantileLengthPredictor

            lengths: OutputLengthModel = ForestLengthModel(
                cfg.output_prior,
                forest=QuantileLengthPredictor(cap_feature=cfg.length_cap_feature),
                auto_refresh=False,  # _maybe_refresh_forest: off the event loop when live
            )
        elif cfg.length_model == "normal":
            lengths = OutputLengthModel(cfg.output_prior)
        else:
            raise ValueError(f"length_model must be normal or forest, got {cfg.length_model!r}")
        self.estimator = RCTEstimator(lengths)
        self._forest_refresh: asyncio.Task[Any] | None = None
        # -- state kept between plans for place()/sort_key()/wants_replan()
        self._keys: dict[str, tuple[Any, ...]] = {}  # the last plan's sort keys
        self._arrival_keys: dict[str, tuple[Any, ...]] = {}  # arrivals placed since
        self._lanes: dict[str, _LaneState] = {}
        self._rates: dict[tuple[str, str], _Rate] = {}
        self._default_rates: dict[tuple[Any, ...], _Rate] = {}  # before a plan priced them
        self._ctx: dict[str, tuple[float, float]] = {}  # model -> (context, prompt ratio)
        # model -> decayed [completions, Σ output, Σ prompt, Σ output·(prompt + output/2)]
        self._flow: dict[str, list[float]] = {}
        self._planned_at: float | None = None
        self._violation = False
        self._arrivals_since_plan = 0
        self._half_out: dict[int, float] = {}
        self._last_detail: tuple[dict[str, float], float] | None = None
        self._models: list[str] = []  # of the plan being made
        # what the plan does not see: the requests running on each instance. A request this
        # policy placed or planned that is gone from the next snapshot left its queue in
        # between; the latest ones to leave an instance are what runs there now
        # id -> (iid, model, output, when, prompt); iid -> (model, output, left at, prompt)
        self._seen: dict[str, tuple[str, str, float, float, int]] = {}
        # the bound on _seen: a plan keeps every request it queued (a backlog larger than
        # ARRIVAL_KEYS_MAX must not be taken for work that left its queue)
        self._seen_max = ARRIVAL_KEYS_MAX
        self._left: dict[str, deque[tuple[str, float, float, int]]] = {}
        self._tail_ranks: list[dict[str, int]] = []  # per instance: model -> its tail run
        self._head_due: list[list[float]] = []  # per instance: its kept work's sort-key dues
        # long shots spend only the capacity sure work leaves: the occupancy of sure arrivals
        # (_sure_rate) against the instances, and the credit the rest accrues. Per spread
        # (_spread_s of the SLO): the decayed Σ occupancy (s) of the arrivals that can meet at
        # Δ over LOAD_WINDOW_S, over the spread, and over RECENT_S
        self._sure_load: dict[float, list[float]] = {}
        self._credit = 0.0  # instance-seconds long shots may still take
        self._load_at: float | None = None
        self._load_since: float | None = None  # the first arrival's time (the load's warm-up)
        # (arrival time, SLO s) of sure arrivals, SLOs increasing: the window's minimum first
        self._sure_slos: deque[tuple[float, float]] = deque()
        self._shots: set[str] = set()  # long shots admitted, still queued
        # long shots' priced occupancy that arrived, decayed over LOAD_WINDOW_S (the sure
        # work's share of what arrived weighs a long shot's charge)
        self._shot_load = 0.0
        # long_shot_density: recent long shots' prices, their (5th, 95th) percentiles, and
        # how many long shots arrived since those were read
        self._shot_prices: deque[float] = deque(maxlen=SHOT_PRICES_KEPT)
        self._shot_price_range: tuple[float, float] | None = None
        self._shot_prices_new = 0
        # long_shot_odds: the running mean priced occupancy (s) of sure arrivals
        self._sure_price = 0.0
        # occupancy_learning: priced occupancy that left each instance's queue since the last
        # plan, the instances whose queues held work at it, and the decayed sums (busy
        # instance-seconds, priced occupancy that left busy queues) the scale is read from
        self._occ_left: dict[str, list[float]] = {}  # iid -> [requests, priced occupancy]
        self._busy: dict[str, int] = {}  # iid -> requests in its engine at the last plan
        self._occ_at: float | None = None
        self._occ_busy_s = 0.0
        self._occ_priced_s = 0.0
        # _lengths_of's answers while the length model stays at one version (place() asks
        # for every arrival; a per-group fit answers the same between completions)
        self._lengths_seen: dict[tuple[str, str | None, int], tuple[float, float, float]] = {}
        self._lengths_at: tuple[OutputLengthModel, int] | None = None  # whose, which version
        # and the (mean, variance) the odds gate asks of long shots, kept the same way
        self._moments_seen: dict[tuple[str, str | None, int], tuple[float, float]] = {}
        self._bound_at: dict[str, float] = {}  # model -> when a plan last saw latency-bound work
        self._ttft_at = -math.inf  # when a plan last saw work with a TTFT SLO of seconds
        # instance id -> when the cap the last plan set there lapses unless a plan sees
        # latency-bound work of its model again (lapsed_caps)
        self._cap_lapse: dict[str, float] = {}
        # class_lanes: per SLO class, the decayed mean of own time / SLO; per instance, its
        # tight and slack arrivals placed, each weighted exp((t - _lane_t0) / LANE_WINDOW_S)
        # (forward decay: a share of one kind needs no decay of its own, being a ratio)
        self._lane_ratio: dict[str | None, float] = {}
        self._lane_mix: dict[str, dict[str, float]] = {}
        self._lane_t0: float | None = None

    # ------------------------------------------------------------------ interface
    def sort_key(self, request: PlanRequest) -> tuple[Any, ...]:
        """(FEASIBLE, latest start (running max along the planned order), position, seq) for
        kept work: an arrival's (FEASIBLE, its latest start, inf, seq) lands at its EDF
        position among it. The best-effort tail: (TAIL, ALIVE, model run, latest start, seq)
        for what could still make it, then (TAIL, HOPELESS, model run, arrival, seq): in model
        runs, so serving it late does not add switches. A request this policy never saw
        sorts into the tail by its deadline."""
        rid = request.request_id
        key = self._arrival_keys.get(rid) or self._keys.get(rid)
        if key is not None:
            return key
        return (TAIL, ALIVE, 0, request.effective_deadline, request.seq)

    def stale_key(
        self, request: PlanRequest, key: tuple[Any, ...], instance_id: str, now: float
    ) -> tuple[Any, ...] | None:
        """Kept work whose latest start (its key's second element, at least its own) passed
        since the plan can no longer meet at the length bound: it joins the hopeless tail now
        instead of going first, ahead of work that can still make it, until the next replan
        (in overload replans come tens of seconds apart, and EDF order puts exactly these
        requests at the head)."""
        if key[0] != FEASIBLE or not self.config.demote or key[1] >= now:
            return None
        lane = self._lanes.get(instance_id)
        run = lane.ranks.setdefault(request.model, len(lane.ranks)) if lane is not None else 0
        new = (TAIL, HOPELESS, run, request.arrival_time, request.seq)
        rid = request.request_id
        self._arrival_keys.pop(rid, None)
        self._keys[rid] = new
        self._shots.discard(rid)
        return new

    def observe_completion(self, obs: CompletionObservation) -> None:
        lengths = self.estimator.lengths
        lengths.observe(
            obs.model,
            obs.slo_class,
            obs.output_tokens,
            prompt_tokens=obs.prompt_tokens,
            max_tokens=obs.max_tokens,
            tenant=obs.tenant,
        )
        if obs.prompt_tokens is not None:
            # the mix the engine actually runs: what finishes, not what waits (a backlog in
            # overload holds the requests nobody serves)
            o, p, keep = (
                float(max(obs.output_tokens, 1)),
                float(obs.prompt_tokens),
                1.0 - 1.0 / FLOW_WINDOW,
            )
            f = self._flow.setdefault(obs.model, [0.0, 0.0, 0.0, 0.0])
            f[0], f[1], f[2] = f[0] * keep + 1.0, f[1] * keep + o, f[2] * keep + p
            f[3] = f[3] * keep + o * (p + o / 2)
        if self._forest_lengths:
            self._maybe_refresh_forest()

    def _maybe_refresh_forest(self) -> None:
        """Retrain the length forest when due: in a worker thread when an event loop runs (the
        live coordinator: a refresh costs ~0.3 s of CPU), inline otherwise (the simulator,
        whose clock is virtual)."""
        from qlm.length_forest import ForestLengthModel

        lengths = self.estimator.lengths
        assert isinstance(lengths, ForestLengthModel)
        if not lengths.forest.refresh_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            lengths.forest.refresh()
            return
        if self._forest_refresh is None or self._forest_refresh.done():
            self._forest_refresh = loop.create_task(lengths.forest.refresh_async())

    def predicted_completions(self) -> dict[str, float]:
        """Completion time of every request of the last plan at the chance level Δ (with
        Δ = 0.5, the RCT estimator's mean), the tail after the kept work of its queue."""
        if self._last_detail is None:
            return {}
        rel, planned_at = self._last_detail
        return {rid: planned_at + c for rid, c in rel.items()}

    def dispatch_estimate(
        self, request: PlanRequest, instance: PlanInstance, now: float
    ) -> float | None:
        """§6 with what is known at dispatch. Its wait in the queue is over; what is left is a
        drain and a load when another model is resident, then its own prefill and decode at
        the length model's mean (eqs. 1, 4) in the batch the instance runs now:
        ``instance.running`` sequences (this one included; at most its batch cap). The others
        hold the context the last plan priced a batch at and are replaced as they finish, their
        successors' prompts prefilled beside it (that plan's prompt ratio); this one holds its
        own prompt and half its predicted output. Alone on an instance, this is its solo time:
        its prefill and its decode at batch 1.

        The mix is the last plan's, not the completions' of this moment: right after a burst
        the first to finish are the shortest answers, whose prompt ratio (150 once, on the rct
        static queue) prices a prefill beside every decode step for the whole batch."""
        model = request.model
        prompt = float(request.prompt_tokens)
        mean, var = self.estimator.lengths.predict(
            model,
            request.slo_class,
            np.array([max(request.max_tokens, 1)], dtype=np.float64),
            prompt_tokens=np.array([prompt]),
        )
        out_mean, out_var = float(mean[0]), float(var[0])
        resident = instance.active_model in (None, model)
        batch = max(instance.running, 1) if resident else 1
        if instance.max_in_engine is not None:
            batch = min(batch, instance.max_in_engine)
        mix_ctx, mix_ratio = self._ctx.get(model, (1024.0, 0.0))
        others = (batch - 1) / batch
        ctx = others * mix_ctx + (prompt + out_mean / 2) / batch
        hw = self._hw(instance, model, ctx, others * mix_ratio, batch=batch)
        wait = 0.0
        if not resident:  # the resident model's batch drains first (strict FCFS), then a load
            _, drain, _ = self._running(instance, -1, {}, {}, [], now)
            wait = drain + self._switch(instance, hw, model)
        left = self.estimator.estimate_dispatched(
            hw, prompt_tokens=prompt, out_mean=out_mean, out_var=out_var, wait_s=wait
        )
        return now + left.mean

    def wants_replan(self, now: float) -> bool:
        if self._planned_at is None:
            return self._arrivals_since_plan > 0
        if self._violation:
            return True
        return now - self._planned_at > self.config.max_plan_age_s and self._arrivals_since_plan > 0

    def lapsed_caps(self, now: float) -> list[str]:
        """A cap costs throughput: once no plan has seen latency-bound work of its model for
        CAP_HOLD_S it goes, plan or not (plans need arrivals and queued work; a drain after
        the last latency-bound arrival ran capped to its end). Lifting it needs no replan,
        which would reshuffle the queues and model runs for nothing."""
        gone = [iid for iid, until in self._cap_lapse.items() if now > until]
        for iid in gone:
            del self._cap_lapse[iid]
        return gone

    def place(
        self,
        request: PlanRequest,
        instances: Sequence[PlanInstance],
        load: Mapping[str, float],
        now: float,
    ) -> str | None:
        """The instance where the arrival starts first among those where it meets its SLO
        (its latest start against the planned work due before it there, model switch
        priced), else the least loaded one, into the tail. O(instances · log n)."""
        model = request.model
        eligible = [i for i in instances if not i.draining and model in i.models]
        if not eligible:
            return None
        self._arrivals_since_plan += 1
        out_mean, out_bound, out_shot = self._lengths_of(request)
        tokens = float(self.work_tokens(request))
        best: tuple[tuple[Any, ...], PlanInstance, float, float, bool, float] | None = None
        best_infeasible, best_primary = True, math.inf
        # identical instances share their rate: one (due, long shot) for all
        dues: dict[int, tuple[float, bool]] = {}
        # this loop runs once per instance per arrival (a million-request simulation spends
        # most of its coordinator time here): the common paths of _rate, _lane and
        # ahead_tokens are inlined, and a rank tuple is built only for a candidate that can win
        rates_get, lanes_get, load_get = self._rates.get, self._lanes.get, load.get
        # a candidate that meets and starts at once (nothing ahead, no switch) is beaten only
        # by another that does on fewer running requests (then a smaller id): the rest of the
        # instances are compared on that alone, so that an arrival on an idle fleet costs one
        # tuple comparison per instance
        at_once: tuple[int, str] | None = None
        kind = (
            self._lane_kind(request, eligible, out_bound, now) if self.config.class_lanes else None
        )
        crowd = math.inf
        taken: dict[str, float] = {}  # tight work: each instance's lane arrivals, summed once
        if kind == "tight":
            taken = self._lane_taken(eligible)
            crowd = LANE_CROWD * sum(taken.values()) / len(eligible)
        for inst in eligible:
            iid = inst.instance_id
            rate = None
            queued = load_get(iid, 0.0)
            if queued < 0.0:
                queued = 0.0
            lane = lanes_get(iid)
            if lane is None or (queued <= 0.0 and (lane.placed > 0.0 or lane._due)):
                rate = rates_get((iid, model)) or self._rate(inst, model)
                lane = self._lane(iid, queued, rate)
            if at_once is not None and (inst.running, iid) >= at_once:
                continue
            if rate is None:
                rate = rates_get((iid, model)) or self._rate(inst, model)
            priced_due = dues.get(id(rate))
            if priced_due is None:
                pre = rate.prefill_fixed_s + rate.prefill_s_per_token * request.prompt_tokens
                due = _latest_start(request, pre, pre + out_bound * rate.token_s)
                shot = due < now  # a long shot where it can meet at the long-shot bound
                if shot:
                    due = _latest_start(request, pre, pre + out_shot * rate.token_s)
                priced_due = dues[id(rate)] = (due, shot)
            due, shot = priced_due
            # a model the instance holds no work of: a new run (drain, then load)
            held = model in lane.models or inst.active_model in (None, model)
            swap = 0.0 if held else rate.switch_s + lane.swap_s
            runs = lane.runs
            if not runs or (len(runs) == 1 and runs[0][0] == model):
                at, later = due, None
            else:
                at, later = lane.sort_due(model, due, queued)
            ahead = 0.0 if queued <= 0.0 else lane.ahead_tokens(at, queued)
            start = now + ahead * lane.s_per_token + swap
            infeasible = start > due
            if infeasible and later is not None:
                at = later
                ahead = 0.0 if queued <= 0.0 else lane.ahead_tokens(at, queued)
                start = now + ahead * lane.s_per_token + swap
                infeasible = start > due
            primary = queued * lane.s_per_token + swap if infeasible else start
            rank: tuple[Any, ...]
            if kind is None:
                if best is not None and (
                    infeasible > best_infeasible
                    or (infeasible == best_infeasible and primary > best_primary)
                ):
                    continue
                rank = (infeasible, primary, inst.running, iid)
            elif infeasible:
                rank = (True, False, False, 0.0, primary, inst.running, iid)
            else:  # among the instances where it meets: the one whose mix suits it
                late = kind == "slack" and start - now > LANE_WAIT * max(due - now, 0.0)
                # an idle instance suits every kind: a lane whose kind stopped coming (a
                # class no longer tight) must not keep its instances from other work
                step = 0 if queued <= 0.0 and inst.running == 0 else self._lane_step(iid, kind)
                crowded = crowd < math.inf and taken[iid] > crowd
                rank = (False, swap > 0.0, late, crowded, step, primary, inst.running, iid)
            if best is None or rank < best[0]:
                occ = request.prompt_tokens * rate.inv_prefill_tps + out_mean * rate.inv_tps
                best = (rank, inst, due, occ, shot, at)
                best_infeasible, best_primary = infeasible, primary
                # start >= now: none starts sooner (with lanes: nor suits it better)
                if not infeasible and primary <= now and (kind is None or rank[1:5] == _SUITS):
                    at_once = (inst.running, iid)
        assert best is not None
        rank, inst, due, occ, shot, at = best
        infeasible = rank[0]
        if kind is not None:
            self._note_lane(inst.instance_id, kind, now)
        if self.config.long_shot_quantile is not None:
            self._accrue(now, len(eligible))
            if not shot:
                slo = None if request.deadline is None else request.deadline - request.arrival_time
                sums = self._sure_load.setdefault(_spread_s(slo), [0.0, 0.0, 0.0])
                sums[0] += occ
                sums[1] += occ
                sums[2] += occ
                if slo is not None:
                    self._note_sure_slo(now, slo)
                if self._sure_price <= 0.0:
                    self._sure_price = occ
                else:
                    self._sure_price += SURE_PRICE_WEIGHT * (occ - self._sure_price)
            else:
                self._shot_load += occ
                charge = occ * self._shot_charge_scale()
                floor = self._borrow_s(len(eligible)) * len(eligible)
                within = occ <= self._shot_price_limit(occ, floor)
                if (
                    not infeasible
                    and due >= now
                    and within
                    and self._credit - charge >= -floor
                    and self._shot_has_odds(request, eligible, occ, floor, now)
                ):
                    self._credit -= charge
                    self._shots.add(request.request_id)
                elif due >= now:
                    due, infeasible = now - 1.0, True  # no spare capacity: hopeless for now
        iid = inst.instance_id
        lane = self._lanes[iid]
        lane.placed += tokens
        lane.models.add(request.model)
        self._remember(request, iid, out_mean, now)
        if not infeasible:
            key: tuple[Any, ...] = (FEASIBLE, at, math.inf, request.seq)
            lane.add_pending(at, tokens)
            lane.added_s += occ
            # §4: replan when the arrival pushes kept work behind it past its deadline
            if lane.slack_after(at) < lane.added_s:
                self._violation = True
        elif due > now:
            run = lane.ranks.setdefault(request.model, len(lane.ranks))
            key = (TAIL, ALIVE, run, due, request.seq)
            # it can still make it if a costlier request ahead of it gives way: a replan
            # (the Moore-Hodgson walk) decides
            self._violation = True
        else:
            run = lane.ranks.setdefault(request.model, len(lane.ranks))
            key = (TAIL, HOPELESS, run, request.arrival_time, request.seq)
        if len(self._arrival_keys) >= ARRIVAL_KEYS_MAX:
            # the coordinator reads an arrival's key right after place(), and every queued
            # request gets a new one at the next plan: the oldest can go
            for old in list(itertools.islice(self._arrival_keys, ARRIVAL_KEYS_MAX // 2)):
                del self._arrival_keys[old]
        self._arrival_keys[request.request_id] = key
        return iid

    def _lane_kind(
        self, request: PlanRequest, eligible: Sequence[PlanInstance], out_bound: float, now: float
    ) -> str | None:
        """class_lanes: "tight", "slack" or None (no preference) for an arrival, by its
        class's decayed mean of own time at the length bound over its e2e SLO (per class, so
        that one class does not flip between lanes with its members' lengths). Work with a
        TTFT SLO has none: its wait, not its decode speed, decides it; nor has a call of a
        task chain or a program, whose slack is its later calls' too. None too while the
        arrivals' load is near the fleet's capacity: then every instance is needed for
        everything, and keeping classes apart only leaves one lane short."""
        if request.ttft_deadline is not None or request.derived_deadline:
            return None
        if request.deadline is None:
            ratio = 0.0  # no SLO: as slack as can be
        else:
            inst = eligible[0]
            rate = self._rates.get((inst.instance_id, request.model)) or self._rate(
                inst, request.model
            )
            own = (
                rate.prefill_fixed_s
                + rate.prefill_s_per_token * request.prompt_tokens
                + out_bound * rate.token_s
            )
            slo = request.deadline - request.arrival_time
            ratio_or_none = self._lane_ratio.get(request.slo_class)
            if slo > 0:  # not a request past its deadline when it came (a late redelivery)
                x = min(own / slo, 1.0)  # at most "all of it": one outlier moves it little
                ratio_or_none = (
                    x
                    if ratio_or_none is None
                    else ratio_or_none + LANE_CLASS_ALPHA * (x - ratio_or_none)
                )
                self._lane_ratio[request.slo_class] = ratio_or_none
            if ratio_or_none is None:
                return None
            ratio = ratio_or_none
        if LANE_SLACK < ratio < LANE_TIGHT:
            return None
        load = self._occupancy_scale() * (self._sure_rate() + self._shot_load / LOAD_WINDOW_S)
        # the decayed sums start from nothing: over the first minutes they hold only the
        # share 1 - exp(-t / LOAD_WINDOW_S) of a steady rate, so an overload would look like
        # spare capacity while it starts (and its first placements would set the lanes)
        if self._load_since is None:  # no long shots (nothing accrued): from the first one here
            self._load_since = now
        seen = 1.0 - math.exp(-max(now - self._load_since, 0.0) / LOAD_WINDOW_S)
        if load >= LANE_MAX_LOAD * len(eligible) * seen:
            return None
        return "slack" if ratio <= LANE_SLACK else "tight"

    def _lane_step(self, iid: str, kind: str) -> int:
        """The share of the other kind among the lane arrivals placed on ``iid`` lately (0
        where none were), in LANE_BUCKETS steps: 0 for an instance of ``kind``'s lane."""
        counts = self._lane_mix.get(iid)
        if not counts:
            return 0
        own = counts.get(kind, 0.0)
        other = counts.get("slack" if kind == "tight" else "tight", 0.0)
        if own + other <= 0.0:  # counts scaled back to nothing (LANE_RESCALE_AT): none lately
            return 0
        return min(int(LANE_BUCKETS * other / (own + other)), LANE_BUCKETS - 1)

    def _lane_taken(self, instances: Sequence[PlanInstance]) -> dict[str, float]:
        """The (forward-decayed) lane arrivals of either kind placed on each of ``instances``."""
        mix_get = self._lane_mix.get
        return {i.instance_id: sum(mix_get(i.instance_id, {}).values()) for i in instances}

    def _note_lane(self, iid: str, kind: str, now: float) -> None:
        if self._lane_t0 is None:
            self._lane_t0 = now
        exponent = (now - self._lane_t0) / LANE_WINDOW_S
        if exponent > LANE_RESCALE_AT:  # scale every count back (a ratio does not change;
            # after a long quiet spell the old counts may fall to 0.0: no lane work lately)
            back = math.exp(-exponent)
            for counts in self._lane_mix.values():
                for k in counts:
                    counts[k] *= back
            self._lane_t0, exponent = now, 0.0
        weight = math.exp(exponent)
        counts = self._lane_mix.setdefault(iid, {})
        counts[kind] = counts.get(kind, 0.0) + weight

    def _accrue(self, now: float, n_inst: int) -> None:
        """Decay the sure load to ``now`` and credit long shots with the capacity it leaves
        (its rate: the decayed occupancy over LOAD_WINDOW_S, per instance)."""
        if self._load_at is None:
            self._load_at = self._load_since = now
        dt = max(now - self._load_at, 0.0)
        self._load_at = now
        if dt > 0.0:
            fast, recent = math.exp(-dt / LOAD_WINDOW_S), math.exp(-dt / RECENT_S)
            self._shot_load *= fast
            for spread, sums in self._sure_load.items():
                sums[0] *= fast
                sums[1] *= math.exp(-dt / spread)
                sums[2] *= recent
        # demand above capacity drains the credit: what spare capacity was saved up is spent
        # by the backlog of sure work, not left for long shots
        spare = n_inst - self._sure_instances()
        floor = -self._borrow_s(n_inst) * n_inst  # what long shots may owe
        self._credit = min(max(self._credit + spare * dt, floor), CREDIT_MAX_S * n_inst)

    def _learn_occupancy(self, now: float, instances: Sequence[PlanInstance]) -> None:
        """Add the time since the last plan of every instance whose queue held work then and
        holds work now (its engine took work as fast as it served it), and the priced
        occupancy of what its engine finished meanwhile: what left the queue, less what the
        engine holds more than at the last plan (an engine filling its batch takes work
        faster than it serves it), at the mean price of what left. Older sums decay over
        OCCUPANCY_WINDOW_S."""
        queued = {entry[0] for entry in self._seen.values()}
        running = {i.instance_id: i.running for i in instances if i.instance_id in queued}
        if self._occ_at is not None and now > self._occ_at:
            dt = now - self._occ_at
            decay = math.exp(-dt / OCCUPANCY_WINDOW_S)
            self._occ_busy_s *= decay
            self._occ_priced_s *= decay
            for iid, held in running.items():
                before = self._busy.get(iid)
                if before is None:
                    continue
                n, priced = self._occ_left.get(iid, (0.0, 0.0))
                finished = n - (held - before)
                self._occ_busy_s += dt
                if n > 0 and finished > 0:
                    self._occ_priced_s += priced * finished / n
        self._occ_left.clear()
        self._busy = running
        self._occ_at = now

    def _shot_price_limit(self, price: float, floor: float) -> float:
        """The highest price a long shot may have at the current debt (``long_shot_density``):
        with recent prices in [lo, hi], ``e·hi·(lo / (e·hi))^z`` at debt ``z`` of the ``floor``
        long shots may owe, the online knapsack's threshold on value per unit of weight (every
        long shot worth the same) as a price: above every recent price while nothing is owed,
        lo at the floor. Notes ``price`` among the recent ones."""
        if not self.config.long_shot_density:
            return math.inf
        prices = self._shot_prices
        prices.append(price)
        self._shot_prices_new += 1
        if len(prices) < SHOT_PRICES_MIN or floor <= 0.0:
            return math.inf
        if self._shot_price_range is None or self._shot_prices_new >= SHOT_PRICES_EVERY:
            lo, hi = np.quantile(np.fromiter(prices, np.float64, len(prices)), SHOT_PRICE_QUANTILES)
            self._shot_price_range = (float(lo), float(hi))
            self._shot_prices_new = 0
        lo, hi = self._shot_price_range
        if hi <= 0.0:
            return math.inf
        z = min(max(-self._credit / floor, 0.0), 1.0)
        top = math.e * hi
        return top * (max(lo, 0.0) / top) ** z

    def _shot_has_odds(
        self,
        request: PlanRequest,
        eligible: Sequence[PlanInstance],
        price: float,
        floor: float,
        now: float,
    ) -> bool:
        """Whether a long shot of ``price`` (priced occupancy, s) may add to the debt
        (``long_shot_odds``): its chance per second at least the bar times a sure arrival's,
        the bar rising with the debt from 0 to ``long_shot_odds`` at the ``floor``."""
        bar = self.config.long_shot_odds
        if bar is None or self._credit >= 0.0 or floor <= 0.0 or self._sure_price <= 0.0:
            return True
        if request.deadline is None:
            return True
        model = request.model
        fits = -math.inf  # output tokens that fit before the deadline, started now
        for inst in eligible:
            rate = self._rates.get((inst.instance_id, model)) or self._rate(inst, model)
            pre = rate.prefill_fixed_s + rate.prefill_s_per_token * request.prompt_tokens
            fits = max(fits, (request.deadline - now - pre) / max(rate.token_s, 1e-12))
        mean, var = self._length_moments(request)
        sd = math.sqrt(max(var, 1e-9))
        chance = float(ndtr((fits - mean) / sd))
        debt = min(-self._credit / floor, 1.0)
        return chance / max(price, 1e-12) >= bar * debt / self._sure_price

    def _shot_charge_scale(self) -> float:
        """A long shot's charge over its price: 1 moved towards the occupancy scale by the sure
        work's share of the priced occupancy that arrived over about LOAD_WINDOW_S
        (``long_shot_measured_charge``)."""
        if not self.config.long_shot_measured_charge:
            return 1.0
        scale = self._occupancy_scale()
        if scale == 1.0:
            return 1.0
        sure = sum(sums[0] for sums in self._sure_load.values())
        total = sure + self._shot_load
        return 1.0 if total <= 0.0 else 1.0 + sure / total * (scale - 1.0)

    def _occupancy_scale(self) -> float:
        """Measured over priced occupancy (1 until enough busy time was seen)."""
        if self._occ_busy_s < OCCUPANCY_MIN_S or self._occ_priced_s <= 0.0:
            return 1.0
        scale = self._occ_busy_s / self._occ_priced_s
        return min(max(scale, OCCUPANCY_SCALE_MIN), 1.0)

    def _sure_instances(self) -> float:
        """Instances' worth of capacity the sure work takes, at the measured occupancy."""
        return self._occupancy_scale() * self._sure_rate()

    def _sure_rate(self) -> float:
        """Instances' worth of capacity the sure work needs: its occupancy's arrival rate over
        the last LOAD_WINDOW_S, except that work with SLOs of minutes or more that came as a
        burst is spread over its SLO. A burst of work with an hour to go needs a share of
        an hour's capacity, not the next minute's, and should not starve long shots of the
        capacity its slack leaves (the batch-api scenario's 10,000 requests at once).

        Per spread: min(over LOAD_WINDOW_S, over the spread + over RECENT_S). A stream that
        goes on keeps the last term at its rate, so the minimum is its rate at once (an
        overload of slack-rich work is seen within seconds, not after its SLO); once a burst
        ends, the last term fades within a minute and the burst counts spread. Work whose
        spread is LOAD_WINDOW_S counts as its arrival rate."""
        rate = 0.0
        for spread, (fast, slow, recent) in self._sure_load.items():
            rate += min(fast / LOAD_WINDOW_S, slow / spread + recent / RECENT_S)
        return rate

    def _note_sure_slo(self, now: float, slo_s: float) -> None:
        """A sliding-window minimum of the sure arrivals' SLOs (monotonic deque)."""
        window = self._sure_slos
        while window and window[-1][1] >= slo_s:
            window.pop()
        window.append((now, slo_s))
        while window and window[0][0] < now - LOAD_WINDOW_S:
            window.popleft()

    def _borrow_s(self, n_inst: int) -> float:
        """Seconds of each instance long shots may owe: ``long_shot_borrow`` of the shortest
        recent sure SLO, or ``long_shot_borrow_stable`` of it while the sure work's measured
        load (instances' worth) is below the ``n_inst`` instances there are."""
        if not self._sure_slos:
            return 0.0
        frac = self.config.long_shot_borrow
        stable = self.config.long_shot_borrow_stable
        if stable is not None and self._sure_instances() < n_inst:
            frac = stable
        return frac * self._sure_slos[0][1]

    def _remember(self, r: PlanRequest, iid: str, out: float, now: float) -> None:
        if len(self._seen) >= self._seen_max and r.request_id not in self._seen:
            # bounded without replans (short queues): the oldest entries are long dispatched
            for old in list(itertools.islice(self._seen, self._seen_max // 2)):
                self._note_left(old, now)
        self._seen[r.request_id] = (iid, r.model, out, now, r.prompt_tokens)

    def _note_left(self, rid: str, now: float) -> None:
        """``rid`` left its queue between when it was last seen there and ``now``."""
        iid, model, out, seen, prompt = self._seen.pop(rid)
        if self.config.occupancy_learning:
            rate = self._rates.get((iid, model))
            if rate is not None:
                sums = self._occ_left.setdefault(iid, [0.0, 0.0])
                sums[0] += 1.0
                sums[1] += prompt * rate.inv_prefill_tps + out * rate.inv_tps
        left = self._left.get(iid)
        if left is None:
            left = self._left[iid] = deque(maxlen=DISPATCH_MEMORY)
        left.append((model, out, (seen + now) / 2, prompt))

    @property
    def _feasible_q(self) -> float:
        q = self.config.feasible_quantile
        return self.config.slo_quantile if q is None else q

    # ------------------------------------------------------------------ place() helpers
    def _lengths_of(self, r: PlanRequest) -> tuple[float, float, float]:
        """(mean, Δ-quantile bound, long-shot bound) of one request's output tokens."""
        lengths = self.estimator.lengths
        key: tuple[str, str | None, int] | None = None
        if lengths.per_group:  # the same figures until a completion is learnt
            self._lengths_current(lengths)
            key = (r.model, r.slo_class, r.max_tokens)
            seen = self._lengths_seen.get(key)
            if seen is not None:
                return seen
        shot_q = self.config.long_shot_quantile
        qs = [self._feasible_q] if shot_q is None else [self._feasible_q, shot_q]
        if key is not None:
            mean, (bound, *shot) = lengths.mean_and_bounds_at(
                r.model, r.slo_class, r.max_tokens, qs
            )
            out = (mean, bound, min(shot[-1], bound) if shot else bound)
        else:
            cap = np.array([max(r.max_tokens, 1)], dtype=np.float64)
            prompt = np.array([r.prompt_tokens], dtype=np.float64)
            means, _ = lengths.predict(r.model, r.slo_class, cap, prompt_tokens=prompt)
            bounds = [
                float(lengths.upper_bound(r.model, r.slo_class, cap, q, prompt_tokens=prompt)[0])
                for q in qs
            ]
            out = (float(means[0]), bounds[0], min(bounds[-1], bounds[0]))
        if key is not None:
            if len(self._lengths_seen) >= LENGTHS_SEEN_MAX:
                self._lengths_seen.clear()
            self._lengths_seen[key] = out
        return out

    def _lengths_current(self, lengths: OutputLengthModel) -> None:
        """Forget the kept per-group answers once the length model learnt a completion."""
        at = self._lengths_at
        if at is None or at[0] is not lengths or at[1] != lengths.version:
            self._lengths_seen.clear()
            self._moments_seen.clear()
            self._lengths_at = (lengths, lengths.version)

    def _length_moments(self, r: PlanRequest) -> tuple[float, float]:
        """(mean, variance) of one request's output tokens: the length model's prediction,
        kept per (model, class, max_tokens) between completions where the fit is per group."""
        lengths = self.estimator.lengths
        key: tuple[str, str | None, int] | None = None
        if lengths.per_group:
            self._lengths_current(lengths)
            key = (r.model, r.slo_class, r.max_tokens)
            seen = self._moments_seen.get(key)
            if seen is not None:
                return seen
        mean, var = lengths.predict(
            r.model,
            r.slo_class,
            np.array([max(r.max_tokens, 1)], dtype=np.float64),
            prompt_tokens=np.array([r.prompt_tokens], dtype=np.float64),
        )
        out = (float(mean[0]), float(var[0]))
        if key is not None:
            if len(self._moments_seen) >= LENGTHS_SEEN_MAX:
                self._moments_seen.clear()
            self._moments_seen[key] = out
        return out

    def _rate(self, inst: PlanInstance, model: str) -> _Rate:
        """The (instance, model) timing of the last plan, else priced now at the context last
        seen for the model (before any plan; the batch: what runs there now plus this one)."""
        rate = self._rates.get((inst.instance_id, model))
        if rate is not None:
            return rate
        joins = inst.running + 1 if inst.active_model == model else 1
        if inst.max_in_engine is not None:
            joins = min(joins, inst.max_in_engine)
        warm = inst.warm_models is None or model in inst.warm_models
        key = (
            inst.gpu_type,
            model,
            inst.kv_capacity_tokens,
            inst.max_batch_size,
            inst.max_in_engine,
            joins,
            warm,
        )
        rate = self._default_rates.get(key)
        if rate is None:  # an instance shape seen before costs a dict lookup (no replan
            # may run for hours when queues stay short)
            ctx, ratio = self._ctx.get(model, (1024.0, 0.0))
            p = self._hw(inst, model, ctx, ratio, batch=inst.max_in_engine)
            lat = self._hw(inst, model, ctx, ratio, batch=joins)
            if len(self._default_rates) >= 4096:
                self._default_rates.clear()
            rate = self._default_rates[key] = _Rate.of(p, lat, self._switch(inst, p, model))
        return rate

    def _lane(self, iid: str, queued: float, rate: _Rate) -> _LaneState:
        """The instance's state; an empty virtual queue has nothing planned left in it."""
        lane = self._lanes.get(iid)
        if lane is None or (queued <= 0.0 and (lane.placed > 0.0 or len(lane.due))):
            s_per_token = lane.s_per_token if lane is not None else rate.inv_tps
            swap_s = lane.swap_s if lane is not None else 0.0
            lane = self._lanes[iid] = _LaneState.empty(s_per_token, swap_s)
        return lane

    # ------------------------------------------------------------------ plan
    def plan(
        self,
        requests: Sequence[PlanRequest],
        instances: Sequence[PlanInstance],
        now: float,
    ) -> Plan:
        t0 = time.perf_counter()
        budget_end = self._clock() + self.config.time_budget_s
        reqs = sorted(requests, key=lambda r: (r.seq, r.request_id))
        queued = {r.request_id for r in reqs}
        self._shots &= queued
        for rid in [rid for rid in self._seen if rid not in queued]:
            self._note_left(rid, now)
        if self.config.occupancy_learning:
            self._learn_occupancy(now, instances)
        self._seen_max = max(ARRIVAL_KEYS_MAX, 2 * len(reqs))
        insts = sorted(instances, key=lambda i: i.instance_id)
        live = [i for i in insts if not i.draining]
        queues_out: dict[str, list[str]] = {i.instance_id: [] for i in insts}
        models = sorted({r.model for r in reqs})
        serve = np.array([[i.serves(m) for i in live] for m in models], dtype=bool).reshape(
            len(models), len(live)
        )
        mpos = {m: k for k, m in enumerate(models)}
        self._models = models
        priced = self._price(reqs, mpos, now)
        servable = serve[priced.model_idx].any(axis=1) if len(reqs) else np.zeros(0, bool)
        unassigned = [r.request_id for r, ok in zip(reqs, servable, strict=True) if not ok]
        meta: dict[str, Any] = {"groups": 0, "requests": len(reqs)}
        if not servable.any():
            self._adopt(None, priced, live, ({}, {}), models, now)
            meta.update(feasible=not any(math.isfinite(d) for d in priced.deadline))
            return Plan(queues=queues_out, unassigned=unassigned, policy=self.name, meta=meta)

        hw, lat = self._profiles(priced, live, models, serve)
        self._half_out = {
            m: float(priced.out_mean[priced.model_idx == m].mean()) / 2
            for m in range(len(models))
            if (priced.model_idx == m).any()
        }
        tab = self._tables(priced, hw, lat, live, models, now)
        best_lst = tab.lst.max(axis=1) if len(live) else np.full(len(reqs), -np.inf)
        # hopeless: misses even if it started now on its best instance; only the tail can
        # take it (not demoting anything keeps it in the candidates)
        hopeless = servable & ~tab.prio & (best_lst < 0) & self.config.demote
        walkable = servable & ~hopeless

        # -- candidates: request-level EDF on latest starts, and the group plan before and
        # after improvement (within what is left of the time budget)
        candidates: dict[str, _Walk] = {"edf": self._walk_edf(tab, priced, walkable, best_lst)}
        # A full batch delays even requests of its own model until a slot frees. Evicting it
        # (an LSO) lets them start now, and costs recomputing the batch's contexts: worth it
        # when the requests it saves outnumber those that recompute time would have served
        evict_wait = np.zeros(len(live))
        full = tab.first_slot > 0
        if full.any() and self.config.demote:
            occ = np.where(np.isfinite(tab.occ[walkable]), tab.occ[walkable], np.nan)
            # per column, then per instance
            mean_occ: np.ndarray | float = (
                np.nan_to_num(np.nanmean(occ, axis=0), nan=1.0)[tab.col] if walkable.any() else 1.0
            )
            cost = float((tab.evict / np.maximum(mean_occ, 1e-6))[full].sum())
            # the probe meets at most every walkable request (each is kept once at most):
            # where EDF's walk leaves no more than the cost unmet, the probe cannot win and is
            # not walked (about half the replans in wb's overload)
            if int(walkable.sum()) - candidates["edf"].met > cost:
                freed = dataclasses.replace(tab, first_slot=np.zeros(len(live)))
                probe = self._walk_edf(freed, priced, walkable, best_lst)
                if probe.met - candidates["edf"].met > cost:
                    evict_wait = np.where(full, tab.first_slot, 0.0)
                    tab, candidates["edf"] = freed, probe
        problem: GroupProblem | None = None
        if self.config.group_candidates and walkable.sum() > 1:
            grouping = build_groups(
                reqs,
                priced.out_mean,
                avg_batch={m: self._avg_batch(hw, k) for k, m in enumerate(models)},
                instances_per_model={m: int(serve[k].sum()) for k, m in enumerate(models)},
                config=self.config.grouping,
                deadlines=np.where(
                    np.isfinite(priced.deadline), priced.deadline + now, now + 3600.0
                ),
                skip=~walkable,
            )
            problem = self._group_problem(grouping, priced, hw, tab, live, models, now)
            meta["groups"] = problem.n_groups
            incumbent = greedy_assign(problem)
            if len(models) > 1 or self.config.improve_one_model:
                improved, milp_stats = self.improve_groups(problem, incumbent, budget_end)
            else:
                # one model queued, and the operator chose a faster replan: no model run to
                # decide, the greedy plan stands as it is (docs/planner.md, section 5)
                improved, milp_stats = incumbent, {"skipped": "one model"}
            meta["milp"] = milp_stats
            candidates["greedy"] = self._walk_lanes(
                self._expand(incumbent, grouping, tab, best_lst), tab, priced
            )
            # the same queues walk the same (at 100k requests a walk takes ~1 s)
            candidates["improved"] = (
                candidates["greedy"]
                if improved == incumbent
                else self._walk_lanes(self._expand(improved, grouping, tab, best_lst), tab, priced)
            )
        # most requests (or value) predicted to meet; then fewer model switches (each costs a
        # load and a drain), then the shorter makespan; then the order below
        order = {"improved": 0, "greedy": 1, "edf": 2}
        name, chosen = max(
            candidates.items(),
            key=lambda kv: (
                # expected attainment: long shots count by their chance of meeting
                round(kv[1].worth, 9),
                -kv[1].switches,
                -round(kv[1].makespan, 6),
                -order[kv[0]],
            ),
        )
        if self.config.consolidate_runs and len(models) > 1:
            until = self._clock() + CONSOLIDATE_BUDGET * self.config.time_budget_s
            merged = _consolidate(chosen, tab, priced, self.z, until, self._clock)
            meta["consolidated"] = chosen.switches - merged.switches
            chosen = merged
        n_deadline = int(np.isfinite(priced.deadline[servable]).sum())
        feasible = chosen.met >= int(servable.sum())
        tail = sorted(set(chosen.tail) | set(np.flatnonzero(hopeless).tolist()))
        final, detail, keys = self._finish(chosen, tail, tab, priced, best_lst, now)
        meta.update(
            chosen=name,
            objective=self.config.objective,
            predicted_met=chosen.met,
            predicted_value=round(chosen.worth, 3),
            predicted_attainment=chosen.met / max(len(reqs), 1),
            candidates={k: w.met for k, w in candidates.items()},
            switches=chosen.switches,
            demoted=len(tail),
            feasible=bool(feasible),
            with_deadline=n_deadline,
        )
        if not feasible and problem is not None:
            meta["fallback"] = None
            meta["scale_up"] = self._scale_up(
                problem, live, self._clock() + self.config.scale_up_budget_s
            )
            meta["scale_up"]["unattainable_requests"] += int(hopeless.sum())
        else:
            meta["scale_up"] = {"needed": not feasible}
        caps = (
            self._batch_caps(final, keys, priced, tab, live, models, now)
            if self.config.batch_cap
            else {}
        )
        lso = self._lso(final, priced, hw, tab, live, models, evict_wait, caps)
        # what _remember() does, inline (100k calls at the largest backlogs): _seen holds only
        # queued requests here, well below its bound
        seen, out_mean = self._seen, priced.out_mean.tolist()
        for g, ids in enumerate(final):
            iid = live[g].instance_id
            queues_out[iid] = [reqs[i].request_id for i in ids]
            for i in ids:
                r = reqs[i]
                seen[r.request_id] = (iid, r.model, out_mean[i], now, r.prompt_tokens)
        self._adopt((final, detail, keys, tab), priced, live, (hw, lat), models, now)
        meta["replan_s"] = round(time.perf_counter() - t0, 4)
        return Plan(queues=queues_out, unassigned=unassigned, policy=self.name, meta=meta, lso=lso)

    # ------------------------------------------------------------------ pricing
    def _price(self, reqs: list[PlanRequest], mpos: dict[str, int], now: float) -> _Priced:
        n = len(reqs)
        model_idx = np.fromiter((mpos[r.model] for r in reqs), np.int64, n)
        prompt = np.fromiter((r.prompt_tokens for r in reqs), np.float64, n)
        max_tok = np.fromiter((max(r.max_tokens, 1) for r in reqs), np.float64, n)
        out_mean, out_var, out_bound = np.zeros(n), np.zeros(n), np.zeros(n)
        out_shot = np.zeros(n)
        shot_q = self.config.long_shot_quantile
        keys: dict[tuple[str, str | None], list[int]] = {}
        for k, r in enumerate(reqs):
            keys.setdefault((r.model, r.slo_class), []).append(k)
        lengths = self.estimator.lengths
        for (model, cls), idx in keys.items():
            ix = np.asarray(idx)
            # per request when the forest is in use: it prices each prompt
            out_mean[ix], out_var[ix] = lengths.predict(
                model, cls, max_tok[ix], prompt_tokens=prompt[ix]
            )
            out_bound[ix] = lengths.upper_bound(
                model, cls, max_tok[ix], self._feasible_q, prompt_tokens=prompt[ix]
            )
            out_shot[ix] = (
                out_bound[ix]
                if shot_q is None
                else lengths.upper_bound(model, cls, max_tok[ix], shot_q, prompt_tokens=prompt[ix])
            )
        inf = math.inf
        e2e = np.fromiter((r.deadline if r.deadline is not None else inf for r in reqs), float, n)
        ttft = np.fromiter(
            (r.ttft_deadline if r.ttft_deadline is not None else inf for r in reqs), float, n
        )
        seq = np.fromiter((r.seq for r in reqs), np.int64, n)
        value = np.ones(n)
        if self.config.objective == "service-gain" and n:
            gain = W_IN * prompt + W_OUT * out_mean
            value = gain / max(float(gain.mean()), 1e-9)
        return _Priced(
            reqs,
            model_idx,
            prompt,
            out_mean,
            out_var,
            out_bound,
            np.minimum(out_shot, out_bound),
            np.minimum(e2e, ttft) - now,
            e2e - now,
            ttft - now,
            seq,
            value,
        )

    def _hw(
        self, inst: PlanInstance, model: str, ctx: float, ratio: float, batch: int | None = None
    ) -> HardwareProfile:
        """The profile at the batch the instance runs: the KV share the agent fills, at most
        ``batch`` sequences when fewer are there to run."""
        cap = inst.max_batch_size if batch is None else max(1, min(batch, inst.max_batch_size))
        return self.estimator.profile(
            inst.gpu_type,
            model,
            inst.kv_capacity_tokens,
            cap,
            ctx,
            ratio,
            kv_fraction=self.config.kv_fill,
        )

    def _profiles(
        self, priced: _Priced, live: list[PlanInstance], models: list[str], serve: np.ndarray
    ) -> tuple[dict[tuple[int, int], HardwareProfile], dict[tuple[int, int], HardwareProfile]]:
        """Each (instance, model) priced twice. Capacity (occupancy, what a request adds to the
        wait of those behind it): at the batch a busy instance runs, the KV share the agent
        fills over the context a running sequence holds. Latency (a request's own decode): at
        the batch it will be part of, that one or, when fewer requests are there to run (what
        runs there now of that model and its share of the queue), those: an instance that is
        not full decodes faster than a full one. A sequence stays in the batch in proportion
        to its output, so that context is weighted by output: prompt + half the output of the
        requests as the batch holds them, E[O·(P + O/2)] / E[O], not of the requests as they
        arrive (long answers hold the cache longest; the arrival mean overstates the batch).
        Taken from the completions once there are enough of them (the mix actually served),
        from the queued requests before."""
        out: dict[tuple[int, int], HardwareProfile] = {}
        lat: dict[tuple[int, int], HardwareProfile] = {}
        for m, model in enumerate(models):
            sel = priced.model_idx == m
            if not sel.any():
                continue
            share = math.ceil(int(sel.sum()) / max(int(serve[m].sum()), 1))
            flow = self._flow.get(model)
            if flow is not None and flow[0] >= FLOW_MIN:
                ctx, ratio = flow[3] / flow[1], flow[2] / flow[1]
            else:  # nothing served yet: the queued requests, as predicted
                p, om, ov = priced.prompt[sel], priced.out_mean[sel], priced.out_var[sel]
                weight = max(float(om.sum()), 1e-9)
                ctx = float((om * p + (om**2 + ov) / 2).sum()) / weight
                ratio = float(p.sum()) / weight
            self._ctx[model] = (ctx, ratio)
            for g, inst in enumerate(live):
                if serve[m, g]:
                    cap = inst.max_in_engine  # the batch cap its agent applies
                    out[(g, m)] = self._hw(inst, model, ctx, ratio, batch=cap)
                    running = inst.running if inst.active_model == model else 0
                    joins = running + share if cap is None else min(running + share, cap)
                    lat[(g, m)] = self._hw(inst, model, ctx, ratio, batch=joins)
        return out, lat

    @staticmethod
    def _avg_batch(hw: Mapping[tuple[int, int], HardwareProfile], m: int) -> float:
        bs = [p.batch for (g, mm), p in hw.items() if mm == m]
        return float(np.mean(bs)) if bs else 1.0

    def _switch(self, inst: PlanInstance, hwp: HardwareProfile, model: str) -> float:
        warm = inst.warm_models is None or model in inst.warm_models
        return hwp.switch_in_s(warm)

    def _running(
        self, inst: PlanInstance, g: int, hw: Mapping, lat: Mapping, models: list[str], now: float
    ) -> tuple[float, float, float]:
        """(until the first running request frees a slot, until the last one finishes, what
        evicting them all costs) on an instance: what a request of the running model waits for
        when the batch is full, what a model switch waits for, and the recompute (or swap,
        whichever is cheaper) of their contexts. The running requests are the latest
        ``running`` ones that left this instance's queue, each with its predicted output less
        what it decoded since; any the policy never saw count with the model's mean context
        and half its mean output to go."""
        if inst.running <= 0 or inst.active_model is None:
            return 0.0, 0.0, 0.0
        model = inst.active_model
        m = models.index(model) if model in models else -1
        if (g, m) in hw:
            p, token_s = hw[(g, m)], lat[(g, m)].token_time_s
        else:
            ctx, ratio = self._ctx.get(model, (1024.0, 0.0))
            p, token_s = self._hw(inst, model, ctx, ratio), self._rate(inst, model).token_s
        per_token = min(p.recompute_s_per_token, 2 * p.kv_transfer_s_per_token)
        flow = self._flow.get(model)
        mean_out = flow[1] / flow[0] if flow is not None and flow[0] > 0 else 256.0
        left, ctx_sum = [], 0.0
        for mm, out, t, prompt in reversed(self._left.get(inst.instance_id, ())):
            if mm != model:
                continue
            done = min((now - t) / token_s, out - 1.0)
            left.append(out - done)
            ctx_sum += prompt + done
            if len(left) == inst.running:
                break
        unknown = inst.running - len(left)
        left += [mean_out / 2] * unknown
        ctx_sum += unknown * self._ctx.get(model, (1024.0, 0.0))[0]
        slot = min(left) * token_s if inst.running >= p.batch else 0.0
        return slot, max(left) * token_s, ctx_sum * per_token

    def _tables(
        self,
        priced: _Priced,
        hw: Mapping[tuple[int, int], HardwareProfile],
        lat: Mapping[tuple[int, int], HardwareProfile],
        live: list[PlanInstance],
        models: list[str],
        now: float,
    ) -> _Tables:
        n, n_inst, M = len(priced.reqs), len(live), len(models)
        # profiles are cached objects: the same object for the same instance shape and batch,
        # so instances with the same profiles for every model share one column (_Tables)
        signature: dict[tuple[int, ...], int] = {}
        col = [
            signature.setdefault(
                tuple(x for m in range(M) for x in (id(hw.get((g, m))), id(lat.get((g, m))))),
                len(signature),
            )
            for g in range(n_inst)
        ]
        first_of = {c: col.index(c) for c in range(len(signature))}  # a column's first instance
        C = len(signature)
        occ = np.full((n, C), np.inf)
        occ_var = np.zeros((n, C))
        own = np.full((n, C), np.inf)
        own_mean = np.full((n, C), np.inf)
        lst = np.full((n, C), -np.inf)
        shot_lst = np.full((n, C), -np.inf)  # at the long-shot bound
        chance = np.zeros((n, C))  # P(output fits the time left if started now)
        sd = np.sqrt(priced.out_var)
        switch = np.zeros((n_inst, M))
        for (g, m), p in hw.items():
            switch[g, m] = self._switch(live[g], p, models[m])
        rows = {m: np.flatnonzero(priced.model_idx == m) for m in range(M)}
        for c, g in first_of.items():
            for m in range(M):
                if (g, m) not in hw:
                    continue
                p, q = hw[(g, m)], lat[(g, m)]
                sel = rows[m]
                prompt = priced.prompt[sel]
                pre = q.prefill_fixed_s + q.prefill_s_per_token * prompt
                own_k = pre + priced.out_bound[sel] * q.token_time_s
                occ[sel, c] = prompt / p.prefill_tps + priced.out_mean[sel] / p.throughput_tps
                occ_var[sel, c] = priced.out_var[sel] / p.throughput_tps**2
                own[sel, c] = own_k
                own_mean[sel, c] = pre + priced.out_mean[sel] * q.token_time_s
                lst[sel, c] = np.minimum(priced.e2e[sel] - own_k, priced.ttft[sel] - pre)
                shot = pre + priced.out_shot[sel] * q.token_time_s
                shot_lst[sel, c] = np.minimum(priced.e2e[sel] - shot, priced.ttft[sel] - pre)
                fits = (priced.e2e[sel] - pre) / max(q.token_time_s, 1e-12)  # tokens, from now
                with np.errstate(divide="ignore", invalid="ignore"):
                    zs = np.where(sd[sel] > 0, (fits - priced.out_mean[sel]) / sd[sel], np.inf)
                p_fit = np.where(fits >= priced.out_mean[sel], 1.0, 0.0)
                p_fit = np.where(np.isfinite(zs), ndtr(zs), p_fit)
                chance[sel, c] = np.where(priced.ttft[sel] >= pre, p_fit, 0.0)
        running = [self._running(inst, g, hw, lat, models, now) for g, inst in enumerate(live)]
        first_slot = np.array([r[0] for r in running])
        drain = np.array([r[1] for r in running])
        evict = np.array([r[2] for r in running])
        # -1: nothing loaded (the first model costs nothing); -2: a model none of the queued
        # requests uses (the first of them switches)
        init = np.array(
            [
                models.index(i.active_model)
                if i.active_model in models
                else (-1 if i.active_model is None else -2)
                for i in live
            ],
            dtype=np.int64,
        )
        arrival = np.fromiter((r.arrival_time for r in priced.reqs), np.float64, n)
        has_deadline = np.isfinite(priced.deadline)
        # long shots: miss at the feasibility bound even if started now, not at the long-shot
        # one. Walked at the long-shot latest start and worth their chance of meeting, so the
        # walk's objective is expected attainment and work of higher value density (value per
        # second of occupancy) displaces them
        best_strict = lst.max(axis=1) if n_inst else np.full(n, -np.inf)
        shots = has_deadline & (best_strict < 0) & (shot_lst.max(axis=1) >= 0)
        shots &= np.fromiter((r.request_id in self._shots for r in priced.reqs), bool, n)
        if shots.any():
            lst[shots] = shot_lst[shots]
            priced.value = priced.value * np.where(shots, chance.max(axis=1), 1.0)
        # starvation guard: overdue by more than starvation_factor × its own SLO
        slo_len = np.maximum(priced.deadline + now - arrival, 1e-3)
        prio = has_deadline & (-priced.deadline > self.config.starvation_factor * slo_len)
        best_occ = np.where(np.isfinite(occ), occ, np.inf).min(axis=1) if n_inst else np.ones(n)
        # a request without a deadline is met wherever it waits: it gives way first
        cost = np.where(has_deadline, best_occ / np.maximum(priced.value, 1e-12), np.inf)
        # a new model run waits for the previous one to drain: about a typical request's own
        # time there (then the load)
        by_col = []
        for c in range(C):
            fin = own[:, c][np.isfinite(own[:, c])]
            by_col.append(float(np.median(fin)) if len(fin) else 0.0)
        typical = np.array([by_col[c] for c in col], dtype=np.float64)
        swap = switch + typical[:, None]
        return _Tables(
            occ,
            occ_var,
            own,
            own_mean,
            lst,
            switch,
            swap,
            drain,
            first_slot,
            evict,
            init,
            prio,
            cost,
            has_deadline,
            priced.model_idx,
            col,
        )

    # ------------------------------------------------------------------ candidates
    def _walker(self, tab: _Tables, priced: _Priced) -> _Walker:
        return _Walker(tab, priced, self.z, self.config.demote)

    def _walk_edf(
        self, tab: _Tables, priced: _Priced, walkable: np.ndarray, best_lst: np.ndarray
    ) -> _Walk:
        """Request-level EDF on latest starts: starving requests first, then each request (in
        latest-start order) to the instance where it starts first among those where it meets
        its SLO (its model switch and the drain before it priced), walked with displacement."""
        w = self._walker(tab, priced)
        idx = np.flatnonzero(walkable)
        order = idx[np.lexsort((priced.seq[idx], best_lst[idx], ~tab.prio[idx]))]
        inf = math.inf
        z, model, lanes, switch_of, lst_of = w.z, w.model, w.lanes, w.switch, w.lst
        # The lowest (misses, start, position) over the model's candidate instances. Few
        # candidates are scanned. Many are kept sorted by (start, position) per model: the
        # first where the request meets wins, else the first of all; a step changes one lane,
        # so only that lane's entries move (the scan costs n × instances, this about n).
        cands_of: dict[int, list[int]] = {}  # model -> its instances, in order
        sorted_of: dict[int, list[tuple[float, int]]] = {}  # model -> [(start, position)]
        start_of: dict[int, list[float]] = {}  # model -> start at each position
        entries: list[list[tuple[int, int]]] = [[] for _ in lanes]  # lane -> [(model, pos)]

        def start_at(g: int, m: int) -> float:
            lane = lanes[g]
            lm = lane.model
            if lm == -1 or lm == m:
                return lane.t
            return (lane.t if lane.t > lane.run_end else lane.run_end) + switch_of[g][m]

        for k in order.tolist():
            m = model[k]
            cands = cands_of.get(m)
            if cands is None:
                cands = cands_of[m] = tab.served(k)
                if len(cands) > SCAN_LANES_UP_TO:
                    start_of[m] = [start_at(g, m) for g in cands]
                    sorted_of[m] = sorted((t, p) for p, t in enumerate(start_of[m]))
                    for p, g in enumerate(cands):
                        entries[g].append((m, p))
            if not cands:
                continue
            ranked = sorted_of.get(m)
            if ranked is None:
                best_g, best_start, best_miss = -1, inf, True
                for g in cands:
                    lane = lanes[g]
                    lm = lane.model
                    if lm == -1 or lm == m:
                        start = lane.t
                    else:
                        start = (lane.t if lane.t > lane.run_end else lane.run_end) + switch_of[g][
                            m
                        ]
                    if start >= best_start and not best_miss:
                        continue  # a lane where it meets was found: one no earlier cannot win
                    if start + z * lane.sd > lst_of[g][k]:
                        if best_miss and start < best_start:
                            best_g, best_start = g, start
                    else:
                        best_g, best_start, best_miss = g, start, False
            else:
                best_g = -1
                for start, p in ranked:
                    g = cands[p]
                    if start + z * lanes[g].sd <= lst_of[g][k]:
                        best_g = g
                        break
                else:
                    if ranked[0][0] < inf:  # as the scan: an infinite start is never chosen
                        best_g = cands[ranked[0][1]]
            if best_g < 0:
                continue
            w.step(best_g, k)
            for m2, p in entries[best_g]:
                starts, ranked2 = start_of[m2], sorted_of[m2]
                new = start_at(best_g, m2)
                old = starts[p]
                if new == old:
                    continue
                del ranked2[bisect.bisect_left(ranked2, (old, p))]
                bisect.insort(ranked2, (new, p))
                starts[p] = new
        return w.result()

    def _walk_lanes(self, orders: list[list[int]], tab: _Tables, priced: _Priced) -> _Walk:
        """A candidate's queues walked in their own order, with displacement."""
        w = self._walker(tab, priced)
        step = w.step
        for g, order in enumerate(orders):
            for k in order:
                step(g, k)
        return w.result()

    def _expand(
        self, group_queues: list[list[int]], grouping: Any, tab: _Tables, best_lst: np.ndarray
    ) -> list[list[int]]:
        """Group queues as request orders: each group's members by latest start (starving
        first): the planner decides which group runs where and when, EDF inside it."""
        out = []
        for q in group_queues:
            parts = []
            for i in q:
                mem = grouping.groups[i].members
                parts.append(mem[np.lexsort((mem, best_lst[mem], ~tab.prio[mem]))])
            out.append(np.concatenate(parts).tolist() if parts else [])
        return out

    def _finish(
        self,
        chosen: _Walk,
        tail: list[int],
        tab: _Tables,
        priced: _Priced,
        best_lst: np.ndarray,
        now: float,
    ) -> tuple[list[list[int]], dict[str, float], dict[str, tuple[Any, ...]]]:
        """The queues (kept work, then the tail spread over the least busy eligible
        instances: still-feasible requests by latest start, then the hopeless FCFS), their
        predicted completions (s from now, at the mean length) and sort keys."""
        reqs = priced.reqs
        models = self._models
        n_inst = len(chosen.lanes)
        # Python lists: this runs once per queued request (100k at the largest backlogs),
        # where reading numpy scalars one at a time would cost more than the work
        model_of: list[int] = tab.model_idx.tolist()
        seq: list[int] = priced.seq.tolist()
        heads = [lane.kept + lane.later for lane in chosen.lanes]
        timing = [_lane_times(tab, g, head) for g, head in enumerate(heads)]
        end = [t.end for t in timing]
        # the models each instance holds work of: a tail request joins one of its own model
        # where it can (served late anyway, it should not add a model switch as well)
        present: list[set[int]] = []
        for g, head in enumerate(heads):
            held = set(np.unique(tab.model_idx[head]).tolist()) if head else set()
            if tab.init_model[g] >= 0:
                held.add(int(tab.init_model[g]))
            present.append(held)
        lst_best: list[float] = best_lst.tolist()
        order = sorted(
            tail,
            key=lambda k: (
                (0, lst_best[k], seq[k]) if lst_best[k] > 0 else (1, reqs[k].arrival_time, seq[k])
            ),
        )
        tails: list[list[int]] = [[] for _ in range(n_inst)]
        done: dict[str, float] = {}
        swap: list[list[float]] = tab.swap.tolist()
        col = tab.col
        eligible: dict[int, list[int]] = {}  # by model: the instances that serve it
        for k in order:
            m = model_of[k]
            ok = eligible.get(m)
            if ok is None:
                ok = eligible[m] = tab.served(k)
            if not ok:
                continue
            # the least busy, a model switch priced, lowest index on ties (min() by key)
            g = ok[0]
            best = end[g] + (0.0 if m in present[g] else swap[g][m])
            for h in ok[1:]:
                v = end[h] + (0.0 if m in present[h] else swap[h][m])
                if v < best:
                    g, best = h, v
            done[reqs[k].request_id] = end[g] + float(tab.own_mean[k, col[g]])
            end[g] += float(tab.occ[k, col[g]])
            present[g].add(m)
            tails[g].append(k)
        keys: dict[str, tuple[Any, ...]] = {}
        final: list[list[int]] = []
        self._tail_ranks = []
        self._head_due = []
        for g, head in enumerate(heads):
            due = []
            if head:
                due = np.maximum.accumulate(tab.lst[head, col[g]] + now).tolist()
                fin = (timing[g].start + tab.own_mean[head, col[g]]).tolist()
                # zipped rather than a loop with a tuple and two dict writes per request
                rids = [reqs[k].request_id for k in head]
                keys.update(
                    zip(
                        rids,
                        zip(
                            repeat(FEASIBLE, len(head)),
                            due,
                            range(len(head)),
                            [seq[k] for k in head],
                            strict=True,
                        ),
                        strict=True,
                    )
                )
                done.update(zip(rids, fin, strict=True))
            self._head_due.append(due)
            # the tail in model runs: first the model the kept work ends with (or the one
            # loaded), then the others in the order their first request comes
            last = model_of[head[-1]] if head else int(tab.init_model[g])
            ranks: dict[str, int] = {models[last]: 0} if last >= 0 else {}
            mine: list[tuple[tuple[Any, ...], int]] = []
            lst_abs = (tab.lst[tails[g], col[g]] + now).tolist() if tails[g] else []
            for k, due_abs in zip(tails[g], lst_abs, strict=True):
                rank = ranks.setdefault(models[model_of[k]], len(ranks))
                key = (
                    (TAIL, ALIVE, rank, due_abs, seq[k])
                    if due_abs > now
                    else (TAIL, HOPELESS, rank, reqs[k].arrival_time, seq[k])
                )
                keys[reqs[k].request_id] = key
                mine.append((key, k))
            mine.sort()
            final.append(head + [k for _, k in mine])
            self._tail_ranks.append(ranks)
        return final, done, keys

    def _group_problem(
        self, grouping, priced: _Priced, hw, tab: _Tables, live, models, now: float
    ) -> GroupProblem:
        """The group-level model of planner.milp. Requests of the running model start as
        slots free (no base); a model switch waits for the previous run to drain (a typical
        request's own time on that instance) and then loads the model."""
        G, n_inst = len(grouping.groups), len(live)
        z = self.z
        weight = np.zeros(G)
        size = np.zeros(G)
        deadline = np.full(G, np.inf)
        model = np.zeros(G, np.int64)
        dur = np.full((G, n_inst), np.inf)
        own = np.full((G, n_inst), np.inf)
        elig = np.zeros((G, n_inst), bool)
        prio = np.zeros(G, bool)
        sums = np.zeros((G, 3))
        for gi, grp in enumerate(grouping.groups):
            mem = grp.members
            size[gi] = len(mem)
            weight[gi] = float(priced.value[mem].sum())
            deadline[gi] = float(priced.deadline[mem].min())
            model[gi] = int(priced.model_idx[mem[0]])
            prio[gi] = bool(tab.prio[mem].any())
            sums[gi] = (
                priced.prompt[mem].sum(),
                priced.out_mean[mem].sum(),
                priced.out_var[mem].sum(),
            )
        for (g, m), p in hw.items():
            sel = np.flatnonzero(model == m)
            if not len(sel):
                continue
            occ_m, occ_v, own_m, own_v = RCTEstimator.group_moments_array(
                p, size[sel], sums[sel, 0], sums[sel, 1], sums[sel, 2]
            )
            dur[sel, g] = occ_m + z * np.sqrt(occ_v)
            own[sel, g] = own_m + z * np.sqrt(own_v)
            elig[sel, g] = True
        init = np.where(tab.init_model >= 0, tab.init_model, -1)
        return GroupProblem(
            weight, deadline, model, dur, own, elig, np.zeros(n_inst), init, tab.swap, prio, size
        )

    # ------------------------------------------------------------------ improvement
    def improve_groups(
        self, problem: GroupProblem, incumbent: list[list[int]], budget_end: float
    ) -> tuple[list[list[int]], dict[str, Any]]:
        """Local search over group moves, then the rolling-horizon MILP on each queue's head;
        each step keeps its input unless it scores strictly better (never worse than the
        incumbent). Public so the exact-MILP comparison (tests, benches) runs the same code."""
        if problem.n_groups <= self.config.ils_max_groups:
            improved = iterated_local_search(
                problem, incumbent, deadline_s=budget_end, clock=self._clock
            )
        else:
            improved = local_search(
                problem,
                incumbent,
                deadline_s=budget_end,
                max_groups=self.config.local_search_max_groups,
                clock=self._clock,
            )
        return self._rolling_horizon(problem, improved, budget_end)

    def _rolling_horizon(
        self, p: GroupProblem, queues: list[list[int]], budget_end: float
    ) -> tuple[list[list[int]], dict[str, Any]]:
        """Re-order each queue's head (``head_groups``) exactly with the slot MILP, queues with
        the most predicted misses in the head first, until the time budget runs out. A MILP
        answer replaces the head only if the whole queue scores better."""
        stats: dict[str, Any] = {"solved": 0, "improved": 0, "skipped_budget": 0, "rejected": 0}
        H = self.config.head_groups
        todo = []
        for g, q in enumerate(queues):
            if len(q) < 2:
                continue
            head = q[:H]
            c = queue_times(p, g, q)[: len(head)]
            misses = float(p.weight[head][c > p.deadline[head]].sum())
            switches = len({int(p.model[i]) for i in head}) > 1
            if misses > 0 or switches:
                todo.append((-misses, g))
        todo.sort()
        queues = [list(q) for q in queues]
        for _, g in todo[: self.config.max_milp_queues]:
            left = budget_end - self._clock()
            if left < 0.03:
                stats["skipped_budget"] += 1
                continue
            q = queues[g]
            head = q[:H]
            if len(head) <= self.config.enumerate_up_to:
                # a few groups: scoring every order of the head (the tail after it) at once
                # is exact and far cheaper than building and solving a MILP. Row 0 is the
                # queue as it is, so argmax keeps it among equal scores, else takes the
                # first order (itertools.permutations's)
                rows, scores = head_order_scores(p, g, q, H)
                pick = int(scores.argmax())
                stats["enumerated"] = stats.get("enumerated", 0) + 1
                if scores[pick] > scores[0] + 1e-9:
                    queues[g] = rows[pick].tolist()
                    stats["improved"] += 1
                continue
            res = solve_slots(
                p, head, [g], len(head), solver=self.config.solver, **self._milp_limits(left)
            )
            stats["solved"] += 1
            if res.queues is None:
                stats["rejected"] += 1
                continue
            cand = res.queues[0] + q[H:]
            if _score(p, g, cand) > _score(p, g, q) + 1e-9:
                queues[g] = cand
                stats["improved"] += 1
        return queues, stats

    def _milp_limits(self, left: float) -> dict[str, Any]:
        """The rolling horizon MILP's limits; ``left``: the budget left on the planner's clock."""
        cfg = self.config
        time_limit, nodes = budget_limits(
            cfg.budget_clock, cfg.milp_time_limit_s, cfg.milp_node_limit, left
        )
        return {"time_limit": time_limit, "node_limit": nodes}

    # ------------------------------------------------------------------ LSO
    def _lso(
        self,
        queues,
        priced: _Priced,
        hw,
        tab: _Tables,
        live,
        models,
        evict_wait: np.ndarray,
        caps: Mapping[int, int],
    ) -> dict[str, InstanceLSO]:
        out: dict[str, InstanceLSO] = {}
        for g, inst in enumerate(live):
            q = queues[g]
            # models in the order the queue first needs them
            mi = priced.model_idx[q]
            _, first = np.unique(mi, return_index=True)
            order = [models[int(mi[k])] for k in sorted(first)]
            head = order[0] if order else inst.active_model
            warm, cold = [], []
            budget = inst.cpu_memory_bytes
            for m in [m for m in order[1:] if m != head] + [
                m for m in inst.models if m not in order and m != head
            ]:
                p = next(
                    (hw[(g, k)] for k in range(len(models)) if (g, k) in hw and models[k] == m),
                    None,
                )
                size = p.weight_bytes if p else 0.0
                if budget is None or size <= budget:
                    warm.append(m)
                    budget = None if budget is None else budget - size
                else:
                    cold.append(m)
            decision = InstanceLSO(
                active_model=head,
                model_switch=head is not None and inst.active_model not in (None, head),
                warm_models=tuple(warm),
                cold_models=tuple(cold),
                max_in_engine=caps.get(g),
            )
            if len(q) and head in models:
                hm = models.index(head)
                p = hw[(g, hm)]
                ctx = int(priced.prompt[q[:64]].mean() + priced.out_mean[q[:64]].mean() / 2)
                # Preempt the running batch where the head misses waiting for it and meets
                # without: a switch to another model waits until the running requests have
                # finished (then loads); one of the running model waits only for the first
                # free slot, nothing while the batch has room, and is planned that way only
                # where evicting was found worth its recompute (evict_wait)
                head_lst = float(tab.lst[q[: p.batch], tab.col[g]].min())
                if decision.model_switch and inst.running > 0:
                    ready, wait = float(tab.switch[g, hm]), float(tab.drain[g])
                else:
                    ready, wait = 0.0, float(evict_wait[g])
                decision = dataclasses.replace(
                    decision,
                    preemption_mode=p.preemption_mode(ctx, inst.cpu_memory_bytes),
                    head_requests=tuple(priced.reqs[i].request_id for i in q[: p.batch]),
                    preempt_running=bool(
                        math.isfinite(head_lst) and ready <= head_lst < ready + wait
                    ),
                )
            out[inst.instance_id] = decision
        return out

    def _batch_caps(
        self,
        queues: list[list[int]],
        keys: Mapping[str, tuple[Any, ...]],
        priced: _Priced,
        tab: _Tables,
        live: list[PlanInstance],
        models: list[str],
        now: float,
    ) -> dict[int, int]:
        """Per instance, the batch cap for the next plan period (instance index -> cap; none:
        no cap).

        In continuous batching every running request decodes one token per iteration, and an
        iteration takes longer the more requests run (their prefills share it): a request
        whose SLO is short next to its decode at the full batch meets it only in a smaller
        one. A smaller batch also serves fewer tokens per second. So while the queues hold
        *latency-bound* work of a model (its decode at the full batch, at the mean length,
        takes over half its SLO, and it can still meet in the smallest batch; seen in a plan
        within the last CAP_HOLD_S, so that the cap does not flap with the queue), each
        instance that serves that model alone and holds only its work gets the smallest cap
        (of CAP_SHARES of its full batch, at least CAP_MIN) that keeps

        * its throughput at least ``cap_throughput_min`` of the full batch's (occupancy of a
          typical request of the served mix),
        * the sure work's arrival rate (the decayed sure load of place(), per instance) at
          most ``cap_load_max`` of the capped instance, where it is at most that of the full
          batch (a cap may not tip an instance that keeps up into an overload; in one
          already, the throughput floor alone bounds what the cap costs), and
        * every kept request of its queue meeting its deadline at the capped speed."""
        caps: dict[int, int] = {}
        self._cap_lapse = {}
        n_live = len(live)
        if not n_live:
            return caps
        reqs = priced.reqs
        arrival = np.fromiter((r.arrival_time for r in reqs), np.float64, len(reqs))
        with np.errstate(invalid="ignore"):
            slo_len = priced.e2e + now - arrival
        for m, name in enumerate(models):
            sel = np.flatnonzero((priced.model_idx == m) & np.isfinite(slo_len))
            if not len(sel):
                continue
            g0 = next((g for g, i in enumerate(live) if name in i.models), None)
            if g0 is None:
                continue
            ctx, ratio = self._ctx.get(name, (1024.0, 0.0))
            full = self._hw(live[g0], name, ctx, ratio)
            small = self._hw(live[g0], name, ctx, ratio, batch=CAP_MIN)
            prompt = priced.prompt[sel]
            own_full = full.prefill_s(prompt) + priced.out_mean[sel] * full.token_time_s
            own_small = small.prefill_s(prompt) + priced.out_shot[sel] * small.token_time_s
            bound = (own_full > 0.5 * slo_len[sel]) & (own_small <= priced.e2e[sel])
            if bound.any():
                self._bound_at[name] = now
        # work with a TTFT deadline of seconds cannot wait for a slot of a capped engine to
        # free (late work holds slots as well): no cap while any was seen lately
        ttft_len = priced.ttft + now - arrival
        if (ttft_len < CAP_TTFT_S).any():
            self._ttft_at = now
        if now - self._ttft_at <= CAP_HOLD_S:
            return caps
        per_instance = self._sure_rate() / n_live
        floor = self.config.cap_throughput_min
        load_max = self.config.cap_load_max
        # a cap may not tip an instance that carries its sure work into an overload; in one
        # already, the throughput floor alone bounds what the cap costs
        keeps_up = per_instance <= load_max
        for g, inst in enumerate(live):
            if len(inst.models) > 1:
                # an instance that switches models: a cap slows the drain of one model's run
                # and defers the switch the others' work waits for (docs/planner.md)
                continue
            q = queues[g]
            model: str | None = inst.active_model
            if q:
                m = int(priced.model_idx[q[0]])
                if (priced.model_idx[q] != m).any() or model not in (None, models[m]):
                    continue  # several models' work: a run of each decides, not a cap
                model = models[m]
            if model is None or now - self._bound_at.get(model, -math.inf) > CAP_HOLD_S:
                continue
            ctx, ratio = self._ctx.get(model, (1024.0, 0.0))
            full = self._hw(inst, model, ctx, ratio)
            if full.batch < 2 * CAP_MIN:
                continue
            menu = sorted(
                {max(CAP_MIN, int(full.batch * share)) for share in CAP_SHARES} - {full.batch},
                reverse=True,
            )
            # occupancy per output token of the served mix (prompt ratio r): r/Π + 1/Θ
            occ_full = ratio / full.prefill_tps + 1.0 / full.throughput_tps
            current = self._hw(inst, model, ctx, ratio, batch=inst.max_in_engine)
            occ_now = ratio / current.prefill_tps + 1.0 / current.throughput_tps
            kept = np.asarray(
                [
                    k
                    for k in q
                    if keys[reqs[k].request_id][0] == FEASIBLE
                    and reqs[k].request_id not in self._shots
                    and math.isfinite(priced.deadline[k])
                ],
                dtype=np.int64,
            )
            chosen: int | None = None
            for b in menu:
                p = self._hw(inst, model, ctx, ratio, batch=b)
                occ_b = ratio / p.prefill_tps + 1.0 / p.throughput_tps
                if occ_full < floor * occ_b or (
                    keeps_up and per_instance * occ_b > load_max * occ_now
                ):
                    break
                if len(kept):
                    occ = priced.prompt[kept] / p.prefill_tps + priced.out_mean[kept] / (
                        p.throughput_tps
                    )
                    var = priced.out_var[kept] / p.throughput_tps**2
                    start = float(tab.first_slot[g]) + np.concatenate(([0.0], np.cumsum(occ)[:-1]))
                    sd = np.sqrt(np.concatenate(([0.0], np.cumsum(var)[:-1])))
                    pre = p.prefill_s(priced.prompt[kept])
                    own = pre + priced.out_bound[kept] * p.token_time_s
                    lst = np.minimum(priced.e2e[kept] - own, priced.ttft[kept] - pre)
                    if (start + self.z * sd > lst + 1e-9).any():
                        # too large a batch for the latency-bound work, or too small for
                        # the rest: the caps that fit lie between, so a miss before the
                        # first fit asks the next smaller cap, a miss after it ends the search
                        if chosen is None:
                            continue
                        break
                chosen = b
            if chosen is not None:
                caps[g] = chosen
                self._cap_lapse[inst.instance_id] = self._bound_at[model] + CAP_HOLD_S
        return caps

    def _scale_up(self, p: GroupProblem, live: list[PlanInstance], until: float) -> dict[str, Any]:
        """A.3: the fewest extra instances of one GPU type (cloned from a live instance of that
        type serving the most missed models) that make every attainable group meet its SLO in
        the greedy plan. Groups that miss even alone on an idle instance are unattainable."""
        alone = np.where(p.eligible, p.own, np.inf).min(axis=1) if p.n_instances else np.inf
        attainable = np.asarray(alone <= p.deadline)
        ev = evaluate_queues(p, greedy_assign(p))
        missed = attainable & ~(ev.completion <= p.deadline)
        result: dict[str, Any] = {
            "needed": bool(missed.any()),
            "missed_attainable_requests": int(p.requests[missed].sum()),
            "unattainable_requests": int(p.requests[~attainable].sum()),
        }
        if not missed.any():
            return result
        missed_models = set(p.model[missed].tolist())
        best: dict[str, Any] | None = None
        for gpu in sorted({i.gpu_type for i in live}):
            cands = [g for g, i in enumerate(live) if i.gpu_type == gpu]
            tmpl = max(cands, key=lambda g: (int(p.eligible[missed][:, g].sum()), -g))

            def ok(k: int, tmpl: int = tmpl) -> bool:
                pk = p.with_clones(tmpl, k)
                c = evaluate_queues(pk, greedy_assign(pk)).completion
                return bool(((c <= p.deadline) | ~attainable).all())

            k, found = 1, None
            while k <= self.config.scale_up_max and self._clock() < until:
                if ok(k):
                    found = k
                    break
                k *= 2
            if found is None:
                continue
            lo = found // 2 + 1
            while lo < found and self._clock() < until:
                mid = (lo + found) // 2
                if ok(mid):
                    found = mid
                else:
                    lo = mid + 1
            if best is None or found < best["count"]:
                best = {
                    "gpu_type": gpu,
                    "models": list(live[tmpl].models),
                    "count": found,
                    "serves_missed_models": len(missed_models),
                }
        result["recommendation"] = best
        return result

    # ------------------------------------------------------------------ adopt a plan
    def _adopt(
        self,
        result: tuple[list[list[int]], dict[str, float], dict[str, tuple[Any, ...]], _Tables]
        | None,
        priced: _Priced,
        live: list[PlanInstance],
        profiles: tuple[
            Mapping[tuple[int, int], HardwareProfile], Mapping[tuple[int, int], HardwareProfile]
        ],
        models: list[str],
        now: float,
    ) -> None:
        """Keep what place()/sort_key()/wants_replan() need until the next plan: the sort
        keys, each instance's kept work by key with its work tokens and slack, the timings."""
        self._planned_at = now
        self._violation = False
        self._arrivals_since_plan = 0
        self._arrival_keys = {}
        self._rates, self._default_rates = {}, {}
        hw, lat = profiles
        for (g, m), p in hw.items():
            self._rates[(live[g].instance_id, models[m])] = _Rate.of(
                p, lat[(g, m)], self._switch(live[g], p, models[m])
            )
        self._lanes = {}
        if result is None:
            self._keys, self._last_detail = {}, None
            return
        final, done, keys, tab = result
        self._keys = keys
        self._last_detail = (done, now)
        reqs = priced.reqs
        tokens_of = np.fromiter((self.work_tokens(r) for r in reqs), np.float64, len(reqs))
        model_of: list[int] = tab.model_idx.tolist()
        for g, q in enumerate(final):
            iid = live[g].instance_id
            # _finish put the kept work (FEASIBLE keys, these dues) ahead of the tail
            dues = self._head_due[g]
            kept = q[: len(dues)]
            timing = _lane_times(tab, g, kept)
            due = np.array(dues, dtype=np.float64)
            toks = tokens_of[kept] if kept else np.zeros(0)
            start = timing.start + self.z * np.sqrt(timing.var)
            slack = tab.lst[kept, tab.col[g]] - start if kept else np.zeros(0)
            suffix = np.minimum.accumulate(np.append(slack, np.inf)[::-1])[::-1]
            planned = float(tokens_of[q].sum()) if q else 0.0
            occ = float(tab.occ[q, tab.col[g]].sum()) if q else 0.0
            rate = self._rates.get((iid, models[0])) if models else None
            s_per_token = occ / planned if planned > 0 else (rate.inv_tps if rate else 1e-4)
            typical = tab.swap[g] - tab.switch[g]
            self._lanes[iid] = _LaneState(
                due,
                toks,
                np.concatenate(([0.0], np.cumsum(toks))),
                suffix,
                s_per_token,
                planned,
                models={models[m] for m in np.unique(tab.model_idx[q]).tolist()} if q else set(),
                ranks=dict(self._tail_ranks[g]),
                swap_s=float(typical[0]) if len(typical) else 0.0,
                runs=_runs([models[model_of[k]] for k in kept], due),
            )


@dataclass
class _Timing:
    start: np.ndarray
    var: np.ndarray
    switches: int
    end: float


def _lane_times(tab: _Tables, g: int, order: list[int]) -> _Timing:
    """Start (and its variance) of each request of one queue, in order: occupancies add up
    (eq. 2); a model switch waits for the previous run's last completion, then loads.
    Vectorised run by run (a queue holds few model runs and many requests)."""
    t, run_end = float(tab.first_slot[g]), float(tab.drain[g])
    if not order:
        return _Timing(np.zeros(0), np.zeros(0), 0, 0.0)
    idx = np.asarray(order)
    c = tab.col[g]
    mi, occ, own = tab.model_idx[idx], tab.occ[idx, c], tab.own[idx, c]
    cum_var = np.cumsum(tab.occ_var[idx, c])
    var = np.concatenate(([0.0], cum_var[:-1]))
    start = np.empty(len(idx))
    cuts = np.flatnonzero(mi[1:] != mi[:-1]) + 1
    model, switches = int(tab.init_model[g]), 0
    for a, b in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [len(idx)])), strict=True):
        m = int(mi[a])
        if model != -1 and m != model:
            t = max(t, run_end) + float(tab.switch[g, m])
            run_end = 0.0
            switches += 1
        model = m
        cum = np.cumsum(occ[a:b])
        start[a:b] = t + cum - occ[a:b]
        run_end = max(run_end, float((start[a:b] + own[a:b]).max()))
        t += float(cum[-1])
    return _Timing(start, var, switches, max(t, run_end))


class _Walker:
    """Walks candidate queues request by request with Moore-Hodgson displacement: a request
    predicted to miss where it stands takes the place of the costliest request of the same
    model run ahead of it (largest occupancy per unit of value) if that one costs more, is
    worth no more, and its removal lets the newcomer meet; otherwise it is demoted. A removal
    only moves later requests earlier, so everything kept still meets (this is Moore and
    Hodgson's rule, optimal for the number of on-time jobs in EDF order on one machine).
    Earlier runs are never touched: a switch waits for its run's drain, which a removal
    there need not shorten."""

    def __init__(self, tab: _Tables, priced: _Priced, z: float, demote: bool) -> None:
        self.tab = tab
        self.z = z
        self.demote = demote
        n_inst = len(tab.col)
        self.model: list[int] = priced.model_idx.tolist()
        columns: dict[int, tuple[list[float], ...]] = {}
        for c in dict.fromkeys(tab.col):
            columns[c] = tuple(a[:, c].tolist() for a in (tab.occ, tab.occ_var, tab.own, tab.lst))
        per_lane = [columns[c] for c in tab.col]
        self.occ = [col[0] for col in per_lane]
        self.var = [col[1] for col in per_lane]
        self.own = [col[2] for col in per_lane]
        self.lst = [col[3] for col in per_lane]
        self.switch = tab.switch.tolist()
        self.prio: list[bool] = tab.prio.tolist()
        self.cost: list[float] = tab.cost.tolist()
        self.has_deadline: list[bool] = tab.has_deadline.tolist()
        self.value: list[float] = priced.value.tolist()
        self.values = priced.value
        self.gone = [False] * len(self.model)
        self.lanes = [
            _Lane(
                t=float(tab.first_slot[g]),
                model=int(tab.init_model[g]),
                run_end=float(tab.drain[g]),
            )
            for g in range(n_inst)
        ]
        self.tail: list[int] = []

    def start(self, g: int, k: int) -> tuple[float, float]:
        """When request k would start at the end of queue g (and the variance of that)."""
        lane = self.lanes[g]
        m = self.model[k]
        if lane.model != -1 and m != lane.model:
            return max(lane.t, lane.run_end) + self.switch[g][m], lane.var
        return lane.t, lane.var

    def step(self, g: int, k: int) -> bool:
        """Append request k to queue g if it meets its SLO there (after displacing, maybe);
        else demote it. True when kept."""
        lane = self.lanes[g]
        m = self.model[k]
        lane_model = lane.model
        new_run = lane_model != -1 and m != lane_model
        # start(g, k), inline: this runs once per request and candidate
        if new_run:
            t, run_end = lane.t, lane.run_end
            start = (t if t > run_end else run_end) + self.switch[g][m]
        else:
            start = lane.t
        var = lane.var
        prio = self.prio[k]
        if self.demote and not prio and start + self.z * lane.sd > self.lst[g][k]:
            if new_run or not self._displace(lane, g, k, start, var):
                self.tail.append(k)
                return False
            start, var = self.start(g, k)
        if new_run:
            lane.switches += 1
            lane.heap = []
            lane.run_end = 0.0
        lane.model = m
        lane.kept.append(k)
        lane.t = start + self.occ[g][k]
        var += self.var[g][k]
        lane.var = var
        lane.sd = sqrt(var)
        end = start + self.own[g][k]
        if end > lane.run_end:
            lane.run_end = end
        if not prio:
            heappush(lane.heap, (-self.cost[k], k))
        return True

    def _displace(self, lane: _Lane, g: int, k: int, start: float, var: float) -> bool:
        """Remove the costliest requests of this run ahead of k (largest occupancy per unit
        of value first, each costlier than k and worth no more) until k meets, if together
        they are worth less than k (one for one when values are equal: Moore-Hodgson; several
        long shots for one sure request, which their summed chance does not outweigh)."""
        heap = lane.heap
        taken: list[tuple[float, int]] = []
        worth, freed, freed_var = 0.0, 0.0, 0.0
        fits = False
        while heap:
            neg_cost, j = heap[0]
            if self.gone[j]:
                heapq.heappop(heap)
                continue
            no_deadline = not self.has_deadline[j]
            if -neg_cost <= self.cost[k] or (self.value[j] > self.value[k] and not no_deadline):
                break
            if not no_deadline:
                worth += self.value[j]
            if taken and worth >= self.value[k]:
                break  # taken alone is worth as much as k: keep them
            heapq.heappop(heap)
            taken.append((neg_cost, j))
            freed += self.occ[g][j]
            freed_var += self.var[g][j]
            if start - freed + self.z * math.sqrt(max(var - freed_var, 0.0)) <= self.lst[g][k]:
                fits = True
                break
        if not fits:
            for item in taken:
                heapq.heappush(heap, item)
            return False
        for _, j in taken:
            self.gone[j] = True  # out of lane.kept when the walk ends (a list removal is O(n))
            # without a deadline it is met wherever it waits: behind the kept work, not the tail
            (lane.later if not self.has_deadline[j] else self.tail).append(j)
        lane.t -= freed
        lane.var = max(lane.var - freed_var, 0.0)
        lane.sd = math.sqrt(lane.var)
        return True

    def result(self) -> _Walk:
        for lane in self.lanes:
            lane.kept = [k for k in lane.kept if not self.gone[k]]
        return _summarise(self.tab, self.values, self.z, self.lanes, self.tail)


def _lane_met(tab: _Tables, g: int, order: list[int], z: float) -> tuple[_Timing, np.ndarray]:
    """One queue's timing and which of its requests count as met (no deadline, or predicted
    to meet at the z-quantile; a starving request is served first, not counted)."""
    timing = _lane_times(tab, g, order)
    if not order:
        return timing, np.zeros(0, dtype=bool)
    idx = np.asarray(order)
    meets = timing.start + z * np.sqrt(timing.var) <= tab.lst[idx, tab.col[g]]
    return timing, ~tab.has_deadline[idx] | (~tab.prio[idx] & meets)


def _summarise(
    tab: _Tables, values: np.ndarray, z: float, lanes: list[_Lane], tail: list[int]
) -> _Walk:
    """A candidate's score: requests (and value) predicted to meet, switches, makespan."""
    met, worth, switches, makespan = 0, 0.0, 0, 0.0
    for g, lane in enumerate(lanes):
        order = lane.kept + lane.later
        timing, ok = _lane_met(tab, g, order, z)
        switches += timing.switches
        makespan = max(makespan, timing.end)
        if order:
            met += int(ok.sum())
            worth += float(values[np.asarray(order)][ok].sum())
    return _Walk(lanes, tail, met, worth, switches, makespan)


# Run moves tried per queue and replan, at most: a queue holds few runs, and each try costs
# one vectorised timing of the queue
CONSOLIDATE_TRIES = 64
# its own time, as a share of the plan's improvement budget (which the phases before it may
# have used up)
CONSOLIDATE_BUDGET = 0.25
# and at most this many request timings over all its tries: a try times whole queues, and the
# clock is read between moves, not between tries (a deterministic bound on one plan's cost;
# the simulator's queues stay far below it)
CONSOLIDATE_WORK = 400_000


def _consolidate(
    walk: _Walk,
    tab: _Tables,
    priced: _Priced,
    z: float,
    budget_end: float,
    clock: Callable[[], float],
) -> _Walk:
    """Fewer model loads at no predicted miss. Within a queue, a run of one model (its kept
    requests in a row) moves to just before the next run of the same model, or to the end of
    the kept work when none follows; across queues, a run joins the first run of its model on
    another instance (merged in latest-start order). A move is taken when it saves a load
    and every request met before still meets (its own requests wait longer; those of the
    runs it leaves start earlier). The pass stops at CONSOLIDATE_TRIES tries per queue, at
    CONSOLIDATE_WORK request timings or at ``budget_end``."""
    lanes = [dataclasses.replace(lane, kept=list(lane.kept)) for lane in walk.lanes]
    state = [_lane_met(tab, g, lane.kept + lane.later, z) for g, lane in enumerate(lanes)]
    work = 0  # request timings spent (CONSOLIDATE_WORK)

    def met_of(g: int, order: list[int], ok: np.ndarray) -> dict[int, bool]:
        return dict(zip(order + lanes[g].later, ok.tolist(), strict=True))

    def runs_of(order: list[int]) -> list[tuple[int, int, int]]:
        """(model, first, end) of each run of a kept order."""
        if not order:
            return []
        mi = tab.model_idx[np.asarray(order)]
        cuts = np.flatnonzero(mi[1:] != mi[:-1]) + 1
        starts = np.concatenate(([0], cuts)).tolist()
        ends = [*cuts.tolist(), len(order)]
        return [(int(mi[a]), a, b) for a, b in zip(starts, ends, strict=True)]

    def still_met(before: dict[int, bool], after: dict[int, bool]) -> bool:
        return all(after[k] for k, was in before.items() if was)

    # within each queue
    for g, lane in enumerate(lanes):
        tries = 0
        moved = True
        while moved and tries < CONSOLIDATE_TRIES and clock() <= budget_end:
            moved = False
            order = lane.kept
            runs = runs_of(order)
            for r, (m, a, b) in enumerate(runs[:-1]):
                if tries >= CONSOLIDATE_TRIES or work > CONSOLIDATE_WORK:
                    break
                nxt = next((c for mm, c, _ in runs[r + 1 :] if mm == m), len(order))
                cand = order[:a] + order[b:nxt] + order[a:b] + order[nxt:]
                tries += 1
                work += len(cand) + len(lane.later)
                t2, ok2 = _lane_met(tab, g, cand + lane.later, z)
                if t2.switches >= state[g][0].switches or not still_met(
                    met_of(g, order, state[g][1]), met_of(g, cand, ok2)
                ):
                    continue
                lane.kept, state[g] = cand, (t2, ok2)
                moved = True
                break
    # across queues: a run into a run of its model elsewhere (same model, same eligibility)
    for g, lane in enumerate(lanes):
        tries = 0
        moved = True
        while moved and tries < CONSOLIDATE_TRIES and clock() <= budget_end:
            moved = False
            for m, a, b in runs_of(lane.kept):
                run = lane.kept[a:b]
                for h, other in enumerate(lanes):
                    if h == g or tries >= CONSOLIDATE_TRIES or work > CONSOLIDATE_WORK:
                        continue
                    there = [(c, e) for mm, c, e in runs_of(other.kept) if mm == m]
                    # served there (the walks' eligibility: a finite occupancy)
                    if not there or not np.isfinite(tab.occ[np.asarray(run), tab.col[h]]).all():
                        continue
                    c, e = there[0]
                    tries += 1
                    work += len(lane.kept) + len(other.kept) + len(lane.later) + len(other.later)
                    g_order = lane.kept[:a] + lane.kept[b:]
                    # into its first run of the model there, in latest-start order
                    h_col = tab.col[h]
                    joined = sorted(other.kept[c:e] + run, key=lambda k: tab.lst[k, h_col])
                    h_order = other.kept[:c] + joined + other.kept[e:]
                    tg, okg = _lane_met(tab, g, g_order + lane.later, z)
                    th, okh = _lane_met(tab, h, h_order + other.later, z)
                    saved = state[g][0].switches + state[h][0].switches
                    if tg.switches + th.switches >= saved:
                        continue
                    before = met_of(g, lane.kept, state[g][1]) | met_of(h, other.kept, state[h][1])
                    after = met_of(g, g_order, okg) | met_of(h, h_order, okh)
                    if not still_met(before, after):
                        continue
                    lane.kept, other.kept = g_order, h_order
                    state[g], state[h] = (tg, okg), (th, okh)
                    moved = True
                    break
                if moved:
                    break
    return _summarise(tab, priced.value, z, lanes, walk.tail)


def _runs(models: list[str], due: np.ndarray) -> list[tuple[str, float, float]]:
    """Model runs of a kept order: (model, first key, last key) per run of one model."""
    runs: list[tuple[str, float, float]] = []
    for m, d in zip(models, due.tolist(), strict=True):
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1], d)
        else:
            runs.append((m, d, d))
    return runs


def _latest_start(r: PlanRequest, prefill_s: float, own_s: float) -> float:
    """The latest start (absolute s) at which ``r`` meets its e2e deadline (finishing
    ``own_s`` later) and its TTFT deadline (first token ``prefill_s`` later); inf: none."""
    due = math.inf
    if r.deadline is not None:
        due = r.deadline - own_s
    if r.ttft_deadline is not None:
        due = min(due, r.ttft_deadline - prefill_s)
    return due


def _score(p: GroupProblem, g: int, order: list[int]) -> float:
    return evaluate_queues(p, [order if k == g else [] for k in range(p.n_instances)]).score
