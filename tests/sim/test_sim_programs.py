"""Programs of dependent calls in the simulator: task chains (CATO) and collective programs
(Tempo). A call is issued only after the calls it depends on finished; its deadline comes from
the same code the live coordinator uses (qlm/chains.py, qlm/collective.py); task attainment is
judged per program."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.planner import create_policy
from qlm.tooling.simulator.cluster import ClusterSimulator, InstanceSpec, SimConfig
from qlm.tooling.simulator.scenario import ScenarioError, ScenarioSpec
from qlm.tooling.simulator.workload import SimRequest, build_requests
from qlm.types import StageInfo

A100 = "A100-80GB"


def call(rid: str, arrival: float = 0.0, output: int = 50, **extra: object) -> SimRequest:
    return SimRequest(
        request_id=rid,
        model="mistral-7b",
        arrival_s=arrival,
        prompt_tokens=200,
        output_tokens=output,
        max_tokens=output,
        slo_class=str(extra.pop("slo_class", "agent")),
        e2e_slo_s=extra.pop("e2e", None),  # type: ignore[arg-type]
        ttft_slo_s=None,
        stream="s",
        **extra,  # type: ignore[arg-type]
    )


def simulate(reqs: list[SimRequest], policy: str = "fcfs", **config: object):
    sim = ClusterSimulator(
        [InstanceSpec("i0", A100, ("mistral-7b",))],
        create_policy(policy),
        reqs,
        SimConfig(**config),  # type: ignore[arg-type]
    )
    return sim, sim.run()


def chain(pid: str, steps: int, *, sla: float, step_s: float, think: float = 0.0, start=0.0):
    return [
        call(
            f"{pid}.{k}",
            start,
            after=(f"{pid}.{k - 1}",) if k else (),
            think_s=think if k else 0.0,
            program_id=pid,
            program_slo_s=sla,
            task_slo_s=sla,
            remaining_s=(steps - 1 - k) * step_s,
        )
        for k in range(steps)
    ]


def test_a_chain_step_is_issued_after_the_previous_one_finished_plus_its_think_time():
    sim, result = simulate(chain("t", 3, sla=60.0, step_s=5.0, think=2.0))
    by_id = {o.request_id: o for o in result.outcomes}
    for k in (1, 2):
        before, after = by_id[f"t.{k - 1}"], by_id[f"t.{k}"]
        assert before.finished_s is not None
        assert after.arrival_s == pytest.approx(before.finished_s + 2.0)
    assert result.tasks == [("agent", True)]
    assert result.metrics()["task_attainment"] == 1.0
    assert result.metrics()["tasks"] == 1


def test_a_chain_steps_deadline_is_the_task_sla_less_the_later_steps_profile():
    reqs = chain("t", 3, sla=60.0, step_s=5.0)
    sim, result = simulate(reqs, record_estimates=False)
    first = {o.request_id: o for o in result.outcomes}["t.0"]
    # judged against start + 60 - 2 * 5 (the live coordinator's rule): met by a 50-token call
    assert sim._judged["t.0"] == pytest.approx(first.arrival_s + 50.0)
    assert sim._judged["t.2"] == pytest.approx(first.arrival_s + 60.0)


def test_a_task_that_overruns_its_sla_is_missed_though_early_steps_met_theirs():
    # long steps, a tight SLA: the first step meets its (early) deadline, the task does not
    reqs = chain("t", 3, sla=12.0, step_s=1.0)
    for r in reqs:
        r.output_tokens = r.max_tokens = 600
    _, result = simulate(reqs)
    assert result.tasks == [("agent", False)]
    assert result.metrics()["task_attainment"] == 0.0


@pytest.mark.parametrize(("rule", "has_deadline"), [("promote", True), ("demote", False)])
def test_calls_of_a_late_task_are_promoted_or_demoted(rule, has_deadline):
    # the second step arrives after its derived deadline (SLA 1 s, 3 s of tool time)
    reqs = chain("t", 2, sla=1.0, step_s=0.1, think=3.0)
    sim, _ = simulate(reqs, late_task_rule=rule)
    view = sim.jobs["t.1"].view
    assert (view.deadline is not None) == has_deadline
    if rule == "promote":
        assert view.priority == 9


def test_a_program_never_started_or_unfinished_counts_as_missed():
    # the scenario ends (no drain) before the second step is issued
    reqs = chain("t", 2, sla=60.0, step_s=1.0, think=50.0)
    _, result = simulate(reqs, drain_s=0.0)
    assert result.tasks == [("agent", False)]
    issued = {o.request_id: o for o in result.outcomes}
    assert issued["t.1"].finished_s is None and not issued["t.1"].met


def stage_calls(pid: str, stage: int, fanout: int, last: bool, slo: float) -> list[SimRequest]:
    info = StageInfo(
        program_id=pid,
        app_type="tot",
        stage_id=f"s{stage}",
        after=[f"s{stage - 1}"] if stage else [],
        program_slo_ms=int(slo * 1000),
        last_stage=last,
    )
    before = tuple(f"{pid}.{stage - 1}.{i}" for i in range(fanout)) if stage else ()
    return [
        call(
            f"{pid}.{stage}.{i}",
            after=before,
            program_id=pid,
            program_slo_s=slo,
            stage=info,
            output=40 * (stage + 1),
        )
        for i in range(fanout)
    ]


def test_a_stage_starts_when_the_whole_stage_before_it_finished_and_shares_its_deadline():
    reqs = [*stage_calls("p", 0, 3, False, 60.0), *stage_calls("p", 1, 3, True, 60.0)]
    sim, result = simulate(reqs)
    by_id = {o.request_id: o for o in result.outcomes}
    last_of_first = max(by_id[f"p.0.{i}"].finished_s for i in range(3))  # type: ignore[type-var]
    for i in range(3):
        assert by_id[f"p.1.{i}"].arrival_s == pytest.approx(last_of_first)
    assert len({sim._judged[f"p.1.{i}"] for i in range(3)}) == 1  # one shared deadline
    assert result.tasks == [("agent", True)]
    assert sim.core.collective.finished_programs == 1


def test_a_later_program_gets_its_stage_deadlines_from_the_finished_ones():
    first = [*stage_calls("a", 0, 2, False, 60.0), *stage_calls("a", 1, 2, True, 60.0)]
    later = [*stage_calls("b", 0, 2, False, 60.0), *stage_calls("b", 1, 2, True, 60.0)]
    for r in later:
        r.arrival_s = 100.0
    sim, result = simulate(first + later)
    assert sim.core.collective.matched_stages >= 1
    # b's first stage gets a share of the program's 60 s, not all of it
    start = {o.request_id: o for o in result.outcomes}["b.0.0"].arrival_s
    assert sim._judged["b.0.0"] < start + 60.0
    assert [met for _, met in result.tasks] == [True, True]


def test_tbt_slo_is_judged_on_the_mean_gap_after_the_first_token():
    loose = call("loose", e2e=60.0, output=100, tbt_slo_s=1.0)
    tight = call("tight", e2e=60.0, output=100, tbt_slo_s=1e-4)
    _, result = simulate([loose, tight])
    met = {o.request_id: o.met for o in result.outcomes}
    assert met == {"loose": True, "tight": False}


def test_a_call_after_an_unknown_request_is_refused():
    with pytest.raises(ValueError, match="unknown requests"):
        simulate([call("x", after=("nope",), e2e=10.0)])


# ---------------------------------------------------------------------------- scenario files


def scenario(program: dict, **stream: object) -> dict:
    return {
        "name": "p",
        "duration_s": 30,
        "pools": [{"gpu": A100, "count": 1, "models": ["mistral-7b"]}],
        "policies": ["fcfs"],
        "streams": [
            {
                "name": "agent",
                "models": ["mistral-7b"],
                "slo_class": "agent",
                "arrival": {"process": "poisson", "rate_rps": 1.0},
                "lengths": {"source": "sharegpt", "max_prompt_tokens": 256},
                "program": program,
                **stream,
            }
        ],
    }


def test_a_chain_stream_builds_dependent_steps_with_growing_context():
    spec = ScenarioSpec.model_validate(
        scenario(
            {
                "shape": "chain",
                "stages": [3, 3],
                "think_s": 1.0,
                "slo_s": 10.0,
                "slo_per_stage": True,
                "step_s": 4.0,
            }
        )
    )
    reqs = build_requests(spec)
    steps = [r for r in reqs if r.program_id == "agent-0"]
    assert [r.request_id for r in steps] == ["agent-0.0", "agent-0.1", "agent-0.2"]
    assert steps[1].after == ("agent-0.0",) and steps[2].after == ("agent-0.1",)
    assert [r.remaining_s for r in steps] == [8.0, 4.0, 0.0]
    assert {r.task_slo_s for r in steps} == {30.0}  # 10 s per step
    # each step's prompt carries the previous step's prompt and output
    assert steps[1].prompt_tokens > steps[0].prompt_tokens + steps[0].output_tokens
    assert all(r.stage is None for r in steps)


def test_a_tree_stream_builds_stages_that_wait_for_the_whole_stage_before():
    spec = ScenarioSpec.model_validate(
        scenario(
            {"shape": "tree", "stages": [2, 2], "fanout": [3, 3], "slo_s": 20.0, "context": "fresh"}
        )
    )
    reqs = [r for r in build_requests(spec) if r.program_id == "agent-0"]
    assert len(reqs) == 6
    second = [r for r in reqs if r.stage is not None and r.stage.stage_id == "s1"]
    assert all(set(r.after) == {"agent-0.0.0", "agent-0.0.1", "agent-0.0.2"} for r in second)
    assert all(r.stage is not None and r.stage.last_stage for r in second)
    assert {r.program_slo_s for r in reqs} == {20.0}


def test_a_default_step_profile_comes_from_the_engine_model():
    spec = ScenarioSpec.model_validate(
        scenario({"shape": "chain", "stages": [2, 2], "think_s": 1.5, "slo_s": 30.0})
    )
    first = next(r for r in build_requests(spec) if r.program_id == "agent-0")
    assert first.remaining_s > 1.5  # think time plus a modelled call


@pytest.mark.parametrize(
    ("program", "stream", "message"),
    [
        ({"shape": "chain", "stages": [3, 2], "slo_s": 5}, {}, "stages: needs 1 <= min"),
        ({"shape": "chain", "stages": [1, 2], "fanout": [2, 2], "slo_s": 5}, {}, "fanout"),
        ({"shape": "tree", "stages": [0, 2], "slo_s": 5}, {}, "stages"),
        ({"shape": "tree", "stages": [1, 2]}, {}, "slo_s"),
    ],
)
def test_bad_programs_are_refused_naming_the_field(program, stream, message):
    with pytest.raises(ScenarioError, match=message):
        ScenarioSpec.model_validate(scenario(program, **stream))


def test_programs_do_not_change_the_draws_of_the_other_streams():
    plain = scenario({"shape": "chain", "stages": [2, 2], "slo_s": 9.0})
    del plain["streams"][0]["program"]
    plain["streams"][0]["e2e_slo_s"] = 9.0
    with_program = scenario({"shape": "chain", "stages": [2, 2], "slo_s": 9.0})
    with_program["streams"] = [plain["streams"][0], {**with_program["streams"][0], "name": "b"}]
    alone = build_requests(ScenarioSpec.model_validate(plain))
    mixed = [
        r for r in build_requests(ScenarioSpec.model_validate(with_program)) if r.stream == "agent"
    ]
    assert [(r.arrival_s, r.prompt_tokens) for r in alone] == [
        (r.arrival_s, r.prompt_tokens) for r in mixed
    ]


def test_the_agentic_scenario_reports_task_attainment_per_policy(tmp_path):
    import json

    import yaml
    from typer.testing import CliRunner

    from qlm.cli import app
    from qlm.tooling.simulator.presets import agentic

    path = tmp_path / "agentic.yaml"
    path.write_text(yaml.safe_dump(agentic(duration_s=40.0, rates=[4.0, 12.0])))
    out = tmp_path / "summary.json"
    result = CliRunner().invoke(
        app, ["bench", "sim", "--file", str(path), "--json", str(out), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    columns = summary["policies"]
    assert set(columns) == {
        *("qlm", "qlm-gate", "edf", "edf-demote", "gain_density", "fcfs", "edf-shed", "vllm")
    }
    for entry in columns.values():
        assert len(entry["task_attainment"]) == 2
        assert all(0.0 <= v <= 1.0 for v in entry["task_attainment"])
        assert set(entry["task_attainment_by_class"]) == {"agent", "tot"}
        assert all(n > 0 for n in entry["tasks"])
        assert len(entry["service_gain"]) == 2


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(
            st.sampled_from(["chain", "tree"]),
            st.integers(1, 4),  # stages
            st.integers(1, 3),  # fanout (trees)
            st.floats(0.0, 30.0),  # start
            st.floats(0.0, 3.0),  # think time
        ),
        min_size=1,
        max_size=6,
    ),
    policy=st.sampled_from(["fcfs", "edf", "gain_density"]),
)
def test_every_call_runs_once_and_only_after_what_it_depends_on(shapes, policy):
    reqs: list[SimRequest] = []
    for p, (shape, stages, fanout, start, think) in enumerate(shapes):
        if shape == "chain":
            steps = chain(f"c{p}", stages, sla=30.0, step_s=2.0, think=think, start=start)
            reqs += steps
            continue
        for stage in range(stages):
            calls = stage_calls(f"t{p}", stage, fanout, stage == stages - 1, 20.0 * stages)
            for c in calls:
                c.arrival_s = start
                c.think_s = think if stage else 0.0
            reqs += calls
    sim, result = simulate(reqs, policy=policy, drain_s=3600.0)
    done = {o.request_id: o for o in result.outcomes}
    assert len(done) == len(reqs) == len(result.outcomes)  # each call once
    for r in reqs:
        o = done[r.request_id]
        assert o.finished_s is not None  # the drain lets everything finish
        for dep in r.after:
            before = done[dep]
            assert before.finished_s is not None
            assert o.arrival_s >= before.finished_s + r.think_s - 1e-9
    assert len(result.tasks) == len(shapes)
    assert result.metrics()["tasks"] == len(shapes)
