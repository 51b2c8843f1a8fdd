"""Finite-time Lyapunov exponents of a fixed-step discretized flow, exactly.

A vector field `f(t, x)` (`x: [T, D]`, all tokens of a sequence; any shape works) integrated from
`t0` to `t1` by `num_steps` steps of a fixed-step scheme (`"euler"`: `x_{k+1} = x_k + dt f(t_k,
x_k)`, the discretization of an ODE transformer; `"rk4"`: classical Runge-Kutta), with `dt = (t1 -
t0) / num_steps` and `t_k = t0 + k dt`, is the discrete flow map `Phi = phi_{N-1} o ... o phi_0`.
Its Jacobian `J = dPhi/dx_0 = J_{N-1} ... J_0`, `J_k = dphi_k/dx (x_k)`, is what forward-mode
differentiation of the integrator computes: the tangent dynamics of the discrete map, not an
approximation of the continuous one. With `tau = t1 - t0` and an initial frame `Q_0: [n, p]`
(orthonormal columns, `n = x.size`) two exponents are defined:

- `flow_jacobian_exponents`: `lambda_k = log sigma_k(J Q_0) / tau`, the singular values of the
  Jacobian restricted to the frame (of the whole `J` without a frame), in decreasing order. These
  are the finite-time Lyapunov exponents of the subspace: `sigma_1` is the largest growth
  `|J v| / |v|` over `v` in `span(Q_0)`, reached at the top right singular vector.
- `qr_exponents` (Benettin's QR method): `Z_k = J_k Q_k`, `Z_k = Q_{k+1} R_{k+1}` (QR),
  `mu_j = sum_k log |R_k[j, j]| / tau`. The product `R_N ... R_1` is the R factor of `J Q_0`, so
  exactly `mu_j = log |R[j, j]| / tau` with `J Q_0 = Q R`: `tau (mu_1 + ... + mu_j)` is the log
  of the factor by which `J` stretches the `j`-volume spanned by the first `j` frame vectors
  (Gram-Schmidt order). Hence `sum_j mu_j = sum_j lambda_j` (the full `p`-volume) and
  `mu_1 + ... + mu_j <= lambda_1 + ... + lambda_j` for every `j`, but `mu_1 = log |J q_1| / tau`
  is the growth of the first frame vector, not `lambda_1`, unless `q_1` is the top right singular
  vector. As `tau -> inf` both converge to the top `p` Lyapunov exponents for almost every
  frame (Oseledets); at finite time they differ, and the QR form avoids forming an
  ill-conditioned `J`.

"Per token" (a sequence `x: [T, D]`): the exponents of token `i` are those of the frame
`token_frame(x.shape, i)` (the `D` coordinate directions of token `i`'s initial state): how the
whole output `x(t1)` (all tokens) responds to token `i`'s input. With `out_token=j`,
`flow_jacobian_exponents` restricts the output to token `j`: the singular values of the block
`dx_j(t1) / dx_i(t0): [D, D]` (for a causal flow it is zero, exponent `-inf`, when `j < i`).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_choice, check_floating, check_positive_int, check_shape

METHODS = ("euler", "rk4")
"""The time steppers of a discretized flow (`method=`)."""

VectorField = Callable[[jax.Array, jax.Array], jax.Array]
"""`f(t, x) -> dx/dt`, the right-hand side of an ODE."""


def step(f: VectorField, t: jax.Array, x: jax.Array, dt: jax.Array, method: str) -> jax.Array:
    """One step of the fixed-step scheme `method` (`"euler"` or `"rk4"`) from `(t, x)` with step
    `dt`: `x_{k+1}`, the shape of `x`."""
    check_choice("method", method, METHODS)
    if method == "euler":
        return x + dt * f(t, x)
    k1 = f(t, x)
    k2 = f(t + dt / 2, x + dt / 2 * k1)
    k3 = f(t + dt / 2, x + dt / 2 * k2)
    k4 = f(t + dt, x + dt * k3)
    return x + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def _check(x0, num_steps, t0, t1, method) -> None:
    """Validate the flow's arguments (`t0`, `t1` are Python numbers)."""
    check_floating("x0", x0)
    check_positive_int("num_steps", num_steps)
    check_choice("method", method, METHODS)
    if not t1 > t0:
        raise ValueError(f"t1 must be > t0, got t0={t0}, t1={t1}")


