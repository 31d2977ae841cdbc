"""The ``qlm`` planner's per-request feasibility: demotion to a best-effort tail, Moore-Hodgson
displacement, the length bound, ties on model switches, LSO preemption, place()'s bookkeeping."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import numpy as np
import pytest

from qlm.planner.stochastic import (
    ALIVE,
    FEASIBLE,
    HOPELESS,
    LANE_BUCKETS,
    PENDING_MAX,
    TAIL,
    QLMPolicy,
    _LaneState,
    _runs,
)
from qlm.policy import PlanInstance, PlanRequest
from qlm.virtual_queue import VirtualQueue

A100 = "A100-80GB"
NOW = 1_000.0


def inst(iid: str = "i0", models: tuple[str, ...] = ("mistral-7b",), **kw: object) -> PlanInstance:
    return PlanInstance(iid, models, A100, 400_000, kw.pop("max_batch", 256), **kw)  # type: ignore[arg-type]


def req(rid: str, deadline_s: float, out: int, *, prompt: int = 200, seq: int = 0, **kw: object):
    return PlanRequest(
        rid,
        str(kw.get("model", "mistral-7b")),
        prompt,
        out,
        float(kw.get("arrival", NOW)),  # type: ignore[arg-type]
        NOW + deadline_s,
        None,
        seq=seq,
    )


def test_an_infeasible_request_sorts_behind_a_later_feasible_one() -> None:
    """A request that can no longer make its deadline (500 tokens in 3 s) goes to the tail,
    behind one that arrived after it and can; an arrival after the plan that can make it
    goes ahead of the tail too."""
    late = req("late", 3.0, 500, arrival=NOW - 50, seq=1)
    fresh = req("fresh", 100.0, 20, seq=2)
    pol = QLMPolicy()
    i0 = [inst()]
    plan = pol.plan([late, fresh], i0, NOW)
    assert plan.queues["i0"] == ["fresh", "late"]
    assert plan.meta["demoted"] == 1 and plan.meta["predicted_met"] == 1
    assert pol.sort_key(late)[:2] == (TAIL, HOPELESS) and pol.sort_key(fresh)[0] == FEASIBLE
    vq = VirtualQueue("i0")
    vq.replace([(r.request_id, pol.sort_key(r)) for r in (fresh, late)])
    newer = req("newer", 200.0, 20, seq=3)
    load = {"i0": float(pol.work_tokens(fresh) + pol.work_tokens(late))}
    assert pol.place(newer, i0, load, NOW) == "i0"
    vq.insert("newer", pol.sort_key(newer))
    assert list(vq) == ["fresh", "newer", "late"]


def test_without_demotion_the_hopeless_request_keeps_its_place() -> None:
    late = req("late", 3.0, 500, arrival=NOW - 50, seq=1)
    fresh = req("fresh", 100.0, 20, seq=2)
    plan = QLMPolicy(demote=False).plan([late, fresh], [inst()], NOW)
    assert plan.queues["i0"] == ["late", "fresh"] and plan.meta["demoted"] == 0


def serial_case() -> list[PlanRequest]:
    """One request at a time (max_batch 1): a long request with the earliest latest start,
    then twelve short ones that all fit only if the long one gives way."""
    long = req("long", 16.0, 600, seq=0)
    short = [req(f"s{k}", 14.0, 100, seq=1 + k) for k in range(12)]
    return [long, *short]


def test_moore_hodgson_displaces_the_costliest_request() -> None:
    reqs = serial_case()
    i0 = [inst(max_batch=1)]
    walked = QLMPolicy(group_candidates=False).plan(reqs, i0, NOW)
    kept_in_order = QLMPolicy(demote=False, group_candidates=False).plan(reqs, i0, NOW)
    assert kept_in_order.queues["i0"][0] == "long"  # the earliest latest start
    assert walked.queues["i0"][-1] == "long"
    assert walked.meta["predicted_met"] == 12
    assert walked.meta["predicted_met"] > kept_in_order.meta["predicted_met"]


def test_the_length_bound_decides_feasibility() -> None:
    """Same prompt and deadline: the request whose max_tokens bounds its output at 20 tokens
    can make 10 s, the one that may write 2,000 cannot (no completions seen: the bound is the
    cap, the conservative prior)."""
    short = req("short", 10.0, 20, seq=1)
    long = req("long", 10.0, 2000, seq=2)
    pol = QLMPolicy()
    plan = pol.plan([long, short], [inst()], NOW)
    assert plan.queues["i0"] == ["short", "long"]
    assert pol.sort_key(short)[0] == FEASIBLE and pol.sort_key(long)[0] == TAIL


def test_a_tie_goes_to_fewer_model_switches() -> None:
    """Everything meets its SLO in every candidate; request-level EDF alternates the two
    models, the group plan runs each model once: the plan with fewer switches wins."""
    reqs = [
        req(f"r{i}", 600.0 + i, 20, prompt=50, seq=i, model=("mistral-7b", "vicuna-13b")[i % 2])
        for i in range(40)
    ]
    i0 = [inst(models=("mistral-7b", "vicuna-13b"), active_model="mistral-7b")]
    plan = QLMPolicy().plan(reqs, i0, NOW)
    assert plan.meta["candidates"]["edf"] == plan.meta["predicted_met"] == 40
    assert plan.meta["chosen"] != "edf" and plan.meta["switches"] <= 1
    models = [r.model for rid in plan.queues["i0"] for r in reqs if r.request_id == rid]
    assert sum(a != b for a, b in zip(models, models[1:], strict=False)) <= 1


def test_preemption_only_where_the_head_waits_for_a_drain() -> None:
    """A switch waits for the whole running batch: preempt when the head misses waiting for
    it and meets without. A request of the running model waits for nothing while the batch
    has room (200 running on a 256 cap with 400k tokens of KV: the requests the policy never
    saw count as typical ones)."""
    both = ("mistral-7b", "vicuna-13b")
    busy = inst(models=both, active_model="vicuna-13b", running=200)
    same = QLMPolicy().plan([req("u", 12.0, 50, model="vicuna-13b")], [busy], NOW)
    assert same.lso["i0"].preempt_running is False
    pol = QLMPolicy()
    urgent = req("u", 12.0, 50, model="mistral-7b")
    switch = pol.plan([urgent], [busy], NOW)
    entry = switch.lso["i0"]
    assert entry.model_switch is True and entry.preempt_running is True
    relaxed = QLMPolicy().plan([req("r", 3600.0, 50, model="mistral-7b")], [busy], NOW)
    assert relaxed.lso["i0"].preempt_running is False
    assert entry.head_requests == ("u",) and entry.preemption_mode in {"swap", "evict"}


def test_a_full_batch_of_long_requests_is_preempted_for_urgent_ones() -> None:
    """Eight 3,000-token requests fill an 8-sequence engine (the policy planned them, then
    they left the queue): the next slot frees in tens of seconds, so ten urgent requests of
    the same model (2 s) can only make it if the batch is evicted, which costs far less than
    it saves. Short running requests free a slot at once: no eviction."""
    eight = inst(max_batch=8, active_model="mistral-7b")
    for length, expect in ((3000, True), (30, False)):
        pol = QLMPolicy()
        batch = [req(f"b{k}", 3600.0, length, prompt=500, seq=k) for k in range(8)]
        pol.plan(batch, [eight], NOW)
        running = PlanInstance(
            "i0", ("mistral-7b",), A100, 400_000, 8, active_model="mistral-7b", running=8
        )
        urgent = [req(f"c{k}", 2.0, 50, prompt=100, seq=10 + k) for k in range(10)]
        plan = pol.plan(urgent, [running], NOW + 1.0)
        assert plan.lso["i0"].preempt_running is expect, length
        if expect:
            assert plan.meta["predicted_met"] >= 8


def test_the_lane_state_counts_the_work_ahead_exactly() -> None:
    """place()'s bookkeeping: planned work by key plus arrivals since (merged into the sorted
    arrays every PENDING_MAX), less what was dispatched from the head, equals a brute-force
    sum, before and after merges."""
    rng = random.Random(5)
    planned = sorted((rng.uniform(0, 100), rng.uniform(1, 50)) for _ in range(200))
    due = np.maximum.accumulate(np.array([d for d, _ in planned]))
    toks = np.array([t for _, t in planned])
    lane = _LaneState(
        due,
        toks,
        np.concatenate(([0.0], np.cumsum(toks))),
        np.full(len(toks) + 1, np.inf),
        1e-3,
        float(toks.sum()),
    )
    entries = list(zip(due.tolist(), toks.tolist(), strict=True))
    for n in range(3 * PENDING_MAX):
        d, t = rng.uniform(0, 100), rng.uniform(1, 50)
        lane.placed += t
        lane.add_pending(d, t)
        entries.append((d, t))
        x = rng.uniform(0, 110)
        brute = sum(tok for dd, tok in entries if dd <= x)
        assert lane.ahead_tokens(x, lane.placed) == pytest.approx(brute), n
    # dispatching from the head: what was taken is no longer ahead of anyone
    x = 1e9
    assert lane.ahead_tokens(x, lane.placed - 100.0) == pytest.approx(lane.placed - 100.0)
    # queued work this state never saw (no place() for it) counts as ahead
    assert lane.ahead_tokens(-1.0, lane.placed + 7.0) == pytest.approx(7.0)


def test_arrival_keys_are_bounded_and_fresh() -> None:
    pol = QLMPolicy()
    i0 = [inst()]
    first = req("first", 50.0, 20, seq=1)
    pol.place(first, i0, {"i0": 0.0}, NOW)
    assert pol.sort_key(first)[0] == FEASIBLE
    assert pol.sort_key(req("unseen", 50.0, 20, seq=9))[0] == TAIL  # never placed nor planned
    keys = {ALIVE, HOPELESS}
    assert keys == {0, 1}


def priced_policy(**config: object) -> tuple[QLMPolicy, list[PlanInstance]]:
    """A qlm policy whose length model has seen both classes' outputs, N(400, ~290²), and whose
    one instance was priced by a plan."""
    pol = QLMPolicy(**config)
    rng = np.random.default_rng(0)
    for cls in ("interactive", "batch"):
        for out in np.clip(rng.normal(400, 290, 512), 1, 1024):
            pol.estimator.lengths.observe("mistral-7b", cls, int(out))
    i0 = [inst()]
    pol.plan([req("warm", 100.0, 1024, seq=0)], i0, NOW)  # prices the instance
    return pol, i0


def long_shot_case(
    overload: bool, borrow: float = 0.5, batch_slo_s: float = 300.0, burst: bool = False
) -> tuple[QLMPolicy, PlanRequest, PlanRequest]:
    """Interactive outputs fit N(400, ~290²): a deadline between its 0.2- and 0.9-quantile
    decode times misses at Δ even if started now, but a short output (P ≈ 0.5 here) meets.
    In overload 9,600 batch requests arrive over the 240 s before it (40/s), or with
    ``burst`` all within 5 s, 120 s before it."""
    pol, i0 = priced_policy(long_shot_borrow=borrow)
    token_s = pol._rates[("i0", "mistral-7b")].token_s
    probe = PlanRequest("x", "mistral-7b", 200, 1024, NOW, None, None, slo_class="interactive")
    _, bound, shot = pol._lengths_of(probe)
    assert shot < 420 < bound
    t = NOW + 240.0
    load, seq = 0.0, 1
    # overload: sure (batch) arrivals worth more instance-seconds than the instance has
    first, gap = (t - 120, 5.0 / 9600) if burst else (t - 240, 0.025)
    for k in range(9600 if overload else 1):  # 40/s, ~1.4 × what the instance serves
        at = first + k * gap
        b = PlanRequest(f"b{k}", "mistral-7b", 200, 1024, at, at + batch_slo_s, None, seq)
        b = dataclasses.replace(b, slo_class="batch")
        pol.place(b, i0, {"i0": load}, b.arrival_time)
        load += pol.work_tokens(b)
        seq += 1
    # deadline: own prefill plus ~420 tokens' decode, the median output
    shot_req = PlanRequest("shot", "mistral-7b", 200, 1024, t, t + 420 * token_s, None, seq)
    shot_req = dataclasses.replace(shot_req, slo_class="interactive")
    pol.place(shot_req, i0, {"i0": load}, t)
    batch = dataclasses.replace(
        PlanRequest("b0", "mistral-7b", 200, 1024, t - 240, t + 300, None, 1), slo_class="batch"
    )
    return pol, shot_req, batch


def test_a_long_shot_uses_spare_capacity_ahead_of_slack_rich_work() -> None:
    """In spare capacity an interactive request that meets only if its output is short is
    kept ahead of batch work with slack to spare, worth its chance; without long shots it is
    hopeless and goes behind the batch work."""
    pol, shot, batch = long_shot_case(overload=False)
    assert pol.sort_key(shot)[0] == FEASIBLE
    plan = pol.plan([batch, shot], [inst()], shot.arrival_time)
    assert plan.queues["i0"] == ["shot", "b0"]
    assert 0.2 < plan.meta["predicted_value"] - 1 < 0.9  # b0, plus the long shot's chance
    off = QLMPolicy(long_shot_quantile=None)
    off.estimator = pol.estimator
    plan = off.plan([batch, shot], [inst()], shot.arrival_time)
    assert plan.queues["i0"] == ["b0", "shot"]


def test_in_overload_a_long_shot_is_demoted() -> None:
    """Sure arrivals take all the capacity: the long shot is not admitted (it would take
    capacity the sure work needs), so it waits in the best-effort tail - unless the sure
    work's slack may be borrowed: 240 s at 1.4x leave a debt of ~96 s, which half of the
    batch work's 300 s SLO covers."""
    borrowing, shot, _ = long_shot_case(overload=True)
    assert borrowing.sort_key(shot)[0] == FEASIBLE
    pol, shot, batch = long_shot_case(overload=True, borrow=0.0)
    assert pol.sort_key(shot)[:2] == (TAIL, HOPELESS)
    plan = pol.plan([batch, shot], [inst()], shot.arrival_time)
    assert plan.queues["i0"] == ["b0", "shot"]


