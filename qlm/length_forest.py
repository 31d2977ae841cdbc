"""Learned output-length bound: a quantile regression forest (Tempo §4.1, issue 7 item 5).

Tempo bounds a request's output length with a quantile regression forest (QRF, Meinshausen
2006; the ``quantile-forest`` package) trained on completed requests, uses a high quantile as a
conservative bound, and tightens it while the request generates. This module is that predictor
plus an adapter that lets :class:`qlm.estimator.RCTEstimator` use it per request.

* :class:`QuantileLengthPredictor` — features known at arrival (:class:`LengthFeatures`: model,
  SLO class, task type, tenant, prompt tokens, ``max_tokens``), a bounded window of completions,
  online refresh (every ``refresh_every`` completions; :meth:`~QuantileLengthPredictor.refresh`
  is thread-safe and meant to run off the event loop), chosen quantiles, and
  :meth:`~QuantileLengthPredictor.tighten` (the quantile of the forest's conditional
  distribution given the tokens generated so far).
* :class:`ForestLengthModel` — an :class:`~qlm.estimator.OutputLengthModel` whose
  ``predict``/``observe`` take the per-request features as optional keywords: with them, and
  once the forest was trained on ``min_observations`` completions of the request's model, the
  (mean, variance) come from the forest; otherwise from the per-group fit it inherits.

Calibration. A forest's raw q-quantile under-covers on held-out data (leaves overfit: on the
shipped traces the raw 0.9-quantile covers 83-89 % for leaf sizes 5-50), so each refresh maps
every nominal level q to the level whose *out-of-bag* coverage on the training window is
closest to q, and predicts at that level. This is split-conformal-style level calibration
without holding data out (each training sample is out of bag in about a third of the trees).
``docs/length-bound.md`` has the measured effect.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog
from quantile_forest import RandomForestQuantileRegressor

from qlm.estimator import OutputLengthModel, normal_quantile

log = structlog.get_logger(__name__)

UNSEEN = -1.0  # a category value the fitted forest never saw
OTHER = -2.0  # a tenant outside the vocabulary cap
NO_CAP = -1.0  # feature value of "no max_tokens given"
_CAL_GRID = np.round(np.arange(0.005, 0.9951, 0.005), 4)  # levels tried by the calibration
_MOMENT_LEVELS = (np.arange(32) + 0.5) / 32  # midpoint rule on the quantile function


def _check_count(name: str, value: float, *, minimum: int = 0) -> int:
    """A token count: finite, an integer value, and >= ``minimum`` (else ValueError)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, not a bool")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if f < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if f != int(f):
        raise ValueError(f"{name} must be a whole number of tokens, got {value!r}")
    return int(f)


def _check_quantiles(quantiles: Sequence[float]) -> tuple[float, ...]:
    qs = tuple(float(q) for q in quantiles)
    if not qs:
        raise ValueError("at least one quantile is needed")
    for q in qs:
        if not 0.0 < q < 1.0:  # also rejects NaN
            raise ValueError(f"quantiles must lie in (0, 1), got {q!r}")
    return qs


def bucket_prompt(tokens: float) -> float:
    """Prompt tokens rounded to 1/16-octave buckets (exact up to 32). A tree only splits on
    order, so this costs < 3 % resolution and lets predictions of many requests share one row
    (the planner prices whole queues; see :meth:`QuantileLengthPredictor.moments`)."""
    if tokens <= 32:
        return float(tokens)
    step = 2.0 ** (math.floor(math.log2(tokens)) - 4)
    return float(round(tokens / step) * step)


def bucket_prompt_array(tokens: np.ndarray) -> np.ndarray:
    """:func:`bucket_prompt` of many counts at once."""
    t = np.asarray(tokens, dtype=np.float64)
    step = np.exp2(np.floor(np.log2(np.maximum(t, 1.0))) - 4)
    return np.where(t <= 32, t, np.round(t / step) * step)


def check_counts(name: str, values: np.ndarray, *, minimum: int = 0) -> np.ndarray:
    """Vectorised :func:`_check_count`: finite whole numbers >= ``minimum`` (else ValueError
    naming the first bad entry)."""
    v = np.atleast_1d(np.asarray(values, dtype=np.float64))
    bad = ~np.isfinite(v) | (v < minimum) | (v != np.round(v))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _check_count(f"{name}[{i}]", float(v[i]), minimum=minimum)  # raises with the reason
    return v


