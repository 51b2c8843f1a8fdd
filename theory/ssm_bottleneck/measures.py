"""Measurements behind the recency and over-smoothing claims, on seqlab's Mamba and scan op.

- `init_with_input`, `step_sizes`, `state_influence`, `influence_and_steps`,
  `one_step_retention`, `retention_and_steps`, `elapsed`: the polarization claims' influence on
  the final state, one-step retention and elapsed step size of a Mamba mixer.
- `smoothing_curves`: the similarity measures of `seqlab.analysis.similarity` per layer.
- `recency_fit`, `recency_profile`: mean log-influence `log ||dy_t / dx_{t-r}||` against the
  distance `r` and its fitted slope, for influence matrices or a Mamba mixer.
- `train_delayed_copy`: a short Adam training of a Mamba mixer on `y_t = x_{t-k}`.
- `ssm_stack`: a stack of SSM layers in the over-smoothing theorem's setting. Layer `k` reads its
  input-dependent step size from a random Mamba (`dt = softplus(S_delta x + b_dt)`, the module's
  own maps) and runs `seqlab.ops.selective_scan` with one state, `B = C = 1`, `A = -a`, no skip:

      h_t = exp(-a dt_t) h_{t-1} + dt_t x_t,   y_t = h_t      (per channel)

  With `A_t = exp(-a dt_t)` in [0, 1] and `A_t + dt_t <= 1`, `y_t` is a combination of
  `0, x_1..x_t` with non-negative weights summing to at most 1 (by induction, the weights' sum
  `W_t = A_t W_{t-1} + dt_t <= A_t + dt_t <= 1`). If the inputs are centered (per-channel mean 0,
  so 0 lies between the channel's min and max), every `y_t[d]` lies in `[min_t x[d], max_t x[d]]`:
  no channel's range can grow, layer after layer.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from seqlab.analysis import rates, similarity
from seqlab.analysis.influence import module_influence, token_influence
from seqlab.analysis.transitions import transition_range
from seqlab.dynamics.mamba_ode import step_size_map
from seqlab.modules.mamba import Mamba
from seqlab.ops.selective_scan import selective_scan

# Influences below this are float32 underflow, not measurements (the smallest normal is 1.2e-38).
UNDERFLOW = 1e-30


@functools.partial(jax.jit, static_argnums=0)
def _influences(model: Mamba, params, xs: jax.Array) -> jax.Array:
    """`[B, T, T]` influence matrices of the mixer on each sequence of `xs: [B, T, d_model]`, one
    sequence at a time (`lax.map`: each holds `T * d_model` backward passes in memory)."""
    return jax.lax.map(lambda x: module_influence(model, params, x), xs)


def recency_fit(infl: np.ndarray, min_distance: int) -> dict:
    """Mean log-influence against distance for influence matrices `infl: [B, T, T]`.

    `profile[r] = mean_{b, t} log infl[b, t, t - r]` for `r = min_distance..T-1`; `slope`,
    `slope_stderr` and `intercept` of a least-squares line through it (`rates.line_fit`).
    """
    length = infl.shape[-1]
    distances = np.arange(min_distance, length)
    profile = np.array(
        [np.mean(np.log(np.diagonal(infl, offset=-r, axis1=1, axis2=2))) for r in distances]
    )
    return dict(distances=distances, profile=profile, **rates.line_fit(distances, profile))


def recency_profile(model: Mamba, params, xs: jax.Array, min_distance: int) -> dict:
    """`recency_fit` of the mixer's influence matrices on `xs: [B, T, d_model]` (closer tokens
    than `min_distance` also reach `y_t` through the convolution window), plus `log_a_max`: the
    log of the largest transition `exp(dt A)` over batch, time and channels."""
    infl = np.asarray(_influences(model, params, xs), np.float64)  # [B, T, T]
    _, a_max = transition_range(model.apply(params, xs, method="op_inputs"))
    log_a_max = float(np.log(np.max(np.asarray(a_max, np.float64))))
    return dict(**recency_fit(infl, min_distance), log_a_max=log_a_max)


def train_delayed_copy(
    model: Mamba, params, key: jax.Array, *, steps: int, delay: int, length: int, batch: int
):
    """Adam (lr 1e-2) on the mean squared error of `y_t = x_{t - delay}` (zeros before the
    start), fresh standard-normal inputs each step. Returns `(params, losses: [steps])`."""
    opt = optax.adam(1e-2)

    def loss_fn(p, x):
        target = jnp.pad(x, ((0, 0), (delay, 0), (0, 0)))[:, :length]
        return jnp.mean(jnp.square(model.apply(p, x) - target))

    @jax.jit
    def step(carry, k):
        p, state = carry
        x = jax.random.normal(k, (batch, length, model.d_model), jnp.float32)
        loss, grads = jax.value_and_grad(loss_fn)(p, x)
        updates, state = opt.update(grads, state, p)
        return (optax.apply_updates(p, updates), state), loss

    (params, _), losses = jax.lax.scan(
        step, (params, opt.init(params)), jax.random.split(key, steps)
    )
    return params, np.asarray(losses)


def stack_layers(key: jax.Array, depth: int, width: int) -> list[tuple[jax.Array, jax.Array]]:
    """`depth` step-size maps `(S_delta: [width, width], b_dt: [width])` of random Mamba mixers
    with `d_inner = width` (`expand=1`, default dt range)."""
    model = Mamba(d_model=width, d_state=1, expand=1)

    @jax.jit
    def one(k):
        return step_size_map(model, model.init(k, jnp.zeros((1, 2, width), jnp.float32)))

    return [one(k) for k in jax.random.split(key, depth)]


@functools.partial(jax.jit, static_argnames=("centered",))
def _layer(x, s_delta, b_dt, a, *, centered):
    """One stack layer on `x: [T, D]`: `(y: [T, D], max_t,d (A_t + dt_t), min_t,d A_t)`."""
    if centered:
        x = x - jnp.mean(x, axis=0)
    delta = x @ s_delta.T
    ones = jnp.ones((1, x.shape[0], 1), x.dtype)
    A = jnp.broadcast_to(-a, (x.shape[1], 1)).astype(x.dtype)
    y = selective_scan(x[None], delta[None], A, ones, ones, delta_bias=b_dt, delta_softplus=True)
    dt = jax.nn.softplus(delta + b_dt)
    transition = jnp.exp(-a * dt)
    return y[0], jnp.max(transition + dt), jnp.min(transition)


def ssm_stack(
    x: jax.Array, layers, a: float, *, centered: bool = True, rescale: bool = False
) -> dict:
    """Run `x: [T, D]` through the stack; returns the tokens entering every layer and leaving the
    last (`xs: [depth + 1, T, D]`, centered copies when `centered`) and, per layer, the largest
    `A_t + dt_t` and the smallest `A_t`. With `rescale`, every layer's input is also divided by
    its RMS over tokens and channels (one scalar, as a pre-norm would; scale-free measures are
    unchanged and the tokens do not shrink towards underflow with depth)."""

    def prepare(v):
        v = v - jnp.mean(v, axis=0) if centered else v
        return v / jnp.sqrt(jnp.mean(jnp.square(v))) if rescale else v

    xs, sums, mins = [prepare(x)], [], []
    for s_delta, b_dt in layers:
        y, top, low = _layer(xs[-1], s_delta, b_dt, jnp.asarray(a, x.dtype), centered=centered)
        xs.append(prepare(y))
        sums.append(float(top))
        mins.append(float(low))
    return dict(xs=np.asarray(jnp.stack(xs), np.float64), max_a_plus_dt=sums, min_a=mins)


@functools.partial(jax.jit, static_argnums=(0, 2))
def init_with_input(model: Mamba, key: jax.Array, length: int) -> tuple[dict, jax.Array]:
    """`(params, x: [length, d_model])`: `model`'s init and a standard-normal float32 input."""
    k_init, k_x = jax.random.split(key)
    x = jax.random.normal(k_x, (length, model.d_model), jnp.float32)
    return model.init(k_init, x[None]), x


