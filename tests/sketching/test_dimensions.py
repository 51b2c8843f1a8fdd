"""The target dimensions: their formulas, and their guarantees measured at those dimensions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.sketching import (
    birthday_dimension,
    birthday_embedding,
    collision_bound,
    estimate_product,
    linf_dimension,
    lp_distance,
    max_embedding,
    max_embedding_dimension,
    priority_sketch,
    product_sketch_rows,
    sparse_vectors,
    threshold_sketch,
)

PS = (1.0, 2.0, 3.0, math.inf)


def _nonneg_sparse(rng, n, d, s):
    idx = np.stack([rng.choice(d, s, replace=False) for _ in range(n)])
    return sparse_vectors(jnp.asarray(idx), jnp.asarray(rng.uniform(0.5, 2, (n, s))), d)


def _pairwise_ratios(emb, x):
    """`[P, n, n]`: estimated over true `l_p` distance for each p in PS (diagonal is nan)."""
    dense = np.zeros((x.batch_shape[0], x.dim))
    np.put_along_axis(dense, np.asarray(x.indices), np.asarray(x.values), axis=1)
    f = emb.apply(x)
    ratios = []
    for p in PS:
        est = np.asarray(emb.distance(f[:, None], f[None, :], p))
        true = np.asarray(lp_distance(jnp.asarray(dense)[:, None], jnp.asarray(dense)[None], p))
        with np.errstate(invalid="ignore"):
            ratios.append(np.where(np.eye(len(dense), dtype=bool), np.nan, est / true))
    return np.stack(ratios)


def test_formulas():
    assert birthday_dimension(10, 0.01) == 4500  # s(s-1)/(2 failure)
    assert birthday_dimension(1) == 1
    assert collision_bound(10, 4500) == pytest.approx(0.01)
    m, reps = max_embedding_dimension(5, 100, 0.25, 0.01)
    assert m == 80 and reps == math.ceil(24 * math.log(100 * 99 * 5 / 0.01))
    assert linf_dimension(5, 100, 0.01) == (20, math.ceil(math.log2(9900 / 0.02)))
    assert product_sketch_rows(0.1, 0.1, "priority") == 2001
    assert product_sketch_rows(0.1, 0.1, "jl") == 2000


def test_formulas_validate():
    with pytest.raises(ValueError, match="failure must be a number in"):
        birthday_dimension(3, 1.5)
    with pytest.raises(ValueError, match="n_points must be >= 2"):
        max_embedding_dimension(3, 1, 0.1)
    with pytest.raises(ValueError, match="eps must be a number in"):
        max_embedding_dimension(3, 10, 0.0)
    with pytest.raises(ValueError, match="method must be one of"):
        product_sketch_rows(0.1, 0.1, "gaussian")


def test_birthday_dimension_keeps_the_promised_fraction():
    s, failure, n, d = 5, 0.05, 1500, 10**6
    rng = np.random.default_rng(0)
    idx = np.stack([rng.choice(d, s, replace=False) for _ in range(n)])
    x = sparse_vectors(jnp.asarray(idx), jnp.asarray(rng.uniform(1, 2, (n, s))), d)
    m = birthday_dimension(s, failure)
    frac = float(jnp.mean(birthday_embedding(jax.random.key(0), d, m).injective_on(x)))
    sigma = math.sqrt(failure * (1 - failure) / n)
    assert frac >= 1 - failure - 3 * sigma
    # Ten times fewer buckets break the promise: the measurement can fail.
    small = float(jnp.mean(birthday_embedding(jax.random.key(0), d, m // 10).injective_on(x)))
    assert small < 1 - failure - 3 * sigma


def test_max_embedding_dimension_holds_for_every_pair_and_p():
    s, n, eps, d = 3, 16, 0.5, 500
    x = _nonneg_sparse(np.random.default_rng(1), n, d, s)
    m, reps = max_embedding_dimension(s, n, eps)
    r = _pairwise_ratios(max_embedding(jax.random.key(1), d, m, reps), x)
    assert np.nanmax(r) <= 1 + 1e-12 and np.nanmin(r) >= 1 - eps
    # One repetition into s buckets is far too small: the lower end fails.
    r_small = _pairwise_ratios(max_embedding(jax.random.key(1), d, s, 1), x)
    assert np.nanmin(r_small) < 1 - eps


def test_linf_dimension_is_exact_for_every_pair():
    s, n, d = 3, 16, 500
    x = _nonneg_sparse(np.random.default_rng(2), n, d, s)
    m, reps = linf_dimension(s, n)
    r = _pairwise_ratios(max_embedding(jax.random.key(2), d, m, reps), x)[-1]
    np.testing.assert_allclose(r[~np.isnan(r)], 1.0, rtol=1e-12)


@pytest.mark.parametrize("sketch", [priority_sketch, threshold_sketch])
def test_product_sketch_rows_meet_eps_with_probability_one_minus_delta(sketch):
    eps, delta, trials = 0.5, 0.2, 100
    k = product_sketch_rows(eps, delta, sketch.__name__.split("_")[0])
    rng = np.random.default_rng(3)
    A = jnp.asarray(rng.standard_t(2, (300, 6)))  # heavy-tailed rows
    B = jnp.asarray(rng.standard_t(2, (300, 4)))

    def err(seed):
        W = estimate_product(sketch(A, k, seed), sketch(B, k, seed))
        return jnp.linalg.norm(W - A.T @ B)

    errors = np.asarray(jax.vmap(err)(jnp.arange(trials)))
    bound = eps * float(jnp.linalg.norm(A) * jnp.linalg.norm(B))
    assert np.mean(errors > bound) <= delta
