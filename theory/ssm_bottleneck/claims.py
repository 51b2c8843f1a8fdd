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
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from seqlab.analysis import rates
from seqlab.analysis.transitions import transition_range
from seqlab.modules.block import Block
from seqlab.modules.mamba import Mamba
from seqlab.train import make_datasets
from theory.registry import Context, Outcome, Paper, verdict
from theory.ssm_bottleneck import figures, measures, mqar
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
    """Step-size maps of the over-smoothing stack at the context's size (`measures.stack_layers`)
    and a standard-normal input `x: [T, width]`."""
    depth, length, width = ctx.size((8, 32, 8), (24, 128, 16))
    x = jax.random.normal(jax.random.fold_in(ctx.key, 1), (length, width), jnp.float32)
    return measures.stack_layers(ctx.key, depth, width), x


A_MAX_SWEEP = (0.5, 0.7, 0.9, 0.95, 0.99)
A_MIN_SWEEP = (0.5, 0.8, 0.9, 0.95, 0.99)


@PAPER.claim(
    "recency_rate_vs_a_max",
    "Theorem 3.1's rate: |dy_t/dx_s| = O(exp(-kappa (t - s))) with kappa = Theta(log 1/A_max). "
    "In a Mamba mixer (init, learnable A scaled so that the largest transition is A_max) swept "
    "over A_max = 0.5, 0.7, 0.9, 0.95, 0.99, the decay rate kappa (minus the slope of "
    "the mean log-influence against distance, beyond the conv window) is proportional to "
    "log(1/A_max): the fitted exponent p of kappa ~ log(1/A_max)^p lies in [0.8, 1.25].",
    kind="paper",
)
def recency_rate_vs_a_max(ctx: Context) -> Outcome:
    d_model, d_state, length, batch = ctx.size((8, 8, 32, 2), (16, 16, 128, 4))
    model = Mamba(d_model=d_model, d_state=d_state)
    k_init, k_x = jax.random.split(ctx.key)
    xs = jax.random.normal(k_x, (batch, length, d_model), jnp.float32)
    params = jax.jit(model.init)(k_init, xs)
    sweep = measures.recency_sweep(
        model, params, xs, A_MAX_SWEEP, min_distance=model.conv_size, max_distance=length - 4
    )
    fit = measures.rate_exponent(sweep["rate"], sweep["a_max"])
    p = fit["slope"]
    holds = bool(np.all(sweep["rate"] > 0)) and 0.8 <= p <= 1.25
    ratio = sweep["rate"] / np.log(1.0 / sweep["a_max"])
    path = ctx.figure()
    figures.rate_vs_a_max(path, sweep, fit, model.conv_size)
    return Outcome(
        measured=dict(
            exponent=p,
            exponent_stderr=fit["slope_stderr"],
            a_max=sweep["a_max"],
            rate=sweep["rate"],
            rate_over_log_inv_a_max=ratio,
            profile_r2=sweep["r2"],
        ),
        expected=dict(exponent="in [0.8, 1.25] (1: proportional)", rate="> 0"),
        verdict=verdict(holds),
        summary=f"kappa ~ log(1/A_max)^p with p = {p:.3f} +- {fit['slope_stderr']:.2g} (holds iff "
        f"in [0.8, 1.25]); kappa / log(1/A_max) from {ratio.min():.3g} to {ratio.max():.3g}",
        figures=(path,),
    )


