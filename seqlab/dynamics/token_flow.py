r"""Self-attention as interacting particles on the sphere (Geshkovski et al.; Bruno, Pasqualotto,
Agazzi, arXiv 2410.23228; DESIGN.md 3.3).

`n` tokens `x_i` on the unit sphere `S^{d-1}` move by

$$
\frac{dx_i}{dt} = P_{x_i}\Big(\sum_j w_{ij} V x_j\Big), \qquad
w_{ij} = \frac{e^{\beta \langle Q x_i, K x_j \rangle}}{Z_i}, \qquad
P_x y = y - \langle x, y \rangle x,
$$

with $Z_i = \sum_j e^{\beta \langle Q x_i, K x_j \rangle}$ (SA, softmax-normalized,
`normalized=True`) or $Z_i = n$ (USA, unnormalized). `Q = K = V = I` is the paper's setting.
On the circle (`d = 2`, `x = (cos theta, sin theta)`) USA reads
`dtheta_i/dt = -(1/n) sum_j exp(beta cos(theta_i - theta_j)) sin(theta_i - theta_j)`.

USA with `Q = K = V = I` is the gradient flow ascending the interaction energy
`E_beta = (1 / (2 beta n^2)) sum_{i,j} exp(beta <x_i, x_j>)`: with this normalization
`dE/dt = (1/n) sum_i |dx_i/dt|^2` exactly, so `E` never decreases. Along SA it rises too:
`dE/dt = (1/n^2) sum_i Z_i |dx_i/dt|^2` (SA is USA with time rescaled per particle by `n / Z_i`).

Linearized at the uniform measure, the degree-`k` spherical harmonics grow at (Funk-Hecke)

$$
\text{USA: } \lambda_k = k (k + d - 2)\, 2^{d/2-1}\, \Gamma(d/2)\,
  \beta^{-d/2}\, I_{k+d/2-1}(\beta),
\qquad
\text{SA: } \lambda_k = \frac{k (k + d - 2)\, I_{k+d/2-1}(\beta)}{\beta\, I_{d/2-1}(\beta)},
$$

(`d = 2`: `k^2 I_k(beta) / beta`, divided by `I_0(beta)` for SA). Both have the same argmax over
`k`, `dominant_mode(beta, d)`: the number of clusters that emerge on the circle.

- `vector_field`: the right-hand side, dense or blocked over keys (`O(n * block_size)` memory;
  tiles of queries x keys that stay in cache, one pass over the logits when `Q = K = I`).
- `integrate`: fixed-step projected Euler or RK4 (retraction `x / |x|`), snapshots; jit/vmap-able.
- `energy`, `growth_rate`, `dominant_mode`, `fourier_modes`, `mode_amplitudes`,
  `linearized_modes` (the linearized mean-field solution on the circle), `circle_clusters`,
  `circle_cluster_sizes`,
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
"""The time steppers of the flow (`method=`)."""


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


def _self_shift(Q, K, beta):
    """The largest logit when it is known without looking at the data, else None.

    With `Q = K = I` and unit rows, `beta <x_i, x_j> <= beta <x_i, x_i> = beta`: every row's
    largest logit is `beta` (its own), so `exp(beta (<x_i, x_j> - 1))` lies in `(0, 1]` with the
    self term about 1. Shifting by this constant replaces the running max of an online softmax
    (one pass over the logits instead of two, no rescaling) and keeps USA from overflowing in the
    sum (its `exp(beta)` factor is applied once, at the end).
    """
    return beta if Q is None and K is None else None


def _augment(v):
    """`[v | 1]: [n, d + 1]`: one product `p @ [v | 1]` gives both `sum_j p_ij v_j` and `Z_i`."""
    return jnp.concatenate([v, jnp.ones((v.shape[0], 1), v.dtype)], axis=-1)


def _normalize(acc, n, normalized, log_scale):
    """`(a, scale)` with `a * scale = sum_j w_ij v_j`, from `acc = [sum_j e_ij v_j | sum_j e_ij]`,
    `e_ij = exp(l_ij - log_scale)`: `scale` is `1 / sum` (SA, `[n, 1]`) or `exp(log_scale) / n`
    (USA, a scalar), applied after the projection so that a large USA `beta` overflows only
    where the field does."""
    a, s = acc[:, :-1], acc[:, -1:]
    if normalized:
        return a, 1 / s
    return a, jnp.exp(log_scale - float(np.log(n)))  # a Python float keeps the dtype


def _attend_dense(q, k, v, beta, normalized, shift):
    """`(a, scale)`, `a * scale = sum_j w_ij v_j: [n, d]`, from the full `[n, n]` logits."""
    logits = beta * (q @ k.T)
    if shift is not None:
        return _normalize(jnp.exp(logits - shift) @ _augment(v), q.shape[0], normalized, shift)
    w = jax.nn.softmax(logits, axis=-1) if normalized else jnp.exp(logits) / q.shape[0]
    return w @ v, 1


# Query rows per tile of the blocked interaction: tiles of about this many logits stay in cache.
_TILE = 1 << 20


def _attend_blocked(q, k, v, beta, normalized, block_size, shift):
    """`(a, scale)`, `a * scale = sum_j w_ij v_j: [n, d]`, over tiles of `rows x block_size`
    logits: `O(n * block)` memory.

    The queries are taken `rows = clip(2^20 / block_size, 1, n)` at a time (a tile of logits that
    stays in cache), and for each the keys are scanned in blocks of `block_size`. With a known
    largest logit `shift` (`_self_shift`) one pass accumulates `sum_j exp(l_ij - shift) [v_j | 1]`.
    Otherwise SA keeps a running max `m_i` of the logits, `s_i = sum_j exp(l_ij - m_i)` and
    `a_i = sum_j exp(l_ij - m_i) v_j`, rescaled by `exp(m_old - m_new)` at every block (online
    softmax), and USA sums `exp(l_ij) v_j / n`. Keys and queries padded to whole blocks are masked
    out (keys) or dropped (queries).
    """
    n, d = q.shape
    dv = v.shape[1]
    blocks = -(-n // block_size)
    k_blocks = jnp.pad(k, ((0, blocks * block_size - n), (0, 0))).reshape(blocks, block_size, d)
    valid = (jnp.arange(blocks * block_size) < n).reshape(blocks, block_size)
    rows = min(n, max(1, _TILE // block_size))
    tiles = -(-n // rows)
    q_tiles = jnp.pad(q, ((0, tiles * rows - n), (0, 0))).reshape(tiles, rows, d)
    neg_inf = jnp.asarray(-jnp.inf, q.dtype)

    if shift is not None:
        # Padded keys carry [v | 1] = 0: they add nothing, no mask needed.
        v_blocks = jnp.pad(_augment(v), ((0, blocks * block_size - n), (0, 0)))
        v_blocks = v_blocks.reshape(blocks, block_size, dv + 1)

        def tile(qt):
            def step(acc, blk):
                k_b, v_b = blk
                return acc + jnp.exp(beta * (qt @ k_b.T) - shift) @ v_b, None

            init = jnp.zeros((rows, dv + 1), q.dtype)
            return jax.lax.scan(jax.checkpoint(step), init, (k_blocks, v_blocks))[0]

        acc = jax.lax.map(tile, q_tiles).reshape(tiles * rows, dv + 1)[:n]
        return _normalize(acc, n, normalized, shift)

    v_blocks = jnp.pad(v, ((0, blocks * block_size - n), (0, 0))).reshape(blocks, block_size, dv)

    def sa_step(carry, blk, qt):
        m, s, a = carry
        k_b, v_b, ok = blk
        logits = jnp.where(ok, beta * (qt @ k_b.T), neg_inf)  # [rows, b]
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        rescale = jnp.exp(m - m_new)  # 0 on the first block (m = -inf)
        p = jnp.exp(logits - m_new[:, None])
        return (m_new, s * rescale + p.sum(-1), a * rescale[:, None] + p @ v_b), None

    def usa_step(a, blk, qt):
        k_b, v_b, ok = blk
        p = jnp.where(ok, jnp.exp(beta * (qt @ k_b.T)), 0)
        return a + p @ v_b, None

    blks = (k_blocks, v_blocks, valid)

    def tile(qt):
        if normalized:
            init = (jnp.full((rows,), neg_inf), jnp.zeros((rows,), q.dtype))
            init += (jnp.zeros((rows, dv), q.dtype),)
            step = jax.checkpoint(functools.partial(sa_step, qt=qt))
            (_, s, a), _ = jax.lax.scan(step, init, blks)
            return a / s[:, None]
        step = jax.checkpoint(functools.partial(usa_step, qt=qt))
        return jax.lax.scan(step, jnp.zeros((rows, dv), q.dtype), blks)[0] / n

    return jax.lax.map(tile, q_tiles).reshape(tiles * rows, dv)[:n], 1


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

    Computed in the dtype of `x` (`beta`, `Q`, `K`, `V` are cast to it). SA is stable for any
    `beta`. With `Q = K = I` the sums are shifted by the known largest logit `beta` (every row's
    own), which assumes unit rows (checked when concrete; `integrate` keeps them unit); USA's
    `exp(beta) / n` is then applied once to the sum, which overflows only where the field does.
    With `Q` or `K` given, USA weights are not rescaled and overflow once `beta <Q x_i, K x_j>`
    exceeds the log of the dtype's largest number (88 in float32).
    """
    _check_field_args(x, beta, Q, K, V, block_size)
    return _field(x, beta, normalized, Q, K, V, block_size)