def test_a_burst_of_slack_rich_work_leaves_long_shots_the_capacity_its_slack_spares() -> None:
    """9,600 batch requests with an hour's SLO, at once, are ~1,340 s of the instance's work:
    spread over their hour they leave capacity, and 115 s after the burst (when a minute's
    average still counts it twice the instance) a long shot is admitted with nothing to
    borrow. The same work arriving all along (40/s, 1.4x) is an
    overload as soon as it arrives, whatever its SLO, and the long shot is demoted."""
    pol, shot, _ = long_shot_case(overload=True, borrow=0.0, batch_slo_s=3600.0, burst=True)
    assert pol.sort_key(shot)[0] == FEASIBLE
    pol, shot, _ = long_shot_case(overload=True, borrow=0.0, batch_slo_s=3600.0)
    assert pol.sort_key(shot)[:2] == (TAIL, HOPELESS)


def shots_admitted(
    load_share: float,
    shots: tuple[tuple[int, int], ...] = ((200, 420),),
    per_instance: int = 1,
    **config: object,
) -> tuple[dict[tuple[int, int], int], int]:
    """Batch work at ``load_share`` of the instance's capacity for 240 s, with interactive long
    shots arriving beside it (``per_instance`` instances' worth at a 200-token prompt), each
    shot in turn of the next kind in ``shots``: (prompt tokens, decode times of a token from
    its arrival to its deadline). How many of each kind the policy (``config``) admitted, and
    how many of each arrived."""
    pol, i0 = priced_policy(**config)
    rate = pol._rates[("i0", "mistral-7b")]
    token_s = rate.token_s
    mean, _, _ = pol._lengths_of(
        PlanRequest("x", "mistral-7b", 200, 1024, NOW, None, None, slo_class="batch")
    )
    occ = 200 * rate.inv_prefill_tps + mean * rate.inv_tps
    t, seq, next_shot, k = NOW, 1, NOW, 0
    admitted = dict.fromkeys(shots, 0)
    while t < NOW + 240.0:
        b = PlanRequest(f"b{seq}", "mistral-7b", 200, 1024, t, t + 300.0, None, seq)
        pol.place(dataclasses.replace(b, slo_class="batch"), i0, {"i0": 0.0}, t)
        seq += 1
        while next_shot <= t:
            kind = shots[k % len(shots)]
            prompt, window = kind
            s = PlanRequest(
                f"s{seq}", "mistral-7b", prompt, 1024, t, t + window * token_s, None, seq
            )
            s = dataclasses.replace(s, slo_class="interactive")
            pol.place(s, i0, {"i0": 0.0}, t)
            admitted[kind] += pol.sort_key(s)[0] == FEASIBLE
            seq += 1
            k += 1
            next_shot += occ / per_instance
        t += occ / load_share
    return admitted, k // len(shots)


