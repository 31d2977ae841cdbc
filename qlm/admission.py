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
replace it: the gate only needs a callable. :meth:`SLOAdmissionGate.admits_in_time` is
SABER's check exactly, for callers that keep hopeless requests in a separate low-priority
queue (the simulator's ``pull_gate="saber"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


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

    def admits_in_time(self, running: int, req_speed: float, floor: float) -> bool:
        """SABER's Algorithm 1 check, with no best-effort pass (SABER demotes those requests
        to a low-priority queue instead): f(L + 1) >= reqSpd and f(L + 1) >= ``floor``."""
        predicted = self.speed(running + 1)
        return predicted >= req_speed and predicted >= floor


@dataclass(frozen=True)
class USLSpeedModel:
    """Per-request decode speed under concurrency, the Universal Scalability Law (Gunther):

        X(L) = lam * L / (1 + sigma (L - 1) + kappa L (L - 1))   (tokens/s of the engine)
        f(L) = X(L) / L = lam / (1 + sigma (L - 1) + kappa L (L - 1))

    ``lam`` is the single-request speed, ``sigma`` contention, ``kappa`` coherency. SABER fits
    it to (concurrency, per-request speed) points measured by profiling (``qlm profile``)."""

    lam: float
    sigma: float
    kappa: float
    r_squared: float | None = None  # of the fit, on the points it was fitted to

    def __post_init__(self) -> None:
        values = (self.lam, self.sigma, self.kappa)
        if not all(math.isfinite(v) for v in values) or self.lam <= 0:
            raise ValueError(f"USL parameters must be finite with lam > 0, got {values}")
        if self.sigma < 0 or self.kappa < 0:
            raise ValueError(f"USL sigma and kappa must be >= 0, got {values}")

    def __call__(self, concurrency: int) -> float:
        n = max(1, concurrency)
        return self.lam / (1.0 + self.sigma * (n - 1) + self.kappa * n * (n - 1))

    def throughput(self, concurrency: int) -> float:
        return max(1, concurrency) * self(concurrency)

    def to_dict(self) -> dict[str, float | None]:
        return {
            "lam": self.lam,
            "sigma": self.sigma,
            "kappa": self.kappa,
            "r_squared": self.r_squared,
        }

    @classmethod
    def from_dict(cls, data: dict[str, float | None]) -> USLSpeedModel:
        try:
            lam, sigma, kappa = (float(data[k]) for k in ("lam", "sigma", "kappa"))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a USL model needs numeric lam, sigma, kappa: {exc}") from exc
        r2 = data.get("r_squared")
        return cls(lam, sigma, kappa, None if r2 is None else float(r2))


def fit_usl(points: Sequence[tuple[int, float]]) -> USLSpeedModel:
    """Least-squares fit of f(L) to (concurrency, per-request tokens/s) points, as SABER does
    (bounded: sigma, kappa in [0, 1]). Needs at least three distinct concurrency levels."""
    pts = [(int(n), float(v)) for n, v in points]
    if any(n < 1 or not math.isfinite(v) or v <= 0 for n, v in pts):
        raise ValueError("USL points need concurrency >= 1 and a finite speed > 0")
    if len({n for n, _ in pts}) < 3:
        raise ValueError("fitting the USL needs points at >= 3 distinct concurrency levels")
    import numpy as np
    from scipy.optimize import curve_fit

    n = np.array([p[0] for p in pts], dtype=float)
    v = np.array([p[1] for p in pts], dtype=float)

    def f(x: Any, lam: float, sigma: float, kappa: float) -> Any:
        return lam / (1.0 + sigma * (x - 1.0) + kappa * x * (x - 1.0))

    p0 = [float(v.max()), 1e-2, 1e-4]
    params, _ = curve_fit(
        f, n, v, p0=p0, bounds=([1e-9, 0.0, 0.0], [np.inf, 1.0, 1.0]), maxfev=20_000
    )
    residual = float(((v - f(n, *params)) ** 2).sum())
    total = float(((v - v.mean()) ** 2).sum())
    r2 = 1.0 - residual / total if total > 0 else 1.0
    return USLSpeedModel(float(params[0]), float(params[1]), float(params[2]), r2)
