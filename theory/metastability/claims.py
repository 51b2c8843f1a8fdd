"""Claims of Bruno, Pasqualotto, Agazzi, "Emergence of meta-stable clustering in mean-field
transformer models" (arXiv 2410.23228), measured on `seqlab.dynamics.token_flow`.

Tokens are particles on the circle (`d = 2`) moving by self-attention with `Q = K = V = I`,
softmax-normalized (SA) or not (USA). Linearized at the uniform measure, the Fourier mode `k` of
the particle density grows at `lambda_k = k^2 I_k(beta) / beta` (USA; SA divides by `I_0(beta)`),
and the fastest mode `k* = token_flow.dominant_mode(beta, 2)` sets how many clusters emerge. The
clusters persist for a long time, then merge; USA ascends the energy `E_beta` throughout.

Clusters on the circle are groups of particles separated by angular gaps wider than `GAP`; a
configuration is "clustered" when every cluster spans less than `TIGHT` radians. A cluster count is
"metastable" from the first clustered snapshot where it holds unchanged for at least
`PERSIST / lambda_{k*}` (so that stray particles still joining a cluster do not count as clusters).
Times are reported in units of the formation scale `1 / lambda_{k*}`.

Every claim takes an optional `size` (the tuple it otherwise picks with `ctx.size`), so that the
tests can run it smaller.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special
from matplotlib.figure import Figure

from seqlab.dynamics import token_flow
from theory.registry import Context, Outcome, Paper, verdict

PAPER = Paper(
    "metastability",
    "Bruno, Pasqualotto, Agazzi, meta-stable clustering in mean-field transformers (2410.23228)",
)

GAP = 0.1  # radians: particles farther apart than this along the circle are in different clusters
TIGHT = 0.05  # radians: a clustered configuration has every cluster narrower than this
PERSIST = 5.0  # units of 1 / lambda_{k*}: a metastable count holds at least this long
GROWTH_RTOL = 0.01  # relative error allowed between a fitted and a predicted growth rate


def on_circle(theta):
    """Points `[..., n, 2]` at the angles `theta: [..., n]`."""
    return jnp.stack([jnp.cos(theta), jnp.sin(theta)], axis=-1)


def equally_spaced(n: int) -> np.ndarray:
    """`2 pi j / n`, `j = 0..n-1`: the uniform state of `n` particles (float64 angles)."""
    return 2 * np.pi * np.arange(n) / n


def perturbed(n: int, modes, eps: float) -> np.ndarray:
    """Equally spaced angles displaced by `eps * sum_k sin(k theta + phi_k) / k`: every mode `k`
    in `modes` gets the same density amplitude `eps / 2` (a displacement `u` changes the density
    by `-u'`). Schroeder phases `phi_k = pi k (k - 1) / len(modes)` keep the sum flat, so no spot
    of the circle leaves the linear regime first."""
    theta = equally_spaced(n)
    modes = np.asarray(modes)
    phase = np.pi * modes * (modes - 1) / len(modes)
    displacement = np.sin(modes[:, None] * theta + phase[:, None]) / modes[:, None]
    return theta + eps * displacement.sum(axis=0)


def clusters(x: np.ndarray) -> tuple[int, float]:
    """`(count, widest)` of one configuration `x: [n, 2]`: the number of clusters (groups split
    by gaps `> GAP`, as `token_flow.cluster_count_circle`) and the angular span of the widest."""
    theta = np.sort(np.arctan2(x[:, 1], x[:, 0]))
    gaps = np.diff(theta, append=theta[0] + 2 * np.pi)  # gaps[i]: from particle i to i + 1
    split = gaps > GAP
    if not split.any():
        return 1, 2 * np.pi
    gaps = np.roll(gaps, -(np.argmax(split) + 1))  # start right after a split
    split = gaps > GAP
    cluster = np.cumsum(split) - split  # the cluster of each particle
    widths = np.bincount(cluster, weights=np.where(split, 0.0, gaps))
    return int(split.sum()), float(widths.max())


def cluster_history(xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(counts, clustered)`, both `[S]`, of snapshots `xs: [S, n, 2]`."""
    found = [clusters(x) for x in np.asarray(xs)]
    counts = np.array([c for c, _ in found])
    return counts, np.array([w < TIGHT for _, w in found])