def shots_borrowing(load_share: float, stable: float | None) -> int:
    return sum(shots_admitted(load_share, long_shot_borrow_stable=stable)[0].values())


@pytest.mark.parametrize("load_share", [0.9, 1.3])
def test_debt_goes_to_the_long_shots_likelier_to_meet(load_share: float) -> None:
    """Outputs fit N(400, ~290²): a long shot with 100 tokens' time left meets with P ≈ 0.12,
    one with 700 with P ≈ 0.85. Once long shots owe, the odds gate (``long_shot_odds``) refuses
    the first kind more the deeper the debt, so the second kind gets the debt: more of them
    admitted than first come, first served, and more long shots expected to meet in all."""
    slim, fair = (200, 100), (200, 700)
    gated, offered = shots_admitted(load_share, (slim, fair), 2)
    first_come, _ = shots_admitted(load_share, (slim, fair), 2, long_shot_odds=None)
    assert offered > 4000
    assert gated[slim] < first_come[slim] / 1.5
    assert gated[fair] > first_come[fair] * 1.3
    expected_met = {
        k: 0.12 * n[slim] + 0.85 * n[fair] for k, n in (("gated", gated), ("fcfs", first_come))
    }
    assert expected_met["gated"] > expected_met["fcfs"] * 1.2
    with pytest.raises(ValueError, match="long_shot_odds"):
        QLMPolicy(long_shot_odds=-0.1)


