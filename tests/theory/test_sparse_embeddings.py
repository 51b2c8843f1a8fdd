"""The properties behind the sparse-embedding claims, at small sizes; each can fail. Negative
controls: the same measures on systems where a statement is false give the other answer (the max
map on signed data never reaches 1 - eps; compressed sensing with m = 2s is not exact; the
compressed-sensing dimension does not grow like s^2)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqlab.sketching import (
    SparseVectors,
    birthday_embedding,
    collision_bound,
    linf_dimension,
    max_embedding,
    max_embedding_dimension,
    to_dense,
)
from seqlab.sketching.compact import compact_max_image
from theory.sparse_embeddings import measures

SEEDS = st.integers(0, 2**31 - 1)
D = 10**5  # every max-map test reduces: its dimension m T is far below D
S, N, EPS = 2, 16, 0.5


def _dense(x):
    out = np.zeros((x.batch_shape[0], x.dim))
    np.put_along_axis(out, np.asarray(x.indices), np.asarray(x.values, np.float64), axis=1)
    return out


def test_slot_norms_merge_equal_indices():
    idx = np.array([[3, 1, 3, 0], [2, 2, 2, 5]])
    val = np.array([[1.0, -2.0, 4.0, 0.0], [1.0, 1.0, -3.0, 2.0]])
    got = measures.slot_norms(idx, val)
    want = [[5.0, -2.0], [-1.0, 2.0]]  # the merged non-zeros of each row
    for k, p in enumerate(measures.PS):
        np.testing.assert_allclose(got[k], [np.linalg.norm(w, ord=p) for w in want])


def test_true_and_repetition_distances_match_dense():
    rng = np.random.default_rng(0)
    x = measures.near_duplicates(rng, 16, 300, 3)  # shared coordinates: paired slots
    dense = _dense(x)
    i, j = measures.pair_indices(16)
    assert np.all(i < j) and len(i) == measures.pair_count(16)
    assert set(zip(i[:6], j[:6], strict=True)) == {(a, b) for b in range(4) for a in range(b)}
    true = measures.true_distances(x)
    for k, p in enumerate(measures.PS):
        np.testing.assert_allclose(
            true[k], np.linalg.norm(dense[i] - dense[j], p, axis=1), rtol=1e-6
        )
    emb = max_embedding(jax.random.key(0), 300, 5, 4)
    f = np.asarray(emb.apply(x), np.float64).reshape(16, 4, 5)
    rep = measures.rep_distances(compact_max_image(emb, x), rows=50)  # several chunks
    diff = np.abs(f[i] - f[j])
    np.testing.assert_allclose(rep[0], diff.sum(-1), rtol=1e-6)
    np.testing.assert_allclose(rep[-1], diff.max(-1), rtol=1e-6)
    last = measures.running_ratios(rep, true)[..., -1]
    want = np.asarray(emb.distance(emb.apply(x)[i], emb.apply(x)[j], 3.0)) / true[2]
    np.testing.assert_allclose(last[2], want, rtol=1e-5)


def test_prefix_of_a_max_map_is_the_map_with_fewer_repetitions():
    """The scans read the first t repetitions as the max map with t repetitions."""
    x = measures.random_sparse(np.random.default_rng(1), 6, 300, 3, signed=False)
    emb = max_embedding(jax.random.key(1), 300, 7, 5)
    short = emb.replace(repetitions=2)
    full, prefix = compact_max_image(emb, x), compact_max_image(short, x)
    np.testing.assert_array_equal(to_dense(full)[:, :2], to_dense(prefix))


def test_first_good_and_needed_dimension():
    assert measures.first_good(np.array([True, False, True, False, False])) == 4
    assert measures.first_good(np.zeros(4, bool)) == 1
    assert measures.first_good(np.array([False, True])) == 3  # not reached
    ms = np.geomspace(100, 1000, 7)
    assert measures.needed_dimension(ms, 1 - 3 / ms) == pytest.approx(300)
    assert math.isnan(measures.needed_dimension(ms, np.ones(7)))  # never fails: no crossing
    assert measures.loglog_slope([1, 2, 4], [3, 12, 48]) == pytest.approx(2)


def test_near_duplicates_differ_on_two_coordinates():
    x = measures.near_duplicates(np.random.default_rng(2), 16, 1000, 4)
    dense = _dense(x)
    assert np.all(np.count_nonzero(dense, axis=1) == 4) and np.all(dense >= 0)
    same_group = np.count_nonzero(dense[0] != dense[1])
    other_group = np.count_nonzero(dense[0] != dense[8])
    assert (same_group, other_group) == (2, 8)


@given(seed=SEEDS, m=st.sampled_from([3, 10, 40]))
@settings(max_examples=4)
def test_exact_fraction_is_at_least_the_collision_bound(seed, m):
    s, n = 4, 600
    x = measures.random_sparse(np.random.default_rng(seed), n, 10**6, s, signed=True)
    frac = measures.birthday_fraction(jax.random.key(seed), x, m)
    bound = 1 - collision_bound(s, m)
    assert frac >= bound - 3 * math.sqrt(max(bound * (1 - bound), 1 / n) / n)
    assert frac == pytest.approx(measures.birthday_probability(s, m), abs=4 / math.sqrt(n))


@given(seed=SEEDS)
@settings(max_examples=2)
def test_all_p_exactness_is_injectivity(seed):
    x = measures.random_sparse(np.random.default_rng(seed), 300, 10**6, 5, signed=True)
    emb = birthday_embedding(jax.random.key(seed), 10**6, 25)
    exact = measures.exact_norms(*measures.birthday_slots(emb, x), x)
    inj = np.asarray(emb.injective_on(x))
    np.testing.assert_array_equal(np.all(exact, axis=0), inj)
    assert 0 < inj.sum() < len(inj)


@given(seed=SEEDS)
@settings(max_examples=2)
def test_max_map_reaches_the_window_within_the_stated_repetitions(seed):
    x = measures.near_duplicates(np.random.default_rng(seed), N, D, S)
    rows = measures.max_map_sweep(jax.random.key(seed), x, (8, N), EPS, S)
    for row in rows:
        assert max(row["needed"]) <= row["stated"]
        assert row["max_ratio"] <= 1 + measures.EXPAND_RTOL
        assert row["m"] * row["stated"] < D / 4


def test_max_map_on_signed_data_never_reaches_the_window():
    """Negative control: the same scan on signed vectors (the max map drops negative values)."""
    x = measures.random_sparse(np.random.default_rng(3), N, D, S, signed=True)
    x = SparseVectors(x.indices, -jnp.abs(x.values), D)  # f(x) = 0 for every vector
    rows = measures.max_map_sweep(jax.random.key(3), x, (N,), EPS, S)
    assert all(v == rows[0]["stated"] + 1 for v in rows[0]["needed"][:3])


@given(seed=SEEDS)
@settings(max_examples=2)
def test_linf_is_exact_within_the_stated_repetitions(seed):
    x = measures.random_sparse(np.random.default_rng(seed), 64, D, S, signed=False)
    needed = measures.linf_sweep(jax.random.key(seed), x, (16, 64), S)
    assert needed[0] <= needed[1] <= linf_dimension(S, 64)[1]  # nested sets: monotone


@given(seed=SEEDS)
@settings(max_examples=2)
def test_separations(seed):
    m, reps = max_embedding_dimension(S, N, EPS)
    emb = max_embedding(jax.random.key(seed), D, m, reps)
    signed = measures.random_sparse(np.random.default_rng(seed), N, D, S, signed=True)
    nonneg = SparseVectors(signed.indices, jnp.abs(signed.values), D)
    inside = measures.final_ratios(compact_max_image(emb, nonneg), nonneg)
    assert inside.min() >= 1 - EPS and inside.max() <= 1 + measures.EXPAND_RTOL
    linear = measures.final_ratios(measures.sum_map_images(jax.random.key(7), emb, nonneg), nonneg)
    assert linear.max() > 1 + EPS or linear.min() < 1 - EPS
    if np.any(np.asarray(signed.values) < 0):
        assert measures.final_ratios(compact_max_image(emb, signed), signed).min() < 1 - EPS


@pytest.mark.slow
def test_sum_map_images_are_linear():
    x = measures.random_sparse(np.random.default_rng(4), 5, 300, 3, signed=False)
    emb = max_embedding(jax.random.key(4), 300, 6, 3)
    img = measures.sum_map_images(jax.random.key(5), emb, x)
    twice = measures.sum_map_images(
        jax.random.key(5), emb, SparseVectors(x.indices, 2 * x.values, 300)
    )
    np.testing.assert_allclose(to_dense(twice), 2 * to_dense(img), rtol=1e-6)


def test_compressed_sensing_is_exact_above_and_not_below_its_dimension():
    d, s, n = 400, 4, 40
    x = measures.random_sparse(np.random.default_rng(5), n, d, s, signed=True)
    good = measures.compressed_sensing_fraction(
        jax.random.key(5), x, math.ceil(4 * s * math.log(d / s))
    )
    assert good["fraction"] == 1.0 and good["max_rel_error"] < 1e-5
    bad = measures.compressed_sensing_fraction(jax.random.key(5), x, 2 * s)  # negative control
    assert bad["fraction"] < 0.5


def test_linear_maps_need_a_dimension_growing_like_s_squared():
    sparsities, n = (4, 8, 16), 2000
    rng = np.random.default_rng(6)
    data = {s: measures.random_sparse(rng, n, 10**6, s, signed=True) for s in sparsities}
    _, k, make = measures.linear_maps(jax.random.key(6), 10**6)[1]  # sparse JL, k = 2
    needed = measures.m99_curve(make, k, data, (-0.5, 0, 0.5))
    slope = measures.loglog_slope(sparsities, needed)
    assert 1.75 <= slope <= 2.5  # s(s-1) over s = 4..16 has slope 2.16
    cs = [4 * s * math.log(10**6 / s) for s in sparsities]  # negative control
    assert not 1.75 <= measures.loglog_slope(sparsities, cs) <= 2.25
