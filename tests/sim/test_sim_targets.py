"""The target checks of the named scenarios, on hand-made summaries."""

from __future__ import annotations

from qlm.tooling.simulator.targets import check_rct, evaluate


def test_wb_targets_of_issue_17():
    summary = {
        "scenario": "wb",
        "sweep": {"values": [[{"stream": 1}], [{"stream": 2}]], "variants": ["4", "16"]},
        "policies": {
            "qlm": {"slo_attainment": [0.9, 0.8], "throughput_rps": [4.0, 9.9]},
            "fcfs": {"slo_attainment": [0.9, 0.3], "throughput_rps": [4.0, 10.0]},
            "edf-shed": {"slo_attainment": [0.95, 0.76], "throughput_rps": [4.0, 10.0]},
            "vllm": {"slo_attainment": [0.9, 0.35], "throughput_rps": [4.0, 9.0]},
        },
    }
    evaluate(summary)
    met = {c["target"]: c["met"] for c in summary["checks"]}
    assert met == {
        "4 req/s: qlm >= every baseline - 1 point": False,  # edf-shed 95 %
        "4 req/s: qlm throughput >= 1x vllm": True,
        "4 req/s: qlm throughput >= 0.97x fcfs": True,
        "16 req/s: qlm >= every baseline - 1 point": True,
        "16 req/s (overload): qlm >= vllm + 40 points": True,
        # 80 against edf-shed's 76: 4 points, not 5
        "16 req/s (overload): qlm >= best of fcfs, edf, edf-shed + 5 points": False,
        "16 req/s: qlm throughput >= 1x vllm": True,
        "16 req/s: qlm throughput >= 0.97x fcfs": True,
    }


def test_trace_targets_count_as_overload_what_offers_1_2x_fcfs_peak_throughput():
    def streams(*rates: float) -> list[dict[str, object]]:
        return [{"arrival": {"rate_rps": r}} for r in rates]

    summary = {
        "scenario": "trace",
        # 7 and 15 req/s offered; FCFS peaks at 12 req/s: only 15 (>= 14.4) is overload
        "sweep": {
            "parameter": "streams",
            "values": [streams(5.0, 2.0), streams(10.0, 5.0)],
            "variants": ["x1", "x2"],
        },
        "policies": {
            "qlm": {"slo_attainment": [0.9, 0.5], "throughput_rps": [7.0, 11.5]},
            "fcfs": {"slo_attainment": [0.9, 0.2], "throughput_rps": [7.0, 12.0]},
            "edf-shed": {"slo_attainment": [0.9, 0.46], "throughput_rps": [7.0, 12.0]},
            "vllm": {"slo_attainment": [0.9, 0.2], "throughput_rps": [7.0, 11.0]},
        },
    }
    evaluate(summary)
    met = {c["target"]: c["met"] for c in summary["checks"]}
    assert met == {
        "x1: qlm >= every baseline - 1 point": True,
        "x1: qlm throughput >= 1x vllm": True,
        "x1: qlm throughput >= 0.97x fcfs": True,
        "x2: qlm >= every baseline - 1 point": True,
        # 50 against edf-shed's 46: 4 points, not 5
        "x2 (overload): qlm >= best of fcfs, edf, edf-shed + 5 points": False,
        "x2: qlm throughput >= 1x vllm": True,
        "x2: qlm throughput >= 0.97x fcfs": False,  # 11.5 < 11.64
    }


def test_ablation_judges_each_lso_by_more_than_one_sd():
    """A default LSO pays where removing it costs more than one sd; one that is off by default
    is rightly off where adding it gains no more than one sd."""
    summary = {
        "scenario": "wa-ablation",
        "sweep": {
            "values": [{}, {}, {}, {}, {}],
            "variants": ["default", "no warm start", "no cap", "+ eviction", "+ pull"],
        },
        "policies": {
            "qlm": {
                "slo_attainment": [0.80, 0.70, 0.79, 0.82, 0.86],
                "throughput_rps": [2.0, 2.0, 2.0, 2.0, 1.5],
            },
        },
        "sd": {"qlm": {"slo_attainment": [0.03, 0.03, 0.03, 0.03, 0.03]}},
    }
    evaluate(summary)
    # warm start: -10 > 3 pays; cap: -1 within the sd; eviction: +2 within it (rightly off);
    # pull: +6 beyond it, though at a throughput cost (the miss says so)
    assert [c["met"] for c in summary["checks"]] == [True, False, True, False]
    assert "sd 3.0" in summary["checks"][0]["measured"]


