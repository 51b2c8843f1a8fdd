r"""State space duality (Mamba-2; Dao and Gu, arXiv 2405.21060), in the multi-head layout.

Per value head, a state `S: [K, V]` decays and takes an outer-product write, then is read:

$$
S_t = e^{g_t} S_{t-1} + k_t v_t^\top, \qquad o_t = S_t^\top q_t
$$

In Mamba-2's names: `q = C`, `k = B` (`H = n_groups` heads), `v = x * dt`, `g = A * dt`.
`"recurrent"` runs this token by token. `"chunked"` is the SSD form: within a chunk with
chunk-local cumulative log-gate $\gamma$ and $\Gamma_{ij} = e^{\gamma_i - \gamma_j}$ ($i \ge j$),

$$
o = (q e^{\gamma}) S + ((q k^\top) \odot \Gamma)\, v
$$

and the state entering the next chunk, $S' = e^{\gamma_C} S + (k\, e^{\gamma_C - \gamma})^\top v$,
is the only sequential step (over T / C chunks): the gated delta rule's state pass with `v_new = v`
(`seqlab.ops._chunked.scan_chunk_states`).
"""

import functools

import jax
import jax.numpy as jnp

from seqlab.ops import _chunk_vjp, _chunked


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
    state_every: int | None = None,
):
    """Mamba-2's gated linear recurrence (SSD) over a sequence.

    Args:
      q, k: `[B, T, H, K]` (Mamba-2's C and B, `H = n_groups`).
      v: `[B, T, HV, V]` with `HV` a multiple of `H`: q/k head `h` serves value heads
        `h * G .. h * G + G - 1`, `G = HV // H` (as `jnp.repeat(q, G, axis=2)`).
      g: `[B, T, HV]`, the log-decay (<= 0).
      initial_state, output_final_state, chunk_size, segment_ids: as in
        `seqlab.ops.gated_delta_rule`: the state `[B, HV, K, V]` before each row's first token
        (zeros by default; with packed documents, before the first one), returned after the last
        token when asked; tokens per chunk of `"chunked"` (T need not be a multiple); `[B, T]`
        int ids of packed documents, the state restarting from zero at every change of id.
      impl: None (auto: `"mixed"` on CPU, else `"chunked"`), `"recurrent"` (token-by-token
        `lax.scan`), `"chunked"` (SSD form in XLA), `"mixed"` (`"recurrent"`'s values, `"chunked"`'s
        derivative: `seqlab.ops._chunk_vjp.select`). `"pallas_tpu"`, `"pallas_gpu"` and `"pallas"`
        raise `NotImplementedError`: the kernels are not implemented yet.
      state_every: N, a positive int, to also return the states every N tokens (a prefix cache
        to resume from); as in `seqlab.ops.gated_delta_rule` (`"chunked"` needs N a multiple of
        `chunk_size`).

    Returns:
      `(o, final_state)`: `o: [B, T, HV, V]` in `v.dtype`; `final_state: [B, HV, K, V]` in float32
      (float64 for float64 inputs) when `output_final_state`, else None. With `state_every = N`,
      `(o, final_state, states)`: `states: [B, T // N, HV, K, V]` (float32, float64 for float64
      inputs), the states after tokens `N, 2N, ..., (T // N) N`.
    """
    _chunked.validate(
        q, k, v, g, initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size
    )
    if state_every is None:
        impl = _chunked.check_impl(impl)
    else:
        impl = _chunked.resolve_with_states(impl, state_every, chunk_size)
    form = functools.partial(_chunked_form, chunk_size=chunk_size, state_every=state_every)
    form = _chunk_vjp.select(impl, _token_step, form, chunk_size, state_every)
    return _chunked.run(form, (q, k, v, g), initial_state, segment_ids, output_final_state)


def ssd_step(q_t, k_t, v_t, g_t, state):
    """One decoding step of `ssd`.

    Args:
      q_t, k_t: `[B, H, K]`; v_t: `[B, HV, V]`; g_t: `[B, HV]`; state: `[B, HV, K, V]`.

    Returns:
      `(o_t: [B, HV, V] in v_t.dtype, new_state: [B, HV, K, V])`, the state in float32 (float64
      for float64 inputs).
    """
    _chunked.validate_step(q_t, k_t, v_t, g_t, state)
    return _chunked.decode_step(_token_step, q_t, k_t, v_t, (g_t,), state)


def _token_step(state, xs):
    """`state: [B, HV, K, V]`; `q_t, k_t: [B, HV, K]`; `v_t: [B, HV, V]`; `g_t: [B, HV]`."""
    q_t, k_t, v_t, g_t = xs
    state = jnp.exp(g_t)[..., None, None] * state + k_t[..., :, None] * v_t[..., None, :]
    return state, _chunked.einsum("bhkv,bhk->bhv", state, q_t)


def _chunked_form(q, k, v, g, state, seg, chunk_size, state_every=None):
    """SSD chunked form (module docstring); inputs in the accumulation dtype. Returns `(o,
    final)`, and with `state_every = N` (a multiple of `chunk_size`) also the states after tokens
    `N, 2N, ...`, `[B, T // N, HV, K, V]`, read off the chunk boundaries."""
    t = q.shape[1]
    q, k, v, g = (_chunked.pad_and_chunk(x, chunk_size) for x in (q, k, v, g))
    decays = _chunked.chunk_decays(g, _chunked.pad_and_chunk(seg, chunk_size, edge=True))
    k_end = k * decays.token_to_end[..., None]
    final, states, _ = _chunked.scan_chunk_states(state, k_end, v, None, decays.state_to_end)
    o = _chunked.chunk_outputs(q, k, v, states, decays)
    if state_every is None:
        return _chunked.unchunk(o, t), final
    states = _chunked.every_state(states, final, state_every // chunk_size, t // state_every)
    return _chunked.unchunk(o, t), final, states
