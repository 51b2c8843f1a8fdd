"""Machinery shared by the gated linear recurrences `gated_delta_rule` and `ssd`.

Both ops run, per value head, a state `S: [K, V]` through

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,        o_t = S_t^T q_t,

with `u_t = v_t` for SSD and `u_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t)` for the gated delta
rule. This module holds what the two share: argument validation, the dispatch scaffolding (inputs
in the accumulation dtype, grouped heads, packed-segment indices, the output dtype), the
token-by-token scan of the references and of the decoding steps, and the pieces of the chunked
form (padding, masked chunk-local decays, the state-passing scan over chunks and the output
assembly). An op supplies its token step `(S_{t-1}, x_t) -> (S_t, o_t)` and its chunked form.

Prefix-cache states (`state_every=N`): the states after tokens `N, 2N, ..., (T // N) N`,
`[B, T // N, HV, K, V]`. The reference keeps every N-th state of a scan over blocks of N tokens
(`scan_blocks`); the chunked form picks them from the chunk-boundary states of its state pass
(`every_state`), so N must be a multiple of the chunk size (`resolve_with_states`).

Shapes: `q, k: [B, T, H, K]`, `v: [B, T, HV, V]`, `g: [B, T, HV]`, chunked tensors
`[B, N, C, ...]` with `N = ceil(T / C)` chunks of `C` tokens.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from seqlab.ops.checks import (
    accumulation_dtype,
    check_choice,
    check_floating,
    check_positive_int,
    check_shape,
)

IMPLS = (None, "recurrent", "chunked", "mixed", "pallas_tpu", "pallas_gpu", "pallas")
PALLAS_IMPLS = ("pallas_tpu", "pallas_gpu", "pallas")

# The XLA paths are the oracles (and the fallback on accelerators until the kernels land): keep
# float32 matmuls in full float32 on TPU too.
einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def validate(
    q, k, v, g, *, beta=None, initial_state=None, segment_ids=None, chunk_size=None,
    channel_gates=False,
):  # fmt: skip
    """Check the shared arguments; returns `(B, T, H, K, HV, V)`.

    `g` is `[B, T, HV]`, or `[B, T, HV, K]` with `channel_gates` (a log-decay per key channel).
    Raises `ValueError` naming the argument and its expected layout.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x is not None:
            check_floating(name, x)
    check_shape("q", q, (None, None, None, None), "[B, T, H, K]")
    b, t, h, dk = q.shape
    check_shape("k", k, (b, t, h, dk), "[B, T, H, K]")
    check_shape("v", v, (b, t, None, None), "[B, T, HV, V]")
    hv, dv = v.shape[2], v.shape[3]
    if hv % h:
        raise ValueError(
            f"v must have shape [B, T, HV, V] with HV a multiple of the H = {h} heads of q and k,"
            f" got {v.shape}"
        )
    if channel_gates:
        check_shape("g", g, (b, t, hv, dk), "[B, T, HV, K]")
    else:
        check_shape("g", g, (b, t, hv), "[B, T, HV]")
    if beta is not None:
        check_shape("beta", beta, (b, t, hv), "[B, T, HV]")
    if initial_state is not None:
        check_floating("initial_state", initial_state)
        check_shape("initial_state", initial_state, (b, hv, dk, dv), "[B, HV, K, V]")
    if segment_ids is not None:
        check_shape("segment_ids", segment_ids, (b, t), "[B, T]")
        if not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer):
            raise ValueError(
                f"segment_ids must be an integer array [B, T], got dtype"
                f" {jnp.result_type(segment_ids)}"
            )
    if chunk_size is not None:
        check_positive_int("chunk_size", chunk_size)
    return b, t, h, dk, hv, dv


