"""Measurements behind the metastability claims, on `seqlab.dynamics.token_flow`.

- Initial states: `equally_spaced`, `perturbed` (every Fourier mode the same amplitude),
  `zonal_perturbation` (a degree-`k` zonal harmonic on `S^2`), `uniform_starts`.
- Flows: `flows` (`token_flow.integrate` vmapped over runs), `one_step` (every snapshot advanced
  by one step), `energies`, `rate_of` (the growth rate of the dominant mode on the circle).
- Responses and rates: `zonal_amplitude`, `fitted_growth` (fitted and predicted growth rates of
  single modes, SA and USA).
- Clusters: `cluster_history` (count and clustered per snapshot), `metastable` (the first count
  that persists), `random_start_states` (the first metastable state of runs from uniform starts).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special

from seqlab.analysis import rates
from seqlab.dynamics import token_flow
from seqlab.modules.attention import Attention

GAP = 0.1  # radians: particles farther apart than this along the circle are in different clusters
TIGHT = 0.05  # radians: a clustered configuration has every cluster narrower than this
PERSIST = 5.0  # units of 1 / lambda_{k*}: a metastable count holds at least this long


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


def uniform_starts(key, runs: int, n: int):
    """`[runs, n, 2]` float32 particles drawn iid uniformly on the circle."""
    return token_flow.on_circle(jax.random.uniform(key, (runs, n), jnp.float32, 0.0, 2 * np.pi))


@functools.partial(jax.jit, static_argnames=("n_steps", "n_saves", "normalized", "block_size"))
def flows(x0, beta, t1, *, n_steps, n_saves, normalized, block_size=None) -> token_flow.Trajectory:
    """`token_flow.integrate` over initial states `x0: [R, n, d]` and `beta, t1: [R]`:
    `Trajectory(ts: [R, S], xs: [R, S, n, d])`. Runs are vmapped, or with a `block_size` (large
    `n`: blocked interaction) taken one after the other, so that one run's tiles fill the cache."""

    def one(x, b, t):
        return token_flow.integrate(
            x,
            beta=b,
            t1=t,
            n_steps=n_steps,
            n_saves=n_saves,
            normalized=normalized,
            block_size=block_size,
        )

    if block_size is None:
        return jax.vmap(one)(x0, beta, t1)
    return jax.lax.map(lambda args: one(*args), (x0, beta, t1))


@jax.jit
def energies(xs, beta):
    """`E_beta` of every snapshot of `xs: [S, n, d]`: `[S]`."""
    return jax.vmap(lambda x: token_flow.energy(x, beta=beta))(xs)


@functools.partial(jax.jit, static_argnames="n_steps")
def one_step(xs, beta, h, *, n_steps):
    """Every snapshot of `xs: [S, n, d]` advanced by `h` in `n_steps` USA RK4 steps: `[S, n, d]`."""

    def advance(x):
        return token_flow.integrate(
            x, beta=beta, t1=h, n_steps=n_steps, n_saves=1, normalized=False
        ).xs[-1]

    return jax.vmap(advance)(xs)


def rate_of(beta: float, normalized: bool) -> float:
    """`lambda_{k*}`: the growth rate of the dominant mode on the circle."""
    return float(
        token_flow.growth_rate(token_flow.dominant_mode(beta, 2), beta, 2, normalized=normalized)
    )


def fitted_growth(starts, beta, ks, d, response, *, growth, n_steps, n_saves):
    """Fitted and predicted growth rates of single modes `ks: [K]` on `S^{d-1}`, SA and USA.

    Every run of `starts: [R, n, d]` is integrated until the fastest predicted mode grows by
    `e^growth`; `response(xs: [R, S, n, d]) -> [K, S]` reads the amplitude of mode `ks[i]` and
    its fitted exponential rate is compared with `token_flow.growth_rate`. Returns
    `(measured, predicted, curves)`, dicts over `"sa"`, `"usa"`: rates `[K]`, rates `[K]` and
    `(ts: [S], amplitudes: [K, S])`. Call it with x64 enabled for float64 starts.
    """
    measured, predicted, curves = {}, {}, {}
    runs = len(starts)
    for name, normalized in (("sa", True), ("usa", False)):
        lam = token_flow.growth_rate(ks, beta, d, normalized=normalized)
        t1 = growth / lam.max()
        traj = flows(
            starts,
            jnp.full(runs, beta),
            jnp.full(runs, t1),
            n_steps=n_steps,
            n_saves=n_saves,
            normalized=normalized,
        )
        ts = np.asarray(traj.ts[0])
        amplitudes = response(traj.xs)
        measured[name] = np.array([rates.exponential_rate(ts, a) for a in amplitudes])
        predicted[name], curves[name] = lam, (ts, amplitudes)
    return measured, predicted, curves


