"""Claims of Wang et al., "Understanding and mitigating bottlenecks of state space models
through the lens of recency and over-smoothing" (arXiv 2501.00658), measured on the seqlab Mamba
(`seqlab.modules.mamba.Mamba`).

Polarization prepends a state channel with pre-exponential `A = 0` (the "1-channel": decay exactly
1) and appends one with `A = -100` (the "0-channel"). With `h_t = exp(dt_t A) h_{t-1} + dt_t B_t
u_t` the influence of token `s` on the final state `h_T` carries the factor `exp(A * tau(s))` with
`tau(s) = sum_{t > s} dt_t` the elapsed step size, so the log-influence falls at rate `|A|` per
unit of `tau`: 0 on the 1-channel, `|A_n|` on the learnable channels, 100 on the 0-channel.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from seqlab.analysis.influence import token_influence
from seqlab.modules.mamba import Mamba
from seqlab.ops.selective_scan import selective_scan
from theory.registry import Context, Outcome, Paper, verdict

PAPER = Paper("ssm_bottleneck", "Wang et al., recency and over-smoothing in SSMs (2501.00658)")

# Influences below this are float32 underflow, not measurements (the smallest normal is 1.2e-38).
_UNDERFLOW = 1e-30
# "Forgotten after one step": at most 1% of the state survives the step.
FORGET = 0.01


def polarized_mamba(ctx: Context, length: int) -> tuple[Mamba, dict, jax.Array]:
    """A randomly initialized polarized Mamba (`polarize=(1, 1)`), its params and a random input
    `x: [T, d_model]` (float32, standard normal), at the context's size."""
    d_model, d_state = ctx.size((8, 8), (16, 16))
    model = Mamba(d_model=d_model, d_state=d_state, polarize=(1, 1))
    return model, *_init(model, ctx.key, length)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init(model: Mamba, key: jax.Array, length: int) -> tuple[dict, jax.Array]:
    k_init, k_x = jax.random.split(key)
    x = jax.random.normal(k_x, (length, model.d_model), jnp.float32)
    return model.init(k_init, x[None]), x


def step_sizes(inputs: dict) -> jax.Array:
    """`dt = softplus(delta + delta_bias): [T, d_inner]` from one sequence's scan inputs."""
    return jax.nn.softplus(inputs["delta"][0].astype(jnp.float32) + inputs["delta_bias"])


def state_influence(model: Mamba, params: dict, x: jax.Array) -> jax.Array:
    """`I[d, n, s] = ||d h_T[d, n] / d x_s||`: the influence of token `s` of `x: [T, d_model]` on
    the final SSM state `h_T: [d_inner, N]`, through the whole mixer (projection, conv, scan)."""

    def final_state(x):
        inputs = model.apply(params, x[None], method="scan_inputs")
        return selective_scan(**inputs, return_final_state=True)[1][0]

    return token_influence(final_state, x)


@functools.partial(jax.jit, static_argnums=0)
def _influence_and_steps(model: Mamba, params: dict, x: jax.Array):
    """`(I: [d_inner, N, T], dt: [T, d_inner], A: [d_inner, N])` in one compiled call."""
    inputs = model.apply(params, x[None], method="scan_inputs")
    return state_influence(model, params, x), step_sizes(inputs), inputs["A"]


@functools.partial(jax.jit, static_argnums=0)
def _retention_and_steps(model: Mamba, params: dict, x: jax.Array):
    """`(rho: [T, d_inner, N], dt: [T, d_inner], A: [d_inner, N])` in one compiled call."""
    inputs = model.apply(params, x[None], method="scan_inputs")
    return one_step_retention(inputs), step_sizes(inputs), inputs["A"]


def elapsed(dt: np.ndarray, start: np.ndarray) -> np.ndarray:
    """`tau[i, d] = sum_{t >= start[i]} dt[t, d]` for `dt: [T, d]`: the step size still to come."""
    tail = np.concatenate([np.cumsum(dt[::-1], axis=0)[::-1], np.zeros_like(dt[:1])])
    return tail[np.minimum(start, len(dt))]


