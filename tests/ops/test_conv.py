"""causal_conv1d and its decode step against a brute-force loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from seqlab.ops.conv import causal_conv1d, causal_conv1d_step
from tests.conftest import assert_close


def _brute_force(x, weight, bias, initial_state):
    """y[t] = bias + sum_i weight[i] * xp[t + i] with xp = concat(initial_state, x)."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    width = weight.shape[0]
    xp = np.concatenate([np.asarray(initial_state, np.float64), x], axis=1)
    y = np.stack([(xp[:, t : t + width] * weight).sum(1) for t in range(x.shape[1])], axis=1)
    return y + (0.0 if bias is None else np.asarray(bias, np.float64))


def _inputs(dtype, batch=2, length=9, dim=5, width=4, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (batch, length, dim), dtype)
    weight = jax.random.normal(ks[1], (width, dim), dtype)
    bias = jax.random.normal(ks[2], (dim,), dtype)
    state = jax.random.normal(ks[3], (batch, width - 1, dim), dtype)
    return x, weight, bias, state


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_brute_force(dtype, with_bias, with_state):
    x, weight, bias, state = _inputs(dtype)
    bias = bias if with_bias else None
    state = state if with_state else jnp.zeros_like(state)
    y, final = causal_conv1d(x, weight, bias, initial_state=state, return_final_state=True)
    assert y.dtype == dtype
    assert_close(y, _brute_force(x, weight, bias, state), dtype)
    assert_close(final, x[:, -3:], dtype)


@given(
    length=st.integers(1, 12),
    width=st.integers(1, 5),
    dim=st.integers(1, 4),
)
def test_decode_steps_equal_full_forward(length, width, dim):
    x, weight, bias, state = _inputs(jnp.float64, length=length, dim=dim, width=width)
    y, final = causal_conv1d(x, weight, bias, initial_state=state, return_final_state=True)
    step = jax.jit(causal_conv1d_step)  # one compile per draw, not one per eager op
    carry, ys = state, []
    for t in range(length):
        y_t, carry = step(x[:, t], carry, weight, bias)
        ys.append(y_t)
    assert_close(jnp.stack(ys, axis=1), y)
    assert_close(carry, final)


def test_short_sequence_final_state_keeps_initial_inputs():
    """With T < W - 1 the final state still holds the last W - 1 inputs, some from the state."""
    x, weight, _, state = _inputs(jnp.float64, length=2, width=5)
    _, final = causal_conv1d(x, weight, initial_state=state, return_final_state=True)
    assert_close(final, jnp.concatenate([state[:, 2:], x], axis=1))


def test_causal():
    x, weight, bias, _ = _inputs(jnp.float64, length=8)
    jac = jax.jacrev(lambda x: causal_conv1d(x, weight, bias))(x)  # [B, T, D, B, T, D]
    t_out, t_in = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    future = np.asarray(jnp.abs(jac).sum(axis=(0, 2, 3, 5)))[t_in > t_out]
    assert np.all(future == 0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(x=jnp.zeros((2, 3))), "x must have rank 3"),
        (dict(x=jnp.zeros((2, 3, 5), jnp.int32)), "x must be a floating-point"),
        (dict(weight=jnp.zeros((4, 6))), "weight must have shape"),
        (dict(bias=jnp.zeros((6,))), "bias must have shape"),
        (dict(initial_state=jnp.zeros((2, 2, 5))), "initial_state must have shape"),
    ],
)
def test_bad_input(kwargs, match):
    args = dict(x=jnp.zeros((2, 3, 5)), weight=jnp.zeros((4, 5)), bias=None, initial_state=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        causal_conv1d(args["x"], args["weight"], args["bias"], initial_state=args["initial_state"])
