"""The figures of the neural-ODE claims (matplotlib, written to the claims' figure paths)."""

import numpy as np
from matplotlib.figure import Figure

from theory.neural_ode.measures import ALL_EPS


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


def lm_comparison(path, pre):
    """Training curves and held-out losses of the ODE and discrete language models per seed."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    window = max(1, len(pre.ode_losses) // 30)
    smooth = lambda x: np.convolve(x, np.ones(window) / window, mode="valid")  # noqa: E731
    for r, seed in enumerate(pre.setup.seeds):
        left.plot(smooth(pre.ode_losses[:, r]), color="C0", lw=0.8, label=f"ODE, seed {seed}")
        left.plot(smooth(pre.discrete_losses[:, r]), color="C1", lw=0.8, label=f"discrete, {seed}")
    left.set(xlabel="step", ylabel="training loss (nats/byte)", title="pretraining (ode_lm data)")
    left.legend(fontsize=7)
    n = pre.setup.num_steps
    for x, losses in enumerate((pre.ode_eval, pre.discrete_eval)):
        right.plot([x] * len(losses), losses, "o", color=f"C{x}")
        right.hlines(np.mean(losses), x - 0.2, x + 0.2, color="k")
    right.set_xticks([0, 1], [f"ODE, {n} Euler steps", f"discrete, {n} layers"])
    right.set(ylabel="held-out loss", title=f"per seed (line: mean), N = {n}")
    fig.savefig(path, dpi=100)


def seed_spectra(path, ts, trained, init):
    """Mean |lambda| of the three products along the Euler depths, per seed, trained and init."""
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    titles = {"qk": "W_Q W_K^T", "ov": "W_V W_O", "mlp": "W_1 W_2"}
    for ax, (kind, title) in zip(fig.subplots(1, 3), titles.items(), strict=True):
        for r, (spec, spec0) in enumerate(zip(trained, init, strict=True)):
            ax.plot(
                ts,
                np.abs(spec[kind]).reshape(len(ts), -1).mean(1),
                "o-",
                color=f"C{r}",
                label=f"seed {r}, trained",
            )
            ax.plot(
                ts,
                np.abs(spec0[kind]).reshape(len(ts), -1).mean(1),
                ":",
                color=f"C{r}",
                label=f"seed {r}, init",
            )
        ax.set(xlabel="depth t_k = k / N", ylabel="mean |eigenvalue|", title=title)
    fig.axes[0].legend(fontsize=7)
    fig.savefig(path, dpi=100)


def ov_sign(path, ts, shares, init_shares, ov_eigs):
    """Positive share of the OV spectrum along depth per seed, and one seed's eigenvalues."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    for r in range(len(shares)):
        left.plot(ts, shares[r], "o-", color=f"C{r}", label=f"seed {r}, trained")
        left.plot(ts, init_shares[r], ":", color=f"C{r}", label=f"seed {r}, init")
    left.axhline(0.5, color="k", lw=0.5)
    left.axvline(0.5, color="k", lw=0.5, ls="--")
    left.set(xlabel="depth t_k", ylabel="share of |lambda| with Re > 0", title="W_V W_O sign")
    left.legend(fontsize=7)
    for k, t in enumerate(ts):
        e = np.ravel(ov_eigs[k])
        right.scatter(e.real, e.imag, s=12, color=plt_color(k, len(ts)), label=f"t = {t:.2f}")
    right.axvline(0, color="k", lw=0.5)
    right.set(xlabel="Re lambda", ylabel="Im lambda", title="W_V W_O eigenvalues, seed 0")
    right.legend(fontsize=7)
    fig.savefig(path, dpi=100)


def plt_color(k, n):
    """The `k`-th of `n` colors from dark (early depth) to light (late)."""
    from matplotlib import colormaps

    return colormaps["viridis"](k / max(1, n - 1))


def kv_exponents(path, lam, pairs, tokens, rate, chance):
    """Top exponent of every (output q, input i) block of one MQAR row, with the matching keys
    and values of its queries marked."""
    fig = Figure(figsize=(6.5, 5.5), layout="constrained")
    ax = fig.subplots()
    shown = np.where(np.isfinite(lam), lam, np.nan)
    image = ax.imshow(shown, cmap="magma", origin="upper")
    fig.colorbar(image, ax=ax, label="top exponent of dx_q(1)/dx_i(0)")
    for q, k, v in pairs:
        ax.plot([k, v], [q, q], "c s", ms=6, mfc="none", mew=1.5)
        best = int(np.argmax(lam[q, :q]))
        ax.plot(best, q, "wx", ms=7)
    ax.set(
        xlabel="input token i",
        ylabel="output (query) position q",
        title=f"squares: matching key/value; x: largest exponent\nhit rate {rate:.2f} "
        f"(chance {chance:.2f})",
    )
    ax.set_xticks(range(len(tokens)), [str(t) for t in tokens], fontsize=6)
    fig.savefig(path, dpi=100)


def finetune(path, ft, counts):
    """Held-out loss on the fine-tuning corpus along fine-tuning, full rank and LoRA (Fig. 6)."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    steps = sorted(ft.curves)
    curves = np.array([ft.curves[s] for s in steps])  # [points, R]
    n = counts[1]
    for ax, mode in zip(fig.subplots(1, 2, sharey=True), ("full", "lora"), strict=True):
        for r, (family, m, kind) in enumerate(ft.variants):
            if kind != mode and family != "scratch":
                continue
            if family == "ode":
                style = dict(marker="o", label=f"ODE ({n} -> {m})")
            elif family == "discrete":
                style = dict(marker="s", color="k", label=f"discrete ({n} -> {n})")
            else:
                style = dict(ls="--", color="C4", label=f"discrete from scratch ({n})")
            ax.plot(steps, curves[:, r], **style)
        ax.set(
            xlabel="fine-tuning step",
            ylabel="held-out loss (Markdown)",
            title="full rank" if mode == "full" else "LoRA",
        )
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)
