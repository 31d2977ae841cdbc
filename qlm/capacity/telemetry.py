"""What a live autoscaler measures, fed by the coordinator as requests come and go.

The coordinator owns the facts (every admitted request, every answered one, every plan); a
capacity loop (``planner/capacity/live_loop.py``, wired by the CLI) reads them here on its own
schedule. Kept in the core so the coordinator feeds it without knowing whether any autoscaler
runs, and cheap: a per-minute bucket per model and a one-minute deque of arrivals.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

from qlm.capacity.forecast import TokenRateSeries


class AutoscalerView(Protocol):
    """What the admin API shows of a running autoscaler (``GET /v1/capacity``)."""

    def status(self) -> dict[str, Any]: ...


class CapacityTelemetry:
    """Input tokens per minute per model (for the forecaster and LT-UA's observed rate), SLO
    misses since the last read (CATO's violation counter), and the request planner's latest
    scale-up signal. Thread-safe: the forecaster may read a series from a worker thread."""

    def __init__(self, pool: str = "default", keep_minutes: int = 180) -> None:
        self.pool = pool
        self.keep_minutes = keep_minutes
        self._series: dict[str, TokenRateSeries] = {}
        self._last_minute: dict[str, deque[tuple[float, int]]] = {}
        self._misses: dict[str, int] = {}
        self._finished: dict[str, int] = {}
        self.scale_up: Mapping[str, Any] = {}
        self._lock = threading.Lock()

    def on_arrival(self, model: str, prompt_tokens: int, t: float) -> None:
        with self._lock:
            series = self._series.get(model)
            if series is None:
                series = self._series[model] = TokenRateSeries(
                    model, self.pool, keep_minutes=self.keep_minutes
                )
            series.observe(t, max(0, prompt_tokens))
            recent = self._last_minute.setdefault(model, deque())
            recent.append((t, prompt_tokens))
            while recent and recent[0][0] <= t - 60.0:
                recent.popleft()

    def on_finished(self, model: str, met: bool | None) -> None:
        with self._lock:
            self._finished[model] = self._finished.get(model, 0) + 1
            if met is False:
                self._misses[model] = self._misses.get(model, 0) + 1

    def on_plan(self, meta: Mapping[str, Any]) -> None:
        self.scale_up = dict(meta.get("scale_up") or {})

    def models(self) -> list[str]:
        with self._lock:
            return sorted(self._series)

    def observed_tpm(self, model: str, now: float) -> float:
        """Input tokens that arrived in the last 60 s."""
        with self._lock:
            recent = self._last_minute.get(model)
            if not recent:
                return 0.0
            return float(sum(n for t, n in recent if t > now - 60.0))

    def per_minute(self, model: str, now: float) -> Any:
        """The completed minutes of ``model``'s input-token series (a numpy array)."""
        with self._lock:
            series = self._series.get(model)
            if series is None:
                import numpy as np

                return np.zeros(0)
            return series.per_minute(now)

    def take_misses(self) -> dict[str, int]:
        """SLO misses per model since the previous call."""
        with self._lock:
            out, self._misses = self._misses, {}
            return out

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "observed_tpm": {m: self.observed_tpm(m, now) for m in self.models()},
            "finished": dict(self._finished),
            "scale_up": dict(self.scale_up),
        }
