"""Measurements behind the neural-ODE claims, on `seqlab.modules.ode_transformer` models.

- `token_field`, `initial_state`: the model's vector field on one sequence and its `x(0)`.
- `depth_spectra`, `magnitude_trend`: eigenvalues of the weight products along depth and the
  fitted trend of their magnitudes.
- `token_exponents`, `perturbation_growth`: finite-time Lyapunov exponents of the model's Euler
  flow and the growth of small perturbations through it (at the step sizes `ALL_EPS`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from seqlab.analysis import lyapunov, rates, spectra

# Finite differences: `(1/tau) log(growth)` of an `eps`-perturbation tends to the exponent at
# first order in `eps`; the perturbation sizes, largest first.
ALL_EPS = (1.0, 1e-1, 1e-2, 1e-3)


def token_field(model, params):
    """The model's vector field on one sequence: `f(t, x: [T, D]) -> dx/dt: [T, D]`."""
    return lambda t, x: model.apply({"params": params}, t, x[None], method="vector_field")[0]


def initial_state(model, params, tokens: jax.Array) -> jax.Array:
    """`x(0): [T, D]`, the embedded tokens of one sequence `tokens: [T]`, in the dtype of the
    model's residual stream."""
    return model.apply({"params": params}, tokens[None], method="embed")[0].astype(model.acc_dtype)


@functools.cache
def _spectra_fn(model):
    """`(params, ts) -> spectra_along_depth` of `model`, jitted once per model."""

    def fn(params, ts):
        weights = lambda t: model.apply({"params": params}, t, method="weights")  # noqa: E731
        return spectra.spectra_along_depth(weights, ts)

    return jax.jit(fn)


def depth_spectra(model, params, ts: jax.Array) -> dict[str, np.ndarray]:
    """`{"qk", "ov": [S, H, K], "mlp": [S, min(D, F)]}` complex eigenvalues at depths `ts: [S]`."""
    return {k: np.asarray(v) for k, v in _spectra_fn(model)(params, ts).items()}


def magnitude_trend(ts: np.ndarray, eigs: np.ndarray) -> dict:
    """Magnitudes of `eigs: [S, ...]` along `ts: [S]`: the mean `|lambda|` and the largest over
    the other axes per `t` (`[S]` each), and least-squares slopes of both, absolute and relative
    to the curve's mean level."""
    mags = np.abs(eigs).reshape(len(ts), -1)
    out = {"mean_abs": mags.mean(axis=1), "max_abs": mags.max(axis=1)}
    for name in ("mean_abs", "max_abs"):
        slope = rates.slope(ts, out[name])
        out[f"{name}_slope"] = slope
        out[f"{name}_relative_slope"] = slope / float(out[name].mean())
    return out


def unit(v):
    """`v / |v|`."""
    return v / jnp.linalg.norm(v)


def token_exponents(model, params, x0: jax.Array, num_steps: int):
    """Per token `i` of `x0: [T, D]`: the flow-Jacobian exponents of token `i`'s frame `[T, D]`
    (decreasing), the QR exponents `[T, D]` (frame order), and the top input directions
    `[T, T, D]`, all of the model's `num_steps`-step Euler flow on `[0, 1]`."""
    f = token_field(model, params)

    @jax.jit
    def one(frame):
        lam, vecs = lyapunov.flow_jacobian_exponents(
            f, x0, num_steps=num_steps, frame=frame, return_vectors=True
        )
        return lam, lyapunov.qr_exponents(f, x0, num_steps=num_steps, frame=frame), vecs[0]

    per_token = [one(lyapunov.token_frame(x0.shape, i, x0.dtype)) for i in range(x0.shape[0])]
    lam, mu, top = (jnp.stack(v) for v in zip(*per_token, strict=True))
    return np.asarray(lam), np.asarray(mu), top


def perturbation_growth(model, params, x0: jax.Array, num_steps: int):
    """A jitted `(v: [T, D], |v| = 1) -> (fd: [len(ALL_EPS)], linear)` for the model's
    `num_steps`-step Euler flow on `[0, 1]` (tau = 1) from `x0: [T, D]`: `fd[e] = log(|x'(1) -
    x(1)| / eps_e)` with `x'(0) = x0 + eps_e v` through the nonlinear flow, and `linear = log|J v|`
    its eps -> 0 limit from the exact tangent map."""
    f = token_field(model, params)
    flow = lambda x: lyapunov.integrate(f, x, num_steps=num_steps)  # noqa: E731
    eps = jnp.asarray(ALL_EPS, x0.dtype)

    @jax.jit
    def growth(v):
        base, jvp = jax.linearize(flow, x0)
        moved = jax.vmap(flow)(x0 + eps[:, None, None] * v)
        fd = jnp.log(jnp.linalg.norm((moved - base).reshape(len(ALL_EPS), -1), axis=1) / eps)
        return fd, jnp.log(jnp.linalg.norm(jvp(v)))

    return growth


