r"""Sequence (context) parallelism of the recurrent ops, the short convolution and attention.

The functions named like the ops of `seqlab.ops` run on one piece of the sequence inside
`jax.shard_map`: the mesh axis `axis_name` splits the time axis (axis 1) of every per-token
input into `P` equal pieces, shard `i = lax.axis_index(axis_name)` holding global tokens
`[i T_loc, (i + 1) T_loc)`. They return the local slice of the op's output on the global sequence;
`initial_state` (replicated) is the state before global token 0, and a requested final state is
the state after the global last token, replicated on every shard (a `psum` of shard 0's copy, so
it is typed replicated and may leave a `check_vma=True` shard_map with `out_specs=P()`).
`shard_time` wraps any of them for one global sequence (padding T to a multiple of `P`).

Linear recurrences (`gated_delta_rule`, `kda`, `gdn2`, `gated_delta_product`, `ssd`,
`selective_scan`). Every token maps the state affinely, so a shard's whole piece is one affine
map of the state entering it:

$$
S_{\mathrm{end},i} = A_i\, S_{\mathrm{in},i} + B_i
$$

with `A_i: [K, K]` per value head acting on the left of `S: [K, V]` for the delta family,
`A_i = a_i I` (a scalar per head) for SSD, and `A_i: [D, N]` acting elementwise on `h: [D, N]`
for the Mamba-1 selective scan. Per shard:

1. Local run from a zero state. Delta family and SSD: the op runs once with the value columns
   augmented by `K` zero columns (`v -> [v | 0]`, gdn2's write gate `w -> [w | 0]`) from the
   initial state `[0 | I_K]`. Every update acts on the state from the left (decay, erase) plus a
   write into each value column, so the columns evolve independently: the final state is
   `[B_i | A_i]` and the output `[o0_t | p_t]`, `o0_t` the output from a zero state and
   `p_t = M_t^T (scale q_t)` with `M_t` the transition from the shard start through token t.
   Selective scan: one call on the batch stacked twice, `u` from `h = 0` and `u = 0` from
   `h = 1`, gives `B_i` and `A_i` as the two final states.
2. Segments at the boundary: `r_i = 0` when shard i's first `segment_ids` entry differs from
   shard i-1's last (one `lax.ppermute` of `[B]` ids), else 1 (`r_0 = 1`), so that
   `S_in,i = r_i S_end,i-1`. A change inside a shard needs nothing: the op restarts its state
   there, the identity columns too, which zeroes `A_i` and the later `p_t`.
3. Combine: `lax.all_gather` of `(r_i A_i, B_i)` along the axis, then every shard runs the
   P-step prefix `S_end,-1 = S_0` (`initial_state`), `S_end,j = r_j A_j S_end,j-1 + B_j`, and
   takes `S_in,i = r_i S_end,i-1`; the final state is `S_end,P-1`. The gather is one collective
   round (an associative scan over shards would take log2 P rounds to move the same bytes); the
   prefix is `P` state-sized products per shard, small next to the local run.
4. Correct the outputs. Delta family and SSD: `o_t = o0_t + S_in,i^T p_t`, the op's output for
   zero inputs from `S_in,i` obtained by linearity from the identity columns of step 1: no
   second run after the collective, at the cost of `K` more value columns in the first.
   Selective scan: re-run the op from `S_in,i`: its output correction
   `sum_n (prod_s exp(dt_s A))[d, n] S_in[d, n] C_t[n]` needs the per-token cumulative decay of
   every `(d, n)`, which the op's output (summed over n) does not expose, so a correction costs
   a full scan either way, and the re-run gives `y` (with `D`, `z`) in one rounding.

Bytes each shard receives, for itemsize `s` (it sends its own piece, `1 / (P - 1)` of that):
`(P - 1) B HV K (K + V) s` (delta family), `(P - 1) B HV (1 + K V) s` (SSD),
`(P - 1) 2 B D N s` (selective scan); `4 B` more with `segment_ids`; a requested final state
adds an all-reduce of one state.

Short convolution: a halo exchange, each shard receiving the last `W - 1` inputs of the previous
shard (`lax.ppermute`; shard 0 uses `initial_state`); a shard must hold at least `W - 1` tokens.
Attention: positions are global (shard offset plus local index). Global causal attention
gathers k and v along time (`lax.all_gather`, tiled); a sliding window `w` with
`w - 1 <= T_loc` needs only the previous shard's last `w - 1` keys and values (`lax.ppermute`).

The Pallas TPU kernels (what `impl=None` runs on a TPU) take their pieces only inside a
`shard_map` with `check_vma=False`: their backward traces a `jax.vjp` inside the kernel, mixing
values typed varying over the axis with untyped kernel-local ones, which the checked mode rejects
(`shard_time` and the trainer's sequence-parallel step use `check_vma=False`).

Backward passes are JAX autodiff through the collectives (the transpose of `ppermute` is the
opposite `ppermute`, of `all_gather` a `psum_scatter`).
"""

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from seqlab import ops
from seqlab.ops.checks import accumulation_dtype

