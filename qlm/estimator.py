"""Request completion time (RCT) estimator, QLM §6 (eqs. 1-5).

Two parts, both vectorised with numpy so the planner can price 100k queued requests at once:

* :class:`HardwareProfile` — per (GPU type, model, instance shape) the constants of §6, derived
  from :mod:`qlm.engine_model`: prefill time ``P`` (affine in prompt tokens), decode time per
  token ``d`` (one iteration at batch 1), inefficiency ``ε`` (an iteration at the typical
  continuous batch over one at batch 1), token throughput ``Θ`` (typical batch / iteration),
  prefill throughput ``Π``, KV capacity, model load times (cold from disk, warm from CPU), and
  the per-token KV transfer and recompute times that decide eviction vs swap (Insight #2).
  Profiles are validated: a NaN, infinite or negative value is a ``ValueError`` at load.
* :class:`OutputLengthModel` — workload profiling: per (model, SLO class) an output-length
  distribution, a prior from a shipped length table mixed with the completions observed online
  (:meth:`OutputLengthModel.observe`), always truncated at each request's ``max_tokens``.

The estimator itself (:class:`RCTEstimator`) turns these into distributions:

    W = (tokens ahead) / Θ                         (eq. 2, prompt tokens priced at 1/Π)
    O ~ N(μ_o, σ_o²)                               (eq. 3)
    D = O · ε · d                                  (eq. 4)
    C_q = W + P + D                                (eq. 1)
    C_group = max over the group's members of C_q  (eq. 5)

The max of ``n`` i.i.d. normals is summarised by its mean (Blom's approximation of the top
order statistic) and variance (exact for n = 1, the Gumbel limit ``π²/(12 ln n)`` otherwise), and
its quantile ``q`` is the single-request quantile at ``q^(1/n)``. ``docs/planner.md`` maps every
symbol to the paper.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Literal, TypeVar

import numpy as np
from scipy.special import ndtri

from qlm.engine_model import (
    EngineProfile,
    InsufficientMemoryError,
    get_profile,
    profile_caches,
)

FALLBACK_GPU = "A100-80GB"
FALLBACK_MODEL = "mistral-7b"
PRIOR_TABLES = ("sharegpt", "arxiv", "azure-conv", "azure-code", "max_tokens")


@lru_cache(maxsize=64)
def normal_quantile(q: float) -> float:
    """Φ⁻¹(q), the standard normal quantile (cached: a few levels are asked for, per request)."""
    return float(ndtri(q))


@lru_cache(maxsize=256)
def engine_profile(gpu_type: str, model: str) -> EngineProfile:
    """The engine profile of ``model`` on ``gpu_type``. Names the catalog does not know (unit
    tests use made-up ones) are timed as ``FALLBACK_MODEL`` on ``FALLBACK_GPU`` — the same rule
    as :mod:`qlm.planner.evaluate`, so the two never disagree on what an unknown name costs."""
    for g, m in ((gpu_type, model), (gpu_type, FALLBACK_MODEL), (FALLBACK_GPU, FALLBACK_MODEL)):
        try:
            return get_profile(g, m)
        except (KeyError, InsufficientMemoryError):
            continue
    raise AssertionError("the fallback profile always exists")  # pragma: no cover


@dataclass(frozen=True)
class HardwareProfile:
    """The §6 hardware constants of one model on one instance shape (all seconds or tokens)."""

    gpu_type: str
    model: str
    batch: int  # typical continuous batch (sequences) the constants were taken at
    prefill_fixed_s: float  # P(n) = prefill_fixed_s + prefill_s_per_token * n
    prefill_s_per_token: float
    decode_token_s: float  # d: one decode iteration at batch 1
    inefficiency: float  # ε: iteration at the typical batch / iteration at batch 1 (>= 1)
    throughput_tps: float  # Θ: output tokens per second at the typical batch
    prefill_tps: float  # Π: prompt tokens per second with full chunked-prefill iterations
    kv_capacity_tokens: int
    load_cold_s: float  # disk -> CPU -> GPU
    load_warm_s: float  # CPU -> GPU
    kv_transfer_s_per_token: float  # GPU <-> CPU, one direction
    recompute_s_per_token: float  # rebuilding evicted KV by prefill
    kv_bytes_per_token: float
    weight_bytes: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str):
                continue
            if not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"hardware profile {self.model}@{self.gpu_type}: {f.name}={value!r} "
                    "must be a finite number >= 0"
                )
        if self.throughput_tps <= 0 or self.prefill_tps <= 0 or self.batch < 1:
            raise ValueError(
                f"hardware profile {self.model}@{self.gpu_type}: throughputs and batch must be > 0"
            )

    @property
    def token_time_s(self) -> float:
        """ε·d: seconds per output token of one request inside the typical batch (eq. 4)."""
        return self.inefficiency * self.decode_token_s

    def prefill_s(self, prompt_tokens: np.ndarray | float) -> np.ndarray | float:
        return self.prefill_fixed_s + self.prefill_s_per_token * prompt_tokens

    def switch_in_s(self, warm: bool) -> float:
        return self.load_warm_s if warm else self.load_cold_s

    def preemption_mode(
        self, context_tokens: int, cpu_free_bytes: float | None
    ) -> Literal["swap", "evict"]:
        """Insight #2: swap the KV to CPU when moving it out and back is cheaper than a
        recompute and the host has room for it; evict (recompute later) otherwise."""
        swap_s = 2 * self.kv_transfer_s_per_token * context_tokens
        recompute_s = self.recompute_s_per_token * context_tokens
        fits = cpu_free_bytes is None or cpu_free_bytes >= self.kv_bytes_per_token * context_tokens
        return "swap" if fits and swap_s < recompute_s else "evict"


def typical_batch(
    profile: EngineProfile, kv_capacity: int, max_batch: int, ctx: int, kv_fraction: float = 1.0
) -> int:
    fit = int(kv_capacity * kv_fraction) // max(ctx, 1)
    return max(1, min(max_batch, profile.max_batch_size, fit))


@lru_cache(maxsize=4096)
def hardware_profile(
    gpu_type: str,
    model: str,
    kv_capacity: int,
    max_batch: int,
    ctx: int,
    prompt_ratio: float = 0.0,
    kv_fraction: float = 1.0,
) -> HardwareProfile:
    """Derive the §6 constants from the engine model at a typical batch of ``ctx``-token
    sequences (``ctx`` = mean prompt + half the mean output, as a sequence is on average half
    way through its decode).

    ``kv_fraction`` is the share of the KV cache the running batch fills: 1 (the default) is
    the cache's capacity; an agent that stops pulling at a utilisation threshold (the
    simulator's and the live agent's 90 %, ``qlm.engine_scheduler.KV_SATURATED_FRACTION``)
    runs a batch that fills about that share, not the whole cache.

    ``prompt_ratio`` is the workload's prompt tokens per output token. With continuous batching
    the prefills of the requests that replace finished ones run inside the decode batch: in
    steady state ``b / mean output`` requests finish per iteration and as many prompts are
    prefilled, so each iteration carries ``b · prompt_ratio`` prefill tokens. ε includes them,
    as an ε measured on the workload (the paper's profiling) would; Θ stays the decode rate,
    since the waiting time already prices prompt tokens at 1/Π (eq. 2). The engine fills an
    iteration's token budget with prompt chunks beside the decode batch, and an iteration
    costs the larger of its compute and its memory traffic (the roofline): a chunk adds the
    difference between a mixed iteration and a pure decode one, not a prefill's whole time
    (a decode batch is memory-bound, so the prompt's compute partly hides under it). So a
    share ``b · prompt_ratio / chunk`` of the iterations carries a full chunk."""
    ep = engine_profile(gpu_type, model)
    kv = kv_capacity if kv_capacity > 0 else ep.kv_capacity_tokens
    b = typical_batch(ep, kv, max_batch, ctx, kv_fraction)
    it1 = ep.decode_iteration_time(1, ctx)
    itb = ep.decode_iteration_time(b, ctx)
    p_small, p_big = ep.prefill_time(1), ep.prefill_time(ep.max_num_batched_tokens)
    per_token = (p_big - p_small) / max(ep.max_num_batched_tokens - 1, 1)
    interleaved = 0.0
    if prompt_ratio > 0:
        chunk = max(ep.max_num_batched_tokens - b, 1)  # the budget left beside the decode
        mixed = ep.iteration_time(chunk, b, b * ctx)
        interleaved = b * prompt_ratio / chunk * max(mixed - itb, 0.0)
    return HardwareProfile(
        gpu_type=gpu_type,
        model=model,
        batch=b,
        prefill_fixed_s=max(p_small - per_token, 0.0),
        prefill_s_per_token=per_token,
        decode_token_s=it1,
        inefficiency=(itb + interleaved) / it1,
        throughput_tps=b / itb,
        prefill_tps=ep.max_num_batched_tokens / p_big,
        kv_capacity_tokens=kv,
        load_cold_s=ep.load_time_from_disk(),
        load_warm_s=ep.load_time_from_cpu(),
        kv_transfer_s_per_token=ep.kv_transfer_time(1),
        recompute_s_per_token=ep.recompute_time(ctx) / max(ctx, 1),
        kv_bytes_per_token=float(ep.kv_bytes_per_token),
        weight_bytes=float(ep.model.weight_bytes),
    )


# a newly registered measured profile holds for the next estimate (engine_model.profile_caches)
profile_caches(engine_profile.cache_clear, hardware_profile.cache_clear)


def bucket_ctx(ctx: float) -> int:
    """Round a context length to 1/8-octave buckets so profiles are cached and shared."""
    if ctx <= 16:
        return max(1, round(ctx))
    step = 2 ** max(0, math.floor(math.log2(ctx)) - 3)
    return int(round(ctx / step) * step)


# ------------------------------------------------------------------ output-length model
def _prior_sample(table: str) -> np.ndarray:
    if table == "max_tokens":
        return np.empty(0)
    from qlm.trace import load_azure_trace, load_request_lengths

    if table in ("sharegpt", "arxiv"):
        outs = [o for _, o in load_request_lengths(table)]  # type: ignore[arg-type]
    elif table in ("azure-conv", "azure-code"):
        outs = [r.output_tokens for r in load_azure_trace(table.split("-")[1])]  # type: ignore[arg-type]
    else:
        raise ValueError(f"unknown output-length prior {table!r}; choose from {PRIOR_TABLES}")
    return np.sort(np.maximum(np.asarray(outs, dtype=np.float64), 1.0))


_M = TypeVar("_M", float, np.ndarray)  # one cap's moment, or an array of caps' moments


def _exact_sums(largest: float, n: int) -> bool:
    """Whether n whole numbers up to ``largest`` have exact float sums of their squares."""
    return largest >= 0 and largest * largest * n < 2.0**53


@lru_cache(maxsize=8)
def prior_sample(table: str) -> np.ndarray:
    return _prior_sample(table)


class _Sample:
    """A sorted sample with prefix sums: truncated moments E[min(O,m)], E[min(O,m)²] for many m
    at once by binary search.

    The history of a key changes by one completion at a time, so the sample is kept sorted by
    inserting (and dropping the value that leaves the window) in place, O(n) memory moves,
    instead of re-sorting after every completion; the prefix sums are rebuilt, O(n), only
    when a prediction of several caps needs them. Whole token counts (whose sums of squares
    stay below 2**53) have exact float sums however they are summed: their totals are kept
    as values come and go, and one cap's moments take the total less the values at or above
    it (few: the longest outputs), so that place(), which prices every arrival at its one
    cap between completions, never waits for a rebuild."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = np.sort(values.astype(np.float64))
        self._cum: np.ndarray | None = None
        self._cum2: np.ndarray | None = None
        v = self.values
        self._exact = bool(
            len(v) == 0 or (np.all(v == np.floor(v)) and _exact_sums(float(v[-1]), len(v)))
        )
        self._total = float(v.sum()) if self._exact else 0.0
        self._total2 = float((v * v).sum()) if self._exact else 0.0

    def __len__(self) -> int:
        return len(self.values)

    def add(self, value: float, drop: float | None = None) -> None:
        """Insert ``value`` and, when the window is full, remove one copy of ``drop``."""
        v = self.values
        if self._exact and not (
            value == math.floor(value)
            and _exact_sums(max(value, float(v[-1]) if len(v) else 0.0), len(v) + 1)
        ):
            self._exact = False
        at = int(np.searchsorted(v, value, side="right"))
        k = -1  # where the copy of ``drop`` that leaves is
        if drop is not None:
            k = int(np.searchsorted(v, drop, side="left"))
            if k < len(v) and v[k] == drop:
                self._total -= drop
                self._total2 -= drop * drop
            else:
                k = -1
        if k >= 0:  # a full window: the values between the two places move by one, in place
            # (np.delete then np.insert, without their two new arrays: the same array after)
            if at <= k:
                v[at + 1 : k + 1] = v[at:k]
                v[at] = value
            else:
                v[k : at - 1] = v[k + 1 : at]
                v[at - 1] = value
        else:
            self.values = np.concatenate((v[:at], (value,), v[at:]))
        self._total += value
        self._total2 += value * value
        self._cum = self._cum2 = None

    def _sums(self) -> tuple[np.ndarray, np.ndarray]:
        if self._cum is None or self._cum2 is None:
            self._cum = np.concatenate(([0.0], np.cumsum(self.values)))
            self._cum2 = np.concatenate(([0.0], np.cumsum(self.values**2)))
        return self._cum, self._cum2

    @property
    def cum(self) -> np.ndarray:
        return self._sums()[0]

    @property
    def cum2(self) -> np.ndarray:
        return self._sums()[1]

    def truncated_moments(self, cap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.values)
        k = np.searchsorted(self.values, cap, side="left")  # values below the cap
        if self._exact and self._cum is None and np.ndim(cap) == 1 and len(cap) == 1:
            tail = self.values[int(k[0]) :]  # the same sums as the prefix sums', exactly
            below = np.array([self._total - float(tail.sum())])
            below2 = np.array([self._total2 - float((tail * tail).sum())])
        else:
            cum, cum2 = self._sums()
            below, below2 = cum[k], cum2[k]
        m1 = (below + cap * (n - k)) / n
        m2 = (below2 + cap**2 * (n - k)) / n
        return m1, m2

    def moments_at(self, cap: float) -> tuple[float, float]:
        """:meth:`truncated_moments` at one cap, in Python floats: the same operations in the
        same order, so the same figures to the bit, without numpy's cost per call on arrays
        of one (place() asks this of every arrival)."""
        v = self.values
        n = len(v)
        k = int(np.searchsorted(v, cap, side="left"))
        if self._exact and self._cum is None:
            tail = v[k:]
            below = self._total - float(tail.sum())
            below2 = self._total2 - float((tail * tail).sum())
        else:
            cum, cum2 = self._sums()
            below, below2 = float(cum[k]), float(cum2[k])
        return (below + cap * (n - k)) / n, (below2 + cap * cap * (n - k)) / n


class OutputLengthModel:
    """Output tokens per (model, SLO class): a prior sample mixed with observed completions.

    The mixture weight of history is ``n / (n + prior_weight)`` (empirical Bayes with the
    prior worth ``prior_weight`` observations); history keeps the last ``history_limit``
    completions per key. Every prediction is truncated at the request's ``max_tokens`` (the
    engine stops there) and floored at 1.
    """

    def __init__(
        self, prior: str = "sharegpt", *, prior_weight: float = 32.0, history_limit: int = 4096
    ) -> None:
        if prior not in PRIOR_TABLES:
            raise ValueError(f"unknown output-length prior {prior!r}; choose from {PRIOR_TABLES}")
        if prior_weight < 0 or history_limit < 1:
            raise ValueError("prior_weight must be >= 0 and history_limit >= 1")
        self.prior = prior
        self.prior_weight = prior_weight
        self.history_limit = history_limit
        self._history: dict[tuple[str, str | None], deque[float]] = {}
        self._samples: dict[tuple[str, str | None], _Sample] = {}
        self._prior: _Sample | None = None
        self.version = 0  # counts completions learnt: predictions change only with it

    @property
    def per_group(self) -> bool:
        """Whether a prediction depends on (model, SLO class, max_tokens) and ``version``
        alone (this fit), so that a caller may keep it until ``version`` changes; a subclass
        that prices each request says no."""
        cls = type(self)
        return (
            cls.predict is OutputLengthModel.predict
            and cls.upper_bound is OutputLengthModel.upper_bound
        )

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
        """Learn from a finished request. The per-request features (``prompt_tokens`` ...)
        are for per-request models (``qlm.length_forest.ForestLengthModel``); this per-group
        fit ignores them."""
        if output_tokens < 0:
            raise ValueError("output_tokens must be >= 0")
        key = (model, slo_class)
        hist = self._history.setdefault(key, deque())
        self.version += 1
        value = float(max(output_tokens, 1))
        hist.append(value)
        drop = hist.popleft() if len(hist) > self.history_limit else None
        sample = self._samples.get(key)
        if sample is not None:  # kept sorted in place (built at the first prediction)
            sample.add(value, drop)

    def history_size(self, model: str, slo_class: str | None) -> int:
        return len(self._history.get((model, slo_class), ()))

    def _prior_sample(self) -> _Sample | None:
        if self.prior == "max_tokens":
            return None
        if self._prior is None:
            self._prior = _Sample(prior_sample(self.prior))
        return self._prior

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
        """(mean, variance) of the output tokens of requests of one key, per ``max_tokens``.
        Per-request features are ignored here (see :meth:`observe`)."""
        cap = np.maximum(np.asarray(max_tokens, dtype=np.float64), 1.0)
        m1, m2 = self._fit((model, slo_class), lambda s: s.truncated_moments(cap), (cap, cap**2))
        return m1, np.maximum(m2 - m1**2, 0.0)

    def _fit(
        self,
        key: tuple[str, str | None],
        moments: Callable[[_Sample], tuple[_M, _M]],
        worst: tuple[_M, _M],
    ) -> tuple[_M, _M]:
        """E[min(O, cap)] and E[min(O, cap)²] of a key: the prior's ``moments`` (``worst``,
        the cap itself, with the "max_tokens" prior) mixed with the history's by weight."""
        prior = self._prior_sample()
        p1, p2 = worst if prior is None else moments(prior)
        hist = self._history.get(key)
        n_hist = len(hist) if hist else 0
        if not n_hist:
            return p1, p2
        sample = self._samples.get(key)
        if sample is None:
            sample = self._samples[key] = _Sample(np.asarray(hist))
        h1, h2 = moments(sample)
        w = n_hist / (n_hist + self.prior_weight)
        return w * h1 + (1 - w) * p1, w * h2 + (1 - w) * p2

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
        """A q-quantile bound of each request's output tokens: mean + z_q·σ of the truncated
        fit, in [1, max_tokens] (per-request models give a per-request quantile instead)."""
        if not 0.0 < q < 1.0:
            raise ValueError(f"q must lie in (0, 1), got {q!r}")
        caps = np.maximum(np.atleast_1d(np.asarray(max_tokens, dtype=np.float64)), 1.0)
        mean, var = self.predict(model, slo_class, caps)
        return np.clip(mean + normal_quantile(q) * np.sqrt(var), 1.0, caps)

    def mean_and_bounds_at(
        self, model: str, slo_class: str | None, max_tokens: int, qs: Sequence[float]
    ) -> tuple[float, list[float]]:
        """One request's :meth:`predict` mean and :meth:`upper_bound` at each of ``qs``, for a
        per-group fit (``per_group``): what the planner asks of every arrival, from one
        prediction, in Python floats with :meth:`predict`'s operations in its order, so the
        same figures to the bit as those calls."""
        if not self.per_group:
            raise TypeError("a model that prices each request needs its features")
        for q in qs:
            if not 0.0 < q < 1.0:
                raise ValueError(f"q must lie in (0, 1), got {q!r}")
        cap = max(float(max_tokens), 1.0)
        m1, m2 = self._fit((model, slo_class), lambda s: s.moments_at(cap), (cap, cap * cap))
        sd = math.sqrt(max(m2 - m1 * m1, 0.0))
        return m1, [min(max(m1 + normal_quantile(q) * sd, 1.0), cap) for q in qs]


# ------------------------------------------------------------------ the max of n (eq. 5)
# Exact variance of the max of n i.i.d. N(0, 1), n = 1..10 (tables of normal order statistics).
_MAX_VAR_SMALL_N = np.array(
    [1.0, 0.6817, 0.5595, 0.4917, 0.4475, 0.4159, 0.3919, 0.3729, 0.3574, 0.3443]
)


def max_normal_moments(n: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
    """(E, Var) of the largest of ``n`` i.i.d. standard normals: Blom's approximation of the
    mean, Φ⁻¹((n − 0.375)/(n + 0.25)); the variance from the exact table up to n = 10 and the
    Gumbel limit π²/(12 ln n) above."""
    n = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    mean = ndtri((n - 0.375) / (n + 0.25))
    mean = np.where(n <= 1, 0.0, mean)
    with np.errstate(divide="ignore"):
        gumbel = np.minimum(1.0, math.pi**2 / (12 * np.log(n)))
    small = np.interp(n, np.arange(1, 11), _MAX_VAR_SMALL_N)
    return mean, np.where(n <= 10, small, gumbel)


def max_normal_quantile(q: float, n: np.ndarray | int) -> np.ndarray:
    """The q-quantile of the max of ``n`` i.i.d. standard normals: P(max ≤ t) = Φ(t)^n, so
    t = Φ⁻¹(q^(1/n))."""
    n = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    return ndtri(q ** (1.0 / n))


@dataclass(frozen=True)
class TimeDistribution:
    """Normal summary of a time (seconds from ``now``) and its quantiles."""

    mean: float
    var: float

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def quantile(self, q: float) -> float:
        return self.mean + normal_quantile(q) * self.std


@dataclass(frozen=True)
class GroupEstimate:
    waiting: TimeDistribution  # W of the group's first request (eq. 2)
    completion: TimeDistribution  # C of the group (eq. 5)
    completion_quantiles: dict[float, float]


class RCTEstimator:
    """Waiting and completion time distributions of request groups on instances (§6)."""

    def __init__(self, lengths: OutputLengthModel | None = None) -> None:
        self.lengths = lengths or OutputLengthModel()

    @staticmethod
    def profile(
        gpu_type: str,
        model: str,
        kv_capacity: int,
        max_batch: int,
        ctx: float,
        prompt_ratio: float = 0.0,
        kv_fraction: float = 1.0,
    ) -> HardwareProfile:
        """``prompt_ratio``: prompt tokens per output token of the requests priced (0: the
        prefills of later arrivals are not counted in the per-token time). ``kv_fraction``: the
        share of the KV cache the running batch fills (see :func:`hardware_profile`)."""
        ratio = round(prompt_ratio, 1) if prompt_ratio < 10 else float(round(prompt_ratio))
        return hardware_profile(
            gpu_type, model, kv_capacity, max_batch, bucket_ctx(ctx), ratio, round(kv_fraction, 3)
        )

    @staticmethod
    def group_moments_array(
        hw: HardwareProfile,
        n: np.ndarray,
        prompt_sum: np.ndarray,
        out_mean_sum: np.ndarray,
        out_var_sum: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(occupancy mean, occupancy var, own-completion mean, own-completion var) of groups of
        ``n`` requests once they start, for many groups at once. Occupancy is how long a group
        holds the instance's batched capacity (what it adds to everyone behind it, eq. 2); own
        completion is when its last member finishes (eq. 5): the last ``min(n, batch)`` members
        start together after the others' occupancy, and the group ends with the longest of
        them, prefill + O·ε·d (eqs. 1, 4)."""
        n = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
        occ_mean = prompt_sum / hw.prefill_tps + out_mean_sum / hw.throughput_tps
        occ_var = out_var_sum / hw.throughput_tps**2
        n_eff = np.minimum(n, hw.batch)
        ahead = (n - n_eff) / n
        mu, sd = out_mean_sum / n, np.sqrt(out_var_sum / n)
        e_max, v_max = max_normal_moments(n_eff)
        own_mean = (
            ahead * occ_mean + hw.prefill_s(prompt_sum / n) + hw.token_time_s * (mu + sd * e_max)
        )
        own_var = ahead * ahead * occ_var + (hw.token_time_s * sd) ** 2 * v_max
        return occ_mean, occ_var, own_mean, own_var

    @classmethod
    def group_moments(
        cls,
        hw: HardwareProfile,
        n: int,
        prompt_sum: float,
        out_mean_sum: float,
        out_var_sum: float,
    ) -> tuple[float, float, float, float]:
        """Scalar :meth:`group_moments_array` (all zero for an empty group)."""
        if n <= 0:
            return 0.0, 0.0, 0.0, 0.0
        a = cls.group_moments_array(
            hw,
            np.array([n]),
            np.array([prompt_sum]),
            np.array([out_mean_sum]),
            np.array([out_var_sum]),
        )
        return tuple(float(x[0]) for x in a)  # type: ignore[return-value]

    def estimate_group(
        self,
        hw: HardwareProfile,
        *,
        n: int,
        prompt_sum: float,
        out_mean_sum: float,
        out_var_sum: float,
        ahead_tokens_mean: float,
        ahead_tokens_var: float,
        switch_s: float = 0.0,
        quantiles: Sequence[float] = (0.5, 0.9, 0.95, 0.99),
    ) -> GroupEstimate:
        """A group at a queue position with ``ahead_tokens_*`` output tokens before it."""
        w = TimeDistribution(
            ahead_tokens_mean / hw.throughput_tps + switch_s,
            ahead_tokens_var / hw.throughput_tps**2,
        )
        _, _, own_mean, own_var = self.group_moments(hw, n, prompt_sum, out_mean_sum, out_var_sum)
        c = TimeDistribution(w.mean + own_mean, w.var + own_var)
        return GroupEstimate(w, c, {q: c.quantile(q) for q in quantiles})

    def estimate_dispatched(
        self,
        hw: HardwareProfile,
        *,
        prompt_tokens: float,
        out_mean: float,
        out_var: float,
        wait_s: float = 0.0,
    ) -> TimeDistribution:
        """What is left of a request's completion time once it is handed to an engine
        (eq. 1): ``wait_s`` still ahead of it there (e.g. another model's batch to drain and
        a load), then its own prefill and decode (eq. 4) in the batch ``hw`` was taken at.
        What it waited in the queue is a fact by then, so eq. 2 prices nothing."""
        _, _, own_mean, own_var = self.group_moments(hw, 1, prompt_tokens, out_mean, out_var)
        return TimeDistribution(wait_s + own_mean, own_var)
