"""Mamba2 layer: reference semantics, decoding, causality, init, groups, impls, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.mamba2 import Mamba2
from tests.conftest import assert_close

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
    """Random float64 parameters (numpy draws: compiling `init` would cost more than the tests).

    Matrices ~ N(0, 1 / fan_in), vectors ~ 1 + 0.1 N(0, 1); then decay rates `exp(A_log)` in
    [0.5, 3] and `dt_bias` in [-1, 1], so that the decays differ visibly from 1.
    """
    n_groups, norm_before_gate = config
    model = _model(n_groups=n_groups, norm_before_gate=norm_before_gate)
    shapes = jax.eval_shape(model.init, jax.random.key(0), _x())["params"]
    rng = np.random.default_rng(1)

    def draw(s):
        a = rng.standard_normal(s.shape)
        return jnp.asarray(a / np.sqrt(s.shape[0]) if a.ndim == 2 else 1.0 + 0.1 * a)

    p = jax.tree.map(draw, shapes)
    p["A_log"] = jnp.log(jnp.linspace(0.5, 3.0, HEADS))
    p["dt_bias"] = jnp.linspace(-1.0, 1.0, HEADS)
    return {"params": p}


@functools.cache
def _forward(impl, config):
    n_groups, norm_before_gate = config
    return jax.jit(_model(impl=impl, n_groups=n_groups, norm_before_gate=norm_before_gate).apply)


@functools.cache
def _forward_and_vjp(impl):
    """`(params, x, cotangent) -> (out, (d params, d x))`, one compilation per impl."""
    apply = _model(impl=impl).apply

    def run(params, x, cotangent):
        out, vjp = jax.vjp(apply, params, x)
        return out, vjp(cotangent)

    return jax.jit(run)


@functools.cache
def _decode(config):
    n_groups, norm_before_gate = config
    model = _model(n_groups=n_groups, norm_before_gate=norm_before_gate)

    def decode(params, x):
        def step(cache, x_t):
            y_t, cache = model.apply(params, x_t, cache, method=model.step)
            return cache, y_t

        _, ys = jax.lax.scan(step, model.init_cache(x.shape[0], x.shape[1]), jnp.swapaxes(x, 0, 1))
        return jnp.swapaxes(ys, 0, 1)

    return jax.jit(decode)


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


@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
@pytest.mark.parametrize("t", [0, 3, T - 2])
def test_output_at_t_has_no_gradient_from_later_inputs(impl, t):
    params, x = _params(), _x()
    cotangent = jnp.zeros_like(x).at[:, t].set(1.0)  # d(sum of outputs at t) / d x
    _, (_, dx) = _forward_and_vjp(impl)(params, x, cotangent)
    influence = np.abs(np.asarray(dx)).max(axis=(0, 2))  # [s]
    assert np.all(influence[t + 1 :] == 0.0), influence
    assert np.all(influence[: t + 1] > 0.0), influence


def test_shapes_and_dtypes():
    model = _model(n_groups=2, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    x = jax.ShapeDtypeStruct((BATCH, T, D_MODEL), jnp.bfloat16)
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(params))
    out = jax.eval_shape(model.apply, params, x)
    assert (out.shape, out.dtype) == ((BATCH, T, D_MODEL), jnp.bfloat16)
    cache = model.init_cache(BATCH, max_len=1000)  # max_len unused: the cache does not grow
    shapes = {name: (a.shape, a.dtype) for name, a in cache.items()}
    assert shapes == {
        "conv": ((BATCH, 3, 2 * D_MODEL + 2 * 2 * N), jnp.bfloat16),
        "state": ((BATCH, HEADS, N, P), jnp.float32),
    }
    x_t = jax.ShapeDtypeStruct((BATCH, D_MODEL), jnp.bfloat16)
    step = functools.partial(model.apply, method=model.step)
    y_t, new_cache = jax.eval_shape(step, params, x_t, cache)
    assert (y_t.shape, y_t.dtype) == ((BATCH, D_MODEL), jnp.bfloat16)
    assert {n: (a.shape, a.dtype) for n, a in new_cache.items()} == shapes


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


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"d_state": 0}, "d_state"),
        ({"head_dim": 5}, "head_dim"),
        ({"n_groups": 3}, "n_groups"),
        ({"expand": 0}, "expand"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"dt_min": 0.2}, "dt_min"),
        ({"A_init_range": (3.0, 2.0)}, "A_init_range"),
    ],
)
def test_bad_fields_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(_model(**fields).init, jax.random.key(0), _x())


def test_bad_inputs_raise():
    model, params = _model(), _params()
    apply = functools.partial(jax.eval_shape, model.apply, params)  # raises while tracing
    step = functools.partial(jax.eval_shape, functools.partial(model.apply, method=model.step))
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, d_model\]"):
        apply(jnp.zeros((BATCH, T, D_MODEL + 1)))
    with pytest.raises(ValueError, match="x must have rank 3"):
        apply(jnp.zeros((BATCH, D_MODEL)))
    with pytest.raises(ValueError, match="x must be a floating-point"):
        apply(jnp.zeros((BATCH, T, D_MODEL), jnp.int32))
    cache = model.init_cache(BATCH, T)
    with pytest.raises(ValueError, match="x_t must have rank 2"):
        step(params, jnp.zeros((BATCH, 1, D_MODEL)), cache)
    with pytest.raises(ValueError, match="state"):
        step(params, jnp.zeros((BATCH + 1, D_MODEL)), cache)
    with pytest.raises(ValueError, match="max_len"):
        model.init_cache(BATCH, 0)
    with pytest.raises(ValueError, match="impl"):
        jax.eval_shape(_model(impl="fast").apply, params, _x())
    with pytest.raises(NotImplementedError, match="pallas"):
        jax.eval_shape(_model(impl="pallas_gpu").apply, params, _x())
