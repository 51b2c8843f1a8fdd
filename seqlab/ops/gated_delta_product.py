r"""Gated DeltaProduct (Siems et al., "DeltaProduct", arXiv 2502.10297): `n` delta-rule steps
(Householder products) per token after one scalar decay.

Per value head, a state `S: [K, V]`; per token t, with its n keys, values and write strengths
at rows `t * n + j` of `k, v, beta`:

$$
S \leftarrow e^{g_t} S, \qquad
S \leftarrow S + k_j \big(\beta_j (v_j - S^\top k_j)\big)^\top
  \ \text{ for } j = t n, \dots, t n + n - 1,
\qquad o_t = S^\top (\mathrm{scale}\; q_t)
$$

`"recurrent"` runs this token by token (the definition of correct). Every other impl is the gated
delta rule (`seqlab.ops.gated_delta_rule`, with its chunked form and its Pallas kernels) on the
expanded sequence of `T n` steps: step `t n + j` carries `k_j, v_j, beta_j`, the log-gate `g_t`
at `j = 0` and 0 after, and the query `q_t` at `j = n - 1` and 0 before (a zero query reads
nothing); the outputs are those of the steps `t n + n - 1`.
"""

import functools

import jax
import jax.numpy as jnp

from seqlab.ops import _chunked, _delta
from seqlab.ops.checks import check_choice, check_floating, check_positive_int, check_shape
from seqlab.ops.gated_delta import gated_delta_rule


def gated_delta_product(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    num_householder: int,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    segment_ids: jax.Array | None = None,
    impl: str | None = None,
    state_every: int | None = None,
):
    """Gated DeltaProduct over a sequence.

    Args:
      q: `[B, T, H, K]`; k: `[B, T * n, H, K]` (not normalized here); v: `[B, T * n, HV, V]`,
        `HV` a multiple of `H`; beta: `[B, T * n, HV]`: the n writes of token t are rows
        `t * n .. t * n + n - 1`. `n = num_householder`.
      g: `[B, T, HV]`, the log-decay (<= 0) of each token.
      num_householder: `n`, delta-rule steps per token.
      scale: multiplies q; defaults to `K ** -0.5`.
      initial_state: `[B, HV, K, V]` (zeros by default); with `segment_ids` it applies to each
        row's first segment.
      output_final_state: also return the state after the last token.
      chunk_size: steps of the expanded sequence (`T * n` long) per chunk.
      segment_ids: `[B, T]` int, packed documents: the state restarts at every change.
      impl: `"recurrent"` (token by token), or any impl of `gated_delta_rule` (None, `"chunked"`,
        `"mixed"`, `"pallas_tpu"`, `"pallas_gpu"`, `"pallas"`), run on the expanded sequence.
      state_every: N, a positive int, to also return the states every N tokens (N counts
        tokens, not writes), as in `seqlab.ops.gated_delta_rule`: `"recurrent"` or `"chunked"`
        (also for `impl=None`; `N * n` must be a multiple of `chunk_size`); the Pallas names
        raise `NotImplementedError`.

    Returns:
      `(o: [B, T, HV, V] in v.dtype, final_state: [B, HV, K, V] float32 (float64 for float64
      inputs) or None)`; with `state_every = N`, `(o, final_state, states)`, `states:
      [B, T // N, HV, K, V]` (float32, float64 for float64 inputs) after tokens `N, 2N, ...`
      (after all n writes of token `j N - 1`).
    """
    n = num_householder
    _validate(q, k, v, g, beta, n, initial_state, segment_ids, chunk_size)
    if state_every is None:
        check_choice("impl", impl, _chunked.IMPLS)
    else:
        _chunked.resolve_with_states(impl, state_every, chunk_size, steps_per_token=n)
    b, t, h, dk = q.shape
    scale = dk**-0.5 if scale is None else scale
    if impl == "recurrent":
        xs = (q, k, v, g, beta)
        form = functools.partial(_recurrent, n, state_every=state_every)
        return _chunked.run(form, xs, initial_state, segment_ids, output_final_state, scale=scale)
    first = (jnp.arange(t * n) % n == 0)[None, :, None]
    q_steps = jnp.zeros((b, t, n, h, dk), q.dtype).at[:, :, -1].set(q).reshape(b, t * n, h, dk)
    g_steps = jnp.where(first, jnp.repeat(g, n, axis=1), jnp.zeros((), g.dtype))
    o, final, *states = gated_delta_rule(
        q_steps, k, v, g_steps, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, chunk_size=chunk_size,
        segment_ids=_repeat(segment_ids, n), impl=impl,
        state_every=None if state_every is None else state_every * n,
    )  # fmt: skip
    return o[:, n - 1 :: n], final, *states