def decay_rate(log_infl: np.ndarray, tau: np.ndarray, valid: np.ndarray) -> float:
    """The pooled least-squares rate `a` in `log I[d, s] = c_d - a * tau[d, s]` (one intercept per
    inner channel `d`, one common rate), over the `valid` entries. Arrays `[d, S]`."""
    w = valid.astype(np.float64)
    count = np.maximum(w.sum(axis=1, keepdims=True), 1.0)
    tau_c = tau - (w * tau).sum(axis=1, keepdims=True) / count
    log_c = log_infl - (w * log_infl).sum(axis=1, keepdims=True) / count
    return float(-(w * tau_c * log_c).sum() / (w * tau_c**2).sum())


@PAPER.claim(
    "polar_one_channel_keeps",
    "In a randomly initialized polarized Mamba (polarize=(1, 1)), the influence of token s on the "
    "final SSM state does not decay with distance along the 1-channel (A = 0), while along every "
    "learnable channel it decays exponentially at rate |A_n| per unit of elapsed step size: the "
    "fitted rate is within 0.25 of 0 on the 1-channel and within 25% of |A_n| on each learnable "
    "one.",
)
def one_channel_keeps(ctx: Context) -> Outcome:
    length = ctx.size(64, 256)
    model, params, x = polarized_mamba(ctx, length)
    infl, dt, A = (np.asarray(v, np.float64) for v in _influence_and_steps(model, params, x))
    a = -A[0]  # [N]: 0, 1..d_state, 100 (infl: [d, N, T], dt: [T, d])

    # Token s enters the scan through the conv window s..s+W-1; beyond it only the state carries it.
    width = model.d_conv
    s = np.arange(length - width + 1)
    tau = elapsed(dt, s + width).T  # [d, S]
    window = infl[:, :, s]  # [d, N, S]
    valid = window > _UNDERFLOW
    log_w = np.log(np.where(valid, window, 1.0))
    rates = np.array([decay_rate(log_w[:, n], tau, valid[:, n]) for n in range(a.size)])
    learnable = slice(1, 1 + model.d_state)
    rel_err = np.abs(rates[learnable] - a[learnable]) / a[learnable]

    holds = abs(rates[0]) <= 0.25 and bool(np.all(rel_err <= 0.25))
    path = ctx.figure()
    _plot_influence(path, infl, a, rates, model.d_state)
    return Outcome(
        measured=dict(
            one_channel_rate=rates[0],
            learnable_rates=rates[learnable],
            learnable_max_rel_err=rel_err.max(),
            zero_channel_rate=rates[-1],
            dt_range=[dt.min(), dt.max()],
        ),
        expected=dict(
            one_channel_rate=0.0,
            learnable_rates=a[learnable].round(4),
            tolerance="|one_channel_rate| <= 0.25; learnable within 25%",
        ),
        verdict=verdict(holds),
        figures=(path,),
    )


def _plot_influence(path, infl, a, rates, d_state):
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    distance = np.arange(infl.shape[-1])[::-1]
    norm = np.sqrt(np.sum(infl**2, axis=0))  # [N, T]: ||d h_T[:, n] / d x_s||
    channels = [(0, "1-channel (A=0)"), (1, "learnable A=-1"), (d_state, f"learnable A=-{d_state}")]
    for n, label in [*channels, (len(a) - 1, f"0-channel (A=-{a[-1]:g})")]:
        left.semilogy(distance, np.maximum(norm[n], _UNDERFLOW), label=label)
    left.set(xlabel="distance T-1-s", ylabel="||dh_T[:, n] / dx_s||", title="influence on state")
    left.legend(fontsize=8)
    learn = slice(1, 1 + d_state)
    right.plot(a[learn], a[learn], "k:", label="rate = |A_n|")
    right.plot(a[learn], rates[learn], "o", label="learnable (fitted)")
    right.plot([0.0], rates[:1], "s", label="1-channel (fitted)")
    right.set(xlabel="|A_n|", ylabel="fitted decay rate per unit dt", title="decay rates")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=100)


