"""Autoscaler drivers: the dry run, and an operator's program that succeeds, fails, hangs or is
missing - each reported, none raising, the decision passed whole."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

from qlm.capacity.drivers import CommandDriver, DryRunDriver, create_driver

DECISION = {"id": "d-1", "deltas": {"mistral-7b/A100/pool-a": 1}, "reason": "forecast peak"}


async def test_the_default_is_a_dry_run_that_changes_nothing() -> None:
    driver = create_driver(None)
    assert isinstance(driver, DryRunDriver)
    outcome = await driver.apply(DECISION)
    assert outcome.dry_run and not outcome.applied and outcome.decision_id == "d-1"
    assert driver.recent[-1][0] == DECISION


async def test_the_command_gets_the_decision_on_stdin(tmp_path: Path) -> None:
    got = tmp_path / "got.json"
    script = f"import json,os,sys; d=json.load(sys.stdin); d['env_id']=os.environ['QLM_DECISION_ID']; open({str(got)!r},'w').write(json.dumps(d)); print('scaled')"  # noqa: E501
    driver = CommandDriver([sys.executable, "-c", script], timeout_s=30)
    outcome = await driver.apply(DECISION)
    assert outcome.applied and not outcome.dry_run and outcome.detail == "scaled"
    assert json.loads(got.read_text()) == {**DECISION, "env_id": "d-1"}
    assert outcome.as_dict()["applied"] is True


async def test_a_failing_command_is_reported_not_raised() -> None:
    driver = CommandDriver(
        [sys.executable, "-c", "import sys; print('quota exceeded', file=sys.stderr); sys.exit(3)"]
    )
    outcome = await driver.apply(DECISION)
    assert not outcome.applied and "exit status 3" in outcome.detail
    assert "quota exceeded" in outcome.detail


async def test_a_hanging_command_is_killed_at_the_timeout(tmp_path: Path) -> None:
    marker = tmp_path / "child-alive"
    child = tmp_path / "child.py"
    child.write_text(f"import time\ntime.sleep(2)\nopen({str(marker)!r}, 'w').close()\n")
    # the program starts a child that would outlive it: the whole group must go
    script = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, {str(child)!r}])\n"
        "time.sleep(60)\n"
    )
    driver = CommandDriver([sys.executable, "-c", script], timeout_s=0.5)
    t0 = time.monotonic()
    outcome = await driver.apply(DECISION)
    assert time.monotonic() - t0 < 10
    assert not outcome.applied and "timed out" in outcome.detail
    await asyncio.sleep(2.5)
    assert not marker.exists()  # the child was killed with its parent


async def test_a_missing_program_is_reported() -> None:
    outcome = await CommandDriver(["/nonexistent/scale-it"]).apply(DECISION)
    assert not outcome.applied and "could not start" in outcome.detail


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError):
        CommandDriver([])
    with pytest.raises(ValueError):
        CommandDriver(["true"], timeout_s=0)
    assert isinstance(create_driver("  "), DryRunDriver)
    assert isinstance(create_driver("kubectl-scale --dry-run=none"), CommandDriver)
