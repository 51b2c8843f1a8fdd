r"""Gated DeltaNet-2: the delta rule with a decay and an erase gate per key channel and a write
gate per value channel.

Per head, a state `S: [K, V]`, with `g_t: [K]` log-decays (<= 0), `b_t: [K]` the erase gate
and `w_t: [V]` the write gate:

$$
S_t = \operatorname{Diag}(e^{g_t}) S_{t-1}, \qquad
S_t \leftarrow S_t + k_t \big(w_t \odot v_t - S_t^\top (b_t \odot k_t)\big)^\top, \qquad
o_t = S_t^\top (\mathrm{scale}\; q_t)
$$

With `b_t = beta_t` and `w_t = beta_t` on every channel this is KDA (`seqlab.ops.kda`), and with
a scalar decay too the gated delta rule. `"recurrent"` runs it token by token (the definition of
correct); `"chunked"` is the WY form of `seqlab.ops._delta` with the erase key `b * k` and the
write gate `w`.
"""

import functools

import jax

from seqlab.ops import _chunk_vjp, _chunked, _delta
from seqlab.ops.checks import check_floating, check_shape


def gdn2(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    b: jax.Array,
    w: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    segment_ids: jax.Array | None = None,
    impl: str | None = None,
    state_every: int | None = None,
):
    """Gated DeltaNet-2 over a sequence.

    Args:
      q, k: `[B, T, H, K]`, not normalized here.
      v: `[B, T, H, V]` (one value head per q/k head).
      g: `[B, T, H, K]`, the log-decay (<= 0) of each key channel.
      b: `[B, T, H, K]`, the erase gate of each key channel.
      w: `[B, T, H, V]`, the write gate of each value channel.
      scale: multiplies q; defaults to `K ** -0.5`.
      initial_state: `[B, H, K, V]` (zeros by default); with `segment_ids` it applies to each
        row's first segment.
      output_final_state: also return the state after the last token.
      chunk_size: tokens per chunk of `"chunked"` (any positive int).
      segment_ids: `[B, T]` int, packed documents: the state restarts from zero at every change.
      impl: None (`"mixed"` on CPU, else `"chunked"`), `"chunked"` (WY form), `"recurrent"`
        (token by token), `"mixed"` (`"recurrent"`'s values, `"chunked"`'s derivative). There is
        no Pallas kernel: Pallas names raise `NotImplementedError`.
      state_every: N, a positive int, to also return the states every N tokens, as in
        `seqlab.ops.gated_delta_rule` (`"chunked"` needs N a multiple of `chunk_size`).

    Returns:
      `(o: [B, T, H, V] in v.dtype, final_state: [B, H, K, V] float32 (float64 for float64
      inputs) or None)`; with `state_every = N`, `(o, final_state, states)`, `states:
      [B, T // N, H, K, V]` (float32, float64 for float64 inputs) after tokens `N, 2N, ...`.
    """
    bt, t, h, dk, hv, dv = _chunked.validate(
        q, k, v, g, initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size,
        channel_gates=True,
    )  # fmt: skip
    _check_gates(b, w, (bt, t, h, dk), dv, hv, layout="[B, T, H, {}]", names=("b", "w", "v"))
    if state_every is None:
        impl = _chunked.check_impl(impl)
    else:
        impl = _chunked.resolve_with_states(impl, state_every, chunk_size)
    scale = dk**-0.5 if scale is None else scale
    form = functools.partial(
        _delta.chunked_form, _erase_write, chunk_size, _chunked.scan_chunk_states,
        state_every=state_every,
    )  # fmt: skip
    form = _chunk_vjp.select(impl, _token_step, form, chunk_size, state_every)
    xs = (q, k, v, g, b, w)
    return _chunked.run(form, xs, initial_state, segment_ids, output_final_state, scale=scale)


def gdn2_step(q_t, k_t, v_t, g_t, b_t, w_t, state, *, scale: float | None = None):
    """One decoding step of `gdn2`.

    Args:
      q_t, k_t: `[B, H, K]`; v_t: `[B, H, V]`; g_t, b_t: `[B, H, K]`; w_t: `[B, H, V]`;
      state: `[B, H, K, V]`; scale: defaults to `K ** -0.5`.

    Returns:
      `(o_t: [B, H, V] in v_t.dtype, new_state: [B, H, K, V])`, the state in float32 (float64
      for float64 inputs).
    """
    bt, h, dk, hv, dv = _chunked.validate_step(q_t, k_t, v_t, g_t, state, channel_gates=True)
    _check_gates(b_t, w_t, (bt, h, dk), dv, hv, layout="[B, H, {}]", names=("b_t", "w_t", "v_t"))
    scale = dk**-0.5 if scale is None else scale
    return _chunked.decode_step(_token_step, q_t, k_t, v_t, (g_t, b_t, w_t), state, scale=scale)


def _check_gates(b, w, key_shape, dv, hv, *, layout, names):
    """`b` of the key layout `key_shape` (`[..., H, K]`), `w` of the value layout `[..., H, V]`,
    and as many value heads as q/k heads."""
    b_name, w_name, v_name = names
    h = key_shape[-2]
    if hv != h:
        raise ValueError(
            f"{v_name} must have as many heads as q and k (H = {h}) in gdn2, got HV = {hv}"
        )
    value_shape = (*key_shape[:-1], dv)
    for name, x, shape, width in ((b_name, b, key_shape, "K"), (w_name, w, value_shape, "V")):
        check_floating(name, x)
        check_shape(name, x, shape, layout.format(width))


def _erase_write(k, b, w):
    """Gated DeltaNet-2's write rule: erase key `b * k`, write gate `w`."""
    return b * k, w


_token_step = functools.partial(_delta.token_step, _erase_write)
