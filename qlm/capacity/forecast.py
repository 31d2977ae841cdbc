"""Next-hour token-rate forecast per (model, pool) (SageServe §6.3, App. B; issue 8 item 1).

SageServe forecasts each (model, region)'s interactive input load one hour ahead with ARIMA fitted
on a trailing 60-minute window at 1-minute resolution, orders chosen by AIC, and sizes capacity for
the **peak** of that forecast plus a buffer β = 10 % of the batch (NIW) load of the past hour.
This module is that forecaster, in tokens per minute (TPM), for qlm's pools:

* :func:`forecast_next_hour` — one dense per-minute series → :class:`TokenForecast` (the forecast
  path, its peak, the buffer, and the target = peak + buffer that the capacity ILP covers);
* :class:`TokenRateSeries` — an accumulator of ``(time, tokens)`` observations bucketed per
  minute (a minute with no observation carried no tokens: zero is the truth there, not a gap).

Bad input, and what each gets (every case is in the returned ``method``/``notes``, never an
exception from statsmodels):

* negative or infinite values → :class:`ValueError` (a token count cannot be either);
* ``NaN`` marks a *missing measurement* (e.g. a lost scrape): filled by linear interpolation
  between its neighbours (the nearest value at either edge) — unless more than
  ``max_gap_fraction`` of the window is missing, then the ``gappy`` fallback;
* no finite value at all → :class:`ValueError`;
* fewer than ``min_points`` measured minutes → ``short`` fallback (peak of what was seen);
* a constant series (ARIMA's likelihood is degenerate: zero variance) → ``constant`` fallback,
  the last value;
* every candidate order failing to fit, or a non-finite forecast → ``fit_failed`` fallback
  (peak of the window).

Fallback paths are flat at their value. An ARIMA forecast is clipped at 0 (a rate is never
negative) and its peak capped at ``max_peak_ratio`` × the window's peak (a drift term fitted on
one rising hour extrapolates without bound; the LT-UA correction, not the forecast, is what
handles real bursts). statsmodels' ``ConvergenceWarning``/``ValueWarning`` during order search are
expected on short windows (a poor order's optimiser stops at ``maxiter``); they are caught,
counted into ``notes`` and logged at debug level, never printed. (``warnings.catch_warnings``
swaps process-wide state: run forecasts from one worker thread or a process, not from several
threads at once; the same holds for the BLAS thread limit each fit sets, see
:func:`_one_blas_thread`.)

Cost (measured, docs/capacity.md): the default 3 × 2 × 3 grid is 18 state-space fits on 60
points, ≈ 0.4-0.6 s per series on one core of the development machine — fine for a dozen
(model, pool) series every few minutes, which is SageServe's hourly cadence with margin.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import structlog

log = structlog.get_logger(__name__)

MINUTE_S = 60.0


@dataclass(frozen=True)
class ForecastConfig:
    """SageServe's parameters (window 60 min, horizon 60 min, β = 10 % of the past hour's batch
    load) plus the guards this implementation adds."""

    window_minutes: int = 60
    horizon_minutes: int = 60
    p_values: tuple[int, ...] = (0, 1, 2)
    d_values: tuple[int, ...] = (0, 1)
    q_values: tuple[int, ...] = (0, 1, 2)
    batch_buffer_fraction: float = 0.10
    min_points: int = 15  # an ARIMA(2,1,2) with drift has 6 parameters: need a few more points
    max_gap_fraction: float = 0.5
    max_peak_ratio: float = 5.0
    maxiter: int = 50  # per fit; enough for these small orders on 60 standardised points

    def __post_init__(self) -> None:
        if self.window_minutes < 2 or self.horizon_minutes < 1:
            raise ValueError("window_minutes must be ≥ 2 and horizon_minutes ≥ 1")
        if not (self.p_values and self.d_values and self.q_values):
            raise ValueError("the order grid must not be empty")
        if min(self.p_values + self.d_values + self.q_values) < 0:
            raise ValueError("ARIMA orders must be ≥ 0")
        if self.batch_buffer_fraction < 0 or self.max_peak_ratio < 1:
            raise ValueError("batch_buffer_fraction must be ≥ 0 and max_peak_ratio ≥ 1")
        if not 0 <= self.max_gap_fraction < 1 or self.min_points < 2:
            raise ValueError("max_gap_fraction must be in [0, 1) and min_points ≥ 2")

    @property
    def orders(self) -> list[tuple[int, int, int]]:
        return list(itertools.product(self.p_values, self.d_values, self.q_values))


@dataclass(frozen=True)
class TokenForecast:
    """One next-hour forecast. ``path[m]`` is the predicted TPM of the minute starting at
    ``origin_s + 60·m``; ``target_tpm`` is what capacity must cover (SageServe's ρ)."""

    model: str
    pool: str
    origin_s: float
    path: tuple[float, ...]
    peak_tpm: float
    buffer_tpm: float
    method: str  # "arima" | "constant" | "short" | "gappy" | "fit_failed"
    order: tuple[int, int, int] | None = None
    aic: float | None = None
    fit_s: float = 0.0
    n_points: int = 0  # measured (non-missing) minutes in the window
    n_filled: int = 0  # minutes filled by interpolation
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def target_tpm(self) -> float:
        return self.peak_tpm + self.buffer_tpm

    def predicted_tpm(self, t_s: float) -> float:
        """The forecast rate at time ``t_s`` (the last minute's value past the horizon, the first
        before the origin): LT-UA compares the observed rate with this."""
        m = int(math.floor((t_s - self.origin_s) / MINUTE_S))
        return self.path[min(max(m, 0), len(self.path) - 1)]


def _validate(values: npt.ArrayLike) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError("empty token-rate series")
    finite_or_nan = np.isfinite(arr) | np.isnan(arr)
    if not finite_or_nan.all():
        raise ValueError("token-rate series contains ±inf")
    if (arr[~np.isnan(arr)] < 0).any():
        raise ValueError("token-rate series contains negative values")
    if np.isnan(arr).all():
        raise ValueError("token-rate series has no measured minute (all NaN)")
    return arr


def _fill_gaps(window: np.ndarray) -> tuple[np.ndarray, int]:
    missing = np.isnan(window)
    n_missing = int(missing.sum())
    if n_missing == 0:
        return window, 0
    idx = np.arange(window.size)
    # np.interp holds the edge values constant outside the known points: nearest-value fill
    filled = np.interp(idx, idx[~missing], window[~missing])
    return filled, n_missing


def _one_blas_thread() -> contextlib.AbstractContextManager[object]:
    """State-space fits on 60 points are tiny matrix operations: with a multi-threaded BLAS,
    threads cost more than they save, and on a loaded machine they spin. Measured on the
    2-core development machine under load ≈ 2: median 2.1 s / p95 7.1 s per forecast with
    OpenBLAS's 2 threads, 0.49 s / 0.55 s with one. (threadpoolctl comes with scikit-learn.)"""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - scikit-learn, a dependency, brings it
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def _fit_best(
    y: np.ndarray, config: ForecastConfig
) -> tuple[tuple[int, int, int] | None, float, np.ndarray | None, int, int]:
    """AIC search over the order grid on the standardised series. Returns (order, aic, forecast
    in standardised units, convergence warnings, other warnings)."""
    # imported here: statsmodels costs ~1 s to import and only forecasting processes need it
    from statsmodels.tools.sm_exceptions import ConvergenceWarning
    from statsmodels.tsa.arima.model import ARIMA

    best: tuple[float, tuple[int, int, int], np.ndarray] | None = None
    n_conv = n_other = 0
    with _one_blas_thread(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for order in config.orders:
            if order[0] + order[2] + order[1] + 2 >= y.size:
                continue  # more parameters than the window can identify
            # constant mean without differencing, drift with it (as auto-ARIMA does)
            trend = "c" if order[1] == 0 else "t"
            try:
                res = ARIMA(y, order=order, trend=trend).fit(
                    method_kwargs={"maxiter": config.maxiter}
                )
                aic = float(res.aic)
                fc = np.asarray(res.forecast(config.horizon_minutes), dtype=np.float64)
            except (ValueError, np.linalg.LinAlgError, IndexError) as exc:
                # a non-invertible or singular start for this order: skip it, others may fit
                log.debug("arima_order_failed", order=order, error=str(exc))
                continue
            if not math.isfinite(aic) or not np.isfinite(fc).all():
                continue
            if best is None or aic < best[0]:
                best = (aic, order, fc)
        for w in caught:
            if issubclass(w.category, ConvergenceWarning):
                n_conv += 1
            else:
                n_other += 1
    if best is None:
        return None, math.nan, None, n_conv, n_other
    return best[1], best[0], best[2], n_conv, n_other


def trailing_mean(per_minute: np.ndarray, minutes: int) -> np.ndarray:
    """Each minute's value replaced by the mean of it and the ``minutes - 1`` before it (the
    first ones by the mean of what exists). [ours] Capacity is profiled as a sustained rate,
    and the Azure trace's token rate swings ±50 % from one minute to the next: an ARIMA fitted
    to raw minutes often picks a random walk, whose forecast starts at the last (noisy)
    minute."""
    if minutes <= 1 or per_minute.size == 0:
        return per_minute
    csum = np.cumsum(np.concatenate([[0.0], per_minute]))
    idx = np.arange(1, per_minute.size + 1)
    lo = np.maximum(0, idx - minutes)
    return (csum[idx] - csum[lo]) / (idx - lo)


def forecast_next_hour(
    tpm: npt.ArrayLike,
    *,
    origin_s: float = 0.0,
    model: str = "",
    pool: str = "",
    batch_tpm: float = 0.0,
    config: ForecastConfig | None = None,
) -> TokenForecast:
    """Forecast the next ``horizon_minutes`` of a per-minute token-rate series.

    ``tpm`` is dense, oldest first, one value per minute, the last one being the minute that
    ended at ``origin_s``; ``NaN`` marks a missing measurement. Only the trailing
    ``window_minutes`` are used. ``batch_tpm`` is the mean batch (NIW) rate of the past hour: the
    buffer is ``batch_buffer_fraction`` × it.
    """
    cfg = config or ForecastConfig()
    if not math.isfinite(batch_tpm) or batch_tpm < 0:
        raise ValueError("batch_tpm must be a finite rate ≥ 0")
    arr = _validate(tpm)
    window = arr[-cfg.window_minutes :]
    buffer_tpm = cfg.batch_buffer_fraction * batch_tpm
    measured = window[~np.isnan(window)]
    n_points = int(measured.size)

    def flat(
        value: float, method: str, n_filled: int, notes: tuple[str, ...] = ()
    ) -> TokenForecast:
        v = max(0.0, float(value))
        return TokenForecast(
            model=model,
            pool=pool,
            origin_s=origin_s,
            path=(v,) * cfg.horizon_minutes,
            peak_tpm=v,
            buffer_tpm=buffer_tpm,
            method=method,
            n_points=n_points,
            n_filled=n_filled,
            notes=notes,
        )

    if n_points == 0:
        # the window is all missing but older minutes exist: hold the last measured value
        last = float(arr[~np.isnan(arr)][-1])
        return flat(last, "gappy", 0, ("window has no measurement",))
    if n_points < cfg.min_points:
        return flat(float(measured.max()), "short", 0)
    missing_frac = 1.0 - n_points / window.size
    if missing_frac > cfg.max_gap_fraction:
        note = f"{missing_frac:.0%} of the window missing"
        return flat(float(measured.max()), "gappy", 0, (note,))
    filled, n_filled = _fill_gaps(window)
    scale = float(filled.std())
    if scale <= 1e-9 * max(1.0, abs(float(filled.mean()))):
        return flat(float(filled[-1]), "constant", n_filled)

    t0 = time.perf_counter()
    mean = float(filled.mean())
    # standardised: the optimiser's starting values and tolerances assume unit-scale data
    order, aic, fc, n_conv, n_other = _fit_best((filled - mean) / scale, cfg)
    fit_s = time.perf_counter() - t0
    notes: list[str] = []
    if n_conv or n_other:
        notes.append(f"warnings: {n_conv} convergence, {n_other} other (suppressed)")
        log.debug(
            "arima_warnings_suppressed",
            model=model,
            pool=pool,
            convergence=n_conv,
            other=n_other,
        )
    if order is None or fc is None:
        notes.append("no order fitted")
        return flat(float(filled.max()), "fit_failed", n_filled, tuple(notes))
    path = np.maximum(fc * scale + mean, 0.0)
    cap = cfg.max_peak_ratio * float(filled.max())
    if path.max() > cap:
        notes.append(f"peak capped at {cfg.max_peak_ratio:g}× the window peak")
        path = np.minimum(path, cap)
    return TokenForecast(
        model=model,
        pool=pool,
        origin_s=origin_s,
        path=tuple(float(v) for v in path),
        peak_tpm=float(path.max()),
        buffer_tpm=buffer_tpm,
        method="arima",
        order=order,
        aic=aic,
        fit_s=fit_s,
        n_points=n_points,
        n_filled=n_filled,
        notes=tuple(notes),
    )


class TokenRateSeries:
    """Tokens per minute of one (model, pool), from raw ``(time, tokens)`` observations.

    Observations are summed into the minute ``floor(t / 60)``. A minute inside the observed span
    with no observation counts 0 tokens (nothing arrived); minutes before the first observation
    are not part of the series. Only the last ``keep_minutes`` are kept. Observations older than
    that are dropped; a negative or non-finite token count raises :class:`ValueError`.
    """

    def __init__(self, model: str, pool: str, keep_minutes: int = 180) -> None:
        if keep_minutes < 2:
            raise ValueError("keep_minutes must be ≥ 2")
        self.model = model
        self.pool = pool
        self.keep_minutes = keep_minutes
        self._minutes: dict[int, float] = {}
        self._first: int | None = None
        self._newest: int | None = None

    def observe(self, t_s: float, tokens: float) -> None:
        if not (math.isfinite(t_s) and math.isfinite(tokens)) or tokens < 0:
            raise ValueError(f"bad observation (t={t_s!r}, tokens={tokens!r})")
        m = int(math.floor(t_s / MINUTE_S))
        newest = m if self._newest is None else self._newest
        if m <= newest - self.keep_minutes:
            return  # older than what is kept
        self._minutes[m] = self._minutes.get(m, 0.0) + float(tokens)
        self._first = m if self._first is None else min(self._first, m)
        if m > newest or self._newest is None:
            # prune only when a new minute starts: observe() runs per request
            self._newest = m
            horizon = m - self.keep_minutes
            for old in [k for k in self._minutes if k <= horizon]:
                del self._minutes[old]
            self._first = max(self._first, horizon + 1)

    def observe_many(self, events: Iterable[tuple[float, float]]) -> None:
        for t, n in events:
            self.observe(t, n)

    def per_minute(self, now_s: float) -> np.ndarray:
        """Completed minutes up to (not including) the one containing ``now_s``."""
        end = int(math.floor(now_s / MINUTE_S))  # the current, incomplete minute
        if self._first is None or self._first >= end:
            return np.zeros(0)
        start = max(self._first, end - self.keep_minutes)
        return np.array([self._minutes.get(m, 0.0) for m in range(start, end)], dtype=np.float64)

    def forecast(
        self, now_s: float, *, batch_tpm: float = 0.0, config: ForecastConfig | None = None
    ) -> TokenForecast:
        series = self.per_minute(now_s)
        if series.size == 0:
            raise ValueError(f"no completed minute observed for {self.model}/{self.pool}")
        origin = math.floor(now_s / MINUTE_S) * MINUTE_S
        return forecast_next_hour(
            series,
            origin_s=origin,
            model=self.model,
            pool=self.pool,
            batch_tpm=batch_tpm,
            config=config,
        )
