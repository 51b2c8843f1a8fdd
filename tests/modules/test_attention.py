"""Tests of seqlab.modules.attention.Attention and seqlab.modules.mlp.SwiGLU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.attention import Attention
from seqlab.modules.mlp import SwiGLU
from tests.conftest import assert_close
from tests.modules import mixers

F64 = dict(dtype=jnp.float64, param_dtype=jnp.float64)
# Every option of Qwen3-Next's full-attention layers on, rotating 4 channels of each head.
QWEN3_NEXT = dict(
    qk_norm=True, zero_centered_norm=True, norm_eps=1e-3, output_gate=True, rotary_dim=4
)


def _init(module, x):
    return jax.jit(module.init)(jax.random.key(0), x)


def _normal(seed, shape):
    # numpy draws: jax.random would compile a sampler for every new shape
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float64)


@pytest.mark.parametrize(
    ("kwargs", "max_len"),
    [
        (dict(num_heads=4), 9),  # global, multi-head
        (dict(num_heads=4, num_kv_heads=2, qk_norm=True), 12),  # global, GQA, cache longer than T
        (dict(num_heads=4, num_kv_heads=1, window=3), 9),  # T = 9 > window: the ring wraps 3 times
        (dict(num_heads=2, head_dim=6, window=16), 9),  # window > max_len: max_len slots
        (dict(num_heads=4, num_kv_heads=2, head_dim=6, **QWEN3_NEXT), 12),  # GQA, all options
        (dict(num_heads=4, num_kv_heads=1, head_dim=5, window=3, **QWEN3_NEXT), 9),  # odd D
    ],
)
def test_step_equals_call_token_by_token(kwargs, max_len):
    module = Attention(d_model=16, **kwargs, **F64)
    x = _normal(1, (2, 9, 16))
    params = _init(module, x)
    full = module.apply(params, x)
    stepped = jax.jit(mixers.decode, static_argnums=(0, 3))(module, params, x, max_len)
    assert_close(stepped, full)
    window = kwargs.get("window")
    slots = max_len if window is None else min(window, max_len)
    cache = module.init_cache(2, max_len)
    assert cache["k"].shape == (2, slots, module.kv_heads, module.head_size)


def test_step_float32():
    module = Attention(d_model=16, num_heads=4, num_kv_heads=2, window=4)
    x = _normal(2, (2, 7, 16)).astype(jnp.float32)
    params = _init(module, x)
    stepped = jax.jit(mixers.decode, static_argnums=(0, 3))(module, params, x, 7)
    assert stepped.dtype == jnp.float32 and module.init_cache(2, 7)["k"].dtype == jnp.float32
    assert_close(stepped, module.apply(params, x))


@pytest.mark.parametrize(
    ("window", "options"), [(None, {}), (3, {}), (3, dict(QWEN3_NEXT, rotary_dim=2))]
)
def test_gradient_causality(window, options):
    """d y_t / d x_s vanishes exactly for s > t and, with a window, for t - s >= window; it does not
    vanish for the visible tokens."""
    module = Attention(d_model=8, num_heads=2, window=window, **options, **F64)
    x = _normal(3, (1, 7, 8))
    params = _init(module, x)
    proj = _normal(4, (8,))
    jac = jax.jacrev(lambda x: module.apply(params, x)[0] @ proj)(x)  # [T, 1, T, D]
    influence = np.abs(np.asarray(jac)).sum((1, 3))
    t, s = np.meshgrid(np.arange(7), np.arange(7), indexing="ij")
    seen = (s <= t) & ((t - s < window) if window is not None else True)
    np.testing.assert_array_equal(influence > 0, seen)


def test_bfloat16_compute_follows_dtype():
    module = Attention(d_model=16, num_heads=2, dtype=jnp.bfloat16)
    x = _normal(5, (1, 5, 16)).astype(jnp.float32)
    params = _init(module, x)
    y = module.apply(params, x)
    assert y.dtype == jnp.bfloat16
    assert jax.tree.leaves(params)[0].dtype == jnp.float32
    reference = Attention(d_model=16, num_heads=2).apply(params, x)
    assert_close(y, reference, jnp.bfloat16)


def test_parameter_shapes():
    module = Attention(d_model=16, num_heads=4, num_kv_heads=2, head_dim=6, qk_norm=True)
    params = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 2, 16)))["params"]
    shapes = {k: jax.tree.map(lambda a: a.shape, v) for k, v in params.items()}
    assert shapes == {
        "q_proj": {"kernel": (16, 24)},
        "k_proj": {"kernel": (16, 12)},
        "v_proj": {"kernel": (16, 12)},
        "o_proj": {"kernel": (24, 16)},
        "q_norm": {"weight": (6,)},
        "k_norm": {"weight": (6,)},
    }


def test_swiglu_matches_formula():
    mlp = SwiGLU(d_model=6, d_ff=10, **F64)
    x = _normal(6, (2, 3, 6))
    params = _init(mlp, x)
    p = params["params"]
    gate, up, down = (p[n]["kernel"] for n in ("gate", "up", "down"))
    expected = (jax.nn.silu(x @ gate) * (x @ up)) @ down
    assert_close(mlp.apply(params, x), expected)
    assert gate.shape == (6, 10) and up.shape == (6, 10) and down.shape == (10, 6)
    with pytest.raises(ValueError, match="x"):
        mlp.apply(params, jnp.zeros((2, 3, 5)))
    with pytest.raises(ValueError, match="d_ff"):
        SwiGLU(d_model=6, d_ff=0).init(jax.random.key(0), x)


# --- Qwen3-Next's options: output gate, partial rotary, zero-centred q/k norms with their eps ----


def _random_params(module, x):
    """Random float64 parameters: matrices ~ N(0, 1 / fan_in), norm weights ~ 0.3 N(0, 1) (so that
    both `w` and `1 + w` differ visibly from 1)."""
    shapes = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    rng = np.random.default_rng(7)

    def draw(s):
        a = rng.standard_normal(s.shape)
        return jnp.asarray(a / np.sqrt(s.shape[0]) if a.ndim == 2 else 0.3 * a)

    return {"params": jax.tree.map(draw, shapes)}


def _rotate(x, theta, r):
    """Rotate the first `r` channels of `x: [T, H, D]` at positions 0..T-1, written as Hugging
    Face's `apply_rotary_pos_emb`: `x_rot * cos + rotate_half(x_rot) * sin`, `cos, sin` of
    `t * theta^(-2i/r)` repeated twice; the channels from `r` on pass through."""
    inv_freq = theta ** -(np.arange(0, r, 2) / r)  # [r/2]
    freqs = np.arange(x.shape[0])[:, None] * inv_freq  # [T, r/2]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, r]
    x_rot, x_pass = x[..., :r], x[..., r:]
    rotate_half = np.concatenate([-x_rot[..., r // 2 :], x_rot[..., : r // 2]], axis=-1)
    return np.concatenate([x_rot * np.cos(emb) + rotate_half * np.sin(emb), x_pass], axis=-1)


def _reference(module, params, x):
    """A straightforward numpy float64 forward pass of `module` on `x: [B, T, d_model]`."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    x = np.asarray(x, np.float64)
    heads, kv_heads, dim = module.num_heads, module.kv_heads, module.head_size
    r = dim if module.rotary_dim is None else module.rotary_dim
    batch, length, _ = x.shape

    def norm(a, name):
        if not module.qk_norm:
            return a
        w = p[name]["weight"]
        scale = 1 + w if module.zero_centered_norm else w
        return a / np.sqrt((a**2).mean(-1, keepdims=True) + module.norm_eps) * scale

    out = np.zeros((batch, length, heads * dim))
    t, s = np.meshgrid(np.arange(length), np.arange(length), indexing="ij")
    visible = s <= t
    if module.window is not None:
        visible &= t - s < module.window
    for b in range(batch):
        q = norm((x[b] @ p["q_proj"]["kernel"]).reshape(length, heads, dim), "q_norm")
        k = norm((x[b] @ p["k_proj"]["kernel"]).reshape(length, kv_heads, dim), "k_norm")
        v = (x[b] @ p["v_proj"]["kernel"]).reshape(length, kv_heads, dim)
        q, k = _rotate(q, module.rope_theta, r), _rotate(k, module.rope_theta, r)
        for h in range(heads):
            g = h // (heads // kv_heads)  # the key/value head of query head h
            scores = np.where(visible, q[:, h] @ k[:, g].T / np.sqrt(dim), -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[b, :, h * dim : (h + 1) * dim] = probs @ v[:, g]
        if module.output_gate:
            out[b] *= 1 / (1 + np.exp(-(x[b] @ p["g_proj"]["kernel"])))
    return out @ p["o_proj"]["kernel"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_output_gate_matches_reference(num_kv_heads, dtype):
    param_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
    module = Attention(
        d_model=16,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        output_gate=True,
        dtype=dtype,
        param_dtype=param_dtype,
    )
    x = _normal(10, (2, 6, 16)).astype(dtype)
    params = jax.tree.map(lambda a: a.astype(param_dtype), _random_params(module, x))
    y = jax.jit(module.apply)(params, x)
    assert y.dtype == dtype
    expected = _reference(module, params, x)
    assert_close(y, expected, dtype)
    # The gate matters: without it (the same other weights) the output differs.
    ungated = module.clone(output_gate=False)
    p = {"params": {k: v for k, v in params["params"].items() if k != "g_proj"}}
    assert_close(jax.jit(ungated.apply)(p, x), _reference(ungated, p, x), dtype)
    assert not np.allclose(_reference(ungated, p, x), expected, atol=1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(8, None), (8, 4), (8, 2), (5, 4)])
def test_partial_rotary_matches_reference(head_dim, rotary_dim, dtype):
    param_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
    module = Attention(
        d_model=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=100.0,  # large angles at the slow frequencies too
        dtype=dtype,
        param_dtype=param_dtype,
    )
    x = _normal(11, (2, 7, 16)).astype(dtype)
    params = jax.tree.map(lambda a: a.astype(param_dtype), _random_params(module, x))
    y = jax.jit(module.apply)(params, x)
    assert y.dtype == dtype
    assert_close(y, _reference(module, params, x), dtype)
    q = jax.jit(lambda p, x: module.apply(p, x, method="op_inputs"))(params, x)["q"]
    # The channels past rotary_dim are the unrotated projections.
    r = head_dim if rotary_dim is None else rotary_dim
    q_raw = np.asarray(x, np.float64) @ np.asarray(params["params"]["q_proj"]["kernel"])
    q_raw = q_raw.reshape(2, 7, 2, head_dim)
    assert_close(q[..., r:], q_raw[..., r:].astype(dtype), dtype)


@pytest.mark.parametrize("window", [None, 3])
def test_all_qwen3_next_options_match_reference(window):
    """Output gate, partial rotary and zero-centred q/k norms with eps 0.1 (visible against the
    default 1e-6) together, grouped-query."""
    options = dict(QWEN3_NEXT, norm_eps=0.1, rotary_dim=6)
    module = Attention(
        d_model=16, num_heads=4, num_kv_heads=2, head_dim=8, window=window, **options, **F64
    )
    x = _normal(12, (2, 7, 16))
    params = _random_params(module, x)
    assert_close(jax.jit(module.apply)(params, x), _reference(module, params, x))
    stepped = jax.jit(mixers.decode, static_argnums=(0, 3))(module, params, x, 7)
    assert_close(stepped, _reference(module, params, x))
    default_eps = module.clone(norm_eps=1e-6)
    assert not np.allclose(default_eps.apply(params, x), _reference(module, params, x))


def test_default_params_unchanged():
    """The new options at their defaults add no parameter and change no initial value: the output
    gate adds `g_proj` only, and the other parameters keep their values under the same key."""
    x = jnp.zeros((1, 3, 16))
    base = dict(d_model=16, num_heads=4, num_kv_heads=2, qk_norm=True)
    default = jax.jit(Attention(**base).init)(jax.random.key(0), x)["params"]
    assert set(default) == {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
    np.testing.assert_array_equal(default["q_norm"]["weight"], 1.0)
    explicit = Attention(
        **base, output_gate=False, rotary_dim=None, norm_eps=1e-6, zero_centered_norm=False
    )
    assert Attention(**base) == explicit
    full = Attention(**base, rotary_dim=4)  # rotary_dim = head_dim: the whole head, same params
    x = _normal(13, (1, 5, 16)).astype(jnp.float32)
    np.testing.assert_array_equal(
        full.apply({"params": default}, x), explicit.apply({"params": default}, x)
    )

    gated = jax.jit(Attention(**base, output_gate=True, zero_centered_norm=True).init)(
        jax.random.key(0), x
    )["params"]
    assert set(gated) == set(default) | {"g_proj"}
    assert gated["g_proj"]["kernel"].shape == (16, 16)  # d_model -> H * D
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        np.testing.assert_array_equal(gated[name]["kernel"], default[name]["kernel"])
    for name in ("q_norm", "k_norm"):
        np.testing.assert_array_equal(gated[name]["weight"], 0.0)  # zero-centred: scale 1 at init
    # At init a zero-centred norm (weight 0, scale 1) is the plain one (weight 1, scale 1).
    zero_init = {**default, "q_norm": gated["q_norm"], "k_norm": gated["k_norm"]}
    zero_centered = Attention(**base, zero_centered_norm=True).apply({"params": zero_init}, x)
    assert_close(zero_centered, Attention(**base).apply({"params": default}, x))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(rotary_dim=3), "rotary_dim must be an even int in \\[2, head_dim = 8\\], got 3"),
        (dict(rotary_dim=0), "rotary_dim must be a positive int"),
        (dict(rotary_dim=-2), "rotary_dim must be a positive int"),
        (dict(rotary_dim=10), "rotary_dim must be an even int in \\[2, head_dim = 8\\], got 10"),
        (dict(rotary_dim=4.0), "rotary_dim must be a positive int"),
        (dict(head_dim=5), "head_dim must be even for RoPE"),  # whole-head RoPE needs even D
        (dict(head_dim=5, rotary_dim=6), "rotary_dim"),
        (dict(qk_norm=True, norm_eps=0.0), "norm_eps"),
        (dict(zero_centered_norm=True), "zero_centered_norm requires qk_norm"),
    ],
)
def test_bad_option_fields_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        Attention(**{"d_model": 16, "num_heads": 2, "head_dim": 8, **fields})


def test_bfloat16_with_options_follows_dtype():
    options = dict(num_heads=2, num_kv_heads=1, **QWEN3_NEXT)
    module = Attention(d_model=16, dtype=jnp.bfloat16, **options)
    x = _normal(14, (1, 5, 16)).astype(jnp.float32)
    params = jax.tree.map(lambda a: a.astype(jnp.float32), _random_params(module, x))
    y = module.apply(params, x)
    assert y.dtype == jnp.bfloat16
    assert_close(y, Attention(d_model=16, **options).apply(params, x), jnp.bfloat16)