# ------------------------------------------------------------------------------ shard helpers


def _shard(axis_name) -> tuple[jax.Array, int]:
    """`(i, P)`: this shard's index along `axis_name` and the number of shards; `ValueError`
    when `axis_name` is not an axis of the enclosing `shard_map`."""
    if not isinstance(axis_name, str):
        raise ValueError(f"axis_name must be a str naming a mesh axis, got {axis_name!r}")
    try:
        size = lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(
            f"axis_name {axis_name!r} is not an axis of the enclosing jax.shard_map"
        ) from e
    return lax.axis_index(axis_name), size


def _varying(x, axis_name):
    """`x` typed as varying over `axis_name`: a state built here from constants enters the op's
    `lax.scan` beside per-shard inputs, and a scan carry must keep its type."""
    if axis_name in getattr(jax.typeof(x), "vma", ()):
        return x
    return lax.pcast(x, axis_name, to="varying")


def _from_previous(x, axis_name, size):
    """Shard i receives `x` of shard i - 1 (shard 0 receives zeros)."""
    return lax.ppermute(x, axis_name, [(j, j + 1) for j in range(size - 1)])


def _replicated(x, index, axis_name, source=0):
    """`x` of shard `source` on every shard, typed replicated (a psum of its copy and zeros)."""
    return lax.psum(jnp.where(index == source, x, jnp.zeros_like(x)), axis_name)


def _check_op(op, *args, **kwargs) -> None:
    """Run the op's own argument checks on the shapes alone (abstract evaluation)."""

    def abstract(x):
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) if _is_array(x) else x

    args, kwargs = jax.tree.map(abstract, (args, kwargs))
    arrays = {n: x for n, x in kwargs.items() if isinstance(x, jax.ShapeDtypeStruct)}
    static = {n: x for n, x in kwargs.items() if n not in arrays}
    jax.eval_shape(lambda a, kw: op(*a, **kw, **static), args, arrays)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _carry_in(segment_ids, index, axis_name, size, batch):
    """`r_i: [B]` bool, whether the state leaving shard i - 1 enters shard i (module docstring,
    step 2): always on shard 0; else unless the segment id changes at the boundary."""
    if segment_ids is None:
        return jnp.ones((batch,), bool)
    previous_last = _from_previous(segment_ids[:, -1], axis_name, size)
    return (index == 0) | (segment_ids[:, 0] == previous_last)


def _combine(transition, offset, carry, initial, apply, index, axis_name):
    """Step 3 of the module docstring: `(S_in,i, S_end,P-1)` from this shard's
    `(r_i A_i, B_i)`, gathered over the axis.

    `apply(A, S)` applies a transition to a state; `carry: [B]` is `r_i`; `initial` is `S_0`.
    """
    transitions, offsets = lax.all_gather((transition, offset), axis_name)
    ends = [initial]  # S_end,-1 .. S_end,P-1
    for a, b in zip(transitions, offsets, strict=True):
        ends.append(apply(a, ends[-1]) + b)
    previous = jnp.stack(ends[:-1])[index]
    return _rows(carry, previous) * previous, ends[-1]


def _rows(r, like):
    """`r: [B]` as a float array broadcasting against `like: [B, ...]`."""
    return r.astype(like.dtype).reshape(r.shape + (1,) * (like.ndim - 1))


# ------------------------------------------------------------ delta family and SSD (step 1-4)