def metastable(ts, counts, clustered, min_duration: float) -> tuple[int, float, float] | None:
    """The first metastable state `(count, t_start, t_end)`: the first clustered snapshot whose
    count then holds (clustered) for at least `min_duration`; `t_end` is the first time after
    `t_start` the count differs (inf when it never does within the window; the count must still be
    seen for `min_duration` before the window ends). None when there is no such state."""
    ts = np.asarray(ts)
    for i in np.flatnonzero(clustered):
        changed = np.flatnonzero((counts[i:] != counts[i]) | ~clustered[i:])
        seen_until = ts[i + changed[0]] if changed.size else ts[-1]
        if seen_until - ts[i] >= min_duration:
            return int(counts[i]), float(ts[i]), float(seen_until if changed.size else np.inf)
    return None


def fitted_rate(ts, amplitude) -> float:
    """The least-squares slope of `log amplitude` against `ts`."""
    return float(np.polyfit(np.asarray(ts), np.log(np.asarray(amplitude)), 1)[0])


@functools.partial(jax.jit, static_argnames=("n_steps", "n_saves", "normalized"))
def _flows(x0, beta, t1, *, n_steps, n_saves, normalized):
    """`token_flow.integrate` vmapped over initial states `x0: [R, n, d]` and `beta, t1: [R]`."""

    def one(x, b, t):
        return token_flow.integrate(
            x, beta=b, t1=t, n_steps=n_steps, n_saves=n_saves, normalized=normalized
        )

    return jax.vmap(one)(x0, beta, t1)


def _rate_of(beta: float, normalized: bool) -> float:
    """`lambda_{k*}`: the growth rate of the dominant mode on the circle."""
    return float(
        token_flow.growth_rate(token_flow.dominant_mode(beta, 2), beta, 2, normalized=normalized)
    )


@PAPER.claim(
    "growth_rates_circle",
    "Perturbed by a single small Fourier mode k, equally spaced particles on the circle move away "
    "from the uniform state at the linearized mean-field rate lambda_k = k^2 I_k(beta) / beta "
    "(USA) and lambda_k / I_0(beta) (SA): the fitted exponential growth rate of the mode "
    "amplitude |mean_j exp(i k theta_j)| is within 1% of lambda_k for every k = 1..K, SA and USA.",
)
def growth_rates_circle(ctx: Context, size=None) -> Outcome:
    n, beta, top = size or ctx.size((64, 4.0, 6), (256, 16.0, 12))
    ks = np.arange(1, top + 1)
    # Mode k starts at amplitude k eps / 2; the fastest grows by e^6, to about 1e-3: still linear.
    eps, growth = 1e-6, 6.0
    with jax.enable_x64(True):
        x0 = on_circle(jnp.asarray(np.stack([perturbed(n, [k], eps) for k in ks])))
        measured, predicted, amplitudes = {}, {}, {}
        for name, normalized in (("sa", True), ("usa", False)):
            lam = token_flow.growth_rate(ks, beta, 2, normalized=normalized)
            t1 = growth / lam.max()
            traj = _flows(
                x0,
                jnp.full(len(ks), beta),
                jnp.full(len(ks), t1),
                n_steps=400,
                n_saves=40,
                normalized=normalized,
            )
            ts = np.asarray(traj.ts[0])
            amp = np.stack(
                [
                    np.asarray(jax.vmap(token_flow.mode_amplitudes, (0, None))(traj.xs[i], [k]))[
                        :, 0
                    ]
                    for i, k in enumerate(ks)
                ]
            )  # [K, S]
            measured[name] = np.array([fitted_rate(ts, a) for a in amp])
            predicted[name], amplitudes[name] = lam, (ts, amp)
    rel_err = {m: np.abs(measured[m] / predicted[m] - 1) for m in measured}
    holds = all(np.all(e <= GROWTH_RTOL) for e in rel_err.values())
    path = ctx.figure()
    _plot_growth(path, ks, beta, amplitudes, measured, predicted)
    return Outcome(
        measured=dict(
            n=n,
            beta=beta,
            sa_rates=measured["sa"],
            usa_rates=measured["usa"],
            sa_max_rel_err=rel_err["sa"].max(),
            usa_max_rel_err=rel_err["usa"].max(),
            fastest_mode=int(ks[np.argmax(measured["sa"])]),
        ),
        expected=dict(
            sa_rates=predicted["sa"],
            usa_rates=predicted["usa"],
            fastest_mode=token_flow.dominant_mode(beta, 2),
            tolerance=f"relative error <= {GROWTH_RTOL}",
        ),
        verdict=verdict(holds),
        figures=(path,),
    )


