"""`qlm admin` against a live coordinator: --url/--token, -o table|json|yaml, plan, drain and
undrain, cancel; and the one-line errors (exit status 2) of a CLI that cannot reach a broker,
an admin API or has no token."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import pytest
import yaml

from qlm.client import QlmClient
from qlm.types import SLO, ErrorCode, ErrorMessage, RequestMessage
from tests.broker.test_e2e_cli import qlm
from tests.e2e import running_cluster

MODEL = "mistral-7b"
AGENT = [{"agent_id": "adm", "models": [MODEL], "time_scale": 5.0}]
# long-deadline requests stay held in the batch tier: a request to cancel that waits for sure
HOLD = {"QLM_BATCH_RELEASE_BELOW": "0", "QLM_BATCH_RELEASE_TWO_BELOW": "0"}
QUIET = {"QLM_LOG_LEVEL": "warning", "QLM_ADMIN_URL": "", "QLM_ADMIN_TOKEN": ""}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_error_line(rc: int, out: str, err: str, *words: str) -> None:
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qlm: error: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.broker
@pytest.mark.slow
async def test_admin_commands_against_a_live_coordinator(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    async with running_cluster(isolated_amqp_url, tmp_path, AGENT, extra_env=HOLD) as cluster:
        # --url and --token, not the environment
        opts = ["--url", cluster.admin_url, "--token", cluster.token]
        env = dict(QUIET)
        rc, out, err = await qlm("admin", "instances", *opts, env=env)
        assert rc == 0, err
        assert [i["instance_id"] for i in json.loads(out)] == ["adm-gpu0"]  # json off a TTY
        rc, out, err = await qlm("admin", "instances", *opts, "-o", "yaml", env=env)
        assert rc == 0 and yaml.safe_load(out)[0]["status"] == "alive", err
        rc, out, err = await qlm("admin", "instances", *opts, "-o", "table", env=env)
        assert rc == 0 and "adm-gpu0" in out, err
        year = time.strftime("%Y", time.gmtime())
        assert f"{year}-" in out and "Z" in out  # last_seen as ISO-8601 UTC
        rc, out, err = await qlm("admin", "instances", *opts, "-o", "xml", env=env)
        _one_error_line(rc, out, err, "xml")

        rc, out, err = await qlm("admin", "replan", *opts, env=env)
        assert rc == 0, err
        plan_id = json.loads(out)["plan_id"]
        rc, out, err = await qlm("admin", "plan", *opts, "-o", "json", env=env)
        assert rc == 0 and json.loads(out)["plan_id"] == plan_id, err

        rc, out, err = await qlm("admin", "drain", "adm-gpu0", *opts, env=env)
        assert rc == 0 and json.loads(out)["status"] == "draining", err
        rc, out, err = await qlm("admin", "undrain", "adm-gpu0", *opts, env=env)
        assert rc == 0 and json.loads(out) == {"instance_id": "adm-gpu0", "status": "alive"}
        rc, out, err = await qlm("admin", "undrain", "nope", *opts, env=env)
        assert rc == 1 and "instance_not_found" in err and len(err.strip().splitlines()) == 1

        # a held request, cancelled by the operator: its producer gets one `cancelled` reply
        async with QlmClient(isolated_amqp_url) as client:
            held = await client.submit(
                RequestMessage(
                    request_id="adm-held",
                    model=MODEL,
                    prompt="hello",
                    max_tokens=8,
                    slo=SLO(e2e_ms=5 * 3600_000),
                    tenant="someone",
                )
            )
            rc, out, err = "", "", ""
            for _ in range(50):  # the coordinator may not have taken it from the queue yet
                rc, out, err = await qlm(  # type: ignore[assignment]
                    "admin", "cancel", "adm-held", "--reason", "ops", *opts, env=env
                )
                if rc == 0:
                    break
                await asyncio.sleep(0.1)
            assert rc == 0 and json.loads(out)["outcome"] == "cancelled", (out, err)
            reply = await asyncio.wait_for(held, 30)
            assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.CANCELLED
            assert "ops" in reply.message
        rc, out, err = await qlm("admin", "cancel", "never-seen", *opts, env=env)
        assert rc == 1 and "request_not_found" in err

        # the token: missing, wrong
        rc, out, err = await qlm("admin", "instances", "--url", cluster.admin_url, env=env)
        _one_error_line(rc, out, err, "no admin token", "--token")
        rc, out, err = await qlm(
            "admin", "instances", "--url", cluster.admin_url, "--token", "wrong-token", env=env
        )
        _one_error_line(rc, out, err, "refused the token")


async def test_unreachable_admin_api_and_broker_are_one_line(tmp_path: Path) -> None:
    port = _closed_port()
    env = dict(QUIET)
    rc, out, err = await qlm(
        "admin", "instances", "--url", f"http://127.0.0.1:{port}", "--token", "t", env=env
    )
    _one_error_line(rc, out, err, f"127.0.0.1:{port}", "QLM_ADMIN_URL")
    rc, out, err = await qlm("admin", "plan", "--url", "ftp://127.0.0.1/", "--token", "t", env=env)
    _one_error_line(rc, out, err, "URL")
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text(
        RequestMessage(
            request_id="x1", model=MODEL, prompt="hi", max_tokens=2, slo=SLO(e2e_ms=10_000)
        ).model_dump_json()
        + "\n"
    )
    broker = {**env, "QLM_AMQP_URL": f"amqp://guest:guest@127.0.0.1:{port}/"}
    rc, out, err = await qlm("submit", str(jsonl), "--no-progress", env=broker)
    _one_error_line(rc, out, err, "broker", f"127.0.0.1:{port}", "QLM_AMQP_URL")
    # --debug: the same failure with its traceback
    rc, out, err = await qlm("--debug", "submit", str(jsonl), "--no-progress", env=broker)
    assert (
        rc == 2
        and "Traceback" in err
        and err.strip().endswith("qlm demo` starts a private broker)")
    )


async def test_bad_options_and_settings_are_one_line() -> None:
    env = dict(QUIET)
    rc, out, err = await qlm("coordinator", "--admin-port", "abc", env=env)
    _one_error_line(rc, out, err, "--admin-port", "qlm coordinator --help")
    rc, out, err = await qlm("no-such-command", env=env)
    _one_error_line(rc, out, err, "no-such-command")
    rc, out, err = await qlm("--version", env=env)
    assert rc == 0 and out.startswith("qlm "), (out, err)