@dataclass(frozen=True, slots=True)
class LengthFeatures:
    """What is known about a request when it arrives (all the forest sees)."""

    model: str
    prompt_tokens: int
    max_tokens: int | None = None  # the client's cap; the engine stops there
    slo_class: str | None = None
    task: str | None = None  # application / task type (e.g. the trace kind)
    tenant: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty string")
        object.__setattr__(self, "prompt_tokens", _check_count("prompt_tokens", self.prompt_tokens))
        if self.max_tokens is not None:
            cap = _check_count("max_tokens", self.max_tokens, minimum=1)
            object.__setattr__(self, "max_tokens", cap)

    @property
    def cap(self) -> float:
        return float(self.max_tokens) if self.max_tokens is not None else math.inf


@dataclass(frozen=True)
class LengthPrediction:
    """One request's output-length distribution from the forest and its quantiles.

    ``support``/``cum_weights``: the training outputs that share a leaf with the request (sorted)
    and their cumulative forest weights (co-occurrence counts over the trees), i.e. the forest's
    conditional distribution; :meth:`QuantileLengthPredictor.tighten` conditions it further.
    ``quantiles`` maps each nominal level to its bound in tokens; ``levels`` to the calibrated
    level actually read off the distribution."""

    features: LengthFeatures
    quantiles: dict[float, float]
    levels: dict[float, float]
    support: np.ndarray = field(repr=False)
    cum_weights: np.ndarray = field(repr=False)
    generated: int = 0
    version: int = 0  # which refresh of the forest produced it

    def bound(self, q: float) -> float:
        return self.quantiles[q]


@dataclass(frozen=True)
class RefreshStats:
    version: int
    samples: int
    fit_s: float  # forest fit + out-of-bag calibration, wall seconds on the calling thread


class _Fitted:
    """An immutable snapshot of one refresh: the forest, the category vocabularies it was
    trained with, the calibration curve and the training outputs. Predictions only read it, so
    a refresh in another thread can build the next one and swap it in atomically."""

    def __init__(
        self,
        forest: RandomForestQuantileRegressor,
        vocab: dict[str, dict[str, float]],
        y: np.ndarray,
        oob_coverage: np.ndarray | None,
        model_counts: Counter[str],
        version: int,
    ) -> None:
        self.forest = forest
        self.vocab = vocab
        self.y_train = y  # in training order: proximity_counts returns indices into it
        self.y_sorted = np.sort(y)
        self.oob_coverage = oob_coverage
        self.model_counts = model_counts
        self.version = version
        # (row bytes) -> (E[min(O,cap)], E[min(O,cap)^2]); bounded, dies with the snapshot
        self.moment_cache: dict[bytes, tuple[float, float]] = {}

    def level(self, q: float) -> float:
        """The calibrated level for nominal ``q``: the grid level whose out-of-bag coverage is
        closest to q (ties: the higher level, the conservative side)."""
        if self.oob_coverage is None:
            return q
        err = np.abs(self.oob_coverage - q)
        best = np.flatnonzero(err <= err.min() + 1e-12)
        return float(_CAL_GRID[best[-1]])


def _code(vocab: dict[str, dict[str, float]], kind: str, value: str | None) -> float:
    if value is None:
        return 0.0  # "not given" is its own category, code 0 in every vocabulary
    table = vocab[kind]
    if value in table:
        return table[value]
    return OTHER if kind == "tenant" and table.get("\0full") else UNSEEN


def _encode_rows(
    features: Sequence[LengthFeatures], vocab: dict[str, dict[str, float]]
) -> np.ndarray:
    rows = np.empty((len(features), 6), dtype=np.float64)
    for i, f in enumerate(features):
        rows[i] = (
            _code(vocab, "model", f.model),
            _code(vocab, "slo_class", f.slo_class),
            _code(vocab, "task", f.task),
            _code(vocab, "tenant", f.tenant),
            bucket_prompt(f.prompt_tokens),
            float(f.max_tokens) if f.max_tokens is not None else NO_CAP,
        )
    return rows


