"""Carrying out capacity decisions: the autoscaler drivers.

A capacity policy (``planner/capacity/policies.py``) decides how many instances of each (model, GPU
type, pool) to run; a *driver* makes it so. qlm cannot know how a site starts GPUs, so besides the
dry run (the default: log and keep the decision, change nothing) it runs an operator-supplied
program with the decision - a Kubernetes, Slurm or cloud CLI wrapper - and reports what came of it.
A program that fails or hangs never takes the caller down: it is killed at the timeout, the failure
is logged with the decision's id, and the caller keeps serving; the program receives the whole
decision at once, so a decision is applied whole or reported as not applied.

The decision is any JSON object (``CapacityDecision.to_dict()``), written to the program's stdin;
``QLM_DECISION_ID`` is in its environment. Exit status 0 means applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class DriverOutcome:
    """What became of one decision."""

    decision_id: str
    applied: bool
    dry_run: bool
    detail: str = ""
    duration_s: float = 0.0
    decided_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return {
            "decision_id": self.decision_id,
            "applied": self.applied,
            "dry_run": self.dry_run,
            "detail": self.detail,
            "duration_s": round(self.duration_s, 3),
            "decided_at": self.decided_at,
        }


class AutoscalerDriver(ABC):
    """Applies capacity decisions; remembers the last ones (for the admin API and metrics)."""

    def __init__(self, history: int = 100) -> None:
        self.recent: deque[tuple[Mapping[str, Any], DriverOutcome]] = deque(maxlen=history)

    async def apply(self, decision: Mapping[str, Any]) -> DriverOutcome:
        """Carry out ``decision``; never raises for a failure of the mechanism."""
        decision_id = str(decision.get("id") or uuid.uuid4().hex)
        started = time.perf_counter()
        outcome = await self._apply(decision_id, decision)
        outcome = DriverOutcome(
            outcome.decision_id,
            outcome.applied,
            outcome.dry_run,
            outcome.detail,
            time.perf_counter() - started,
        )
        self.recent.append((dict(decision), outcome))
        return outcome

    @abstractmethod
    async def _apply(self, decision_id: str, decision: Mapping[str, Any]) -> DriverOutcome: ...


class DryRunDriver(AutoscalerDriver):
    """The default: the decision is logged and kept, nothing changes."""

    async def _apply(self, decision_id: str, decision: Mapping[str, Any]) -> DriverOutcome:
        log.info("capacity_decision_dry_run", decision_id=decision_id)
        return DriverOutcome(decision_id, applied=False, dry_run=True, detail="dry run")


class CommandDriver(AutoscalerDriver):
    """Runs ``argv`` with the decision as JSON on stdin; exit 0 = applied."""

    def __init__(self, argv: Sequence[str], *, timeout_s: float = 60.0, history: int = 100):
        super().__init__(history)
        if not argv:
            raise ValueError("the autoscaler command is empty")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.argv = list(argv)
        self.timeout_s = timeout_s

    async def _apply(self, decision_id: str, decision: Mapping[str, Any]) -> DriverOutcome:
        payload = json.dumps(decision, default=str).encode()
        env = {**os.environ, "QLM_DECISION_ID": decision_id}
        bound = log.bind(decision_id=decision_id, command=self.argv[0])
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,  # a timeout kills the whole group it started
            )
        except OSError as exc:
            bound.error("autoscaler_command_failed_to_start", error=str(exc))
            return DriverOutcome(decision_id, False, False, f"could not start: {exc}")
        try:
            out, err = await asyncio.wait_for(proc.communicate(payload), self.timeout_s)
        except TimeoutError:
            _kill_group(proc)
            await proc.wait()
            bound.error("autoscaler_command_timed_out", timeout_s=self.timeout_s)
            return DriverOutcome(
                decision_id, False, False, f"timed out after {self.timeout_s:g} s; killed"
            )
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip()[-500:]
            bound.error("autoscaler_command_failed", returncode=proc.returncode, stderr=tail)
            return DriverOutcome(
                decision_id, False, False, f"exit status {proc.returncode}: {tail}"
            )
        bound.info("capacity_decision_applied")
        return DriverOutcome(decision_id, True, False, out.decode(errors="replace").strip()[-500:])


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def create_driver(command: str | None, *, timeout_s: float = 60.0) -> AutoscalerDriver:
    """``command`` (a shell-style string, ``QLM_AUTOSCALE_COMMAND``): a
    :class:`CommandDriver`; None or empty: the dry run."""
    import shlex

    if not command or not command.strip():
        return DryRunDriver()
    return CommandDriver(shlex.split(command), timeout_s=timeout_s)
