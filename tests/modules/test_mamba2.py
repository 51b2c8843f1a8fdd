"""Mamba2 layer: reference semantics, decoding, causality, init, groups, impls, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.mamba2 import Mamba2
from tests.conftest import assert_close
from tests.modules import mixers

D_MODEL, N, P, T, BATCH, CHUNK = 16, 4, 8, 7, 2, 4  # d_inner 32, 4 heads; T not a multiple of CHUNK
HEADS = 2 * D_MODEL // P
# (n_groups, norm_before_gate): mamba_ssm's default, and two groups with the other norm order.
CONFIGS = [(1, False), (2, True)]


def _model(**kw) -> Mamba2:
    kw = {"d_state": N, "head_dim": P, "chunk_size": CHUNK, **kw}
    kw.setdefault("dtype", jnp.float64)
    kw.setdefault("param_dtype", kw["dtype"])
    return Mamba2(D_MODEL, **kw)


def _x(dtype=jnp.float64):
    return jax.random.normal(jax.random.key(0), (BATCH, T, D_MODEL), dtype)


@functools.cache
def _params(config=CONFIGS[0]):
    n_groups, norm_before_gate = config
    model = _model(n_groups=n_groups, norm_before_gate=norm_before_gate)
    return mixers.random_params(model, _x(), HEADS)


@functools.cache
def _forward(impl, config):
    n_groups, norm_before_gate = config
    return jax.jit(_model(impl=impl, n_groups=n_groups, norm_before_gate=norm_before_gate).apply)


@functools.cache
def _forward_and_vjp(impl):
    return mixers.forward_and_vjp(_model(impl=impl))


@functools.cache
def _decode(config):
    n_groups, norm_before_gate = config
    model = _model(n_groups=n_groups, norm_before_gate=norm_before_gate)
    return jax.jit(functools.partial(mixers.decode, model))


def _out(impl, config):
    """The layer output on `_x()` with `_params(config)`."""
    params, x = _params(config), _x()
    if config == CONFIGS[0]:
        return _forward_and_vjp(impl)(params, x, jnp.zeros_like(x))[0]
    return _forward(impl, config)(params, x)


def _reference(params, x, config):
    """The layer written out in numpy float64 after `mamba_ssm` (state laid out [P, N] as there)."""
    n_groups, norm_before_gate = config
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    x = np.asarray(x, np.float64)
    d_inner = 2 * D_MODEL

    def silu(a):
        return a / (1.0 + np.exp(-a))

    def conv(u, w, b):  # causal depthwise, w: [W, D], last tap on the current token
        width = w.shape[0]
        up = np.pad(u, ((0, 0), (width - 1, 0), (0, 0)))
        return sum(w[i] * up[:, i : i + T] for i in range(width)) + b

    zxbcdt = x @ p["in_proj"]["kernel"]
    z, xbc, dt = np.split(zxbcdt, [d_inner, 2 * d_inner + 2 * n_groups * N], axis=-1)
    xbc = silu(conv(xbc, p["conv_weight"], p["conv_bias"]))
    xs, b, c = np.split(xbc, [d_inner, d_inner + n_groups * N], axis=-1)
    xs = xs.reshape(BATCH, T, HEADS, P)
    group = np.arange(HEADS) // (HEADS // n_groups)  # head h reads group h // (H / G)
    b = b.reshape(BATCH, T, n_groups, N)[:, :, group]
    c = c.reshape(BATCH, T, n_groups, N)[:, :, group]
    dt = np.log1p(np.exp(dt + p["dt_bias"]))  # [B, T, H]
    a = -np.exp(p["A_log"])
    h = np.zeros((BATCH, HEADS, P, N))
    y = np.zeros((BATCH, T, HEADS, P))
    for t in range(T):
        h = np.exp(dt[:, t] * a)[..., None, None] * h + np.einsum(
            "bh,bhn,bhp->bhpn", dt[:, t], b[:, t], xs[:, t]
        )
        y[:, t] = np.einsum("bhpn,bhn->bhp", h, c[:, t]) + p["D"][:, None] * xs[:, t]
    y = y.reshape(BATCH, T, d_inner)

    def grouped_rms(u):
        ug = u.reshape(BATCH, T, n_groups, -1)
        ug = ug / np.sqrt(np.mean(ug * ug, -1, keepdims=True) + 1e-5)
        return ug.reshape(u.shape) * p["norm_weight"]

    y = grouped_rms(y) * silu(z) if norm_before_gate else grouped_rms(y * silu(z))
    return y @ p["out_proj"]["kernel"]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
def test_forward_matches_numpy_reference(impl, config):
    assert_close(_out(impl, config), _reference(_params(config), _x(), config))


@pytest.mark.parametrize("config", CONFIGS)
def test_decode_matches_forward_for_both_impls(config):
    decoded = _decode(config)(_params(config), _x())
    for impl in ("recurrent", "chunked"):
        assert_close(decoded, _out(impl, config), err_msg=impl)


def test_chunked_matches_recurrent_in_output_and_gradients():
    params, x = _params(), _x()
    cotangent = jax.random.normal(jax.random.key(2), x.shape, x.dtype)
    chunked = _forward_and_vjp("chunked")(params, x, cotangent)
    assert_close(chunked, _forward_and_vjp("recurrent")(params, x, cotangent))


def test_init_ranges():
    # 32 heads; dt_init_floor above dt_min so that the floor is exercised.
    dt_min, dt_max, floor = 1e-5, 1e-2, 1e-3
    model = _model(
        head_dim=1, dt_min=dt_min, dt_max=dt_max, dt_init_floor=floor, A_init_range=(2.0, 3.0),
        dtype=jnp.float32, param_dtype=jnp.float32,
    )  # fmt: skip
    # An rbg key: the init program compiles about twice as fast as with threefry.
    p = jax.jit(model.init)(jax.random.key(3, impl="rbg"), _x(jnp.float32))["params"]
    a = jnp.exp(p["A_log"])
    assert bool(jnp.all((a >= 2.0) & (a <= 3.0)))
    assert bool(jnp.all(-a * jax.nn.softplus(p["dt_bias"]) <= 0))  # the log-decay g = dt A
    dt = jax.nn.softplus(p["dt_bias"])
    # float32 rounding of softplus(softplus^{-1}(dt)) is ~1e-7 relative.
    assert bool(jnp.all((dt >= floor * (1 - 1e-5)) & (dt <= dt_max * (1 + 1e-5))))
    assert bool(jnp.any(jnp.abs(dt - floor) < 1e-8)), "no head at the floor"
    np.testing.assert_array_equal(np.asarray(p["D"]), 1.0)
    np.testing.assert_array_equal(np.asarray(p["norm_weight"]), 1.0)
    assert bool(jnp.all(jnp.abs(p["conv_weight"]) <= 0.5))  # U(-1/sqrt(W), 1/sqrt(W)), W = 4


def test_bad_impl_raises():
    params = _params()
    with pytest.raises(ValueError, match="impl"):
        jax.eval_shape(_model(impl="fast").apply, params, _x())
    with pytest.raises(NotImplementedError, match="pallas"):
        jax.eval_shape(_model(impl="pallas_gpu").apply, params, _x())