def _encode_arrays(
    vocab: dict[str, dict[str, float]],
    model: str,
    slo_class: str | None,
    prompt_tokens: np.ndarray,
    max_tokens: np.ndarray,
    tasks: Sequence[str | None] | None,
    tenants: Sequence[str | None] | None,
) -> np.ndarray:
    """The rows of :func:`_encode_rows` for one (model, SLO class) from arrays, without a
    Python object per request (the planner prices whole queues; validated by the caller)."""
    n = len(prompt_tokens)
    rows = np.empty((n, 6), dtype=np.float64)
    rows[:, 0] = _code(vocab, "model", model)
    rows[:, 1] = _code(vocab, "slo_class", slo_class)
    for col, kind, seq in ((2, "task", tasks), (3, "tenant", tenants)):
        if seq is None:
            rows[:, col] = 0.0
        else:
            cache: dict[str | None, float] = {}
            rows[:, col] = [
                cache[v] if v in cache else cache.setdefault(v, _code(vocab, kind, v)) for v in seq
            ]
    rows[:, 4] = bucket_prompt_array(prompt_tokens)
    rows[:, 5] = max_tokens
    return rows


def _build_vocab(
    features: Sequence[LengthFeatures], max_tenants: int
) -> dict[str, dict[str, float]]:
    """Ordinal codes 1, 2, … by frequency in the window (trees split ordinal codes fine for a
    handful of values). Tenants can be many: the ``max_tenants`` most frequent get a code, the
    rest share ``OTHER``."""
    vocab: dict[str, dict[str, float]] = {}
    for kind in ("model", "slo_class", "task", "tenant"):
        counts = Counter(getattr(f, kind) for f in features if getattr(f, kind) is not None)
        limit = max_tenants if kind == "tenant" else None
        common = counts.most_common(limit)
        vocab[kind] = {v: float(i + 1) for i, (v, _) in enumerate(common)}
        if kind == "tenant" and len(counts) > max_tenants:
            vocab[kind]["\0full"] = 1.0  # marker: unknown tenants map to OTHER, not UNSEEN
    return vocab


def _conditional_quantile(
    support: np.ndarray, cum: np.ndarray, q: float, generated: float
) -> float | None:
    """The q-quantile of the weighted sample conditioned on O > generated, or None if no mass
    lies above ``generated``. Uses unnormalised cumulative weights so that the result is
    non-decreasing in ``generated`` (the threshold W(≤g) + q·(W − W(≤g)) only grows)."""
    k0 = int(np.searchsorted(support, generated, side="right"))
    if k0 >= len(support):
        return None
    below = float(cum[k0 - 1]) if k0 > 0 else 0.0
    target = below + q * (float(cum[-1]) - below)
    k = int(np.searchsorted(cum, target * (1 - 1e-12), side="left"))
    return float(support[min(max(k, k0), len(support) - 1)])