def _columns_recurrence(
    op,
    args,
    value_args,
    *,
    axis_name,
    initial_state,
    output_final_state,
    segment_ids,
    scalar_transition,
    **op_kwargs,
):
    """The delta family and SSD on one shard (module docstring, steps 1-4).

    `args`: the op's positional arrays, q first and v third (`v: [B, T, HV, V]`, the state
    `[B, HV, K, V]`); `value_args`: the indices of the arrays with `V` last-axis channels, which
    get `K` zero columns. `scalar_transition`: `A_i = a_i I` (SSD), gathered as `a_i: [B, HV]`.
    """
    index, size = _shard(axis_name)
    q, v = args[0], args[2]
    b, hv, dv, dk = v.shape[0], v.shape[2], v.shape[3], q.shape[-1]
    acc = accumulation_dtype(*args, initial_state)

    def widen(x):  # [..., V] -> [..., V + K], the K new columns zero, in the accumulation dtype
        return jnp.concatenate([x.astype(acc), jnp.zeros((*x.shape[:-1], dk), acc)], axis=-1)

    args = tuple(widen(x) if j in value_args else x for j, x in enumerate(args))
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=acc), (b, hv, dk, dk))
    start = jnp.concatenate([jnp.zeros((b, hv, dk, dv), acc), eye], axis=-1)  # [0 | I]
    start = _varying(start, axis_name)
    out, end = op(
        *args, initial_state=start, output_final_state=True, segment_ids=segment_ids, **op_kwargs
    )
    o0, p = out[..., :dv], out[..., dv:]  # [B, T, HV, V], [B, T, HV, K]
    offset, transition = end[..., :dv], end[..., dv:]  # B_i [B, HV, K, V], A_i [B, HV, K, K]
    if scalar_transition:
        transition = transition[..., 0, 0]  # a_i I -> a_i: [B, HV]

        def apply(a, s):
            return a[..., None, None] * s
    else:

        def apply(a, s):
            return _chunk_einsum("bhkj,bhjv->bhkv", a, s)

    carry = _carry_in(segment_ids, index, axis_name, size, b)
    s0 = jnp.zeros_like(offset) if initial_state is None else initial_state.astype(acc)
    s_in, final = _combine(
        _rows(carry, transition) * transition, offset, carry, s0, apply, index, axis_name
    )
    o = o0 + _chunk_einsum("bthk,bhkv->bthv", p, s_in)
    final = _replicated(final, index, axis_name) if output_final_state else None
    return o.astype(v.dtype), final


_chunk_einsum = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST)


def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    axis_name: str,
    scale=None,
    initial_state=None,
    output_final_state=False,
    chunk_size=64,
    segment_ids=None,
    impl=None,
):
    """`seqlab.ops.gated_delta_rule` on this shard's piece of the sequence (module docstring).

    Arguments as the op's, local along time (`q, k: [B, T_loc, H, K]`, `v: [B, T_loc, HV, V]`,
    `g, beta: [B, T_loc, HV]`, `segment_ids: [B, T_loc]`); `initial_state: [B, HV, K, V]`
    replicated. Returns `(o: [B, T_loc, HV, V], final_state: [B, HV, K, V] replicated or None)`.
    The local run has `V + K` value columns (a Pallas impl must take that width).
    """
    kw = dict(scale=scale, chunk_size=chunk_size, impl=impl)
    _check_op(ops.gated_delta_rule, q, k, v, g, beta, initial_state=initial_state,
              segment_ids=segment_ids, **kw)  # fmt: skip
    return _columns_recurrence(
        ops.gated_delta_rule, (q, k, v, g, beta), (2,), axis_name=axis_name,
        initial_state=initial_state, output_final_state=output_final_state,
        segment_ids=segment_ids, scalar_transition=False, **kw,
    )  # fmt: skip


def kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    axis_name: str,
    scale=None,
    initial_state=None,
    output_final_state=False,
    chunk_size=64,
    segment_ids=None,
    impl=None,
):
    """`seqlab.ops.kda` on this shard's piece of the sequence; as `gated_delta_rule` here, with
    `g: [B, T_loc, HV, K]`."""
    kw = dict(scale=scale, chunk_size=chunk_size, impl=impl)
    _check_op(ops.kda, q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
              **kw)  # fmt: skip
    return _columns_recurrence(
        ops.kda, (q, k, v, g, beta), (2,), axis_name=axis_name, initial_state=initial_state,
        output_final_state=output_final_state, segment_ids=segment_ids,
        scalar_transition=False, **kw,
    )  # fmt: skip