def _plot_growth(path, ks, beta, amplitudes, measured, predicted, where="circle"):
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


def fibonacci_sphere(n: int) -> np.ndarray:
    """`[n, 3]` nearly uniform points of `S^2` (the Fibonacci lattice, float64)."""
    i = np.arange(n) + 0.5
    z = 1 - 2 * i / n
    phi = np.pi * (1 + np.sqrt(5)) * i
    r = np.sqrt(1 - z**2)
    return np.stack([r * np.cos(phi), r * np.sin(phi), z], axis=-1)


def zonal_perturbation(x: np.ndarray, k: int, eps: float) -> np.ndarray:
    """`x: [n, 3]` moved by `eps * grad_S P_k(z)` and retracted: the density changes by
    `-eps * Delta_S P_k = eps k (k + 1) P_k(z)`, a degree-`k` zonal harmonic."""
    z = x[:, 2]
    dp = scipy.special.eval_legendre(k, z)
    # P_k'(z) = k (z P_k - P_{k-1}) / (z^2 - 1), regular away from the poles (|z| < 1 here).
    dp = k * (z * dp - scipy.special.eval_legendre(k - 1, z)) / (z**2 - 1)
    tangent = np.array([0.0, 0.0, 1.0]) - z[:, None] * x  # grad_S z = P_x e_z
    y = x + eps * dp[:, None] * tangent
    return y / np.linalg.norm(y, axis=-1, keepdims=True)


def zonal_amplitude(xs, k: int) -> np.ndarray:
    """`mean_i P_k(z_i)` of particles `xs: [..., n, 3]`: `[...]`."""
    return scipy.special.eval_legendre(k, np.asarray(xs)[..., 2]).mean(axis=-1)


@PAPER.claim(
    "growth_rates_sphere",
    "On the sphere S^2 the degree-k spherical harmonics grow from the uniform state at lambda_k = "
    "k (k + 1) sqrt(2) Gamma(3/2) beta^(-3/2) I_(k+1/2)(beta) (USA; SA divides by "
    "beta^(-1/2) sqrt(2) Gamma(3/2) I_(1/2)(beta)): the linear response of a Fibonacci lattice to "
    "a small zonal perturbation P_k(z) grows at a fitted rate within 1% of lambda_k for every "
    "k = 1..K, SA and USA, and the fastest is dominant_mode(beta, 3).",
)
def growth_rates_sphere(ctx: Context, size=None) -> Outcome:
    n, beta, top = size or ctx.size((400, 4.0, 4), (1000, 9.0, 6))
    ks = np.arange(1, top + 1)
    eps, growth = 1e-6, 5.0
    base = fibonacci_sphere(n)
    starts = np.stack([base] + [zonal_perturbation(base, k, eps) for k in ks])  # [1 + K, n, 3]
    measured, predicted, curves = {}, {}, {}
    with jax.enable_x64(True):
        for name, normalized in (("sa", True), ("usa", False)):
            lam = token_flow.growth_rate(ks, beta, 3, normalized=normalized)
            t1 = growth / lam.max()
            runs = len(starts)
            traj = _flows(
                jnp.asarray(starts),
                jnp.full(runs, beta),
                jnp.full(runs, t1),
                n_steps=200,
                n_saves=20,
                normalized=normalized,
            )
            ts, xs = np.asarray(traj.ts[0]), np.asarray(traj.xs)
            # The lattice is not exactly uniform: subtract its own drift (the unperturbed run).
            response = np.stack(
                [
                    np.abs(zonal_amplitude(xs[1 + i], k) - zonal_amplitude(xs[0], k))
                    for i, k in enumerate(ks)
                ]
            )  # [K, S]
            measured[name] = np.array([fitted_rate(ts, r) for r in response])
            predicted[name], curves[name] = lam, (ts, response)
    rel_err = {m: np.abs(measured[m] / predicted[m] - 1) for m in measured}
    fastest = int(ks[np.argmax(measured["sa"])])
    expected_fastest = token_flow.dominant_mode(beta, 3)
    holds = all(np.all(e <= GROWTH_RTOL) for e in rel_err.values()) and fastest == expected_fastest
    path = ctx.figure()
    _plot_growth(path, ks, beta, curves, measured, predicted, where="S^2, zonal response")
    return Outcome(
        measured=dict(
            n=n,
            beta=beta,
            sa_rates=measured["sa"],
            usa_rates=measured["usa"],
            sa_max_rel_err=rel_err["sa"].max(),
            usa_max_rel_err=rel_err["usa"].max(),
            fastest_mode=fastest,
        ),
        expected=dict(
            sa_rates=predicted["sa"],
            usa_rates=predicted["usa"],
            fastest_mode=expected_fastest,
            tolerance=f"relative error <= {GROWTH_RTOL}",
        ),
        verdict=verdict(holds),
        figures=(path,),
    )


