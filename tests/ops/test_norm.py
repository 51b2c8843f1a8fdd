"""rms_norm and gated_rms_norm against their formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.ops.norm import gated_rms_norm, l2_normalize, rms_norm
from tests.conftest import assert_close


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
def test_rms_norm_formula(dtype):
    x = jax.random.normal(jax.random.key(0), (3, 4, 8)).astype(dtype)
    w = jax.random.normal(jax.random.key(1), (8,)).astype(dtype)
    xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
    expected = xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-6) * wf
    y = rms_norm(x, w)
    assert y.dtype == dtype
    assert_close(y, expected, dtype)


def test_gated_rms_norm_is_norm_then_gate():
    x, gate = jax.random.normal(jax.random.key(0), (2, 2, 3, 8), jnp.float64)
    w = jnp.linspace(0.5, 1.5, 8, dtype=jnp.float64)
    assert_close(gated_rms_norm(x, gate, w), rms_norm(x, w) * jax.nn.silu(gate))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
def test_l2_normalize_formula(dtype):
    x = jax.random.normal(jax.random.key(2), (3, 5, 8)).astype(dtype)
    xf = np.asarray(x, np.float64)
    y = l2_normalize(x)
    assert y.dtype == dtype
    assert_close(y, xf / np.sqrt((xf**2).sum(-1, keepdims=True) + 1e-6), dtype)
    norms = np.linalg.norm(np.asarray(l2_normalize(x.astype(jnp.float64)), np.float64), axis=-1)
    np.testing.assert_allclose(norms, 1.0, rtol=1e-5)
    assert np.all(np.asarray(l2_normalize(jnp.zeros((2, 8), dtype))) == 0)  # eps keeps 0 finite


def test_bad_input():
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(jnp.zeros((2, 8)), jnp.ones(7))
    with pytest.raises(ValueError, match="gate must have shape"):
        gated_rms_norm(jnp.zeros((2, 8)), jnp.zeros((2, 7)), jnp.ones(8))
    with pytest.raises(ValueError, match="x must be a floating-point"):
        rms_norm(jnp.zeros((2, 8), jnp.int32), jnp.ones(8))