def test_an_lso_with_nothing_to_act_on_is_not_judged():
    """Warm start on a one-model scenario loads nothing with it or without it, nor does the
    batch cap on instances that serve several models (it sets none there): not judged there
    (they are where models switch, where one model is served); one that did act is judged as
    before."""
    default = {"warm_start": True, "eviction": False, "batch_cap": True}
    summary = {
        "scenario": "wb-ablation",
        "sweep": {
            "values": [
                default,
                {**default, "warm_start": False},
                {**default, "eviction": True},
                {**default, "batch_cap": False},
            ],
            "variants": ["default", "no warm start", "+ eviction", "no batch cap"],
        },
        "policies": {
            "qlm": {
                "slo_attainment": [0.80, 0.80, 0.80, 0.80],
                "throughput_rps": [2.0, 2.0, 2.0, 2.0],
                "model_swaps": [0.0, 0.0, 0.0, 0.0],
                "evictions": [0.0, 0.0, 12.0, 0.0],
                "batch_caps": [0.0, 0.0, 0.0, 0.0],
            },
        },
    }
    evaluate(summary)
    warm, evict, cap = summary["checks"]
    assert warm["met"] and "not judged" in warm["target"]
    assert evict["met"] and "stays off rightly" in evict["target"]  # it acted: judged
    assert cap["met"] and "not judged" in cap["target"]
    summary["policies"]["qlm"]["model_swaps"] = [3.0, 9.0, 3.0]  # models switch: judged
    evaluate(summary)
    assert not summary["checks"][0]["met"] and "pays" in summary["checks"][0]["target"]


def test_hetero_checks_only_the_mixed_clusters():
    def pools(a10: int) -> list[dict]:
        return [{"gpu": "A10", "count": a10}, {"gpu": "A100-80GB", "count": 6 - a10}]

    summary = {
        "scenario": "hetero",
        "sweep": {"values": [pools(0), pools(2), pools(3), pools(5)]},
        "policies": {
            "qlm": {"slo_attainment": [0.9, 0.8, 0.6, 0.2], "throughput_rps": [5, 5, 4, 2]},
            "round_robin": {
                "slo_attainment": [0.9, 0.3, 0.4, 0.1],
                "throughput_rps": [5, 4, 3, 1],
            },
        },
    }
    evaluate(summary)
    assert [c["met"] for c in summary["checks"]] == [True, False]  # 33 % and 50 % A10 only


def test_scale_and_rct():
    summary = {
        "scenario": "scale",
        "policies": {"edf": {"requests": 1_000_001, "sim_wall_s": 250.0}},
        "run": {"peak_rss_mb": 5000},
    }
    evaluate(summary)
    assert [c["met"] for c in summary["checks"]] == [True, False]
    rct = {"scenario": "rct", "policies": {}, "scatter": {"x": [1, 2], "r2": 0.97}}
    evaluate(rct)
    assert rct["misses"] == []
    other = {"scenario": "delta", "policies": {}}
    evaluate(other)
    assert "checks" not in other


def test_rct_judges_the_estimates_made_at_dispatch_not_the_plans() -> None:
    def rct(at_dispatch: float, plan: float) -> dict:
        return {
            "scenario": "rct",
            "policies": {},
            "scatter": {"estimate": "dispatch", "x": [1.0] * 30, "r2": at_dispatch},
            "scatters": [
                {"name": "plan 12 req/s", "estimate": "plan", "x": [1.0] * 20, "r2": plan},
                {"name": "plan static queue", "estimate": "plan", "x": [1.0], "r2": plan},
            ],
        }

    missed = rct(at_dispatch=0.80, plan=0.99)
    evaluate(missed)
    ((target, measured, met),) = check_rct(missed)
    assert not met and "at dispatch" in target and measured == "R^2 = 0.800 over 30 requests"
    assert missed["misses"] == [f"{target}: {measured}"]
    passed = rct(at_dispatch=0.96, plan=0.10)
    evaluate(passed)
    assert passed["misses"] == [] and [c["met"] for c in passed["checks"]] == [True]
    nothing = {"scenario": "rct", "policies": {}, "scatters": rct(0.99, 0.99)["scatters"]}
    evaluate(nothing)
    assert nothing["misses"] == [
        "R^2 >= 0.95, estimated at dispatch vs simulated completion time: no estimates"
    ]


