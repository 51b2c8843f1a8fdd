"""Measurements behind the token-dynamics claims: interaction matrices and their spectra, 1-D
fields and the quantities derived from the 1-D ODE, a 2-D field read from a real sign-constrained
`Mamba`, and the residual stack whose depth limit is the ODE.

Token 1 evolves on its own (causal cascade): with `D = 1`, `M = mu`, `S_delta = s`, no bias,

    dx_1/dt = mu * x_1^3 * softplus(s x_1).

- mu < 0: `x_1 -> 0` and `softplus(s x_1) -> ln 2`, so `x_1' ~ -|mu| ln2 x_1^3`, whence
  `d(x_1^-2)/dt -> 2 |mu| ln 2` and `sqrt(t) x_1(t) -> sign(x_1(0)) / sqrt(2 |mu| ln 2)`.
- mu > 0: separating variables, `t(x) = int_{x_1(0)}^{x} dy / (mu y^3 softplus(s y))`. When
  `s x_1(0) > 0`, `softplus(s y) ~ s y` and the integrand `~ 1/(mu s y^4)` is integrable: token 1
  blows up at `T* = t(inf)`. When `s x_1(0) < 0`, `softplus(s y) ~ exp(-|s y|)` and `t(x)` grows
  like `exp(|s| x)`: no finite-time blow-up, `x_1 ~ ln(t) / |s|`.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from scipy import integrate as sci_integrate

from seqlab.dynamics import mamba_ode
from seqlab.modules.mamba import Mamba
from seqlab.ops.selective_scan import selective_scan

# Relative to ||M||_2: float32 products of N terms round at ~1e-7 relative, so eigenvalues and
# singular values below 1e-5 ||M||_2 are zero up to rounding.
REL_TOL = 1e-5
# Save times: log-spaced, so the late-time checks see several decades.
SAVES = 41


def interaction_matrices(model: Mamba, key: jax.Array, count: int) -> np.ndarray:
    """`M = S_C^T S_B` of `count` independent random inits of `model`: `[count, d_inner, d_inner]`.

    Initializing through `interaction_matrix` creates the parameters it reads (x_proj and the
    lambda scales) with the module's initializers, without the unrelated projections. One compiled
    init called per key (compiling a vmapped init costs more than the calls at these sizes).
    """

    @jax.jit
    def one(k):
        params = model.init(k, method="interaction_matrix")
        return model.apply(params, method="interaction_matrix")

    return np.stack([np.asarray(one(k)) for k in jax.random.split(key, count)])


def spectrum_summary(ms: np.ndarray) -> dict[str, np.ndarray]:
    """Per matrix `[count, d, d]`: eigenvalues of the symmetric part scaled by `||M||_2`, the
    numerical rank, and the relative asymmetry `||M - M^T||_F / ||M||_F`."""
    ms = ms.astype(np.float64)
    sym = (ms + np.swapaxes(ms, 1, 2)) / 2
    singular = np.linalg.svd(ms, compute_uv=False)  # [count, d], descending
    norm = singular[:, :1]
    return dict(
        eig=np.linalg.eigvalsh(sym) / norm,  # [count, d], ascending
        rank=np.sum(singular > REL_TOL * norm, axis=1),
        asymmetry=np.linalg.norm(ms - np.swapaxes(ms, 1, 2), axis=(1, 2))
        / np.linalg.norm(ms, axis=(1, 2)),
    )


def save_times(t1: float) -> np.ndarray:
    """`[SAVES]` float32 times log-spaced from `1e-3` to `t1`."""
    return np.geomspace(1e-3, t1, SAVES).astype(np.float32)


def one_d_draws(key: jax.Array, trials: int, length: int, sign: float):
    """`trials` draws of `(mu, s, a, x0: [L])` with `|mu|, s, a ~ U[0.5, 2]`, `mu = sign * |mu|`
    and `|x0| ~ U[0.5, 1.5]` with random signs."""
    k = jax.random.split(key, 5)
    u = lambda kk, shape: np.asarray(jax.random.uniform(kk, shape, minval=0.5, maxval=2.0))  # noqa: E731
    mu, s, a = sign * u(k[0], (trials,)), u(k[1], (trials,)), u(k[2], (trials,))
    mag = np.asarray(jax.random.uniform(k[3], (trials, length), minval=0.5, maxval=1.5))
    signs = np.where(np.asarray(jax.random.bernoulli(k[4], 0.5, (trials, length))), 1.0, -1.0)
    return mu, s, a, (mag * signs).astype(np.float32)


def solve_1d(mu, s, a, x0, t1, max_norm=30.0) -> dict:
    """Integrate the 1-D field `(mu, s, a)` from tokens `x0: [L]` to `t1` (saves `save_times`,
    stop at `|x| >= max_norm`): `{"ts": [S], "xs": [S, L]` (float64), `"t_end"`, `"blew_up"`,
    `"ok"}`."""
    traj = mamba_ode.integrate(
        jnp.asarray(x0, jnp.float32)[:, None],
        one_d_field(mu, s, a),
        t1=t1,
        ts=save_times(t1),
        max_norm=max_norm,
    )
    return dict(
        ts=np.asarray(traj.ts, np.float64),
        xs=np.asarray(traj.xs[:, :, 0], np.float64),  # [S, L]
        t_end=float(traj.t_end),
        blew_up=bool(traj.blew_up),
        ok=bool(traj.ok),
    )


def classify(traj_xs: np.ndarray, blew_up: bool) -> str:
    """'diverges' (blow-up, or every token's norm x10), 'converges' (every norm /10), 'neither'."""
    norms = np.linalg.norm(traj_xs, axis=-1)  # [S, L]
    first, last = norms[0], norms[np.isfinite(norms).all(1)][-1]
    if blew_up or np.all(last >= 10 * first):
        return "diverges"
    if np.all(last <= first / 10):
        return "converges"
    return "neither"


def one_d_field(mu: float, s: float, a: float) -> mamba_ode.Field:
    """The 1-D field `M = [[mu]]`, `S_delta = [[s]]`, `a = [a]`, no bias, in float32."""
    return mamba_ode.Field(
        M=jnp.full((1, 1), mu, jnp.float32),
        S_delta=jnp.full((1, 1), s, jnp.float32),
        a=jnp.full((1,), a, jnp.float32),
        delta_bias=jnp.zeros((1,), jnp.float32),
    )


def convergence_limit(mu: float) -> float:
    """`lim sqrt(t) |x_1(t)| = 1 / sqrt(2 |mu| ln 2)` for mu < 0 (no bias)."""
    return 1.0 / math.sqrt(2.0 * abs(mu) * math.log(2.0))


def time_to_reach(mu: float, s: float, x0: float, x: float) -> float:
    """`t(x) = int_{x0}^{x} dy / (mu y^3 softplus(s y))`: when token 1 (started at x0) reaches x
    (`x = inf` gives the blow-up time). scipy quad, relative error ~1e-10."""

    def rate(y):
        return 1.0 / (mu * y**3 * np.logaddexp(0.0, s * y))

    lo, hi = sorted((x0, x))
    value = sci_integrate.quad(rate, lo, hi, epsabs=0.0, epsrel=1e-10, limit=200)[0]
    return value if hi == x else -value


def mamba_2d_field(constraint: str, key: jax.Array, decay: float = 1.0) -> mamba_ode.Field:
    """The ODE field of a random `Mamba(d_model=1, expand=2, d_state=2, sign_constraint=...)`:
    `D = d_inner = 2`, `M = S_C^T diag(lambda) S_C` from the module, its `S_delta` and `dt_bias`,
    and `A_log` set to `log(decay)` so that `A^d = -decay I`."""
    model = Mamba(d_model=1, d_state=2, sign_constraint=constraint)
    params = model.init(key, jnp.zeros((1, 2, 1), jnp.float32))
    a_log = jnp.full((model.d_inner, model.d_state), math.log(decay), jnp.float32)
    params = {"params": {**params["params"], "A_log": a_log}}
    return mamba_ode.field_from_mamba(model, params)


def scalar_decay_mamba(d_model: int, key: jax.Array, decay_range=(0.5, 2.0)):
    """A random `Mamba(d_model, d_state=4)` with `A_log` set so that `A^d = -a_d I`, `a_d` evenly
    spaced in `decay_range`; its dt bias is raised to `softplus^-1(0.5)` so the dynamics move on
    unit time scales. Returns `(model, params)`."""
    model = Mamba(d_model=d_model, d_state=4)
    params = model.init(key, jnp.zeros((1, 2, d_model), jnp.float32))
    a = jnp.linspace(*decay_range, model.d_inner, dtype=jnp.float32)
    p = dict(params["params"])
    p["A_log"] = jnp.broadcast_to(jnp.log(a)[:, None], (model.d_inner, model.d_state))
    p["dt_bias"] = jnp.full((model.d_inner,), math.log(math.expm1(0.5)), jnp.float32)
    return model, {"params": p}


def residual_stack(model: Mamba, params, x0: jax.Array, tau: float, layers: int) -> jax.Array:
    """`layers` residual steps `x <- x + tau * S6(x)` with the module's shared S6 map on tokens
    `x0: [L, d_inner]` (`Mamba.s6_inputs`, seqlab `selective_scan`): explicit Euler in depth.
    Compiled once per module and shape (`tau` and `layers` are traced)."""
    return _residual_stack(model, params, x0, jnp.asarray(tau, x0.dtype), jnp.asarray(layers))


@functools.partial(jax.jit, static_argnums=0)
def _residual_stack(model, params, x0, tau, layers):
    def step(_, x):
        return x + tau * selective_scan(**model.apply(params, x[None], method="s6_inputs"))[0]

    return jax.lax.fori_loop(0, layers, step, x0)
