"""The figures of the token-dynamics claims (matplotlib, written to the claims' figure paths)."""

import numpy as np
from matplotlib.figure import Figure

from theory.mamba_dynamics import measures


def spectra(path, summaries, d_state):
    """Eigenvalues of the symmetric part of M per sign constraint, with the largest rank."""
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


def tokens_1d(path, runs, title, mu, *, scaled_limit):
    """`|x_l(t)|` of the first runs; `sqrt(t) |x_l(t)|` against its limit, or `|x_l(t)|`."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    for i, run in enumerate(runs[:3]):
        ts, mag = run["ts"], np.abs(run["xs"])
        for l in range(mag.shape[1]):
            kw = dict(
                color=f"C{l}", alpha=1.0 - 0.3 * i, label=f"token {l + 1}" if i == 0 else None
            )
            left.loglog(ts, mag[:, l], **kw)
            right.semilogx(ts, np.sqrt(ts) * mag[:, l] if scaled_limit else mag[:, l], **kw)
        if scaled_limit:
            right.axhline(measures.convergence_limit(mu[i]), color="k", ls=":", lw=0.8)
    left.set(xlabel="t (depth)", ylabel="|x_l(t)|", title=title)
    right.set(
        xlabel="t (depth)",
        ylabel="sqrt(t) |x_l(t)|" if scaled_limit else "|x_l(t)|",
        title="dotted: 1/sqrt(2|mu| ln 2)" if scaled_limit else "linear scale",
    )
    left.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def blowup(path, run, predicted, measured_t):
    """A blowing-up run (`measures.solve_1d`), and the integrator's blow-up times against `T*`."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    ok = np.isfinite(run["xs"]).all(1)
    for l in range(run["xs"].shape[1]):
        left.semilogy(run["ts"][ok], np.abs(run["xs"][ok, l]), ".-", label=f"token {l + 1}")
    left.axvline(predicted[0], color="k", ls=":", label="T* (token 1, quadrature)")
    left.set(xlabel="t", ylabel="|x_l(t)|", title="mu > 0, s x_1(0) > 0: finite-time blow-up")
    left.legend(fontsize=8)
    right.plot(predicted, measured_t, "o")
    lim = [0, max(predicted) * 1.1]
    right.plot(lim, lim, "k:")
    right.set(
        xlabel="T* from the ODE (quadrature)", ylabel="integrator: |x_1| >= 30", title="token 1"
    )
    fig.savefig(path, dpi=100)


def phase(path, trajectories, outcomes):
    """2-D token trajectories of the first random fields for each sign constraint."""
    fig = Figure(figsize=(12, 4), layout="constrained")
    for ax, (name, trajs) in zip(fig.subplots(1, 3), trajectories.items(), strict=True):
        for traj in trajs[:3]:
            ok = np.isfinite(traj).all((1, 2)) & (np.linalg.norm(traj, axis=-1).max(1) < 10)
            for l in range(traj.shape[1]):
                ax.plot(traj[ok, l, 0], traj[ok, l, 1], color=f"C{l}", lw=0.8)
                ax.plot(traj[0, l, 0], traj[0, l, 1], "o", color=f"C{l}", ms=3)
        lo, hi = outcomes[name]["eigenvalue_range"]
        ax.set(title=f"{name}: eig(M_sym) in [{lo:.2f}, {hi:.2f}]", xlabel="x[0]", ylabel="x[1]")
        ax.set_xlim(-4, 4)
        ax.set_ylim(-4, 4)
    fig.savefig(path, dpi=100)