def validate_step(q_t, k_t, v_t, g_t, state, *, beta_t=None, channel_gates=False):
    """Check the arguments of a decoding step; returns `(B, H, K, HV, V)`.

    `g_t` is `[B, HV]`, or `[B, HV, K]` with `channel_gates`."""
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t), ("g_t", g_t), ("beta_t", beta_t)):
        if x is not None:
            check_floating(name, x)
    check_shape("q_t", q_t, (None, None, None), "[B, H, K]")
    b, h, dk = q_t.shape
    check_shape("k_t", k_t, (b, h, dk), "[B, H, K]")
    check_shape("v_t", v_t, (b, None, None), "[B, HV, V]")
    hv, dv = v_t.shape[1], v_t.shape[2]
    if hv % h:
        raise ValueError(
            f"v_t must have shape [B, HV, V] with HV a multiple of the H = {h} heads of q_t and"
            f" k_t, got {v_t.shape}"
        )
    if channel_gates:
        check_shape("g_t", g_t, (b, hv, dk), "[B, HV, K]")
    else:
        check_shape("g_t", g_t, (b, hv), "[B, HV]")
    if beta_t is not None:
        check_shape("beta_t", beta_t, (b, hv), "[B, HV]")
    check_floating("state", state)
    check_shape("state", state, (b, hv, dk, dv), "[B, HV, K, V]")
    return b, h, dk, hv, dv


def resolve_with_states(impl, state_every, chunk_size: int, *, steps_per_token: int = 1) -> str:
    """Check `state_every` (N) and resolve `impl` for a call that returns the states every N
    tokens: `"recurrent"`, or `"chunked"` (also for `impl=None`).

    `"chunked"` reads the states off its chunk boundaries, so `N * steps_per_token` (the steps of
    N tokens; `steps_per_token` > 1 for Gated DeltaProduct's expanded sequence) must be a multiple
    of `chunk_size`. Raises `ValueError` naming `state_every` for a bad N, and
    `NotImplementedError` for the Pallas names (no kernel returns intermediate states).
    """
    check_positive_int("state_every", state_every)
    check_choice("impl", impl, IMPLS)
    if impl in (*PALLAS_IMPLS, "mixed"):
        raise NotImplementedError(
            f"impl={impl!r} with state_every: only 'chunked' and 'recurrent' return the states"
            " every N tokens (the Pallas kernels return only the final state); use one of them"
            " (or impl=None)"
        )
    impl = "chunked" if impl is None else impl
    steps = state_every * steps_per_token
    if impl == "chunked" and steps % chunk_size:
        per_token = f" ({steps_per_token} steps per token)" if steps_per_token > 1 else ""
        raise ValueError(
            f"state_every must make a multiple of chunk_size = {chunk_size} steps for"
            f" impl='chunked'{per_token}, got state_every={state_every}; change either, or use"
            " impl='recurrent'"
        )
    return impl


def check_impl(impl, *, kernels: bool = False) -> str:
    """Resolve `impl`.

    `None` is the target platform's Pallas kernel on TPU and Hopper GPUs when the op has `kernels`,
    `"mixed"` on CPU (where the recurrent forward is the faster forward and the chunked derivative
    the faster derivative, in every case `benchmarks/gated_delta_cpu.py` and `delta_family_cpu.py`
    measured), else `"chunked"`; `"pallas"` is the platform's kernel (`"pallas_tpu"` on CPU, which
    then runs in interpret mode). The target platform is that of the mesh set with `jax.set_mesh`
    (so a step traced for abstract TPU devices from a CPU process, as `seqlab.train.aot` does, gets
    the TPU kernel), else `jax.default_backend()`. Ops without kernels raise
    `NotImplementedError` for Pallas names.
    """
    check_choice("impl", impl, IMPLS)
    if impl in PALLAS_IMPLS and not kernels:
        raise NotImplementedError(
            f"impl={impl!r}: this op has no Pallas kernel yet; use impl='chunked' or 'recurrent'"
        )
    platform = target_platform()
    platform_kernel = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform)
    if impl == "pallas":
        return platform_kernel or "pallas_tpu"
    if impl is None:
        if kernels and _has_kernel_hardware(platform):
            return platform_kernel
        return "mixed" if platform == "cpu" else "chunked"
    return impl


