"""The delta-rule family on the mixer contract: KimiDeltaAttention, GatedDeltaNet2,
GatedDeltaProduct. Each layer against a numpy float64 rendering of its docstring's equations,
decoding against the full forward, parameter shapes and counts, bad fields and inputs, bfloat16
compute; a LanguageModel over the three pattern letters; the DeltaProduct paper presets' sizes."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.gated_deltanet2 import GatedDeltaNet2
from seqlab.modules.gated_deltaproduct import GatedDeltaProduct
from seqlab.modules.kda import KimiDeltaAttention
from seqlab.modules.lm import PRESETS, LanguageModel, count_params, preset
from tests.conftest import assert_close
from tests.modules import mixers

D_MODEL, BATCH, T = 16, 2, 7  # T not a multiple of the chunk size 4
H, K = 2, 4

# name -> (mixer class, its fields). Grouped value heads (HV = 2 H) where the mixer has them; the
# bounded gate and negative eigenvalues on KDA; the ungated DeltaProduct of the paper with n = 3.
# The variants run the recurrent impl (it compiles in half the time; the ops' tests hold every impl
# to it), the three mixers their default impl (chunked on CPU).
MIXERS = {
    "kda": (
        KimiDeltaAttention,
        dict(num_heads=H, head_dim=K, num_v_heads=2 * H, expand_v=2, chunk_size=4),
    ),
    "kda-bounded": (
        KimiDeltaAttention,
        dict(
            num_heads=H, head_dim=K, gate_lower_bound=-5.0, allow_neg_eigval=True, impl="recurrent"
        ),
    ),
    "gdn2": (GatedDeltaNet2, dict(num_heads=H, head_dim=K, expand_v=2, chunk_size=4)),
    "gdp": (
        GatedDeltaProduct,
        dict(num_heads=H, head_dim=K, num_v_heads=2 * H, num_householder=2, chunk_size=4),
    ),
    "gdp-ungated": (
        GatedDeltaProduct,
        dict(
            num_heads=H,
            head_dim=K,
            expand_v=1,
            num_householder=3,
            use_forget_gate=False,
            use_output_gate=False,
            impl="recurrent",
        ),
    ),
}
F64 = dict(dtype=jnp.float64, param_dtype=jnp.float64)


def _mixer(name: str, **overrides):
    cls, fields = MIXERS[name]
    return cls(D_MODEL, **{**fields, **F64, **overrides})


def _x(dtype=jnp.float64, shape=(BATCH, T, D_MODEL)):
    # numpy draws: jax.random would compile a sampler for every new shape
    return jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)


@functools.cache
def _params(name: str):
    return _random_params(_mixer(name), _x())


def _random_params(module, *args, **kwargs) -> dict:
    """Random float64 parameters from numpy draws (compiling `init` would cost more than the
    tests): matrices ~ N(0, 1 / fan_in), vectors ~ 1 + 0.1 N(0, 1); then decay rates
    `exp(A_log)` in [0.5, 3] and `dt_bias` in [-1, 1], so that the decays differ visibly from 1."""
    shapes = jax.eval_shape(module.init, jax.random.key(0), *args, **kwargs)["params"]
    rng = np.random.default_rng(1)

    def draw(path, s):
        name = path[-1].key
        if name == "A_log":
            return jnp.log(jnp.linspace(0.5, 3.0, s.shape[0]))
        if name == "dt_bias":
            return jnp.linspace(-1.0, 1.0, math.prod(s.shape)).reshape(s.shape)
        a = rng.standard_normal(s.shape)
        return jnp.asarray(a / np.sqrt(s.shape[0]) if a.ndim == 2 else 1.0 + 0.1 * a)

    return {"params": jax.tree_util.tree_map_with_path(draw, shapes)}


@functools.cache
def _forward(name: str):
    return jax.jit(_mixer(name).apply)


# -- numpy rendering of the module docstrings ------------------------------------------------------


def _silu(a):
    return a / (1.0 + np.exp(-a))


def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def _softplus(a):
    return np.log1p(np.exp(a))


def _conv(u, w):  # causal depthwise, w: [W, D], the last tap on the current token
    width = w.shape[0]
    up = np.pad(u, ((0, 0), (width - 1, 0), (0, 0)))
    return sum(w[i] * up[:, i : i + u.shape[1]] for i in range(width))


def _l2(a):
    return a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)


def _rms(o, weight, eps):
    return o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps) * weight


def _reference(name: str, params, x) -> np.ndarray:
    """The layer from its docstring's equations, token by token in numpy float64."""
    mixer = _mixer(name)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    x = np.asarray(x, np.float64)
    hv = getattr(mixer, "v_heads", mixer.num_heads)
    n = getattr(mixer, "num_householder", 1)
    dv = mixer.head_v_dim

    def dense(name, u=x):
        return u @ p[name]["kernel"] + p[name].get("bias", 0.0)

    def conv(name):
        return _silu(_conv(dense(f"{name}_proj"), p[f"{name}_conv"]))

    q = _l2(conv("q").reshape(BATCH, T, H, K))
    k = _l2(conv("k").reshape(BATCH, T, n, H, K))
    v = conv("v").reshape(BATCH, T, n, hv, dv)
    q, k = np.repeat(q, hv // H, axis=-2), np.repeat(k, hv // H, axis=-2)  # head j reads j // G
    if isinstance(mixer, GatedDeltaProduct):
        beta = _sigmoid(dense("b_proj")).reshape(BATCH, T, n, hv) * (1 + mixer.allow_neg_eigval)
        if mixer.use_forget_gate:
            g = -np.exp(p["A_log"]) * _softplus(dense("a_proj") + p["dt_bias"])
        else:
            g = np.zeros((BATCH, T, hv))
        g = np.broadcast_to(g[..., None], (BATCH, T, hv, K))
        erase, write = beta[..., None] * k, np.broadcast_to(beta[..., None], v.shape)
    else:
        f = dense("f_b", dense("f_a")).reshape(BATCH, T, hv, K)
        a = np.exp(p["A_log"])[:, None]
        bound = getattr(mixer, "gate_lower_bound", None)
        g = (
            -a * _softplus(f + p["dt_bias"])
            if bound is None
            else bound * _sigmoid(a * (f + p["dt_bias"]))
        )
        if isinstance(mixer, GatedDeltaNet2):
            b = _sigmoid(dense("b_proj")).reshape(BATCH, T, 1, H, K)
            erase, write = b * k, _sigmoid(dense("w_proj")).reshape(v.shape)
        else:
            beta = _sigmoid(dense("b_proj")).reshape(BATCH, T, 1, hv)
            beta = 2.0 * beta if mixer.allow_neg_eigval else beta
            erase, write = beta[..., None] * k, np.broadcast_to(beta[..., None], v.shape)
    state = np.zeros((BATCH, hv, K, dv))
    o = np.zeros((BATCH, T, hv, dv))
    for t in range(T):
        state = np.exp(g[:, t])[..., None] * state
        for j in range(n):
            read = np.einsum("bhkv,bhk->bhv", state, erase[:, t, j])
            state = (
                state + k[:, t, j, :, :, None] * (write[:, t, j] * v[:, t, j] - read)[:, :, None]
            )
        o[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t]) * K**-0.5
    o = _rms(o, p["o_norm"]["weight"], mixer.norm_eps)
    if isinstance(mixer, GatedDeltaProduct):
        if mixer.use_output_gate:
            o = o * _silu(dense("g_proj").reshape(o.shape))
    else:
        o = o * _sigmoid(dense("g_b", dense("g_a")).reshape(o.shape))
    return o.reshape(BATCH, T, hv * dv) @ p["o_proj"]["kernel"]