def depth_limit(path, taus, errors, t1):
    """The stack's error against the ODE per residual step, with a slope-1 guide."""
    fig = Figure(figsize=(5, 4), layout="constrained")
    ax = fig.subplots()
    ax.loglog(taus, errors, "o-", label=f"max |stack - ODE| at t = {t1:g}")
    ax.loglog(taus, [errors[0] * tau / taus[0] for tau in taus], "k:", label="slope 1")
    ax.set(xlabel="tau (residual step = 1 / layers per unit time)", ylabel="error")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def mixed_blowup(path, rows):
    """Mixed signs: the blow-up time against its comparison bound, and the growth of each token
    at the blow-up (tokens before l0 marked) and of the tokens before l0 alone by t = 1e4."""
    fig = Figure(figsize=(12, 4), layout="constrained")
    left, middle, right = fig.subplots(1, 3)
    bound = [r["bound"] for r in rows]
    left.plot(bound, [r["t_blowup"] for r in rows], "o")
    lim = [0, max(bound) * 1.1]
    left.plot(lim, lim, "k:", label="t = bound")
    left.set(xlabel="min T* over tokens with s x_l(0) > 0", ylabel="blow-up time (norm 30)")
    left.legend(fontsize=8)
    for i, r in enumerate(rows):
        growth = np.asarray(r["growth_at_blowup"])
        index = np.arange(1, growth.size + 1)
        middle.semilogy(index - r["l0"], growth, ".-", color=f"C{i % 10}", alpha=0.7)
        right.semilogy(
            np.arange(1, len(r["prefix_growth_by_t1"]) + 1), r["prefix_growth_by_t1"], "o-"
        )
    middle.axvline(-0.5, color="k", lw=0.6)
    middle.set(
        xlabel="l - l0 (left of the line: before the first positive token)",
        ylabel="|x_l(T)| / |x_l(0)| at the blow-up",
    )
    right.axhline(2.0, color="k", ls=":", lw=0.8)
    right.set(xlabel="token l < l0", ylabel="|x_l(1e4)| / |x_l(0)|", title="tokens before l0 alone")
    fig.savefig(path, dpi=100)


def dichotomy(path, rows):
    """Per random 1-D draw: the tokens' growth ratio, by the criterion's scenario."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    colors = {"converges": "C0", "fast": "C3", "slow": "C1"}
    for i, r in enumerate(rows):
        ratio = np.asarray(r["ratio"])
        marker = "x" if r["label"] == "blows_up" else "o"
        ax.semilogy(np.full(ratio.size, i), ratio, marker, color=colors[r["scenario"]], ms=4)
    for name, color in colors.items():
        ax.plot([], [], "o", color=color, label=name)
    ax.axhline(0.1, color="k", ls=":", lw=0.8)
    ax.axhline(2.0, color="k", ls=":", lw=0.8)
    ax.set(
        xlabel="draw",
        ylabel="|x_l(t_end)| / |x_l(0)|",
        title="1-D draws (x: blew up, ratio at the blow-up; o: at t = 1e4)",
    )
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def higher_dim(path, runs):
    """Token norms in D dimensions: positive definite (to the blow-up) and negative definite with
    a t^-1/2 guide."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    for i, run in enumerate(runs["pos"][:3]):
        ok = np.isfinite(run["norms"]).all(1)
        for l in range(run["norms"].shape[1]):
            left.plot(
                run["ts"][ok],
                run["norms"][ok, l],
                color=f"C{l}",
                alpha=1 - 0.3 * i,
                lw=2 if l == 0 else 0.8,
            )
    left.set(xlabel="t", ylabel="||x_l(t)||", title="sym(M) positive definite (thick: token 1)")
    for i, run in enumerate(runs["neg"][:3]):
        for l in range(run["norms"].shape[1]):
            right.loglog(run["ts"], run["norms"][:, l], color=f"C{l}", alpha=1 - 0.3 * i, lw=0.8)
    ts = runs["neg"][0]["ts"]
    late = ts >= 1.0
    right.loglog(ts[late], ts[late] ** -0.5, "k:", label="t^-1/2")
    right.set(xlabel="t", ylabel="||x_l(t)||", title="sym(M) negative definite")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def refinement(path, results, chance, title):
    """Held-out accuracy per seed and arm, and the training loss curves (mean over seeds)."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    for i, (arm, r) in enumerate(results.items()):
        acc = np.asarray(r["accuracy"])
        left.plot(np.full(acc.size, i), acc, "o", color=f"C{i}")
        left.plot([i - 0.2, i + 0.2], [acc.mean()] * 2, color=f"C{i}")
        loss = np.asarray(r["train_loss"])
        right.plot(loss.mean(0), color=f"C{i}", label=arm)
    left.axhline(chance, color="k", ls=":", lw=0.8, label="chance")
    left.set_xticks(range(len(results)), list(results))
    left.set(ylabel="held-out accuracy", title=title)
    left.legend(fontsize=8)
    right.set(xlabel="step", ylabel="training loss (mean over seeds)")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=100)
