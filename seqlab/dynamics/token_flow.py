"""Self-attention as interacting particles on the sphere (Geshkovski et al.; Bruno, Pasqualotto,
Agazzi, arXiv 2410.23228; DESIGN.md 3.3).

`n` tokens `x_i` on the unit sphere `S^{d-1}` move by

    dx_i/dt = P_{x_i}( sum_j w_ij V x_j ),   w_ij = exp(beta <Q x_i, K x_j>) / Z_i,
    P_x y = y - <x, y> x,

with `Z_i = sum_j exp(beta <Q x_i, K x_j>)` (SA, softmax-normalized, `normalized=True`) or
`Z_i = n` (USA, unnormalized). `Q = K = V = I` is the paper's setting. On the circle (`d = 2`,
`x = (cos theta, sin theta)`) USA reads
`dtheta_i/dt = -(1/n) sum_j exp(beta cos(theta_i - theta_j)) sin(theta_i - theta_j)`.

USA with `Q = K = V = I` is the gradient flow ascending the interaction energy
`E_beta = (1 / (2 beta n^2)) sum_{i,j} exp(beta <x_i, x_j>)`: with this normalization
`dE/dt = (1/n) sum_i |dx_i/dt|^2` exactly, so `E` never decreases. Along SA it rises too:
`dE/dt = (1/n^2) sum_i Z_i |dx_i/dt|^2` (SA is USA with time rescaled per particle by `n / Z_i`).

Linearized at the uniform measure, the degree-`k` spherical harmonics grow at (Funk-Hecke)

    USA: lambda_k = k (k + d - 2) 2^{d/2-1} Gamma(d/2) beta^{-d/2} I_{k+d/2-1}(beta),
    SA:  lambda_k = k (k + d - 2) I_{k+d/2-1}(beta) / (beta I_{d/2-1}(beta)),

(`d = 2`: `k^2 I_k(beta) / beta`, divided by `I_0(beta)` for SA). Both have the same argmax over
`k`, `dominant_mode(beta, d)`: the number of clusters that emerge on the circle.

- `vector_field`: the right-hand side, dense or blocked over keys (`O(n * block_size)` memory).
- `integrate`: fixed-step projected Euler or RK4 (retraction `x / |x|`), snapshots; jit/vmap-able.
- `energy`, `growth_rate`, `dominant_mode`, `mode_amplitudes`, `circle_clusters`,
  `cluster_count_circle`, `cluster_count`, and `vector_field_reference` (plain float64 numpy, the
  oracle of the tests).
- `on_circle`, `fibonacci_sphere`: particles at given angles of the circle, a near-uniform
  lattice of `S^2`.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse.csgraph
import scipy.special

from seqlab.ops.checks import check_choice, check_floating, check_positive_int, check_shape

METHODS = ("euler", "rk4")


class Trajectory(NamedTuple):
    """Snapshots of a particle flow: `ts: [S]` times, `xs: [S, n, d]` particles (`xs[0] = x0`)."""

    ts: jax.Array
    xs: jax.Array


def _is_concrete(value) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _check_beta(beta, *, positive: bool = False) -> None:
    """Raise `ValueError` unless a concrete `beta` is a finite scalar `>= 0` (`> 0` if
    `positive`). Traced values (under jit/vmap) are checked for their shape only."""
    if jnp.ndim(beta) != 0:
        raise ValueError(f"beta must be a scalar, got shape {jnp.shape(beta)}")
    if _is_concrete(beta):
        b = float(beta)
        if not np.isfinite(b) or b < 0 or (positive and b == 0):
            bound = "> 0" if positive else ">= 0"
            raise ValueError(f"beta must be a finite number {bound}, got {b}")


def _check_particles(x) -> None:
    """`x: [n, d]` floating with `n >= 1, d >= 2`; concrete rows must have unit norm."""
    check_floating("x", x)
    check_shape("x", x, (None, None), "[n, d]")
    n, d = x.shape
    if n < 1 or d < 2:
        raise ValueError(f"x must have shape [n, d] with n >= 1 and d >= 2, got {x.shape}")
    if _is_concrete(x):
        # On the host (numpy), so that it also runs on constants captured by a traced function.
        # sqrt(eps): rows normalized in this dtype are off by ~eps; anything larger is not unit.
        err = float(np.max(np.abs(np.linalg.norm(np.asarray(x), axis=-1) - 1)))
        if not err <= float(np.sqrt(jnp.finfo(x.dtype).eps)):
            raise ValueError(f"x must have unit rows [n, d] (points on S^(d-1)), off by {err:.3g}")


def _check_field_args(x, beta, Q, K, V, block_size) -> None:
    _check_particles(x)
    _check_beta(beta)
    d = x.shape[1]
    for name, m in (("Q", Q), ("K", K), ("V", V)):
        if m is not None:
            check_floating(name, m)
            check_shape(name, m, (d, d), "[d, d]")
    if block_size is not None:
        check_positive_int("block_size", block_size)


def _project(x, y):
    """`P_x y = y - <x, y> x`, row by row: `[n, d]`."""
    return y - jnp.sum(x * y, axis=-1, keepdims=True) * x


def _maps(x, Q, K, V):
    """Queries, keys, values `[n, d]` (`x M^T`; `x` itself where `M` is None)."""
    return tuple(x if m is None else x @ jnp.asarray(m, x.dtype).T for m in (Q, K, V))


def _attend_dense(q, k, v, beta, normalized):
    """`sum_j w_ij v_j: [n, d]` from the full `[n, n]` logits."""
    logits = beta * (q @ k.T)
    w = jax.nn.softmax(logits, axis=-1) if normalized else jnp.exp(logits) / q.shape[0]
    return w @ v


def _attend_blocked(q, k, v, beta, normalized, block_size):
    """`sum_j w_ij v_j: [n, d]`, scanning over blocks of `block_size` keys: `O(n * block)` memory.

    SA keeps a running max `m_i` of the logits, `s_i = sum_j exp(l_ij - m_i)` and
    `a_i = sum_j exp(l_ij - m_i) v_j`, rescaled by `exp(m_old - m_new)` at every block (online
    softmax); USA sums `exp(l_ij) v_j / n`. Keys padded to a whole block are masked out.
    """
    n, d = q.shape
    blocks = -(-n // block_size)
    pad = blocks * block_size - n
    k_blocks = jnp.pad(k, ((0, pad), (0, 0))).reshape(blocks, block_size, d)
    v_blocks = jnp.pad(v, ((0, pad), (0, 0))).reshape(blocks, block_size, d)
    valid = (jnp.arange(blocks * block_size) < n).reshape(blocks, block_size)
    neg_inf = jnp.asarray(-jnp.inf, q.dtype)

    def sa_step(carry, blk):
        m, s, a = carry
        k_b, v_b, ok = blk
        logits = jnp.where(ok, beta * (q @ k_b.T), neg_inf)  # [n, b]
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        rescale = jnp.exp(m - m_new)  # 0 on the first block (m = -inf)
        p = jnp.exp(logits - m_new[:, None])
        return (m_new, s * rescale + p.sum(-1), a * rescale[:, None] + p @ v_b), None

    def usa_step(a, blk):
        k_b, v_b, ok = blk
        p = jnp.where(ok, jnp.exp(beta * (q @ k_b.T)), 0)
        return a + p @ v_b, None

    blks = (k_blocks, v_blocks, valid)
    if normalized:
        init = (jnp.full((n,), neg_inf), jnp.zeros((n,), q.dtype), jnp.zeros_like(q))
        (_, s, a), _ = jax.lax.scan(jax.checkpoint(sa_step), init, blks)
        return a / s[:, None]
    a, _ = jax.lax.scan(jax.checkpoint(usa_step), jnp.zeros_like(q), blks)
    return a / n


def vector_field(x, *, beta, normalized=True, Q=None, K=None, V=None, block_size=None) -> jax.Array:
    """`dx/dt: [n, d]` of self-attention particles `x: [n, d]` (unit rows) on `S^{d-1}`.

    `dx_i/dt = P_{x_i}(sum_j w_ij V x_j)`, `w_ij = exp(beta <Q x_i, K x_j>) / Z_i` with `Z_i`
    the softmax normalizer (`normalized=True`, SA) or `n` (USA); `P_x y = y - <x, y> x`.

    Args:
      x: `[n, d]` particles, unit rows (checked when concrete, to `sqrt(eps)` of the dtype).
      beta: inverse temperature, a scalar `>= 0` (checked when concrete).
      normalized: SA (softmax weights) when True, USA (weights `exp(.) / n`) otherwise.
      Q, K, V: `[d, d]` query, key and value maps, or None for the identity.
      block_size: None for the dense `[n, n]` interaction; otherwise the keys are scanned in
        blocks of this many, so memory is `O(n * block_size)` (for `n` in the hundred thousands).

    Computed in the dtype of `x` (`beta`, `Q`, `K`, `V` are cast to it). USA weights are not
    rescaled, so they overflow once `beta` exceeds the log of the dtype's largest number
    (88 in float32); SA is stable for any `beta`.
    """
    _check_field_args(x, beta, Q, K, V, block_size)
    return _field(x, beta, normalized, Q, K, V, block_size)


def _field(x, beta, normalized, Q, K, V, block_size):
    """`vector_field` without the argument checks (they ran once, outside the integrator)."""
    beta = jnp.asarray(beta, x.dtype)
    q, k, v = _maps(x, Q, K, V)
    if block_size is None:
        y = _attend_dense(q, k, v, beta, normalized)
    else:
        y = _attend_blocked(q, k, v, beta, normalized, block_size)
    return _project(x, y)


def vector_field_reference(x, beta, normalized=True, Q=None, K=None, V=None) -> np.ndarray:
    """Plain float64 numpy `vector_field` (the oracle of the tests): `[n, d]`, dense."""
    x = np.asarray(x, np.float64)
    eye = np.eye(x.shape[1])
    Q, K, V = (eye if m is None else np.asarray(m, np.float64) for m in (Q, K, V))
    logits = beta * (x @ Q.T) @ (x @ K.T).T  # [n, n]: beta <Q x_i, K x_j>
    if normalized:
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
    else:
        w = np.exp(logits) / len(x)
    y = w @ (x @ V.T)
    return y - np.sum(x * y, axis=1, keepdims=True) * x


def energy(x, *, beta) -> jax.Array:
    """`E_beta = (1 / (2 beta n^2)) sum_{i,j} exp(beta <x_i, x_j>)` of `x: [n, d]`, a scalar.

    USA (`Q = K = V = I`) ascends it: `dE/dt = (1/n) sum_i |dx_i/dt|^2 >= 0`.
    """
    _check_particles(x)
    _check_beta(beta, positive=True)
    beta = jnp.asarray(beta, x.dtype)
    n = x.shape[0]
    return jnp.sum(jnp.exp(beta * (x @ x.T))) / (2 * beta * n**2)


def _retract(x):
    """The nearest point of the sphere, row by row: `x / |x|`."""
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _euler(f, x, h):
    return _retract(x + h * f(x))


def _rk4(f, x, h):
    # Classical RK4 on F(y) = f(y / |y|): every stage is tangent at a point of the sphere, and F
    # keeps |y| constant, so this is a fourth-order method whose result is retracted once more.
    k1 = f(x)
    k2 = f(_retract(x + h / 2 * k1))
    k3 = f(_retract(x + h / 2 * k2))
    k4 = f(_retract(x + h * k3))
    return _retract(x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4))


def integrate(
    x0,
    *,
    beta,
    t1,
    n_steps: int,
    n_saves: int,
    method: str = "rk4",
    normalized=True,
    Q=None,
    K=None,
    V=None,
    block_size=None,
) -> Trajectory:
    """Integrate `vector_field` from `x0: [n, d]` over `[0, t1]` in `n_steps` fixed steps.

    `method="rk4"` (projected RK4: stages evaluated at retracted points, the result retracted) or
    `"euler"` (projected Euler `x <- (x + h f(x)) / |.|`). Returns `Trajectory(ts: [S], xs: [S, n,
    d])` with `S = n_saves + 1` snapshots at `t = 0, t1 / n_saves, ..., t1`; `n_steps` must be a
    multiple of `n_saves`. `beta`, `t1`, `Q`, `K`, `V` may be traced (vmap over betas, step sizes
    or initial states); the other options are static. Keyword options as in `vector_field`.
    """
    _check_field_args(x0, beta, Q, K, V, block_size)
    check_positive_int("n_steps", n_steps)
    check_positive_int("n_saves", n_saves)
    if n_steps % n_saves:
        raise ValueError(f"n_steps must be a multiple of n_saves, got {n_steps} and {n_saves}")
    check_choice("method", method, METHODS)
    if jnp.ndim(t1) != 0 or (_is_concrete(t1) and not float(t1) > 0):
        raise ValueError(f"t1 must be a positive scalar, got {t1}")
    return _integrate(x0, beta, t1, Q, K, V, n_steps, n_saves, method, bool(normalized), block_size)


@functools.partial(jax.jit, static_argnums=(6, 7, 8, 9, 10))
def _integrate(x0, beta, t1, Q, K, V, n_steps, n_saves, method, normalized, block_size):
    dtype = x0.dtype
    h = jnp.asarray(t1, dtype) / n_steps
    f = functools.partial(
        _field, beta=beta, normalized=normalized, Q=Q, K=K, V=V, block_size=block_size
    )
    step = {"euler": _euler, "rk4": _rk4}[method]
    per_save = n_steps // n_saves

    def save(x, _):
        x = jax.lax.fori_loop(0, per_save, lambda _, x: step(f, x, h), x)
        return x, x

    _, xs = jax.lax.scan(save, x0, None, length=n_saves)
    ts = jnp.arange(n_saves + 1, dtype=dtype) * (h * per_save)
    return Trajectory(ts, jnp.concatenate([x0[None], xs]))


def _check_dimension(d) -> None:
    if isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 2:
        raise ValueError(f"d must be an int >= 2 (particles on S^(d-1)), got {d!r}")


def growth_rate(k, beta, d, *, normalized=True) -> np.ndarray:
    """Linearized growth rate `lambda_k` of the degree-`k` spherical harmonics at the uniform
    measure on `S^{d-1}` (float64 numpy, shape of `k`; not traceable).

    USA: `k (k + d - 2) 2^{d/2-1} Gamma(d/2) beta^{-d/2} I_{k+d/2-1}(beta)`; SA: `k (k + d - 2)
    I_{k+d/2-1}(beta) / (beta I_{d/2-1}(beta))`. Computed with the exponentially scaled Bessel
    function `ive`, so SA is finite for any `beta`; USA overflows to inf past `beta ~ 700`.
    """
    _check_beta(beta, positive=True)
    _check_dimension(d)
    k = np.asarray(k)
    if not np.issubdtype(k.dtype, np.integer) or np.any(k < 0):
        raise ValueError(f"k must hold integers >= 0, got {k}")
    beta = float(beta)
    nu = d / 2 - 1
    laplace = k * (k + d - 2.0)  # -Delta_S Y_k = k (k + d - 2) Y_k
    bessel = scipy.special.ive(k + nu, beta)  # I_{k+nu}(beta) e^{-beta}
    if normalized:
        return laplace * bessel / (beta * scipy.special.ive(nu, beta))
    # In logs: I_nu(beta) = ive * e^beta overflows first; a mode whose ive underflows grows at 0.
    log_scale = nu * np.log(2) + scipy.special.gammaln(d / 2) - (d / 2) * np.log(beta) + beta
    with np.errstate(divide="ignore", over="ignore"):
        return np.exp(np.log(laplace) + np.log(bessel) + log_scale)


def dominant_mode(beta, d) -> int:
    """The degree `k >= 1` of the spherical harmonics growing fastest from the uniform measure on
    `S^{d-1}`: `argmax_k k (k + d - 2) I_{k+d/2-1}(beta)` (SA and USA alike). A Python int;
    `beta > 0` and `d` must be concrete. On the circle this is the number of clusters that
    emerge (`beta = 1, 4, 9, 16, 25, 36, 64, 100 -> 1, 3, 4, 6, 7, 8, 11, 14`)."""
    _check_beta(beta, positive=True)
    _check_dimension(d)
    # I_nu(beta) falls faster than any power of nu once nu > beta, so k <= beta + 16 suffices.
    k = np.arange(1, int(float(beta)) + 17)
    return int(k[np.argmax(growth_rate(k, beta, d))])


def mode_amplitudes(x, ks) -> jax.Array:
    """`|mean_j exp(i k theta_j)|: [len(ks)]`, the Fourier modes of the empirical measure of
    `x: [n, 2]` (points of the circle) at the integers `ks`."""
    check_floating("x", x)
    check_shape("x", x, (None, 2), "[n, 2]")
    z = jax.lax.complex(x[:, 0], x[:, 1])  # e^{i theta}
    ks = jnp.asarray(ks)
    return jnp.abs(jnp.mean(z[None, :] ** ks[:, None], axis=-1))


def circle_clusters(x, *, gap) -> tuple[jax.Array, jax.Array]:
    """`(count, widest)` of `x: [n, 2]` on the circle: the number of clusters (groups of points
    separated by angular gaps `> gap`, radians; 1 when no gap is that wide) and the angular span of
    the widest cluster (`2 pi` when there is one). Traceable (vmap over runs and snapshots).

    Sorted angles `theta_(1) <= ... <= theta_(n)` have gaps `g_i = theta_(i+1) - theta_(i)` (the
    last wraps around by `2 pi`); a cluster's span is the sum of the gaps `<= gap` inside it.
    """
    check_floating("x", x)
    check_shape("x", x, (None, 2), "[n, 2]")
    theta = jnp.sort(jnp.arctan2(x[:, 1], x[:, 0]))
    gaps = jnp.diff(theta, append=theta[:1] + 2 * jnp.pi)  # gaps[i]: from point i to i + 1
    split = gaps > gap
    count = jnp.sum(split)
    start = jnp.argmax(split) + 1  # start right after a split
    gaps, split = jnp.roll(gaps, -start), jnp.roll(split, -start)
    cluster = jnp.cumsum(split) - split  # the cluster of each point
    widths = jax.ops.segment_sum(jnp.where(split, 0.0, gaps), cluster, num_segments=x.shape[0])
    widest = jnp.where(count > 0, jnp.max(widths), 2 * jnp.pi).astype(gaps.dtype)
    return jnp.maximum(count, 1), widest


def cluster_count_circle(x, *, gap) -> jax.Array:
    """The number of clusters of `x: [n, 2]` on the circle (`circle_clusters`)."""
    return circle_clusters(x, gap=gap)[0]


def on_circle(theta) -> jax.Array:
    """Points `[..., n, 2]` of the unit circle at the angles `theta: [..., n]`."""
    return jnp.stack([jnp.cos(theta), jnp.sin(theta)], axis=-1)


def fibonacci_sphere(n: int) -> np.ndarray:
    """`[n, 3]` nearly uniform points of `S^2` (the Fibonacci lattice, float64 numpy): heights
    `z_i = 1 - 2 (i + 1/2) / n` and longitudes advancing by the golden angle `pi (1 + sqrt 5)`."""
    check_positive_int("n", n)
    i = np.arange(n) + 0.5
    z = 1 - 2 * i / n
    phi = np.pi * (1 + np.sqrt(5)) * i
    r = np.sqrt(1 - z**2)
    return np.stack([r * np.cos(phi), r * np.sin(phi), z], axis=-1)


def cluster_count(x, *, cos_min) -> int:
    """The number of clusters of `x: [n, d]` in any dimension: connected components of the graph
    linking `i` and `j` when `<x_i, x_j> > cos_min` (single linkage, on the host; not traceable).
    On the circle it equals `cluster_count_circle` with `gap = arccos(cos_min)`."""
    _check_particles(x)
    x = np.asarray(x, np.float64)
    count, _ = scipy.sparse.csgraph.connected_components(x @ x.T > cos_min, directed=False)
    return int(count)
