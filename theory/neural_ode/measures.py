"""Measurements behind the neural-ODE claims, on `seqlab.modules.ode_transformer` models.

- `token_field`, `initial_state`: the model's vector field on one sequence and its `x(0)`.
- `depth_spectra`, `magnitude_trend`: eigenvalues of the weight products along depth and the
  fitted trend of their magnitudes.
- `token_exponents`, `perturbation_growth`: finite-time Lyapunov exponents of the model's Euler
  flow and the growth of small perturbations through it (at the step sizes `ALL_EPS`).
"""

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


def depth_spectra(model, params, ts: jax.Array) -> dict[str, np.ndarray]:
    """`{"qk", "ov": [S, H, K], "mlp": [S, min(D, F)]}` complex eigenvalues at depths `ts: [S]`."""
    weights_fn = lambda t: model.apply({"params": params}, t, method="weights")  # noqa: E731
    got = jax.jit(spectra.spectra_along_depth, static_argnums=0)(weights_fn, ts)
    return {k: np.asarray(v) for k, v in got.items()}


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