def _counts_of(traj) -> tuple[np.ndarray, np.ndarray]:
    """`(counts, clustered)`, both `[R, S]`, of a batch of trajectories `xs: [R, S, n, 2]`."""
    found = [cluster_history(xs) for xs in np.asarray(traj.xs)]
    return np.stack([c for c, _ in found]), np.stack([k for _, k in found])


@PAPER.claim(
    "dominant_mode_count",
    "From equally spaced particles perturbed by every Fourier mode at the same small amplitude, "
    "the mode that grows fastest is k* = dominant_mode(beta, 2) and the particles form k* "
    "clusters (SA): for every beta of the range, the first metastable cluster count equals k*.",
)
def dominant_mode_count(ctx: Context, size=None) -> Outcome:
    n, betas = size or ctx.size(
        (128, (1.0, 4.0, 9.0, 16.0, 25.0)), (256, (1, 4, 9, 16, 25, 36, 64, 100))
    )
    betas = np.asarray(betas, np.float64)
    predicted = np.array([token_flow.dominant_mode(b, 2) for b in betas])
    modes = np.arange(1, 2 * predicted.max() + 3)
    eps, horizon = 1e-10, 60.0  # horizon in units of 1 / lambda_{k*}
    rates = np.array([_rate_of(b, True) for b in betas])
    with jax.enable_x64(True):
        x0 = on_circle(jnp.asarray(perturbed(n, modes, eps)))
        traj = _flows(
            jnp.broadcast_to(x0, (len(betas), *x0.shape)),
            jnp.asarray(betas),
            jnp.asarray(horizon / rates),
            n_steps=2400,
            n_saves=120,
            normalized=True,
        )
        amps = jax.vmap(jax.vmap(token_flow.mode_amplitudes, (0, None)), (0, None))(
            traj.xs, modes
        )  # [B, S, modes]
    ts = np.asarray(traj.ts) * rates[:, None]  # [B, S] in units of 1 / lambda_{k*}
    amps = np.asarray(amps)
    counts, clustered = _counts_of(traj)
    states = [metastable(t, c, k, PERSIST) for t, c, k in zip(ts, counts, clustered, strict=True)]
    measured_count = np.array([-1 if s is None else s[0] for s in states])
    # The fastest-growing mode: the largest amplitude when the first one reaches 0.1 (linear end).
    linear_end = np.argmax(amps.max(axis=-1) >= 0.1, axis=-1)
    fastest = modes[np.argmax(amps[np.arange(len(betas)), linear_end], axis=-1)]
    holds = bool(np.all(measured_count == predicted))
    path = ctx.figure()
    _plot_counts(path, betas, predicted, measured_count, traj, ts, states, linear_end)
    return Outcome(
        measured=dict(
            n=n,
            betas=betas,
            cluster_count=measured_count,
            fastest_mode=fastest,
            formed_at=[None if s is None else s[1] for s in states],
            held_until=[None if s is None else s[2] for s in states],
            final_count=counts[:, -1],
        ),
        expected=dict(
            cluster_count=predicted,
            fastest_mode=predicted,
            rule=f"count = dominant_mode(beta, 2) for every beta; eps = {eps}, time unit "
            f"1 / lambda_k*, window {horizon}, metastable = held >= {PERSIST}",
        ),
        verdict=verdict(holds),
        figures=(path,),
    )


