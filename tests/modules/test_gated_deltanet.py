"""GatedDeltaNet layer: reference semantics, decoding, causality, init, GVA, impls, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.gated_deltanet import GatedDeltaNet
from tests.conftest import assert_close

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
    """Random float64 parameters (numpy draws: compiling `init` would cost more than the tests).

    Matrices ~ N(0, 1 / fan_in), vectors ~ 1 + 0.1 N(0, 1); then decay rates `exp(A_log)` in
    [0.5, 3] and `dt_bias` in [-1, 1], so that the decays differ visibly from 1.
    """
    model = _model(num_v_heads=num_v_heads)
    shapes = jax.eval_shape(model.init, jax.random.key(0), _x())["params"]
    rng = np.random.default_rng(1)

    def draw(s):
        a = rng.standard_normal(s.shape)
        return jnp.asarray(a / np.sqrt(s.shape[0]) if a.ndim == 2 else 1.0 + 0.1 * a)

    p = jax.tree.map(draw, shapes)
    p["A_log"] = jnp.log(jnp.linspace(0.5, 3.0, model.v_heads))
    p["dt_bias"] = jnp.linspace(-1.0, 1.0, model.v_heads)
    return {"params": p}


@functools.cache
def _forward(impl, num_v_heads=None):
    return jax.jit(_model(impl=impl, num_v_heads=num_v_heads).apply)


@functools.cache
def _forward_and_vjp(impl):
    """`(params, x, cotangent) -> (out, (d params, d x))`, one compilation per impl."""
    apply = _model(impl=impl).apply

    def run(params, x, cotangent):
        out, vjp = jax.vjp(apply, params, x)
        return out, vjp(cotangent)

    return jax.jit(run)


@functools.cache
def _decode(num_v_heads=None):
    model = _model(num_v_heads=num_v_heads)

    def decode(params, x):
        def step(cache, x_t):
            y_t, cache = model.apply(params, x_t, cache, method=model.step)
            return cache, y_t

        _, ys = jax.lax.scan(step, model.init_cache(x.shape[0], x.shape[1]), jnp.swapaxes(x, 0, 1))
        return jnp.swapaxes(ys, 0, 1)

    return jax.jit(decode)


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
    model = _model(num_v_heads=2 * H, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    x = jax.ShapeDtypeStruct((BATCH, T, D_MODEL), jnp.bfloat16)
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(params))
    out = jax.eval_shape(model.apply, params, x)
    assert (out.shape, out.dtype) == ((BATCH, T, D_MODEL), jnp.bfloat16)
    cache = model.init_cache(BATCH, max_len=1000)  # max_len unused: the cache does not grow
    shapes = {name: (a.shape, a.dtype) for name, a in cache.items()}
    assert shapes == {
        "q_conv": ((BATCH, 3, H * K), jnp.bfloat16),
        "k_conv": ((BATCH, 3, H * K), jnp.bfloat16),
        "v_conv": ((BATCH, 3, 2 * H * 2 * K), jnp.bfloat16),
        "state": ((BATCH, 2 * H, K, 2 * K), jnp.float32),
    }
    x_t = jax.ShapeDtypeStruct((BATCH, D_MODEL), jnp.bfloat16)
    step = functools.partial(model.apply, method=model.step)
    y_t, new_cache = jax.eval_shape(step, params, x_t, cache)
    assert (y_t.shape, y_t.dtype) == ((BATCH, D_MODEL), jnp.bfloat16)
    assert {n: (a.shape, a.dtype) for n, a in new_cache.items()} == shapes


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


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"num_heads": 0}, "num_heads"),
        ({"head_dim": -1}, "head_dim"),
        ({"num_v_heads": 3}, "num_v_heads"),
        ({"expand_v": 1.3}, "expand_v"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"conv_size": 0}, "conv_size"),
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
    with pytest.raises(ValueError, match="batch_size"):
        model.init_cache(0, T)
    with pytest.raises(ValueError, match="impl"):
        jax.eval_shape(_model(impl="fast").apply, params, _x())
    with pytest.raises(NotImplementedError, match="Pallas"):  # chunk_size=4 is no kernel size
        jax.eval_shape(_model(impl="pallas_tpu").apply, params, _x())
