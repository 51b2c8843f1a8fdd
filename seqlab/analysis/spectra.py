"""Eigenvalues of the weight products of attention and MLP layers, per head and along depth.

For one attention head `h` with `W_Q^h, W_K^h, W_V^h: [D, K]` (columns of `wq[:, h, :]`) and
`W_O^h: [K, D]`, the products that act on the residual stream are

    QK^h = W_Q^h (W_K^h)^T: [D, D]     (scores x_i^T QK^h x_j)
    OV^h = W_V^h W_O^h:     [D, D]     (what a head writes: x_j^T OV^h)

and for the MLP `W_1: [D, F]`, `W_2: [F, D]` the product `W_1 W_2: [D, D]`. Each has rank at most
`K` (or `min(D, F)`), so its spectrum is computed on the small side (Sylvester): for `a: [D, K]`,
`b: [K, D]` the characteristic polynomials satisfy `det(x I_D - a b) = x^(D-K) det(x I_K - b a)`,
so `a b` has the eigenvalues of `b a: [K, K]` and `D - K` more zeros. The products are not
symmetric: eigenvalues are complex in general and are reported with their magnitudes.

- `product_eigenvalues(a, b)`: the `min(D, K)` eigenvalues of `a b` that are not forced to be zero.
- `qk_eigenvalues`, `ov_eigenvalues`, `mlp_eigenvalues`: the three products above, per head.
- `magnitudes(eigs)`: spectral radius and mean `|lambda|` over the last axis.
- `spectra_along_depth(weights_fn, ts)`: all three at every `t` of a grid, for a model whose weights
  are a function of continuous depth (`weights_fn(t) -> {"wq", "wk", "wv", "wo", "w1", "w2", ...}`).

Eigenvalues come back sorted by decreasing magnitude, complex64 (complex128 for float64 inputs).
Non-symmetric eigenvalues (`jnp.linalg.eigvals`) exist on CPU and GPU (LAPACK on the host), not
on TPU: there, call these on CPU arrays.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_floating, check_shape

WEIGHT_NAMES = ("wq", "wk", "wv", "wo", "w1", "w2")
"""The weight matrices of a transformer layer that `spectra` measures."""


def product_eigenvalues(a: jax.Array, b: jax.Array) -> jax.Array:
    """Eigenvalues of `a @ b` from the smaller of `a @ b` and `b @ a`.

    Args:
      a: `[..., D, K]`.
      b: `[..., K, D]`, the same leading axes.

    Returns:
      `[..., min(D, K)]` complex, sorted by decreasing `|lambda|`: all eigenvalues of `a @ b` when
      `D <= K`, else those of `b @ a` (the other `D - K` eigenvalues of `a @ b` are zero).
    """
    check_floating("a", a)
    check_floating("b", b)
    if a.ndim < 2 or b.shape != (*a.shape[:-2], a.shape[-1], a.shape[-2]):
        raise ValueError(
            f"a: [..., D, K] and b: [..., K, D] must have transposed trailing axes and equal "
            f"leading axes, got a {tuple(a.shape)} and b {tuple(b.shape)}"
        )
    d, k = a.shape[-2:]
    small = a @ b if d <= k else b @ a
    eigs = jnp.linalg.eigvals(small)
    order = jnp.argsort(-jnp.abs(eigs), axis=-1)
    return jnp.take_along_axis(eigs, order, axis=-1)


def qk_eigenvalues(wq: jax.Array, wk: jax.Array) -> jax.Array:
    """Per head, the eigenvalues of `W_Q^h (W_K^h)^T: [D, D]`.

    Args:
      wq, wk: `[D, H, K]`.

    Returns:
      `[H, min(D, K)]` complex (the remaining eigenvalues are zero).
    """
    check_shape("wq", wq, (None, None, None), "[D, H, K]")
    check_shape("wk", wk, wq.shape, "[D, H, K]")
    # a = W_Q^h: [H, D, K], b = (W_K^h)^T: [H, K, D].
    return product_eigenvalues(jnp.swapaxes(wq, 0, 1), jnp.transpose(wk, (1, 2, 0)))


def ov_eigenvalues(wv: jax.Array, wo: jax.Array) -> jax.Array:
    """Per head, the eigenvalues of `W_V^h W_O^h: [D, D]`.

    Args:
      wv: `[D, H, K]`.
      wo: `[H, K, D]`.

    Returns:
      `[H, min(D, K)]` complex (the remaining eigenvalues are zero).
    """
    check_shape("wv", wv, (None, None, None), "[D, H, K]")
    d, h, k = wv.shape
    check_shape("wo", wo, (h, k, d), "[H, K, D]")
    return product_eigenvalues(jnp.swapaxes(wv, 0, 1), wo)


def mlp_eigenvalues(w1: jax.Array, w2: jax.Array) -> jax.Array:
    """The eigenvalues of the MLP product `W_1 W_2: [D, D]`.

    Args:
      w1: `[D, F]`.
      w2: `[F, D]`.

    Returns:
      `[min(D, F)]` complex (the remaining eigenvalues are zero).
    """
    check_shape("w1", w1, (None, None), "[D, F]")
    check_shape("w2", w2, w1.shape[::-1], "[F, D]")
    return product_eigenvalues(w1, w2)


def magnitudes(eigs: jax.Array) -> dict[str, jax.Array]:
    """`spectral_radius = max |lambda|` and `mean_abs = mean |lambda|` over the last axis of
    `eigs: [..., n]`; each `[...]`."""
    mag = jnp.abs(eigs)
    return {"spectral_radius": jnp.max(mag, axis=-1), "mean_abs": jnp.mean(mag, axis=-1)}


def spectra_along_depth(
    weights_fn: Callable[[jax.Array], dict[str, jax.Array]], ts: jax.Array
) -> dict[str, jax.Array]:
    """The three spectra at every depth `t` of `ts`.

    Args:
      weights_fn: `t -> weights` (a scalar `t`, traceable: it is vmapped), with at least `"wq",
        "wk", "wv": [D, H, K]`, `"wo": [H, K, D]`, `"w1": [D, F]`, `"w2": [F, D]`.
      ts: `[S]` depths.

    Returns:
      `{"qk": [S, H, min(D, K)], "ov": [S, H, min(D, K)], "mlp": [S, min(D, F)]}` complex.
    """
    check_floating("ts", ts)
    check_shape("ts", ts, (None,), "[S]")
    weights = jax.vmap(weights_fn)(ts)
    missing = [name for name in WEIGHT_NAMES if name not in weights]
    if missing:
        raise ValueError(f"weights_fn(t) must return {list(WEIGHT_NAMES)}, missing {missing}")
    return {
        "qk": jax.vmap(qk_eigenvalues)(weights["wq"], weights["wk"]),
        "ov": jax.vmap(ov_eigenvalues)(weights["wv"], weights["wo"]),
        "mlp": jax.vmap(mlp_eigenvalues)(weights["w1"], weights["w2"]),
    }