def step_sizes(inputs: dict) -> jax.Array:
    """`dt = softplus(delta + delta_bias): [T, d_inner]` from one sequence's scan inputs."""
    return jax.nn.softplus(inputs["delta"][0].astype(jnp.float32) + inputs["delta_bias"])


def state_influence(model: Mamba, params: dict, x: jax.Array) -> jax.Array:
    """`I[d, n, s] = ||d h_T[d, n] / d x_s||`: the influence of token `s` of `x: [T, d_model]` on
    the final SSM state `h_T: [d_inner, N]`, through the whole mixer (projection, conv, scan)."""

    def final_state(x):
        inputs = model.apply(params, x[None], method="op_inputs")
        return selective_scan(**inputs, return_final_state=True)[1][0]

    return token_influence(final_state, x)


@functools.partial(jax.jit, static_argnums=0)
def influence_and_steps(model: Mamba, params: dict, x: jax.Array):
    """`(I: [d_inner, N, T], dt: [T, d_inner], A: [d_inner, N])` in one compiled call."""
    inputs = model.apply(params, x[None], method="op_inputs")
    return state_influence(model, params, x), step_sizes(inputs), inputs["A"]


def one_step_retention(inputs: dict) -> jax.Array:
    """`rho[t, d, n] = d h_t[d, n] / d h_{t-1}[d, n]` for one sequence's scan inputs, measured by
    forward-mode differentiation of `selective_scan` with respect to its initial state, one token
    at a time (each token becomes a batch entry of length 1)."""
    per_token = {
        k: (jnp.swapaxes(v, 0, 1) if k in ("u", "delta", "B", "C", "z") else v)
        for k, v in inputs.items()
    }
    length, (d_inner, n) = inputs["u"].shape[1], inputs["A"].shape
    h0 = jnp.zeros((length, d_inner, n), inputs["A"].dtype)

    def final(h):
        return selective_scan(**per_token, initial_state=h, return_final_state=True)[1]

    _, tangent = jax.jvp(final, (h0,), (jnp.ones_like(h0),))
    return tangent  # diagonal recurrence: the tangent of a ones-perturbation is the diagonal