@pytest.mark.parametrize("name", MIXERS)
def test_forward_matches_numpy_reference_and_decoding(name):
    params, x = _params(name), _x()
    out = _forward(name)(params, x)
    assert_close(out, _reference(name, params, x))
    decoded = jax.jit(functools.partial(mixers.decode, _mixer(name)))(params, x)
    assert_close(decoded, out)


# -- parameters --------------------------------------------------------------------------------


def _expected_shapes(name: str) -> dict:
    """Every parameter's shape, written out from the module docstrings (fla's layouts)."""
    m = _mixer(name)
    d, W = D_MODEL, m.conv_size
    hv = getattr(m, "v_heads", m.num_heads)
    n = getattr(m, "num_householder", 1)
    key, value, dv = H * K, hv * m.head_v_dim, m.head_v_dim
    shapes = {
        "q_proj": {"kernel": (d, key)},
        "k_proj": {"kernel": (d, n * key)},
        "v_proj": {"kernel": (d, n * value)},
        "o_proj": {"kernel": (value, d)},
        "q_conv": (W, key),
        "k_conv": (W, n * key),
        "v_conv": (W, n * value),
        "o_norm": {"weight": (dv,)},
    }
    if isinstance(m, GatedDeltaProduct):
        shapes["b_proj"] = {"kernel": (d, n * hv)}
        if m.use_forget_gate:
            shapes.update(a_proj={"kernel": (d, hv)}, A_log=(hv,), dt_bias=(hv,))
        if m.use_output_gate:
            shapes["g_proj"] = {"kernel": (d, value)}
        return shapes
    shapes.update(
        f_a={"kernel": (d, dv)},
        f_b={"kernel": (dv, hv * K)},
        g_a={"kernel": (d, dv)},
        g_b={"kernel": (dv, value), "bias": (value,)},
        A_log=(hv,),
        dt_bias=(hv, K),
    )
    if isinstance(m, GatedDeltaNet2):
        shapes.update(b_proj={"kernel": (d, key)}, w_proj={"kernel": (d, value)})
    else:
        shapes["b_proj"] = {"kernel": (d, hv)}
    return shapes


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float64])
@pytest.mark.parametrize("name", MIXERS)
def test_parameter_shapes_and_output_and_cache_specs(name, dtype):
    mixer = _mixer(name, dtype=dtype, param_dtype=jnp.promote_types(dtype, jnp.float32))
    x = jax.ShapeDtypeStruct((BATCH, T, D_MODEL), dtype)
    params = jax.eval_shape(mixer.init, jax.random.key(0), x)
    assert jax.tree.map(lambda a: a.shape, params["params"]) == _expected_shapes(name)
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.promote_types(dtype, jnp.float32)}
    assert jax.eval_shape(mixer.apply, params, x).dtype == dtype
    inputs = jax.eval_shape(functools.partial(mixer.apply, method="op_inputs"), params, x)
    assert {inputs[a].dtype for a in ("q", "k", "v")} == {jnp.dtype(dtype)}
    gates = [a for a in ("g", "beta", "b", "w") if a in inputs]
    assert {inputs[a].dtype for a in gates} == {jnp.promote_types(dtype, jnp.float32)}
    cache = mixer.init_cache(BATCH, T)
    assert cache["state"].dtype == jnp.promote_types(dtype, jnp.float32)
    x_t = jax.ShapeDtypeStruct((BATCH, D_MODEL), dtype)
    y_t, new_cache = jax.eval_shape(
        functools.partial(mixer.apply, method="step"), params, x_t, cache
    )
    assert (y_t.shape, y_t.dtype) == ((BATCH, D_MODEL), dtype)
    spec = functools.partial(jax.tree.map, lambda a: (a.shape, a.dtype))
    assert spec(new_cache) == spec(cache)


