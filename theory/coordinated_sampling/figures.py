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
