"""Token similarity of one sequence `x: [T, D]`: how far apart its tokens are.

Over-smoothing (Wang et al., arXiv 2501.00658) is the collapse of these quantities with depth.
Every function takes one sequence; batch with `jax.vmap`. Results follow the dtype of `x`.

- `channel_range(x)`: `max_t x[t, d] - min_t x[t, d]`, `[D]`; the quantity a convex-combination
  layer provably cannot increase (per channel).
- `diameter(x)`: `max_{s,t} ||x_s - x_t||`.
- `average_pairwise_distance(x)`: `mean_{s<t} ||x_s - x_t||`.
- `dirichlet_energy(x)`: `mean_t ||x_{t+1} - x_t||^2` on the path graph of the sequence.
- `relative_dirichlet_energy(x)`: the Dirichlet energy over `mean_t ||x_t - mean(x)||^2`;
  scale-free, it measures the high-frequency share of the sequence (0 for a constant sequence).
- `normalized_diameter(x)`: the diameter over the RMS distance of the tokens to their mean;
  scale-free and shift-invariant (for two distinct tokens it is 2).
"""

import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_floating, check_shape


def _check(x) -> None:
    check_floating("x", x)
    check_shape("x", x, (None, None), "[T, D]")
    if x.shape[0] < 2:
        raise ValueError(f"x must have at least 2 tokens, got shape {tuple(x.shape)}")


def _pairwise(x: jax.Array) -> jax.Array:
    """`||x_s - x_t||: [T, T]`, from differences (no Gram-matrix cancellation)."""
    return jnp.sqrt(jnp.sum(jnp.square(x[:, None, :] - x[None, :, :]), axis=-1))


def channel_range(x: jax.Array) -> jax.Array:
    """`[D]`: per channel, the largest minus the smallest value over the tokens of `x: [T, D]`."""
    _check(x)
    return jnp.max(x, axis=0) - jnp.min(x, axis=0)


def diameter(x: jax.Array) -> jax.Array:
    """The largest distance between two tokens of `x: [T, D]` (a scalar)."""
    _check(x)
    return jnp.max(_pairwise(x))


def average_pairwise_distance(x: jax.Array) -> jax.Array:
    """The mean distance over the `T (T - 1) / 2` pairs of distinct tokens of `x: [T, D]`."""
    _check(x)
    t = x.shape[0]
    return jnp.sum(_pairwise(x)) / (t * (t - 1))  # the [T, T] matrix counts each pair twice


def dirichlet_energy(x: jax.Array) -> jax.Array:
    """`mean_t ||x_{t+1} - x_t||^2` for `x: [T, D]`."""
    _check(x)
    return jnp.mean(jnp.sum(jnp.square(jnp.diff(x, axis=0)), axis=-1))


def _spread(x: jax.Array) -> jax.Array:
    """`mean_t ||x_t - mean(x)||^2`, the total variance of the tokens."""
    return jnp.mean(jnp.sum(jnp.square(x - jnp.mean(x, axis=0)), axis=-1))


def relative_dirichlet_energy(x: jax.Array) -> jax.Array:
    """`dirichlet_energy(x) / mean_t ||x_t - mean(x)||^2` for `x: [T, D]` (scale-free)."""
    _check(x)
    return dirichlet_energy(x) / _spread(x)


def normalized_diameter(x: jax.Array) -> jax.Array:
    """`diameter(x) / sqrt(mean_t ||x_t - mean(x)||^2)` for `x: [T, D]` (scale-free)."""
    _check(x)
    return diameter(x) / jnp.sqrt(_spread(x))
