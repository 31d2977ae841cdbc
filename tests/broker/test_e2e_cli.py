"""The operator-facing CLI against a live coordinator: `qlm submit` and `qlm admin`."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from qlm.types import SLO, RequestMessage
from tests.e2e import running_cluster

pytestmark = [pytest.mark.broker, pytest.mark.slow]

AGENT = [{"agent_id": "cli-a", "models": ["mistral-7b"], "time_scale": 50.0}]


async def qlm(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "qlm.cli",
        *args,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_submit_jsonl_and_admin_commands(isolated_amqp_url: str, tmp_path: Path) -> None:
    jsonl = tmp_path / "requests.jsonl"
    jsonl.write_text(
        "\n".join(
            RequestMessage(
                request_id=f"cli-{i}",
                model="mistral-7b",
                prompt=f"hello {i}",
                max_tokens=5,
                slo=SLO(e2e_ms=30_000, slo_class="chat"),
            ).model_dump_json()
            for i in range(20)
        )
        + "\n"
    )
    report = tmp_path / "report.json"
    async with running_cluster(isolated_amqp_url, tmp_path / "cluster", AGENT) as cluster:
        env = {
            "QLM_AMQP_URL": isolated_amqp_url,
            "QLM_ADMIN_URL": cluster.admin_url,
            "QLM_ADMIN_TOKEN": cluster.token,
            "QLM_LOG_LEVEL": "warning",
        }
        rc, out, err = await qlm("submit", str(jsonl), "--json", str(report), env=env)
        assert rc == 0, err
        assert "chat" in out  # the per-class table
        rc, out, err = await qlm("admin", "instances", env=env)
        assert rc == 0, err
        assert [i["instance_id"] for i in json.loads(out)] == ["cli-a-gpu0"]
        rc, out, err = await qlm("admin", "request", "cli-3", env=env)
        assert rc == 0 and json.loads(out)["status"] == "completed", (out, err)
        rc, out, err = await qlm("admin", "drain", "nope", env=env)
        assert rc == 1 and "404" in err
        rc, _, err = await qlm("admin", "instances", env={**env, "QLM_ADMIN_TOKEN": "wrong-token"})
        # a refused token is a configuration error: one line, exit status 2 (issue 19)
        assert rc == 2 and "refused the token" in err and len(err.strip().splitlines()) == 1
    data = json.loads(report.read_text())
    assert data["requests_sent"] == 20 and data["replies"] == 20
    assert data["lost"] == 0 and data["duplicates"] == 0
