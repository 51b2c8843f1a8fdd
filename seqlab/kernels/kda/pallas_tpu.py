"""Mosaic TPU kernels of the chunked Kimi Delta Attention (KDA) scan, forward and backward.

The structure of the gated delta kernels (`seqlab.kernels.gated_delta.pallas_tpu`): grid
`(B, H, N)`, batch and head parallel, the chunk axis sequential ("arbitrary"), carrying the
`[K, V]` float32 state (forward) or its cotangent (backward, chunks in reverse) in a VMEM scratch
buffer. Each step pipelines one chunk of q/k/v/gamma (and do) through VMEM via the block specs.
The per-chunk math is `chunk.chunk_step`; the backward recomputes a chunk from its saved start
state and pulls the cotangents through `chunk_step` inside the kernel (`jax.vjp` traced into the
kernel body: Mosaic code, not XLA autodiff of the forward). Matmul operands follow the inputs'
dtype (`chunk.chunk_step`, `operands`). Argument layout: README.md, "Kernel contract".
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seqlab.kernels.gated_delta import chunk as gdn_chunk
from seqlab.kernels.gated_delta.pallas_tpu import (
    INTERPRET_PARAMS,
    _block,
    _compiler_params,
    _interpret,
)
from seqlab.kernels.kda import chunk

__all__ = ["INTERPRET_PARAMS", "backward", "forward"]


def _token_inputs(beta, seg):
    """`beta: [B, H, N, C]`, `seg: [B, N, C]` -> beta as columns, seg as columns and rows (free
    reshapes)."""
    return beta[..., None], seg[..., None], seg[..., None, :]


def _specs(c: int, dk: int, dv: int, chunk_of):
    """Block specs for (q, k, v, gamma, beta_col, seg_col, seg_row).

    `chunk_of(n)` maps the grid step to the chunk it works on (reversed in the backward).
    """

    def head(*trailing):
        return lambda b, h, n: (b, h, chunk_of(n), *trailing)

    return [
        _block((None, None, c, dk), head(0)),
        _block((None, None, c, dk), head(0)),
        _block((None, None, c, dv), head(0)),
        _block((None, None, c, dk), head(0)),
        _block((None, None, None, c, 1), head(0, 0)),
        _block((None, None, c, 1), lambda b, h, n: (b, chunk_of(n), 0, 0)),
        _block((None, None, 1, c), lambda b, h, n: (b, chunk_of(n), 0, 0)),
    ]


def chunk_flops(c: int, dk: int, dv: int) -> int:
    """Matmul and score FLOPs of one chunk of the forward.

    Scores across sub-chunks: one `[C, K] x [K, C]` product per sub-chunk after the first, for
    `Q` and for `P` (`2 * 2 C^2 K` each); inside sub-chunks: 16 offsets of elementwise
    multiply-adds over `[C, K]`, for both (`2 * 2 * 16 C K`). Then `u` and `Q v_new` (`4 C^2 V`),
    `w` (`2 C^2 K`), `w S`, `q S`, `k^T v_new` (`6 C K V`), and the inverse's merges (two `C^3`
    products per doubling of the block size from 16).
    """
    subs = c // chunk.SUB_CHUNK
    merges = max(0, math.ceil(math.log2(c / gdn_chunk.INVERSE_BLOCK)))
    scores = 2 * (subs - 1) * 2 * c * c * dk + 2 * 2 * chunk.SUB_CHUNK * c * dk
    return scores + 2 * c * c * dk + 4 * c * c * dv + 6 * c * dk * dv + 4 * c**3 * merges


def _cost(
    grid: tuple[int, int, int], c: int, dk: int, dv: int, arrays, *, backward: bool
) -> pl.CostEstimate:
    """What the kernel costs, declared to XLA (which cannot see into a Mosaic call).

    FLOPs: `chunk_flops` per chunk; the backward recomputes the chunk and takes two products per
    product of it: three times the forward. `exp`: per chunk `(C / 16 - 1) 2 C K` across
    sub-chunks, `15 C K` inside them, `2 C K + K` for the decays to and from the state.
    `arrays`: every operand and result, for the HBM bytes.
    """
    passes = 3 if backward else 1
    programs = math.prod(grid)
    subs = c // chunk.SUB_CHUNK
    exps = (subs - 1) * 2 * c * dk + (chunk.SUB_CHUNK - 1) * c * dk + 2 * c * dk + dk
    return pl.CostEstimate(
        flops=passes * programs * chunk_flops(c, dk, dv),
        transcendentals=(2 if backward else 1) * programs * exps,
        bytes_accessed=sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays),
    )


def _load_chunk(q_ref, k_ref, v_ref, g_ref, bc_ref, sc_ref, sr_ref):
    f32 = jnp.float32
    return (
        q_ref[...].astype(f32),
        k_ref[...].astype(f32),
        v_ref[...].astype(f32),
        g_ref[...],
        bc_ref[...],
        sc_ref[...],
        sr_ref[...],
    )


def _forward_kernel(*refs, save_states: bool):
    inputs, (h0_ref,), rest = refs[:7], refs[7:8], refs[8:]
    if save_states:
        o_ref, hf_ref, states_ref, s_scratch = rest
    else:
        o_ref, hf_ref, s_scratch = rest
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        s_scratch[...] = h0_ref[...]

    state = s_scratch[...]
    if save_states:
        states_ref[...] = state
    q, k, v, g, bc, sc, sr = _load_chunk(*inputs)
    o, state = chunk.chunk_step(state, q, k, v, g, bc, sc, sr, operands=inputs[0].dtype)
    o_ref[...] = o.astype(o_ref.dtype)
    s_scratch[...] = state
    # Written at every step, not only the last, as in the gated delta kernel (jax 0.11's
    # interpret mode does not keep a resident block written only at the last step).
    hf_ref[...] = state


@functools.partial(jax.jit, static_argnames=("chunk_size", "save_states", "interpret"))
def forward(q, k, v, gamma, beta, seg, h0, *, chunk_size: int, save_states: bool, interpret: bool):
    """Chunked forward. `q, k, gamma: [B, H, T, K]`, `v: [B, H, T, V]`, `beta: [B, H, N, C]`,
    `seg: [B, N, C]`, `h0: [B, H, K, V]` -> `(o [B, H, T, V], h_final [B, H, K, V],
    states [B, H, N, K, V] or None)`."""
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    n_chunks = t // c
    state_spec = _block((None, None, dk, dv), lambda b_, h_, n: (b_, h_, 0, 0))
    out_shape = [
        jax.ShapeDtypeStruct((b, h, t, dv), v.dtype),
        jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32),
    ]
    out_specs = [_block((None, None, c, dv), lambda b_, h_, n: (b_, h_, n, 0)), state_spec]
    if save_states:
        out_shape.append(jax.ShapeDtypeStruct((b, h, n_chunks, dk, dv), jnp.float32))
        out_specs.append(_block((None, None, None, dk, dv), lambda b_, h_, n: (b_, h_, n, 0, 0)))
    operands = (q, k, v, gamma, *_token_inputs(beta, seg), h0)
    outs = pl.pallas_call(
        functools.partial(_forward_kernel, save_states=save_states),
        grid=(b, h, n_chunks),
        in_specs=[*_specs(c, dk, dv, lambda n: n), state_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)],
        compiler_params=_compiler_params(),
        interpret=_interpret(interpret),
        cost_estimate=_cost((b, h, n_chunks), c, dk, dv, (*operands, *out_shape), backward=False),
        name="kda_fwd",
    )(*operands)
    return outs[0], outs[1], outs[2] if save_states else None


def _backward_kernel(*refs):
    inputs, (state_ref, do_ref, dht_ref), outs = refs[:7], refs[7:10], refs[10:]
    dq_ref, dk_ref, dv_ref, dg_ref, dbc_ref, dh0_ref, ds_scratch = outs
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        ds_scratch[...] = dht_ref[...]

    q, k, v, g, bc, sc, sr = _load_chunk(*inputs)

    def step(state, q, k, v, g, bc):
        return chunk.chunk_step(state, q, k, v, g, bc, sc, sr, operands=inputs[0].dtype)

    _, pullback = jax.vjp(step, state_ref[...], q, k, v, g, bc)
    d_state, dq, dk, dv, dg, dbc = pullback((do_ref[...].astype(jnp.float32), ds_scratch[...]))
    dq_ref[...] = dq
    dk_ref[...] = dk
    dv_ref[...] = dv
    dg_ref[...] = dg
    dbc_ref[...] = dbc
    ds_scratch[...] = d_state
    dh0_ref[...] = d_state  # at every step, as hf_ref in the forward


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret"))
def backward(q, k, v, gamma, beta, seg, states, do, dh_final, *, chunk_size: int, interpret: bool):
    """Reverse chunk scan of the cotangents. Returns `(dq, dk [B, H, T, K], dv [B, H, T, V],
    dgamma [B, H, T, K], dbeta [B, H, N, C], dh0 [B, H, K, V])`, all float32."""
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    n_chunks = t // c

    def rev(n):
        return n_chunks - 1 - n

    state_spec = _block((None, None, dk, dv), lambda b_, h_, n: (b_, h_, 0, 0))
    f32 = jnp.float32
    out_shape = [
        jax.ShapeDtypeStruct(q.shape, f32),
        jax.ShapeDtypeStruct(k.shape, f32),
        jax.ShapeDtypeStruct(v.shape, f32),
        jax.ShapeDtypeStruct(gamma.shape, f32),
        jax.ShapeDtypeStruct((b, h, n_chunks, c, 1), f32),
        jax.ShapeDtypeStruct((b, h, dk, dv), f32),
    ]
    operands = (q, k, v, gamma, *_token_inputs(beta, seg), states, do, dh_final)
    dq, dk_, dv_, dgamma, dbc, dh0 = pl.pallas_call(
        _backward_kernel,
        grid=(b, h, n_chunks),
        in_specs=[
            *_specs(c, dk, dv, rev),
            _block((None, None, None, dk, dv), lambda b_, h_, n: (b_, h_, rev(n), 0, 0)),
            _block((None, None, c, dv), lambda b_, h_, n: (b_, h_, rev(n), 0)),
            state_spec,
        ],
        out_specs=[*_specs(c, dk, dv, rev)[:5], state_spec],
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((dk, dv), f32)],
        compiler_params=_compiler_params(),
        interpret=_interpret(interpret),
        cost_estimate=_cost((b, h, n_chunks), c, dk, dv, (*operands, *out_shape), backward=True),
        name="kda_bwd",
    )(*operands)
    return dq, dk_, dv_, dgamma, dbc[..., 0], dh0