def _times(x0: jax.Array, num_steps: int, t0: float, t1: float) -> tuple[jax.Array, jax.Array]:
    """`(t_k = t0 + k dt: [num_steps], dt)` in the dtype of `x0`."""
    dt = jnp.asarray((t1 - t0) / num_steps, x0.dtype)
    return jnp.asarray(t0, x0.dtype) + jnp.arange(num_steps, dtype=x0.dtype) * dt, dt


def integrate(
    f: VectorField,
    x0: jax.Array,
    *,
    num_steps: int,
    t0: float = 0.0,
    t1: float = 1.0,
    method: str = "euler",
    trajectory: bool = False,
) -> jax.Array:
    """The discrete flow map: `x(t1)` after `num_steps` fixed steps from `x(t0) = x0`.

    Args:
      f: the vector field `f(t, x) -> dx/dt`, `x` of the shape of `x0`.
      x0: `[*S]` initial state (`[T, D]` for a sequence of tokens).
      num_steps, t0, t1, method: the scheme (see the module docstring).
      trajectory: return every state instead of the last.

    Returns:
      `[*S]`, or `[num_steps + 1, *S]` (`x_0 .. x_N`) with `trajectory`.
    """
    _check(x0, num_steps, t0, t1, method)
    ts, dt = _times(x0, num_steps, t0, t1)

    def body(x, t):
        x_next = step(f, t, x, dt, method)
        return x_next, x_next

    x_end, xs = jax.lax.scan(body, x0, ts)
    return jnp.concatenate([x0[None], xs]) if trajectory else x_end


def token_frame(shape: tuple[int, int], token: int, dtype=jnp.float32) -> jax.Array:
    """The coordinate frame of token `token` in a state of shape `[T, D]`: `[D, T, D]`, frame vector
    `d` is 1 at `[token, d]` and 0 elsewhere."""
    if len(shape) != 2:
        raise ValueError(f"shape must be [T, D], got {tuple(shape)}")
    length, d = shape
    if not 0 <= token < length:
        raise ValueError(f"token must be in [0, {length}), got {token}")
    return jnp.zeros((d, length, d), dtype).at[:, token, :].set(jnp.eye(d, dtype=dtype))


def _frame_matrix(x0: jax.Array, frame: jax.Array | None) -> jax.Array:
    """`frame: [p, *S]` (the identity when None) as validated vectors `[p, *S]` in `x0.dtype`."""
    if frame is None:
        return jnp.eye(x0.size, dtype=x0.dtype).reshape(x0.size, *x0.shape)
    check_floating("frame", frame)
    check_shape("frame", frame, (None, *x0.shape), "[p, *x0.shape]")
    if not 0 < frame.shape[0] <= x0.size:
        raise ValueError(f"frame must hold 1..{x0.size} vectors [p, *x0.shape], got {frame.shape}")
    return frame.astype(x0.dtype)


def _orthonormal(vectors: jax.Array) -> jax.Array:
    """Gram-Schmidt of the rows of `vectors: [p, *S]` (reduced QR, signs kept), `[p, *S]`."""
    p = vectors.shape[0]
    q, r = jnp.linalg.qr(vectors.reshape(p, -1).T)
    return (q * jnp.sign(jnp.diagonal(r))).T.reshape(vectors.shape)


def flow_jacobian(
    f: VectorField,
    x0: jax.Array,
    *,
    num_steps: int,
    t0: float = 0.0,
    t1: float = 1.0,
    method: str = "euler",
    frame: jax.Array | None = None,
) -> jax.Array:
    """`J v` for every vector `v` of `frame`: the exact Jacobian of the discrete flow map applied to
    the frame (forward mode through the integrator; the identity frame gives `jax.jacfwd`).

    Args:
      frame: `[p, *S]` tangent vectors at `x0` (default: the `n = x0.size` coordinate vectors).

    Returns:
      `[p, *S]`, row `j` the image `J frame[j]`.
    """
    _check(x0, num_steps, t0, t1, method)
    vectors = _frame_matrix(x0, frame)
    flow = lambda x: integrate(f, x, num_steps=num_steps, t0=t0, t1=t1, method=method)  # noqa: E731
    _, jvp = jax.linearize(flow, x0)
    return jax.vmap(jvp)(vectors)


