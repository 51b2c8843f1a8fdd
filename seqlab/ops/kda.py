r"""Kimi Delta Attention (KDA; Kimi Team, "Kimi Linear", arXiv 2510.26692): the gated delta rule
with a decay per key channel.

Per value head, a state `S: [K, V]`, with `g_t: [K]` log-decays (<= 0):

$$
S_t = \operatorname{Diag}(e^{g_t}) S_{t-1}, \qquad
S_t \leftarrow S_t + k_t \big(\beta_t (v_t - S_t^\top k_t)\big)^\top, \qquad
o_t = S_t^\top (\mathrm{scale}\; q_t)
$$

`"recurrent"` runs this token by token (the definition of correct); `"chunked"` is the WY form of
`seqlab.ops._delta` with per-channel decays, whose intra-chunk products go through sub-chunk
reference tokens so that it stays finite for cumulative log-gates down to any value;
`"pallas_tpu"` is the Mosaic TPU kernel of `seqlab.kernels.kda` (forward and backward).

`kda_gate` is Kimi Linear's gate law from a projection `x: [..., HV, K]`:
$g = -e^{A_{\log}} \operatorname{softplus}(x + b_{dt})$, or with a `lower_bound` $\ell$,
$g = \ell\, \sigma\big(e^{A_{\log}} (x + b_{dt})\big)$, bounded in `(lower_bound, 0)`
(flash-linear-attention's `safe_gate`, which Kimi's released configs use).
"""

import functools
import math

import jax
import jax.numpy as jnp

from seqlab.kernels.gated_delta import api as gdn_kernel_api
from seqlab.kernels.kda import api as kernel_api
from seqlab.ops import _chunk_vjp, _chunked, _delta
from seqlab.ops.checks import accumulation_dtype, check_floating, check_shape


def kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    segment_ids: jax.Array | None = None,
    impl: str | None = None,
    state_every: int | None = None,
):
    """Kimi Delta Attention over a sequence.

    Args:
      q, k: `[B, T, H, K]`, not normalized here (KDA L2-normalizes them before).
      v: `[B, T, HV, V]`, `HV` a multiple of `H` (q/k head `h` serves value heads
        `h * G .. h * G + G - 1`, `G = HV // H`).
      g: `[B, T, HV, K]`, the log-decay (<= 0) of each key channel.
      beta: `[B, T, HV]`, the write strength.
      scale: multiplies q; defaults to `K ** -0.5`.
      initial_state: `[B, HV, K, V]` (zeros by default); with `segment_ids` it applies to each
        row's first segment.
      output_final_state: also return the state after the last token.
      chunk_size: tokens per chunk (any positive int for `"chunked"`; a multiple of 16 for the
        kernel).
      segment_ids: `[B, T]` int, packed documents: the state restarts from zero at every change.
      impl: None (the TPU kernel on TPU, `"mixed"` on CPU, else `"chunked"`), `"recurrent"`,
        `"chunked"`, `"mixed"` (`"recurrent"`'s values, `"chunked"`'s derivative),
        `"pallas_tpu"` (the Mosaic TPU kernel: float32 or bfloat16 inputs), `"pallas"` (the TPU
        kernel; on CPU in interpret mode). There is no GPU kernel: `"pallas_gpu"`, and
        `"pallas"` on a GPU, raise `NotImplementedError`.
      state_every: N, a positive int, to also return the states every N tokens, as in
        `seqlab.ops.gated_delta_rule`: `"recurrent"` or `"chunked"` (N a multiple of
        `chunk_size`; also for `impl=None`); the Pallas names raise `NotImplementedError`.

    Returns:
      `(o: [B, T, HV, V] in v.dtype, final_state: [B, HV, K, V] float32 (float64 for float64
      inputs) or None)`; with `state_every = N`, `(o, final_state, states)`, `states:
      [B, T // N, HV, K, V]` (float32, float64 for float64 inputs) after tokens `N, 2N, ...`.
    """
    dk = _chunked.validate(
        q, k, v, g, beta=beta, initial_state=initial_state, segment_ids=segment_ids,
        chunk_size=chunk_size, channel_gates=True,
    )[3]  # fmt: skip
    interpret = impl == "pallas" and _chunked.target_platform() == "cpu"
    if state_every is None:
        impl = resolve_impl(impl, q.dtype, chunk_size)
    else:
        impl = _chunked.resolve_with_states(impl, state_every, chunk_size)
    scale = dk**-0.5 if scale is None else scale
    if impl == "pallas_tpu":
        o, final = _pallas_tpu(
            q, k, v, g, beta, initial_state, segment_ids, scale=scale, chunk_size=chunk_size,
            interpret=interpret,
        )  # fmt: skip
        return o, final if output_final_state else None
    form = functools.partial(
        _delta.chunked_form, _delta.beta_write, chunk_size, _chunked.scan_chunk_states,
        state_every=state_every,
    )  # fmt: skip
    form = _chunk_vjp.select(impl, _token_step, form, chunk_size, state_every)
    xs = (q, k, v, g, beta)
    return _chunked.run(form, xs, initial_state, segment_ids, output_final_state, scale=scale)