def test_long_shots_borrow_more_of_the_slack_of_sure_work_that_keeps_up() -> None:
    """Sure work below the capacity does not queue up of itself, so long shots may owe more
    of its slack (``long_shot_borrow_stable``); sure work above the capacity eats its slack
    with its own backlog, and they owe no more than ``long_shot_borrow`` of it."""
    below_more, below_base = shots_borrowing(0.9, 0.75), shots_borrowing(0.9, None)
    assert below_more > below_base > 0
    above = shots_borrowing(1.3, 0.75)
    assert above == shots_borrowing(1.3, None) > 0
    with pytest.raises(ValueError, match="long_shot_borrow_stable"):
        QLMPolicy(long_shot_borrow_stable=1.5)


@pytest.mark.parametrize("load_share", [0.9, 1.3])
def test_borrowed_capacity_goes_to_the_cheaper_long_shots(load_share: float) -> None:
    """Long shots of one class have the same chance; one with a long prompt costs more of the
    capacity they borrow. As the debt grows the admission (an online knapsack) takes only the
    cheaper ones, so more long shots are tried for the same debt: more of the short prompts
    and fewer of the long ones than first come, first served, and more in all."""
    cheap, dear = (200, 420), (3000, 420)
    dense, offered = shots_admitted(
        load_share, (cheap, dear), 2, long_shot_density=True, long_shot_odds=None
    )
    first_come, _ = shots_admitted(
        load_share, (cheap, dear), 2, long_shot_density=False, long_shot_odds=None
    )
    assert offered > 4000
    assert dense[dear] < first_come[dear] / 2
    assert dense[cheap] > first_come[cheap] * 1.5
    assert sum(dense.values()) > sum(first_come.values())


