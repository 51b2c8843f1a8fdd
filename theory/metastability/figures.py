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


def count_histogram(path, outcome, predicted, beta, n, ks, race):
    """The fractions of runs by first metastable count against our race estimate, `k*`
    highlighted."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    values, freq = np.unique(outcome, return_counts=True)
    colors = ["C1" if v == predicted else "C0" for v in values]
    ax.bar(values - 0.2, freq / len(outcome), width=0.4, color=colors, label="simulated")
    ax.bar(ks + 0.2, race, width=0.4, color="gray", label="race estimate (ours)")
    ax.set(
        xlabel="first metastable cluster count (-1: none)",
        ylabel="fraction of runs",
        title=f"iid uniform starts, SA, beta={beta:g}, n={n}: k*={predicted} (orange)",
    )
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def formation_times(path, ns, t_sat, slope, offset, curves, beta):
    """Saturation times against ln n with the fitted and predicted lines, and the largest mode
    amplitude of every run."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    logs = np.log(ns)
    for x, t in zip(logs, t_sat, strict=True):
        left.plot(np.full(len(t), x), t, ".", color="C0", alpha=0.4)
    means = [np.nanmean(t) for t in t_sat]
    left.plot(logs, means, "o", color="C1", label=f"mean (slope {slope:.2f})")
    left.plot(logs, 0.5 * logs + offset, "--", color="gray", label="ln(n)/2 + const")
    left.set(
        xlabel="ln n",
        ylabel="t_sat (units of 1/lambda_k*)",
        title=f"USA, beta={beta:g}: max |c_k| reaches 1/2",
    )
    left.legend(fontsize=8)
    for i, (ts, amp) in enumerate(curves):
        right.semilogy(ts, amp.T, color=f"C{i}", alpha=0.3, lw=0.8)
        right.plot([], [], color=f"C{i}", label=f"n={ns[i]}")
    right.axhline(0.5, color="gray", ls=":")
    right.set(xlabel="t (units of 1/lambda_k*)", ylabel="max_k |c_k|", title="every run")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def cluster_phases(path, shown, errors, nulls, k, n, beta):
    """Measured cluster centres against the peaks of the initial `k*` mode (first runs), and the
    centre errors against those of another run's phase."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    for i, (centres, phase) in enumerate(shown[:8]):
        predicted = (phase + 2 * np.pi * np.arange(k)) / k
        left.plot(np.full(k, i), np.mod(predicted, 2 * np.pi), "_", ms=18, color="gray")
        left.plot(np.full(len(centres), i), np.mod(centres, 2 * np.pi), "o", color="C1")
    left.set(
        xlabel="run",
        ylabel="angle",
        ylim=(0, 2 * np.pi),
        title=f"USA, beta={beta:g}, n={n}: centres (o), (arg c_k*(0) + 2 pi m)/k* (-)",
    )
    bins = np.linspace(0, 1, 21)
    right.hist(errors, bins=bins, alpha=0.7, label="own initial phase")
    right.hist(nulls, bins=bins, alpha=0.5, label="another run's phase")
    right.axvline(0.25, color="gray", ls=":")
    right.set(xlabel="mean centre error (units of pi/k*)", ylabel="runs")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def mean_field(path, ns, rms, slope, shown, ks, beta):
    """The RMS relative error against n with `n^(-1/2)`, and one size's mode amplitudes against
    the linearized solution."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    ns = np.asarray(ns, np.float64)
    left.loglog(ns, rms, "o-", label=f"particles (slope {slope:.2f})")
    left.loglog(ns, rms[0] * np.sqrt(ns[0] / ns), "--", color="gray", label="n^(-1/2)")
    left.set(xlabel="n", ylabel="RMS relative error", title="modes vs linearized mean field")
    left.legend(fontsize=8)
    n, ts, modes = shown
    rates = token_flow.growth_rate(ks, beta, 2, normalized=False) / token_flow.growth_rate(
        token_flow.dominant_mode(beta, 2), beta, 2, normalized=False
    )
    for i, k in enumerate(ks[:4]):
        (line,) = right.semilogy(ts, np.abs(modes[0, :, i]), label=f"k={k}")
        linear = np.abs(modes[0, 0, i] * np.exp(rates[i] * ts))
        right.semilogy(ts, linear, ":", color=line.get_color())
    right.set(
        xlabel="t (units of 1/lambda_k*)",
        ylabel="|c_k| (dotted: linearized)",
        title=f"one run, n={n}, USA beta={beta:g}",
    )
    right.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def lifetimes(path, betas, lives, medians, window, n):
    """The lifetime of every run's first metastable state against beta, and the medians."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for b, life in zip(betas, lives, strict=True):
        shown = np.where(np.isinf(life), window, life)
        ax.plot(np.full(len(life), b), shown, ".", color="C0", alpha=0.5)
    ax.plot(betas, np.minimum(medians, window), "o-", color="C1", label="median")
    ax.axhline(window, color="gray", ls=":", label="window (never changed)")
    ax.set(
        yscale="log",
        xlabel="beta",
        ylabel="lifetime (units of 1/lambda_k*)",
        title=f"SA, n={n}: first metastable state",
    )
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def attention_bridge(path, dts, errors, slope, beta, n):
    """The largest token error of the attention network against the layer step."""
    fig = Figure(figsize=(5, 4), layout="constrained")
    ax = fig.subplots()
    ax.loglog(dts, errors, "o-", label=f"Attention layers (order {slope:.2f})")
    ax.loglog(dts, errors[0] * dts / dts[0], "--", color="gray", label="O(dt)")
    ax.set(xlabel="dt = t1 / layers", ylabel="max token error", title=f"beta={beta:g}, n={n}")
    ax.legend(fontsize=8)
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
