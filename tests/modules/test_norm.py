"""Tests of seqlab.modules.norm.RMSNorm: the plain scale and the zero-centred one (`1 + weight`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.norm import RMSNorm
from seqlab.ops.norm import gated_rms_norm, rms_norm
from tests.conftest import assert_close

D = 8


def _normal(seed, shape, dtype=jnp.float64):
    # numpy draws: jax.random would compile a sampler for every new shape
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_init(zero_centered):
    norm = RMSNorm(zero_centered=zero_centered)
    x = _normal(0, (2, 3, D), jnp.float32)
    params = norm.init(jax.random.key(0), x)
    weight = params["params"]["weight"]
    assert weight.shape == (D,) and weight.dtype == jnp.float32
    np.testing.assert_array_equal(weight, 0.0 if zero_centered else 1.0)
    # At init both variants scale by 1: the plain rms_norm.
    assert_close(norm.apply(params, x), rms_norm(x, jnp.ones(D, jnp.float32)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
def test_zero_centered_scales_by_one_plus_weight(dtype):
    """`RMSNorm(zero_centered=True)` with weight `w` is `rms_norm(x, 1 + w)`, and matches the
    formula `x / sqrt(mean(x^2) + eps) * (1 + w)` (Qwen3NextRMSNorm)."""
    param_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
    norm = RMSNorm(eps=1e-5, zero_centered=True, param_dtype=param_dtype)
    x = _normal(1, (2, 3, D), dtype)
    w = 0.3 * _normal(2, (D,), param_dtype)
    y = norm.apply({"params": {"weight": w}}, x)
    assert y.dtype == dtype
    acc = jnp.promote_types(dtype, jnp.float32)
    assert_close(y, rms_norm(x, 1 + w.astype(acc), eps=1e-5), dtype)
    xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
    expected = xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-5) * (1 + wf)
    assert_close(y, expected, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
def test_zero_centered_gated(dtype):
    """With a gate: `gated_rms_norm(x, gate, 1 + w)` = `rms_norm(x, 1 + w) * silu(gate)`."""
    param_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
    norm = RMSNorm(zero_centered=True, param_dtype=param_dtype)
    x, gate = _normal(3, (2, 2, 3, D), dtype)
    w = 0.3 * _normal(4, (D,), param_dtype)
    y = norm.apply({"params": {"weight": w}}, x, gate)
    assert y.dtype == dtype
    acc = jnp.promote_types(dtype, jnp.float32)
    assert_close(y, gated_rms_norm(x, gate, 1 + w.astype(acc)), dtype)
    xf, wf, gf = (np.asarray(a, np.float64) for a in (x, w, gate))
    expected = xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-6) * (1 + wf)
    assert_close(y, expected * gf / (1 + np.exp(-gf)), dtype)


def test_zero_centered_scale_formed_in_float32():
    """A bfloat16 weight: `1 + w` is formed in float32, so a small `w` (here 1e-3, below half the
    bfloat16 spacing at 1) still moves the scale off 1."""
    norm = RMSNorm(zero_centered=True, param_dtype=jnp.bfloat16)
    x = _normal(5, (4, D), jnp.float32)
    w = jnp.full((D,), 1e-3, jnp.bfloat16)
    y = norm.apply({"params": {"weight": w}}, x)
    assert y.dtype == jnp.float32
    assert_close(y, rms_norm(x, 1 + w.astype(jnp.float32)))
    assert not np.allclose(y, rms_norm(x, jnp.ones(D, jnp.float32)), rtol=1e-4, atol=0)


def test_plain_scale_unchanged():
    """The default (`zero_centered=False`) scales by the weight itself."""
    x = _normal(6, (2, 3, D))
    w = _normal(7, (D,))
    assert_close(RMSNorm().apply({"params": {"weight": w}}, x), rms_norm(x, w))
    gate = _normal(8, (2, 3, D))
    assert_close(RMSNorm().apply({"params": {"weight": w}}, x, gate), gated_rms_norm(x, gate, w))