def test_kept_work_past_its_latest_start_is_demoted_at_dispatch() -> None:
    """Between replans, a kept request whose latest start passes can no longer meet at the
    length bound: as it reaches the head it joins the hopeless tail instead of going first
    (EDF puts exactly these requests at the head), once; fresh work and the tail stay."""
    pol = QLMPolicy()
    i0 = [inst()]
    soon = req("soon", 10.0, 100, seq=1)
    later = req("later", 100.0, 100, seq=2)
    plan = pol.plan([soon, later], i0, NOW)
    assert plan.queues["i0"] == ["soon", "later"]
    vq = VirtualQueue("i0")
    vq.replace([(r.request_id, pol.sort_key(r)) for r in (soon, later)])
    latest = pol.sort_key(soon)[1]
    assert pol.stale_key(soon, pol.sort_key(soon), "i0", latest - 1.0) is None

    def restale(now: float):  # type: ignore[no-untyped-def]
        by_id = {"soon": soon, "later": later}
        return lambda rid, key: pol.stale_key(by_id[rid], key, "i0", now)

    assert vq.pop(restale(latest + 1.0)) == "later"
    assert pol.sort_key(soon)[:2] == (TAIL, HOPELESS)
    assert pol.stale_key(soon, pol.sort_key(soon), "i0", latest + 1e6) is None  # final
    assert vq.pop(restale(latest + 1.0)) == "soon"  # the tail is served when nothing else is
    off = QLMPolicy(demote=False)
    off.plan([soon, later], i0, NOW)
    assert off.stale_key(soon, off.sort_key(soon), "i0", latest + 1.0) is None


