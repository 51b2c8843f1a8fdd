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


@pytest.mark.parametrize("window", [None, 3])
def test_gradient_causality(window):
    """d y_t / d x_s vanishes exactly for s > t and, with a window, for t - s >= window; it does not
    vanish for the visible tokens."""
    module = Attention(d_model=8, num_heads=2, window=window, **F64)
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