def flow_jacobian_exponents(
    f: VectorField,
    x0: jax.Array,
    *,
    num_steps: int,
    t0: float = 0.0,
    t1: float = 1.0,
    method: str = "euler",
    frame: jax.Array | None = None,
    out_token: int | None = None,
    return_vectors: bool = False,
):
    """Finite-time exponents `log sigma_k(J Q_0) / (t1 - t0)`, decreasing (module docstring).

    Args:
      f, x0, num_steps, t0, t1, method: the flow (see `integrate`).
      frame: `[p, *S]` orthonormal input directions (default: all coordinates, the full `J`).
      out_token: restrict the output to token `out_token` of `x(t1): [T, D]` (`x0` of rank 2).
      return_vectors: also return the right singular vectors.

    Returns:
      `[min(p, m)]` exponents (`m` the output size: `x0.size`, or `D` with `out_token`), and with
      `return_vectors` also `[min(p, m), *S]`: row `k` the unit input direction `v_k` in the span of
      the frame with `|J v_k| = sigma_k` (up to sign).
    """
    if out_token is not None and (x0.ndim != 2 or not 0 <= out_token < x0.shape[0]):
        raise ValueError(
            f"out_token must index a token of x0 [T, D], got {out_token} for {x0.shape}"
        )
    images = flow_jacobian(f, x0, num_steps=num_steps, t0=t0, t1=t1, method=method, frame=frame)
    if out_token is not None:
        images = images[:, out_token]
    vectors = _frame_matrix(x0, frame)
    p = vectors.shape[0]
    # images.T = U diag(sigma) Vh: [m, p]; the input directions are the rows of Vh @ frame.
    _, sigma, vh = jnp.linalg.svd(images.reshape(p, -1).T, full_matrices=False)
    exponents = jnp.log(sigma) / (t1 - t0)
    if not return_vectors:
        return exponents
    return exponents, (vh @ vectors.reshape(p, -1)).reshape(-1, *x0.shape)


def qr_exponents(
    f: VectorField,
    x0: jax.Array,
    *,
    num_steps: int,
    t0: float = 0.0,
    t1: float = 1.0,
    method: str = "euler",
    frame: jax.Array | None = None,
) -> jax.Array:
    """QR-method exponents `mu_j = sum_k log |R_k[j, j]| / (t1 - t0)` (module docstring).

    The tangent frame is propagated through each step's exact linearization and re-orthonormalized
    by QR after every step. `frame` (default: all coordinates) is first orthonormalized in its own
    order (Gram-Schmidt), so only growth from `t0` on counts.

    Args:
      f, x0, num_steps, t0, t1, method: the flow (see `integrate`).
      frame: `[p, *S]` initial directions.

    Returns:
      `[p]` exponents in frame order (not sorted).
    """
    _check(x0, num_steps, t0, t1, method)
    q0 = _orthonormal(_frame_matrix(x0, frame))
    p = q0.shape[0]
    ts, dt = _times(x0, num_steps, t0, t1)

    def body(carry, t):
        x, q, log_growth = carry
        x_next, jvp = jax.linearize(lambda y: step(f, t, y, dt, method), x)
        z = jax.vmap(jvp)(q).reshape(p, -1).T  # [n, p]: Z_k = J_k Q_k
        q_next, r = jnp.linalg.qr(z)
        log_growth = log_growth + jnp.log(jnp.abs(jnp.diagonal(r)))
        return (x_next, q_next.T.reshape(q.shape), log_growth), None

    init = (x0, q0, jnp.zeros(p, x0.dtype))
    (_, _, log_growth), _ = jax.lax.scan(body, init, ts)
    return log_growth / (t1 - t0)