def gdn2(
    q,
    k,
    v,
    g,
    b,
    w,
    *,
    axis_name: str,
    scale=None,
    initial_state=None,
    output_final_state=False,
    chunk_size=64,
    segment_ids=None,
    impl=None,
):
    """`seqlab.ops.gdn2` on this shard's piece of the sequence; as `gated_delta_rule` here, with
    `g, b: [B, T_loc, H, K]` and `w: [B, T_loc, H, V]` (widened with `v`)."""
    kw = dict(scale=scale, chunk_size=chunk_size, impl=impl)
    _check_op(ops.gdn2, q, k, v, g, b, w, initial_state=initial_state, segment_ids=segment_ids,
              **kw)  # fmt: skip
    return _columns_recurrence(
        ops.gdn2, (q, k, v, g, b, w), (2, 5), axis_name=axis_name,
        initial_state=initial_state, output_final_state=output_final_state,
        segment_ids=segment_ids, scalar_transition=False, **kw,
    )  # fmt: skip


def gated_delta_product(
    q,
    k,
    v,
    g,
    beta,
    *,
    axis_name: str,
    num_householder: int,
    scale=None,
    initial_state=None,
    output_final_state=False,
    chunk_size=64,
    segment_ids=None,
    impl=None,
):
    """`seqlab.ops.gated_delta_product` on this shard's piece of the sequence; as
    `gated_delta_rule` here, with `k: [B, T_loc n, H, K]`, `v: [B, T_loc n, HV, V]`,
    `beta: [B, T_loc n, HV]` (the n writes of each local token)."""
    kw = dict(num_householder=num_householder, scale=scale, chunk_size=chunk_size, impl=impl)
    _check_op(ops.gated_delta_product, q, k, v, g, beta, initial_state=initial_state,
              segment_ids=segment_ids, **kw)  # fmt: skip
    return _columns_recurrence(
        ops.gated_delta_product, (q, k, v, g, beta), (2,), axis_name=axis_name,
        initial_state=initial_state, output_final_state=output_final_state,
        segment_ids=segment_ids, scalar_transition=False, **kw,
    )  # fmt: skip


def ssd(
    q,
    k,
    v,
    g,
    *,
    axis_name: str,
    initial_state=None,
    output_final_state=False,
    chunk_size=64,
    segment_ids=None,
    impl=None,
):
    """`seqlab.ops.ssd` on this shard's piece of the sequence; as `gated_delta_rule` here, the
    transition a scalar per head (`a_i I`), gathered as one number per head."""
    kw = dict(chunk_size=chunk_size, impl=impl)
    _check_op(ops.ssd, q, k, v, g, initial_state=initial_state, segment_ids=segment_ids, **kw)
    return _columns_recurrence(
        ops.ssd, (q, k, v, g), (2,), axis_name=axis_name, initial_state=initial_state,
        output_final_state=output_final_state, segment_ids=segment_ids, scalar_transition=True,
        **kw,
    )  # fmt: skip


def selective_scan(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    *,
    axis_name: str,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    return_final_state=False,
    impl=None,
):
    """`seqlab.ops.selective_scan` on this shard's piece of the sequence (module docstring).

    `u, delta, z: [batch, L_loc, D]` and `B, C: [batch, L_loc, N]` local along time; `A: [D, N]`,
    `D, delta_bias: [D]` and `initial_state: [batch, D, N]` replicated. Returns
    `y: [batch, L_loc, D]`, and `(y, h_L: [batch, D, N] replicated)` with `return_final_state`.
    Costs three local scans: two (stacked on the batch) for `(A_i, B_i)`, one from `S_in,i`.
    """
    kw = dict(delta_bias=delta_bias, delta_softplus=delta_softplus, impl=impl)
    _check_op(ops.selective_scan, u, delta, A, B, C, D, z, initial_state=initial_state, **kw)
    index, _ = _shard(axis_name)
    batch = u.shape[0]
    acc = accumulation_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    zero, one = jnp.zeros((batch, *A.shape), acc), jnp.ones((batch, *A.shape), acc)

    def twice(x, second):  # stack on the batch axis: [x; second]
        return jnp.concatenate([x, second], axis=0)

    _, ends = ops.selective_scan(
        twice(u, jnp.zeros_like(u)), twice(delta, delta), A, twice(B, B), twice(C, C),
        initial_state=_varying(twice(zero, one), axis_name), return_final_state=True, **kw,
    )  # fmt: skip
    offset, transition = ends[:batch], ends[batch:]  # B_i, A_i: [batch, D, N]
    carry = jnp.ones((batch,), bool)
    s0 = zero if initial_state is None else initial_state.astype(acc)
    s_in, final = _combine(transition, offset, carry, s0, jnp.multiply, index, axis_name)
    y = ops.selective_scan(u, delta, A, B, C, D, z, initial_state=s_in, **kw)
    if return_final_state:
        return y, _replicated(final, index, axis_name)
    return y


