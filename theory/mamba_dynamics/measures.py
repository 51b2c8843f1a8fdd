"""Measurements behind the token-dynamics claims: interaction matrices and their spectra, 1-D
fields and the quantities derived from the 1-D ODE (blow-up times, the paper's criterion and what
an integration shows), random fields with a definite symmetric part in D dimensions, a 2-D field
read from a real sign-constrained `Mamba`, and the residual stack whose depth limit is the ODE.

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

from seqlab.analysis import rates
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


def dense_times(t1: float) -> np.ndarray:
    """`[SAVES]` float32 times evenly spaced in `(0, t1]` (the shape of `save_times`, so the
    compiled integration is shared)."""
    return np.linspace(0.0, t1, SAVES + 1)[1:].astype(np.float32)


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
    (`x = +-inf` gives the blow-up time); `x0` and `x` of one sign.

    Computed as `int_{1/x}^{1/x0} u du / (mu softplus(s / u))` (`u = 1/y`, for positive values;
    `(x0, x, s) -> -(x0, x, s)` for negative ones), a finite interval with a smooth integrand, by
    scipy quad (relative error ~1e-10).
    """
    mu, s, x0, x = (float(v) for v in (mu, s, x0, x))  # float64 quadrature for float32 inputs
    if x0 == 0 or x0 * x <= 0:
        raise ValueError(f"x0 and x must be nonzero and of one sign, got x0={x0}, x={x}")
    if x0 < 0:
        return time_to_reach(mu, -s, -x0, -x)

    def rate(u):
        return u / (mu * np.logaddexp(0.0, s / u))

    value = sci_integrate.quad(rate, 1.0 / x, 1.0 / x0, epsabs=0.0, epsrel=1e-10, limit=200)[0]
    return value


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


# -- 1-D scenarios: the paper's criterion and what an integration shows ---------------------------

# Blow-up test: a finite-time blow-up crosses norm 30 and then norm 100 within a vanishing
# fraction of the time (the tail after norm r is ~ 1 / (mu s r^3)); slow divergence needs
# `exp(|s| * 70)` times longer for the same rise.
BLOWUP_NORMS = (30.0, 100.0)
BLOWUP_RTOL = 1e-2


def scenario_1d(mu: float, s: float, x0: np.ndarray) -> str:
    """The paper's 1-D criterion (no dt bias): "converges" for `mu < 0`; for `mu > 0`, "fast"
    (finite-time blow-up) when some `s x_l(0) > 0`, else "slow". `x0: [L]`, no zero entry."""
    x0 = np.asarray(x0, np.float64)
    if x0.ndim != 1 or not np.all(x0 != 0):
        raise ValueError(f"x0 must be [L] with no zero entry, got {x0!r}")
    if mu == 0:
        raise ValueError("mu must be nonzero")
    if mu < 0:
        return "converges"
    return "fast" if np.any(s * x0 > 0) else "slow"


def blowup_time(mu: float, s: float, x0: float) -> float:
    """`T*` of one token alone, `dx/dt = mu x^3 softplus(s x)` from `x0`: finite iff `mu > 0` and
    `s x0 > 0` (inf otherwise)."""
    if mu <= 0 or s * x0 <= 0:
        return math.inf
    return time_to_reach(mu, s, x0, math.copysign(math.inf, x0))


def blowup_bound(mu: float, s: float, x0: np.ndarray) -> float:
    """Comparison bound on the system's blow-up time: `min_l T*(x_l(0))` over the tokens with
    `s x_l(0) > 0` (inf when none). Token `l` obeys `x_l' = mu x_l (x_l^2 softplus(s x_l) +
    sum_{j<l} (>= 0))`, so for `mu > 0` `|x_l|` grows at least as fast as alone."""
    return min([blowup_time(mu, s, float(x)) for x in np.asarray(x0)], default=math.inf)