def _field(x, beta, normalized, Q, K, V, block_size):
    """`vector_field` without the argument checks (they ran once, outside the integrator)."""
    beta = jnp.asarray(beta, x.dtype)
    q, k, v = _maps(x, Q, K, V)
    shift = _self_shift(Q, K, beta)
    if block_size is None:
        y, scale = _attend_dense(q, k, v, beta, normalized, shift)
    else:
        y, scale = _attend_blocked(q, k, v, beta, normalized, block_size, shift)
    # P_x is linear: project first, so that a large USA scale multiplies the tangent part only.
    return _project(x, y) * scale


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


def fourier_modes(x, ks) -> jax.Array:
    """`c_k = mean_j exp(i k theta_j): [len(ks)]` (complex), the Fourier coefficients of the
    empirical measure of `x: [n, 2]` (points of the circle) at the integers `ks`."""
    check_floating("x", x)
    check_shape("x", x, (None, 2), "[n, 2]")
    z = jax.lax.complex(x[:, 0], x[:, 1])  # e^{i theta}
    ks = jnp.asarray(ks)
    return jnp.mean(z[None, :] ** ks[:, None], axis=-1)


def mode_amplitudes(x, ks) -> jax.Array:
    """`|c_k|: [len(ks)]`, the moduli of `fourier_modes(x, ks)`."""
    return jnp.abs(fourier_modes(x, ks))


