"""The figures of the sparse-embedding claims (matplotlib, written to the claims' figure paths)."""

import numpy as np
from matplotlib.figure import Figure

from theory.sparse_embeddings.measures import P_NAMES, birthday_probability


def exact_fraction(path, rows, sparsities, ratios):
    """The fraction of exactly embedded vectors against m / s^2, with the bounds."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    grid = np.geomspace(min(ratios), max(ratios), 100)
    ax.plot(grid, np.maximum(0, 1 - 1 / (2 * grid)), "k:", label="bound 1 - s^2/(2m)")
    for s in sparsities:
        pts = [r for r in rows if r["s"] == s]
        ax.plot([r["m_over_s2"] for r in pts], [r["fraction"] for r in pts], "o-", label=f"s={s}")
        curve = [birthday_probability(s, max(1, round(g * s * s))) for g in grid]
        ax.plot(grid, curve, lw=0.6, alpha=0.6)
    ax.axhline(0.99, color="r", lw=0.6, label="99%")
    ax.set(xscale="log", xlabel="m / s^2", ylabel="fraction with every l_p exact", ylim=(0, 1.02))
    ax.set_title("birthday map (thin lines: exact birthday probability)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def max_map(path, t_grid, lows, eps, reps):
    """The worst pairwise ratio per p against the number of repetitions."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for name, col in zip(P_NAMES, lows.T, strict=True):
        ax.plot(t_grid, col, "o-", label=f"p={name}")
    ax.axhline(1 - eps, color="r", lw=0.8, label="1 - eps")
    ax.axvline(reps, color="k", ls=":", label="stated T")
    ax.set(xscale="log", xlabel="repetitions T", ylabel="min over pairs of estimate / true")
    ax.set_title("max map: worst pairwise ratio (never above 1)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def linf_exact(path, t_grid, exact):
    """The fraction of pairs with an exact l_inf distance against T, with the per-pair bound."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    ax.plot(t_grid, exact, "o-", label="measured")
    ax.plot(t_grid, [1 - 0.5**t for t in t_grid], "k:", label="per-pair bound 1 - 2^-T")
    ax.set(xlabel="repetitions T (m = 4s)", ylabel="fraction of pairs with exact l_inf")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def separations(path, r_max, r_linear, r_signed, eps):
    """Pairwise ratios per p for the max map, its linear counterpart and signed inputs."""
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    axes = fig.subplots(1, 3, sharey=True)
    titles = ("max map, non-negative", "linear (sum) map, non-negative", "max map, signed")
    for ax, r, title in zip(axes, (r_max, r_linear, r_signed), titles, strict=True):
        ax.boxplot(list(r), tick_labels=list(P_NAMES), whis=(0, 100))
        ax.axhspan(1 - eps, 1, color="g", alpha=0.15)
        ax.set(title=title, xlabel="p")
    axes[0].set_ylabel("estimate / true distance (all pairs)")
    fig.savefig(path, dpi=100)