def observe_1d(mu: float, s: float, a: float, x0: np.ndarray, t1: float) -> dict:
    """What the integrations of the 1-D field show from `x0: [L]` up to `t1`.

    `{"label", "t_blowup", "ratio": [L'], "monotone": str, "ok"}` over the `L'` nonzero tokens
    (a zero token stays zero and drives nothing, so zeros after a prefix integrate the prefix
    alone): "blows_up" when norm 30 is reached and the integration towards norm 100 reaches it, or
    stalls (float32 steps underflow next to a blow-up), within `BLOWUP_RTOL` of that time
    (`t_blowup` the time of norm 30); otherwise the run to `t1` (stopping at norm 1e4) gives the
    ratio `|x_l(t_end)| / |x_l(0)|` and the label "converges" (every ratio <= 1/10), "diverges"
    (every ratio >= 2) or "neither". `ratio` is taken at the last save before the stop when the
    system blows up. `monotone`: "down" when every `|x_l|` is non-increasing at the saves (1e-6
    relative), "up" when every one is non-decreasing, "no" otherwise.
    """
    x0 = np.asarray(x0, np.float32)
    nonzero = x0 != 0
    if x0.ndim != 1 or not nonzero.any():
        raise ValueError(f"x0 must be [L] with a nonzero entry, got {x0!r}")
    low, high = BLOWUP_NORMS
    first = solve_1d(mu, s, a, x0, t1, max_norm=low)
    run, t_blowup = first, math.nan
    if first["blew_up"]:
        second = solve_1d(mu, s, a, x0, t1, max_norm=high)
        stopped = second["blew_up"] or not second["ok"]
        if stopped and second["t_end"] <= first["t_end"] * (1 + BLOWUP_RTOL):
            t_blowup = first["t_end"]
        else:
            run = solve_1d(mu, s, a, x0, t1, max_norm=1e4)
    xs = run["xs"][:, nonzero]
    mag = np.abs(xs[np.isfinite(xs).all(1)])  # [S', L'], saves before t_end
    step = np.diff(mag, axis=0) / mag[:-1]
    monotone = "down" if np.all(step <= 1e-6) else "up" if np.all(step >= -1e-6) else "no"
    ratio = mag[-1] / np.abs(x0[nonzero].astype(np.float64))
    if not math.isnan(t_blowup):
        label = "blows_up"
    elif np.all(ratio <= 0.1):
        label = "converges"
    elif np.all(ratio >= 2.0):
        label = "diverges"
    else:
        label = "neither"
    return dict(label=label, t_blowup=t_blowup, ratio=ratio, monotone=monotone, ok=run["ok"])


SCENARIOS = ("converges", "fast", "slow")


def scenario_draws(key: jax.Array, trials: int, length: int):
    """`trials` draws of `(mu, s, a, x0: [L])` of every sign, draw `i` in scenario
    `SCENARIOS[i % 3]` of `scenario_1d` (uniform draws rarely give the slow one, which needs every
    one of `L` signs to oppose `s`): `|mu|, |s|, a ~ U[0.5, 2]`, `|x0| ~ U[0.5, 1.5]`, the sign of
    `s` and of each token random, then `mu < 0` ("converges"); `mu > 0` and, if no token has
    `s x_l(0) > 0`, one random token flipped ("fast"); `mu > 0` and every token of sign `-sign(s)`
    ("slow")."""
    k_sign, k_draw, k_flip = jax.random.split(key, 3)
    mu, s, a, x0 = one_d_draws(k_draw, trials, length, 1.0)
    s = s * np.where(np.asarray(jax.random.bernoulli(k_sign, 0.5, (trials,))), 1.0, -1.0)
    flip = np.asarray(jax.random.randint(k_flip, (trials,), 0, length))
    for i in range(trials):
        scenario = SCENARIOS[i % 3]
        if scenario == "converges":
            mu[i] = -mu[i]
        elif scenario == "slow":
            x0[i] = -np.sign(s[i]) * np.abs(x0[i])
        elif not np.any(s[i] * x0[i] > 0):
            x0[i, flip[i]] = -x0[i, flip[i]]
    return mu, s, a, x0


def first_positive_draws(key: jax.Array, trials: int, length: int):
    """Draws of `one_d_draws` (`mu > 0`, `s > 0`) with the first token with `s x_l(0) > 0` at a
    random `l0` in `2..L`: tokens before it negative, token `l0` positive, later tokens of random
    sign. Returns `(mu, s, a, x0: [trials, L], l0: [trials])` (`l0` 1-based)."""
    if length < 2:
        raise ValueError(f"length must be >= 2 (l0 > 1), got {length}")
    k_l0, k_draw = jax.random.split(key)
    mu, s, a, x0 = one_d_draws(k_draw, trials, length, 1.0)
    l0 = np.asarray(jax.random.randint(k_l0, (trials,), 2, length + 1))
    index = np.arange(1, length + 1)
    mag = np.abs(x0)
    x0 = np.where(index < l0[:, None], -mag, np.where(index == l0[:, None], mag, x0))
    return mu, s, a, x0.astype(np.float32), l0


