"""Transitions of a Mamba layer: the discretization by hand, ranges, polarized channels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.analysis.transitions import transition_range, transitions
from seqlab.modules.mamba import Mamba
from tests.conftest import assert_close


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_transitions_of_a_polarized_mamba(dtype):
    model = Mamba(d_model=4, d_state=3, polarize=(1, 1), dtype=dtype, param_dtype=dtype)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 7, 4)), dtype)
    params = jax.jit(model.init)(jax.random.key(0), x)
    inputs = jax.jit(lambda p, x: model.apply(p, x, method="op_inputs"))(params, x)
    got = transitions(inputs)
    assert got.shape == (2, 7, 8, 5) and got.dtype == dtype
    dt = np.logaddexp(
        0.0, np.asarray(inputs["delta"], np.float64) + np.asarray(inputs["delta_bias"])
    )
    want = np.exp(dt[..., None] * np.asarray(inputs["A"], np.float64))
    assert_close(got, want.astype(dtype))
    lo, hi = transition_range(inputs)
    assert_close(lo, want.min((0, 1)).astype(dtype))
    assert_close(hi, want.max((0, 1)).astype(dtype))
    np.testing.assert_array_equal(np.asarray(lo[:, 0]), 1.0)  # the 1-channel never decays
    assert np.all(np.asarray(hi[:, 1:]) < 1.0)


def test_without_softplus_or_bias():
    A = jnp.asarray([[-1.0, -2.0]])
    delta = jnp.asarray([[[0.5], [1.0]]])
    got = transitions(dict(delta=delta, A=A))
    assert_close(got, jnp.exp(delta[..., None] * A))
    with pytest.raises(ValueError, match=r"delta must have rank 3"):
        transitions(dict(delta=delta[0], A=A))
