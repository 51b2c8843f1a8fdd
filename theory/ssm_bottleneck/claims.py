"""Claims of Wang et al., "Understanding and mitigating bottlenecks of state space models
through the lens of recency and over-smoothing" (arXiv 2501.00658), measured on the seqlab Mamba
(`seqlab.modules.mamba.Mamba`).

Polarization prepends a state channel with pre-exponential `A = 0` (the "1-channel": decay exactly
1) and appends one with `A = -100` (the "0-channel"). With `h_t = exp(dt_t A) h_{t-1} + dt_t B_t
u_t` the influence of token `s` on the final state `h_T` carries the factor `exp(A * tau(s))` with
`tau(s) = sum_{t > s} dt_t` the elapsed step size, so the log-influence falls at rate `|A|` per
unit of `tau`: 0 on the 1-channel, `|A_n|` on the learnable channels, 100 on the 0-channel.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from seqlab.analysis import rates
from seqlab.analysis.transitions import transition_range
from seqlab.modules.mamba import Mamba
from theory.registry import Context, Outcome, Paper, verdict
from theory.ssm_bottleneck import figures, measures
from theory.ssm_bottleneck.measures import UNDERFLOW

PAPER = Paper("ssm_bottleneck", "Wang et al., recency and over-smoothing in SSMs (2501.00658)")

# "Forgotten after one step": at most 1% of the state survives the step.
FORGET = 0.01


def _polarized(ctx: Context, measure) -> tuple[Mamba, list[np.ndarray]]:
    """A randomly initialized polarized Mamba (`polarize=(1, 1)`) at the context's size, and
    `measure(model, params, x)` on a standard-normal input `x: [T, d_model]`, as float64 arrays."""
    d_model, d_state = ctx.size((8, 8), (16, 16))
    model = Mamba(d_model=d_model, d_state=d_state, polarize=(1, 1))
    params, x = measures.init_with_input(model, ctx.key, ctx.size(64, 256))
    return model, [np.asarray(v, np.float64) for v in measure(model, params, x)]


@PAPER.claim(
    "polar_one_channel_keeps",
    "In a randomly initialized polarized Mamba (polarize=(1, 1)), the influence of token s on the "
    "final SSM state does not decay with distance along the 1-channel (A = 0), while along every "
    "learnable channel it decays exponentially at rate |A_n| per unit of elapsed step size: the "
    "fitted rate is within 0.25 of 0 on the 1-channel and within 25% of |A_n| on each learnable "
    "one.",
    kind="construction",
)
def one_channel_keeps(ctx: Context) -> Outcome:
    model, (infl, dt, A) = _polarized(ctx, measures.influence_and_steps)
    length, a = infl.shape[-1], -A[0]  # [N]: 0, 1..d_state, 100 (infl: [d, N, T], dt: [T, d])

    # Token s enters the scan through the conv window s..s+W-1; beyond it only the state carries it.
    width = model.conv_size
    s = np.arange(length - width + 1)
    tau = measures.elapsed(dt, s + width).T  # [d, S]
    window = infl[:, :, s]  # [d, N, S]
    valid = window > UNDERFLOW
    log_w = np.log(np.where(valid, window, 1.0))
    # log I[d, s] = c_d - rate * tau[d, s]: one pooled rate per state channel n.
    fitted = np.array([-rates.pooled_slope(tau, log_w[:, n], valid[:, n]) for n in range(a.size)])
    learnable = slice(1, 1 + model.d_state)
    rel_err = np.abs(fitted[learnable] - a[learnable]) / a[learnable]

    holds = abs(fitted[0]) <= 0.25 and bool(np.all(rel_err <= 0.25))
    path = ctx.figure()
    figures.influence(path, infl, a, fitted, model.d_state)
    return Outcome(
        measured=dict(
            one_channel_rate=fitted[0],
            learnable_rates=fitted[learnable],
            learnable_max_rel_err=rel_err.max(),
            zero_channel_rate=fitted[-1],
            dt_range=[dt.min(), dt.max()],
        ),
        expected=dict(
            one_channel_rate=0.0,
            learnable_rates=a[learnable].round(4),
            tolerance="|one_channel_rate| <= 0.25; learnable within 25%",
        ),
        verdict=verdict(holds),
        summary=f"1-channel rate {fitted[0]:.3g} (holds iff |rate| <= 0.25); learnable rates "
        f"within {rel_err.max():.1%} of |A_n| (holds iff <= 25%)",
        figures=(path,),
    )


@PAPER.claim(
    "polar_zero_channel_forgets",
    "The 0-channel (A = -100) of a polarized Mamba forgets its state in one step only for large "
    "step sizes: the measured one-step retention dh_t/dh_{t-1} is <= 0.01 for every channel-step "
    "with dt >= ln(100)/100 = 0.046 and > 0.01 for every one with smaller dt. Over the init range "
    "dt in [1e-3, 1e-1] it therefore forgets only at the large-dt end (exp(-100 * 1e-3) = 0.905).",
    kind="construction",
)
def zero_channel_forgets(ctx: Context) -> Outcome:
    model, (rho, dt, A) = _polarized(ctx, measures.retention_and_steps)
    dt, retention, a_zero = dt.ravel(), rho[..., -1].ravel(), float(-A[0, -1])  # [T * d]

    dt_star = math.log(1 / FORGET) / a_zero
    forgets = retention <= FORGET
    # A 1% margin around dt* keeps float32 rounding of samples at the boundary out of the verdict.
    large, small = dt >= dt_star * 1.01, dt <= dt_star * 0.99
    holds = bool(np.all(forgets[large]) and not np.any(forgets[small]))
    path = ctx.figure()
    figures.retention(path, dt, retention, a_zero, dt_star, (model.dt_min, model.dt_max), FORGET)
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
        summary=f"retention <= {FORGET} on {forgets[large].mean():.1%} of steps with dt >= "
        f"{dt_star:.3g} and on {forgets[small].mean():.1%} below (holds iff 100% and 0%)",
        figures=(path,),
    )


# -- recency and over-smoothing ---------------------------------------------------------------


@PAPER.claim(
    "recency_slope",
    "In a Mamba mixer (d_state channels, no polarization), the influence |dy_t/dx_s| decays "
    "exponentially with the distance t - s at least as fast as A_max^(t-s), A_max the largest "
    "transition exp(dt A) seen: the fitted slope of the mean log-influence against distance "
    "(beyond the conv window) is below log A_max by more than 2 standard errors, at init and "
    "after a short training on a delayed copy task (fails if above by more than 2 standard "
    "errors, inconclusive in between).",
    kind="paper",
)
def recency_slope(ctx: Context) -> Outcome:
    d_model, d_state, length, batch, steps = ctx.size((8, 8, 32, 2, 30), (16, 16, 128, 4, 300))
    model = Mamba(d_model=d_model, d_state=d_state)
    k_init, k_x, k_train = jax.random.split(ctx.key, 3)
    xs = jax.random.normal(k_x, (batch, length, d_model), jnp.float32)
    params = jax.jit(model.init)(k_init, xs)
    trained, losses = measures.train_delayed_copy(
        model, params, k_train, steps=steps, delay=2, length=length, batch=batch
    )
    profiles = {
        name: measures.recency_profile(model, p, xs, min_distance=model.conv_size)
        for name, p in (("init", params), ("trained", trained))
    }
    checks = {}
    for name, prof in profiles.items():
        margin = 2 * prof["slope_stderr"]
        checks[name] = dict(
            slope=prof["slope"],
            slope_stderr=prof["slope_stderr"],
            log_a_max=prof["log_a_max"],
            slope_over_log_a_max=prof["slope"] / prof["log_a_max"],
            below=prof["slope"] + margin <= prof["log_a_max"],
            above=prof["slope"] - margin > prof["log_a_max"],
        )
    holds = all(c["below"] for c in checks.values())
    decidable = holds or any(c["above"] for c in checks.values())
    ranges = {
        name: np.asarray(
            [
                np.asarray(v, np.float64)
                for v in transition_range(model.apply(p, xs, method="op_inputs"))
            ]
        )
        for name, p in (("init", params), ("trained", trained))
    }
    path = ctx.figure()
    figures.recency(path, profiles, ranges)
    return Outcome(
        measured=dict(
            **checks,
            loss_first_last=[float(losses[0]), float(losses[-1])],
            a_range_median={k: float(np.median(v[1] - v[0])) for k, v in ranges.items()},
        ),
        expected=dict(slope="<= log A_max - 2 standard errors"),
        verdict=verdict(holds, decidable=decidable),
        # log A_max < 0: slope + 2 s.e. <= log A_max iff (slope + 2 s.e.) / log A_max >= 1.
        summary="(slope + 2 s.e.) / log A_max: "
        + ", ".join(
            f"{k} {(c['slope'] + 2 * c['slope_stderr']) / c['log_a_max']:.3g}"
            for k, c in checks.items()
        )
        + " (holds iff >= 1 at both)",
        figures=(path,),
    )


def _stack(ctx: Context) -> tuple[list, jax.Array]:
    """The over-smoothing stack at the context's size: `measures.stack_layers` and a
    standard-normal input `x: [T, width]`."""
    depth, length, width = ctx.size((8, 32, 8), (24, 128, 16))
    x = jax.random.normal(jax.random.fold_in(ctx.key, 1), (length, width), jnp.float32)
    return measures.stack_layers(ctx.key, depth, width), x


@PAPER.claim(
    "oversmoothing_diameter",
    "Under the over-smoothing theorem's conditions (transitions A_t in [0, 1], A_t + dt_t <= 1, "
    "inputs centered), a stack of SSM layers (seqlab selective_scan, input-dependent dt from real "
    "Mamba layers, B = C = 1, A = -2) never increases any channel's token range max_t x - min_t x, "
    "so the sup-norm token diameter is non-increasing with depth (1e-6 relative slack for "
    "float32). The Euclidean diameter, average pairwise distance and Dirichlet energy are "
    "reported, with a contrast stack (A = -0.5, violating A_t + dt_t <= 1).",
    kind="paper",
)
def oversmoothing_diameter(ctx: Context) -> Outcome:
    layers, x = _stack(ctx)
    runs = {a: measures.ssm_stack(x, layers, a) for a in (2.0, 0.5)}
    ranges = {a: r["xs"].max(axis=1) - r["xs"].min(axis=1) for a, r in runs.items()}  # [K+1, D]
    growth = {a: float(np.max(rg[1:] / rg[:-1])) for a, rg in ranges.items()}
    cond = runs[2.0]
    conditions_met = max(cond["max_a_plus_dt"]) <= 1.0 and min(cond["min_a"]) >= 0.0
    curves = {a: measures.smoothing_curves(r["xs"]) for a, r in runs.items()}
    holds = conditions_met and growth[2.0] <= 1.0 + 1e-6
    path = ctx.figure()
    figures.smoothing(path, {_a_label(a): c for a, c in curves.items()}, "over-smoothing")
    return Outcome(
        measured=dict(
            max_a_plus_dt=max(cond["max_a_plus_dt"]),
            min_transition=min(cond["min_a"]),
            max_channel_range_growth_per_layer=growth[2.0],
            linf_diameter_last_over_first=float(
                curves[2.0]["linf_diameter"][-1] / curves[2.0]["linf_diameter"][0]
            ),
            euclidean_diameter_max_growth_per_layer=float(
                np.max(curves[2.0]["diameter"][1:] / curves[2.0]["diameter"][:-1])
            ),
            relative_dirichlet_energy_first_last=[
                float(curves[2.0]["relative_dirichlet_energy"][i]) for i in (0, -1)
            ],
            contrast_a_0_5=dict(
                max_a_plus_dt=max(runs[0.5]["max_a_plus_dt"]),
                max_channel_range_growth_per_layer=growth[0.5],
            ),
        ),
        expected=dict(
            max_a_plus_dt="<= 1",
            max_channel_range_growth_per_layer="<= 1 + 1e-6",
        ),
        verdict=verdict(holds, decidable=conditions_met),
        summary=f"max channel-range growth per layer {growth[2.0]:.6f} (holds iff <= 1 + 1e-6, "
        f"with max A + dt {max(cond['max_a_plus_dt']):.3g} <= 1); contrast A = -0.5: "
        f"{growth[0.5]:.3g}",
        figures=(path,),
    )


@PAPER.claim(
    "polar_zero_channel_distinct",
    "Polarization's 0-channel (A = -100) keeps tokens distinct with depth: in the same SSM stack "
    "(dt from real Mamba layers, inputs centered and scaled to unit RMS as a pre-norm model "
    "would), after all layers the scale-free relative "
    "Dirichlet energy (mean ||x_{t+1} - x_t||^2 over the token variance) keeps at least half of "
    "its input value with A = -100, and keeps more than with a learnable-init channel (A = -1). "
    "An exact zero transition (A = -inf) and the 1-channel (A = 0) are reported for contrast.",
    kind="paper",
)
def polar_zero_channel_distinct(ctx: Context) -> Outcome:
    layers, x = _stack(ctx)
    decays = (100.0, 1.0, 0.0, math.inf)  # 0-channel, learnable at init, 1-channel, exact 0
    curves = {
        a: measures.smoothing_curves(measures.ssm_stack(x, layers, a, rescale=True)["xs"])
        for a in decays
    }
    kept = {
        a: float(c["relative_dirichlet_energy"][-1] / c["relative_dirichlet_energy"][0])
        for a, c in curves.items()
    }
    holds = kept[100.0] >= 0.5 and kept[100.0] > kept[1.0]
    path = ctx.figure()
    figures.smoothing(path, {_a_label(a): c for a, c in curves.items()}, "polarized channels")
    return Outcome(
        measured=dict(
            relative_dirichlet_energy_kept={_a_label(a): v for a, v in kept.items()},
            depth=len(layers),
        ),
        expected=dict(kept_zero_channel=">= 0.5 and > kept with A = -1"),
        verdict=verdict(holds),
        summary=f"relative Dirichlet energy kept: A = -100 {kept[100.0]:.3g}, A = -1 "
        f"{kept[1.0]:.3g} (holds iff >= 0.5 and more than A = -1)",
        figures=(path,),
    )


def _a_label(a: float) -> str:
    """`"A = -a"` for a decay rate `a >= 0` (`"A = 0"` for the 1-channel)."""
    return "A = 0" if a == 0 else f"A = -{a:g}"