@PAPER.claim(
    "recency_log_linear_trained",
    "Fig. 1: in a trained Mamba, the log-influence decays linearly with distance. In the default "
    "Mamba language model trained on MQAR (the deeper of the mqar_polarization_table2 runs, "
    "seed 0), "
    "the mean over query positions of log ||dh_t / de_s|| (last block output against input "
    "embeddings) against t - s, beyond the conv window, has a negative slope and R^2 >= 0.9. "
    "The polarized model (A = 1 channel, outside the theorem) is reported for contrast. With "
    "--model, the same fit on the given model over random tokens of its vocabulary.",
    kind="paper",
    on_model=True,
)
def recency_log_linear_trained(ctx: Context) -> Outcome:
    if ctx.model is not None:
        return _recency_given(ctx)
    setup = ctx.size(mqar.QUICK, mqar.FULL)
    length = min(setup.seq_len, 64)  # a causal prefix keeps the Jacobian small at paper size
    trained = mqar.train_all(setup)
    depth = setup.depths[-1]
    runs = {
        name: trained[(polar, depth)] for name, polar in (("default", False), ("polarized", True))
    }
    eval_set = make_datasets(mqar.data_block(setup), batch_size=1, seed=setup.seeds[0])[1]
    tokens = jnp.asarray(eval_set[f"kv{setup.eval_kv}"].batch(0)["inputs"][:, :length])
    lm, conv = trained["model"], Mamba(d_model=setup.d_model).conv_size
    fits = {}
    for name, run in runs.items():
        infl = mqar.block_influence(lm, mqar.seed_params(run["params"], 0), tokens)
        fit = measures.recency_fit(infl, conv, length - 4)
        fits[name] = dict(**fit, r2=measures.r_squared(fit["distances"], fit["profile"]))
    d = fits["default"]
    holds = d["slope"] < 0 and d["r2"] >= 0.9
    path = ctx.figure()
    figures.log_linear(path, fits)
    return Outcome(
        measured={
            name: dict(slope=f["slope"], slope_stderr=f["slope_stderr"], r2=f["r2"])
            for name, f in fits.items()
        }
        | dict(accuracy_seed0={k: float(r["accuracy"][0]) for k, r in runs.items()}),
        expected=dict(default=dict(slope="< 0", r2=">= 0.9")),
        verdict=verdict(holds),
        summary=f"default: slope {d['slope']:.3g}, R^2 {d['r2']:.3f} (holds iff < 0 and >= 0.9); "
        f"polarized: slope {fits['polarized']['slope']:.3g}, R^2 {fits['polarized']['r2']:.3f}",
        figures=(path,),
    )


def _given_tokens(ctx: Context, length: int, batch: int = 1) -> jax.Array:
    """Uniform random tokens `[batch, length]` over the given model's vocabulary."""
    vocab = ctx.model.model.vocab_size
    return jax.random.randint(jax.random.fold_in(ctx.key, 7), (batch, length), 0, vocab)


def _recency_given(ctx: Context) -> Outcome:
    """`recency_log_linear_trained` on `ctx.model` (random tokens; fit beyond the widest
    convolution of its mixers)."""
    lm, params = ctx.model.model, ctx.model.params
    length = ctx.size(48, 128)
    tokens = _given_tokens(ctx, length, ctx.size(2, 4))
    conv = max(getattr(lm.make_mixer(kind), "conv_size", 1) for kind in set(lm.pattern))
    infl = mqar.block_influence(lm, params, tokens)
    fit = measures.recency_fit(infl, conv, length - 4)
    fit["r2"] = measures.r_squared(fit["distances"], fit["profile"])
    holds = fit["slope"] < 0 and fit["r2"] >= 0.9
    path = ctx.figure()
    name = pathlib.Path(ctx.model.source).name
    figures.log_linear(path, {lm.pattern: fit}, title=f"{name}, random tokens")
    return Outcome(
        measured=dict(
            model=ctx.model.source,
            pattern=lm.pattern,
            slope=fit["slope"],
            slope_stderr=fit["slope_stderr"],
            r2=fit["r2"],
            length=length,
        ),
        expected=dict(slope="< 0", r2=">= 0.9"),
        verdict=verdict(holds),
        summary=f"{ctx.model.source} ({lm.pattern}): slope {fit['slope']:.3g}, R^2 "
        f"{fit['r2']:.3f} (holds iff < 0 and >= 0.9)",
        figures=(path,),
    )


