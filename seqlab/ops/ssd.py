"""State space duality (Mamba-2; Dao and Gu, arXiv 2405.21060), in the multi-head layout.

Per value head, a state `S: [K, V]` decays and takes an outer-product write, then is read:

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,        o_t = S_t^T q_t

In Mamba-2's names: `q = C`, `k = B` (`H = n_groups` heads), `v = x * dt`, `g = A * dt`.
`"recurrent"` runs this token by token. `"chunked"` is the SSD form: within a chunk with
chunk-local cumulative log-gate `gamma` and `Gamma_ij = exp(gamma_i - gamma_j)` (i >= j),

    o = (q exp(gamma)) S + ((q k^T) * Gamma) v
    S' = exp(gamma_C) S + (k exp(gamma_C - gamma))^T v

so that only the state passing `S -> S'` is sequential (over T / C chunks).
"""

import jax
import jax.numpy as jnp

from seqlab.ops import _chunked


def ssd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    segment_ids: jax.Array | None = None,
    impl: str | None = None,
):
    """Mamba-2's gated linear recurrence (SSD) over a sequence.

    Args:
      q, k: `[B, T, H, K]` (Mamba-2's C and B, `H = n_groups`).
      v: `[B, T, HV, V]` with `HV` a multiple of `H`: q/k head `h` serves value heads
        `h * G .. h * G + G - 1`, `G = HV // H` (as `jnp.repeat(q, G, axis=2)`).
      g: `[B, T, HV]`, the log-decay (<= 0).
      initial_state: `[B, HV, K, V]`, the state before the first token of each row (zeros by
        default); with `segment_ids` it applies to each row's first segment.
      output_final_state: also return the state after the last token.
      chunk_size: tokens per chunk of `"chunked"`; T need not be a multiple.
      segment_ids: `[B, T]` int, packed documents: the state restarts from zero at every change of
        id along t; the final state is that of each row's last segment.
      impl: None (auto: `"chunked"` on every platform for now), `"recurrent"` (token-by-token
        `lax.scan`), `"chunked"` (SSD form in XLA). `"pallas_tpu"`, `"pallas_gpu"` and `"pallas"`
        raise `NotImplementedError`: the kernels are not implemented yet.

    Returns:
      `(o, final_state)`: `o: [B, T, HV, V]` in `v.dtype`; `final_state: [B, HV, K, V]` in float32
      (float64 for float64 inputs) when `output_final_state`, else None.
    """
    b, t, h, dk, hv, dv = _chunked.validate(
        q, k, v, g, initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size
    )
    impl = _chunked.check_impl(impl)
    acc = _chunked.accumulation_dtype(q, k, v, g)
    out_dtype = v.dtype
    groups = hv // h
    q, k = (_chunked.expand_heads(x, groups).astype(acc) for x in (q, k))
    v, g = v.astype(acc), g.astype(acc)
    state = jnp.zeros((b, hv, dk, dv), acc) if initial_state is None else initial_state.astype(acc)
    seg = _chunked.segment_index(segment_ids, b, t)
    if impl == "recurrent":
        o, final = _recurrent(q, k, v, g, state, seg)
    else:
        o, final = _chunked_form(q, k, v, g, state, seg, chunk_size)
    return o.astype(out_dtype), final if output_final_state else None


def ssd_step(q_t, k_t, v_t, g_t, state):
    """One decoding step of `ssd`.

    Args:
      q_t, k_t: `[B, H, K]`; v_t: `[B, HV, V]`; g_t: `[B, HV]`; state: `[B, HV, K, V]`.

    Returns:
      `(o_t: [B, HV, V] in v_t.dtype, new_state: [B, HV, K, V])`, the state in float32 (float64
      for float64 inputs).
    """
    _, h, _, hv, _ = _chunked.validate_step(q_t, k_t, v_t, g_t, state)
    acc = _chunked.accumulation_dtype(q_t, k_t, v_t, g_t, state)
    groups = hv // h
    q_t, k_t = (_chunked.expand_heads(x, groups, axis=1).astype(acc) for x in (q_t, k_t))
    state, o_t = _token_step(state.astype(acc), (q_t, k_t, v_t.astype(acc), g_t.astype(acc)))
    return o_t.astype(v_t.dtype), state


def _token_step(state, xs):
    """`state: [B, HV, K, V]`; `q_t, k_t: [B, HV, K]`; `v_t: [B, HV, V]`; `g_t: [B, HV]`."""
    q_t, k_t, v_t, g_t = xs
    state = jnp.exp(g_t)[..., None, None] * state + k_t[..., :, None] * v_t[..., None, :]
    return state, _chunked.einsum("bhkv,bhk->bhv", state, q_t)


def _recurrent(q, k, v, g, state, seg):
    """Token-by-token reference; inputs in the accumulation dtype."""

    def step(s, xs):
        reset_t, *rest = xs
        s = jnp.where(reset_t[:, None, None, None], 0.0, s)
        return _token_step(s, tuple(rest))

    final, o = _chunked.scan_tokens(step, state, (_chunked.resets(seg), q, k, v, g))
    return o, final


def _chunked_form(q, k, v, g, state, seg, chunk_size):
    """SSD chunked form (module docstring); inputs in the accumulation dtype."""
    t = q.shape[1]
    q, k, v, g = (_chunked.pad_and_chunk(x, chunk_size) for x in (q, k, v, g))
    decays = _chunked.chunk_decays(g, _chunked.pad_and_chunk(seg, chunk_size, edge=True))
    k_end = k * decays.token_to_end[..., None]
    final, states, _ = _chunked.scan_chunk_states(state, k_end, v, None, decays.state_to_end)
    o = _chunked.chunk_outputs(q, k, v, states, decays)
    return _chunked.unchunk(o, t), final
