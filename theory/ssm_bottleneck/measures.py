"""Measurements behind the recency and over-smoothing claims, on seqlab's Mamba and scan op.

- `init_with_input`, `step_sizes`, `state_influence`, `influence_and_steps`,
  `one_step_retention`, `retention_and_steps`, `elapsed`: the polarization claims' influence on
  the final state, one-step retention and elapsed step size of a Mamba mixer.
- `smoothing_curves`: the similarity measures of `seqlab.analysis.similarity` per layer.
- `recency_fit`, `recency_profile`: mean log-influence `log ||dy_t / dx_{t-r}||` against the
  distance `r` and its fitted slope, for influence matrices or a Mamba mixer.
- `train_delayed_copy`: a short Adam training of a Mamba mixer on `y_t = x_{t-k}`.
- `stack_layers`: step-size maps of random Mamba mixers for the over-smoothing stacks.
- `r_squared`, `with_a_max`, `recency_sweep`, `rate_exponent`: the decay rate of the influence
  against `A_max` (a mixer's `A` scaled so that its largest transition is `A_max`) and the
  linearity of the log-influence.
- `normalized_stack`, `sup_diameter`: the convex-combination SSM stack of Theorem 4.2,

      h_t = A_t h_{t-1} + (1 - A_t) x_t,   h_1 = x_1,   A_t = exp(-a dt_t)   (per channel)

  Every `h_t` is a convex combination of `x_1..x_t` with weight `prod_{r<=t} A_r >= A_min^(T-1)`
  on `x_1`, so two states differ by at most `(1 - A_min^(T-1))` times the input diameter.
- `mixer_blocks`, `block_stack`, `without_zero_channel`: stacks of real Mamba mixers, bare and
  with the residual path, and the ablation of the polarized 0-channel.
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
from seqlab.modules.block import Block
from seqlab.modules.lm import LanguageModel
from seqlab.modules.mamba import Mamba
from seqlab.ops.selective_scan import selective_scan

# Influences below this are float32 underflow, not measurements (the smallest normal is 1.2e-38).
UNDERFLOW = 1e-30


@functools.partial(jax.jit, static_argnums=0)
def _influences(model: Mamba, params, xs: jax.Array) -> jax.Array:
    """`[B, T, T]` influence matrices of the mixer on each sequence of `xs: [B, T, d_model]`, one
    sequence at a time (`lax.map`: each holds `T * d_model` backward passes in memory)."""
    return jax.lax.map(lambda x: module_influence(model, params, x), xs)


def recency_fit(infl: np.ndarray, min_distance: int, max_distance: int | None = None) -> dict:
    """Mean log-influence against distance for influence matrices `infl: [B, T, T]`.

    `profile[r] = mean_{b, t} log infl[b, t, t - r]` for `r = min_distance..max_distance`
    (default `T - 1`); `slope`, `slope_stderr` and `intercept` of a least-squares line through it
    (`rates.line_fit`). The profile stops before the first distance at which some influence is
    below float32's smallest normal number (the mixers run in float32: a fast decay underflows to 0
    and its log to -inf); at least 3 distances must remain.
    """
    length = infl.shape[-1]
    top = length - 1 if max_distance is None else max_distance
    if not 0 <= min_distance < top - 1 or top > length - 1:
        raise ValueError(
            f"distances must satisfy 0 <= min_distance < max_distance - 1 <= T - 2 = {length - 2}, "
            f"got min_distance={min_distance}, max_distance={max_distance}"
        )
    tiny = np.finfo(np.float32).tiny
    for r in range(min_distance, top + 1):
        if not np.min(np.diagonal(infl, offset=-r, axis1=1, axis2=2)) >= tiny:
            top = r - 1
            break
    if top - min_distance < 2:
        raise ValueError(
            f"influences underflow float32 from distance {top + 1}: fewer than 3 distances from "
            f"min_distance={min_distance} to fit"
        )
    distances = np.arange(min_distance, top + 1)
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
    energy and the normalized diameter 0), so that deep stacks, whose tokens shrink by orders of
    magnitude, do not underflow."""
    fns = dict(
        linf_diameter=(lambda x: jnp.max(similarity.channel_range(x)), 1),
        diameter=(similarity.diameter, 1),
        average_pairwise_distance=(similarity.average_pairwise_distance, 1),
        dirichlet_energy=(similarity.dirichlet_energy, 2),
        relative_dirichlet_energy=(similarity.relative_dirichlet_energy, 0),
        normalized_diameter=(similarity.normalized_diameter, 0),
    )
    scales = np.max(np.abs(xs), axis=(1, 2))
    return {
        k: np.array(
            [float(f(jnp.asarray(x / c))) * c**deg for x, c in zip(xs, scales, strict=True)]
        )
        for k, (f, deg) in fns.items()
    }


# -- recency against A_max, and its linearity ----------------------------------------------------