def _a_min_sweep(ctx: Context) -> list[dict]:
    """The normalized stack (`measures.normalized_stack`) for each `A_MIN_SWEEP` value: per
    layer, the sup-norm diameter ratio and Theorem 4.2's bound, and the similarity curves."""
    layers, x = _stack(ctx)
    rows = []
    for target in A_MIN_SWEEP:
        run = measures.normalized_stack(x, layers, target)
        ratio = measures.sup_diameter(run["outputs"]) / measures.sup_diameter(run["inputs"])
        # The measures are scale- and shift-free, so the energy of a layer's (normalized) input
        # is that of the previous layer's output.
        curves = measures.smoothing_curves(np.concatenate([run["inputs"][:1], run["outputs"]]))
        energy = curves["relative_dirichlet_energy"]
        rows.append(
            dict(
                a_min=target,
                ratio=ratio,
                bound=1.0 - run["a_min"] ** (x.shape[0] - 1),
                rate=float(-np.log(energy[-1] / energy[0]) / len(layers)),
                curves=curves,
            )
        )
    return rows


@PAPER.claim(
    "oversmoothing_bound",
    "Theorem 4.2: for a selective SSM whose hidden states are convex combinations of the encoded "
    "inputs (here h_t = A_t h_{t-1} + (1 - A_t) x_t, h_1 = x_1, dt from real Mamba layers), "
    "max_{t,s} ||h_t - h_s||_inf <= (1 - A_min^{T-1}) max_{t,s} ||x_t - x_s||_inf. Checked on "
    "every layer of a stack for A_min = 0.5, 0.8, 0.9, 0.95, 0.99 (1e-5 relative slack).",
    kind="paper",
)
def oversmoothing_bound(ctx: Context) -> Outcome:
    rows = _a_min_sweep(ctx)
    over = {r["a_min"]: float(np.max(r["ratio"] / r["bound"])) for r in rows}
    worst = max(over.values())
    path = ctx.figure()
    figures.oversmoothing_bound(path, rows)
    return Outcome(
        measured=dict(
            max_diameter_ratio_over_bound=worst,
            per_a_min={
                f"{r['a_min']:g}": dict(ratio=r["ratio"], bound=r["bound"][0]) for r in rows
            },
        ),
        expected=dict(diameter_ratio="<= (1 - A_min^(T-1)) (1 + 1e-5)"),
        verdict=verdict(worst <= 1.0 + 1e-5),
        summary="largest diameter ratio / bound over layers: "
        + ", ".join(f"{v:.3g} at A_min {a:g}" for a, v in over.items())
        + " (holds iff <= 1 + 1e-5)",
        figures=(path,),
    )


@PAPER.claim(
    "oversmoothing_rate_vs_a_min",
    "Over-smoothing is stronger for larger A_min (Sec. 4: transitions near 1 make the SSM a "
    "uniform averaging operator; the bound 1 - A_min^(T-1) shrinks): in the stack of "
    "oversmoothing_bound, the per-layer decay of the scale-free relative Dirichlet energy, "
    "-log(E_K / E_0) / K, is strictly increasing along A_min = 0.5, 0.8, 0.9, 0.95, 0.99.",
    kind="paper",
)
def oversmoothing_rate_vs_a_min(ctx: Context) -> Outcome:
    rows = _a_min_sweep(ctx)
    rate = np.array([r["rate"] for r in rows])
    increasing = bool(np.all(np.diff(rate) > 0))
    path = ctx.figure()
    figures.oversmoothing_bound(path, rows)
    return Outcome(
        measured=dict(a_min=list(A_MIN_SWEEP), energy_decay_per_layer=rate),
        expected=dict(energy_decay_per_layer="strictly increasing in A_min"),
        verdict=verdict(increasing),
        summary=f"energy decay per layer {', '.join(f'{v:.3g}' for v in rate)} at A_min "
        f"{', '.join(f'{a:g}' for a in A_MIN_SWEEP)} (holds iff strictly increasing)",
        figures=(path,),
    )


