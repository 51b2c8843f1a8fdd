"""Compressed sensing: Gaussian measurements of sparse vectors and two decoders.

Measurements: `A: [m, d]` with i.i.d. `N(0, 1/m)` entries, `y = A x: [..., m]`. For `m` of order
`s ln(d / s)`, an `s`-sparse `x` is the unique sparsest solution of `A z = y` with high probability,
and both decoders below find it: then every norm of the decoded vector equals that of `x`. The
decoders are arbitrary (non-smooth, non-linear) functions of `y`: the point of Silwal, Woodruff,
Zhang (arXiv 2502.19865) that `O(s log d)` dimensions suffice for exact norms once the decoder may
be any function, against `Omega(s^2)` for linear or smooth maps.

- `omp(a, y, s)`: orthogonal matching pursuit, `s` greedy steps; batched and jit-compatible
  (not differentiable: it selects columns by `argmax`). Each step picks the column most correlated
  with the residual, `j = argmax_i |a_i^T r| / ||a_i||`, then refits `y` on all chosen columns by
  least squares (normal equations, `s x s`) and updates `r = y - A_S z_S`. Cost per step:
  `O(N m d)` (the correlations `r A`).
- `basis_pursuit(a, y)`: `min ||z||_1` subject to `A z = y`, the linear program
  `min 1^T (u + v)` s.t. `A u - A v = y`, `u, v >= 0`, solved by `scipy.optimize.linprog` (HiGHS)
  one vector at a time, in float64 numpy (not jit-compatible).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from seqlab.ops.checks import check_floating, check_positive_int
from seqlab.sketching.sparse import SparseVectors, as_vectors


def gaussian_measurements(key: jax.Array, m: int, d: int, dtype=jnp.float32) -> jax.Array:
    """`A: [m, d]` with i.i.d. `N(0, 1/m)` entries (so `E ||A x||_2^2 = ||x||_2^2`)."""
    check_positive_int("m", m)
    check_positive_int("d", d)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    return jax.random.normal(key, (m, d), dtype) / jnp.sqrt(jnp.asarray(m, dtype))


def _check_matrix(a) -> None:
    check_floating("a", a)
    if jnp.ndim(a) != 2:
        raise ValueError(f"a must be a matrix [m, d], got shape {jnp.shape(a)}")


def measure(a: jax.Array, x) -> jax.Array:
    """`y = A x: [..., m]` for `a: [m, d]` and `x: [..., d]` dense or `SparseVectors` of dimension
    `d` (sparse: only the `s` columns of each vector's slots are read)."""
    _check_matrix(a)
    x = as_vectors("x", x, a.shape[1])
    if isinstance(x, SparseVectors):
        return _measure_sparse(a, x.indices, x.values)
    return x.astype(a.dtype) @ a.T


@jax.jit
def _measure_sparse(a, indices, values):
    cols = a.T[indices]  # [..., s, m]: only the columns of the slots
    return jnp.einsum("...sm,...s->...m", cols, values.astype(a.dtype))


def _check_measurements(a, y) -> None:
    _check_matrix(a)
    check_floating("y", y)
    if jnp.ndim(y) < 1 or jnp.shape(y)[-1] != a.shape[0]:
        raise ValueError(f"y must have shape [..., m] with m = {a.shape[0]}, got {jnp.shape(y)}")


def omp(a: jax.Array, y: jax.Array, s: int) -> SparseVectors:
    """Orthogonal matching pursuit (module docstring): the `s`-sparse `z` with `A z ~ y`.

    `a: [m, d]`, `y: [..., m]`, `1 <= s <= min(m, d)`. Returns `SparseVectors` of dimension `d`
    with `s` slots, `indices: [..., s]` (the chosen columns, in the order chosen) and
    `values: [..., s]` (the least-squares coefficients), in `a`'s dtype.
    """
    _check_measurements(a, y)
    check_positive_int("s", s)
    if s > min(a.shape):
        raise ValueError(f"s must be <= min(m, d) = {min(a.shape)}, got {s}")
    flat = jnp.asarray(y, a.dtype).reshape(-1, a.shape[0])
    idx, vals = _omp(a, flat, s)
    batch = jnp.shape(y)[:-1]
    return SparseVectors(idx.reshape(*batch, s), vals.reshape(*batch, s), a.shape[1])


@functools.partial(jax.jit, static_argnums=2)
def _omp(a: jax.Array, y: jax.Array, s: int) -> tuple[jax.Array, jax.Array]:
    """`y: [N, m]` -> `(indices [N, s] int32, values [N, s])`."""
    n = y.shape[0]
    rows = jnp.arange(n)[:, None]
    col_norms = jnp.linalg.norm(a, axis=0)
    inv_norms = jnp.where(col_norms > 0, 1 / col_norms, 0)
    slots = jnp.arange(s)

    def step(j, state):
        support, coef, r = state
        corr = jnp.abs(r @ a) * inv_norms  # [N, d]
        chosen = slots < j  # the slots already filled
        # never pick a column twice: the filled slots' columns get -inf (min with +inf: no-op)
        corr = corr.at[rows, support].min(jnp.where(chosen, -jnp.inf, jnp.inf))
        support = support.at[:, j].set(jnp.argmax(corr, axis=1).astype(jnp.int32))
        active = slots <= j
        cols = a.T[support] * active[None, :, None]  # [N, s, m], unfilled slots zero
        # normal equations A_S^T A_S z = A_S^T y; unfilled slots get the identity (z = 0 there)
        gram = cols @ jnp.swapaxes(cols, 1, 2) + jnp.diag(~active).astype(a.dtype)
        coef = jnp.linalg.solve(gram, jnp.einsum("nsm,nm->ns", cols, y)[..., None])[..., 0]
        return support, coef, y - jnp.einsum("ns,nsm->nm", coef, cols)

    init = (jnp.zeros((n, s), jnp.int32), jnp.zeros((n, s), a.dtype), y)
    support, coef, _ = jax.lax.fori_loop(0, s, step, init)
    return support, coef


def basis_pursuit(a, y) -> np.ndarray:
    """`argmin ||z||_1` subject to `A z = y` (module docstring), by `scipy.optimize.linprog`.

    `a: [m, d]`, `y: [..., m]`; returns `z: [..., d]` float64 numpy. Raises `RuntimeError` naming
    the vector when the solver reports no optimum (e.g. `y` outside the range of `A`).
    """
    from scipy.optimize import linprog

    _check_measurements(a, y)
    a64 = np.asarray(a, np.float64)
    ys = np.asarray(y, np.float64)
    flat = ys.reshape(-1, a64.shape[0])
    d = a64.shape[1]
    a_eq = np.concatenate([a64, -a64], axis=1)  # z = u - v
    out = np.empty((len(flat), d))
    for i, yi in enumerate(flat):
        res = linprog(np.ones(2 * d), A_eq=a_eq, b_eq=yi, bounds=(0, None), method="highs")
        if res.status != 0:
            raise RuntimeError(f"basis_pursuit: linprog found no optimum for y[{i}]: {res.message}")
        out[i] = res.x[:d] - res.x[d:]
    return out.reshape(*ys.shape[:-1], d)