def test_an_arrival_sorts_into_its_own_model_run() -> None:
    """The plan runs model a then b here: an arrival of b sorts inside b's run (not ahead of
    a's, which would switch the engine mid-run), of a at its EDF position while a runs, of a
    third model after all the planned work (else right after the current run); once a's run
    has been dispatched, b's is the current one."""
    due = np.array([10.0, 20.0, 30.0, 40.0])
    toks = np.full(4, 100.0)
    lane = _LaneState(
        due,
        toks,
        np.concatenate(([0.0], np.cumsum(toks))),
        np.full(5, np.inf),
        0.01,
        400.0,
        runs=_runs(["a", "a", "b", "b"], due),
    )
    assert lane.runs == [("a", 10.0, 20.0), ("b", 30.0, 40.0)]
    assert lane.sort_due("a", 5.0, 400.0) == (5.0, None)
    assert lane.sort_due("b", 5.0, 400.0) == (30.0, None)
    assert lane.sort_due("b", 35.0, 400.0) == (35.0, None)
    assert lane.sort_due("b", 50.0, 400.0) == (40.0, None)
    assert lane.sort_due("c", 5.0, 400.0) == (40.0, 20.0)
    assert lane.sort_due("c", 45.0, 400.0) == (45.0, 45.0)
    # a's two requests dispatched (200 of 400 tokens left): b runs now
    assert lane.sort_due("b", 5.0, 200.0) == (5.0, None)
    assert lane.sort_due("a", 5.0, 200.0) == (40.0, 40.0)
    assert lane.sort_due("a", 5.0, 0.0) == (5.0, None)  # everything planned has left


def test_place_keeps_an_arrival_out_of_another_model_s_run() -> None:
    """One instance serving two models, a planned run of each: an arrival of the second
    model due before the first run's work is keyed into its own model's run (at its first
    key: it ties with that run's work, after it), not ahead of the first run."""
    pol = QLMPolicy()
    i0 = [inst(models=("mistral-7b", "vicuna-13b"), active_model="mistral-7b")]
    first = [req(f"m{k}", 280.0, 50, seq=k) for k in range(3)]
    second = [req(f"v{k}", 300.0, 50, seq=3 + k, model="vicuna-13b") for k in range(3)]
    plan = pol.plan(first + second, i0, NOW)
    assert plan.queues["i0"] == [r.request_id for r in first + second]
    load = {"i0": float(sum(pol.work_tokens(r) for r in first + second))}
    urgent = req("urgent", 250.0, 20, seq=9, model="vicuna-13b")
    assert pol.place(urgent, i0, load, NOW) == "i0"
    key = pol.sort_key(urgent)
    assert key[0] == FEASIBLE and key[1] == pol.sort_key(second[0])[1] > NOW + 250.0
    assert key[1] > pol.sort_key(first[-1])[1]
    vq = VirtualQueue("i0")
    vq.replace([(r.request_id, pol.sort_key(r)) for r in first + second])
    vq.insert("urgent", key)
    assert list(vq)[:3] == ["m0", "m1", "m2"] and "urgent" in list(vq)[3:]