# ------------------------------------------------------------------- halo exchange: conv, attention


def causal_conv1d(
    x, weight, bias=None, *, axis_name: str, initial_state=None, return_final_state=False
):
    """`seqlab.ops.causal_conv1d` on this shard's piece `x: [B, T_loc, D]` (module docstring):
    shard i > 0 takes the last `W - 1` inputs of shard i - 1 as its initial state, shard 0
    `initial_state: [B, W - 1, D]` (replicated; zeros by default). Needs `T_loc >= W - 1`.

    Returns `y: [B, T_loc, D]`, and `(y, final_state: [B, W - 1, D] replicated)` with
    `return_final_state` (the last `W - 1` global inputs).
    """
    _check_op(ops.causal_conv1d, x, weight, bias, initial_state=initial_state)
    index, size = _shard(axis_name)
    halo = weight.shape[0] - 1
    if halo > x.shape[1]:
        raise ValueError(
            f"x must hold at least W - 1 = {halo} tokens per shard for causal_conv1d, got"
            f" {x.shape[1]} ([B, T_loc, D] = {x.shape})"
        )
    if initial_state is None:
        initial_state = jnp.zeros((x.shape[0], halo, x.shape[2]), x.dtype)
    tail = x[:, x.shape[1] - halo :]  # [B, W - 1, D]
    previous = _from_previous(tail, axis_name, size)
    y = ops.causal_conv1d(
        x,
        weight,
        bias,
        initial_state=jnp.where(index == 0, initial_state.astype(x.dtype), previous),
    )
    if return_final_state:
        return y, _replicated(tail, index, axis_name, source=size - 1)
    return y


def attention(q, k, v, *, axis_name: str, window=None, scale=None):
    """`seqlab.ops.attention` (causal self-attention, optionally a sliding window) on this shard's
    piece `q: [B, T_loc, H, D]`, `k: [B, T_loc, HKV, D]`, `v: [B, T_loc, HKV, DV]`, positions
    global (`i T_loc + local index`). Returns `[B, T_loc, H, DV]`.

    Global: k and v gathered along time. Window `w` with `w - 1 <= T_loc`: the previous shard's
    last `w - 1` keys and values only (on shard 0 they carry a position past every query, so no
    query sees them); a longer window gathers as the global case.
    """
    t_loc = q.shape[1]
    positions = jnp.arange(t_loc)
    _check_op(ops.attention, q, k, v, q_positions=positions, k_positions=positions,
              window=window, scale=scale)  # fmt: skip
    if k.shape[1] != t_loc:
        raise ValueError(f"k must have the T_loc = {t_loc} tokens of q, got shape {k.shape}")
    index, size = _shard(axis_name)
    q_positions = index * t_loc + positions
    if window is not None and window - 1 <= t_loc:
        halo = window - 1
        k_halo, v_halo = (_from_previous(x[:, t_loc - halo :], axis_name, size) for x in (k, v))
        halo_positions = jnp.where(
            index == 0, size * t_loc, index * t_loc - halo + jnp.arange(halo)
        )
        keys, values = (jnp.concatenate(pair, axis=1) for pair in ((k_halo, k), (v_halo, v)))
        k_positions = jnp.concatenate([halo_positions, q_positions])
    else:
        keys, values = (lax.all_gather(x, axis_name, axis=1, tiled=True) for x in (k, v))
        k_positions = jnp.arange(size * t_loc)
    return ops.attention(
        q, keys, values, q_positions=q_positions, k_positions=k_positions, window=window,
        scale=scale,
    )  # fmt: skip