def test_agentic_holds_qlm_to_the_tasks_and_counts_overload_by_the_calls_offered() -> None:
    def col(att: list[float], thr: list[float], tasks: list[float]) -> dict[str, list[float]]:
        return {"slo_attainment": att, "throughput_rps": thr, "task_attainment": tasks}

    summary = {
        "scenario": "agentic",
        # the streams offer tasks; the labels say calls/s. FCFS peaks at 10 calls/s, so 12
        # (>= 1.2x) is overload and 8 is not
        "sweep": {"values": [[], []], "variants": ["8", "12"]},
        "policies": {
            "qlm": col([0.90, 0.55], [7.0, 9.9], [0.93, 0.40]),
            "qlm-gate": col([0.50, 0.60], [5.0, 7.0], [0.99, 0.99]),  # not a baseline
            "fcfs": col([0.90, 0.49], [7.0, 10.0], [0.94, 0.30]),
            "edf-shed": col([0.89, 0.50], [7.0, 10.0], [0.92, 0.35]),
            "vllm": col([0.90, 0.45], [7.1, 9.0], [0.90, 0.30]),
        },
    }
    evaluate(summary)
    met = {c["target"]: c["met"] for c in summary["checks"]}
    assert met == {
        "8 calls/s: qlm >= every baseline - 1 point": True,
        "8 calls/s: qlm throughput >= 1x vllm": False,  # 7.0 against 7.1
        "8 calls/s: qlm throughput >= 0.97x fcfs": True,
        "12 calls/s: qlm >= every baseline - 1 point": True,
        "12 calls/s (overload): qlm >= best of fcfs, edf, edf-shed + 5 points": True,
        "12 calls/s: qlm throughput >= 1x vllm": True,
        "12 calls/s: qlm throughput >= 0.97x fcfs": True,
        "8 calls/s: qlm tasks met >= every baseline's": False,  # fcfs 94 %
        "12 calls/s: qlm tasks met >= every baseline's": True,
    }


def test_multi_model_runs_are_held_to_shepherd_and_its_model_loads() -> None:
    summary = {
        "scenario": "wc",
        "sweep": {"values": [[], []], "variants": ["0", "1"]},
        "policies": {
            "qlm": {
                "slo_attainment": [0.8, 0.7],
                "throughput_rps": [3.0, 3.0],
                "model_swaps": [60.0, 61.0],
            },
            "shepherd": {
                "slo_attainment": [0.7, 0.71],
                "throughput_rps": [3.0, 3.0],
                "model_swaps": [50.0, 50.0],
            },
            "vllm": {
                "slo_attainment": [0.5, 0.5],
                "throughput_rps": [2.0, 3.1],
                "model_swaps": [9.0, 9.0],
            },
        },
    }
    evaluate(summary)
    assert summary["misses"] == [
        "1: qlm >= shepherd: qlm 70.0 %, shepherd 71.0 %",
        "1: qlm's model loads <= 1.2x shepherd's: qlm 61.0, shepherd 50.0",
        "1: qlm throughput >= 1x vllm: qlm 3.000, vllm 3.100 req/s",
    ]


def test_a_run_without_a_checker_of_its_own_is_held_to_the_throughput_target() -> None:
    run = {
        "scenario": "wb-512",
        "sweep": {"values": [[], []], "variants": ["8", "16"]},
        "policies": {
            "qlm": {"slo_attainment": [1.0, 0.8], "throughput_rps": [7.70, 10.0]},
            "fcfs": {"slo_attainment": [1.0, 0.5], "throughput_rps": [7.75, 10.2]},
            "vllm": {"slo_attainment": [1.0, 0.4], "throughput_rps": [7.72, 9.5]},
        },
    }
    evaluate(run)
    # 7.70 against 7.72: 0.26 % below, past the 0.1 % a finishing time explains
    assert run["misses"] == ["8: qlm throughput >= 1x vllm: qlm 7.700, vllm 7.720 req/s"]
    assert len(run["checks"]) == 4
    alone = {"scenario": "batch-api", "policies": {"qlm": {}, "edf": {}}}
    evaluate(alone)
    assert "checks" not in alone  # nothing there to hold it to


def test_the_glance_judges_a_run_by_today_s_targets_not_the_ones_it_recorded() -> None:
    from qlm.tooling.simulator.glance import current_checks

    run = {
        "scenario": "wb-512",
        "sweep": {"values": [[]], "variants": ["8"]},
        "policies": {
            "qlm": {"slo_attainment": [1.0], "throughput_rps": [7.0]},
            "vllm": {"slo_attainment": [1.0], "throughput_rps": [7.5]},
        },
        "checks": [],  # recorded before the throughput target applied to it
        "misses": [],
    }
    assert [c["met"] for c in current_checks(run)] == [False]
    capacity = {"scenario": "capacity", "policies": {}, "checks": [{"target": "t", "met": False}]}
    assert current_checks(capacity) == [{"target": "t", "met": False}]  # its own, as recorded
