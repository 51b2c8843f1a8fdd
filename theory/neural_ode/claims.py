"""Claims of Tong et al., "Neural ODE Transformers: Analyzing Internal Dynamics and Adaptive
Fine-tuning" (arXiv 2503.01329), measured on small `seqlab.modules.ode_transformer.ODETransformer`s
trained on multi-query associative recall (`theory/neural_ode/train.py`).

Every block weight is a function of continuous depth `t` in [0, 1]; the hidden states of a sequence,
`x: [T, D]`, follow `dx/dt = f(t, x)` (parallel attention and MLP branches), integrated by explicit
Euler with `num_steps` steps. The spectra come from `seqlab.analysis.spectra` on
`model.apply(params, t, method="weights")`; the exponents from `seqlab.analysis.lyapunov` on the
model's vector field through the same Euler scheme, so they are those of the model's own discrete
flow map.
"""

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from seqlab.analysis import lyapunov, spectra
from theory.neural_ode import train
from theory.registry import Context, Outcome, Paper, verdict

PAPER = Paper("neural_ode", "Tong et al., neural ODE transformers (2503.01329)")

# A model counts as trained when its evaluation loss is at most this fraction of log V (uniform).
TRAINED_FRACTION = 0.5
# "Increases with t": the fitted line of the mean |lambda| rises by at least 10% of its mean level
# over t in [0, 1].
RISE = 0.1
# Finite differences: `(1/tau) log(growth)` of an `eps`-perturbation tends to the exponent at
# first order in `eps`. Agreement: within FD_TOLERANCE at the smallest `eps`, where the error
# fell >= 3x over the last decade of `eps` (a linear regime, not a chance crossing).
FD_TOLERANCE = 0.02
ALL_EPS = (1.0, 1e-1, 1e-2, 1e-3)
# Step-count transfer: evaluation at a new step count "loses little" when the loss rises by less
# than LITTLE of the gap between log V and the N-step loss; fine-tuning "recovers" when the loss is
# back within RECOVER of that gap above the N-step loss.
LITTLE = 0.1
RECOVER = 0.02


def token_field(model, params):
    """The model's vector field on one sequence: `f(t, x: [T, D]) -> dx/dt: [T, D]`."""
    return lambda t, x: model.apply({"params": params}, t, x[None], method="vector_field")[0]


def initial_state(model, params, tokens: jax.Array) -> jax.Array:
    """`x(0): [T, D]`, the embedded tokens of one sequence `tokens: [T]`, in the dtype of the
    model's residual stream."""
    return model.apply({"params": params}, tokens[None], method="embed")[0].astype(model.acc_dtype)


def _trained(ctx: Context) -> train.Trained:
    return train.trained(train.setup_for(ctx.full))


def _is_trained(tr: train.Trained, loss: float) -> bool:
    return loss <= TRAINED_FRACTION * tr.uniform_loss


# -- spectra along depth ----------------------------------------------------------------------


def depth_spectra(model, params, ts: jax.Array) -> dict[str, np.ndarray]:
    """`{"qk", "ov": [S, H, K], "mlp": [S, min(D, F)]}` complex eigenvalues at depths `ts: [S]`."""
    weights_fn = lambda t: model.apply({"params": params}, t, method="weights")  # noqa: E731
    got = jax.jit(spectra.spectra_along_depth, static_argnums=0)(weights_fn, ts)
    return {k: np.asarray(v) for k, v in got.items()}


def magnitude_trend(ts: np.ndarray, eigs: np.ndarray) -> dict:
    """Magnitudes of `eigs: [S, ...]` along `ts: [S]`: the mean `|lambda|` and the largest over
    the other axes per `t` (`[S]` each), and least-squares slopes of both, absolute and relative
    to the curve's mean level."""
    mags = np.abs(eigs).reshape(len(ts), -1)
    out = {"mean_abs": mags.mean(axis=1), "max_abs": mags.max(axis=1)}
    for name in ("mean_abs", "max_abs"):
        slope = float(np.polyfit(ts, out[name], 1)[0])
        out[f"{name}_slope"] = slope
        out[f"{name}_relative_slope"] = slope / float(out[name].mean())
    return out


