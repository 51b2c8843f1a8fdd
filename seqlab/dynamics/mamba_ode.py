r"""The continuous-time limit of Mamba's token dynamics (Vo et al., arXiv 2410.03292; DESIGN 3.3).

A Mamba layer with `A^d = -a_d I` (one decay rate per channel), Euler input discretization and no
convolution, gate or skip maps tokens `x: [L, D]` to

$$
y_l = \sum_{j \le l} (x_l^\top M x_j)\,
  \operatorname{diag}\Big(\Delta_j\, e^{-a \sum_{k=j+1}^{l} \Delta_k}\Big)\, x_j,
\qquad \Delta_j = \operatorname{softplus}(S_\Delta x_j + \delta_{\mathrm{bias}}),
\qquad M = S_C^\top S_B.
$$

Stacking such layers as a residual flow `x <- x + tau * y` with shared weights and letting the
step `tau -> 0` gives the ODE `dx/dt = vector_field(x)`, depth playing the role of time. The system
is a causal cascade: token `l` is driven by tokens `<= l` only, so token 1 evolves on its own.

- `vector_field(x, *, M, S_delta, a, delta_bias=None)`: the right-hand side above.
- `field_from_mamba(module, params)`: `(M, S_delta, a, delta_bias)` of a `seqlab.modules.Mamba`;
  `step_size_map(module, params)`: its `(S_delta, delta_bias)` alone.
- `integrate(x0, field, ...)`: adaptive integration with diffrax (Tsit5, PID step control), with
  finite-time blow-up detection by a norm threshold.
"""

import functools
from typing import NamedTuple

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

from seqlab.modules.mamba import Mamba
from seqlab.ops.checks import check_floating, check_shape


class Field(NamedTuple):
    """Parameters of `vector_field`: `M, S_delta: [D, D]`, `a, delta_bias: [D]`."""

    M: jax.Array
    S_delta: jax.Array
    a: jax.Array
    delta_bias: jax.Array


class Trajectory(NamedTuple):
    """A solution of the token ODE.

    `ts: [S]` the requested save times; `xs: [S, L, D]` the tokens there (`inf` after a blow-up);
    `t_end`: the time integration stopped (`t1`, the blow-up time, or where `max_steps` ran out);
    `blew_up`: a token reached `max_norm` at `t_end`; `ok`: integration reached `t1` or
    a blow-up (False when it ran out of steps).
    """

    ts: jax.Array
    xs: jax.Array
    t_end: jax.Array
    blew_up: jax.Array
    ok: jax.Array


def _check_field(x, M, S_delta, a, delta_bias) -> None:
    check_floating("x", x)
    check_shape("x", x, (None, None), "[L, D]")
    d = x.shape[1]
    check_shape("M", M, (d, d), "[D, D]")
    check_shape("S_delta", S_delta, (d, d), "[D, D]")
    check_shape("a", a, (d,), "[D]")
    if delta_bias is not None:
        check_shape("delta_bias", delta_bias, (d,), "[D]")


def vector_field(x, *, M, S_delta, a, delta_bias=None) -> jax.Array:
    """`dx/dt: [L, D]` of the continuous-time Mamba token dynamics at tokens `x: [L, D]`.

    `dx_l/dt = sum_{j<=l} (x_l^T M x_j) * dt_j * exp(-a * (c_l - c_j)) * x_j` (elementwise in the
    channel), with `dt = softplus(x S_delta^T + delta_bias): [L, D]` and `c = cumsum(dt)`, so that
    `c_l - c_j = sum_{k=j+1..l} dt_k`.

    Args:
      x: `[L, D]` tokens.
      M: `[D, D]` interaction matrix `S_C^T S_B`.
      S_delta: `[D, D]` step-size projection.
      a: `[D]` decay rates (positive for the paper's setting; not checked, so that it traces).
      delta_bias: `[D]` or None (zero).

    Computed in the dtype of `x` (the parameters are cast to it); `O(L^2 D)` work and memory.
    """
    _check_field(x, M, S_delta, a, delta_bias)
    dtype = x.dtype
    M, S_delta, a = (jnp.asarray(v, dtype) for v in (M, S_delta, a))
    bias = jnp.zeros((x.shape[1],), dtype) if delta_bias is None else jnp.asarray(delta_bias, dtype)
    dt = jax.nn.softplus(x @ S_delta.T + bias)  # [L, D]
    c = jnp.cumsum(dt, axis=0)
    causal = jnp.tril(jnp.ones((x.shape[0],) * 2, bool))[:, :, None]  # [l, j, 1]: j <= l
    # Mask before exp: for j > l the gap is negative and exp(+a * gap) could overflow.
    gap = jnp.where(causal, c[:, None, :] - c[None, :, :], 0.0)  # [l, j, D], >= 0 where kept
    decay = jnp.where(causal, jnp.exp(-a * gap), 0.0)
    coupling = x @ M @ x.T  # [l, j] = x_l^T M x_j
    return jnp.einsum("lj,ljd,jd->ld", coupling, decay, dt * x)