def target_platform() -> str:
    """`"cpu"`, `"gpu"` or `"tpu"`: the platform of the mesh set with `jax.set_mesh`, else the
    default backend's (`"cuda"` and `"rocm"` read as `"gpu"`)."""
    device = jax.sharding.get_abstract_mesh().abstract_device  # None without a mesh
    platform = jax.default_backend() if device is None else device.platform
    return "gpu" if platform in ("cuda", "rocm") else platform


def _has_kernel_hardware(platform: str) -> bool:
    """TPUs run the TPU kernel; of GPUs only Hopper (sm_90, wgmma) runs the GPU kernel."""
    if platform == "gpu":
        return getattr(jax.devices()[0], "compute_capability", None) == "9.0"
    return platform == "tpu"


def run(form, xs, initial_state, segment_ids, output_final_state, *, scale=None):
    """Run one form of an op on its inputs in the accumulation dtype.

    Args:
      form: `form(q, k, v, *gates, state, seg) -> (o, final)`, the recurrent reference
        (`functools.partial(recurrent, token_step)`) or a chunked form; it gets q/k repeated to
        `HV` heads, q multiplied by `scale` (when given), every array in the accumulation dtype,
        `state: [B, HV, K, V]` and `seg = segment_index(segment_ids)`.
      xs: `(q, k, v, *gates)`: q, k `[B, T, H, K]`, v `[B, T, HV, V]` and the op's other
        per-token arrays `[B, T, HV, ...]` (e.g. `g, beta`).
      initial_state: `[B, HV, K, V]` or None (zeros); segment_ids: `[B, T]` or None.
      output_final_state: return the final state, else None in its place.

    Returns:
      `(o: [B, T, HV, V] in v.dtype, final: [B, HV, K, V] or None)`, followed by the form's
      states every N tokens `[B, T // N, HV, K, V]` when the form was built with `state_every`
      (it then returns `(o, final, states)`).
    """
    q, k, v, *gates = xs
    acc = accumulation_dtype(*xs)
    b, t, h, dk = q.shape
    hv, dv = v.shape[2:]
    q, k = (expand_heads(x, hv // h).astype(acc) for x in (q, k))
    q = q if scale is None else q * scale
    state = jnp.zeros((b, hv, dk, dv), acc) if initial_state is None else initial_state.astype(acc)
    rest = (x.astype(acc) for x in (v, *gates))
    o, final, *states = form(q, k, *rest, state, segment_index(segment_ids, b, t))
    return o.astype(v.dtype), final if output_final_state else None, *states


def decode_step(token_step, q_t, k_t, v_t, gates_t, state, *, scale=None):
    """One decoding step: `token_step(state, (q_t, k_t, v_t, *gates_t)) -> (state, o_t)` on the
    inputs in the accumulation dtype, q_t/k_t repeated to `HV` heads and q_t multiplied by
    `scale` (when given).

    `q_t, k_t: [B, H, K]`; `v_t: [B, HV, V]`; `gates_t`: `[B, HV, ...]` each; `state:
    [B, HV, K, V]`. Returns `(o_t: [B, HV, V] in v_t.dtype, state)`, the state in float32
    (float64 for float64 inputs).
    """
    acc = accumulation_dtype(q_t, k_t, v_t, *gates_t, state)
    groups = v_t.shape[1] // q_t.shape[1]
    q_t, k_t = (expand_heads(x, groups, axis=1).astype(acc) for x in (q_t, k_t))
    q_t = q_t if scale is None else q_t * scale
    xs = (q_t, k_t, *(x.astype(acc) for x in (v_t, *gates_t)))
    state, o_t = token_step(state.astype(acc), xs)
    return o_t.astype(v_t.dtype), state


def recurrent(token_step, *args, state_every=None):
    """The token-by-token reference: `lax.scan` of `token_step(state, x_t) -> (state, o_t)`.

    `args = (*xs, state, seg)` as `run` passes them: per-token arrays `[B, T, ...]`, the state
    `[B, HV, K, V]` entering t = 0 and the segment index `[B, T]`; the state restarts from zero
    at every change of segment. Returns `(o: [B, T, HV, V], final: [B, HV, K, V])`, and with
    `state_every = N` also the states after tokens `N, 2N, ...`: `[B, T // N, HV, K, V]`.
    """
    *xs, state, seg = args

    def step(s, xs_t):
        reset_t, *rest = xs_t
        s = jnp.where(reset_t[:, None, None, None], 0.0, s)
        return token_step(s, tuple(rest))

    xs = (resets(seg), *xs)
    if state_every is None:
        final, o = scan_tokens(step, state, xs)
        return o, final
    final, o, states = scan_blocks(step, state, xs, state_every)
    return o, final, states


def expand_heads(x: jax.Array, groups: int, axis: int = 2) -> jax.Array:
    """Repeat q/k heads so head `h` serves value heads `h * G .. h * G + G - 1`."""
    return x if groups == 1 else jnp.repeat(x, groups, axis=axis)


def segment_index(segment_ids: jax.Array | None, batch: int, length: int) -> jax.Array:
    """Monotone segment index `[B, T]` int32: 0 at t = 0, +1 at every change of id along t."""
    if segment_ids is None:
        return jnp.zeros((batch, length), jnp.int32)
    change = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), jnp.cumsum(change, axis=1)], axis=1)