def gated_delta_product_step(q_t, k_t, v_t, g_t, beta_t, state, *, scale: float | None = None):
    """One decoding step of `gated_delta_product`: one token's decay, n writes and read.

    Args:
      q_t: `[B, H, K]`; k_t: `[B, n, H, K]`; v_t: `[B, n, HV, V]`; g_t: `[B, HV]`;
      beta_t: `[B, n, HV]`; state: `[B, HV, K, V]`; scale: defaults to `K ** -0.5`.

    Returns:
      `(o_t: [B, HV, V] in v_t.dtype, new_state: [B, HV, K, V])`, the state in float32 (float64
      for float64 inputs).
    """
    for name, x in (("k_t", k_t), ("v_t", v_t), ("beta_t", beta_t)):
        check_floating(name, x)
    check_shape("k_t", k_t, (None, None, None, None), "[B, n, H, K]")
    n = k_t.shape[1]
    check_shape("v_t", v_t, (k_t.shape[0], n, None, None), "[B, n, HV, V]")
    check_shape("beta_t", beta_t, (k_t.shape[0], n, v_t.shape[2]), "[B, n, HV]")
    # The shared checks on the first write, then the layout of every write.
    dk = _chunked.validate_step(q_t, k_t[:, 0], v_t[:, 0], g_t, state, beta_t=beta_t[:, 0])[2]
    scale = dk**-0.5 if scale is None else scale
    to_steps = [jnp.moveaxis(x, 1, 2) for x in (k_t, v_t)]  # [B, H | HV, n, ...]
    o_t, state = _chunked.decode_step(
        functools.partial(_token_step, n),
        q_t,
        to_steps[0],
        to_steps[1],
        (g_t, jnp.moveaxis(beta_t, 1, 2)),
        state,
        scale=scale,
    )
    return o_t, state


def _validate(q, k, v, g, beta, n, initial_state, segment_ids, chunk_size):
    """The layout of the n writes per token (`k, v, beta` have `T * n` rows), then the checks of
    every recurrence on one write per token."""
    check_positive_int("num_householder", n)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_floating(name, x)
    check_shape("q", q, (None, None, None, None), "[B, T, H, K]")
    b, t = q.shape[:2]
    check_shape("k", k, (b, t * n, None, None), "[B, T * n, H, K]")
    check_shape("v", v, (b, t * n, None, None), "[B, T * n, HV, V]")
    check_shape("beta", beta, (b, t * n, None), "[B, T * n, HV]")

    def one_write(x):  # the shape of x with one row per token
        return jax.ShapeDtypeStruct((b, t, *x.shape[2:]), x.dtype)

    _chunked.validate(
        q, one_write(k), one_write(v), g, beta=one_write(beta), initial_state=initial_state,
        segment_ids=segment_ids, chunk_size=chunk_size,
    )  # fmt: skip


def _repeat(segment_ids, n):
    return None if segment_ids is None else jnp.repeat(segment_ids, n, axis=1)


def _recurrent(n, q, k, v, g, beta, state, seg, state_every=None):
    """`_chunked.recurrent` over tokens, the n writes of a token as one step; arguments as
    `_chunked.run` passes them (k, v, beta with `T * n` rows), `state_every` as there."""
    b, t = q.shape[:2]

    def per_token(x):  # [B, T * n, HV, ...] -> [B, T, HV, n, ...]
        return jnp.moveaxis(x.reshape(b, t, n, *x.shape[2:]), 2, 3)

    k, v, beta = per_token(k), per_token(v), per_token(beta)
    step = functools.partial(_token_step, n)
    return _chunked.recurrent(step, q, k, v, g, beta, state, seg, state_every=state_every)


def _token_step(n, state, xs):
    """One token: `k_t: [B, HV, n, K]`, `v_t: [B, HV, n, V]`, `beta_t: [B, HV, n]`; the decay,
    then n writes of `_delta.token_step` without decay, then the read."""
    q_t, k_t, v_t, g_t, beta_t = xs
    state = _chunked.decay_state(jnp.exp(g_t), state)
    no_decay = jnp.zeros_like(g_t)
    for j in range(n):
        write = (q_t, k_t[:, :, j], v_t[:, :, j], no_decay, beta_t[:, :, j])
        state, o_t = _delta.token_step(_delta.beta_write, state, write)
    return state, o_t