@PAPER.claim(
    "qk_eigenvalue_trend",
    "The magnitudes of the eigenvalues of W_Q(t) W_K(t)^T grow with depth t in a trained ODE "
    "transformer. Measured: per head, the eigenvalues at the model's own Euler depths t_k = k/N "
    "(the only weights the trained model uses) on a small model trained on MQAR; holds iff the "
    "least-squares line of the mean |lambda| (over heads) rises by at least 10% of its mean over "
    "[0, 1] (relative slope >= 0.1), fails otherwise; inconclusive when the model did not train "
    "(loss > 0.5 log V). The same on a fine grid of t, at initialization, and for W_V W_O and "
    "W_1 W_2 is reported.",
)
def qk_eigenvalue_trend(ctx: Context) -> Outcome:
    tr = _trained(ctx)
    n = tr.setup.num_steps
    grids = {"euler": np.arange(n) / n, "grid": np.linspace(0.0, 1.0, ctx.size(41, 81))}
    trends = {
        (name, grid): {
            kind: magnitude_trend(ts, eigs)
            for kind, eigs in depth_spectra(tr.model, p, jnp.asarray(ts, jnp.float32)).items()
        }
        for name, p in (("init", tr.init_params), ("trained", tr.params))
        for grid, ts in grids.items()
    }
    loss = train.eval_loss(tr.model, tr.params, tr.eval_data, n)
    qk = trends["trained", "euler"]["qk"]
    holds = qk["mean_abs_relative_slope"] >= RISE
    path = ctx.figure()
    _plot_spectra(path, grids, trends)

    def summary(t):
        keys = ("mean_abs_slope", "mean_abs_relative_slope", "max_abs_relative_slope")
        ends = [t["mean_abs"][0], t["mean_abs"][-1]]
        return {k: t[k] for k in keys} | {"mean_abs_first_last": ends}

    return Outcome(
        measured=dict(
            trained_qk=summary(qk),
            trained_qk_fine_grid=summary(trends["trained", "grid"]["qk"]),
            init_qk=summary(trends["init", "euler"]["qk"]),
            trained_ov=summary(trends["trained", "euler"]["ov"]),
            trained_mlp=summary(trends["trained", "euler"]["mlp"]),
            eval_loss=loss,
            uniform_loss=tr.uniform_loss,
        ),
        expected=dict(
            trained_qk_mean_abs_relative_slope=f">= {RISE} (the paper: magnitudes increase with t)"
        ),
        verdict=verdict(holds, decidable=_is_trained(tr, loss)),
        figures=(path,),
    )


def _plot_spectra(path, grids, trends):
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    titles = {"qk": "W_Q W_K^T", "ov": "W_V W_O", "mlp": "W_1 W_2"}
    for ax, (kind, title) in zip(fig.subplots(1, 3), titles.items(), strict=True):
        for name, style in (("init", ":"), ("trained", "-")):
            t = trends[name, "grid"][kind]
            ax.plot(grids["grid"], t["mean_abs"], style, color="C0", lw=0.8, label=f"{name}: mean")
            ax.plot(grids["grid"], t["max_abs"], style, color="C1", lw=0.8, label=f"{name}: max")
        euler = trends["trained", "euler"][kind]
        ax.plot(grids["euler"], euler["mean_abs"], "o", color="C0", label="trained, t_k: mean")
        ax.plot(grids["euler"], euler["max_abs"], "s", color="C1", label="trained, t_k: max")
        ax.set(xlabel="depth t", ylabel="|eigenvalue|", title=title)
    fig.axes[0].legend(fontsize=7)
    fig.savefig(path, dpi=100)


# -- Lyapunov exponents against finite differences --------------------------------------------


def _unit(v):
    return v / jnp.linalg.norm(v)


def token_exponents(model, params, x0: jax.Array, num_steps: int):
    """Per token `i` of `x0: [T, D]`: the flow-Jacobian exponents of token `i`'s frame `[T, D]`
    (decreasing), the QR exponents `[T, D]` (frame order), and the top input directions
    `[T, T, D]`, all of the model's `num_steps`-step Euler flow on `[0, 1]`."""
    f = token_field(model, params)

    @jax.jit
    def one(frame):
        lam, vecs = lyapunov.flow_jacobian_exponents(
            f, x0, num_steps=num_steps, frame=frame, return_vectors=True
        )
        return lam, lyapunov.qr_exponents(f, x0, num_steps=num_steps, frame=frame), vecs[0]

    per_token = [one(lyapunov.token_frame(x0.shape, i, x0.dtype)) for i in range(x0.shape[0])]
    lam, mu, top = (jnp.stack(v) for v in zip(*per_token, strict=True))
    return np.asarray(lam), np.asarray(mu), top


