"""Paper variants of the Mamba-1 mixer, as the small functions `Mamba` composes.

- Polarized state transitions (Wang et al., arXiv 2501.00658): `polarized_state_matrix`.
- Sign-constrained token interactions (Vo et al., arXiv 2410.03292, "Refinement 1"):
  `sign_constrained_maps`.
- Token reordering by importance (Vo et al., "Refinement 2"): `importance_scores`, `reorder`,
  `restore_order`, with `seqlab.ops.soft_sort`.
"""

import jax
import jax.numpy as jnp

SIGN_CONSTRAINTS = (None, "pos", "neg", "mixed")
"""The values of `Mamba(sign_constraint=...)`: none, or the sign of the token-dynamics matrix."""
LAMBDA_FLOOR = 0.7
"""`|lambda| = softplus(theta) + LAMBDA_FLOOR`, as in the token-dynamics authors' code."""


def polarized_state_matrix(learned: jax.Array, polarize: tuple[int, int], zero_A: float):
    """`A: [D, n_ones + N + n_zeros]`: `n_ones` channels of pre-exponential `A` exactly 0 (decay
    exactly 1: a running sum of `dt B u` that never forgets), the learned `A: [D, N]`, and `n_zeros`
    channels fixed at `zero_A <= 0`. The fixed channels are constants, not parameters.

    The "zero" channel only forgets for large dt: `exp(-100 dt)` is ~0.905 at dt = 1e-3 and ~4.5e-5
    at dt = 0.1 (-100 is the value of the authors' code).
    """
    n_ones, n_zeros = polarize
    d_inner = learned.shape[0]
    ones = jnp.zeros((d_inner, n_ones), learned.dtype)
    zeros = jnp.full((d_inner, n_zeros), zero_A, learned.dtype)
    return jnp.concatenate([ones, learned, zeros], axis=1)


def signed_scales(theta: jax.Array, constraint: str) -> jax.Array:
    """`lambda: [N]` with `|lambda| = softplus(theta) + 0.7` and signs by `constraint`: all positive
    ("pos"), all negative ("neg"), or the first `N - N // 2` positive and the rest negative
    ("mixed")."""
    magnitude = jax.nn.softplus(theta) + LAMBDA_FLOOR
    n = theta.shape[0]
    sign = {
        "pos": jnp.ones((n,), magnitude.dtype),
        "neg": -jnp.ones((n,), magnitude.dtype),
        "mixed": jnp.where(jnp.arange(n) < n - n // 2, 1, -1).astype(magnitude.dtype),
    }[constraint]
    return sign * magnitude


def sign_constrained_maps(free: jax.Array, theta: jax.Array, constraint: str):
    """`(S_B, S_C): [N, d_inner]` with `S_C = triu(P, 1) + I` for the free `P = free: [N, d_inner]`
    and `S_B = diag(lambda) S_C` (`lambda = signed_scales(theta, constraint)`).

    Then `M = S_C^T S_B = S_C^T diag(lambda) S_C` is symmetric with the inertia of `lambda`
    (positive semidefinite for "pos", negative for "neg", indefinite for "mixed"), and `S_C` has
    full rank `min(N, d_inner)`, as in the authors' `PosDefiniteMambav2`.
    """
    n, d_inner = free.shape
    s_c = jnp.triu(free, k=1) + jnp.eye(n, d_inner, dtype=free.dtype)
    return signed_scales(theta, constraint)[:, None] * s_c, s_c


def importance_scores(delta: jax.Array, delta_bias: jax.Array, w: jax.Array) -> jax.Array:
    """`s_l = w^T (delta_l + b_dt): [B, T]` from the scan's `delta: [B, T, D]` before its bias
    `b_dt: [D]`, and the importance weights `w: [D]`."""
    return (delta + delta_bias) @ w


def reorder(perm: jax.Array, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """`P x` for each `x: [B, T, D]`, with the sort matrix `P: [B, T, T]`."""
    return tuple(jnp.einsum("bij,bjd->bid", perm, x) for x in xs)


def restore_order(perm: jax.Array, y: jax.Array) -> jax.Array:
    """`P^T y: [B, T, D]`, back to the input order (the inverse of a permutation matrix)."""
    return jnp.einsum("bij,bid->bjd", perm, y)
