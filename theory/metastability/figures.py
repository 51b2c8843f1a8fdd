"""The figures of the metastability claims (matplotlib, written to the claims' figure paths)."""

import numpy as np
from matplotlib.figure import Figure

from seqlab.dynamics import token_flow


def growth_rates(path, ks, beta, amplitudes, measured, predicted, where="circle"):
    """Mode amplitudes against `exp(lambda_k t)` (SA), and fitted against predicted rates."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    ts, amp = amplitudes["sa"]
    for i, k in enumerate(ks):
        (line,) = left.semilogy(ts, amp[i], label=f"k={k}")
        left.semilogy(ts, amp[i, 0] * np.exp(predicted["sa"][i] * ts), ":", color=line.get_color())
    left.set(xlabel="t", ylabel="mode amplitude", title=f"SA, {where}, beta={beta:g}")
    left.legend(fontsize=7, ncol=2)
    for name, marker in (("sa", "o"), ("usa", "s")):
        scale = predicted[name].max()
        right.plot(ks, predicted[name] / scale, "-", color="gray")
        right.plot(ks, measured[name] / scale, marker, label=f"{name.upper()} fitted")
    right.set(xlabel="k", ylabel="lambda_k / max_k lambda_k", title="fitted (marks) vs predicted")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def cluster_counts(path, betas, predicted, measured, traj, ts, states, linear_end):
    """`dominant_mode` against beta with the measured counts, and three runs' snapshots."""
    fig = Figure(figsize=(12, 4), layout="constrained")
    left, *snaps = fig.subplots(1, 4)
    fine = np.linspace(betas.min(), betas.max(), 200)
    left.plot(
        fine,
        [token_flow.dominant_mode(b, 2) for b in fine],
        "-",
        color="gray",
        label="dominant_mode(beta, 2)",
    )
    left.plot(betas, measured, "o", label="measured clusters")
    left.set(xlabel="beta", ylabel="clusters", title="predicted vs measured (SA)")
    left.legend(fontsize=8)
    # Snapshots of the smallest beta, the largest, and the first mismatch (else the middle one).
    wrong = np.flatnonzero(measured != predicted)
    show = [0, wrong[0] if wrong.size else len(betas) // 2, len(betas) - 1]
    xs = np.asarray(traj.xs)
    for ax, b in zip(snaps, show, strict=True):
        stop = len(ts[b]) - 1 if states[b] is None else np.searchsorted(ts[b], states[b][1])
        for j, tone in ((0, 0.2), (linear_end[b], 0.5), (stop, 1.0)):
            r = 1 + 0.15 * tone
            ax.plot(
                r * xs[b, j, :, 0],
                r * xs[b, j, :, 1],
                ".",
                ms=3,
                alpha=tone,
                label=f"t={ts[b, j]:.0f}",
            )
        title = f"beta={betas[b]:g}: k*={predicted[b]}, measured {measured[b]}"
        ax.set(aspect="equal", title=title, xticks=[], yticks=[])
        ax.legend(fontsize=7, loc="center")
    fig.savefig(path, dpi=100)


def count_histogram(path, outcome, predicted, beta, n):
    """The fractions of runs by first metastable count, `k*` highlighted."""
    fig = Figure(figsize=(5, 4), layout="constrained")
    ax = fig.subplots()
    values, freq = np.unique(outcome, return_counts=True)
    ax.bar(values, freq / len(outcome), color=["C1" if v == predicted else "C0" for v in values])
    ax.set(
        xlabel="first metastable cluster count (-1: none)",
        ylabel="fraction of runs",
        title=f"iid uniform starts, SA, beta={beta:g}, n={n}: k*={predicted} (orange)",
    )
    fig.savefig(path, dpi=100)


def counts_in_time(path, ts, counts, clustered, beta, n):
    """The cluster count of every run against time (log scale), where clustered."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for c, k in zip(counts, clustered, strict=True):
        ax.step(ts, np.where(k, c, np.nan), where="post", alpha=0.7)
    ax.set(
        xscale="log",
        xlabel="t (units of 1 / lambda_k*)",
        ylabel="clusters (when clustered)",
        title=f"USA, beta={beta:g}, n={n}: plateaus then merges",
    )
    fig.savefig(path, dpi=100)


def energy_staircase(path, ts, energies, ts_counts, counts, clustered, beta, n):
    """The energy along the run, with the cluster count on a second axis."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    ax.plot(ts, energies, color="C0")
    ax.set(
        xscale="log",
        xlabel="t (units of 1 / lambda_k*)",
        ylabel="E_beta",
        title=f"USA energy staircase, beta={beta:g}, n={n}",
    )
    right = ax.twinx()
    right.step(ts_counts, np.where(clustered, counts, np.nan), where="post", color="C1")
    right.set_ylabel("clusters (when clustered)", color="C1")
    fig.savefig(path, dpi=100)
