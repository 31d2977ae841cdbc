"""Scenario files: validation names the bad field, YAML/JSON loading, dotted-path edits, sweeps."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from qlm.catalog import MODELS
from qlm.tooling.simulator.scenario import ScenarioError, ScenarioSpec, load_scenario


def base() -> dict[str, Any]:
    return {
        "name": "t",
        "duration_s": 60,
        "pools": [{"gpu": "A100-80GB", "count": 2, "models": ["mistral-7b", "vicuna-13b"]}],
        "streams": [
            {
                "name": "chat",
                "models": ["mistral-7b"],
                "slo_class": "interactive",
                "e2e_slo_s": 20,
                "arrival": {"process": "poisson", "rate_rps": 2.0},
                "lengths": {"source": "sharegpt"},
            }
        ],
    }


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return edit


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        del node[last]

    return edit


def _second_stream(data: dict[str, Any]) -> None:
    data["streams"].append(copy.deepcopy(data["streams"][0]))


def _second_pool(data: dict[str, Any]) -> None:
    data["pools"].append(copy.deepcopy(data["pools"][0]))


def _sweep(sweep: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return _set("sweep", sweep)


BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    # (the field path the message must name, the edit, a fragment of the message)
    ("pools.0.gpu", _set("pools.0.gpu", "Z9000"), "unknown GPU type 'Z9000'; known: ['A10'"),
    ("pools.0.count", _set("pools.0.count", -1), "greater than or equal to 0"),
    ("pools", _set("pools.0.count", 0), "at least one instance"),
    (
        "pools.1.max_num_batched_tokens",
        _set(
            "pools",
            [
                {"gpu": "A100-80GB", "count": 1, "models": ["mistral-7b"], "name": "a"},
                {
                    "gpu": "A100-80GB",
                    "count": 1,
                    "models": ["mistral-7b"],
                    "name": "b",
                    "max_num_batched_tokens": 512,
                },
            ],
        ),
        "'mistral-7b' on A100-80GB runs None in pools.0: pools serving one model",
    ),
    ("pools", _set("pools", []), "at least 1 item"),
    ("pools.0.models", _set("pools.0.models", []), "at least 1 item"),
    ("pools.0.models.1", _set("pools.0.models.1", "gpt-5"), "unknown model 'gpt-5'; known"),
    ("pools.0.tp", _set("pools.0.tp", 0), "greater than or equal to 1"),
    ("pools.0.cpu_memory_gb", _set("pools.0.cpu_memory_gb", 0), "greater than 0"),
    ("pools.1.name", _second_pool, "distinct names"),
    ("streams", _set("streams", []), "at least 1 item"),
    ("streams.0.models.0", _set("streams.0.models.0", "gpt-5"), "unknown model 'gpt-5'"),
    ("streams.0.models.0", _set("streams.0.models.0", "llama-2-70b"), "in no pool's models"),
    ("streams.0.models", _set("streams.0.models", []), "at least 1 item"),
    ("streams.1.name", _second_stream, "duplicate stream name 'chat'"),
    ("streams.0.arrival.rate_rps", _set("streams.0.arrival.rate_rps", 0), "greater than 0"),
    ("streams.0.arrival.rate_rps", _set("streams.0.arrival.rate_rps", -3), "greater than 0"),
    ("streams.0.arrival.rate_rps", _drop("streams.0.arrival.rate_rps"), "required for a poisson"),
    (
        "streams.0.arrival.rate_rps",
        _set("streams.0.arrival", {"process": "gamma", "cv": 2}),
        "required for a gamma",
    ),
    ("streams.0.arrival.cv", _set("streams.0.arrival.cv", 0), "greater than 0"),
    ("streams.0.arrival.process", _set("streams.0.arrival.process", "hawkes"), "poisson"),
    (
        "streams.0.arrival.trace",
        _set("streams.0.arrival", {"process": "trace"}),
        "required for a trace process",
    ),
    (
        "streams.0.arrival.trace",
        _set("streams.0.arrival", {"process": "trace", "trace": "/no/such/trace.csv"}),
        "neither a shipped trace",
    ),
    ("streams.0.arrival.trace", _set("streams.0.arrival.trace", "conv"), "only for process"),
    (
        "streams.0.arrival.count",
        _set("streams.0.arrival", {"process": "burst"}),
        "required for a burst",
    ),
    (
        "streams.0.arrival.rate_rps",
        _set("streams.0.arrival", {"process": "burst", "count": 5, "rate_rps": 2.0}),
        "a burst has no rate",
    ),
    ("streams.0.arrival.count", _set("streams.0.arrival.count", 5), "only for process 'burst'"),
    (
        "streams.0.arrival.count",
        _set("streams.0.arrival", {"process": "burst", "count": 0}),
        "greater than or equal to 1",
    ),
    ("streams.0.arrival.start_s", _set("streams.0.arrival.start_s", -1), "greater than or equal"),
    ("streams.0.lengths.source", _set("streams.0.lengths.source", "trace"), "needs trace arrivals"),
    (
        "streams.0.lengths.output_tokens",
        _set("streams.0.lengths", {"source": "fixed", "prompt_tokens": 10}),
        "required for source 'fixed'",
    ),
    (
        "streams.0.lengths.prompt_tokens",
        _set("streams.0.lengths", {"source": "fixed", "output_tokens": 10}),
        "required for source 'fixed'",
    ),
    (
        "streams.0.lengths.prompt_tokens",
        _set("streams.0.lengths.prompt_tokens", 10),
        "only for source 'fixed'",
    ),
    (
        "streams.0.lengths.max_prompt_tokens",
        _set("streams.0.lengths.max_prompt_tokens", 0),
        "greater",
    ),
    ("streams.0.model_weights", _set("streams.0.model_weights", [1, 2]), "has 2 entries"),
    ("streams.0.model_weights.0", _set("streams.0.model_weights", [0]), "must be > 0"),
    ("streams.0.e2e_slo_s", _drop("streams.0.e2e_slo_s"), "e2e_slo_s and/or ttft_slo_s"),
    ("streams.0.ttft_slo_s", _set("streams.0.ttft_slo_s", 0), "greater than 0"),
    ("streams.0.max_tokens_slack", _set("streams.0.max_tokens_slack", 1.0), "removed: it derived"),
    ("streams.0.max_tokens", _set("streams.0.max_tokens", 0), "greater than or equal to 1"),
    ("streams.0.end_s", _set("streams.0.end_s", 0), "greater than 0"),
    (
        "streams.0.end_s",
        lambda d: d["streams"][0].update(start_s=10, end_s=5),
        "must be > start_s",
    ),
    ("streams.0.start_s", _set("streams.0.start_s", 60), "not before duration_s"),
    ("duration_s", _set("duration_s", 0), "greater than 0"),
    ("seed", _set("seed", -1), "greater than or equal to 0"),
    ("models.ft", _set("models", {"ft": "gpt-5"}), "unknown model 'gpt-5'"),
    ("models.mistral-7b", _set("models", {"mistral-7b": "vicuna-13b"}), "may not shadow"),
    ("options.replan_interval_s", _set("options", {"replan_interval_s": 0}), "greater than 0"),
    ("options.drain_s", _set("options", {"drain_s": -1}), "greater than or equal to 0"),
    ("options.decision_delay", _set("options", {"decision_delay": "x"}), "'none' or 'measured'"),
    ("options.lso.evict", _set("options", {"lso": {"evict": False}}), "Extra inputs"),
    ("colour", _set("colour", "blue"), "Extra inputs are not permitted"),
    ("streams.0.arrival.burst", _set("streams.0.arrival.burst", 3), "Extra inputs"),
    ("pools.0.memory", _set("pools.0.memory", 3), "Extra inputs"),
    (
        "sweep.values",
        _sweep({"parameter": "streams.0.arrival.rate_rps", "values": []}),
        "at least 1 item",
    ),
    (
        "sweep.variants",
        _sweep({"parameter": "pools.0.count", "values": [1, 2], "variants": ["a"]}),
        "has 1 entries but values has 2",
    ),
    (
        "sweep.parameter",
        _sweep({"parameter": "streams.3.arrival.rate_rps", "values": [1]}),
        "streams.3: no index",
    ),
    (
        "sweep.values.1",
        _sweep({"parameter": "pools.0.count", "values": [1, 0]}),
        "pools: the scenario needs at least one instance",
    ),
    (
        "sweep.values.0",
        _sweep({"parameter": "streams.0.arrival.rate_rps", "values": [-1.0]}),
        "streams.0.arrival.rate_rps: Input should be greater than 0",
    ),
]


@pytest.mark.parametrize(
    ("path", "edit", "fragment"), BAD, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD)]
)
def test_bad_scenarios_name_the_field(
    path: str, edit: Callable[[dict[str, Any]], None], fragment: str
) -> None:
    data = base()
    edit(data)
    with pytest.raises(ScenarioError) as caught:
        ScenarioSpec.model_validate(data)
    message = str(caught.value)
    assert f"{path}: " in message
    assert fragment in message


def test_base_scenario_is_valid_and_constructor_raises_scenario_error() -> None:
    spec = ScenarioSpec.model_validate(base())
    assert spec.policies == ["qlm", "edf", "fcfs", "shepherd"]
    assert spec.options.lso_policies == ["qlm"]
    data = base()
    data["pools"][0]["gpu"] = "Z9000"
    with pytest.raises(ScenarioError, match=r"pools\.0\.gpu: unknown GPU type"):
        ScenarioSpec(**data)


def test_pool_whose_model_does_not_fit_names_the_pool() -> None:
    data = base()
    data["models"] = {"big-ft": "vicuna-13b"}
    data["pools"] = [
        {"gpu": "A100-80GB", "count": 1, "models": ["mistral-7b"]},
        {"gpu": "A10", "count": 1, "tp": 1, "models": ["mistral-7b", "big-ft"]},
    ]
    with pytest.raises(ScenarioError) as caught:
        ScenarioSpec.model_validate(data)
    message = str(caught.value)
    assert message.startswith("pools.1: model 'big-ft' does not fit on A10")
    assert "big-ft" in message.split("A10:", 1)[1]  # the engine model saw the renamed alias
    # With tp chosen by the engine model the same pool is fine (vicuna-13b on 2 A10s).
    del data["pools"][1]["tp"]
    ScenarioSpec.model_validate(data)


def test_aliases_and_variants_resolve() -> None:
    data = base()
    data["models"] = {"mistral-ft-3": "mistral-7b"}
    data["pools"][0]["models"] = ["mistral-ft-3", "vicuna-13b@chat"]
    data["streams"][0]["models"] = ["vicuna-13b@chat", "mistral-ft-3"]
    spec = ScenarioSpec.model_validate(data)
    alias = spec.model_spec("mistral-ft-3")
    assert alias.name == "mistral-ft-3"
    assert alias.max_context == MODELS["mistral-7b"].max_context
    assert alias.n_layers == MODELS["mistral-7b"].n_layers
    assert spec.model_spec("vicuna-13b@chat").name == "vicuna-13b@chat"
    assert spec.model_spec("mistral-7b") == MODELS["mistral-7b"]
    assert spec.model_names() == ["mistral-ft-3", "vicuna-13b@chat"]
    with pytest.raises(ScenarioError, match="unknown model 'nope'"):
        spec.model_spec("nope")


# --- files -----------------------------------------------------------------------------------


def test_load_yaml_and_json_give_the_same_scenario(tmp_path: Path) -> None:
    data = base()
    data["sweep"] = {"parameter": "streams.0.arrival.rate_rps", "values": [1, 2]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "s.json").write_text(json.dumps(data))
    from_yaml = load_scenario(tmp_path / "s.yaml")
    from_json = load_scenario(str(tmp_path / "s.json"))
    assert from_yaml == from_json
    assert from_yaml.streams[0].arrival.rate_rps == 2.0
    assert from_yaml.sweep is not None and from_yaml.sweep.values == [1, 2]
    # A dump loads back to the same scenario.
    (tmp_path / "dump.yml").write_text(yaml.safe_dump(from_yaml.model_dump(mode="json")))
    assert load_scenario(tmp_path / "dump.yml") == from_yaml


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda d: d.update(colour="blue"), "colour: Extra inputs are not permitted"),
        (
            lambda d: d["streams"][0]["lengths"].update(bucket=1),
            "streams.0.lengths.bucket: Extra inputs are not permitted",
        ),
        (lambda d: d.update(options={"lso": {"swapp": True}}), "options.lso.swapp: Extra"),
    ],
)
def test_load_rejects_unknown_keys(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], fragment: str
) -> None:
    data = base()
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    assert str(path) in str(caught.value)
    assert fragment in str(caught.value)


def test_load_errors_name_the_file_and_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: t\nduration_s: 60\npools: [unclosed\n")
    with pytest.raises(ScenarioError, match=rf"{broken}:\d+: invalid YAML"):
        load_scenario(broken)
    broken_json = tmp_path / "broken.json"
    broken_json.write_text('{\n "name": "t",\n "duration_s": \n}')
    with pytest.raises(ScenarioError, match=rf"{broken_json}:4: invalid JSON"):
        load_scenario(broken_json)
    listed = tmp_path / "list.yaml"
    listed.write_text("- name: t\n")
    with pytest.raises(ScenarioError, match=rf"{listed}: a scenario is a mapping, got list"):
        load_scenario(listed)
    with pytest.raises(ScenarioError, match="not '.toml'"):
        load_scenario(tmp_path / "s.toml")
    with pytest.raises(ScenarioError, match="missing.yaml: cannot read"):
        load_scenario(tmp_path / "missing.yaml")


# --- with_value and sweeps -------------------------------------------------------------------


def test_with_value_sets_a_copy_and_revalidates() -> None:
    spec = ScenarioSpec.model_validate(base())
    faster = spec.with_value("streams.0.arrival.rate_rps", 8)
    assert faster.streams[0].arrival.rate_rps == 8.0
    assert spec.streams[0].arrival.rate_rps == 2.0  # the original is untouched
    assert spec.with_value("options.lso.swap", False).options.lso.swap is False
    assert spec.with_value("pools.0.count", 5).pools[0].count == 5
    aliased = spec.with_value("models.ft", "mistral-7b")  # a new alias is a new key
    assert aliased.model_spec("ft").name == "ft"
    with pytest.raises(ScenarioError, match=r"^streams\.0\.arrival\.rate_rps: Input should be"):
        spec.with_value("streams.0.arrival.rate_rps", 0)
    with pytest.raises(ScenarioError, match=r"^pools: the scenario needs"):
        spec.with_value("pools.0.count", 0)


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("streams.4.arrival.rate_rps", "streams.4: no index '4'"),
        ("streams.x.arrival", "streams.x: no index 'x'"),
        ("pools.0.colour", "pools.0.colour: no field 'colour'"),
        ("duration_s.value", "duration_s.value: duration_s is a value"),
        ("options..swap", "not a dotted path"),
        ("", "not a dotted path"),
    ],
)
def test_with_value_bad_path_names_it(path: str, fragment: str) -> None:
    spec = ScenarioSpec.model_validate(base())
    with pytest.raises(ScenarioError) as caught:
        spec.with_value(path, 1)
    assert fragment in str(caught.value)


@given(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))
def test_with_value_rate_property(rate: float) -> None:
    spec = ScenarioSpec.model_validate(base())
    if rate > 0:
        assert spec.with_value("streams.0.arrival.rate_rps", rate).streams[0].arrival.rate_rps == (
            rate
        )
    else:
        with pytest.raises(ScenarioError, match=r"streams\.0\.arrival\.rate_rps"):
            spec.with_value("streams.0.arrival.rate_rps", rate)


def test_sweep_points_of_a_rate() -> None:
    data = base()
    data["sweep"] = {"parameter": "streams.0.arrival.rate_rps", "values": [1, 2.5, 4]}
    spec = ScenarioSpec.model_validate(data)
    points = spec.sweep_points()
    assert [label for label, _ in points] == ["1", "2.5", "4"]
    assert [p.streams[0].arrival.rate_rps for _, p in points] == [1.0, 2.5, 4.0]
    assert all(p.sweep is None for _, p in points)
    assert all(p.duration_s == spec.duration_s and p.pools == spec.pools for _, p in points)


def test_sweep_points_of_a_pool_count_with_variants() -> None:
    data = base()
    data["sweep"] = {
        "parameter": "pools.0.count",
        "values": [1, 4],
        "variants": ["one GPU", "four GPUs"],
        "label": "GPUs",
    }
    points = ScenarioSpec.model_validate(data).sweep_points()
    assert [(label, p.pools[0].count) for label, p in points] == [("one GPU", 1), ("four GPUs", 4)]


def test_sweep_of_a_whole_list_and_no_sweep() -> None:
    data = base()
    other = copy.deepcopy(data["streams"])
    other[0]["name"] = "batch"
    data["sweep"] = {"parameter": "streams", "values": [other], "label": "mix"}
    [(label, point)] = ScenarioSpec.model_validate(data).sweep_points()
    assert label == "mix #0"
    assert point.streams[0].name == "batch"
    plain = ScenarioSpec.model_validate(base())
    assert plain.sweep_points() == [("", plain)]