def _setup_params(name: str) -> dict:
    """The parameters `setup` declares itself (convolutions, `A_log`, `dt_bias`), initialized for
    real: an init through a method that only reads them compiles none of the layer."""
    mixer = _mixer(name, dtype=jnp.float32, param_dtype=jnp.float32)
    init = jax.jit(lambda key: mixer.init(key, method=lambda m: (m.A_log, m.dt_bias)))
    return init(jax.random.key(3, impl="rbg"))["params"]  # rbg: compiles faster than threefry


@pytest.mark.parametrize(
    ("name", "a_range"), [("kda", (1, 16)), ("gdn2", (1, 16)), ("gdp", (0, 16))]
)
def test_initial_decays_follow_fla(name, a_range):
    """`A = exp(A_log)` in fla's range `(low, high]`, `softplus(dt_bias)` in [1e-3, 1e-1]."""
    p = _setup_params(name)
    a, dt = np.exp(p["A_log"]), np.asarray(jax.nn.softplus(p["dt_bias"]))
    assert np.all((a > a_range[0]) & (a <= a_range[1] * (1 + 1e-6))), a
    # float32 rounding of softplus(softplus^{-1}(dt)) is ~1e-7 relative.
    assert np.all((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 1e-1 * (1 + 1e-5))), dt


