"""Progress bars of the long-running commands: a --no-progress flag each, and no bar (nor any
other output beyond the result) when stdout is not a terminal, as under CliRunner."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from qlm.cli import app


def _command(*path: str) -> Any:
    cmd: Any = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


@pytest.mark.parametrize(
    "path", [("chaos",), ("bench", "ingest"), ("bench", "gateway"), ("submit",), ("demo",)]
)
def test_long_commands_have_no_progress_flag(path: tuple[str, ...]) -> None:
    [opt] = [p for p in _command(*path).params if p.name == "progress"]
    assert "--no-progress" in opt.secondary_opts
    assert opt.default is True


@pytest.fixture
def no_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a rich progress bar is ever built."""
    import rich.progress

    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("a progress bar was shown although stdout is not a terminal")

    monkeypatch.setattr(rich.progress, "Progress", refuse)


def test_chaos_prints_no_progress_when_not_a_tty(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_bar: None
) -> None:
    import qlm.tooling.chaos as chaos
    from qlm.tooling.chaos.scenarios import ScenarioResult

    async def fake(scenarios: Any, settings: Any, amqp_url: Any, results: list[Any]) -> None:
        for sc in scenarios:
            results.append(
                ScenarioResult(name=sc.name, sent=1, answered=1, lost=0, duplicates=0, recovery_s=0)
            )

    monkeypatch.setattr(chaos, "_run_scenarios", fake)
    out = tmp_path / "chaos.json"
    result = CliRunner().invoke(
        app,
        ["chaos", "--quick", "--workdir", str(tmp_path), "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    scenarios = [sc.name for sc in chaos.select(None, include_long=False)]
    expected = chaos.format_table(
        [
            ScenarioResult(name=n, sent=1, answered=1, lost=0, duplicates=0, recovery_s=0)
            for n in scenarios
        ]
    )
    assert result.output == expected + "\n"
    assert [s["name"] for s in json.loads(out.read_text())["scenarios"]] == scenarios


def test_bench_ingest_prints_only_json_when_not_a_tty(
    monkeypatch: pytest.MonkeyPatch, no_bar: None
) -> None:
    import qlm.tooling.bench as bench
    import qlm.tooling.localbroker as localbroker

    @contextlib.contextmanager
    def vhost(base: str, prefix: str) -> Iterator[str]:
        yield base

    async def ingest(url: str, n: int, shards: int, policy: str) -> dict[str, Any]:
        return {"requests": n, "policy": policy}

    async def latency(url: str, n: int, rate: float, shards: int, policy: str) -> dict[str, Any]:
        return {"requests": n, "rate_rps": rate}

    monkeypatch.setattr(localbroker, "ensure_broker", lambda: "amqp://unused/")
    monkeypatch.setattr(localbroker, "isolated_vhost", vhost)
    monkeypatch.setattr(bench, "ingest_phase", ingest)
    monkeypatch.setattr(bench, "latency_phase", latency)
    result = CliRunner().invoke(
        app, ["bench", "ingest", "--requests", "5", "--latency-requests", "3", "--rate", "7"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {
        p: {"ingest": {"requests": 5, "policy": p}, "dispatch": {"requests": 3, "rate_rps": 7.0}}
        for p in ("qlm", "edf")
    }


def test_bench_percentiles_are_numpys() -> None:
    import math

    from qlm.tooling import bench, bench_gateway

    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    for pct in (bench._pct, bench_gateway._pct):
        assert pct(xs, 0.5) == 3.0
        assert pct(xs, 0.99) == pytest.approx(4.96)
        assert math.isnan(pct([], 0.5))
    assert bench_gateway._summary(xs) == {"p50": 3.0, "p95": 4.8, "mean": 3.0}