def linearized_modes(c0, ks, t, beta, *, normalized=True) -> np.ndarray:
    """The solution of the mean-field equation on the circle linearized at the uniform measure:
    `c_k(t) = c_k(0) exp(lambda_k t)` (`lambda_k = growth_rate(k, beta, 2)`), float64/complex128
    numpy `[..., T, K]` for `c0: [..., K]` (Fourier coefficients at the integers `ks: [K]`, as
    `fourier_modes`) and times `t: [T]`.

    The continuity equation `d_t rho + d_theta(rho v[rho]) = 0` with the USA velocity
    `v(theta) = -int exp(beta cos(theta - phi)) sin(theta - phi) rho(phi) dphi` reads, for
    `c_k = int exp(i k theta) rho`, `dc_k/dt = -(k / beta) sum_p p I_p(beta) conj(c_p) c_(k+p)`;
    at `c_0 = 1`, `c_(k != 0)` small, only `p = -k` is first order: `dc_k/dt = lambda_k c_k`.
    """
    c0 = np.asarray(c0)
    ks, t = np.asarray(ks), np.asarray(t, np.float64)
    if c0.shape[-1:] != ks.shape or ks.ndim != 1:
        raise ValueError(f"c0 must have shape [..., K], K = len(ks) = {ks.size}, got {c0.shape}")
    if t.ndim != 1:
        raise ValueError(f"t must be a 1-D array of times, got shape {t.shape}")
    rates = growth_rate(ks, beta, 2, normalized=normalized)  # [K]
    return c0[..., None, :] * np.exp(t[:, None] * rates)


def circle_cluster_sizes(x, *, gap) -> tuple[jax.Array, jax.Array]:
    """`(sizes, widths)`, both `[n]`, of the clusters of `x: [n, 2]` on the circle (groups of
    points separated by angular gaps `> gap`, radians): entry `c < count` holds the number of
    points of cluster `c` and its angular span, the other entries 0; with no gap that wide, one
    cluster of all points and width `2 pi`. Traceable (vmap over runs and snapshots).

    Sorted angles `theta_(1) <= ... <= theta_(n)` have gaps `g_i = theta_(i+1) - theta_(i)` (the
    last wraps around by `2 pi`); a cluster's span is the sum of the gaps `<= gap` inside it.
    """
    check_floating("x", x)
    check_shape("x", x, (None, 2), "[n, 2]")
    n = x.shape[0]
    theta = jnp.sort(jnp.arctan2(x[:, 1], x[:, 0]))
    gaps = jnp.diff(theta, append=theta[:1] + 2 * jnp.pi)  # gaps[i]: from point i to i + 1
    split = gaps > gap
    start = jnp.argmax(split) + 1  # start right after a split
    gaps, split = jnp.roll(gaps, -start), jnp.roll(split, -start)
    cluster = jnp.cumsum(split) - split  # the cluster of each point
    widths = jax.ops.segment_sum(jnp.where(split, 0.0, gaps), cluster, num_segments=n)
    sizes = jax.ops.segment_sum(jnp.ones_like(cluster), cluster, num_segments=n)
    none = ~jnp.any(split)
    widths = jnp.where(none, jnp.zeros_like(widths).at[0].set(2 * jnp.pi), widths)
    return sizes, widths.astype(gaps.dtype)


def circle_clusters(x, *, gap) -> tuple[jax.Array, jax.Array]:
    """`(count, widest)` of `x: [n, 2]` on the circle: the number of clusters (groups of points
    separated by angular gaps `> gap`, radians; 1 when no gap is that wide) and the angular span of
    the widest cluster (`2 pi` when there is one). Traceable (vmap over runs and snapshots); see
    `circle_cluster_sizes`."""
    sizes, widths = circle_cluster_sizes(x, gap=gap)
    return jnp.sum(sizes > 0), jnp.max(widths)


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