def _plot_counts(path, betas, predicted, measured, traj, ts, states, linear_end):
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


def _uniform_starts(key, runs: int, n: int):
    """`[runs, n, 2]` float32 particles drawn iid uniformly on the circle."""
    return on_circle(jax.random.uniform(key, (runs, n), jnp.float32, 0.0, 2 * np.pi))


@PAPER.claim(
    "random_start_frequency",
    "From iid uniform particles on the circle (SA), the number of clusters that form is random; "
    "the predicted count dominant_mode(beta, 2) is the most frequent first metastable count over "
    "many runs, though far from certain (the paper: about half to three quarters of the runs).",
)
def random_start_frequency(ctx: Context, size=None) -> Outcome:
    n, runs, beta = size or ctx.size((128, 128, 9.0), (256, 512, 9.0))
    predicted = token_flow.dominant_mode(beta, 2)
    horizon, per_unit = 40.0, 8  # window and steps per unit of 1 / lambda_{k*}
    rate = _rate_of(beta, True)
    traj = _flows(
        _uniform_starts(ctx.key, runs, n),
        jnp.full(runs, beta, jnp.float32),
        jnp.full(runs, horizon / rate, jnp.float32),
        n_steps=int(horizon * per_unit),
        n_saves=int(horizon * 2),
        normalized=True,
    )
    ts = np.asarray(traj.ts[0], np.float64) * rate
    counts, clustered = _counts_of(traj)
    states = [metastable(ts, c, k, PERSIST) for c, k in zip(counts, clustered, strict=True)]
    outcome = np.array([-1 if s is None else s[0] for s in states])  # -1: none within the window
    values, freq = np.unique(outcome, return_counts=True)
    most = int(values[np.argmax(freq)])
    frequency = float(np.mean(outcome == predicted))
    path = ctx.figure()
    _plot_histogram(path, outcome, predicted, beta, n)
    return Outcome(
        measured=dict(
            n=n,
            beta=beta,
            runs=runs,
            most_frequent_count=most,
            frequency_of_predicted=frequency,
            histogram={int(v): int(f) for v, f in zip(values, freq, strict=True)},
            median_formation_time=float(np.median([s[1] for s in states if s is not None])),
        ),
        expected=dict(
            most_frequent_count=predicted,
            frequency_of_predicted="well below 1 (about 0.5 to 0.75)",
            formation_time_scale=f"ln(n) / 2 = {np.log(n) / 2:.2f} (units of 1 / lambda_k*)",
        ),
        verdict=verdict(most == predicted, decidable=bool(np.any(outcome > 0))),
        figures=(path,),
    )


def _plot_histogram(path, outcome, predicted, beta, n):
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


@PAPER.claim(
    "metastable_then_merge",
    "Clusters formed from iid uniform starts (USA) persist much longer than they took to form, "
    "then merge: over the runs, the median time the first metastable count holds is at least 3 "
    "times the median formation time, and at least half of the runs end the window with fewer "
    "clusters than they formed.",
)
def metastable_then_merge(ctx: Context, size=None) -> Outcome:
    n, runs, beta = size or ctx.size((64, 16, 9.0), (128, 64, 9.0))
    horizon, per_unit = 400.0, 4  # window and steps per unit of 1 / lambda_{k*}
    rate = _rate_of(beta, False)
    traj = _flows(
        _uniform_starts(ctx.key, runs, n),
        jnp.full(runs, beta, jnp.float32),
        jnp.full(runs, horizon / rate, jnp.float32),
        n_steps=int(horizon * per_unit),
        n_saves=int(horizon * 2),
        normalized=False,
    )
    ts = np.asarray(traj.ts[0], np.float64) * rate
    counts, clustered = _counts_of(traj)
    states = [metastable(ts, c, k, PERSIST) for c, k in zip(counts, clustered, strict=True)]
    found = [s for s in states if s is not None]
    formed = np.array([s[1] for s in found])
    held = np.array([s[2] - s[1] for s in found])
    merged = np.array([counts[r, -1] < s[0] for r, s in enumerate(states) if s is not None])
    persistent = bool(np.median(held) >= 3 * np.median(formed)) if found else False
    holds = persistent and merged.mean() >= 0.5
    path = ctx.figure()
    _plot_counts_in_time(path, ts, counts, clustered, beta, n)
    return Outcome(
        measured=dict(
            n=n,
            beta=beta,
            runs=runs,
            median_formation_time=float(np.median(formed)) if found else None,
            median_time_held=float(np.median(held)) if found else None,
            formed_counts=[s[0] for s in found],
            final_counts=counts[:, -1],
            fraction_merged=float(merged.mean()) if found else None,
            runs_without_metastable_state=runs - len(found),
        ),
        expected=dict(
            median_time_held=">= 3 x median formation time (units of 1 / lambda_k*)",
            fraction_merged=f">= 0.5 within the window of {horizon:g}",
        ),
        verdict=verdict(holds, decidable=bool(found) and (not persistent or merged.mean() >= 0.5)),
        figures=(path,),
    )