# ------------------------------------------------------------------- one global sequence


class _Layout(NamedTuple):
    """How `shard_time` runs one op: `per_shard` (this module), `op` (its `seqlab.ops` twin, run
    abstractly for the checks on the global shapes), `time` the arguments split along axis 1
    (the others replicated), `static` the keyword arguments `shard_time` fixes."""

    per_shard: Callable
    op: Callable
    time: tuple[str, ...]
    static: tuple[str, ...]


_DELTA_STATIC = ("scale", "output_final_state", "chunk_size", "impl")
_DELTA_TIME = ("q", "k", "v", "g", "beta", "segment_ids")
LAYOUTS = {
    "gated_delta_rule": _Layout(gated_delta_rule, ops.gated_delta_rule, _DELTA_TIME, _DELTA_STATIC),
    "kda": _Layout(kda, ops.kda, _DELTA_TIME, _DELTA_STATIC),
    "gdn2": _Layout(gdn2, ops.gdn2, ("q", "k", "v", "g", "b", "w", "segment_ids"), _DELTA_STATIC),
    "gated_delta_product": _Layout(
        gated_delta_product,
        ops.gated_delta_product,
        _DELTA_TIME,
        ("num_householder", *_DELTA_STATIC),
    ),
    "ssd": _Layout(
        ssd,
        ops.ssd,
        ("q", "k", "v", "g", "segment_ids"),
        ("output_final_state", "chunk_size", "impl"),
    ),
    "selective_scan": _Layout(
        selective_scan,
        ops.selective_scan,
        ("u", "delta", "B", "C", "z"),
        ("delta_softplus", "return_final_state", "impl"),
    ),
    "causal_conv1d": _Layout(causal_conv1d, ops.causal_conv1d, ("x",), ("return_final_state",)),
    "attention": _Layout(attention, ops.attention, ("q", "k", "v"), ("window", "scale")),
}
"""Op name -> how `shard_time` splits its arguments: the per-piece op, the global op, the arguments
with a time axis and the static ones."""
# Ops whose result is always `(out, final_state or None)`; the others return a tuple only with
# `return_final_state`.
_PAIRS = ("gated_delta_rule", "kda", "gdn2", "gated_delta_product", "ssd")


