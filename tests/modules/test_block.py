"""Block: the pre-norm residual structure, decoding through the mixer, the MambaBlock factory."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.block import Block, MambaBlock
from seqlab.modules.mamba import Mamba
from seqlab.ops.norm import rms_norm
from tests.conftest import assert_close

D_MODEL = 8
SHAPE = (2, 10, D_MODEL)
MAMBA = dict(d_state=4, polarize=(1, 1))


class _MLP(nn.Module):
    """A small per-token MLP, `[..., D] -> [..., D]`."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(D_MODEL)(nn.gelu(nn.Dense(2 * D_MODEL)(x)))


def _block(with_mlp: bool) -> Block:
    return Block(Mamba(D_MODEL, **MAMBA), _MLP() if with_mlp else None, norm_eps=1e-5)


def _x():
    return jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE), jnp.float32)


@functools.cache
def _params_with_mlp():
    """Block parameters with an MLP, the norm scales drawn away from their initial ones."""
    params = jax.jit(_block(True).init)(jax.random.key(0), _x())
    rng = np.random.default_rng(1)
    for norm in ("mixer_norm", "mlp_norm"):
        weight = 1 + 0.5 * rng.standard_normal(D_MODEL)
        params["params"][norm]["weight"] = jnp.asarray(weight, jnp.float32)
    return params


def _params(with_mlp: bool):
    """The same parameters, without the MLP ones for a Block without an MLP."""
    params = _params_with_mlp()["params"]
    keep = ("mixer", "mixer_norm") + (("mlp", "mlp_norm") if with_mlp else ())
    return jax.tree.map(lambda a: a, {"params": {k: params[k] for k in keep}})  # a fresh tree


def test_params_tree():
    assert set(_params_with_mlp()["params"]) == {"mixer", "mixer_norm", "mlp", "mlp_norm"}
    params = jax.eval_shape(MambaBlock(D_MODEL, **MAMBA).init, jax.random.key(0), _x())["params"]
    assert set(params) == {"mixer", "mixer_norm"}  # Mamba-1 blocks have no MLP


@pytest.mark.parametrize("with_mlp", [False, True])
def test_residual_structure(with_mlp):
    p = _params(with_mlp)["params"]
    x = _x()
    mixer = Mamba(D_MODEL, **MAMBA)
    h = x + mixer.apply({"params": p["mixer"]}, rms_norm(x, p["mixer_norm"]["weight"], eps=1e-5))
    if with_mlp:
        h = h + _MLP().apply({"params": p["mlp"]}, rms_norm(h, p["mlp_norm"]["weight"], eps=1e-5))
    assert_close(_block(with_mlp).apply(_params(with_mlp), x), h)


def test_zero_mixer_output_is_identity():
    params = _params(False)
    kernel = params["params"]["mixer"]["out_proj"]["kernel"]
    params["params"]["mixer"]["out_proj"]["kernel"] = jnp.zeros_like(kernel)
    x = _x()
    np.testing.assert_array_equal(_block(False).apply(params, x), x)


@pytest.mark.parametrize("with_mlp", [False, True])
def test_step_matches_call(with_mlp):
    block, params = _block(with_mlp), _params(with_mlp)
    x = _x()
    cache = block.init_cache(SHAPE[0], SHAPE[1])
    step = jax.jit(functools.partial(block.apply, method="step"))
    ys = []
    for t in range(SHAPE[1]):
        y_t, cache = step(params, x[:, t], cache)
        ys.append(y_t)
    assert_close(jnp.stack(ys, axis=1), block.apply(params, x))


def test_cache_is_the_mixers():
    block = MambaBlock(D_MODEL, norm_eps=1e-5, d_state=3, polarize=(2, 1), conv_size=3)
    assert block.norm_eps == 1e-5 and block.mlp is None
    cache = block.init_cache(2, 7)
    want = Mamba(D_MODEL, d_state=3, polarize=(2, 1), conv_size=3).init_cache(2, 7)
    assert jax.tree.structure(cache) == jax.tree.structure(want)
    assert cache["conv"].shape == (2, 2, 16) and cache["state"].shape == (2, 16, 6)
