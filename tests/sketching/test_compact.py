"""Compact images of sparse vectors (`seqlab.sketching.compact`): equal to the dense maps, merge
against a brute force, the sparse JL transform's structure and its exact l_2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.sketching import birthday_embedding, max_embedding, sparse_vectors, to_dense
from seqlab.sketching.compact import (
    SMALL_MERGE,
    compact_image,
    compact_max_image,
    merge_slots,
    sparse_jl,
)


def _sparse(seed, n, d, s, signed=True):
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice(d, s, replace=False) for _ in range(n)])
    vals = rng.uniform(1, 2, (n, s)) * (rng.choice([-1.0, 1.0], (n, s)) if signed else 1)
    return sparse_vectors(jnp.asarray(idx), jnp.asarray(vals), d)


@pytest.mark.parametrize("k", [5, SMALL_MERGE + 8])  # the equality table and the sort
@pytest.mark.parametrize("combine", ["sum", "max"])
def test_merge_slots_against_brute_force(k, combine):
    rng = np.random.default_rng(k)
    idx = rng.integers(0, 6, (3, 4, k))  # many repeats
    val = rng.normal(size=(3, 4, k))
    out_idx, out_val = merge_slots(jnp.asarray(idx), jnp.asarray(val), combine)
    for r in np.ndindex(3, 4):
        want = {}
        for i, v in zip(idx[r], val[r], strict=True):
            want[i] = want.get(i, 0.0) + v if combine == "sum" else max(want.get(i, -np.inf), v)
        live = np.asarray(out_val[r]) != 0
        live_idx = np.asarray(out_idx[r])[live].tolist()
        got = dict(zip(live_idx, np.asarray(out_val[r])[live], strict=True))
        assert sorted(got) == sorted(i for i, v in want.items() if v != 0)
        for i, v in got.items():
            np.testing.assert_allclose(v, want[i], rtol=1e-12)


def test_merge_slots_validates():
    with pytest.raises(ValueError, match="same shape"):
        merge_slots(jnp.zeros((2, 3), int), jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="combine must be one of"):
        merge_slots(jnp.zeros(3, int), jnp.zeros(3), "min")


def test_compact_image_equals_the_birthday_map():
    x = _sparse(0, 40, 500, 6)
    emb = birthday_embedding(jax.random.key(0), 500, 17)
    np.testing.assert_allclose(to_dense(compact_image(emb, x)), emb.apply(x), rtol=1e-12)


@pytest.mark.slow  # also checked (non-negative data) by tests/theory/test_sparse_embeddings.py
def test_compact_max_image_equals_the_max_map():
    x = _sparse(0, 40, 500, 6)
    mm = max_embedding(jax.random.key(1), 500, 7, 5)
    img = compact_max_image(mm, x)  # signed values: the {0} of every bucket matters
    assert img.batch_shape == (40, 5) and img.dim == 7
    np.testing.assert_array_equal(to_dense(img).reshape(40, -1), mm.apply(x))


def test_compact_images_reject_dense_inputs():
    emb = birthday_embedding(jax.random.key(0), 10, 4)
    with pytest.raises(ValueError, match="x must be SparseVectors"):
        compact_image(emb, jnp.ones((2, 10)))
    with pytest.raises(ValueError, match="dimension 10"):
        compact_max_image(max_embedding(jax.random.key(0), 10, 4, 2), _sparse(0, 2, 11, 3))


def test_sparse_jl_columns_and_exact_l2():
    d, m, k = 500, 192, 3
    jl = sparse_jl(jax.random.key(3), d, m, k)
    assert (jl.k, jl.m, jl.block) == (k, m, 64)
    eye = sparse_vectors(jnp.arange(240).reshape(40, 6), jnp.ones((40, 6)), d)
    # slots are block-major, [40, k * 6]: column i of A has the k slots of coordinate i
    idx, val = (
        np.asarray(v).reshape(40, k, 6).transpose(0, 2, 1).reshape(240, k) for v in jl.slots(eye)
    )
    cols = np.zeros((240, m))
    np.put_along_axis(cols, idx, val, 1)
    assert np.all(np.count_nonzero(cols, axis=1) == k)
    np.testing.assert_allclose(np.abs(cols[cols != 0]), k**-0.5, rtol=1e-6)
    blocks = np.nonzero(cols)[1].reshape(240, k) // jl.block
    np.testing.assert_array_equal(blocks, np.tile(np.arange(k), (240, 1)))  # one per block
    x = _sparse(1, 40, 240, 6)  # inside the tabulated columns; the shape of the other tests
    x = sparse_vectors(x.indices, x.values, d)
    y = jl.image(x)
    dense = np.zeros((40, 240))
    np.put_along_axis(dense, np.asarray(x.indices), np.asarray(x.values), 1)
    np.testing.assert_allclose(to_dense(y), dense @ cols, atol=1e-12)  # linear: A x
    idx = np.asarray(jl.slots(x)[0])
    distinct = np.array([len(set(r)) == len(r) for r in idx])
    norm = np.linalg.norm(np.asarray(y.values), axis=1)
    np.testing.assert_allclose(norm[distinct], np.linalg.norm(dense, axis=1)[distinct], rtol=1e-12)
    assert 0 < distinct.sum() < 40


def test_sparse_jl_validates():
    with pytest.raises(ValueError, match="multiple of k"):
        sparse_jl(jax.random.key(0), 10, 7, 2)
    with pytest.raises(ValueError, match="k must be a positive int"):
        sparse_jl(jax.random.key(0), 10, 8, 0)
