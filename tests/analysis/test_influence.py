"""Jacobian influence: exact on linear maps, causal structure, finite differences, batching."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.analysis.influence import jacobian_influence, module_influence, token_influence
from seqlab.modules.lm import preset
from seqlab.modules.mamba import Mamba
from seqlab.ops.conv import causal_conv1d
from tests.conftest import assert_close


def _normal(seed, shape, dtype):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _attention(x, w):
    """A non-causal nonlinear mixer: softmax attention on tanh features. `[T, D] -> [T, E]`."""
    h = jnp.tanh(x @ w)  # [T, E]
    scores = h @ h.T / jnp.sqrt(h.shape[-1])
    return jax.nn.softmax(scores, axis=-1) @ h


@pytest.mark.parametrize(("T", "D", "E"), [(1, 1, 1), (5, 2, 3)])
def test_linear_map_influence_is_the_block_norm(T, D, E):
    # y_t = sum_s K[t, s] x_s with blocks K[t, s]: [E, D], so dy_t/dx_s = K[t, s] exactly.
    K = _normal(T, (T, T, E, D), jnp.float64)
    x = _normal(T + 1, (T, D), jnp.float64)
    got = jax.jit(lambda K, x: jacobian_influence(partial(jnp.einsum, "tsed,sd->te", K), x))(K, x)
    assert got.shape == (T, T)
    assert_close(got, jnp.sqrt(jnp.sum(K**2, axis=(2, 3))))


def test_causal_map_is_lower_triangular():
    T, D, W = 9, 3, 3
    weight, x = _normal(0, (W, D), jnp.float32), _normal(1, (T, D), jnp.float32)

    def causal(x):  # conv (window W) then a running sum: token t sees tokens <= t only
        return jnp.cumsum(jnp.tanh(causal_conv1d(x[None], weight)[0]), axis=0)

    def anti(x):  # the same map in reverse time looks ahead
        return causal(x[::-1])[::-1]

    infl, anti_infl = jax.jit(
        lambda x: (jacobian_influence(causal, x), jacobian_influence(anti, x))
    )(x)
    above, below = np.triu_indices(T, k=1), np.tril_indices(T)
    assert np.all(np.asarray(infl)[above] == 0.0)
    assert np.all(np.asarray(infl)[below] > 0.0)  # every past token reaches every later output
    assert np.all(np.asarray(anti_infl)[above] > 0.0)  # the check sees a non-causal map


def test_matches_central_finite_differences():
    T, D, E = 5, 3, 4
    w, x = _normal(2, (D, E), jnp.float64), _normal(3, (T, D), jnp.float64)
    fn = partial(_attention, w=w)

    eps = 1e-5
    basis = jnp.eye(T * D, dtype=jnp.float64).reshape(T * D, T, D)
    central = jax.jit(jax.vmap(lambda e: (fn(x + eps * e) - fn(x - eps * e)) / (2 * eps)))
    jac = central(basis).reshape(T, D, T, E)  # [s, d, t, e]
    expected = jnp.sqrt(jnp.sum(jac**2, axis=(1, 3))).T  # [t, s]
    got, per_feature = jax.jit(lambda x: (jacobian_influence(fn, x), token_influence(fn, x)))(x)
    # Central differences carry O(eps^2) truncation and O(1e-16 / eps) rounding error.
    np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-9)
    # The per-feature view [T, E, T] aggregates to the matrix.
    assert per_feature.shape == (T, E, T)
    assert_close(jnp.sqrt(jnp.sum(per_feature**2, axis=1)), got)


def test_token_influence_on_a_final_quantity():
    T, D = 6, 2
    x = _normal(4, (T, D), jnp.float32)
    powers = jnp.asarray([0.5, 1.0], jnp.float32)[:, None] ** jnp.arange(T - 1, -1, -1)  # [2, T]

    def final_state(x):  # h_T[k] = sum_s decay[k]^(T-1-s) x_s[0]: a 2-channel leaky sum
        return powers @ x[:, 0]

    got = jax.jit(partial(token_influence, final_state))(x)
    assert got.shape == (2, T)
    assert_close(got, powers)


def test_batches_with_vmap():
    B, T, D = 3, 4, 2
    w, xs = _normal(5, (D, D), jnp.float32), _normal(6, (B, T, D), jnp.float32)
    one = partial(jacobian_influence, partial(_attention, w=w))
    batched = jax.jit(jax.vmap(one))(xs)
    assert batched.shape == (B, T, T)
    assert batched.dtype == jnp.float32
    assert_close(batched, jax.jit(lambda xs: jnp.stack([one(x) for x in xs]))(xs))


def test_bad_inputs_name_the_argument():
    fn = lambda x: x  # noqa: E731
    with pytest.raises(ValueError, match=r"x must have rank 2 with layout \[T, D\]"):
        jacobian_influence(fn, jnp.zeros((1, 4, 2), jnp.float32))
    with pytest.raises(ValueError, match="x must be a floating-point array"):
        token_influence(fn, jnp.zeros((4, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"fn must map x \[T, D\]"):
        jacobian_influence(lambda x: x.sum(0), jnp.zeros((4, 2), jnp.float32))


def _influence(module, params, x, method=None):
    return np.asarray(
        jax.jit(lambda p, x: module_influence(module, p, x, method=method))(params, x)
    )


def test_module_influence_on_mixers():
    T, D = 5, 2
    x = _normal(7, (T, D), jnp.float32)
    above = np.triu_indices(T, k=1)
    causal = Mamba(d_model=D, d_state=2)
    infl = _influence(causal, jax.jit(causal.init)(jax.random.key(0), x[None]), x)
    assert infl.shape == (T, T) and np.all(infl[above] == 0.0) and np.all(np.diag(infl) > 0)
    # The reordering mixer looks at the whole sequence: the same measurement shows it.
    mixer = Mamba(d_model=D, d_state=2, reorder=True, reorder_tau=1.0)
    infl = _influence(mixer, jax.jit(mixer.init)(jax.random.key(0), x[None]), x)
    assert np.any(infl[above] > 0.0)


def test_module_influence_on_a_language_model():
    T = 5
    above = np.triu_indices(T, k=1)
    model = preset("tiny-mamba")
    lm_params = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, T), jnp.int32))
    h = _normal(8, (T, model.d_model), jnp.float32)
    infl = _influence(model, lm_params, h, method="logits_from_embeddings")
    assert infl.shape == (T, T) and np.all(infl[above] == 0.0)
