"""The influence and recency measurements of `seqlab.analysis` run unchanged on a Kimi Delta
Attention mixer: its Jacobian influence is causal, and with strong decays it falls geometrically
with distance at a rate between the mixer's fastest and slowest log-decays."""

import jax
import jax.numpy as jnp
import numpy as np

from seqlab.analysis import rates
from seqlab.analysis.influence import module_influence
from seqlab.modules.kda import KimiDeltaAttention

T, D = 12, 8


def test_influence_of_a_kda_mixer_is_causal_and_decays_with_distance():
    # The recurrent impl compiles fastest; the measurement does not depend on the impl.
    mixer = KimiDeltaAttention(d_model=D, num_heads=2, head_dim=4, impl="recurrent")
    xs = jnp.asarray(np.random.default_rng(0).standard_normal((2, T, D)), jnp.float32)
    # Parameters from numpy draws (compiling init would cost more than the test): matrices
    # N(0, 1 / fan_in), vectors 1 + 0.1 N(0, 1); strong decays: A = 1, dt_bias = 3, so every
    # log-decay is -softplus(3 + f).
    rng = np.random.default_rng(1)

    def draw(path, s):
        if path[-1].key == "A_log":
            return jnp.zeros(s.shape, s.dtype)
        if path[-1].key == "dt_bias":
            return jnp.full(s.shape, 3.0, s.dtype)
        a = rng.standard_normal(s.shape)
        return jnp.asarray(a / np.sqrt(s.shape[0]) if a.ndim == 2 else 1.0 + 0.1 * a, s.dtype)

    shapes = jax.eval_shape(mixer.init, jax.random.key(0), xs)["params"]
    params = {"params": jax.tree_util.tree_map_with_path(draw, shapes)}

    @jax.jit
    def measure(params, xs):
        infl = jax.vmap(lambda x: module_influence(mixer, params, x))(xs)  # [B, T, T]
        return infl, mixer.apply(params, xs, method="op_inputs")["g"]

    infl, g = (np.asarray(a, np.float64) for a in measure(params, xs))
    assert infl.shape == (2, T, T)
    assert np.all(infl[:, *np.triu_indices(T, k=1)] == 0.0)
    assert np.all(np.diagonal(infl, axis1=1, axis2=2) > 0.0)
    # Recency: mean log-influence against distance, past the convolution window (4 tokens).
    distances = np.arange(mixer.conv_size, T - 1)
    profile = [np.mean(np.log(np.diagonal(infl, -r, axis1=1, axis2=2))) for r in distances]
    fit = rates.line_fit(distances, np.array(profile))
    # Influence at distance r passes r decays of every key channel: its log falls no faster than
    # the fastest log-decay and at least about as fast as the slowest one (half of it, a margin).
    assert g.min() <= fit["slope"] <= 0.5 * g.max(), (fit, g.min(), g.max())