@PAPER.claim(
    "polar_zero_channel_forgets",
    "The 0-channel (A = -100) of a polarized Mamba forgets its state in one step only for large "
    "step sizes: the measured one-step retention dh_t/dh_{t-1} is <= 0.01 for every channel-step "
    "with dt >= ln(100)/100 = 0.046 and > 0.01 for every one with smaller dt. Over the init range "
    "dt in [1e-3, 1e-1] it therefore forgets only at the large-dt end (exp(-100 * 1e-3) = 0.905).",
)
def zero_channel_forgets(ctx: Context) -> Outcome:
    length = ctx.size(64, 256)
    model, params, x = polarized_mamba(ctx, length)
    rho, dt, A = (np.asarray(v, np.float64) for v in _retention_and_steps(model, params, x))
    dt, retention, a_zero = dt.ravel(), rho[..., -1].ravel(), float(-A[0, -1])  # [T * d]

    dt_star = math.log(1 / FORGET) / a_zero
    forgets = retention <= FORGET
    # A 1% margin around dt* keeps float32 rounding of samples at the boundary out of the verdict.
    large, small = dt >= dt_star * 1.01, dt <= dt_star * 0.99
    holds = bool(np.all(forgets[large]) and not np.any(forgets[small]))
    path = ctx.figure()
    _plot_retention(path, dt, retention, a_zero, dt_star, (model.dt_min, model.dt_max))
    return Outcome(
        measured=dict(
            largest_dt_retaining=float(dt[~forgets].max()) if np.any(~forgets) else None,
            smallest_dt_forgetting=float(dt[forgets].min()) if np.any(forgets) else None,
            fraction_forgetting=float(forgets.mean()),
            retention_at_min_dt=float(retention[dt.argmin()]),
            min_dt=float(dt.min()),
            retention_at_max_dt=float(retention[dt.argmax()]),
            max_dt=float(dt.max()),
            max_abs_err_vs_exp=float(np.abs(retention - np.exp(-a_zero * dt)).max()),
        ),
        expected=dict(
            forgets_for_dt_at_least=dt_star,
            retention="exp(-100 dt)",
            threshold=FORGET,
        ),
        verdict=verdict(holds, decidable=bool(np.any(large) and np.any(small))),
        figures=(path,),
    )


def one_step_retention(inputs: dict) -> jax.Array:
    """`rho[t, d, n] = d h_t[d, n] / d h_{t-1}[d, n]` for one sequence's scan inputs, measured by
    forward-mode differentiation of `selective_scan` with respect to its initial state, one token
    at a time (each token becomes a batch entry of length 1)."""
    per_token = {
        k: (jnp.swapaxes(v, 0, 1) if k in ("u", "delta", "B", "C", "z") else v)
        for k, v in inputs.items()
    }
    length, (d_inner, n) = inputs["u"].shape[1], inputs["A"].shape
    h0 = jnp.zeros((length, d_inner, n), inputs["A"].dtype)

    def final(h):
        return selective_scan(**per_token, initial_state=h, return_final_state=True)[1]

    _, tangent = jax.jvp(final, (h0,), (jnp.ones_like(h0),))
    return tangent  # diagonal recurrence: the tangent of a ones-perturbation is the diagonal


def _plot_retention(path, dt, retention, a_zero, dt_star, init_range):
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    grid = np.geomspace(min(dt.min(), init_range[0]) / 2, max(dt.max(), init_range[1]) * 2, 200)
    ax.axvspan(*init_range, color="0.92", label="dt init range")
    ax.loglog(grid, np.exp(-a_zero * grid), "k:", label=f"exp(-{a_zero:g} dt)")
    ax.loglog(dt, np.maximum(retention, _UNDERFLOW), ".", ms=3, label="measured dh_t/dh_{t-1}")
    ax.axhline(FORGET, color="r", lw=0.8, label=f"forgotten (<= {FORGET})")
    ax.axvline(dt_star, color="r", ls="--", lw=0.8, label=f"dt* = {dt_star:.3f}")
    ax.set(xlabel="dt", ylabel="one-step retention", title="0-channel: one-step retention")
    ax.set_ylim(1e-8, 2)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)