def _mixer_input(ctx: Context) -> tuple[int, int, int, jax.Array]:
    """`(depth, d_model, d_state, x: [T, d_model])` of the real-mixer stacks."""
    depth, length, d_model, d_state = ctx.size((12, 32, 16, 8), (24, 128, 32, 16))
    x = jax.random.normal(jax.random.fold_in(ctx.key, 1), (length, d_model), jnp.float32)
    return depth, d_model, d_state, x


def _kept(xs: np.ndarray) -> float:
    """Relative Dirichlet energy of the last layer over that of the input (`xs: [K + 1, T, D]`)."""
    energy = measures.smoothing_curves(xs[[0, -1]])["relative_dirichlet_energy"]
    return float(energy[1] / energy[0])


@PAPER.claim(
    "oversmoothing_mixer",
    "Over-smoothing with depth (Sec. 4, Fig. 5) on the real mixer: in a stack of randomly "
    "initialized seqlab Mamba mixers on standard-normal tokens, the scale-free relative "
    "Dirichlet energy after all layers is at most 0.9 of its input value, both for the bare "
    "stack (x <- mixer(RMSNorm(x))) and with the residual path (x <- x + mixer(RMSNorm(x))). "
    "With --model, the given model's blocks on the embeddings of random tokens: its mixers alone "
    "(bare) and its blocks as they are (residual, with their MLPs).",
    kind="paper",
    on_model=True,
)
def oversmoothing_mixer(ctx: Context) -> Outcome:
    if ctx.model is not None:
        lm = ctx.model.model
        tokens = _given_tokens(ctx, ctx.size(32, 128))
        runs = measures.model_streams(lm, ctx.model.params, tokens[0])
        depth, label, extra = len(lm.pattern), ctx.model.source, dict(model=ctx.model.source)
    else:
        depth, d_model, d_state, x = _mixer_input(ctx)
        block, params = measures.mixer_blocks(ctx.key, depth, d_model, d_state=d_state)
        runs = {
            name: measures.block_stack(block, params, x, residual=residual)
            for name, residual in (("bare", False), ("residual", True))
        }
        inputs = block.apply(params[0], x[None], method=lambda m, v: m.mixer.op_inputs(v))
        a_lo, a_hi = (np.asarray(v, np.float64) for v in transition_range(inputs))
        label = "Mamba mixers"
        extra = dict(first_layer_a_min_max=[float(a_lo.min()), float(a_hi.max())])
    kept = {name: _kept(xs) for name, xs in runs.items()}
    holds = all(v <= 0.9 for v in kept.values())
    path = ctx.figure()
    figures.smoothing(path, {n: measures.smoothing_curves(xs) for n, xs in runs.items()}, label)
    return Outcome(
        measured=dict(
            relative_dirichlet_energy_kept=kept,
            normalized_diameter_kept={
                n: float(
                    measures.smoothing_curves(xs[[0, -1]])["normalized_diameter"][1]
                    / measures.smoothing_curves(xs[[0, -1]])["normalized_diameter"][0]
                )
                for n, xs in runs.items()
            },
            depth=depth,
            **extra,
        ),
        expected=dict(relative_dirichlet_energy_kept="<= 0.9 in both stacks"),
        verdict=verdict(holds),
        summary=f"relative Dirichlet energy kept after {depth} layers: bare {kept['bare']:.3g}, "
        f"residual {kept['residual']:.3g} (holds iff both <= 0.9)",
        figures=(path,),
    )


