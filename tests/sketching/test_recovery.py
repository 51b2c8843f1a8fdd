"""Compressed sensing (`seqlab.sketching.recovery`): Gaussian measurements, OMP and basis pursuit
recover sparse vectors at m ~ 4 s ln(d/s) and fail well below it."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.sketching import sparse_vectors, to_dense
from seqlab.sketching.recovery import basis_pursuit, gaussian_measurements, measure, omp


def _sparse(seed, n, d, s, dtype=jnp.float64):
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice(d, s, replace=False) for _ in range(n)])
    vals = rng.uniform(1, 2, (n, s)) * rng.choice([-1.0, 1.0], (n, s))
    return sparse_vectors(jnp.asarray(idx), jnp.asarray(vals, dtype), d)


def test_gaussian_measurements_scale():
    a = gaussian_measurements(jax.random.key(0), 200, 300, jnp.float64)
    assert a.shape == (200, 300) and a.dtype == jnp.float64
    assert np.mean(np.asarray(a) ** 2) == pytest.approx(1 / 200, rel=0.02)


def test_measure_sparse_equals_dense():
    x = _sparse(0, 7, 50, 4)
    a = gaussian_measurements(jax.random.key(1), 12, 50, jnp.float64)
    np.testing.assert_allclose(measure(a, x), measure(a, to_dense(x)), rtol=1e-12)


D, S = 400, 5
M = math.ceil(4 * S * math.log(D / S))  # 88


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.float64])
def test_omp_and_basis_pursuit_recover_at_4_s_ln_d_over_s(dtype):
    n = 60
    x = _sparse(2, n, D, S, dtype)
    a = gaussian_measurements(jax.random.key(2), M, D, dtype)
    y = measure(a, x)
    z = omp(a, y.reshape(3, 20, M), S)  # any batch shape
    assert z.values.shape == (3, 20, S) and z.values.dtype == dtype
    got = to_dense(z).reshape(n, D)
    np.testing.assert_allclose(got, to_dense(x), atol=1e-4 if dtype == jnp.float32 else 1e-9)
    bp = basis_pursuit(a, y[:2])  # slow (a linear program per vector): two vectors
    assert bp.shape == (2, D) and bp.dtype == np.float64
    np.testing.assert_allclose(bp, to_dense(x)[:2], atol=1e-4 if dtype == jnp.float32 else 1e-7)


def test_omp_fails_with_too_few_measurements():
    x = _sparse(3, 60, D, S)
    a = gaussian_measurements(jax.random.key(3), 2 * S, D, jnp.float64)
    err = np.abs(to_dense(omp(a, measure(a, x), S)) - to_dense(x)).max(axis=1)
    assert np.mean(err > 1e-3) > 0.5


@pytest.mark.slow
def test_omp_under_jit():
    x = _sparse(4, 5, 100, 3)
    a = gaussian_measurements(jax.random.key(4), 40, 100, jnp.float64)
    y = measure(a, x)
    fast = jax.jit(lambda a, y: omp(a, y, 3).values)(a, y)
    np.testing.assert_allclose(fast, omp(a, y, 3).values, rtol=1e-12)


def test_recovery_validates():
    a = jnp.zeros((5, 9))
    with pytest.raises(ValueError, match="a must be a matrix"):
        omp(jnp.zeros(5), jnp.zeros(5), 1)
    with pytest.raises(ValueError, match="y must have shape"):
        omp(a, jnp.zeros((2, 4)), 1)
    with pytest.raises(ValueError, match="s must be <= min"):
        omp(a, jnp.zeros(5), 6)
    with pytest.raises(ValueError, match="y must be a floating"):
        basis_pursuit(a, jnp.zeros(5, int))
    with pytest.raises(ValueError, match="dimension 9"):
        measure(a, _sparse(0, 1, 10, 2))
    with pytest.raises(ValueError, match="m must be a positive int"):
        gaussian_measurements(jax.random.key(0), 0, 3)
