"""Request groups, QLM §4 and Algorithm 1.

Requests are partitioned by model, then clustered with k-means on standardised features
(effective deadline — the SLO value —, log prompt tokens, log predicted output tokens). Any
cluster larger than its cap is split in halves (by deadline, so halves stay tight) until it
fits; the cap is ``δ × average batch size`` (Algorithm 1), lowered where needed so one model's
requests make at least two groups per instance that serves it (so load can spread) and raised
where needed so no model makes more than ``max_groups_per_model`` groups. Inside a group
requests are FCFS (by the coordinator's arrival sequence).

:func:`build_groups` is a pure function (seeded k-means on canonically ordered input).
:class:`GroupIndex` keeps the centroids of the last clustering so an arrival joins its nearest
group in O(k) without re-clustering; it tracks drift (how far arrivals land from their
centroid compared with the fit) so the planner can re-cluster when groups no longer describe
the queue. Re-clustering never reorders members inside a group: FCFS by ``seq`` is recomputed.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qlm.policy import PlanRequest

NO_DEADLINE_HORIZON_S = 3600.0  # a request without an SLO clusters as due an hour after arrival


@dataclass(frozen=True)
class GroupingConfig:
    delta: float = 4.0  # Algorithm 1's δ: group cap = δ × average batch size
    max_clusters_per_model: int = 24
    max_groups_per_model: int = 512
    minibatch_above: int = 20_000  # MiniBatchKMeans above this many requests of one model
    seed: int = 0
    # OpenMP threads of one k-means fit (None: scikit-learn's default, every core). One: the
    # fits are small (tens to thousands of points, a few ms), the planner runs beside the
    # coordinator's event loop, and OpenMP's threads spin: with the two cores of the
    # development machine busy, a fit of 300 points took 63 ms on two threads and 4 ms on one
    kmeans_threads: int | None = 1

    def __post_init__(self) -> None:
        if not (self.delta > 0 and math.isfinite(self.delta)):
            raise ValueError("delta must be a finite number > 0")
        if self.max_clusters_per_model < 1 or self.max_groups_per_model < 1:
            raise ValueError("max_clusters_per_model and max_groups_per_model must be >= 1")
        if self.kmeans_threads is not None and self.kmeans_threads < 1:
            raise ValueError("kmeans_threads must be >= 1 (or None: every core)")


@dataclass
class RequestGroup:
    """One group: its model, its members (indices into the request list, FCFS), its centroid
    in the model partition's standardised feature space."""

    gid: int
    model: str
    members: np.ndarray
    centroid: np.ndarray


@dataclass
class Grouping:
    groups: list[RequestGroup]
    labels: np.ndarray  # group id per request (-1: not grouped)
    scalers: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    fit_spread: dict[str, float] = field(default_factory=dict)  # mean sq. distance at fit


def request_features(
    deadline: np.ndarray, prompt: np.ndarray, predicted_output: np.ndarray
) -> np.ndarray:
    return np.column_stack(
        [deadline, np.log1p(np.maximum(prompt, 0)), np.log1p(np.maximum(predicted_output, 0))]
    )


def effective_deadlines(requests: Sequence[PlanRequest]) -> np.ndarray:
    d = np.fromiter((r.effective_deadline for r in requests), np.float64, len(requests))
    arrival = np.fromiter((r.arrival_time for r in requests), np.float64, len(requests))
    return np.where(np.isfinite(d), d, arrival + NO_DEADLINE_HORIZON_S)


def load_clustering() -> None:
    """Import scikit-learn's k-means now. It takes seconds (2.7 s on the development machine),
    so it is imported on first use: a coordinator running EDF or FCFS never pays for it, and
    the policies that group call this when built, so their first replan does not either."""
    import sklearn.cluster  # noqa: F401

    _threadpools()