RUN_S = 10.0  # how long a placed request runs in placed_by_class's fleet


def placed_by_class(
    *,
    lanes: bool,
    ttft: bool = False,
    gap_s: float = 0.5,
    arrivals: int = 80,
    derived: bool = False,
    instances: int = 2,
    mixed_history: bool = False,
    tight_share: float = 0.5,
) -> list[tuple[str, str]]:
    """``instances`` instances; interactive arrivals (12 s SLO, outputs N(400, ~290²): their
    decode at the length bound, ~820 tokens at ~9 ms, takes most of it) and batch arrivals
    (300 s) in a random order (``tight_share`` interactive), one every ``gap_s``, each
    dispatched at once (nothing queued) and running for RUN_S: the (class, instance) of each
    placement. ``ttft``: the
    interactive requests carry a TTFT SLO instead; ``derived``: the batch requests are calls
    of task chains (their deadlines derived from their tasks'); ``mixed_history``: every
    instance took work of both kinds just before (3 slack arrivals and 1 tight, i0 2 tight)."""
    pol = QLMPolicy(class_lanes=lanes)
    for k in range(instances if mixed_history else 0):
        for kind in ["slack"] * 3 + ["tight"] * (2 if k == 0 else 1):
            pol._note_lane(f"i{k}", kind, NOW - 1.0)
    rng = np.random.default_rng(0)
    for cls in ("interactive", "batch"):
        for out in np.clip(rng.normal(400, 290, 512), 1, 1024):
            pol.estimator.lengths.observe("mistral-7b", cls, int(out))
    ids = [f"i{k}" for k in range(instances)]
    idle = dict.fromkeys(ids, 0.0)
    started: list[tuple[float, str]] = []
    placed = []
    for k, tight in enumerate(rng.random(arrivals) < tight_share):
        at = NOW + k * gap_s
        cls, slo = ("interactive", 12.0) if tight else ("batch", 300.0)
        running = Counter(iid for t, iid in started if at - t < RUN_S)
        fleet = [inst(iid, running=running[iid]) for iid in ids]
        r = PlanRequest(
            f"{cls}{k}",
            "mistral-7b",
            200,
            1024,
            at,
            None if ttft and tight else at + slo,
            at + 1.0 if ttft and tight else None,
            seq=k,
            slo_class=cls,
            derived_deadline=derived and not tight,
        )
        iid = pol.place(r, fleet, idle, at)
        assert iid is not None
        placed.append((cls, iid))
        started.append((at, iid))
    return placed


def mixed_instances(placed: list[tuple[str, str]]) -> set[str]:
    """The instances that took both classes."""
    classes: dict[str, set[str]] = {}
    for cls, iid in placed:
        classes.setdefault(iid, set()).add(cls)
    return {iid for iid, c in classes.items() if len(c) > 1}


def off_lane(placed: list[tuple[str, str]]) -> int:
    """Placements of the class an instance took less of (on an instance of the other lane)."""
    per = Counter(placed)
    return sum(min(per[("interactive", i)], per[("batch", i)]) for i in {i for _, i in placed})


def test_class_lanes_keep_tight_work_apart_from_slack_work() -> None:
    """With class lanes, work whose decode takes most of its SLO and work with minutes to
    spare go to different instances (each meets its deadline on either); without, each
    arrival goes to the instance running fewer requests, whatever its class. The first
    arrival has no lane: no load was measured yet, and a load that starts as an overload
    must not set the lanes."""
    laned = placed_by_class(lanes=True)[10:]  # the lanes formed
    assert not mixed_instances(laned)
    assert {cls for cls, _ in laned} == {"interactive", "batch"}
    assert mixed_instances(placed_by_class(lanes=False)) == {"i0", "i1"}


