"""The one-way dependency rule's contracts (``[tool.importlinter]`` in pyproject.toml) cover the
whole of ``qlm``: a forbidden contract only checks the modules it names, so a new module that
is in neither list would escape the rule silently. ``make lint`` runs the contracts themselves
(``lint-imports``); this test keeps their lists complete and consistent."""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path

import qlm

ROOT = Path(__file__).resolve().parents[2]
# The composition root: the only module allowed to wire runtime, planner, agents and tooling.
WIRING = {"qlm.cli"}


def _contracts() -> dict[str, dict[str, list[str]]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def test_every_qlm_module_is_runtime_or_tooling() -> None:
    contracts = _contracts()
    runtime = set(contracts["runtime"]["source_modules"])
    outside = set(contracts["runtime"]["forbidden_modules"]) - WIRING  # planner, agents, tooling
    modules = {f"qlm.{m.name}" for m in pkgutil.iter_modules(qlm.__path__)}
    unclassified = modules - runtime - outside - WIRING
    assert not unclassified, (
        f"{sorted(unclassified)}: add them to the runtime list of [tool.importlinter] in "
        "pyproject.toml, or move them into qlm/tooling/"
    )
    assert not runtime & outside
    stale = (runtime | outside) - modules
    assert not stale, f"{sorted(stale)} no longer exist: remove them from [tool.importlinter]"


def test_runtime_and_planner_forbid_the_same_tooling() -> None:
    contracts = _contracts()
    runtime_forbidden = set(contracts["runtime"]["forbidden_modules"])
    tooling = set(contracts["planner-agents"]["forbidden_modules"])
    assert runtime_forbidden == tooling | {"qlm.agents", "qlm.planner"}
    assert set(contracts["planner-agents"]["source_modules"]) == {"qlm.planner", "qlm.agents"}


def test_no_generic_top_level_names_are_installed() -> None:
    """agents/ and planner/ install as qlm.agents and qlm.planner (issue 16): the wheel must not
    claim names such as ``agents`` (OpenAI's openai-agents uses it)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["packages"]["find"]["include"] == ["qlm", "qlm.*"]
    for name in ("agents", "planner", "migrations"):
        link = ROOT / "qlm" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve()