def shard_time(op_name: str, mesh: jax.sharding.Mesh, axis_name: str = "seq", **static_kwargs):
    """The op `op_name` of `seqlab.ops` on one global sequence, its time axis split over the mesh
    axis `axis_name` (the per-shard functions of this module under `jax.shard_map`).

    Returns `fn(*arrays, **array_kwargs)` taking the op's array arguments (global shapes, as
    `seqlab.ops.<op_name>` takes them; attention: `q, k, v` only, positions `0..T-1`) and
    returning what the op returns. T need not be divisible by the number of shards `P`: time is
    padded to a multiple of `P` with tokens that leave the state unchanged (zeros: `g = 0` and
    `k = 0`, `beta = 0`; selective scan: `dt = 0`, i.e. `delta = -delta_bias`, or `-inf` under
    softplus; segment ids repeat the last one) at the end, and for `causal_conv1d` with zeros
    before `initial_state` (whose own `W - 1` inputs then shift into the first shard); the
    outputs are sliced back to the T tokens.

    Args:
      op_name: one of `LAYOUTS`: `gated_delta_rule`, `kda`, `gdn2`, `gated_delta_product`,
        `ssd`, `selective_scan`, `causal_conv1d`, `attention`.
      mesh: a `jax.sharding.Mesh` with the axis `axis_name`; the other axes replicate.
      axis_name: the mesh axis that splits time.
      **static_kwargs: the op's non-array keyword arguments (`LAYOUTS[op_name].static`, e.g.
        `output_final_state`, `chunk_size`, `impl`, `num_householder`, `window`).

    Raises:
      ValueError: an unknown `op_name`, an `axis_name` not in `mesh`, or a static keyword the op
        does not take; when called, the op's own checks on the global shapes, before any work.
    """
    if op_name not in LAYOUTS:
        raise ValueError(f"op_name must be one of {sorted(LAYOUTS)}, got {op_name!r}")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name must be an axis of mesh {mesh.axis_names}, got {axis_name!r}")
    layout = LAYOUTS[op_name]
    unknown = sorted(set(static_kwargs) - set(layout.static))
    if unknown:
        raise ValueError(
            f"static_kwargs of shard_time({op_name!r}) must be among {layout.static}, got {unknown}"
        )
    size = mesh.shape[axis_name]
    signature = inspect.signature(layout.per_shard)
    time_spec = P(None, axis_name)
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

    def sharded(*args, **kwargs):
        bound = signature.bind(*args, **kwargs, **static_kwargs, axis_name=axis_name).arguments
        arrays = {n: x for n, x in bound.items() if _is_array(x)}
        static = {n: x for n, x in bound.items() if n not in arrays}
        length = arrays[layout.time[0]].shape[1]
        check = dict(arrays, **{n: x for n, x in static.items() if n != "axis_name"})
        if op_name == "attention":
            check.update(q_positions=jnp.arange(length), k_positions=jnp.arange(length))
        _check_op(layout.op, **check)

        pad = -length % size
        if pad:
            arrays = _pad(op_name, arrays, length, pad, static)
        names = tuple(arrays)
        specs = tuple(time_spec if n in layout.time else P() for n in names)
        if op_name in _PAIRS or static.get("return_final_state", False):
            out_specs = (time_spec, P())
        else:
            out_specs = time_spec
        values = tuple(jnp.asarray(x) for x in arrays.values())
        if explicit:  # explicit axes: shard_map takes the arguments' own shardings
            values = tuple(
                jax.reshard(x, NamedSharding(mesh, s)) for x, s in zip(values, specs, strict=True)
            )

        def local(*xs):
            return layout.per_shard(**dict(zip(names, xs, strict=True)), **static)

        # Unchecked: the TPU kernels' backward (impl None on a TPU) mixes values typed varying
        # over the axis with untyped kernel-local ones, which a checked shard_map rejects.
        out = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)(
            *values
        )
        if not pad:
            return out
        first = slice(pad, None) if op_name == "causal_conv1d" else slice(0, length)
        time_out = out[0] if isinstance(out, tuple) else out
        if explicit:  # explicit axes cannot slice a split axis to a length P does not divide
            time_out = jax.reshard(time_out, NamedSharding(mesh, P()))
        time_out = time_out[:, first]
        return (time_out, *out[1:]) if isinstance(out, tuple) else time_out

    return sharded


def _pad(op_name, arrays, length, pad, static):
    """The time arguments padded by `pad` tokens that leave the state unchanged (`shard_time`)."""
    arrays = dict(arrays)
    if op_name == "causal_conv1d":  # zeros, then initial_state, then x; the first W - 1 the state
        x = arrays["x"]
        halo = arrays["weight"].shape[0] - 1
        state = arrays.get("initial_state", jnp.zeros((x.shape[0], halo, x.shape[2]), x.dtype))
        ext = jnp.concatenate([jnp.zeros((x.shape[0], pad, x.shape[2]), x.dtype), state, x], 1)
        arrays.update(initial_state=ext[:, :halo], x=ext[:, halo:])
        return arrays
    time = LAYOUTS[op_name].time
    for name in time:
        if name not in arrays:
            continue
        x = arrays[name]
        rows = pad * (x.shape[1] // length)  # gated_delta_product: n rows per token
        widths = [(0, 0), (0, rows)] + [(0, 0)] * (x.ndim - 2)
        if name == "segment_ids":
            arrays[name] = jnp.pad(x, widths, mode="edge")
        elif op_name == "selective_scan" and name == "delta":
            arrays[name] = jnp.concatenate([x, _zero_step(x, rows, static, arrays)], axis=1)
        else:
            arrays[name] = jnp.pad(x, widths)
    return arrays


def _zero_step(delta, rows, static, arrays):
    """`[batch, rows, D]` of `delta` giving `dt = 0`: `-inf` under softplus, else
    `-delta_bias` (its gradient cancels that of the bias in `dt`) or 0."""
    shape = (delta.shape[0], rows, delta.shape[2])
    if static.get("delta_softplus", False):
        return jnp.full(shape, -jnp.inf, delta.dtype)
    bias = arrays.get("delta_bias")
    return jnp.zeros(shape, delta.dtype) if bias is None else jnp.broadcast_to(-bias, shape)