@PAPER.claim(
    "polar_zero_channel_distinct",
    "Polarization's 0-channel (A = -100) mitigates over-smoothing, in the model's own setting: "
    "one state channel of N, summed through C with the others. In the stacks of "
    "oversmoothing_mixer built with polarize=(0, 1), against the same parameters with the "
    "0-channel ablated (its B and C columns removed), the 0-channel keeps at least 1.1 times the "
    "relative Dirichlet energy of the ablation after all layers, in every stack (bare, residual) "
    "where the ablation over-smooths (keeps <= 0.9); inconclusive if none does.",
    kind="paper",
)
def polar_zero_channel_distinct(ctx: Context) -> Outcome:
    depth, d_model, d_state, x = _mixer_input(ctx)
    block, params = measures.mixer_blocks(ctx.key, depth, d_model, d_state=d_state, polarize=(0, 1))
    ablated = Block(mixer=Mamba(d_model=d_model, d_state=d_state))
    ablated_params = [measures.without_zero_channel(p, block.mixer) for p in params]
    kept, curves = {}, {}
    for name, residual in (("bare", False), ("residual", True)):
        with_zero = measures.block_stack(block, params, x, residual=residual)
        without = measures.block_stack(ablated, ablated_params, x, residual=residual)
        kept[name] = dict(with_zero=_kept(with_zero), ablated=_kept(without))
        curves[f"{name}, 0-channel"] = measures.smoothing_curves(with_zero)
        curves[f"{name}, ablated"] = measures.smoothing_curves(without)
    smoothing = [n for n, k in kept.items() if k["ablated"] <= 0.9]
    gain = {n: k["with_zero"] / k["ablated"] for n, k in kept.items()}
    holds = all(gain[n] >= 1.1 for n in smoothing)
    path = ctx.figure()
    figures.smoothing(path, curves, "0-channel vs ablated")
    return Outcome(
        measured=dict(relative_dirichlet_energy_kept=kept, gain=gain, decided_by=smoothing),
        expected=dict(gain=">= 1.1 where the ablation keeps <= 0.9"),
        verdict=verdict(holds, decidable=bool(smoothing)),
        summary=f"energy kept with / without the 0-channel: bare {gain['bare']:.3g}, residual "
        f"{gain['residual']:.3g} (holds iff >= 1.1 where the ablation over-smooths: "
        f"{', '.join(smoothing) or 'none'})",
        figures=(path,),
    )


@PAPER.claim(
    "mqar_polarization_table2",
    "Table 2's trend: on MQAR, polarized Mamba (polarize=(1, 1)) recalls better than default "
    "Mamba at 2 and at 4 layers (1 and 2 at quick size), and its gain grows with depth (paper, "
    "256 pairs: +18.7 points at 2 layers, +48.0 at 4). Three seeds per model, accuracy at the "
    "largest kv count; per "
    "depth the paired gain g +- se over seeds. Holds iff g - 2 se > 0 at both depths and g grows "
    "with depth; fails iff some g + 2 se < 0, or both gains are significant and g does not grow; "
    "inconclusive otherwise or when no model is 10 points above chance (2 / vocab).",
    kind="paper",
)
def mqar_polarization_table2(ctx: Context) -> Outcome:
    setup = ctx.size(mqar.QUICK, mqar.FULL)
    trained = mqar.train_all(setup)
    runs = {(p, L): trained[(p, L)] for L in setup.depths for p in (False, True)}
    acc = {k: r["accuracy"] for k, r in runs.items()}
    decision = mqar.table2_verdict(acc, setup.chance)
    path = ctx.figure()
    figures.mqar(path, runs, setup)
    gains = decision["gains"]
    return Outcome(
        measured=dict(
            accuracy={f"{'polar' if p else 'default'}-{L}": a for (p, L), a in acc.items()},
            gain={str(L): g for L, g in gains.items()},
            final_loss={
                f"{'polar' if p else 'default'}-{L}": r["losses"][:, -1]
                for (p, L), r in runs.items()
            },
            chance=setup.chance,
            setup=dict(
                seq_len=setup.seq_len,
                kv=setup.eval_kv,
                steps=setup.steps,
                d_model=setup.d_model,
                seeds=list(setup.seeds),
            ),
        ),
        expected=dict(gain="> 2 se at every depth, larger at 4 layers"),
        verdict=decision["verdict"],
        summary="polar - default at "
        + ", ".join(
            f"{L} layers {100 * g['gain']:+.1f} +- {100 * g['stderr']:.1f}"
            for L, g in gains.items()
        )
        + f" points (kv {setup.eval_kv}, best mean acc "
        f"{100 * max(float(np.mean(a)) for a in acc.values()):.1f}%, chance "
        f"{100 * setup.chance:.1f}%)",
        figures=(path,),
    )
