"""The properties behind the sparse-embedding claims, at small sizes, over hypothesis-drawn seeds;
each can fail (the tests of `tests/sketching/test_dimensions.py` show the same checks failing at
too small a dimension)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from seqlab.sketching import (
    SparseVectors,
    birthday_embedding,
    collision_bound,
    linf_dimension,
    max_embedding,
    max_embedding_dimension,
)
from theory.sparse_embeddings import measures

SEEDS = st.integers(0, 2**31 - 1)
S, N, EPS, D = 2, 8, 0.5, 300


def _data(seed, *, signed):
    return measures.random_sparse(np.random.default_rng(seed), N, D, S, signed=signed)


@given(seed=SEEDS, m=st.sampled_from([3, 10, 40]))
def test_exact_fraction_is_at_least_the_collision_bound(seed, m):
    s, n = 4, 600
    x = measures.random_sparse(np.random.default_rng(seed), n, 10**6, s, signed=True)
    emb = birthday_embedding(jax.random.key(seed), 10**6, m)
    frac = float(np.mean(np.all(measures.exact_norms(emb, x), axis=0)))
    bound = 1 - collision_bound(s, m)
    assert frac >= bound - 3 * math.sqrt(max(bound * (1 - bound), 1 / n) / n)
    assert frac == pytest.approx(measures.birthday_probability(s, m), abs=4 / math.sqrt(n))


@given(seed=SEEDS)
def test_all_p_exactness_is_injectivity(seed):
    x = measures.random_sparse(np.random.default_rng(seed), 300, 10**6, 5, signed=True)
    emb = birthday_embedding(jax.random.key(seed), 10**6, 25)
    exact = measures.exact_norms(emb, x)
    inj = np.asarray(emb.injective_on(x))
    np.testing.assert_array_equal(np.all(exact, axis=0), inj)
    assert 0 < inj.sum() < len(inj)


@given(seed=SEEDS)
def test_max_map_stays_in_the_window_at_the_stated_dimension(seed):
    m, reps = max_embedding_dimension(S, N, EPS)
    emb = max_embedding(jax.random.key(seed), D, m, reps)
    r = measures.pairwise_ratios(emb, _data(seed, signed=False))
    assert r.max() <= 1 + 1e-6 and r.min() >= 1 - EPS


@given(seed=SEEDS)
def test_linf_is_exact_at_the_stated_dimension(seed):
    m, reps = linf_dimension(S, N)
    emb = max_embedding(jax.random.key(seed), D, m, reps)
    r = measures.pairwise_ratios(emb, _data(seed, signed=False))[-1]
    np.testing.assert_allclose(r, 1.0, rtol=1e-6)


@given(seed=SEEDS)
def test_separations(seed):
    m, reps = max_embedding_dimension(S, N, EPS)
    emb = max_embedding(jax.random.key(seed), D, m, reps)
    signed = _data(seed, signed=True)
    nonneg = SparseVectors(signed.indices, jnp.abs(signed.values), D)
    linear = measures.sum_map_ratios(emb, nonneg)
    assert linear.max() > 1 + 1e-6 or linear.min() < 1 - EPS
    if np.any(np.asarray(signed.values) < 0):
        assert measures.pairwise_ratios(emb, signed).min() < 1 - EPS


def test_prefix_ratios_agree_with_the_map_of_each_prefix():
    x = _data(0, signed=False)
    emb = max_embedding(jax.random.key(0), D, 6, 5)
    prefix = measures.prefix_ratios(emb, x, [2, 5])
    np.testing.assert_allclose(prefix[1], measures.pairwise_ratios(emb, x), rtol=1e-5)
    two = measures.ratios_of_images(emb.replace(repetitions=2), _prefix_images(emb, x, 2), x)
    np.testing.assert_allclose(prefix[0], two, rtol=1e-5)


def _prefix_images(emb, x, t):
    return emb.apply(x).reshape(N, emb.repetitions, emb.m)[:, :t].reshape(N, -1)