def test_bounded_gate_starts_at_unit_rate_and_stays_in_its_bounds():
    """With `gate_lower_bound=-5`, `A_log` starts at 0 (fla's safe gate) and every log-decay lies
    in (-5, 0); with negative eigenvalues beta lies in (0, 2) and exceeds 1 somewhere."""
    assert np.all(_setup_params("kda-bounded")["A_log"] == 0.0)
    mixer = _mixer("kda-bounded")
    inputs = jax.jit(functools.partial(mixer.apply, method="op_inputs"))(
        _params("kda-bounded"), 3.0 * _x()
    )
    g, beta = np.asarray(inputs["g"]), np.asarray(inputs["beta"])
    assert np.all((g > -5.0) & (g < 0.0)) and g.min() < -1.0
    assert np.all((beta > 0.0) & (beta < 2.0)) and beta.max() > 1.0


# -- bad fields and inputs ---------------------------------------------------------------------

BAD_FIELDS = [
    ("kda", {"num_heads": 0}, "num_heads"),
    ("kda", {"head_dim": -1}, "head_dim"),
    ("kda", {"num_v_heads": 3}, "num_v_heads"),
    ("kda", {"expand_v": 1.3}, "expand_v"),
    ("kda", {"conv_size": 0}, "conv_size"),
    ("kda", {"chunk_size": 0}, "chunk_size"),
    ("kda", {"gate_lower_bound": 0.5}, "gate_lower_bound"),
    ("kda", {"gate_lower_bound": "low"}, "gate_lower_bound"),
    ("gdn2", {"d_model": 0}, "d_model"),
    ("gdn2", {"num_heads": -2}, "num_heads"),
    ("gdn2", {"expand_v": 0.1}, "expand_v"),
    ("gdn2", {"chunk_size": 1.5}, "chunk_size"),
    ("gdp", {"num_householder": 0}, "num_householder"),
    ("gdp", {"num_v_heads": 5}, "num_v_heads"),
    ("gdp", {"head_dim": 0}, "head_dim"),
    ("gdp", {"conv_size": -1}, "conv_size"),
]


@pytest.mark.parametrize(("name", "fields", "match"), BAD_FIELDS)
def test_bad_fields_raise_at_construction(name, fields, match):
    cls, defaults = MIXERS[name]
    with pytest.raises(ValueError, match=match):
        cls(**{"d_model": D_MODEL, **defaults, **fields})