# -- higher dimensions ---------------------------------------------------------------------------


def definite_field(key: jax.Array, d: int, sign: float) -> mamba_ode.Field:
    """A random `d`-dimensional field whose `M` has a definite symmetric part of sign `sign`:
    `M = Q diag(sign * U[0.5, 2]) Q^T + K` with `Q` random orthogonal and `K` a random skew matrix
    (so `M` is not symmetric but `x^T M x = x^T sym(M) x`); `S_delta` Gaussian with variance
    `1/d`, `a ~ U[0.5, 2]`, no bias. float32."""
    if sign not in (1.0, -1.0):
        raise ValueError(f"sign must be 1.0 or -1.0, got {sign}")
    k = jax.random.split(key, 5)
    q, _ = jnp.linalg.qr(jax.random.normal(k[0], (d, d)))
    lam = sign * jax.random.uniform(k[1], (d,), minval=0.5, maxval=2.0)
    g = jax.random.normal(k[2], (d, d))
    m = q @ jnp.diag(lam) @ q.T + (g - g.T) / 2
    return mamba_ode.Field(
        M=m.astype(jnp.float32),
        S_delta=(jax.random.normal(k[3], (d, d)) / math.sqrt(d)).astype(jnp.float32),
        a=jax.random.uniform(k[4], (d,), minval=0.5, maxval=2.0).astype(jnp.float32),
        delta_bias=jnp.zeros((d,), jnp.float32),
    )


def token_norms(x0: jax.Array, field: mamba_ode.Field, ts: np.ndarray, max_norm: float) -> dict:
    """Integrate `x0: [L, D]` at save times `ts: [S]` (to `ts[-1]`, stop at `max_norm`):
    `{"ts": [S], "norms": [S, L]` (inf after a stop), `"t_end"`, `"blew_up"`, `"ok"}`."""
    traj = mamba_ode.integrate(
        jnp.asarray(x0, jnp.float32), field, t1=float(ts[-1]), ts=ts, max_norm=max_norm
    )
    return dict(
        ts=np.asarray(traj.ts, np.float64),
        norms=np.linalg.norm(np.asarray(traj.xs, np.float64), axis=-1),
        t_end=float(traj.t_end),
        blew_up=bool(traj.blew_up),
        ok=bool(traj.ok),
    )


def late_exponents(ts: np.ndarray, norms: np.ndarray, decades: float = 2.0) -> np.ndarray:
    """`[L]` fitted exponents `p` in `||x_l|| ~ t^p` over the last `decades` of `ts: [S]`
    (`norms: [S, L]`, finite and positive there)."""
    late = ts >= ts[-1] / 10**decades
    return np.asarray([rates.power_exponent(ts[late], n) for n in norms[late].T])


def norm_x1_min_step(run: dict) -> float:
    """The smallest relative step `(||x_1||_{k+1} - ||x_1||_k) / ||x_1||_k` between the saves of a
    `token_norms` run before its stop (`>= -1e-6`: non-decreasing up to float32 rounding)."""
    n1 = run["norms"][np.isfinite(run["norms"]).all(1), 0]
    if n1.size < 2:
        raise ValueError("run must have at least two saves before its stop")
    return float(np.min(np.diff(n1) / n1[:-1]))


def decay_summary(run: dict) -> tuple[np.ndarray, np.ndarray]:
    """`(ratio, exponent)`, both `[L]`, of a `token_norms` run that reached its last save:
    `||x_l(t_end)|| / ||x_l(0)||` and the fitted exponent of `||x_l||` against `t` over the last
    two decades (`-1/2` for a `t^-1/2` decay). NaN for a run that stopped early."""
    norms = run["norms"]
    if not np.isfinite(norms).all():
        nan = np.full(norms.shape[1], np.nan)
        return nan, nan
    return norms[-1] / norms[0], late_exponents(run["ts"], norms)
