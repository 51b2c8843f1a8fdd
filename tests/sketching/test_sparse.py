"""SparseVectors conversions and the stateless hashes: determinism, position independence,
uniformity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from seqlab.sketching import sparse
from seqlab.sketching.sparse import from_dense, sparse_vectors, to_dense


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_from_dense_round_trip(dtype):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 4, 50)) * (rng.random((3, 4, 50)) < 0.1)
    x[0, 0] = 0.0  # an all-zero vector is all padding
    x = jnp.asarray(x, dtype)
    sv = from_dense(x, 12)
    assert sv.indices.shape == (3, 4, 12) and sv.indices.dtype == jnp.int32
    assert np.all(np.asarray(sv.indices)[np.asarray(sv.values) == 0] == 0)  # padding convention
    np.testing.assert_array_equal(to_dense(sv), x)


def test_sparse_vectors_validates():
    with pytest.raises(ValueError, match="indices must lie"):
        sparse_vectors(jnp.array([0, 7]), jnp.array([1.0, 2.0]), 7)
    with pytest.raises(ValueError, match="same shape"):
        sparse_vectors(jnp.array([0, 1]), jnp.array([1.0]), 7)
    with pytest.raises(ValueError, match="values must be a floating"):
        sparse_vectors(jnp.array([0]), jnp.array([1]), 7)
    with pytest.raises(ValueError, match="indices must be an integer"):
        sparse_vectors(jnp.array([0.0]), jnp.array([1.0]), 7)
    with pytest.raises(ValueError, match="dim must be a positive int"):
        sparse_vectors(jnp.array([0]), jnp.array([1.0]), 0)


def test_hashed_uniforms_depend_only_on_seed_and_id():
    key = sparse.base_key(3, sparse.SAMPLING)
    ids = jnp.array([5, 17, 2**30, 0, 123456])
    u = sparse.hashed_uniforms(key, ids, jnp.float64)
    assert np.all((u > 0) & (u <= 1))
    perm = jnp.array([3, 0, 4, 1, 2])
    np.testing.assert_array_equal(sparse.hashed_uniforms(key, ids[perm], jnp.float64), u[perm])
    np.testing.assert_array_equal(sparse.hashed_uniforms(key, ids[:2], jnp.float64), u[:2])
    other = sparse.hashed_uniforms(sparse.base_key(4, sparse.SAMPLING), ids, jnp.float64)
    assert not np.any(np.asarray(other) == np.asarray(u))


def test_hashed_uniforms_are_uniform():
    u = sparse.hashed_uniforms(jax.random.key(0), jnp.arange(20000), jnp.float64)
    assert stats.kstest(np.asarray(u), "uniform").pvalue > 1e-3


def test_hashed_buckets_are_uniform_and_signs_balanced():
    m = 16
    bucket, sign = sparse.hashed_buckets(jax.random.key(1), jnp.arange(32000), m)
    assert bucket.min() >= 0 and bucket.max() < m
    counts = np.bincount(np.asarray(bucket), minlength=m)
    assert stats.chisquare(counts).pvalue > 1e-3
    assert set(np.unique(np.asarray(sign))) == {-1, 1}
    assert abs(float(jnp.mean(sign))) < 4 / np.sqrt(32000)


def test_hashed_normals_are_standard_normal():
    g = sparse.hashed_normals(jax.random.key(2), jnp.arange(4000), 3, jnp.float64)
    assert g.shape == (4000, 3)
    assert stats.kstest(np.asarray(g).ravel(), "norm").pvalue > 1e-3


def test_hashed_uniforms_of_different_seeds_and_neighbouring_ids_are_uncorrelated():
    """The sampling uniforms come from a keyed integer mixer (`sparse.mix_bits`): seeds must give
    unrelated draws (independent sketches) and consecutive ids (row-index keys) too."""
    ids = jnp.arange(40000)
    u = [np.asarray(sparse.hashed_uniforms(sparse.base_key(s, sparse.SAMPLING), ids, jnp.float64))
         for s in (0, 1)]  # fmt: skip
    bound = 4 / np.sqrt(ids.size)  # 4 standard errors of a correlation coefficient
    assert abs(np.corrcoef(u[0], u[1])[0, 1]) < bound
    assert abs(np.corrcoef(u[0][:-1], u[0][1:])[0, 1]) < bound
    # float32 and float64 draws of one id share their leading bits.
    u32 = np.asarray(sparse.hashed_uniforms(sparse.base_key(0, sparse.SAMPLING), ids, jnp.float32))
    np.testing.assert_allclose(u32, u[0], atol=2**-23)
    assert np.all(u32 > 0) and np.all(u32 <= 1)
