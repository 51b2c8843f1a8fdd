"""The figures of the sparse-embedding claims: each function returns a matplotlib `Figure` (the
claims save it, the notebook shows it)."""

import math

import numpy as np
from matplotlib.figure import Figure

from theory.sparse_embeddings.measures import P_NAMES, birthday_probability


def exact_fraction(rows, sparsities, ratios) -> Figure:
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
    return fig


def max_map(rows) -> Figure:
    """Repetitions needed for `1 - eps` against ln(ns)/eps, per p, with the stated T."""
    families = sorted({r["family"] for r in rows})
    fig = Figure(figsize=(5 * len(families), 4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(families), sharey=True))
    for ax, family in zip(axes, families, strict=True):
        pts = sorted((r for r in rows if r["family"] == family), key=lambda r: r["scale"])
        scale = [r["scale"] for r in pts]
        for k, name in enumerate(P_NAMES):
            ax.plot(scale, [r["needed"][k] for r in pts], "o", label=f"T_min, p={name}", ms=5)
        ax.plot(scale, [r["stated"] for r in pts], "k^", label="T_stated (6 ln(n^2 s/0.01)/eps)")
        ax.plot(scale, scale, "k:", lw=0.8, label="ln(ns)/eps")
        ax.set(xscale="log", yscale="log", xlabel="ln(n s) / eps", title=f"{family} data")
    axes[0].set_ylabel("repetitions T (m = 4s/eps buckets each)")
    axes[0].legend(fontsize=7)
    fig.suptitle("max map: repetitions from which every pair stays >= 1 - eps")
    return fig


def linf_exact(sizes, needed, stated, s, q) -> Figure:
    """Repetitions (and dimension 4s T) for exact l_inf against n, per seed and mean, with the
    stated T and the predicted growth."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for row in needed:
        ax.plot(sizes, row, "o", color="C0", alpha=0.3, ms=4)
    mean = needed.mean(axis=0)
    ax.plot(sizes, mean, "o-", color="C0", label="T_min (dots: seeds; line: mean)")
    ax.plot(sizes, stated, "k^--", label="stated T = log2(n(n-1)/0.02)")
    pred = [math.log(n * (n - 1) / 2) / math.log(1 / q) for n in sizes]
    offset = float(np.mean(mean - np.array(pred)))
    ax.plot(sizes, np.array(pred) + offset, "r:", label=f"log_(1/q)(n^2/2) + c, q = {q:.2f}")
    ax.set(xscale="log", xlabel="n (data set size)", ylabel=f"repetitions T (dimension 4sT, s={s})")
    ax.set_title("max map: exact l_inf on every pair")
    ax.legend(fontsize=8)
    return fig


def separations(cases, eps) -> Figure:
    """Pairwise ratios per p for the max map, its linear counterpart and signed inputs."""
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    axes = fig.subplots(1, len(cases), sharey=True)
    for ax, (title, r) in zip(axes, cases.items(), strict=True):
        ax.boxplot(list(r), tick_labels=list(P_NAMES), whis=(0, 100))
        ax.axhspan(1 - eps, 1 + eps, color="g", alpha=0.15)
        ax.set(title=title, xlabel="p")
    axes[0].set_ylabel("estimate / true distance (all pairs)")
    return fig


def compressed_sensing(rows, d) -> Figure:
    """Dimensions: compressed sensing's m against the birthday map's 99% dimension, and the
    exact fractions of both at the compressed-sensing m."""
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    ax, bx = fig.subplots(1, 2)
    s = [r["s"] for r in rows]
    ax.plot(s, [r["m"] for r in rows], "o-", label="compressed sensing m = 4 s ln(d/s)")
    ax.plot(s, [r["birthday_dimension"] for r in rows], "s-", label="birthday 99%: 50 s(s-1)")
    ax.set(xscale="log", yscale="log", xlabel="s", ylabel="dimension m", title=f"d = {d}")
    ax.legend(fontsize=8)
    width = 0.35
    pos = np.arange(len(rows))
    bx.bar(pos - width / 2, [r["cs_fraction"] for r in rows], width, label="OMP decoding")
    bx.bar(pos + width / 2, [r["birthday_fraction"] for r in rows], width, label="birthday map")
    bx.axhline(0.99, color="r", lw=0.8, label="99%")
    bx.set_xticks(pos, [f"s={v}" for v in s])
    bx.set(ylim=(0.8, 1.005), ylabel="fraction with every l_p exact", title="at the same m")
    bx.legend(fontsize=8, loc="lower left")
    return fig


def lower_bound(sparsities, curves, d) -> Figure:
    """m_99 against s per linear map, with s^2 and compressed sensing's s ln(d/s) for scale."""
    fig = Figure(figsize=(6, 4.2), layout="constrained")
    ax = fig.subplots()
    s = np.asarray(sparsities, float)
    for name, needed in curves.items():
        ax.plot(s, needed, "o-", label=name)
    ax.plot(s, 50 * s * (s - 1), "k:", label="50 s(s-1) (union bound)")
    ax.plot(s, 4 * s * np.log(d / s), "r--", label="4 s ln(d/s) (compressed sensing)")
    ax.set(xscale="log", yscale="log", xlabel="s", ylabel="m at which 99% keep l_2 exactly")
    ax.set_title("oblivious linear maps: m_99 grows like s^2")
    ax.legend(fontsize=8)
    return fig
