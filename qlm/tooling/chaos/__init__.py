"""``qlm chaos``: fault injection against real processes, measured (docs/reliability.md).

:func:`run_chaos` runs the named scenarios one after another and returns one
:class:`ScenarioResult` each. Scenarios that kill the broker start private nodes of their own
(never touching ``QLM_AMQP_URL``'s broker); the others run on ``amqp_url`` when given, else on
the checkout's private node (``scripts/rabbitmq-local.sh``), each in a fresh vhost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import structlog

from qlm.tooling.chaos.engines import ENGINE_SCENARIOS
from qlm.tooling.chaos.scenarios import SCENARIOS as _FAULT_SCENARIOS
from qlm.tooling.chaos.scenarios import ChaosSettings, Scenario, ScenarioResult
from qlm.tooling.chaos.security import SECURITY_SCENARIOS

# every scenario `qlm chaos` knows, in the order it runs them
SCENARIOS: dict[str, Scenario] = {**_FAULT_SCENARIOS, **ENGINE_SCENARIOS, **SECURITY_SCENARIOS}

__all__ = [
    "SCENARIOS",
    "ChaosSettings",
    "Scenario",
    "ScenarioResult",
    "format_table",
    "results_json",
    "run_chaos",
]

log = structlog.get_logger(__name__)


def select(names: Sequence[str] | None, *, include_long: bool = True) -> list[Scenario]:
    """The scenarios to run, in the registry's order. Unknown names raise KeyError."""
    if not names:
        return [s for s in SCENARIOS.values() if include_long or not s.long]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise KeyError(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    return [SCENARIOS[n] for n in SCENARIOS if n in names]


@contextlib.asynccontextmanager
async def _shared_broker(amqp_url: str | None) -> AsyncIterator[str]:
    """A fresh vhost on ``amqp_url`` (or on the local private node, started if needed)."""
    from qlm.tooling.localbroker import ensure_broker, temporary_vhost

    base = amqp_url if amqp_url is not None else await asyncio.to_thread(ensure_broker)
    async with temporary_vhost(base, prefix="qlm-chaos") as url:
        yield url


async def run_chaos(
    scenarios: Sequence[Scenario],
    settings: ChaosSettings,
    amqp_url: str | None = None,
    *,
    progress: bool = False,
) -> list[ScenarioResult]:
    """``progress``: a bar of the scenarios finished on stderr, on a terminal only."""
    from qlm.tooling.progress import counting

    results: list[ScenarioResult] = []
    async with counting("scenarios", len(scenarios), lambda: len(results), enabled=progress):
        await _run_scenarios(scenarios, settings, amqp_url, results)
    return results


async def _run_scenarios(
    scenarios: Sequence[Scenario],
    settings: ChaosSettings,
    amqp_url: str | None,
    results: list[ScenarioResult],
) -> None:
    for scenario in scenarios:
        log.info("chaos_scenario_started", scenario=scenario.name)
        t0 = time.monotonic()
        try:
            if scenario.needs_own_broker:
                result = await scenario.run(settings, None)
            else:
                async with _shared_broker(amqp_url) as url:
                    result = await scenario.run(settings, url)
        except Exception as exc:  # one scenario's failure is a row of the table, not the end
            log.exception("chaos_scenario_failed", scenario=scenario.name)
            result = ScenarioResult(
                name=scenario.name,
                sent=0,
                answered=0,
                lost=0,
                duplicates=0,
                recovery_s=None,
                wall_s=round(time.monotonic() - t0, 1),
                error=f"scenario failed to run: {exc!r}"[:500],
            )
        log.info("chaos_scenario_finished", **result.as_dict())
        results.append(result)


def results_json(results: Sequence[ScenarioResult], settings: ChaosSettings) -> dict[str, Any]:
    return {
        "scenarios": [r.as_dict() for r in results],
        "settings": {
            "requests": settings.requests,
            "leader_kill_requests": settings.leader_kill_requests,
            "leader_kill_late_requests": settings.leader_kill_late_requests,
            "max_tokens": settings.max_tokens,
            "time_scale": settings.time_scale,
            "server_stream_requests": settings.server_stream_requests,
            "heartbeat_timeout_s": settings.heartbeat_timeout_s,
        },
    }


def write_json(path: Path, results: Sequence[ScenarioResult], settings: ChaosSettings) -> None:
    path.write_text(json.dumps(results_json(results, settings), indent=2) + "\n")


def format_table(results: Sequence[ScenarioResult]) -> str:
    """A Markdown table: one row per scenario."""
    lines = [
        "| scenario | sent | in flight at fault | answered | lost | duplicates | errors "
        "| recovery s (target) | wall s | result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        target = "" if r.target_recovery_s is None else f" (≤ {r.target_recovery_s:g})"
        rec = "-" if r.recovery_s is None else f"{r.recovery_s:.2f}"
        lines.append(
            f"| {r.name} | {r.sent} | {r.in_flight_at_fault} | {r.answered} | {r.lost} "
            f"| {r.duplicates} | {r.errors} | {rec}{target} | {r.wall_s:.0f} "
            f"| {'skipped' if r.skipped else 'pass' if r.passed else 'FAIL'} |"
        )
    notes = [
        f"- {r.name}: {n}"
        for r in results
        for n in [*r.notes, *filter(None, [r.error, r.skipped and f"skipped: {r.skipped}"])]
    ]
    return "\n".join(lines + ([""] + notes if notes else []))