def field_from_mamba(module: Mamba, params) -> Field:
    """The ODE parameters of a `Mamba` mixer, on its inner channels (`D = d_inner`).

    `M = S_C^T S_B` (`interaction_matrix`), `S_delta = W_dt S_dt` (dt_proj after the dt part of
    x_proj), `a = -A[:, 0]` and `delta_bias = dt_bias`. The ODE assumes `A^d = -a_d I`: every state
    channel of an inner channel decays at one rate. Raises `ValueError` when the module's state
    matrix has different entries within a row (as the S4D-real init `A = -(1..N)` and polarized
    channels do); set `A_log[d, :]` to one value per row first. Call outside `jit` (it inspects
    values).
    """
    if not isinstance(module, Mamba):
        raise ValueError(
            f"module must be a seqlab.modules.mamba.Mamba, got {type(module).__name__}"
        )
    A = np.asarray(module.apply(params, method="state_matrix"))  # [d_inner, N]
    if not np.all(A[:, :1] == A):
        spread = float(np.max(A.max(1) - A.min(1)))
        raise ValueError(
            "module's state matrix A must have one value per row (A^d = -a_d I), got rows spread "
            f"by up to {spread:.3g}; set params['params']['A_log'][d, :] to a single value per row"
        )
    if np.any(A[:, 0] >= 0):
        raise ValueError("module's state matrix A must be negative (a_d > 0) in every row")
    S_delta, delta_bias = step_size_map(module, params)
    return Field(
        M=module.apply(params, method="interaction_matrix"),
        S_delta=S_delta,
        a=jnp.asarray(-A[:, 0], S_delta.dtype),
        delta_bias=delta_bias,
    )


def step_size_map(module: Mamba, params) -> tuple[jax.Array, jax.Array]:
    """`(S_delta: [d_inner, d_inner], delta_bias: [d_inner])` of a `Mamba` mixer: its step size
    on a post-conv token `u` is `dt = softplus(S_delta u + delta_bias)`, `S_delta = W_dt S_dt`.
    float32 (float64 for float64 parameters); any state matrix."""
    s_dt, _, _ = module.apply(params, method="x_proj_maps")  # [dt_rank, d_inner]
    p = params["params"]
    acc = jnp.promote_types(p["dt_proj"].dtype, jnp.float32)
    return p["dt_proj"].astype(acc).T @ s_dt.astype(acc), p["dt_bias"].astype(acc)


def integrate(
    x0: jax.Array,
    field: Field,
    *,
    t1: float,
    ts: jax.Array,
    max_norm: float = 30.0,
    rtol: float = 1e-7,
    atol: float = 1e-10,
    max_steps: int = 16384,
) -> Trajectory:
    """Integrate `dx/dt = vector_field(x)` from `x(0) = x0: [L, D]` to `t1`, or to a blow-up.

    diffrax's Tsit5 (5th-order explicit Runge-Kutta) with a PID step-size controller (`rtol`,
    `atol`). Blow-up detection: integration stops at the end of the first accepted step where some
    token has `||x_l|| >= max_norm`, so `t_end` lies between the crossing and the blow-up. For
    dynamics that blow up like `x' ~ c x^p`, `p > 1`, the time left after the threshold is
    `~ max_norm^(1-p) / (c (p-1))`, so `t_end` approximates the blow-up time to that order. The
    threshold must stay small enough for the steps near it to be representable in the dtype
    (`t * eps`): the default 30 suits float32 (1e3 overflows its step sizes). The system is a
    causal cascade, so the blow-up of token `l` alone is timed by integrating `x0[:l]`. Compiled
    once per shape of `x0` and `ts` and the static arguments; the field, `t1` and `max_norm` are
    traced.

    Args:
      x0: `[L, D]` initial tokens (the integration runs in their dtype).
      field: `Field` (see `field_from_mamba`), cast to the dtype of `x0`.
      t1: final time (> 0).
      ts: `[S]` increasing save times in `[0, t1]`.
      max_norm: blow-up threshold on the token norm.
      rtol, atol, max_steps: step-size control and the step budget.

    Returns:
      `Trajectory`; `xs` is `inf` at save times after `t_end`.
    """
    check_floating("x0", x0)
    check_shape("x0", x0, (None, None), "[L, D]")
    _check_field(x0, *field)
    check_shape("ts", ts, (None,), "[S]")
    dtype = x0.dtype
    field = Field(*(jnp.asarray(v, dtype) for v in field))
    return _solve(
        x0,
        field,
        jnp.asarray(t1, dtype),
        jnp.asarray(ts, dtype),
        jnp.asarray(max_norm, dtype),
        rtol=rtol,
        atol=atol,
        max_steps=max_steps,
    )


def _rhs(t, x, args):
    del t
    return vector_field(x, **args[0]._asdict())


def _blown_up(t, y, args, **kwargs):
    del t, kwargs
    return jnp.max(jnp.linalg.norm(y, axis=-1)) >= args[1]


@functools.partial(jax.jit, static_argnames=("rtol", "atol", "max_steps"))
def _solve(x0, field, t1, ts, max_norm, *, rtol, atol, max_steps):
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(_rhs),
        diffrax.Tsit5(),
        t0=jnp.zeros((), x0.dtype),
        t1=t1,
        dt0=None,
        y0=x0,
        args=(field, max_norm),
        # Two sub-saves: the requested times, and the time where integration stopped.
        saveat=diffrax.SaveAt(subs=[diffrax.SubSaveAt(ts=ts), diffrax.SubSaveAt(t1=True)]),
        stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
        event=diffrax.Event(_blown_up),
        max_steps=max_steps,
        throw=False,
    )
    blew_up = sol.result == diffrax.RESULTS.event_occurred
    ok = blew_up | (sol.result == diffrax.RESULTS.successful)
    t_end = sol.ts[1][0]
    xs = jnp.where((ts <= t_end)[:, None, None], sol.ys[0], jnp.inf)
    return Trajectory(ts=ts, xs=xs, t_end=t_end, blew_up=blew_up, ok=ok)
