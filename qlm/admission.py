"""SLO-aware pull gate (SABER, Wang et al.; formulas in shared/reference/saber-cato-digest.md).

An agent pulls a request from its virtual queue only if the engine, running one more request,
is still predicted to be fast enough for it and for every request already running:

    f(L + 1) >= reqSpd(candidate)   and   f(L + 1) >= max over running reqSpd(a)

where f(L) is the per-request decode speed (tokens/s) with L requests running and
reqSpd(r, t) = remaining tokens / (deadline - t). A request's reqSpd is frozen when it is
admitted (as SABER does). A request that cannot make its deadline even alone,
reqSpd > f(1), or whose deadline passed, is *best effort*: it is still pulled, but only while
it does not slow a running request below its frozen speed (SABER serves its low-priority queue
only when the high-priority one is empty; here the plan's order decides who is pulled first).

f(L) comes from the engine performance model here; a measured USL fit (``qlm profile``) can
replace it: the gate only needs a callable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


def required_speed(remaining_tokens: int, deadline: float | None, now: float) -> float:
    """Tokens/s a request needs from now on to finish by its deadline (0: no deadline;
    inf: the deadline has passed)."""
    if deadline is None or not math.isfinite(deadline):
        return 0.0
    if deadline <= now:
        return math.inf
    return remaining_tokens / (deadline - now)


@dataclass(frozen=True)
class SLOAdmissionGate:
    speed: Callable[[int], float]  # f(L): per-request tokens/s with L requests running

    def best_effort(self, req_speed: float) -> bool:
        return req_speed > self.speed(1)

    def admits(self, running: int, req_speed: float, floor: float) -> bool:
        """Whether one more request (needing ``req_speed``) may join ``running`` requests whose
        highest frozen required speed is ``floor``."""
        predicted = self.speed(running + 1)
        if predicted < floor:
            return False
        return self.best_effort(req_speed) or predicted >= req_speed
