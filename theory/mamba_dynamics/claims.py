"""Claims of Vo et al., "Demystifying the token dynamics of deep selective state space models"
(arXiv 2410.03292), measured on `seqlab.modules.mamba.Mamba`.

The continuous-time token dynamics are driven by the interaction matrix `M = S_C^T S_B` (d_inner x
d_inner, rank <= N): tokens converge when the symmetric part of `M` is negative definite and diverge
when it is positive definite. Refinement 1 ties `S_B = diag(lambda) S_C`, so that
`M = S_C^T diag(lambda) S_C` has the signs of `lambda` by construction.
"""

import jax
import numpy as np
from matplotlib.figure import Figure

from seqlab.modules.mamba import Mamba
from theory.registry import Context, Outcome, Paper, verdict

PAPER = Paper("mamba_dynamics", "Vo et al., token dynamics of selective SSMs (2410.03292)")

# Relative to ||M||_2: float32 products of N terms round at ~1e-7 relative, so eigenvalues and
# singular values below 1e-5 ||M||_2 are zero up to rounding.
REL_TOL = 1e-5


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


@PAPER.claim(
    "sign_constraint_spectra",
    "With S_B = diag(lambda) S_C (Refinement 1), the interaction matrix M = S_C^T S_B of every "
    "random init has a symmetric part with eigenvalues >= 0 for sign_constraint='pos', <= 0 for "
    "'neg' and of both signs for 'mixed' (zero meaning |eig| <= 1e-5 ||M||_2), and rank(M) <= N "
    "(singular values above 1e-5 ||M||_2) in all three.",
)
def sign_constraint_spectra(ctx: Context) -> Outcome:
    d_model, d_state, inits = ctx.size((8, 4, 32), (16, 16, 256))
    constraints = ("pos", "neg", "mixed", None)  # None: the unconstrained contrast
    summaries = {
        c: spectrum_summary(
            interaction_matrices(
                Mamba(d_model=d_model, d_state=d_state, sign_constraint=c),
                jax.random.fold_in(ctx.key, i),
                inits,
            )
        )
        for i, c in enumerate(constraints)
    }
    pos, neg, mixed = (summaries[c]["eig"] for c in ("pos", "neg", "mixed"))
    checks = dict(
        pos_min_eig=pos.min(),  # >= -REL_TOL
        neg_max_eig=neg.max(),  # <= REL_TOL
        mixed_fraction_both_signs=np.mean((mixed.min(1) < -REL_TOL) & (mixed.max(1) > REL_TOL)),
        max_rank=max(int(summaries[c]["rank"].max()) for c in ("pos", "neg", "mixed")),
    )
    holds = (
        checks["pos_min_eig"] >= -REL_TOL
        and checks["neg_max_eig"] <= REL_TOL
        and checks["mixed_fraction_both_signs"] == 1.0
        and checks["max_rank"] <= d_state
    )
    free = summaries[None]
    path = ctx.figure()
    _plot_spectra(path, summaries, d_state)
    return Outcome(
        measured=dict(
            **checks,
            inits_per_constraint=inits,
            d_inner=2 * d_model,
            max_asymmetry=max(summaries[c]["asymmetry"].max() for c in ("pos", "neg", "mixed")),
            unconstrained_fraction_both_signs=np.mean(
                (free["eig"].min(1) < -REL_TOL) & (free["eig"].max(1) > REL_TOL)
            ),
            unconstrained_max_rank=int(free["rank"].max()),
        ),
        expected=dict(
            pos_min_eig=f">= -{REL_TOL}",
            neg_max_eig=f"<= {REL_TOL}",
            mixed_fraction_both_signs=1.0,
            max_rank=f"<= N = {d_state}",
        ),
        verdict=verdict(bool(holds)),
        figures=(path,),
    )


def _plot_spectra(path, summaries, d_state):
    fig = Figure(figsize=(10, 4), layout="constrained")
    axes = fig.subplots(1, len(summaries), sharey=True)
    for ax, (name, summary) in zip(axes, summaries.items(), strict=True):
        eig = summary["eig"]  # [count, d], ascending
        index = np.broadcast_to(np.arange(eig.shape[1]), eig.shape)
        ax.plot(index.ravel(), eig.ravel(), ".", ms=3, alpha=0.4)
        ax.axhline(0.0, color="k", lw=0.6)
        ax.set(title=f"sign_constraint={name!r}", xlabel="eigenvalue index")
        ax.text(
            0.03,
            0.95,
            f"max rank {summary['rank'].max()} (N={d_state})",
            transform=ax.transAxes,
            va="top",
            fontsize=8,
        )
    axes[0].set_ylabel("eig((M + M^T)/2) / ||M||_2")
    fig.savefig(path, dpi=100)