def scan_tokens(step, state: jax.Array, xs):
    """`lax.scan` of `step(state, x_t) -> (state, o_t)` over axis 1 of every leaf of `xs`.

    Returns `(final_state, o)` with every leaf of `o` stacked back on axis 1.
    """
    xs_time_major = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), xs)
    state, o = jax.lax.scan(step, state, xs_time_major)
    return state, jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1), o)


def scan_blocks(step, state: jax.Array, xs, every: int):
    """`scan_tokens` that also keeps the state after tokens `every, 2 every, ...`: a scan over
    blocks of `every` tokens (each a `scan_tokens`), then over the `T mod every` tokens left;
    only the block-end states are stacked, not all T.

    Returns `(final_state, o, states)`, `states: [B, T // every, ...]` (the shape of `state`).
    """
    t = jax.tree.leaves(xs)[0].shape[1]
    count = t // every
    head = jax.tree.map(lambda x: x[:, : count * every], xs)
    blocks = jax.tree.map(lambda x: x.reshape(x.shape[0], count, every, *x.shape[2:]), head)

    def block(s, xs_block):
        s, o = scan_tokens(step, s, xs_block)
        return s, (o, s)

    state, (o_head, states) = scan_tokens(block, state, blocks)
    final, o_tail = scan_tokens(step, state, jax.tree.map(lambda x: x[:, count * every :], xs))
    o_head = o_head.reshape(o_head.shape[0], count * every, *o_head.shape[3:])
    return final, jnp.concatenate([o_head, o_tail], axis=1), states


def every_state(states: jax.Array, final: jax.Array, every: int, count: int) -> jax.Array:
    """The states after chunks `every, 2 every, ..., count every` from the state pass's
    `states: [B, N, ...]` entering each chunk and `final`, the state after the last chunk.

    With chunks of C tokens these are the states after tokens `every C, 2 every C, ...`; the
    state entering a chunk is the one after its previous token, before any segment restart.
    Returns `[B, count, ...]`.
    """
    after = jnp.concatenate([states[:, 1:], final[:, None]], axis=1)  # after chunk n
    return after[:, every - 1 :: every][:, :count]


