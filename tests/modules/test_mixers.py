"""The mixer contract (`seqlab.modules.mixer`), checked on every mixer.

Adding a mixer is one row of `MIXERS` (and one of `BAD_FIELDS` per field check); the per-mixer
files keep their numpy references and the tests of their variants.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.attention import Attention
from seqlab.modules.gated_deltanet import GatedDeltaNet
from seqlab.modules.gated_deltanet2 import GatedDeltaNet2
from seqlab.modules.gated_deltaproduct import GatedDeltaProduct
from seqlab.modules.kda import KimiDeltaAttention
from seqlab.modules.mamba import Mamba
from seqlab.modules.mamba2 import Mamba2
from seqlab.ops import (
    attention,
    gated_delta_product,
    gated_delta_rule,
    gdn2,
    kda,
    selective_scan,
    ssd,
)
from tests.conftest import assert_close
from tests.modules import mixers

D_MODEL, BATCH, T = 16, 2, 7  # T not a multiple of the chunk size 4

# name -> (mixer class, its fields, the op its `op_inputs` feed)
MIXERS = {
    "mamba": (Mamba, dict(d_state=3, conv_size=3), selective_scan),
    "mamba-polar-mixed": (
        Mamba,
        dict(d_state=3, polarize=(1, 1), sign_constraint="mixed"),
        selective_scan,
    ),
    "mamba2": (Mamba2, dict(d_state=4, head_dim=8, n_groups=2, chunk_size=4), ssd),
    "gdn": (
        GatedDeltaNet,
        dict(num_heads=2, head_dim=8, num_v_heads=4, chunk_size=4),
        gated_delta_rule,
    ),
    "kda": (
        KimiDeltaAttention,
        dict(num_heads=2, head_dim=8, num_v_heads=4, chunk_size=4),
        kda,
    ),
    "gdn2": (GatedDeltaNet2, dict(num_heads=2, head_dim=8, chunk_size=4), gdn2),
    "gdp": (
        GatedDeltaProduct,
        dict(num_heads=2, head_dim=8, num_v_heads=4, num_householder=2, chunk_size=4),
        gated_delta_product,
    ),
    "attention": (Attention, dict(num_heads=4, num_kv_heads=2, qk_norm=True), attention),
    "sliding-window": (Attention, dict(num_heads=2, window=3), attention),
}
FAMILY = ("kda", "gdn2", "gdp")
RECURRENT = (
    "mamba",
    "mamba-polar-mixed",
    "mamba2",
    "gdn",
    "kda",
    "gdn2",
    "gdp",
)  # a fixed-size "state" in the cache


def _mixer(name: str, dtype=jnp.float64, **overrides):
    cls, fields, _ = MIXERS[name]
    param_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
    return cls(D_MODEL, **{**fields, **overrides}, dtype=dtype, param_dtype=param_dtype)


def _x(dtype=jnp.float64, shape=(BATCH, T, D_MODEL)):
    # numpy draws: jax.random would compile a sampler for every new shape
    return jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)


@functools.cache
def _params(name: str):
    return jax.jit(_mixer(name).init)(jax.random.key(1), _x())


# The delta family's mixers decode token by token against a float64 numpy loop in
# `test_delta_family.py`; their rows here run with -m slow.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in FAMILY else n for n in MIXERS]
)
def test_step_equals_call_token_by_token(name):
    mixer, params, x = _mixer(name), _params(name), _x()
    decoded = jax.jit(functools.partial(mixers.decode, mixer))(params, x)
    assert_close(decoded, jax.jit(mixer.apply)(params, x))


@pytest.mark.parametrize("name", MIXERS)
def test_output_at_t_has_no_gradient_from_later_inputs(name):
    mixer, params, x = _mixer(name), _params(name), _x()

    @jax.jit
    def influence(t):  # max |d(sum of outputs at t) / d x_s| over batch and channels: [T]
        _, vjp = jax.vjp(lambda x: mixer.apply(params, x), x)
        (dx,) = vjp(jnp.zeros_like(x).at[:, t].set(1.0))
        return jnp.abs(dx).max(axis=(0, 2))

    for t in (0, 3, T - 1):
        got = np.asarray(influence(t))
        assert np.all(got[t + 1 :] == 0.0), (t, got)
        assert got[t] > 0.0, (t, got)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float64])
@pytest.mark.parametrize("name", MIXERS)
def test_shapes_and_dtypes(name, dtype):
    mixer = _mixer(name, dtype)
    x = jax.ShapeDtypeStruct((BATCH, T, D_MODEL), dtype)
    params = jax.eval_shape(mixer.init, jax.random.key(0), x)
    param_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
    assert all(a.dtype == param_dtype for a in jax.tree.leaves(params))
    out = jax.eval_shape(mixer.apply, params, x)
    assert (out.shape, out.dtype) == ((BATCH, T, D_MODEL), dtype)
    cache = mixer.init_cache(BATCH, max_len=T)
    if name in RECURRENT:  # the state accumulates in float32 (float64), its size fixed
        assert cache["state"].dtype == jnp.promote_types(dtype, jnp.float32)
        grown = mixer.init_cache(BATCH, max_len=10 * T)
        assert jax.tree.map(jnp.shape, grown) == jax.tree.map(jnp.shape, cache)
    x_t = jax.ShapeDtypeStruct((BATCH, D_MODEL), dtype)
    y_t, new_cache = jax.eval_shape(
        functools.partial(mixer.apply, method="step"), params, x_t, cache
    )
    assert (y_t.shape, y_t.dtype) == ((BATCH, D_MODEL), dtype)
    spec = functools.partial(jax.tree.map, lambda a: (a.shape, a.dtype))
    assert spec(new_cache) == spec(cache)


@pytest.mark.parametrize("name", MIXERS)
def test_op_inputs_are_what_the_op_takes(name):
    mixer, params = _mixer(name), _params(name)
    inputs = mixer.apply(params, _x(), method="op_inputs")
    out = MIXERS[name][2](**inputs)
    o = out[0] if isinstance(out, tuple) else out
    assert o.shape[:2] == (BATCH, T) and bool(jnp.all(jnp.isfinite(o)))


@pytest.mark.parametrize("name", MIXERS)
def test_bad_inputs_raise(name):
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
    with pytest.raises(ValueError, match="x_t must have rank 2"):
        step(params, _x(shape=(BATCH, 1, D_MODEL)), cache)
    with pytest.raises(ValueError, match=r"x_t must have shape \[B, d_model\]"):
        step(params, _x(shape=(BATCH, D_MODEL - 1)), cache)
    with pytest.raises(ValueError, match="batch_size"):
        mixer.init_cache(0, T)
    with pytest.raises(ValueError, match="max_len"):
        mixer.init_cache(BATCH, -1)


BAD_FIELDS = [
    ("mamba", {"d_model": 0}, "d_model"),
    ("mamba", {"d_state": -1}, "d_state"),
    ("mamba", {"conv_size": 0}, "conv_size"),
    ("mamba", {"expand": 1.5}, "expand"),
    ("mamba", {"dt_rank": 0}, "dt_rank"),
    ("mamba", {"dt_min": 0.2}, "dt_min"),
    ("mamba", {"sign_constraint": "positive"}, "sign_constraint"),
    ("mamba", {"polarize": (-1, 0)}, "polarize"),
    ("mamba", {"polarize": (1,)}, "polarize"),
    ("mamba", {"polarize": 2}, "polarize"),
    ("mamba", {"d_state": 1, "sign_constraint": "mixed"}, "mixed"),
    ("mamba", {"polar_zero_A": 1.0}, "polar_zero_A"),
    ("mamba", {"reorder_tau": 0.0}, "reorder_tau"),
    ("mamba2", {"d_state": 0}, "d_state"),
    ("mamba2", {"head_dim": 5}, "head_dim"),
    ("mamba2", {"n_groups": 3}, "n_groups"),
    ("mamba2", {"expand": 0}, "expand"),
    ("mamba2", {"chunk_size": 0}, "chunk_size"),
    ("mamba2", {"conv_size": 0}, "conv_size"),
    ("mamba2", {"dt_min": 0.2}, "dt_min"),
    ("mamba2", {"A_init_range": (3.0, 2.0)}, "A_init_range"),
    ("gdn", {"num_heads": 0}, "num_heads"),
    ("gdn", {"head_dim": -1}, "head_dim"),
    ("gdn", {"num_v_heads": 3}, "num_v_heads"),
    ("gdn", {"expand_v": 1.3}, "expand_v"),
    ("gdn", {"chunk_size": 0}, "chunk_size"),
    ("gdn", {"conv_size": 0}, "conv_size"),
    ("kda", {"num_v_heads": 3}, "num_v_heads"),
    ("kda", {"gate_lower_bound": 1.0}, "gate_lower_bound"),
    ("gdn2", {"expand_v": 1.3}, "expand_v"),
    ("gdp", {"num_householder": 0}, "num_householder"),
    ("attention", {"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads"),
    ("attention", {"num_heads": 0}, "num_heads"),
    ("attention", {"num_heads": 2, "head_dim": 5}, "head_dim"),
    ("sliding-window", {"window": 0}, "window"),
]


@pytest.mark.parametrize(("name", "fields", "match"), BAD_FIELDS)
def test_bad_fields_raise_at_construction(name, fields, match):
    cls, defaults, _ = MIXERS[name]
    kwargs = {"d_model": D_MODEL, **defaults, **fields}
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)