# -- the sign of the OV eigenvalues -------------------------------------------------------------


def positive_share(eigs: np.ndarray) -> np.ndarray:
    """Per depth, the magnitude-weighted share of eigenvalues with positive real part:
    `sum |lambda| [Re lambda > 0] / sum |lambda|` over every axis but the first of `eigs: [S,
    ...]`; `[S]` in [0, 1] (0.5 for a spectrum symmetric about the imaginary axis)."""
    flat = np.asarray(eigs).reshape(len(eigs), -1)
    mags = np.abs(flat)
    if not np.all(mags.sum(axis=1) > 0):
        raise ValueError("eigs must have a non-zero eigenvalue at every depth")
    return (mags * (flat.real > 0)).sum(axis=1) / mags.sum(axis=1)


def early_late(ts: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """Means of `values: [S]` over `t < 1/2` and over `t >= 1/2` (`ts: [S]` depths in [0, 1])."""
    ts, values = np.asarray(ts), np.asarray(values)
    late = ts >= 0.5
    if late.all() or not late.any():
        raise ValueError(f"ts must have depths on both sides of 1/2, got {ts}")
    return float(values[~late].mean()), float(values[late].mean())


# -- Lyapunov exponents per (output token, input token) -----------------------------------------


@functools.cache
def _pair_top_singular(model, num_steps: int):
    """`(params, x0: [T, D]) -> [q, i]` top singular values of the blocks `dx_q(1)/dx_i(0)`,
    jitted once per model and step count."""

    def fn(params, x0):
        length, d = x0.shape
        f = token_field(model, params)
        images = lyapunov.flow_jacobian(f, x0, num_steps=num_steps)  # [T*D, T, D]: J e_(i, a)
        jac = images.reshape(length, d, length, d)  # [i, a, q, b] = dx_q,b / dx_i,a
        sigma = jnp.linalg.svd(jnp.transpose(jac, (2, 0, 3, 1)), compute_uv=False)  # [q, i, D]
        return sigma[..., 0]

    return jax.jit(fn)


def pair_exponents(model, params, x0: jax.Array, num_steps: int) -> np.ndarray:
    """`lam[q, i]`: the top finite-time exponent of the block `dx_q(1) / dx_i(0): [D, D]` of the
    model's `num_steps`-step Euler flow on `[0, 1]` from `x0: [T, D]` (the largest growth of
    output token `q` under a perturbation of input token `i`); `[T, T]`, `-inf` for `i > q`
    (causal attention)."""
    length = x0.shape[0]
    top = np.asarray(_pair_top_singular(model, num_steps)(params, x0), np.float64)
    with np.errstate(divide="ignore"):
        lam = np.log(top)
    return np.where(np.tril(np.ones((length, length), bool)), lam, -np.inf)


def recall_pairs(inputs: np.ndarray, targets: np.ndarray, ignore: int) -> list[tuple]:
    """The queries of one MQAR row (`inputs, targets: [T]`): `(q, key_pos, value_pos)` for every
    scored position `q`, with the positions of the matching key and its value in the prefix (the
    first earlier `key, value` pair of the query's token and target)."""
    found = []
    for q in np.flatnonzero(targets != ignore):
        keys = [k for k in np.flatnonzero(inputs[:q] == inputs[q]) if inputs[k + 1] == targets[q]]
        if not keys:
            raise ValueError(f"the query at {q} has no earlier key followed by its target")
        found.append((int(q), int(keys[0]), int(keys[0]) + 1))
    return found


def kv_hits(lam: np.ndarray, pairs: list[tuple]) -> np.ndarray:
    """Per query `(q, key_pos, value_pos)`: whether the input token `i < q` with the largest
    `lam[q, i]` (`pair_exponents`; the query's own token excluded) is the matching key or value;
    `[len(pairs)]` bool."""
    return np.array([int(np.argmax(lam[q, :q])) in (k, v) for q, k, v in pairs], bool)


def chance_rate(pairs: list[tuple]) -> float:
    """The hit rate of a uniformly random earlier token: mean of `2 / q` over the queries."""
    return float(np.mean([2.0 / q for q, _, _ in pairs]))
