"""Helpers shared by the mixer tests: decoding with `step`, vjps, and random parameters."""

import jax
import jax.numpy as jnp
import numpy as np


def decode(mixer, params, x: jax.Array, max_len: int | None = None) -> jax.Array:
    """`step` token by token over `x: [B, T, d_model]` (a `lax.scan`) from
    `init_cache(B, max_len)` (default `T`); returns `[B, T, d_model]`."""

    def body(cache, x_t):
        y_t, cache = mixer.apply(params, x_t, cache, method="step")
        return cache, y_t

    cache = mixer.init_cache(x.shape[0], max_len or x.shape[1])
    return jnp.swapaxes(jax.lax.scan(body, cache, jnp.swapaxes(x, 0, 1))[1], 0, 1)


def forward_and_vjp(mixer):
    """A jitted `(params, x, cotangent) -> (out, (d params, d x))`."""

    def run(params, x, cotangent):
        out, vjp = jax.vjp(mixer.apply, params, x)
        return out, vjp(cotangent)

    return jax.jit(run)


def random_params(mixer, x: jax.Array, heads: int) -> dict:
    """Random float64 parameters of a Mamba-2-style mixer (numpy draws: compiling `init` would cost
    more than the tests).

    Matrices ~ N(0, 1 / fan_in), vectors ~ 1 + 0.1 N(0, 1); then decay rates `exp(A_log)` in
    [0.5, 3] and `dt_bias` in [-1, 1] over the `heads` heads, so that the decays differ visibly
    from 1.
    """
    shapes = jax.eval_shape(mixer.init, jax.random.key(0), x)["params"]
    rng = np.random.default_rng(1)

    def draw(s):
        a = rng.standard_normal(s.shape)
        return jnp.asarray(a / np.sqrt(s.shape[0]) if a.ndim == 2 else 1.0 + 0.1 * a)

    p = jax.tree.map(draw, shapes)
    p["A_log"] = jnp.log(jnp.linspace(0.5, 3.0, heads))
    p["dt_bias"] = jnp.linspace(-1.0, 1.0, heads)
    return {"params": p}
