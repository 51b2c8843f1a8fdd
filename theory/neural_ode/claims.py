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

from theory.neural_ode import figures, measures, train
from theory.neural_ode.measures import ALL_EPS
from theory.registry import Context, Outcome, Paper, verdict

PAPER = Paper("neural_ode", "Tong et al., neural ODE transformers (2503.01329)")

# A model counts as trained when its evaluation loss is at most this fraction of log V (uniform).
TRAINED_FRACTION = 0.5
# "Increases with t": the fitted line of the mean |lambda| rises by at least 10% of its mean level
# over t in [0, 1].
RISE = 0.1
# Finite differences (`measures.ALL_EPS`): agreement within FD_TOLERANCE at the smallest `eps`,
# where the error fell >= 3x over the last decade of `eps` (a linear regime, not a chance crossing).
FD_TOLERANCE = 0.02
# Step-count transfer: evaluation at a new step count "loses little" when the loss rises by less
# than LITTLE of the gap between log V and the N-step loss; fine-tuning "recovers" when the loss is
# back within RECOVER of that gap above the N-step loss.
LITTLE = 0.1
RECOVER = 0.02


def _trained(ctx: Context) -> train.Trained:
    return train.trained(train.setup_for(ctx.full))


def _trained_with_sequence(ctx: Context) -> tuple[train.Trained, jax.Array]:
    """The trained model and `x(0): [T, D]` of its first evaluation sequence."""
    tr = _trained(ctx)
    tokens = jnp.asarray(tr.eval_data[0]["inputs"][0])
    return tr, measures.initial_state(tr.model, tr.params, tokens)


def _is_trained(tr: train.Trained, loss: float) -> bool:
    return loss <= TRAINED_FRACTION * tr.uniform_loss


# -- spectra along depth ----------------------------------------------------------------------


@PAPER.claim(
    "qk_eigenvalue_trend",
    "The magnitudes of the eigenvalues of W_Q(t) W_K(t)^T grow with depth t in a trained ODE "
    "transformer. Measured: per head, the eigenvalues at the model's own Euler depths t_k = k/N "
    "(the only weights the trained model uses) on a small model trained on MQAR; holds iff the "
    "least-squares line of the mean |lambda| (over heads) rises by at least 10% of its mean over "
    "[0, 1] (relative slope >= 0.1), fails otherwise; inconclusive when the model did not train "
    "(loss > 0.5 log V). The same on a fine grid of t, at initialization, and for W_V W_O and "
    "W_1 W_2 is reported.",
    kind="paper",
)
def qk_eigenvalue_trend(ctx: Context) -> Outcome:
    tr = _trained(ctx)
    n = tr.setup.num_steps
    grids = {"euler": np.arange(n) / n, "grid": np.linspace(0.0, 1.0, ctx.size(41, 81))}
    trends = {
        (name, grid): {
            kind: measures.magnitude_trend(ts, eigs)
            for kind, eigs in measures.depth_spectra(
                tr.model, p, jnp.asarray(ts, jnp.float32)
            ).items()
        }
        for name, p in (("init", tr.init_params), ("trained", tr.params))
        for grid, ts in grids.items()
    }
    loss = train.eval_loss(tr.model, tr.params, tr.eval_data, n)
    qk = trends["trained", "euler"]["qk"]
    holds = qk["mean_abs_relative_slope"] >= RISE
    path = ctx.figure()
    figures.spectra(path, grids, trends)

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
        summary=f"relative slope of mean |lambda(W_Q W_K^T)| at the Euler depths "
        f"{qk['mean_abs_relative_slope']:.3g} (holds iff >= {RISE}); eval loss {loss:.3g} "
        f"(trained iff <= {0.5 * tr.uniform_loss:.3g})",
        figures=(path,),
    )


# -- Lyapunov exponents against finite differences --------------------------------------------


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
    kind="consistency",
)
def lyapunov_matches_finite_difference(ctx: Context) -> Outcome:
    tr, x0 = _trained_with_sequence(ctx)
    length, d = x0.shape
    lam, mu, top = measures.token_exponents(tr.model, tr.params, x0, tr.setup.num_steps)
    growth = measures.perturbation_growth(tr.model, tr.params, x0, tr.setup.num_steps)
    probes = sorted({0, length // 2, length - 1})
    rows = {}
    for i, key in zip(probes, jax.random.split(ctx.key, len(probes)), strict=True):
        directions = {
            "top": (top[i], lam[i, 0]),
            "qr_first": (jnp.zeros_like(x0).at[i, 0].set(1.0), mu[i, 0]),
            "random": (
                jnp.zeros_like(x0).at[i].set(measures.unit(jax.random.normal(key, (d,), x0.dtype))),
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
    figures.lyapunov(path, lam, mu, rows, FD_TOLERANCE)
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
        summary=f"largest error at eps = 1e-3: {max(float(e[-1]) for e in errors.values()):.2g} "
        f"(holds iff <= {FD_TOLERANCE}), first order in eps {first_order}; top exponents "
        f"{float(lam[:, 0].min()):.2g}..{float(lam[:, 0].max()):.2g}",
        figures=(path,),
    )


# -- step-count transfer ------------------------------------------------------------------------


@PAPER.claim(
    "step_count_transfer",
    "A model trained at N Euler steps and evaluated at 2N and N/2 steps loses little: the loss "
    "rises by less than 10% of the gap between the uniform guess log V and the N-step loss; "
    "fine-tuning at the new step count for a few steps recovers it: the loss is back within 2% "
    "of that gap above the N-step loss. Inconclusive when the N-step model did not train "
    "(loss > 0.5 log V). A control fine-tuned at N for as many steps is reported.",
    kind="paper",
)
def step_count_transfer(ctx: Context) -> Outcome:
    ft_steps = ctx.size(50, 200)
    tr = _trained(ctx)
    n = tr.setup.num_steps
    counts = (n // 2, n, 2 * n)
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
    figures.transfer(path, counts, before, after, curves, tr.uniform_loss)
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
        summary="rise / gap at N/2, 2N: "
        + ", ".join(f"{v:.3g}" for v in rise.values())
        + f" (holds iff < {LITTLE}); after fine-tuning: "
        + ", ".join(f"{v:.3g}" for v in recovered.values())
        + f" (<= {RECOVER})",
        figures=(path,),
    )