def resets(seg: jax.Array) -> jax.Array:
    """`[B, T]` bool: the state restarts before token t (never at t = 0)."""
    return jnp.concatenate([jnp.zeros_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)


def pad_and_chunk(x: jax.Array, chunk_size: int, *, edge: bool = False) -> jax.Array:
    """`[B, T, ...] -> [B, N, C, ...]`, padding time to `N * C` with zeros (`edge`: last value).

    Zero padding makes a token inert in both recurrences: `g = 0` keeps the state, `k = 0` (and
    `beta = 0`) writes nothing, `q = 0` reads nothing. Segment indices pad with their last value so
    the padding continues the last segment and the final state survives it.
    """
    b, t = x.shape[:2]
    n = -(-t // chunk_size)
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n * chunk_size - t)
    x = jnp.pad(x, pad, mode="edge" if edge else "constant")
    return x.reshape(b, n, chunk_size, *x.shape[2:])


class ChunkDecays(NamedTuple):
    """Masked decays of one chunk layout; every entry is exp of a non-positive number or 0.

    intra: `[B, N, HV, C, C]`, `exp(gamma_i - gamma_j)` for `i >= j` in the same segment.
    state_to_token: `[B, N, C, HV]`, `exp(gamma_i)` for tokens in the segment of the incoming state.
    token_to_end: `[B, N, C, HV]`, `exp(gamma_C - gamma_j)` for tokens in the chunk's last segment.
    state_to_end: `[B, N, HV]`, `exp(gamma_C)` when the incoming state's segment spans the chunk.
    """

    intra: jax.Array
    state_to_token: jax.Array
    token_to_end: jax.Array
    state_to_end: jax.Array


def incoming_segment(seg: jax.Array) -> jax.Array:
    """`[B, N, 1]`: the segment of the state entering each chunk of `seg: [B, N, C]`, that of the
    token before the chunk (for the first chunk, the initial state belongs to the first
    segment). A chunk whose first token starts a new segment does not carry the state in."""
    return jnp.concatenate([seg[:, :1, :1], seg[:, :-1, -1:]], axis=1)


def chunk_decays(g: jax.Array, seg: jax.Array, incoming: jax.Array | None = None) -> ChunkDecays:
    """Decays of the chunked form from `g: [B, N, C, HV]` and the chunked `seg: [B, N, C]`;
    `incoming: [B, N, 1]` is `incoming_segment(seg)`, computed here when None (pass it when the
    chunks come one at a time).

    `gamma_i = sum_{j <= i, same segment} g_j` within each chunk: a cumulative sum that restarts
    at every segment start, as a masked matmul, so no gradient reaches another segment's gates
    (a plain cumsum would leak round-off there through `gamma_i - gamma_j`). Differences are masked
    before `exp`, so no masked entry ever evaluates `exp` of a positive number (which could
    overflow to `inf` and then give `0 * inf = nan`, also in the gradient).
    """
    c = g.shape[2]
    incoming = incoming_segment(seg) if incoming is None else incoming
    in_carry = seg == incoming  # [B, N, C]
    in_last = seg == seg[:, :, -1:]
    causal = jnp.tril(jnp.ones((c, c), bool))
    same = (seg[:, :, :, None] == seg[:, :, None, :]) & causal  # [B, N, C_i, C_j]
    gamma = einsum("bnij,bnjh->bnih", same.astype(g.dtype), g)  # [B, N, C, HV]

    gamma_h = jnp.moveaxis(gamma, 3, 2)  # [B, N, HV, C]
    diff = gamma_h[..., :, None] - gamma_h[..., None, :]
    mask = same[:, :, None]
    intra = jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)

    def masked_exp(m, x):
        return jnp.where(m, jnp.exp(jnp.where(m, x, 0.0)), 0.0)

    state_to_token = masked_exp(in_carry[..., None], gamma)
    token_to_end = masked_exp(in_last[..., None], gamma[:, :, -1:] - gamma)
    state_to_end = masked_exp(in_carry[:, :, -1:], gamma[:, :, -1])
    return ChunkDecays(intra, state_to_token, token_to_end, state_to_end)