def resolve_impl(impl: str | None, dtype, chunk_size: int) -> str:
    """The implementation `kda(..., impl=impl)` runs for q/k/v of `dtype` and `chunk_size`.

    `None` is the TPU kernel on TPU where it takes the inputs, `"mixed"` on CPU, else `"chunked"`
    (`_chunked.check_impl`); a kernel name
    that cannot run them raises `NotImplementedError` with the reason, never falls back."""
    resolved = _chunked.check_impl(impl, kernels=True)
    if impl is None and resolved == "pallas_gpu":
        resolved = "chunked"
    if resolved == "pallas_gpu":
        raise NotImplementedError(
            f"impl={impl!r}: kda has no GPU kernel; use impl='chunked' or impl=None"
        )
    if resolved != "pallas_tpu":
        return resolved
    reason = gdn_kernel_api.unsupported("pallas_tpu", dtype, 0, 0, chunk_size)
    if reason is None:
        return resolved
    if impl is None:
        return "chunked"
    raise NotImplementedError(f"impl={impl!r}: {reason}; use impl='chunked' or impl=None")


def _pallas_tpu(q, k, v, g, beta, initial_state, segment_ids, *, scale, chunk_size, interpret):
    """Lay the inputs out as the kernel contract wants (`seqlab/kernels/kda/README.md`), run the
    kernels, and restore `[B, T, HV, V]`."""
    b, t, hv, dv = v.shape
    dk = q.shape[-1]
    c = chunk_size
    f32 = jnp.float32

    def heads_major(x):  # [B, T, HV, D] -> [B, HV, T_pad, D]
        x = _chunked.pad_and_chunk(x, c)
        return jnp.moveaxis(x.reshape(b, -1, hv, x.shape[-1]), 2, 1)

    q, k = (_chunked.expand_heads(x, hv // q.shape[2]) for x in (q, k))
    seg = _chunked.pad_and_chunk(_chunked.segment_index(segment_ids, b, t), c, edge=True)
    incoming = jnp.concatenate([jnp.zeros((b, 1), seg.dtype), seg[:, :-1, -1]], axis=1)
    # Chunk-local inclusive cumsum of the per-channel log-gates, [B, HV, T_pad, K].
    gamma = jnp.cumsum(_chunked.pad_and_chunk(g.astype(f32), c), axis=2)
    gamma = jnp.moveaxis(gamma.reshape(b, -1, hv, dk), 2, 1)
    o, final = kernel_api.chunked_scan(
        heads_major(q * jnp.asarray(scale, q.dtype)),
        heads_major(k.astype(q.dtype)),
        heads_major(v.astype(q.dtype)),
        gamma,
        jnp.moveaxis(_chunked.pad_and_chunk(beta.astype(f32), c), 3, 1),
        (seg - incoming[..., None]).astype(f32),
        jnp.zeros((b, hv, dk, dv), f32) if initial_state is None else initial_state.astype(f32),
        block_sizes=gdn_kernel_api.BlockSizes(c),
        interpret=interpret,
    )
    return jnp.moveaxis(o, 1, 2)[:, :t].astype(v.dtype), final


def kda_step(q_t, k_t, v_t, g_t, beta_t, state, *, scale: float | None = None):
    """One decoding step of `kda`.

    Args:
      q_t, k_t: `[B, H, K]`; v_t: `[B, HV, V]`; g_t: `[B, HV, K]`; beta_t: `[B, HV]`;
      state: `[B, HV, K, V]`; scale: defaults to `K ** -0.5`.

    Returns:
      `(o_t: [B, HV, V] in v_t.dtype, new_state: [B, HV, K, V])`, the state in float32 (float64
      for float64 inputs).
    """
    dk = _chunked.validate_step(q_t, k_t, v_t, g_t, state, beta_t=beta_t, channel_gates=True)[2]
    scale = dk**-0.5 if scale is None else scale
    return _chunked.decode_step(_token_step, q_t, k_t, v_t, (g_t, beta_t), state, scale=scale)


_token_step = functools.partial(_delta.token_step, _delta.beta_write)


def kda_gate(
    x: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array | None = None,
    *,
    lower_bound: float | None = None,
) -> jax.Array:
    """KDA's log-decays from a gate projection.

    Args:
      x: `[..., HV, K]` (e.g. `[B, T, HV, K]`, or `[B, HV, K]` for one token).
      A_log: `[HV]`, log of the decay rate of each head.
      dt_bias: `[HV, K]` or None.
      lower_bound: None for `g = -exp(A_log) * softplus(x + dt_bias)` (in `(-inf, 0)`), or a
        negative float for `g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias))` (in
        `(lower_bound, 0)`).

    Returns:
      `g: [..., HV, K]` in float32 (float64 for float64 inputs).
    """
    check_floating("x", x)
    if jnp.ndim(x) < 2:
        raise ValueError(f"x must have layout [..., HV, K], got shape {jnp.shape(x)}")
    hv, dk = jnp.shape(x)[-2:]
    check_floating("A_log", A_log)
    check_shape("A_log", A_log, (hv,), "[HV]")
    if dt_bias is not None:
        check_floating("dt_bias", dt_bias)
        check_shape("dt_bias", dt_bias, (hv, dk), "[HV, K]")
    if lower_bound is not None and not (
        isinstance(lower_bound, (int, float)) and math.isfinite(lower_bound) and lower_bound < 0
    ):
        raise ValueError(f"lower_bound must be a negative finite float or None, got {lower_bound}")
    acc = accumulation_dtype(x, A_log, dt_bias)
    x = x.astype(acc) if dt_bias is None else x.astype(acc) + dt_bias.astype(acc)
    rate = jnp.exp(A_log.astype(acc))[:, None]  # [HV, 1]
    if lower_bound is None:
        return -rate * jax.nn.softplus(x)
    return lower_bound * jax.nn.sigmoid(rate * x)