def _plot_counts_in_time(path, ts, counts, clustered, beta, n):
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


@jax.jit
def _energies(xs, beta):
    """`E_beta` of every snapshot of `xs: [S, n, d]`: `[S]`."""
    return jax.vmap(lambda x: token_flow.energy(x, beta=beta))(xs)


@functools.partial(jax.jit, static_argnames="n_steps")
def _one_step(xs, beta, h, *, n_steps):
    """Every snapshot of `xs: [S, n, d]` advanced by `h` in `n_steps` USA RK4 steps: `[S, n, d]`."""

    def advance(x):
        return token_flow.integrate(
            x, beta=beta, t1=h, n_steps=n_steps, n_saves=1, normalized=False
        ).xs[-1]

    return jax.vmap(advance)(xs)


@PAPER.claim(
    "usa_energy_monotone",
    "USA is a gradient flow ascending E_beta = (1 / (2 beta n^2)) sum_ij exp(beta <x_i, x_j>): "
    "along an integrated trajectory from iid uniform starts the energy never decreases from one "
    "RK4 step to the next by more than that step's integrator error (step h against two steps "
    "h/2) plus float64 rounding.",
)
def usa_energy_monotone(ctx: Context, size=None) -> Outcome:
    n, beta = size or ctx.size((64, 9.0), (256, 9.0))
    horizon, per_unit = 400.0, 4
    rate = _rate_of(beta, False)
    steps = int(horizon * per_unit)
    h = horizon / rate / steps
    with jax.enable_x64(True):
        x0 = on_circle(jax.random.uniform(ctx.key, (n,), jnp.float64, 0.0, 2 * np.pi))
        traj = token_flow.integrate(
            x0, beta=beta, t1=horizon / rate, n_steps=steps, n_saves=steps, normalized=False
        )
        energies = np.asarray(_energies(traj.xs, beta))  # [S]
        # Local error of each step, measured on E: one step of h against two steps of h / 2.
        coarse = np.asarray(_energies(_one_step(traj.xs[:-1], beta, h, n_steps=1), beta))
        fine = np.asarray(_energies(_one_step(traj.xs[:-1], beta, h, n_steps=2), beta))
    step_error = np.abs(coarse - fine)
    rounding = 64 * np.finfo(np.float64).eps * energies[1:]
    increments = np.diff(energies)
    holds = bool(np.all(increments >= -(step_error + rounding)))
    ts = np.asarray(traj.ts) * rate
    counts, clustered = cluster_history(np.asarray(traj.xs[::per_unit]))
    path = ctx.figure()
    _plot_staircase(path, ts, energies, ts[::per_unit], counts, clustered, beta, n)
    return Outcome(
        measured=dict(
            n=n,
            beta=beta,
            steps=steps,
            energy_start=energies[0],
            energy_end=energies[-1],
            min_increment=increments.min(),
            decreasing_steps=int(np.sum(increments < 0)),
            max_step_error=step_error.max(),
            final_clusters=int(counts[-1]),
        ),
        expected=dict(
            increments=">= -(|E(step h) - E(2 steps h/2)| + 64 eps E) at every step",
            dE_dt="(1/n) sum_i |dx_i/dt|^2 >= 0",
        ),
        verdict=verdict(holds),
        figures=(path,),
    )


def _plot_staircase(path, ts, energies, ts_counts, counts, clustered, beta, n):
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