class QuantileLengthPredictor:
    """Quantile regression forest over :class:`LengthFeatures`, refreshed online.

    ``window``: completions kept for training (the most recent). ``refresh_every``: new
    completions after which :attr:`refresh_due` turns true. ``min_train``: the first refresh
    is due only once the window holds this many. The forest: ``n_estimators`` trees with at
    least ``min_samples_leaf`` samples per leaf (small leaves overfit and under-cover), every
    leaf sample kept (``max_samples_leaf=None``: the weighted leaf samples *are* the conditional
    distribution that :meth:`tighten` needs). ``cap_feature=False`` keeps ``max_tokens`` out
    of the features (predictions are still truncated at it): use it where the cap is derived
    from the true output, as in the simulator's clairvoyant variant (``max_tokens = output``),
    or the forest learns the answer from the cap.

    Cost (measured on this project's 2-core machine, 100 trees, one core): a refresh on a
    window of 2,048 takes about 0.15 s of fit plus 0.12 s of out-of-bag calibration (4,096:
    0.25 + 0.25 s); :meth:`predict` (one request, with its leaf sample) about 5 ms;
    :meth:`predict_quantiles` about 30 µs per request in bulk; :meth:`moments_array` 20-35 ms
    for 100,000 requests (rows repeat after prompt bucketing and are cached per forest).
    scikit-learn's tree builder releases the GIL, so run :meth:`refresh` in a worker thread
    (:meth:`refresh_async`) from a coordinator: the event loop keeps running, and predictions
    use the previous forest until the new one is swapped in.
    """

    def __init__(
        self,
        quantiles: Sequence[float] = (0.5, 0.9),
        *,
        window: int = 2048,
        refresh_every: int = 512,
        min_train: int = 256,
        n_estimators: int = 100,
        min_samples_leaf: int = 32,
        calibrate: bool = True,
        max_tenants: int = 256,
        cap_feature: bool = True,
        random_state: int = 0,
        n_jobs: int = 1,
    ) -> None:
        self.quantiles = _check_quantiles(quantiles)
        if window < 2 or refresh_every < 1 or min_train < 1 or n_estimators < 1:
            raise ValueError("window >= 2, refresh_every >= 1, min_train >= 1, n_estimators >= 1")
        if min_samples_leaf < 1 or max_tenants < 1:
            raise ValueError("min_samples_leaf and max_tenants must be >= 1")
        self.window = window
        self.refresh_every = refresh_every
        self.min_train = min_train
        self.n_estimators = n_estimators
        self.min_samples_leaf = min_samples_leaf
        self.calibrate = calibrate
        self.max_tenants = max_tenants
        self.cap_feature = cap_feature
        self.random_state = random_state
        self.n_jobs = n_jobs
        self._buffer: deque[tuple[LengthFeatures, float]] = deque(maxlen=window)
        self._since_fit = 0
        self._fitted: _Fitted | None = None
        self._lock = threading.Lock()  # guards _buffer/_since_fit and the _fitted swap
        self._refreshing = threading.Lock()  # one refresh at a time
        self._async_refreshing = False
        self._version = 0

    # ------------------------------------------------------------------ training
    def observe(self, features: LengthFeatures, output_tokens: float) -> None:
        """Record a completed request (its output tokens, > ``max_tokens`` is clipped to it)."""
        if not isinstance(features, LengthFeatures):
            raise ValueError("features must be a LengthFeatures")
        out = _check_count("output_tokens", output_tokens)
        out = (
            min(max(out, 1), int(features.cap)) if features.max_tokens is not None else max(out, 1)
        )
        with self._lock:
            self._buffer.append((features, float(out)))
            self._since_fit += 1

    def __len__(self) -> int:
        return len(self._buffer)

    @property
    def fitted(self) -> bool:
        return self._fitted is not None

    @property
    def version(self) -> int:
        return self._fitted.version if self._fitted is not None else 0

    @property
    def refresh_due(self) -> bool:
        """True once the window holds ``min_train`` completions and ``refresh_every`` arrived
        since the last refresh (the first refresh: as soon as ``min_train`` are there)."""
        n = len(self._buffer)
        if n < self.min_train:
            return False
        return self._fitted is None or self._since_fit >= self.refresh_every

    def trained_count(self, model: str) -> int:
        """Completions of ``model`` in the window the current forest was trained on."""
        fitted = self._fitted
        return fitted.model_counts.get(model, 0) if fitted is not None else 0

    def refresh(self) -> RefreshStats:
        """Retrain on the current window and swap the new forest in. Thread-safe; safe to call
        from a worker thread while other threads observe and predict. Raises ValueError if no
        completion was observed yet."""
        with self._refreshing:
            with self._lock:
                snapshot = list(self._buffer)
                self._since_fit = 0
            if not snapshot:
                raise ValueError("no completed requests observed: nothing to train on")
            t0 = time.perf_counter()
            feats = [f for f, _ in snapshot]
            y = np.fromiter((o for _, o in snapshot), np.float64, len(snapshot))
            vocab = _build_vocab(feats, self.max_tenants)
            x = self._forest_input(_encode_rows(feats, vocab))
            forest = RandomForestQuantileRegressor(
                n_estimators=self.n_estimators,
                min_samples_leaf=min(self.min_samples_leaf, max(1, len(y) // 4)),
                max_samples_leaf=None,
                random_state=self.random_state + self._version,
                n_jobs=self.n_jobs,
            )
            forest.fit(x, y)
            coverage = None
            if self.calibrate and len(y) >= 50:
                oob = np.asarray(forest.predict(x, quantiles=list(_CAL_GRID), oob_score=True))
                # with few trees a sample can be in every bootstrap and have no OOB estimate
                seen = np.isfinite(oob).all(axis=1)
                if seen.sum() >= 50:
                    hits = y[seen, None] <= oob[seen]
                    coverage = np.maximum.accumulate(hits.mean(axis=0))
            self._version += 1
            fitted = _Fitted(
                forest, vocab, y, coverage, Counter(f.model for f in feats), self._version
            )
            with self._lock:
                self._fitted = fitted
            stats = RefreshStats(self._version, len(y), time.perf_counter() - t0)
        log.info(
            "length_forest_refreshed",
            version=stats.version,
            samples=stats.samples,
            fit_s=round(stats.fit_s, 3),
        )
        return stats

    async def refresh_async(self) -> RefreshStats | None:
        """:meth:`refresh` in a worker thread, so the event loop keeps running; returns None
        without training if a refresh is already running."""
        # the flag is set on the event loop before the thread starts, so a second call made
        # while the first is still being scheduled is skipped too (the lock alone is taken
        # only once the worker thread runs)
        if self._async_refreshing or self._refreshing.locked():
            return None
        self._async_refreshing = True
        try:
            return await asyncio.to_thread(self.refresh)
        finally:
            self._async_refreshing = False

    # ------------------------------------------------------------------ prediction
    def _require_fitted(self) -> _Fitted:
        fitted = self._fitted
        if fitted is None:
            raise ValueError("the forest is not trained yet: observe completions, then refresh()")
        return fitted

    def predict_quantiles(
        self, features: Sequence[LengthFeatures], quantiles: Sequence[float] | None = None
    ) -> np.ndarray:
        """Bounds (tokens) of many requests at once: shape (len(features), len(quantiles)), at
        the calibrated levels, clipped to [1, max_tokens]."""
        fitted = self._require_fitted()
        if len(features) == 0:
            raise ValueError("no requests to predict")
        qs = _check_quantiles(quantiles if quantiles is not None else self.quantiles)
        rows = _encode_rows(features, fitted.vocab)
        levels = [fitted.level(q) for q in qs]
        out = np.asarray(
            fitted.forest.predict(self._forest_input(rows), quantiles=levels, interpolation="lower")
        )
        out = out.reshape(len(features), len(qs))
        caps = np.array([f.cap for f in features])[:, None]
        return np.clip(out, 1.0, caps)

    def predict(
        self, features: LengthFeatures, quantiles: Sequence[float] | None = None
    ) -> LengthPrediction:
        """One request's distribution (its leaf sample) and its bounds, ready for
        :meth:`tighten`."""
        fitted = self._require_fitted()
        qs = _check_quantiles(quantiles if quantiles is not None else self.quantiles)
        row = _encode_rows([features], fitted.vocab)
        prox = fitted.forest.proximity_counts(self._forest_input(row))[0]
        idx = np.fromiter((i for i, _ in prox), np.int64, len(prox))
        w = np.fromiter((c for _, c in prox), np.float64, len(prox))
        values = fitted.y_train[idx]
        order = np.argsort(values, kind="stable")
        support, cum = values[order], np.cumsum(w[order])
        levels = {q: fitted.level(q) for q in qs}
        pred = LengthPrediction(features, {}, levels, support, cum, 0, fitted.version)
        return self._bounds(pred, 0, fitted)

    def tighten(self, prediction: LengthPrediction, generated: float) -> LengthPrediction:
        """The bounds given that ``generated`` tokens are out already: the quantile (at the same
        calibrated level) of the forest's distribution conditioned on O > generated. Never
        below ``generated``, never above ``max_tokens``, non-decreasing in ``generated``.

        If the request's leaf sample has no mass above ``generated`` (it outlived every
        similar request), the condition is applied to all training outputs instead; if none of
        those is longer either, the bound is ``max_tokens``, or 2 × generated without a cap (a
        documented guess, not a fitted quantile)."""
        g = _check_count("generated", generated)
        if prediction.features.max_tokens is not None and g > prediction.features.max_tokens:
            raise ValueError(f"generated={g} exceeds max_tokens={prediction.features.max_tokens}")
        fitted = self._fitted
        if fitted is None or fitted.version != prediction.version:
            fitted = None  # the marginal fallback must come from the forest that predicted
        return self._bounds(prediction, g, fitted)

    def _bounds(self, pred: LengthPrediction, g: int, fitted: _Fitted | None) -> LengthPrediction:
        cap = pred.features.cap
        out: dict[float, float] = {}
        for q, level in pred.levels.items():
            v = _conditional_quantile(pred.support, pred.cum_weights, level, g)
            if v is None and fitted is not None:
                y = fitted.y_sorted
                v = _conditional_quantile(y, np.arange(1.0, len(y) + 1), level, g)
            if v is None:
                v = cap if math.isfinite(cap) else 2.0 * max(g, 1)
            bound = min(cap, max(v, g + 1.0)) if g > 0 else min(cap, max(v, 1.0))
            out[q] = max(bound, float(g))
        return LengthPrediction(
            pred.features, out, pred.levels, pred.support, pred.cum_weights, g, pred.version
        )

    def moments(self, features: Sequence[LengthFeatures]) -> tuple[np.ndarray, np.ndarray]:
        """(E[min(O, cap)], Var[min(O, cap)]) per request from the forest's (uncalibrated)
        conditional distribution: the midpoint rule over 32 levels of its quantile function.
        Rows shared by several requests (same features after prompt bucketing) are predicted
        once and cached with the forest, so re-pricing a queue is cheap."""
        fitted = self._require_fitted()
        if len(features) == 0:
            return np.empty(0), np.empty(0)
        return self._moments_of_rows(fitted, _encode_rows(features, fitted.vocab))

    def _forest_input(self, rows: np.ndarray) -> np.ndarray:
        """The rows as the forest sees them: without ``cap_feature`` the ``max_tokens``
        column is blanked (the cap still truncates every prediction)."""
        if self.cap_feature:
            return rows
        out = rows.copy()
        out[:, 5] = NO_CAP
        return out

    def moments_array(
        self,
        model: str,
        slo_class: str | None,
        prompt_tokens: np.ndarray,
        max_tokens: np.ndarray,
        *,
        tasks: Sequence[str | None] | None = None,
        tenants: Sequence[str | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`moments` of requests of one (model, SLO class) given as arrays (about 10x
        faster than building a :class:`LengthFeatures` per request)."""
        fitted = self._require_fitted()
        prompts = check_counts("prompt_tokens", prompt_tokens)
        caps = check_counts("max_tokens", max_tokens, minimum=1)
        n = len(caps)
        if len(prompts) != n:
            raise ValueError(f"prompt_tokens has {len(prompts)} entries, max_tokens {n}")
        for name, seq in (("tenants", tenants), ("tasks", tasks)):
            if seq is not None and len(seq) != n:
                raise ValueError(f"{name} has {len(seq)} entries, max_tokens {n}")
        if n == 0:
            return np.empty(0), np.empty(0)
        rows = _encode_arrays(fitted.vocab, model, slo_class, prompts, caps, tasks, tenants)
        return self._moments_of_rows(fitted, rows)

    def _moments_of_rows(self, fitted: _Fitted, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # unique rows through a bytes view: ~10x faster than np.unique(axis=0) at 100k rows
        rows = np.ascontiguousarray(rows)
        as_bytes = rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).ravel()
        _, first, inverse = np.unique(as_bytes, return_index=True, return_inverse=True)
        uniq, inverse = rows[first], inverse.reshape(-1)
        keys = [u.tobytes() for u in uniq]
        # read each row once: another thread may clear the cache between two lookups
        got = [fitted.moment_cache.get(k) for k in keys]
        todo = [i for i, v in enumerate(got) if v is None]
        if todo:
            qv = np.asarray(
                fitted.forest.predict(
                    self._forest_input(uniq[todo]), quantiles=list(_MOMENT_LEVELS)
                )
            ).reshape(len(todo), len(_MOMENT_LEVELS))
            caps = uniq[todo, 5]
            caps = np.where(caps == NO_CAP, np.inf, caps)[:, None]
            qv = np.clip(qv, 1.0, caps)
            if len(fitted.moment_cache) > 65_536:
                fitted.moment_cache.clear()
            for j, i in enumerate(todo):
                got[i] = fitted.moment_cache[keys[i]] = (
                    float(qv[j].mean()),
                    float((qv[j] ** 2).mean()),
                )
        pairs = np.array(got, dtype=np.float64).reshape(len(keys), 2)
        mean, sq = pairs[inverse, 0], pairs[inverse, 1]
        return mean, np.maximum(sq - mean**2, 0.0)


# ------------------------------------------------------------------ estimator adapter
class ForestLengthModel(OutputLengthModel):
    """:class:`OutputLengthModel` that prices a request with the forest when it can.

    ``predict(model, slo_class, max_tokens)`` without per-request features is exactly the
    parent's per-group fit. With ``prompt_tokens=`` (and optionally ``tenants=``, ``tasks=``)
    the forest gives each request's (mean, variance), truncated at its ``max_tokens``, once the
    current forest was trained on at least ``min_observations`` completions of that model
    (default 256); before that, or for a model it has not seen enough of, the parent's fit.
    ``observe`` always feeds the parent; with ``prompt_tokens=`` it also feeds the forest and,
    if ``auto_refresh``, retrains inline when due (about 0.3 s every ``refresh_every``
    completions — a live coordinator should pass ``auto_refresh=False`` and run
    ``await lengths.forest.refresh_async()`` when ``lengths.forest.refresh_due``)."""

    def __init__(
        self,
        prior: str = "sharegpt",
        *,
        forest: QuantileLengthPredictor | None = None,
        min_observations: int = 256,
        auto_refresh: bool = True,
        prior_weight: float = 32.0,
        history_limit: int = 4096,
    ) -> None:
        super().__init__(prior, prior_weight=prior_weight, history_limit=history_limit)
        if min_observations < 1:
            raise ValueError("min_observations must be >= 1")
        self.forest = forest or QuantileLengthPredictor()
        self.min_observations = min_observations
        self.auto_refresh = auto_refresh

    def uses_forest(self, model: str) -> bool:
        return self.forest.trained_count(model) >= self.min_observations

    def observe(
        self,
        model: str,
        slo_class: str | None,
        output_tokens: int,
        *,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        tenant: str | None = None,
        task: str | None = None,
    ) -> None:
        out = _check_count("output_tokens", output_tokens)
        super().observe(model, slo_class, out)
        if prompt_tokens is None:
            return
        feats = LengthFeatures(model, prompt_tokens, max_tokens, slo_class, task, tenant)
        self.forest.observe(feats, out)
        if self.auto_refresh and self.forest.refresh_due:
            self.forest.refresh()

    def _features(
        self,
        model: str,
        slo_class: str | None,
        caps: np.ndarray,
        prompt_tokens: np.ndarray,
        tenants: Sequence[str | None] | None,
        tasks: Sequence[str | None] | None,
    ) -> list[LengthFeatures]:
        n = len(caps)
        if len(prompt_tokens) != n:
            raise ValueError(f"prompt_tokens has {len(prompt_tokens)} entries, max_tokens {n}")
        for name, seq in (("tenants", tenants), ("tasks", tasks)):
            if seq is not None and len(seq) != n:
                raise ValueError(f"{name} has {len(seq)} entries, max_tokens {n}")
        return [
            LengthFeatures(
                model,
                _check_count("prompt_tokens", prompt_tokens[i]),
                _check_count("max_tokens", caps[i], minimum=1),
                slo_class,
                tasks[i] if tasks is not None else None,
                tenants[i] if tenants is not None else None,
            )
            for i in range(n)
        ]

    def predict(
        self,
        model: str,
        slo_class: str | None,
        max_tokens: np.ndarray,
        *,
        prompt_tokens: np.ndarray | None = None,
        tenants: Sequence[str | None] | None = None,
        tasks: Sequence[str | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(mean, variance) of output tokens per request (see the class docstring)."""
        if prompt_tokens is None or not self.uses_forest(model):
            return super().predict(model, slo_class, max_tokens)
        return self.forest.moments_array(
            model, slo_class, prompt_tokens, max_tokens, tasks=tasks, tenants=tenants
        )

    def upper_bound(
        self,
        model: str,
        slo_class: str | None,
        max_tokens: np.ndarray,
        q: float,
        *,
        prompt_tokens: np.ndarray | None = None,
        tenants: Sequence[str | None] | None = None,
        tasks: Sequence[str | None] | None = None,
    ) -> np.ndarray:
        """The q-quantile of each request's output tokens: the forest's calibrated quantile
        when :meth:`predict` would use the forest, else the normal fit's mean + z_q·σ; always
        in [1, max_tokens]."""
        (q,) = _check_quantiles([q])
        caps = np.maximum(np.atleast_1d(np.asarray(max_tokens, dtype=np.float64)), 1.0)
        if prompt_tokens is None or not self.uses_forest(model) or len(caps) == 0:
            mean, var = super().predict(model, slo_class, caps)
            return np.clip(mean + normal_quantile(q) * np.sqrt(var), 1.0, caps)
        prompts = np.atleast_1d(np.asarray(prompt_tokens, dtype=np.float64))
        feats = self._features(model, slo_class, caps, prompts, tenants, tasks)
        return self.forest.predict_quantiles(feats, [q])[:, 0]