@functools.partial(jax.jit, static_argnums=0)
def retention_and_steps(model: Mamba, params: dict, x: jax.Array):
    """`(rho: [T, d_inner, N], dt: [T, d_inner], A: [d_inner, N])` in one compiled call."""
    inputs = model.apply(params, x[None], method="op_inputs")
    return one_step_retention(inputs), step_sizes(inputs), inputs["A"]


def elapsed(dt: np.ndarray, start: np.ndarray) -> np.ndarray:
    """`tau[i, d] = sum_{t >= start[i]} dt[t, d]` for `dt: [T, d]`: the step size still to come."""
    tail = np.concatenate([np.cumsum(dt[::-1], axis=0)[::-1], np.zeros_like(dt[:1])])
    return tail[np.minimum(start, len(dt))]


def smoothing_curves(xs: np.ndarray) -> dict[str, np.ndarray]:
    """Per layer of `xs: [depth + 1, T, D]` (float64): the similarity measures of
    seqlab.analysis. Each layer is scaled to max |x| = 1 before the float32 computation and the
    scale is put back (the measures are homogeneous: degree 1, the energy degree 2, the relative
    energy 0), so that deep stacks, whose tokens shrink by orders of magnitude, do not underflow."""
    fns = dict(
        linf_diameter=(lambda x: jnp.max(similarity.channel_range(x)), 1),
        diameter=(similarity.diameter, 1),
        average_pairwise_distance=(similarity.average_pairwise_distance, 1),
        dirichlet_energy=(similarity.dirichlet_energy, 2),
        relative_dirichlet_energy=(similarity.relative_dirichlet_energy, 0),
    )
    scales = np.max(np.abs(xs), axis=(1, 2))
    return {
        k: np.array(
            [float(f(jnp.asarray(x / c))) * c**deg for x, c in zip(xs, scales, strict=True)]
        )
        for k, (f, deg) in fns.items()
    }
