"""The wheel installs one import namespace (issue 16): ``qlm`` with ``qlm.agents``,
``qlm.planner`` and ``qlm.migrations``, no generic top-level names, and a coordinator that can
migrate its store from the installed files alone."""

from __future__ import annotations

import importlib.metadata
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import importlib.util, sys
import qlm
assert qlm.__file__.startswith(sys.argv[1]), qlm.__file__
for name in ("agents", "planner", "migrations"):
    assert importlib.util.find_spec(name) is None, f"top-level {name!r} is importable"
import qlm.agents.agent, qlm.planner, qlm.store
from qlm.cli import app
assert qlm.store.migrations_dir().is_relative_to(sys.argv[1])
from qlm.catalog import GPUS  # the GPU table is package data (qlm/data/gpus.yaml)
assert {"H200", "B200", "L40S"} <= set(GPUS), sorted(GPUS)
qlm.store.migrate("sqlite+aiosqlite:///" + sys.argv[2])
print("ok")
"""


@pytest.mark.slow
def test_the_wheel_holds_one_namespace_and_migrates(tmp_path: Path) -> None:
    # built from a copy: setuptools leaves build/ and *.egg-info next to the sources
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md", "qlm", "agents", "planner", "migrations"):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=_caches)
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(path, src / name)
    # this environment's setuptools when it is new enough for pyproject.toml (offline, fast);
    # else pip's isolated build fetches one, as `pip install .` would
    isolation = [] if _setuptools_major() < 68 else ["--no-build-isolation"]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", *isolation]
        + ["-q", "-w", str(tmp_path / "dist")],
        check=True,
        timeout=600,
    )
    (wheel,) = (tmp_path / "dist").glob("qlm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {
        "qlm",
        wheel.name.split("-")[0] + "-0.1.0.dist-info",
    }
    assert "qlm/migrations/alembic.ini" in names and "qlm/agents/agent.py" in names
    assert any(n.startswith("qlm/tooling/simulator/scenarios/") for n in names)
    assert "qlm/data/gpus.yaml" in names
    # "installed": the wheel unpacked, imported with no site processing (so this checkout's
    # editable install is not seen), its dependencies from this environment's site-packages
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    path = [str(target), *site.getsitepackages()]
    out = subprocess.run(
        [sys.executable, "-S", "-c", CHECK, str(target), str(tmp_path / "q.db")],
        env={"PYTHONPATH": ":".join(path), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,  # not the checkout: "" on sys.path would find its qlm/
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


_caches = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")


def _setuptools_major() -> int:
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return 0
