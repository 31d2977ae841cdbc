"""The live autoscaler (issue 8 item 3): the capacity spec file, and a running coordinator on the
real broker whose capacity loop hands its decisions to an operator's program, shows them on
``GET /v1/capacity`` and counts them in the metrics."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from qlm.client import QlmClient
from qlm.planner.capacity.live_loop import load_capacity_spec
from qlm.planner.capacity.policies import PoolKey
from qlm.types import SLO, RequestMessage
from tests.e2e import running_cluster

SPEC = """
pool: west
gpu_cost_per_hour: {A100-80GB: 3.67}
profiles:
  - {model: mistral-7b, gpu_type: A100-80GB, tpm: 400000, gpus: 1, startup_s: 120}
min_instances: 1
max_instances: {mistral-7b: 4}
"""


def test_the_capacity_spec_file_is_read_and_bad_ones_are_named(tmp_path: Path) -> None:
    path = tmp_path / "capacity.yaml"
    path.write_text(SPEC)
    spec, pool = load_capacity_spec(path)
    assert pool == "west"
    assert spec.profile("mistral-7b", "A100-80GB") is not None
    assert spec.max_for(PoolKey("mistral-7b", "west")) == 4
    bad = [
        ("pool: x\n", "gpu_cost_per_hour"),
        (SPEC.replace("tpm: 400000", "tpm: -1"), "tpm"),
        (SPEC + "surprise: 1\n", "surprise"),
        (SPEC.replace("{A100-80GB: 3.67}", "{H100-80GB: 5}"), "A100-80GB"),
        ("[: not yaml", "not YAML"),
    ]
    for text, needle in bad:
        path.write_text(text)
        with pytest.raises(ValueError, match=needle):
            load_capacity_spec(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_capacity_spec(tmp_path / "missing.yaml")


@pytest.mark.broker
@pytest.mark.slow
async def test_a_live_coordinator_autoscales_through_the_operators_program(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    spec = tmp_path / "capacity.yaml"
    spec.write_text(SPEC)
    decisions = tmp_path / "decisions.jsonl"
    program = tmp_path / "scale.py"
    program.write_text(
        "import json, os, sys\n"
        "d = json.load(sys.stdin)\n"
        f"with open({str(decisions)!r}, 'a') as f:\n"
        "    f.write(json.dumps({'id': os.environ['QLM_DECISION_ID'], **d}) + '\\n')\n"
    )
    env = {
        # CATO's scaler: SLA misses (the requests below cannot meet a 1 ms deadline) scale out
        "QLM_AUTOSCALE_POLICY": "cato",
        "QLM_CAPACITY_SPEC": str(spec),
        "QLM_AUTOSCALE_COMMAND": f"{sys.executable} {program}",
        "QLM_AUTOSCALE_INTERVAL_S": "0.5",
    }
    agents = [{"agent_id": "as-a", "models": ["mistral-7b"], "time_scale": 50.0}]
    async with running_cluster(isolated_amqp_url, tmp_path, agents, extra_env=env) as cluster:
        async with QlmClient(isolated_amqp_url) as client:
            futures = [
                await client.submit(
                    RequestMessage(
                        request_id=f"as-{k}",
                        model="mistral-7b",
                        prompt="hello",
                        max_tokens=16,
                        slo=SLO(e2e_ms=1),
                    )
                )
                for k in range(12)
            ]
            await asyncio.wait_for(asyncio.gather(*futures), timeout=60)
        status: dict = {}
        for _ in range(40):
            status = (await cluster.admin("GET", "/v1/capacity")).json()
            if status.get("decisions"):
                break
            await asyncio.sleep(0.5)
        metrics = (await cluster.admin("GET", "/metrics")).text
    assert status["policy"] == "cato" and status["driver"] == "command"
    assert status["pool"] == "west" and not status["dry_run"]
    record = status["decisions"][0]
    assert record["outcome"]["applied"] is True
    assert record["decision"]["deltas"]["mistral-7b/A100-80GB/west"] > 0
    assert "violations" in record["decision"]["reasons"]["mistral-7b/west"]
    # the observation the decision was made on travels with it
    assert record["decision"]["observation"]["instances"]["mistral-7b/A100-80GB/west"] >= 1
    lines = [json.loads(line) for line in decisions.read_text().splitlines()]
    assert lines and lines[0]["id"] == record["decision"]["id"]
    assert 'qlm_capacity_decisions_total{outcome="applied",policy="cato"}' in metrics
    assert "qlm_capacity_target_instances" in metrics
    # the added instance never registers (the program only logs): it stays pending, so the
    # loop does not ask for it again on every tick
    assert status["pending"]["add"].get("mistral-7b/A100-80GB/west", 0) >= 1
