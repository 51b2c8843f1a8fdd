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

The definitions live in `measures.py` (`GAP`, `TIGHT`, `PERSIST`), the plots in `figures.py`.
Every claim takes an optional `size` (the tuple it otherwise picks with `ctx.size`), so that the
tests can run it smaller.
"""

import jax
import jax.numpy as jnp
import numpy as np

from seqlab.dynamics import token_flow
from theory.metastability import figures, measures
from theory.metastability.measures import PERSIST
from theory.registry import Context, Outcome, Paper, verdict

PAPER = Paper(
    "metastability",
    "Bruno, Pasqualotto, Agazzi, meta-stable clustering in mean-field transformers (2410.23228)",
)

GROWTH_RTOL = 0.01  # relative error allowed between a fitted and a predicted growth rate


@PAPER.claim(
    "growth_rates_circle",
    "Perturbed by a single small Fourier mode k, equally spaced particles on the circle move away "
    "from the uniform state at the linearized mean-field rate lambda_k = k^2 I_k(beta) / beta "
    "(USA) and lambda_k / I_0(beta) (SA): the fitted exponential growth rate of the mode "
    "amplitude |mean_j exp(i k theta_j)| is within 1% of lambda_k for every k = 1..K, SA and USA.",
    kind="paper",
)
def growth_rates_circle(ctx: Context, size=None) -> Outcome:
    n, beta, top = size or ctx.size((64, 4.0, 6), (256, 16.0, 12))
    ks = np.arange(1, top + 1)
    # Mode k starts at amplitude k eps / 2; the fastest grows by e^6, to about 1e-3: still linear.
    eps = 1e-6

    def response(xs):  # [K, S]: |mean_j exp(i k theta_j)| of run k
        amplitude = jax.vmap(token_flow.mode_amplitudes, (0, None))
        return np.stack([np.asarray(amplitude(xs[i], [k]))[:, 0] for i, k in enumerate(ks)])

    with jax.enable_x64(True):
        x0 = token_flow.on_circle(
            jnp.asarray(np.stack([measures.perturbed(n, [k], eps) for k in ks]))
        )
        fit = measures.fitted_growth(x0, beta, ks, 2, response, growth=6.0, n_steps=400, n_saves=40)
    return _growth_outcome(ctx, n, beta, ks, fit, d=2, where="circle")


def _growth_outcome(ctx: Context, n, beta, ks, fit, *, d: int, where: str) -> Outcome:
    """The verdict of a growth-rate claim from `measures.fitted_growth`'s `fit`: every fitted rate
    within `GROWTH_RTOL` of the prediction, SA and USA, and on the sphere (`d = 3`) the fastest
    fitted mode is `dominant_mode(beta, 3)` too."""
    measured, predicted, curves = fit
    rel_err = {m: np.abs(measured[m] / predicted[m] - 1) for m in measured}
    fastest = int(ks[np.argmax(measured["sa"])])
    expected_fastest = token_flow.dominant_mode(beta, d)
    holds = all(np.all(e <= GROWTH_RTOL) for e in rel_err.values())
    if d == 3:
        holds = holds and fastest == expected_fastest
    path = ctx.figure()
    figures.growth_rates(path, ks, beta, curves, measured, predicted, where=where)
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
        summary=f"largest relative error of the fitted rates: SA {rel_err['sa'].max():.2g}, USA "
        f"{rel_err['usa'].max():.2g} (holds iff <= {GROWTH_RTOL:g})"
        + (f"; fastest mode {fastest} (predicted {expected_fastest})" if d == 3 else ""),
        figures=(path,),
    )


@PAPER.claim(
    "growth_rates_sphere",
    "On the sphere S^2 the degree-k spherical harmonics grow from the uniform state at lambda_k = "
    "k (k + 1) sqrt(2) Gamma(3/2) beta^(-3/2) I_(k+1/2)(beta) (USA; SA divides by "
    "beta^(-1/2) sqrt(2) Gamma(3/2) I_(1/2)(beta)): the linear response of a Fibonacci lattice to "
    "a small zonal perturbation P_k(z) grows at a fitted rate within 1% of lambda_k for every "
    "k = 1..K, SA and USA, and the fastest is dominant_mode(beta, 3).",
    kind="paper",
)
def growth_rates_sphere(ctx: Context, size=None) -> Outcome:
    n, beta, top = size or ctx.size((400, 4.0, 4), (1000, 9.0, 6))
    ks = np.arange(1, top + 1)
    eps = 1e-6
    base = token_flow.fibonacci_sphere(n)
    starts = np.stack([base] + [measures.zonal_perturbation(base, k, eps) for k in ks])  # [1 + K]

    def response(xs):  # [K, S]
        # The lattice is not exactly uniform: subtract its own drift (the unperturbed run).
        xs = np.asarray(xs)
        zonal = measures.zonal_amplitude
        return np.stack([np.abs(zonal(xs[1 + i], k) - zonal(xs[0], k)) for i, k in enumerate(ks)])

    with jax.enable_x64(True):
        fit = measures.fitted_growth(
            jnp.asarray(starts), beta, ks, 3, response, growth=5.0, n_steps=200, n_saves=20
        )
    return _growth_outcome(ctx, n, beta, ks, fit, d=3, where="S^2, zonal response")


@PAPER.claim(
    "dominant_mode_count",
    "From equally spaced particles perturbed by every Fourier mode at the same small amplitude, "
    "the mode that grows fastest is k* = dominant_mode(beta, 2) and the particles form k* "
    "clusters (SA): for every beta of the range, the first metastable cluster count equals k*.",
    kind="paper",
)
def dominant_mode_count(ctx: Context, size=None) -> Outcome:
    n, betas = size or ctx.size(
        (128, (1.0, 4.0, 9.0, 16.0, 25.0)), (256, (1, 4, 9, 16, 25, 36, 64, 100))
    )
    betas = np.asarray(betas, np.float64)
    predicted = np.array([token_flow.dominant_mode(b, 2) for b in betas])
    modes = np.arange(1, 2 * predicted.max() + 3)
    eps, horizon = 1e-10, 60.0  # horizon in units of 1 / lambda_{k*}
    rates = np.array([measures.rate_of(b, True) for b in betas])
    with jax.enable_x64(True):
        x0 = token_flow.on_circle(jnp.asarray(measures.perturbed(n, modes, eps)))
        traj = measures.flows(
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
    counts, clustered = measures.cluster_history(traj.xs)
    states = [
        measures.metastable(t, c, k, PERSIST) for t, c, k in zip(ts, counts, clustered, strict=True)
    ]
    measured_count = np.array([-1 if s is None else s[0] for s in states])
    # The fastest-growing mode: the largest amplitude when the first one reaches 0.1 (linear end).
    linear_end = np.argmax(amps.max(axis=-1) >= 0.1, axis=-1)
    fastest = modes[np.argmax(amps[np.arange(len(betas)), linear_end], axis=-1)]
    holds = bool(np.all(measured_count == predicted))
    path = ctx.figure()
    figures.cluster_counts(path, betas, predicted, measured_count, traj, ts, states, linear_end)
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
        summary=f"cluster counts {measured_count.tolist()} against dominant_mode "
        f"{predicted.tolist()} for beta {betas.tolist()} (holds iff equal at every beta)",
        figures=(path,),
    )


@PAPER.claim(
    "random_start_frequency",
    "From iid uniform particles on the circle (SA), the number of clusters that form is random; "
    "the predicted count dominant_mode(beta, 2) is the most frequent first metastable count over "
    "many runs, though far from certain (the paper: about half to three quarters of the runs).",
    kind="consistency",
)
def random_start_frequency(ctx: Context, size=None) -> Outcome:
    n, runs, beta = size or ctx.size((128, 128, 9.0), (256, 512, 9.0))
    predicted = token_flow.dominant_mode(beta, 2)
    # A window of 40 units of 1 / lambda_{k*}, 8 steps per unit.
    _, _, _, states = measures.random_start_states(
        ctx.key, runs, n, beta, horizon=40.0, per_unit=8, normalized=True
    )
    outcome = np.array([-1 if s is None else s[0] for s in states])  # -1: none within the window
    values, freq = np.unique(outcome, return_counts=True)
    most = int(values[np.argmax(freq)])
    frequency = float(np.mean(outcome == predicted))
    path = ctx.figure()
    figures.count_histogram(path, outcome, predicted, beta, n)
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
        summary=f"most frequent first count {most}, predicted {predicted} (holds iff equal); "
        f"predicted in {frequency:.0%} of {runs} runs",
        figures=(path,),
    )


@PAPER.claim(
    "metastable_then_merge",
    "Clusters formed from iid uniform starts (USA) persist much longer than they took to form, "
    "then merge: over the runs, the median time the first metastable count holds is at least 3 "
    "times the median formation time, and at least half of the runs end the window with fewer "
    "clusters than they formed.",
    kind="paper",
)
def metastable_then_merge(ctx: Context, size=None) -> Outcome:
    n, runs, beta = size or ctx.size((64, 16, 9.0), (128, 64, 9.0))
    horizon = 400.0  # the window, in units of 1 / lambda_{k*} (4 steps per unit)
    ts, counts, clustered, states = measures.random_start_states(
        ctx.key, runs, n, beta, horizon=horizon, per_unit=4, normalized=False
    )
    found = [s for s in states if s is not None]
    formed = np.array([s[1] for s in found])
    held = np.array([s[2] - s[1] for s in found])
    merged = np.array([counts[r, -1] < s[0] for r, s in enumerate(states) if s is not None])
    persistent = bool(np.median(held) >= 3 * np.median(formed)) if found else False
    holds = persistent and merged.mean() >= 0.5
    path = ctx.figure()
    figures.counts_in_time(path, ts, counts, clustered, beta, n)
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
        summary=(
            f"median held / formation time {np.median(held) / np.median(formed):.3g} (holds iff "
            f">= 3), merged in {merged.mean():.0%} of runs (>= 50%)"
            if found
            else f"no run of {runs} formed a metastable state: undecided"
        ),
        figures=(path,),
    )


@PAPER.claim(
    "usa_energy_monotone",
    "USA is a gradient flow ascending E_beta = (1 / (2 beta n^2)) sum_ij exp(beta <x_i, x_j>): "
    "along an integrated trajectory from iid uniform starts the energy never decreases from one "
    "RK4 step to the next by more than that step's integrator error (step h against two steps "
    "h/2) plus float64 rounding.",
    kind="consistency",
)
def usa_energy_monotone(ctx: Context, size=None) -> Outcome:
    n, beta = size or ctx.size((64, 9.0), (256, 9.0))
    horizon, per_unit = 400.0, 4
    rate = measures.rate_of(beta, False)
    steps = int(horizon * per_unit)
    h = horizon / rate / steps
    with jax.enable_x64(True):
        x0 = token_flow.on_circle(jax.random.uniform(ctx.key, (n,), jnp.float64, 0.0, 2 * np.pi))
        traj = token_flow.integrate(
            x0, beta=beta, t1=horizon / rate, n_steps=steps, n_saves=steps, normalized=False
        )
        energies = np.asarray(measures.energies(traj.xs, beta))  # [S]
        # Local error of each step, measured on E: one step of h against two steps of h / 2.
        coarse = np.asarray(
            measures.energies(measures.one_step(traj.xs[:-1], beta, h, n_steps=1), beta)
        )
        fine = np.asarray(
            measures.energies(measures.one_step(traj.xs[:-1], beta, h, n_steps=2), beta)
        )
    step_error = np.abs(coarse - fine)
    rounding = 64 * np.finfo(np.float64).eps * energies[1:]
    increments = np.diff(energies)
    holds = bool(np.all(increments >= -(step_error + rounding)))
    ts = np.asarray(traj.ts) * rate
    counts, clustered = measures.cluster_history(np.asarray(traj.xs[::per_unit]))
    path = ctx.figure()
    figures.energy_staircase(path, ts, energies, ts[::per_unit], counts, clustered, beta, n)
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
        summary=f"{int(np.sum(increments < 0))} of {steps} steps decrease E, the worst by "
        f"{max(-increments.min(), 0.0):.2g} (holds iff each within its step error, at most "
        f"{step_error.max():.2g}, plus rounding)",
        figures=(path,),
    )