def perturbation_growth(model, params, x0: jax.Array, num_steps: int):
    """A jitted `(v: [T, D], |v| = 1) -> (fd: [len(ALL_EPS)], linear)` for the model's
    `num_steps`-step Euler flow on `[0, 1]` (tau = 1) from `x0: [T, D]`: `fd[e] = log(|x'(1) -
    x(1)| / eps_e)` with `x'(0) = x0 + eps_e v` through the nonlinear flow, and `linear = log|J v|`
    its eps -> 0 limit from the exact tangent map."""
    f = token_field(model, params)
    flow = lambda x: lyapunov.integrate(f, x, num_steps=num_steps)  # noqa: E731
    eps = jnp.asarray(ALL_EPS, x0.dtype)

    @jax.jit
    def growth(v):
        base, jvp = jax.linearize(flow, x0)
        moved = jax.vmap(flow)(x0 + eps[:, None, None] * v)
        fd = jnp.log(jnp.linalg.norm((moved - base).reshape(len(ALL_EPS), -1), axis=1) / eps)
        return fd, jnp.log(jnp.linalg.norm(jvp(v)))

    return growth


@PAPER.claim(
    "lyapunov_matches_finite_difference",
    "The finite-time Lyapunov exponents of the trained model's flow (per token i: exponents of "
    "the sensitivity of all outputs x(1) to token i's input, through the model's own Euler "
    "flow) are the growth rates of small perturbations: perturbing token i's embedding by eps v "
    "and integrating the nonlinear flow, (1/tau) log(|x'(1) - x(1)| / eps) converges to the top "
    "flow-Jacobian exponent for v the top right singular vector, to the first QR exponent for v "
    "the first frame vector, and to log|J v| for a random v (first, middle and last token, "
    "float32). Holds iff at eps = 1e-3 every probe is within 0.02 and the error fell from "
    "eps = 1e-2 to 1e-3 by at least 3x (or is below 1e-3): the linear regime, where the error "
    "is first order in eps.",
)
def lyapunov_matches_finite_difference(ctx: Context) -> Outcome:
    tr = _trained(ctx)
    n = tr.setup.num_steps
    x0 = initial_state(tr.model, tr.params, jnp.asarray(tr.eval_data[0]["inputs"][0]))
    length, d = x0.shape
    lam, mu, top = token_exponents(tr.model, tr.params, x0, n)
    growth = perturbation_growth(tr.model, tr.params, x0, n)
    probes = sorted({0, length // 2, length - 1})
    rows = {}
    for i, key in zip(probes, jax.random.split(ctx.key, len(probes)), strict=True):
        directions = {
            "top": (top[i], lam[i, 0]),
            "qr_first": (jnp.zeros_like(x0).at[i, 0].set(1.0), mu[i, 0]),
            "random": (
                jnp.zeros_like(x0).at[i].set(_unit(jax.random.normal(key, (d,), x0.dtype))),
                None,
            ),
        }
        for name, (v, exponent) in directions.items():
            fd, linear = growth(v)
            predicted = linear if exponent is None else exponent
            rows[f"token{i}_{name}"] = dict(
                predicted=float(predicted), fd=np.asarray(fd, np.float64)
            )
    errors = {k: np.abs(r["fd"] - r["predicted"]) for k, r in rows.items()}
    converged = all(e[-1] <= FD_TOLERANCE for e in errors.values())
    first_order = all(e[-1] <= max(e[-2] / 3, 1e-3) for e in errors.values())
    volume_gap = float(np.max(np.abs(mu.sum(axis=1) - lam.sum(axis=1))))
    path = ctx.figure()
    _plot_lyapunov(path, lam, mu, rows)
    return Outcome(
        measured=dict(
            max_abs_error_by_eps={
                f"{e:g}": max(float(v[j]) for v in errors.values()) for j, e in enumerate(ALL_EPS)
            },
            converged=converged,
            first_order=first_order,
            top_exponent_by_token=lam[:, 0],
            first_qr_exponent_by_token=mu[:, 0],
            max_qr_vs_svd_volume_gap=volume_gap,
            probes={k: dict(predicted=r["predicted"], fd=r["fd"]) for k, r in rows.items()},
        ),
        expected=dict(
            max_abs_error_at_eps_1e_3=f"<= {FD_TOLERANCE}",
            error_ratio_1e_2_over_1e_3=">= 3 (or error < 1e-3)",
            max_qr_vs_svd_volume_gap="0 (sum of QR = sum of SVD exponents)",
        ),
        verdict=verdict(converged and first_order),
        figures=(path,),
    )


def _plot_lyapunov(path, lam, mu, rows):
    fig = Figure(figsize=(12, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    tokens = np.arange(lam.shape[0])
    left.plot(tokens, lam[:, 0], "o-", label="top flow-Jacobian exponent lambda_1")
    left.plot(tokens, lam[:, -1], "o-", label="lowest lambda_D")
    left.plot(tokens, mu[:, 0], "s--", label="first QR exponent mu_1 (e_{i,0})")
    left.set(xlabel="input token i", ylabel="exponent (tau = 1)", title="per-token exponents")
    left.legend(fontsize=8)
    for k, r in rows.items():
        right.loglog(ALL_EPS, np.maximum(np.abs(r["fd"] - r["predicted"]), 1e-7), ".-", label=k)
    right.axhline(FD_TOLERANCE, color="k", ls=":", label=f"tolerance {FD_TOLERANCE}")
    right.set(xlabel="eps", ylabel="|FD log-growth - exponent|", title="finite differences")
    right.legend(fontsize=6, ncol=2)
    fig.savefig(path, dpi=100)


# -- step-count transfer ------------------------------------------------------------------------


@PAPER.claim(
    "step_count_transfer",
    "A model trained at N Euler steps and evaluated at 2N and N/2 steps loses little: the loss "
    "rises by less than 10% of the gap between the uniform guess log V and the N-step loss; "
    "fine-tuning at the new step count for a few steps recovers it: the loss is back within 2% "
    "of that gap above the N-step loss. Inconclusive when the N-step model did not train "
    "(loss > 0.5 log V). A control fine-tuned at N for as many steps is reported.",
)
def step_count_transfer(ctx: Context) -> Outcome:
    tr = _trained(ctx)
    n = tr.setup.num_steps
    counts = (n // 2, n, 2 * n)
    ft_steps = ctx.size(50, 200)
    lr = tr.setup.learning_rate / 3
    before = {m: train.eval_loss(tr.model, tr.params, tr.eval_data, m) for m in counts}
    after, curves = {}, {}
    for m in counts:
        params, curves[m] = train.fit(
            tr.model.clone(num_steps=m),
            tr.params,
            tr.train_data,
            steps=ft_steps,
            learning_rate=lr,
            first_batch=tr.setup.train_steps,
        )
        after[m] = train.eval_loss(tr.model, params, tr.eval_data, m)
    gap = tr.uniform_loss - before[n]
    rise = {m: (before[m] - before[n]) / gap for m in counts if m != n}
    recovered = {m: (after[m] - before[n]) / gap for m in counts if m != n}
    holds = all(r < LITTLE for r in rise.values()) and all(r <= RECOVER for r in recovered.values())
    path = ctx.figure()
    _plot_transfer(path, counts, before, after, curves, tr.uniform_loss)
    return Outcome(
        measured=dict(
            loss_before_finetune={str(m): v for m, v in before.items()},
            loss_after_finetune={str(m): v for m, v in after.items()},
            rise_over_gap={str(m): v for m, v in rise.items()},
            after_finetune_over_gap={str(m): v for m, v in recovered.items()},
            gap=gap,
            finetune_steps=ft_steps,
        ),
        expected=dict(
            rise_over_gap=f"< {LITTLE} at N/2 and 2N",
            after_finetune_over_gap=f"<= {RECOVER}",
        ),
        verdict=verdict(holds, decidable=_is_trained(tr, before[n])),
        figures=(path,),
    )


def _plot_transfer(path, counts, before, after, curves, uniform):
    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    pos = np.arange(len(counts))
    left.bar(pos - 0.2, [before[m] for m in counts], 0.4, label="trained at N, evaluated")
    left.bar(pos + 0.2, [after[m] for m in counts], 0.4, label="after fine-tuning at that count")
    left.axhline(uniform, color="k", ls=":", label="uniform guess log V")
    left.set_xticks(pos, [f"{m} steps" for m in counts])
    left.set(ylabel="evaluation loss", title=f"step-count transfer (N = {counts[1]})")
    left.legend(fontsize=8)
    for m in counts:
        right.plot(curves[m], label=f"fine-tune at {m} steps")
    right.set(xlabel="fine-tuning step", ylabel="training loss", title="fine-tuning")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=100)