@functools.cache
def _threadpools() -> Any:
    """threadpoolctl's view of the loaded thread pools, found once: building it inspects
    every loaded library (3 ms), limiting with it afterwards costs 20 µs."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def _kmeans(x: np.ndarray, k: int, cfg: GroupingConfig) -> np.ndarray:
    from sklearn.cluster import KMeans, MiniBatchKMeans

    threads = (
        contextlib.nullcontext()
        if cfg.kmeans_threads is None
        else _threadpools().limit(limits=cfg.kmeans_threads, user_api="openmp")
    )
    with warnings.catch_warnings(), threads:
        # identical points give fewer distinct clusters than k: harmless here
        warnings.simplefilter("ignore")
        if len(x) > cfg.minibatch_above:
            km = MiniBatchKMeans(
                n_clusters=k, random_state=cfg.seed, batch_size=4096, n_init=1, max_iter=50
            )
        else:
            km = KMeans(n_clusters=k, random_state=cfg.seed, n_init=1, max_iter=100)
        return np.asarray(km.fit_predict(x))


def _split(idx: np.ndarray, deadline: np.ndarray, cap: int) -> list[np.ndarray]:
    """Algorithm 1's splitHalf, repeated until every part is within the cap; halves are taken
    in deadline order so each part covers a narrow deadline range."""
    if len(idx) <= cap:
        return [idx]
    order = idx[np.lexsort((idx, deadline[idx]))]
    parts = math.ceil(len(idx) / cap)
    # splitting in halves until <= cap gives 2^ceil(log2 parts) near-equal parts
    pieces = 2 ** math.ceil(math.log2(parts))
    return [p for p in np.array_split(order, pieces) if len(p)]


def build_groups(
    requests: Sequence[PlanRequest],
    predicted_output: np.ndarray,
    *,
    avg_batch: Mapping[str, float],
    instances_per_model: Mapping[str, int],
    config: GroupingConfig | None = None,
    deadlines: np.ndarray | None = None,
    skip: np.ndarray | None = None,
) -> Grouping:
    """Group ``requests`` (Algorithm 1). ``avg_batch``/``instances_per_model`` per model; requests
    with ``skip`` true (e.g. no instance serves their model) get label -1."""
    cfg = config or GroupingConfig()
    n = len(requests)
    labels = np.full(n, -1, dtype=np.int64)
    grouping = Grouping(groups=[], labels=labels)
    if n == 0:
        return grouping
    dl = effective_deadlines(requests) if deadlines is None else deadlines
    prompt = np.fromiter((r.prompt_tokens for r in requests), np.float64, n)
    seq = np.fromiter((r.seq for r in requests), np.int64, n)
    feats = request_features(dl, prompt, np.asarray(predicted_output, dtype=np.float64))
    models = np.array([r.model for r in requests], dtype=object)
    for model in sorted(set(models.tolist())):
        idx = np.flatnonzero(models == model)
        if skip is not None:
            idx = idx[~skip[idx]]
        if len(idx) == 0:
            continue
        x = feats[idx]
        mean, std = x.mean(axis=0), x.std(axis=0)
        std = np.where(std > 1e-12, std, 1.0)
        z = (x - mean) / std
        grouping.scalers[model] = (mean, std)
        batch = max(1.0, float(avg_batch.get(model, 1.0)))
        cap = max(1, int(cfg.delta * batch))
        cap = min(
            cap, max(1, math.ceil(len(idx) / (2 * max(1, instances_per_model.get(model, 1)))))
        )
        cap = max(cap, math.ceil(len(idx) / cfg.max_groups_per_model))
        k = min(cfg.max_clusters_per_model, math.ceil(len(idx) / max(cap, 1)) + 1, len(idx))
        distinct = len(np.unique(z.round(9), axis=0)) if len(idx) <= 4096 else k
        k = max(1, min(k, distinct))
        lab = np.zeros(len(idx), dtype=np.int64) if k == 1 else _kmeans(z, k, cfg)
        spread = 0.0
        for c in range(int(lab.max()) + 1):
            sel = lab == c
            if not sel.any():
                continue
            members = idx[sel]
            centroid = z[sel].mean(axis=0)
            spread += float(((z[sel] - centroid) ** 2).sum())
            for part in _split(members, dl, cap):
                part = part[np.argsort(seq[part], kind="stable")]  # FCFS inside the group
                gid = len(grouping.groups)
                labels[part] = gid
                grouping.groups.append(
                    RequestGroup(gid, model, part, ((feats[part] - mean) / std).mean(axis=0))
                )
        grouping.fit_spread[model] = spread / len(idx)
    return grouping


class GroupIndex:
    """Centroids of the current groups, per model, for O(k) joins of new arrivals."""

    def __init__(self) -> None:
        self._centroids: dict[str, np.ndarray] = {}
        self._gids: dict[str, list[int]] = {}
        self._scalers: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._fit_spread: dict[str, float] = {}
        self._joined = 0
        self._joined_sq = 0.0

    @classmethod
    def from_grouping(cls, grouping: Grouping) -> GroupIndex:
        index = cls()
        for g in grouping.groups:
            index._gids.setdefault(g.model, []).append(g.gid)
        for model, gids in index._gids.items():
            index._centroids[model] = np.array([grouping.groups[i].centroid for i in gids])
        index._scalers = dict(grouping.scalers)
        index._fit_spread = dict(grouping.fit_spread)
        return index

    def add_group(self, model: str, gid: int, centroid: np.ndarray) -> None:
        self._gids.setdefault(model, []).append(gid)
        old = self._centroids.get(model)
        row = centroid.reshape(1, -1)
        self._centroids[model] = row if old is None else np.vstack([old, row])

    def remove_groups(self, gids: set[int]) -> None:
        """Forget these groups (their members have all left the queues)."""
        for model in list(self._gids):
            keep = [k for k, g in enumerate(self._gids[model]) if g not in gids]
            if len(keep) == len(self._gids[model]):
                continue
            self._gids[model] = [self._gids[model][k] for k in keep]
            self._centroids[model] = self._centroids[model][keep]

    def standardise(self, model: str, features: np.ndarray) -> np.ndarray:
        scaler = self._scalers.get(model)
        if scaler is None:
            return features
        return (features - scaler[0]) / scaler[1]

    def set_scaler(self, model: str, mean: np.ndarray, std: np.ndarray) -> None:
        self._scalers.setdefault(model, (mean, std))

    def nearest(self, model: str, z: np.ndarray, allowed: set[int] | None = None) -> int | None:
        """The group of ``model`` whose centroid is nearest to standardised features ``z``
        (restricted to ``allowed`` when given); records the distance for drift tracking."""
        cents = self._centroids.get(model)
        if cents is None or len(cents) == 0:
            return None
        d = ((cents - z) ** 2).sum(axis=1)
        gids = self._gids[model]
        if allowed is not None:
            mask = np.fromiter((g in allowed for g in gids), bool, len(gids))
            if not mask.any():
                return None
            d = np.where(mask, d, np.inf)
        best = int(np.argmin(d))
        self._joined += 1
        self._joined_sq += float(d[best])
        return gids[best]

    def drift(self) -> float:
        """Mean squared distance of arrivals to the centroid they joined, over the fit's own
        mean squared distance (≈ 1 while the clustering still describes the arrivals)."""
        if not self._joined:
            return 0.0
        base = np.mean(list(self._fit_spread.values())) if self._fit_spread else 1.0
        # floor: a fit of identical points has zero spread; 0.05 ≈ (0.22 std)² is "close"
        return (self._joined_sq / self._joined) / max(float(base), 0.05)

    @property
    def joined(self) -> int:
        return self._joined
