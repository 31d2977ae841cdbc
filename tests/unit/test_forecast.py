"""Next-hour token-rate forecast (issue 8 item 1): ARIMA by AIC on a trailing window, peak plus
buffer, the per-minute accumulator, and every bad input the issue names (gaps, constant series,
too-short series, NaN/negative)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.capacity.forecast import ForecastConfig, TokenForecast, TokenRateSeries, forecast_next_hour

DAY = 1440
# a smaller grid for the property test: it runs many fits, and the grid size is not under test
SMALL = ForecastConfig(p_values=(0, 1), d_values=(0, 1), q_values=(0, 1))


def diurnal(days: int = 2, seed: int = 0, noise: float = 40.0) -> np.ndarray:
    """Tokens per minute: 1,000 ± 600 over a day, plus Gaussian noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(days * DAY)
    return np.maximum(1000 + 600 * np.sin(2 * np.pi * t / DAY) + rng.normal(0, noise, t.size), 0)


@pytest.mark.parametrize("end", [300, 360, 1560, 1800])  # the rise and the peak, two days
def test_next_hour_peak_on_a_diurnal_series(end: int) -> None:
    y = diurnal()
    f = forecast_next_hour(y[:end], origin_s=end * 60.0, model="m", pool="p")
    true_peak = float(y[end : end + 60].max())
    assert f.method == "arima" and f.order is not None and math.isfinite(f.aic or math.nan)
    assert len(f.path) == 60 and min(f.path) >= 0
    assert f.peak_tpm == pytest.approx(true_peak, rel=0.15)
    assert f.n_points == 60 and f.n_filled == 0
    assert f.fit_s > 0


def test_target_is_peak_plus_ten_percent_of_the_batch_load() -> None:
    f = forecast_next_hour(diurnal()[:400], batch_tpm=2000.0)
    assert f.buffer_tpm == pytest.approx(200.0)
    assert f.target_tpm == pytest.approx(f.peak_tpm + 200.0)


def test_predicted_tpm_follows_the_path() -> None:
    f = TokenForecast("m", "p", 600.0, (1.0, 2.0, 3.0), 3.0, 0.0, "arima")
    assert f.predicted_tpm(600.0) == 1.0
    assert f.predicted_tpm(719.0) == 2.0
    assert f.predicted_tpm(10_000.0) == 3.0  # past the horizon: the last value
    assert f.predicted_tpm(0.0) == 1.0


def test_no_statsmodels_warning_escapes() -> None:
    # a short, noisy, trending window makes several candidate orders fail to converge
    rng = np.random.default_rng(3)
    y = np.abs(np.cumsum(rng.normal(0, 50, 60)) + 500)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f = forecast_next_hour(y)
    assert f.method == "arima"


def test_constant_series_falls_back_to_the_last_value() -> None:
    f = forecast_next_hour([750.0] * 60)
    assert f.method == "constant" and f.peak_tpm == 750.0 and set(f.path) == {750.0}
    assert forecast_next_hour(np.zeros(60)).peak_tpm == 0.0


def test_too_short_series_falls_back_to_the_observed_peak() -> None:
    f = forecast_next_hour([10.0, 30.0, 20.0])
    assert f.method == "short" and f.peak_tpm == 30.0 and len(f.path) == 60


def test_gaps_are_interpolated() -> None:
    y = diurnal()[:400].copy()
    y[-30:-25] = np.nan
    f = forecast_next_hour(y)
    assert f.method == "arima" and f.n_filled == 5 and f.n_points == 55


def test_a_mostly_missing_window_falls_back() -> None:
    y = diurnal()[:400].copy()
    y[-50:] = np.nan
    y[-3] = 900.0
    f = forecast_next_hour(y)
    assert f.method in ("gappy", "short")  # 11 of 60 minutes measured
    assert f.peak_tpm == pytest.approx(float(np.nanmax(y[-60:])))  # the peak that was seen
    # the whole window missing, older data present: hold the last measured value
    z = diurnal()[:400].copy()
    z[-60:] = np.nan
    g = forecast_next_hour(z)
    assert g.method == "gappy" and g.peak_tpm == pytest.approx(z[-61])


def test_an_explosive_trend_is_capped() -> None:
    y = np.exp(np.linspace(0, 6, 60)) * 10  # grows 400× in the window
    f = forecast_next_hour(y)
    assert f.peak_tpm <= 5.0 * y.max() + 1e-6


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ([], "empty"),
        ([1.0, -1.0, 2.0], "negative"),
        ([1.0, math.inf], "inf"),
        ([math.nan, math.nan], "all NaN"),
    ],
)
def test_bad_values_are_value_errors(values: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        forecast_next_hour(values)


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="batch_tpm"):
        forecast_next_hour([1.0] * 60, batch_tpm=-1.0)
    with pytest.raises(ValueError, match="order grid"):
        ForecastConfig(p_values=())
    with pytest.raises(ValueError, match="window"):
        ForecastConfig(window_minutes=1)


@settings(max_examples=12, deadline=None)
@given(
    st.lists(
        st.one_of(st.floats(0, 1e6, allow_nan=False), st.just(math.nan)),
        min_size=1,
        max_size=80,
    )
)
def test_any_non_negative_series_gives_a_finite_forecast(values: list[float]) -> None:
    if all(math.isnan(v) for v in values):
        with pytest.raises(ValueError):
            forecast_next_hour(values, config=SMALL)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f = forecast_next_hour(values, config=SMALL)
    assert len(f.path) == SMALL.horizon_minutes
    assert all(math.isfinite(v) and v >= 0 for v in f.path)
    assert f.peak_tpm == max(f.path)
    finite = [v for v in values[-SMALL.window_minutes :] if not math.isnan(v)]
    if finite:
        assert f.peak_tpm <= SMALL.max_peak_ratio * max(finite) + 1e-6


def test_series_accumulates_minutes_and_forecasts() -> None:
    s = TokenRateSeries("m", "p", keep_minutes=120)
    s.observe(60.0, 100)
    s.observe(90.0, 50)  # same minute: summed
    s.observe(185.0, 10)  # minute 3; minute 2 had nothing
    assert s.per_minute(240.0).tolist() == [150.0, 0.0, 10.0]
    assert s.per_minute(200.0).tolist() == [150.0, 0.0]  # minute 3 is not complete yet
    with pytest.raises(ValueError, match="bad observation"):
        s.observe(10.0, -5)
    with pytest.raises(ValueError, match="no completed minute"):
        TokenRateSeries("m", "p").forecast(0.0)
    y = diurnal()[:400]
    d = TokenRateSeries("m", "p")
    d.observe_many((60.0 * i + 1, float(v)) for i, v in enumerate(y))
    f = d.forecast(60.0 * len(y))
    assert f.method == "arima" and f.origin_s == 60.0 * len(y)
    assert (f.model, f.pool) == ("m", "p")
    # bounded memory: old minutes are dropped
    assert d.per_minute(60.0 * len(y)).size == 180
    before = d.per_minute(60.0 * len(y))
    d.observe(0.0, 1e6)  # far older than what is kept: ignored
    assert np.array_equal(d.per_minute(60.0 * len(y)), before)
