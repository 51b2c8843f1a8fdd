"""The figures of the neural-ODE claims (matplotlib, written to the claims' figure paths)."""

import numpy as np
from matplotlib.figure import Figure

from theory.neural_ode.measures import ALL_EPS


def spectra(path, grids, trends):
    """Mean and largest eigenvalue magnitudes along depth, init and trained."""
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


def lyapunov(path, lam, mu, rows, tolerance):
    """Per-token exponents, and the finite-difference errors against eps."""
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
    right.axhline(tolerance, color="k", ls=":", label=f"tolerance {tolerance}")
    right.set(xlabel="eps", ylabel="|FD log-growth - exponent|", title="finite differences")
    right.legend(fontsize=6, ncol=2)
    fig.savefig(path, dpi=100)


def transfer(path, counts, before, after, curves, uniform):
    """Losses before and after fine-tuning at each step count, and the curves."""
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