def test_class_lanes_leave_ttft_work_chain_calls_and_a_full_fleet_alone() -> None:
    """Work with a TTFT SLO has no lane (its wait decides it, not its decode speed), nor
    have calls of task chains (their slack is their later calls' too), and
    while the arrivals' load is beyond the fleet's capacity (4,000 arrivals in 20 s, ~3
    instances' worth) lanes are off: placement as without them, from the first arrival on
    (the decayed load is read against the share of a steady rate it holds so far, so an
    overload is seen as one while it starts)."""
    assert placed_by_class(lanes=True, ttft=True) == placed_by_class(lanes=False, ttft=True)
    assert mixed_instances(placed_by_class(lanes=True, derived=True)[1:])
    busy = placed_by_class(lanes=True, gap_s=0.005, arrivals=4000)
    assert busy == placed_by_class(lanes=False, gap_s=0.005, arrivals=4000)


def test_a_tight_lane_grows_by_instances_not_by_taking_everything() -> None:
    """On eight instances that all took both kinds, the one with the least slack work would
    take every tight arrival (the lane rule sorts by mix before start): a tight lane takes at
    most LANE_CROWD times an instance's mean share of the arrivals, and then the next
    instance joins it (a spill here and there while it does). Slack work keeps to the other
    instances."""
    placed = placed_by_class(
        lanes=True, arrivals=800, instances=8, mixed_history=True, tight_share=0.3
    )[400:]  # the lanes settled
    tight = Counter(iid for cls, iid in placed if cls == "interactive")
    assert len(tight) >= 2
    assert max(tight.values()) <= 1.3 * len(placed) / 8
    assert off_lane(placed) <= 0.05 * len(placed)


def test_an_idle_instance_suits_every_lane() -> None:
    """An instance that runs nothing and has nothing queued takes work of either kind: a
    tight lane whose tight work stopped coming (here: its class turned into calls of task
    chains, which have no lane) does not keep its instance from slack work."""
    pol = QLMPolicy(class_lanes=True)
    rng = np.random.default_rng(0)
    for cls in ("interactive", "batch"):
        for out in np.clip(rng.normal(400, 290, 512), 1, 1024):
            pol.estimator.lengths.observe("mistral-7b", cls, int(out))
    idle = {"i0": 0.0, "i1": 0.0}
    for k in range(40):  # i0 becomes the tight lane, i1 the slack one
        at = NOW + k
        for cls, slo in (("interactive", 12.0), ("batch", 300.0)):
            r = PlanRequest(f"{cls}{k}", "mistral-7b", 200, 1024, at, at + slo, None, seq=2 * k)
            r = dataclasses.replace(r, slo_class=cls, seq=2 * k + (cls == "batch"))
            fleet = [inst("i0", running=5), inst("i1", running=5)]
            pol.place(r, fleet, idle, at)
    at = NOW + 60
    batch = PlanRequest("late-batch", "mistral-7b", 200, 1024, at, at + 300, None, seq=999)
    batch = dataclasses.replace(batch, slo_class="batch")
    busy_slack = [inst("i0", running=5), inst("i1", running=9)]
    assert pol.place(batch, busy_slack, idle, at) == "i1"  # its lane, though busier
    idle_tight = [inst("i0", running=0), inst("i1", running=9)]
    assert pol.place(batch, idle_tight, idle, at + 1) == "i0"  # the idle instance


def test_lane_counts_scaled_back_after_hours_keep_their_shares() -> None:
    """The lane counts are forward-decayed (each arrival weighs exp(t / LANE_WINDOW_S)); past
    LANE_RESCALE_AT every count is scaled back, without overflow however long the gap. Shares
    survive that (an idle instance is taken care of in place()), and counts scaled back to
    nothing read as no recent lane work rather than dividing by zero."""
    pol = QLMPolicy(class_lanes=True)
    pol._note_lane("i0", "tight", NOW)
    pol._note_lane("i1", "slack", NOW)
    assert pol._lane_step("i0", "slack") == LANE_BUCKETS - 1
    hours = NOW + 12 * 3600.0  # exp(720) would overflow a float
    pol._note_lane("i1", "tight", hours)
    pol._note_lane("i1", "slack", hours)
    assert pol._lane_step("i0", "slack") == LANE_BUCKETS - 1  # its share, scaled back
    assert pol._lane_step("i1", "slack") == LANE_BUCKETS // 2
    pol._note_lane("i1", "slack", hours + 24 * 3600.0)  # exp(-1440): i0's count is 0.0
    assert pol._lane_step("i0", "slack") == 0
