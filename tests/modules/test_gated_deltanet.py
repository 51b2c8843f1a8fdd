"""GatedDeltaNet layer: reference semantics, decoding, causality, init, GVA, impls, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.gated_deltanet import GatedDeltaNet
from tests.conftest import assert_close
from tests.modules import mixers

D_MODEL, H, K, T, BATCH, CHUNK = 16, 2, 4, 7, 2, 4  # T not a multiple of CHUNK


def _model(**kw) -> GatedDeltaNet:
    kw = {"num_heads": H, "head_dim": K, "chunk_size": CHUNK, **kw}
    kw.setdefault("dtype", jnp.float64)
    kw.setdefault("param_dtype", kw["dtype"])
    return GatedDeltaNet(D_MODEL, **kw)


def _x(dtype=jnp.float64):
    return jax.random.normal(jax.random.key(0), (BATCH, T, D_MODEL), dtype)


@functools.cache
def _params(num_v_heads=None):
    model = _model(num_v_heads=num_v_heads)
    return mixers.random_params(model, _x(), model.v_heads)


@functools.cache
def _forward(impl, num_v_heads=None):
    return jax.jit(_model(impl=impl, num_v_heads=num_v_heads).apply)


@functools.cache
def _forward_and_vjp(impl):
    return mixers.forward_and_vjp(_model(impl=impl))


@functools.cache
def _decode(num_v_heads=None):
    return jax.jit(functools.partial(mixers.decode, _model(num_v_heads=num_v_heads)))


def _out(impl, num_v_heads=None):
    """The layer output on `_x()` with `_params(num_v_heads)`."""
    params, x = _params(num_v_heads), _x()
    if num_v_heads is None:
        return _forward_and_vjp(impl)(params, x, jnp.zeros_like(x))[0]
    return _forward(impl, num_v_heads)(params, x)


def _reference(params, x, num_v_heads=None):
    """The layer written out in numpy float64 from the paper's equations (module docstring)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    x = np.asarray(x, np.float64)
    hv = num_v_heads or H
    dv = 2 * K

    def silu(a):
        return a / (1.0 + np.exp(-a))

    def conv(u, w):  # causal depthwise, w: [W, D], last tap on the current token
        width = w.shape[0]
        up = np.pad(u, ((0, 0), (width - 1, 0), (0, 0)))
        return sum(w[i] * up[:, i : i + T] for i in range(width))

    def proj(name):
        return x @ p[name]["kernel"]

    q = silu(conv(proj("q_proj"), p["q_conv"])).reshape(BATCH, T, H, K)
    k = silu(conv(proj("k_proj"), p["k_conv"])).reshape(BATCH, T, H, K)
    v = silu(conv(proj("v_proj"), p["v_conv"])).reshape(BATCH, T, hv, dv)
    q, k = (a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6) for a in (q, k))
    q, k = (np.repeat(a, hv // H, axis=2) for a in (q, k))  # value head j reads q/k head j // G
    beta = 1.0 / (1.0 + np.exp(-proj("b_proj")))
    g = -np.exp(p["A_log"]) * np.log1p(np.exp(proj("a_proj") + p["dt_bias"]))
    state = np.zeros((BATCH, hv, K, dv))
    o = np.zeros((BATCH, T, hv, dv))
    for t in range(T):
        state = np.exp(g[:, t])[..., None, None] * state
        u = beta[:, t, :, None] * (v[:, t] - np.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * u[:, :, None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t]) * K**-0.5
    gate = proj("g_proj").reshape(o.shape)
    o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + 1e-5) * p["o_norm"]["weight"] * silu(gate)
    return o.reshape(BATCH, T, hv * dv) @ p["o_proj"]["kernel"]


@pytest.mark.parametrize("num_v_heads", [None, 2 * H])
@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
def test_forward_matches_numpy_reference(impl, num_v_heads):
    assert_close(_out(impl, num_v_heads), _reference(_params(num_v_heads), _x(), num_v_heads))


@pytest.mark.parametrize("num_v_heads", [None, 2 * H])
def test_decode_matches_forward_for_both_impls(num_v_heads):
    decoded = _decode(num_v_heads)(_params(num_v_heads), _x())
    for impl in ("recurrent", "chunked"):
        assert_close(decoded, _out(impl, num_v_heads), err_msg=impl)


def test_chunked_matches_recurrent_in_output_and_gradients():
    params, x = _params(), _x()
    cotangent = jax.random.normal(jax.random.key(2), x.shape, x.dtype)
    chunked = _forward_and_vjp("chunked")(params, x, cotangent)
    assert_close(chunked, _forward_and_vjp("recurrent")(params, x, cotangent))


def test_init_ranges_and_unit_norm_qk():
    model = _model(num_heads=2, num_v_heads=64, dtype=jnp.float32, param_dtype=jnp.float32)
    x = 3.0 * _x(jnp.float32)
    init = jax.jit(functools.partial(model.init_with_output, method=model.op_inputs))
    # An rbg key: the init program compiles about twice as fast as with threefry.
    inputs, params = init(jax.random.key(3, impl="rbg"), x)
    p = params["params"]
    assert bool(jnp.all((jnp.exp(p["A_log"]) > 0) & (jnp.exp(p["A_log"]) <= 16)))
    dt = jax.nn.softplus(p["dt_bias"])
    # float32 rounding of softplus(softplus^{-1}(dt)) is ~1e-7 relative.
    assert bool(jnp.all((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 1e-1 * (1 + 1e-5))))
    assert inputs["q"].shape == (BATCH, T, 2, K) and inputs["v"].shape == (BATCH, T, 64, 2 * K)
    assert bool(jnp.all(inputs["g"] <= 0))
    assert bool(jnp.all((inputs["beta"] > 0) & (inputs["beta"] < 1)))
    for name in ("q", "k"):
        norms = jnp.linalg.norm(inputs[name], axis=-1)
        # The L2 normalization adds eps = 1e-6 to ||x||^2 (as fla): norms are 1 - O(1e-6 / ||x||^2).
        np.testing.assert_allclose(np.asarray(norms), 1.0, rtol=0, atol=1e-5, err_msg=name)


def test_bad_impl_raises():
    params = _params()
    with pytest.raises(ValueError, match="impl"):
        jax.eval_shape(_model(impl="fast").apply, params, _x())
    with pytest.raises(NotImplementedError, match="Pallas"):  # chunk_size=4 is no kernel size
        jax.eval_shape(_model(impl="pallas_tpu").apply, params, _x())
