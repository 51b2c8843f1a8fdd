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


@functools.partial(jax.jit, static_argnames=("n_steps", "n_saves", "normalized"))
def flows(x0, beta, t1, *, n_steps, n_saves, normalized) -> token_flow.Trajectory:
    """`token_flow.integrate` vmapped over initial states `x0: [R, n, d]` and `beta, t1: [R]`:
    `Trajectory(ts: [R, S], xs: [R, S, n, d])`."""

    def one(x, b, t):
        return token_flow.integrate(
            x, beta=b, t1=t, n_steps=n_steps, n_saves=n_saves, normalized=normalized
        )

    return jax.vmap(one)(x0, beta, t1)


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


@jax.jit
def _cluster_stats(xs):
    """`circle_clusters` of every snapshot of `xs: [..., n, 2]`: `(counts, widest)`, `[...]`."""
    fn = functools.partial(token_flow.circle_clusters, gap=GAP)
    for _ in range(xs.ndim - 2):
        fn = jax.vmap(fn)
    return fn(xs)


def cluster_history(xs) -> tuple[np.ndarray, np.ndarray]:
    """`(counts, clustered)`, both `[...]`, of snapshots `xs: [..., n, 2]` (float32 or float64):
    the number of clusters (gaps `> GAP`) and whether every cluster is narrower than `TIGHT`."""
    with jax.enable_x64(True):
        counts, widest = _cluster_stats(jnp.asarray(xs))
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


def random_start_states(key, runs: int, n: int, beta: float, *, horizon, per_unit, normalized):
    """The first metastable state of each of `runs` flows of `n` iid uniform particles (float32).

    Integrated over `horizon / lambda_{k*}` with `per_unit` RK4 steps and 2 snapshots per unit.
    Returns `(ts: [S]` in units of `1 / lambda_{k*}`, `counts: [runs, S]`, `clustered: [runs, S]`,
    `states)`, `states[r]` the `metastable` state of run `r` (held `PERSIST`) or None.
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
    counts, clustered = cluster_history(traj.xs)
    states = [metastable(ts, c, k, PERSIST) for c, k in zip(counts, clustered, strict=True)]
    return ts, counts, clustered, states