@pytest.mark.parametrize("name", ["kda", "gdn2", "gdp"])
def test_bad_inputs_raise_before_any_work(name):
    mixer, params = _mixer(name), _params(name)
    apply = functools.partial(jax.eval_shape, mixer.apply, params)  # raises while tracing
    step = functools.partial(jax.eval_shape, functools.partial(mixer.apply, method="step"))
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, d_model\]"):
        apply(_x(shape=(BATCH, T, D_MODEL + 1)))
    with pytest.raises(ValueError, match="x must have rank 3"):
        apply(_x(shape=(BATCH, D_MODEL)))
    with pytest.raises(ValueError, match="x must be a floating-point"):
        apply(jnp.zeros((BATCH, T, D_MODEL), jnp.int32))
    cache = mixer.init_cache(BATCH, T)
    with pytest.raises(ValueError, match=r"x_t must have shape \[B, d_model\]"):
        step(params, _x(shape=(BATCH, D_MODEL - 1)), cache)
    with pytest.raises(ValueError, match="batch_size"):
        mixer.init_cache(0, T)


@pytest.mark.parametrize("name", ["kda", "gdn2", "gdp"])
def test_bfloat16_compute_runs_and_tracks_float64(name):
    mixer = _mixer(name, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    params = jax.tree.map(lambda a: a.astype(jnp.float32), _params(name))
    out = jax.jit(mixer.apply)(params, _x(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and out.shape == (BATCH, T, D_MODEL)
    exact = _reference(name, _params(name), _x())
    err = np.max(np.abs(np.asarray(out, np.float64) - exact)) / np.max(np.abs(exact))
    assert err < 5e-2, err  # bfloat16 rounds inputs and projections at ~4e-3


# -- LanguageModel -------------------------------------------------------------------------------


def test_language_model_over_the_new_letters_decodes_as_its_forward():
    kw = {"num_heads": 2, "head_dim": 4, "impl": "recurrent"}  # compiles fastest
    model = LanguageModel(
        vocab_size=13,
        d_model=D_MODEL,
        pattern="knp",
        d_ff=24,
        kda={**kw, "num_v_heads": 4},
        gdn2=kw,
        gdp={**kw, "num_householder": 2},
        **F64,
    )
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 13, (BATCH, T)), jnp.int32)
    params = _random_params(model, tokens)

    @jax.jit
    def decode(params, tokens):
        cache = model.apply(params, BATCH, T, method=model.init_cache)

        def body(cache, tokens_t):
            logits_t, cache = model.apply(params, tokens_t, cache, method=model.step)
            return cache, logits_t

        return jnp.swapaxes(jax.lax.scan(body, cache, tokens.T)[1], 0, 1)

    full = jax.jit(model.apply)(params, tokens)
    assert full.shape == (BATCH, T, 13) and full.dtype == jnp.float64
    assert_close(decode(params, tokens), full)


def test_tiny_presets_hold_the_new_letters():
    assert {PRESETS[f"tiny-{n}"]["pattern"] for n in ("kda", "gdn2", "gdp")} == {"k", "n", "p"}


@pytest.mark.parametrize("n", [2, 3])
def test_deltaproduct_paper_presets_match_the_authors_layer_sizes(n):
    """delta_product_340m_-1_1_{n}.json of automl/DeltaProduct: 24 x (DeltaProduct_n + SwiGLU 2816),
    width 1024, 8 heads of width 128 (keys and values), no forget or output gate, tied 32000-token
    embedding."""
    d, heads, k, v, conv, d_ff = 1024, 8, 128, 128, 4, 2816
    mixer = (
        d * heads * k  # q
        + n * d * heads * (k + v)  # n keys and values per token
        + n * d * heads  # n betas per head
        + heads * v * d  # output projection
        + conv * heads * (k + n * (k + v))  # short convolutions
        + v  # output RMSNorm
    )
    block = mixer + 3 * d * d_ff + 2 * d
    assert PRESETS[f"dp{n}-340m"]["pattern"] == "p" * 24
    # One block's model, from shapes only (nothing is allocated; 24 blocks take 10 times longer).
    one = count_params(preset(f"dp{n}-340m", pattern="p"))
    assert one == block + 32000 * d + d
    assert one + 23 * block == {2: 392_318_976, 3: 443_043_840}[n]