def r_squared(x, y) -> float:
    """The coefficient of determination of the least-squares line through `(x, y)`, both `[S]`:
    `1 - SS_res / SS_tot` (1 for points on a line, 0 when the line explains nothing)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    slope_, intercept = np.polyfit(x, y, 1)
    total = np.sum(np.square(y - y.mean()))
    residual = np.sum(np.square(y - intercept - slope_ * x))
    return float(1.0 - residual / total) if total > 0 else 0.0


def with_a_max(model: Mamba, params: dict, xs: jax.Array, a_max: float) -> dict:
    """`params` of an unpolarized `model` with every learnable `A` scaled by one factor, so that
    the largest transition `exp(dt A)` over `xs: [B, T, d_model]`, channels and states is `a_max`.

    The step sizes do not depend on `A`: with `m = -log(max A_bar) = min_{b,t,d,n} dt |A|`, the
    factor is `log(1 / a_max) / m`, added as `A_log + log(factor)`; the ratios between the state
    channels (S4D-real: `A_n = -(n + 1)` at init) are kept.
    """
    if not 0.0 < a_max < 1.0:
        raise ValueError(f"a_max must lie in (0, 1), got {a_max}")
    if tuple(model.polarize) != (0, 0):
        raise ValueError(
            f"model must be unpolarized (fixed channels cannot be scaled), got "
            f"polarize={model.polarize}"
        )
    _, top = transition_range(model.apply(params, xs, method="op_inputs"))
    m = -float(np.log(np.max(np.asarray(top, np.float64))))
    inner = dict(params["params"])
    inner["A_log"] = inner["A_log"] + np.log(np.log(1.0 / a_max) / m).astype(np.float32)
    return {**params, "params": inner}


def recency_sweep(
    model: Mamba, params: dict, xs: jax.Array, a_maxes, *, min_distance: int, max_distance: int
) -> dict[str, np.ndarray]:
    """For each target `a_max` (`with_a_max`), the mean log-influence profile of the mixer on
    `xs: [B, T, d_model]` and its line over distances `min_distance..max_distance`.

    Returns `[len(a_maxes)]` arrays `a_max` (measured), `rate` (`-slope`, the decay rate per token),
    `slope_stderr`, `r2`, and `profiles: [len(a_maxes), max_distance - min_distance + 1]` (NaN
    beyond the distances `recency_fit` kept).
    """
    rows = []
    for target in a_maxes:
        p = with_a_max(model, params, xs, target)
        infl = np.asarray(_influences(model, p, xs), np.float64)
        fit = recency_fit(infl, min_distance, max_distance)
        _, top = transition_range(model.apply(p, xs, method="op_inputs"))
        rows.append(
            dict(
                a_max=float(np.max(np.asarray(top, np.float64))),
                rate=-fit["slope"],
                slope_stderr=fit["slope_stderr"],
                r2=r_squared(fit["distances"], fit["profile"]),
                # NaN beyond the distances fitted (where an influence underflowed)
                profiles=np.pad(
                    fit["profile"],
                    (0, max_distance - fit["distances"][-1]),
                    constant_values=np.nan,
                ),
            )
        )
    return {k: np.array([r[k] for r in rows]) for k in rows[0]}


def rate_exponent(rate, a_max) -> dict[str, float]:
    """`p` in `rate ~ c log(1 / a_max)^p` (the slope of `log rate` against `log log(1 / a_max)`)
    and its standard error; `p = 1` is proportionality. `rate, a_max: [S]`, `S >= 3`."""
    x = np.log(np.log(1.0 / np.asarray(a_max, np.float64)))
    return rates.line_fit(x, np.log(np.asarray(rate, np.float64)))


# -- over-smoothing: the normalized SSM stack of Theorem 4.2, the real mixer ---------------------


@functools.partial(jax.jit, static_argnames=("normalized",))
def _normalized_layer(x, s_delta, b_dt, a_min, *, normalized):
    """One layer of `normalized_stack` on `x: [T, D]`: `(h: [T, D], min_t,d A_t)`."""
    dt = jax.nn.softplus(x @ s_delta.T + b_dt)  # [T, D]
    a = jnp.log(1.0 / a_min) / jnp.max(dt)  # the smallest transition exp(-a dt) is a_min
    transition = jnp.exp(-a * dt)

    def per_channel(v):  # [T, D] -> [D, T, 1]: one scan per channel
        return jnp.swapaxes(v, 0, 1)[..., None]

    b = (1.0 - transition) / dt if normalized else 1.0 / dt  # dt_t b_t: (1 - A_t) or 1
    ones = jnp.ones((x.shape[1], x.shape[0], 1), x.dtype)
    h = selective_scan(
        per_channel(x),
        per_channel(dt),
        -a.reshape(1, 1).astype(x.dtype),
        per_channel(b),
        ones,
        initial_state=x[0][:, None, None],
    )  # h_t = A_t h_{t-1} + dt_t b_t x_t, h_0 = x_1
    return jnp.swapaxes(h[..., 0], 0, 1), jnp.min(transition)


def normalized_stack(x: jax.Array, layers, a_min: float, *, normalized: bool = True) -> dict:
    """A stack of selective SSM layers in the form of Theorem 4.2 on `x: [T, D]`: per channel,

        h_t = A_t h_{t-1} + (1 - A_t) x_t,   h_1 = x_1,   A_t = exp(-a dt_t)

    (zero-order hold of `dh/dt = a (x - h)`: each `h_t` is a convex combination of `x_1..x_t`),
    with `dt` from the Mamba step-size maps of `layers` (`stack_layers`) and `a` chosen per layer so
    that its smallest transition is `a_min`. Each layer's input is centered and scaled to unit RMS
    (as a normalization would; the layer commutes with shifts and the measures are scale-free, so
    this only keeps float32 away from a collapsed, constant sequence). `normalized=False` drops
    the `(1 - A_t)` factor (`h_t = A_t h_{t-1} + x_t`), a stack outside the theorem.

    Returns the layers' inputs `inputs: [depth, T, D]` and outputs `outputs: [depth, T, D]`
    (float64) and `a_min: [depth]` (measured per layer).
    """
    if not 0.0 < a_min < 1.0:
        raise ValueError(f"a_min must lie in (0, 1), got {a_min}")
    inputs, outputs, mins, h = [], [], [], x
    for s_delta, b_dt in layers:
        h = h - jnp.mean(h, axis=0)
        h = h / jnp.sqrt(jnp.mean(jnp.square(h)))
        inputs.append(h)
        h, low = _normalized_layer(
            h, s_delta, b_dt, jnp.asarray(a_min, x.dtype), normalized=normalized
        )
        outputs.append(h)
        mins.append(float(low))
    return dict(
        inputs=np.asarray(jnp.stack(inputs), np.float64),
        outputs=np.asarray(jnp.stack(outputs), np.float64),
        a_min=np.array(mins),
    )


def sup_diameter(xs: np.ndarray) -> np.ndarray:
    """`max_{s,t} ||x_s - x_t||_inf` per layer of `xs: [K, T, D]`: the largest channel range."""
    return np.max(np.max(xs, axis=1) - np.min(xs, axis=1), axis=-1)


def mixer_blocks(key: jax.Array, depth: int, d_model: int, **mamba) -> tuple[Block, list[dict]]:
    """A Mamba `Block` (`x + mixer(RMSNorm(x))`, no MLP) and `depth` random initializations of
    it (`mamba`: keyword arguments of the `Mamba` mixer)."""
    block = Block(mixer=Mamba(d_model=d_model, **mamba))
    init = jax.jit(lambda k: block.init(k, jnp.zeros((1, 2, d_model), jnp.float32)))
    return block, [init(k) for k in jax.random.split(key, depth)]


def _bare(block: Block, x: jax.Array) -> jax.Array:
    return block.mixer(block.mixer_norm(x))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _block_layer(block: Block, params: dict, x: jax.Array, residual: bool) -> jax.Array:
    method = None if residual else _bare
    return block.apply(params, x[None], method=method)[0]


def block_stack(block: Block, params: list[dict], x: jax.Array, *, residual: bool) -> np.ndarray:
    """`xs: [depth + 1, T, d_model]` (float64): `x: [T, d_model]` and the output of every layer,
    `x + mixer(RMSNorm(x))` (`residual`) or the bare `mixer(RMSNorm(x))`."""
    xs = [x]
    for p in params:
        xs.append(_block_layer(block, p, xs[-1], residual))
    return np.asarray(jnp.stack(xs), np.float64)


def _streams(lm: LanguageModel, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    h = lm.embed(tokens[None])
    bare, residual = [h], [h]
    for block in lm.blocks:
        bare.append(block.mixer(block.mixer_norm(bare[-1])))
        residual.append(block(residual[-1]))
    return jnp.concatenate(bare), jnp.concatenate(residual)


def model_streams(lm: LanguageModel, params: dict, tokens: jax.Array) -> dict[str, np.ndarray]:
    """`{"bare", "residual"}: [depth + 1, T, d_model]` (float64) for `tokens: [T]` through a
    language model's blocks: the embeddings and the output of every layer, the model's blocks as
    they are (`residual`) or their mixers alone, `x <- mixer(RMSNorm(x))` (`bare`)."""
    bare, residual = jax.jit(lambda p, t: lm.apply({"params": p}, t, method=_streams))(
        params, tokens
    )
    return {"bare": np.asarray(bare, np.float64), "residual": np.asarray(residual, np.float64)}


def without_zero_channel(params: dict, model: Mamba) -> dict:
    """Block `params` of a `Mamba(polarize=(n_ones, 1))` mixer with the 0-channel ablated: its
    columns of `B` and `C` removed from `x_proj` (layout `[dt | B | C]`), so that the result is a
    `polarize=(n_ones, 0)` mixer with every other parameter the same."""
    if model.polarize[1] != 1 or model.sign_constraint is not None:
        raise ValueError(
            f"model must have polarize=(n, 1) and no sign constraint, got "
            f"polarize={model.polarize}, sign_constraint={model.sign_constraint}"
        )
    rank, n = model.effective_dt_rank, model.n_total
    mixer = dict(params["params"]["mixer"])
    keep = [i for i in range(rank + 2 * n) if i not in (rank + n - 1, rank + 2 * n - 1)]
    mixer["x_proj"] = mixer["x_proj"][:, np.array(keep)]
    return {**params, "params": {**params["params"], "mixer": mixer}}
