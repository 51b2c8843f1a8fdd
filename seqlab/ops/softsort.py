"""SoftSort (Prillo and Eisenschlos, ICML 2020): a differentiable relaxation of sorting."""

import jax
import jax.numpy as jnp

from seqlab.ops.checks import accumulation_dtype, check_floating, check_shape


def soft_sort(scores: jax.Array, tau: float, *, hard: bool = False) -> jax.Array:
    """The ascending sort matrix of `scores: [B, T]`: `P: [B, T, T]`, rows summing to 1.

    `P[b, i, j] = softmax_j(-|sorted_i - s_j| / tau)` with `sorted = sort(s)` ascending, so `P s`
    approaches `sorted` as `tau -> 0`. With `hard`, the forward value is the exact permutation
    matrix `one_hot(argsort(s))` (a stable sort: ties keep their order) and the gradient is that of
    the soft matrix (straight-through). Computed in float32 or wider; returned in `scores.dtype`.
    """
    check_floating("scores", scores)
    check_shape("scores", scores, (None, None), "[B, T]")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    s = scores.astype(accumulation_dtype(scores))
    ordered = jnp.sort(s, axis=-1)
    soft = jax.nn.softmax(-jnp.abs(ordered[:, :, None] - s[:, None, :]) / tau, axis=-1)
    if hard:
        exact = jax.nn.one_hot(jnp.argsort(s, axis=-1, stable=True), s.shape[-1], dtype=s.dtype)
        soft = soft + jax.lax.stop_gradient(exact - soft)
    return soft.astype(scores.dtype)