def scan_chunk_states(state, k_end, u, w, state_to_end):
    """Pass the state across chunks; the only sequential part of the chunked form.

    Per chunk n with incoming `S_n: [B, HV, K, V]`: `v_new = u - w S_n` (`v_new = u` when `w` is
    None) and `S_{n+1} = state_to_end S_n + k_end^T v_new` (`Diag(state_to_end) S_n` for a decay
    per key channel).

    Args:
      state: `[B, HV, K, V]`, entering the first chunk.
      k_end: `[B, N, C, HV, K]`, keys decayed to the chunk end (`k * token_to_end`).
      u: `[B, N, C, HV, V]`; w: `[B, N, C, HV, K]` or None.
      state_to_end: `[B, N, HV]`, or `[B, N, HV, K]` per key channel.

    Returns:
      `(final_state, states [B, N, HV, K, V] entering each chunk, v_new [B, N, C, HV, V])`.
      Only per-chunk states are produced or saved for the backward pass: `O(N K V)`, not `O(T K V)`.

    The scan runs chunk-major, `[N, B, HV, C, ...]`, so that every product is a plain batched
    matmul; a caller holding heads-major chunks `[B, N, HV, C, ...]` passes them through
    `token_major` and back through `heads_major`, transposes that XLA cancels against these.
    """

    def step(s, xs):
        k_end_n, u_n, w_n, decay_n = xs
        v_new = u_n if w_n is None else u_n - einsum("bhck,bhkv->bhcv", w_n, s)
        s_next = decay_state(decay_n, s) + einsum("bhck,bhcv->bhkv", k_end_n, v_new)
        return s_next, (s, None if w_n is None else v_new)

    def chunk_major(x):  # [B, N, C, HV, D] -> [N, B, HV, C, D]
        return None if x is None else jnp.moveaxis(heads_major(x), 1, 0)

    xs = (*(chunk_major(x) for x in (k_end, u, w)), jnp.moveaxis(state_to_end, 1, 0))
    final, (states, v_new) = jax.lax.scan(step, state, xs)
    v_new = u if w is None else token_major(jnp.moveaxis(v_new, 0, 1))
    return final, jnp.moveaxis(states, 0, 1), v_new


def heads_major(x: jax.Array) -> jax.Array:
    """`[B, N, C, HV, ...] -> [B, N, HV, C, ...]`: chunks laid out per head, so that the products
    over a chunk's tokens are batched matmuls over `(B, N, HV)` (no transposes around each)."""
    return jnp.swapaxes(x, 2, 3)


def token_major(x: jax.Array) -> jax.Array:
    """`[B, N, HV, C, ...] -> [B, N, C, HV, ...]`, the inverse of `heads_major`."""
    return jnp.swapaxes(x, 2, 3)


def decay_state(decay: jax.Array, state: jax.Array) -> jax.Array:
    """`decay * S` for `state: [B, HV, K, V]` and a decay `[B, HV]` per head or `[B, HV, K]` per
    key channel (`Diag(decay) S`)."""
    return decay.reshape(decay.shape + (1,) * (state.ndim - decay.ndim)) * state


def chunk_outputs(q, k, v_new, states, decays: ChunkDecays):
    """`o = (q * state_to_token) S_n + ((q k^T) * intra) v_new`, all chunks at once.

    q, k: `[B, N, C, HV, K]`; v_new: `[B, N, C, HV, V]`; states: `[B, N, HV, K, V]`.
    Returns `[B, N, C, HV, V]`. Computed heads-major (`heads_major`).
    """
    q_in = heads_major(q * decays.state_to_token[..., None])
    q, k, v_new = (heads_major(x) for x in (q, k, v_new))
    scores = einsum("bnhik,bnhjk->bnhij", q, k) * decays.intra
    o = einsum("bnhck,bnhkv->bnhcv", q_in, states) + einsum("bnhij,bnhjv->bnhiv", scores, v_new)
    return token_major(o)


def unchunk(x: jax.Array, length: int) -> jax.Array:
    """`[B, N, C, ...] -> [B, T, ...]`, dropping the padding."""
    b, n, c = x.shape[:3]
    return x.reshape(b, n * c, *x.shape[3:])[:, :length]
