"""The figures of the coordinated-sampling claims (matplotlib, written to the claims' figure
paths)."""

import numpy as np
from matplotlib.figure import Figure


def running_bias(path, curves, title):
    """`||mean W - A^T B||` over the first trials per method, with a `1/sqrt(trials)` guide."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    t = np.arange(1, len(curves["priority"]) + 1)
    for method, curve in curves.items():
        ax.loglog(t, curve, label=method)
    ax.loglog(t, curves["priority"][0] / np.sqrt(t), "k:", label="1/sqrt(trials)")
    ax.set(xlabel="trials", ylabel="||mean W - A^T B||_F / (||A|| ||B||)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def variance(path, ks, mse):
    """The mean squared relative error per method against k, with the bounds."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for method, values in mse.items():
        ax.loglog(ks, values, "o-", label=method)
    ax.loglog(ks, [2 / (k - 1) for k in ks], "k:", label="bound 2/(k-1)")
    ax.loglog(ks, [2 / k for k in ks], "k--", lw=0.6, label="bound 2/k")
    ax.set(xlabel="k (rows)", ylabel="E||W - A^T B||^2 / (||A||^2 ||B||^2)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def storage_by_sparsity(path, curves, sparsities, d):
    """Error against storage per method, one panel per sparsity."""
    fig = Figure(figsize=(3.2 * len(sparsities), 3.4), layout="constrained")
    axes = fig.subplots(1, len(sparsities), sharey=True)
    for ax, s in zip(axes, sparsities, strict=True):
        for method, (st, err) in curves[s].items():
            ax.loglog(st, err, "o-", label=method)
        ax.set(title=f"s = {s}" + (" (dense)" if s == d else ""), xlabel="storage (numbers)")
    axes[0].set_ylabel("relative Frobenius error")
    axes[0].legend(fontsize=7)
    fig.savefig(path, dpi=100)


def error_by_storage(path, curves, *, xlabel, ylabel, title):
    """Error against storage, one curve per method (`curves[method] = (storage, error)`)."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for method, (st, err) in curves.items():
        ax.loglog(st, err, "o-", label=method)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def error_histograms(path, errors, *, eps=None, title=""):
    """Histograms of per-trial relative errors, one per method (`errors[method]: [trials]`), with
    `eps` as a vertical line when given."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    top = max(float(np.max(e)) for e in errors.values())
    bins = np.linspace(0, max(top, eps or 0) * 1.05, 60)
    for method, e in errors.items():
        ax.hist(e, bins=bins, alpha=0.6, label=method)
    if eps is not None:
        ax.axvline(eps, color="k", ls="--", label=f"eps = {eps}")
    ax.set(xlabel="||W - A^T B||_F / (||A||_F ||B||_F)", ylabel="trials")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def storage_curves(path, curves, reference, *, title):
    """Error against storage per linear method (`curves[method] = (storage, error)`), with the
    sampling sketch's `reference = (storage, error)` point and its 10x storage marked."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for method, (st, err) in curves.items():
        ax.loglog(st, err, "o-", label=method)
    ax.loglog(*reference, "k*", ms=12, label="priority (coordinated)")
    ax.axhline(reference[1], color="k", ls=":", lw=0.8)
    ax.axvline(10 * reference[0], color="gray", ls="--", lw=0.8, label="10x priority's storage")
    ax.set(xlabel="storage (numbers, both sketches)", ylabel="mean relative Frobenius error")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def by_fraction(path, fractions, panels, *, title):
    """One panel per normalization (`panels[ylabel][method] = [error per fraction]`), error
    against the fraction of shared keys."""
    fig = Figure(figsize=(5 * len(panels), 3.8), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    for ax, (ylabel, curves) in zip(axes, panels.items(), strict=True):
        for method, values in curves.items():
            ax.loglog(fractions, values, "o-", label=method)
        ax.set(xlabel="fraction of shared keys", ylabel=ylabel)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
