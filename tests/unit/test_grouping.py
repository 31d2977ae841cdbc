"""Request groups (Algorithm 1): partition, model purity, size cap, FCFS, incremental joins."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.grouping import GroupIndex, GroupingConfig, build_groups, request_features
from qlm.policy import PlanRequest


def reqs_from(specs: list[tuple[str, int, int, float]]) -> list[PlanRequest]:
    return [
        PlanRequest(f"r{i}", m, p, o, 0.0, d, None, seq=i) for i, (m, p, o, d) in enumerate(specs)
    ]


def group(reqs: list[PlanRequest], batch: float = 8.0, insts: int = 1, **cfg: object):
    out = np.array([r.max_tokens for r in reqs], dtype=float)
    models = {r.model for r in reqs}
    return build_groups(
        reqs,
        out,
        avg_batch=dict.fromkeys(models, batch),
        instances_per_model=dict.fromkeys(models, insts),
        config=GroupingConfig(**cfg),  # type: ignore[arg-type]
    )


spec = st.tuples(
    st.sampled_from(["a", "b", "c"]),
    st.integers(1, 4000),
    st.integers(1, 2000),
    st.floats(1, 1000, allow_nan=False),
)


@settings(max_examples=40, deadline=None)
@given(specs=st.lists(spec, max_size=120), batch=st.integers(1, 16), delta=st.sampled_from([1, 4]))
def test_every_request_in_exactly_one_pure_capped_fcfs_group(specs, batch, delta) -> None:
    reqs = reqs_from(specs)
    g = group(reqs, batch=batch, delta=float(delta))
    members = np.concatenate([x.members for x in g.groups]) if g.groups else np.zeros(0, int)
    assert sorted(members.tolist()) == list(range(len(reqs)))
    for x in g.groups:
        assert {reqs[i].model for i in x.members} == {x.model}
        assert len(x.members) <= max(1, int(delta * batch))
        seqs = [reqs[i].seq for i in x.members]
        assert seqs == sorted(seqs)
        assert (g.labels[x.members] == x.gid).all()


def test_degenerate_inputs() -> None:
    assert group([]).groups == []
    one = group(reqs_from([("a", 5, 5, 10.0)]))
    assert len(one.groups) == 1 and one.groups[0].members.tolist() == [0]
    # one huge uniform group is split in halves down to the cap
    same = reqs_from([("a", 10, 10, 10.0)] * 1000)
    g = group(same, batch=8)
    assert all(len(x.members) <= 32 for x in g.groups) and len(g.groups) >= 1000 // 32
    # thousands of tiny requests with a batch of 1 stay bounded by max_groups_per_model
    tiny = reqs_from([("a", 1, 1, float(i % 7)) for i in range(5000)])
    g = group(tiny, batch=1, max_groups_per_model=64)
    assert len(g.groups) <= 128


def test_groups_spread_over_instances() -> None:
    """A model served by 4 instances gives at least 2 groups per instance when it can."""
    g = group(reqs_from([("a", 10, 10, 10.0)] * 400), batch=256, insts=4)
    assert len(g.groups) >= 8


def test_clustering_separates_slo_classes_and_is_deterministic() -> None:
    specs = [("a", 100, 100, 5.0)] * 30 + [("a", 100, 100, 500.0)] * 30
    a, b = group(reqs_from(specs), batch=64), group(reqs_from(specs), batch=64)
    assert [x.members.tolist() for x in a.groups] == [x.members.tolist() for x in b.groups]
    for x in a.groups:  # no group mixes the 5 s and the 500 s SLO
        assert len({specs[i][3] for i in x.members}) == 1


def test_incremental_join_picks_nearest_group_and_tracks_drift() -> None:
    specs = [("a", 100, 100, 5.0)] * 30 + [("a", 100, 100, 500.0)] * 30
    reqs = reqs_from(specs)
    g = group(reqs, batch=64)
    index = GroupIndex.from_grouping(g)
    tight = next(x.gid for x in g.groups if specs[x.members[0]][3] == 5.0)
    z = index.standardise(
        "a", request_features(np.array([6.0]), np.array([100]), np.array([100]))[0]
    )
    assert index.nearest("a", z) == tight
    assert index.nearest("unknown-model", z) is None
    assert index.drift() < 1.0
    far = index.standardise("a", request_features(np.array([1e6]), np.array([1]), np.array([1]))[0])
    for _ in range(10):
        index.nearest("a", far)
    assert index.drift() > 4.0


def test_bad_config_rejected() -> None:
    with pytest.raises(ValueError):
        GroupingConfig(delta=float("nan"))
    with pytest.raises(ValueError):
        GroupingConfig(max_clusters_per_model=0)


def test_one_openmp_thread_per_fit_groups_as_every_core_does() -> None:
    """k-means fits run on one OpenMP thread by default (``kmeans_threads``): the same groups
    as scikit-learn's default of every core, over one chunk of points and several."""
    rng = np.random.default_rng(3)
    for n in (40, 300, 2000):
        reqs = reqs_from(
            [
                ("a", int(p), int(o), float(d))
                for p, o, d in zip(
                    rng.integers(1, 4000, n),
                    rng.integers(1, 2000, n),
                    rng.uniform(1, 900, n),
                    strict=True,
                )
            ]
        )
        one, every = group(reqs, batch=4.0), group(reqs, batch=4.0, kmeans_threads=None)
        np.testing.assert_array_equal(one.labels, every.labels)
        assert len(one.groups) > 1


def test_kmeans_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="kmeans_threads"):
        GroupingConfig(kmeans_threads=0)
