"""Role extras (issue 19): the base dependencies run an agent, the gateway, the client and the
admin CLI; the coordinator's planner and the simulator's plots come with their extras. Each
role is run here with every package outside its set blocked from import."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# import names of the packages only an extra brings
COORDINATOR = ["scipy", "sklearn", "threadpoolctl", "cvxpy", "highspy", "quantile_forest"]
COORDINATOR += ["statsmodels"]
SIM = ["matplotlib", "pandas"]

BLOCKED_RUN = """
import runpy, sys
blocked = set(sys.argv[1].split(","))

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ImportError(f"{name} is blocked: not in this role's dependencies")
        return None

sys.meta_path.insert(0, Block())
for module in sys.argv[2].split(","):
    if module:
        __import__(module)
sys.argv = ["qlm", *sys.argv[3:]]
runpy.run_module("qlm.cli", run_name="__main__")
"""


def run_blocked(
    blocked: list[str], modules: list[str], *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, ",".join(blocked), ",".join(modules), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    ("command", "modules"),
    [
        ("agent", ["qlm.agents.agent", "qlm.agents.sim"]),
        ("gateway", ["qlm.gateway.app", "qlm.gateway.command"]),
        ("admin", ["qlm.client", "qlm.sync_client", "qlm.tooling.admin_cli"]),
        ("coordinator", []),  # its --help; running it needs qlm[coordinator]
    ],
)
def test_base_dependencies_run_each_role(command: str, modules: list[str]) -> None:
    out = run_blocked(COORDINATOR + SIM, modules, command, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Usage" in out.stdout


def test_the_coordinator_runs_without_the_simulator_extra() -> None:
    out = run_blocked(SIM, ["qlm.coordinator.service", "qlm.planner", "qlm.admin"], "--version")
    assert out.returncode == 0, out.stderr[-2000:]


def test_extras_declare_the_roles_and_dev_installs_everything() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert {"coordinator", "agent", "gateway", "sim", "vllm", "all", "dev"} <= set(extras)
    base = " ".join(project["dependencies"])
    for heavy in ("matplotlib", "statsmodels", "scipy", "cvxpy", "scikit-learn", "pandas"):
        assert heavy not in base, f"{heavy} is in every role's dependencies"
    assert "qlm[coordinator,sim]" in extras["dev"]
    assert any("matplotlib" in d for d in extras["sim"])
