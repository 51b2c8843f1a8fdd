"""The figures of the SSM-bottleneck claims (matplotlib, written to the claims' figure paths)."""

import numpy as np
from matplotlib.figure import Figure

from theory.ssm_bottleneck.measures import UNDERFLOW


def influence(path, infl, a, rates, d_state):
    """Influence on the state per channel against distance; fitted against true decay rates."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    distance = np.arange(infl.shape[-1])[::-1]
    norm = np.sqrt(np.sum(infl**2, axis=0))  # [N, T]: ||d h_T[:, n] / d x_s||
    channels = [(0, "1-channel (A=0)"), (1, "learnable A=-1"), (d_state, f"learnable A=-{d_state}")]
    for n, label in [*channels, (len(a) - 1, f"0-channel (A=-{a[-1]:g})")]:
        left.semilogy(distance, np.maximum(norm[n], UNDERFLOW), label=label)
    left.set(xlabel="distance T-1-s", ylabel="||dh_T[:, n] / dx_s||", title="influence on state")
    left.legend(fontsize=8)
    learn = slice(1, 1 + d_state)
    right.plot(a[learn], a[learn], "k:", label="rate = |A_n|")
    right.plot(a[learn], rates[learn], "o", label="learnable (fitted)")
    right.plot([0.0], rates[:1], "s", label="1-channel (fitted)")
    right.set(xlabel="|A_n|", ylabel="fitted decay rate per unit dt", title="decay rates")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def retention(path, dt, retention, a_zero, dt_star, init_range, forget):
    """One-step retention of the 0-channel against dt, with `exp(-a dt)` and the threshold."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    grid = np.geomspace(min(dt.min(), init_range[0]) / 2, max(dt.max(), init_range[1]) * 2, 200)
    ax.axvspan(*init_range, color="0.92", label="dt init range")
    ax.loglog(grid, np.exp(-a_zero * grid), "k:", label=f"exp(-{a_zero:g} dt)")
    ax.loglog(dt, np.maximum(retention, UNDERFLOW), ".", ms=3, label="measured dh_t/dh_{t-1}")
    ax.axhline(forget, color="r", lw=0.8, label=f"forgotten (<= {forget})")
    ax.axvline(dt_star, color="r", ls="--", lw=0.8, label=f"dt* = {dt_star:.3f}")
    ax.set(xlabel="dt", ylabel="one-step retention", title="0-channel: one-step retention")
    ax.set_ylim(1e-8, 2)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def recency(path, profiles, ranges):
    """Mean log-influence against distance with its fit and `log A_max`; transition ranges."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    for i, (name, prof) in enumerate(profiles.items()):
        r = prof["distances"]
        left.plot(r, prof["profile"], ".", color=f"C{i}", label=f"{name}: mean log-influence")
        left.plot(r, prof["intercept"] + prof["slope"] * r, "-", color=f"C{i}", lw=0.8)
        left.plot(
            r,
            prof["intercept"] + prof["log_a_max"] * r,
            ":",
            color=f"C{i}",
            label=f"{name}: slope log A_max = {prof['log_a_max']:.3g}",
        )
    left.set(xlabel="distance t - s", ylabel="mean log ||dy_t / dx_s||", title="recency")
    left.legend(fontsize=7)
    for i, (name, (lo, hi)) in enumerate(ranges.items()):
        right.hist((hi - lo).ravel(), bins=30, alpha=0.6, color=f"C{i}", label=name)
    right.set(xlabel="A_max - A_min per channel", ylabel="channels", title="transition range")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def smoothing(path, curves, title):
    """Token-similarity measures per layer, one curve per stack."""
    fig = Figure(figsize=(12, 4), layout="constrained")
    axes = fig.subplots(1, 3)
    keys = ("linf_diameter", "average_pairwise_distance", "relative_dirichlet_energy")
    for ax, key in zip(axes, keys, strict=True):
        for label, c in curves.items():
            ax.semilogy(np.arange(len(c[key])), c[key], ".-", label=label)
        ax.set(xlabel="layer", ylabel=key.replace("_", " "), title=title)
    axes[0].legend(fontsize=8)
    fig.savefig(path, dpi=100)


def rate_vs_a_max(path, sweep, fit, conv_size):
    """Mean log-influence profiles of the A_max sweep; decay rate against log(1 / A_max)."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    for a, prof in zip(sweep["a_max"], sweep["profiles"], strict=True):
        r = conv_size + np.arange(len(prof))
        left.plot(r, prof - prof[0], ".-", ms=3, label=f"A_max = {a:.3g}")
    left.set(xlabel="distance t - s", ylabel="mean log-influence (shifted to 0)", title="recency")
    left.legend(fontsize=7)
    x = np.log(1.0 / sweep["a_max"])
    grid = np.geomspace(x.min(), x.max(), 50)
    right.loglog(x, sweep["rate"], "o", label="measured decay rate")
    right.loglog(
        grid,
        np.exp(fit["intercept"]) * grid ** fit["slope"],
        "-",
        lw=0.8,
        label=f"fit: exponent {fit['slope']:.3f}",
    )
    right.loglog(grid, grid, "k:", label="rate = log(1 / A_max)")
    right.set(xlabel="log(1 / A_max)", ylabel="decay rate per token", title="rate against A_max")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def log_linear(path, fits, title: str = "trained on MQAR"):
    """Mean log-influence against distance in the models of `fits`, with their lines and R^2."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for i, (name, f) in enumerate(fits.items()):
        r = f["distances"]
        ax.plot(r, f["profile"], ".", color=f"C{i}", label=f"{name} (R^2 = {f['r2']:.3f})")
        ax.plot(r, f["intercept"] + f["slope"] * r, "-", color=f"C{i}", lw=0.8)
    ax.set(xlabel="distance t - s", ylabel="mean log ||dh_t / de_s||", title=title)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def oversmoothing_bound(path, rows):
    """Per A_min: sup-norm diameter ratio per layer against the bound; energy against layer."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    for i, r in enumerate(rows):
        layer = np.arange(1, len(r["ratio"]) + 1)
        label = f"A_min = {r['a_min']:g}"
        left.plot(layer, r["ratio"], ".-", color=f"C{i}", label=label)
        left.plot(layer, r["bound"], ":", color=f"C{i}", lw=0.8)
        e = r["curves"]["relative_dirichlet_energy"]
        right.semilogy(np.arange(len(e)), e, ".-", color=f"C{i}", label=label)
    left.set(xlabel="layer", ylabel="sup-diameter out / in", title="Theorem 4.2 (dotted: bound)")
    left.legend(fontsize=7)
    right.set(xlabel="layer", ylabel="relative Dirichlet energy", title="over-smoothing")
    fig.savefig(path, dpi=100)


def mqar(path, runs, setup):
    """Accuracy of every seed per model and depth; mean training loss curves."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    names = [(p, L) for L in setup.depths for p in (False, True)]
    for i, key in enumerate(names):
        acc = 100 * np.asarray(runs[key]["accuracy"])
        left.plot(np.full(acc.shape, i), acc, "o", color="C1" if key[0] else "C0")
        left.plot([i - 0.2, i + 0.2], [acc.mean()] * 2, "k-")
        loss = np.asarray(runs[key]["losses"]).mean(axis=0)
        right.plot(loss, ls="-" if key[0] else "--", label=f"{_name(key)}")
    left.axhline(100 * setup.chance, color="0.5", ls=":", label="chance")
    left.set_xticks(range(len(names)), [_name(k) for k in names])
    left.set(ylabel=f"accuracy at {setup.eval_kv} pairs (%)", title="MQAR, one dot per seed")
    left.legend(fontsize=8)
    right.set(xlabel="step", ylabel="training loss (mean over seeds)", title="training")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def _name(key):
    polarized, layers = key
    return f"{'polar' if polarized else 'default'}-{layers}"