@functools.partial(jax.jit, static_argnames="min_size")
def _cluster_stats(xs, min_size):
    """Over the clusters of at least `min_size` points of every snapshot of `xs: [..., n, 2]`:
    `(counts, widest)`, `[...]` (widest 2 pi when there is none)."""

    def stats(x):
        sizes, widths = token_flow.circle_cluster_sizes(x, gap=GAP)
        big = sizes >= min_size
        return jnp.sum(big), jnp.max(jnp.where(big, widths, 0.0))

    fn = stats
    for _ in range(xs.ndim - 2):
        fn = jax.vmap(fn)
    counts, widest = fn(xs)
    return counts, jnp.where(counts > 0, widest, 2 * jnp.pi)


def cluster_history(xs, share: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """`(counts, clustered)`, both `[...]`, of snapshots `xs: [..., n, 2]` (float32 or float64):
    the number of clusters (gaps `> GAP`) holding at least a fraction `share` of the particles
    (every cluster by default), and whether every one of them is narrower than `TIGHT`."""
    min_size = max(1, int(np.ceil(share * np.shape(xs)[-2])))
    with jax.enable_x64(True):
        counts, widest = _cluster_stats(jnp.asarray(xs), min_size)
    return np.asarray(counts), np.asarray(widest) < TIGHT


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


def random_start_states(
    key, runs: int, n: int, beta: float, *, horizon, per_unit, normalized, share: float = 0.0
):
    """The first metastable state of each of `runs` flows of `n` iid uniform particles (float32).

    Integrated over `horizon / lambda_{k*}` with `per_unit` RK4 steps and 2 snapshots per unit;
    clusters counted as `cluster_history(xs, share)`. Returns `(ts: [S]` in units of
    `1 / lambda_{k*}`, `counts: [runs, S]`, `clustered: [runs, S]`, `states)`, `states[r]` the
    `metastable` state of run `r` (held `PERSIST`) or None.
    """
    rate = rate_of(beta, normalized)
    traj = flows(
        uniform_starts(key, runs, n),
        jnp.full(runs, beta, jnp.float32),
        jnp.full(runs, horizon / rate, jnp.float32),
        n_steps=int(horizon * per_unit),
        n_saves=int(horizon * 2),
        normalized=normalized,
    )
    ts = np.asarray(traj.ts[0], np.float64) * rate
    counts, clustered = cluster_history(traj.xs, share)
    states = [metastable(ts, c, k, PERSIST) for c, k in zip(counts, clustered, strict=True)]
    return ts, counts, clustered, states


@jax.jit
def fourier_history(xs, ks):
    """`token_flow.fourier_modes` of every snapshot of `xs: [..., n, 2]`: complex `[..., K]`."""
    fn = token_flow.fourier_modes
    for _ in range(xs.ndim - 2):
        fn = jax.vmap(fn, (0, None))
    return fn(xs, ks)


def uniform_flows(key, runs, n, beta, *, horizon, per_unit, n_saves, block_size=None):
    """USA flows of `runs` x `n` iid uniform particles (float32) over `horizon / lambda_{k*}`
    with `per_unit` RK4 steps per unit of `1 / lambda_{k*}` and `n_saves` snapshots after the
    start. Returns `(ts: [S]` in units of `1 / lambda_{k*}`, `xs: [runs, S, n, 2])`.
    """
    rate = rate_of(beta, False)
    steps = round(horizon * per_unit)
    traj = flows(
        uniform_starts(key, runs, n),
        jnp.full(runs, beta, jnp.float32),
        jnp.full(runs, horizon / rate, jnp.float32),
        n_steps=steps - steps % n_saves,
        n_saves=n_saves,
        normalized=False,
        block_size=block_size,
    )
    return np.asarray(traj.ts[0], np.float64) * rate, traj.xs


def first_crossing(ts, amplitudes, level: float) -> np.ndarray:
    """The first time each row of `amplitudes: [R, S]` (positive, sampled at `ts: [S]`) reaches
    `level`, interpolating `log(amplitude)` linearly between snapshots: `[R]`, nan where it never
    does (or already does at `ts[0]`)."""
    ts, amplitudes = np.asarray(ts), np.asarray(amplitudes)
    out = np.full(len(amplitudes), np.nan)
    for r, a in enumerate(amplitudes):
        above = np.flatnonzero(a >= level)
        if above.size and above[0] > 0:
            i = above[0]
            lo, hi = np.log(a[i - 1]), np.log(a[i])
            out[r] = ts[i - 1] + (np.log(level) - lo) / (hi - lo) * (ts[i] - ts[i - 1])
    return out


def linear_fit(x, y) -> tuple[float, float]:
    """Least-squares slope of `y` against `x` (1-D, at least 3 points) and its standard error."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.ndim != 1 or x.shape != y.shape or x.size < 3:
        raise ValueError(f"x and y must be 1-D of the same length >= 3, got {x.shape}, {y.shape}")
    (slope, _), residual = np.polyfit(x, y, 1, full=True)[:2]
    dev = np.sum((x - x.mean()) ** 2)
    sigma2 = float(residual[0]) / (x.size - 2) if residual.size else 0.0
    return float(slope), float(np.sqrt(sigma2 / dev))


def race_estimate(rates, n: int, level: float, samples: int, rng) -> np.ndarray:
    """Our linear-theory estimate (not the paper's) of which Fourier mode forms the clusters from
    `n` iid uniform particles: the probability that mode `i` (growth rate `rates[i]`) is the
    first whose linearly grown amplitude `|c_i(0)| exp(rates[i] t)` reaches `level`, with
    `|c_i(0)|^2` iid exponential of mean `1 / n` (the central limit of `mean_j exp(i k theta_j)`).
    Monte Carlo over `samples` draws of the numpy generator `rng`: `[len(rates)]`, summing to 1."""
    rates = np.asarray(rates, np.float64)
    amplitude = np.sqrt(rng.exponential(size=(samples, rates.size)) / n)
    hit = (np.log(level) - np.log(amplitude)) / rates  # [samples, K]
    return np.bincount(np.argmin(hit, axis=1), minlength=rates.size) / samples


def race_times(rates, ns, level: float = 0.5, samples: int = 100_000, seed: int = 0) -> np.ndarray:
    """Our linear-theory estimate of the mean saturation time for each `n` of `ns`, in units of
    `1 / max(rates)`: the mean over draws `|c_i(0)|^2` iid exponential of mean `1 / n` of the
    first time `|c_i(0)| exp(rates[i] t)` reaches `level` over the modes `i` (`race_estimate`'s
    race; deterministic, `seed` fixes the draws): `[len(ns)]`."""
    rates = np.asarray(rates, np.float64)
    draws = np.random.default_rng(seed).exponential(size=(samples, rates.size))
    out = [np.mean(np.min((np.log(level) - 0.5 * np.log(draws / n)) / rates, axis=1)) for n in ns]
    return np.asarray(out) * rates.max()


def cluster_centres(x, gap: float = GAP, min_share: float = 0.0) -> np.ndarray:
    """The circular means (angles in `(-pi, pi]`) of the clusters of `x: [n, 2]` on the circle
    (split by angular gaps wider than `gap`) that hold at least `min_share` of the particles:
    `[clusters]`, in the order of the circle."""
    theta = np.sort(np.arctan2(np.asarray(x)[:, 1], np.asarray(x)[:, 0]))
    gaps = np.diff(theta, append=theta[0] + 2 * np.pi)
    cut = np.flatnonzero(gaps > gap)
    if cut.size == 0:
        groups = [theta]
    else:  # start right after a cut; the next cuts end the groups
        groups = np.split(np.roll(theta, -(cut[0] + 1)), np.cumsum(np.diff(cut)))
    return np.array(
        [np.angle(np.mean(np.exp(1j * g))) for g in groups if g.size >= min_share * theta.size]
    )


def centre_error(centres, phase: float, k: int) -> float:
    """Mean distance from `centres` (angles) to the nearest of the `k` points `(phase + 2 pi m)
    / k`, in units of half their spacing `pi / k`: in `[0, 1]`, about 1/2 for unrelated angles."""
    miss = np.angle(np.exp(1j * (k * np.asarray(centres) - phase)))  # k * distance, in (-pi, pi]
    return float(np.mean(np.abs(miss)) / np.pi)


def lifetimes(states) -> np.ndarray:
    """The lifetime `t_end - t_start` of each found `metastable` state (inf when it never ends
    within the window): `[found]`."""
    return np.array([s[2] - s[1] for s in states if s is not None], np.float64)


def censored_median(values) -> float:
    """The median of `values` where inf marks a value beyond the window (censored): inf when more
    than half are censored, else the ordinary median (censored values sort last)."""
    values = np.sort(np.asarray(values, np.float64))
    if values.size == 0:
        return float("nan")
    return float(values[(values.size - 1) // 2] + values[values.size // 2]) / 2


def identity_attention(d: int, beta: float, dtype=jnp.float64) -> tuple[Attention, dict]:
    """`seqlab.modules.attention.Attention` set to `Q = K = V = I` at inverse temperature `beta`
    for tokens of `S^{d-1}`: `(module, params)`.

    One head of width `D = 2 (d + 1)`; a token `x` sits in channels `1..d` (`embed`). The
    projections are `W_q = W_k = sqrt(beta sqrt(D)) I` (scores `D^{-1/2} <W_q x, W_k y> = beta
    <x, y>`), `W_v = W_o = I`. RoPE rotates the channel pair `(i, i + D/2)` by `p theta^(-2i/D)`;
    with `rope_theta = inf` only the pair `(0, D/2)` turns, and both channels are 0 for every token,
    so the scores do not depend on positions.
    """
    width = 2 * (d + 1)
    module = Attention(
        d_model=width, num_heads=1, rope_theta=float("inf"), dtype=dtype, param_dtype=dtype
    )
    scale = np.sqrt(beta * np.sqrt(width))
    eye = jnp.eye(width, dtype=dtype)
    params = {
        "q_proj": {"kernel": scale * eye},
        "k_proj": {"kernel": scale * eye},
        "v_proj": {"kernel": eye},
        "o_proj": {"kernel": eye},
    }
    return module, {"params": params}


def embed(x, width: int):
    """Tokens `x: [..., n, d]` in channels `1..d` of `[..., n, width]` (zeros elsewhere)."""
    d = x.shape[-1]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(1, width - d - 1)])


def attention_update(module, params, x):
    """`sum_j softmax_j(beta <x_i, x_j>) x_j: [n, d]` for tokens `x: [n, d]`, computed by the
    causal attention module: sequence `i` is `x` rolled so that token `i` comes last (it then sees
    every token), a batch of `n` sequences; its last output is the update of token `i`."""
    n, d = x.shape
    width = module.d_model
    shifts = jnp.arange(n)
    seqs = jax.vmap(lambda s: jnp.roll(x, n - 1 - s, axis=0))(shifts)  # [n, n, d], x_i last
    out = module.apply(params, embed(seqs, width))  # [n, n, width]
    return out[:, -1, 1 : d + 1]


@functools.partial(jax.jit, static_argnames="module")
def attention_network(module, params, x0, t1, layers):
    """`layers` residual attention layers with shared weights and normalized tokens, the depth
    as time (step `dt = t1 / layers`): `x <- (x + dt A(x)) / |x + dt A(x)|`, `A` =
    `attention_update`. Returns the tokens after the last layer, `[n, d]`. `layers` may be traced
    (one compilation for every depth)."""
    dt = t1 / layers

    def layer(_, x):
        y = x + dt * attention_update(module, params, x)
        return y / jnp.linalg.norm(y, axis=-1, keepdims=True)

    return jax.lax.fori_loop(0, layers, layer, x0)


SATURATION = 0.5  # |c_k| at which the linear density (1 + 2 |c_k| cos(k theta - phi)) / 2 pi hits 0


def saturation_runs(key, runs, n, beta, *, extra=2.0, per_unit=4):
    """USA flows of `runs` x `n` iid uniform particles until `ln(n) / 2 + extra` units of
    `1 / lambda_{k*}` (`per_unit` RK4 steps per unit, a snapshot after each), read through the
    Fourier modes `ks = 1..2 k* + 2`.

    Returns `(ts: [S]` (units of `1 / lambda_{k*}`), `xs: [runs, S, n, 2]`, `modes: [runs, S, K]`
    complex, `t_sat: [runs])`, `t_sat` the first time the largest `|c_k|` reaches `SATURATION`
    (nan when it does not within the window). Blocked interaction from `n = 1024` on.
    """
    horizon = 0.5 * np.log(n) + extra
    k = token_flow.dominant_mode(beta, 2)
    ts, xs = uniform_flows(
        key,
        runs,
        n,
        beta,
        horizon=horizon,
        per_unit=per_unit,
        n_saves=round(horizon * per_unit),
        block_size=1024 if n >= 1024 else None,
    )
    modes = np.asarray(fourier_history(xs, jnp.arange(1, 2 * k + 3)))
    return ts, xs, modes, first_crossing(ts, np.abs(modes).max(axis=-1), SATURATION)


def linearization_errors(modes0, modes1, ks, t, beta) -> np.ndarray:
    """Relative l2 distance, per run, between the USA particle modes `modes1: [R, K]` at time `t`
    and the linearized mean-field solution `token_flow.linearized_modes` started from the same
    particles' modes `modes0: [R, K]` at 0: `[R]`."""
    linear = token_flow.linearized_modes(modes0, ks, [t], beta, normalized=False)[:, 0]
    return np.linalg.norm(modes1 - linear, axis=-1) / np.linalg.norm(linear, axis=-1)
