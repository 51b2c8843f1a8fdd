"""Mosaic TPU kernels of the chunked gated delta rule, forward and backward.

Grid `(B, H, N)`: batch and head are parallel, the chunk axis is sequential ("arbitrary") and
carries the `[K, V]` float32 state (forward) or its cotangent (backward, chunks in reverse) in a
VMEM scratch buffer. Each step pipelines one chunk of q/k/v (and do) through VMEM via the block
specs. The per-chunk math is `chunk.chunk_step`; the backward recomputes a chunk from its saved
start state and pulls the cotangents through `chunk_step` inside the kernel (the VJP of a chunk
is traced into the kernel body, so it runs as Mosaic code, not as XLA autodiff of the forward).
The matmuls take the inputs' dtype as operands: float32 inputs at full precision, bf16 inputs in
bf16 (one MXU pass each, float32 accumulation; the inverse and the state stay float32; see
`chunk.chunk_step`). Argument layout: see README.md, "Kernel contract".
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seqlab.kernels.gated_delta import chunk

# Interpret mode as the issue asks: race detection, uninitialized memory filled with NaN.
INTERPRET_PARAMS = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def _interpret(interpret: bool):
    return INTERPRET_PARAMS if interpret else False


def _compiler_params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _block(shape: tuple, index_map) -> pl.BlockSpec:
    """`pl.BlockSpec(shape, index_map)` with the literal indices of `index_map` as int32: a
    Python 0 is an int64 under `jax_enable_x64`, which Mosaic TPU rejects."""

    def int32_map(*grid):
        return tuple(np.int32(i) if isinstance(i, int) else i for i in index_map(*grid))

    return pl.BlockSpec(shape, int32_map)


def _token_inputs(gamma, beta, seg):
    """`gamma, beta: [B, H, N, C]`, `seg: [B, N, C]` -> column and row views (free reshapes)."""
    return (
        gamma[..., None],
        gamma[..., None, :],
        beta[..., None],
        seg[..., None],
        seg[..., None, :],
    )


def _specs(c: int, dk: int, dv: int, chunk_of):
    """Block specs for (q, k, v, gamma_col, gamma_row, beta_col, seg_col, seg_row).

    `chunk_of(n)` maps the grid step to the chunk it works on (reversed in the backward).
    """

    def head(*trailing):
        return lambda b, h, n: (b, h, chunk_of(n), *trailing)

    return [
        _block((None, None, c, dk), head(0)),
        _block((None, None, c, dk), head(0)),
        _block((None, None, c, dv), head(0)),
        _block((None, None, None, c, 1), head(0, 0)),
        _block((None, None, None, 1, c), head(0, 0)),
        _block((None, None, None, c, 1), head(0, 0)),
        _block((None, None, c, 1), lambda b, h, n: (b, chunk_of(n), 0, 0)),
        _block((None, None, 1, c), lambda b, h, n: (b, chunk_of(n), 0, 0)),
    ]


def _cost(
    grid: tuple[int, int, int], c: int, dk: int, dv: int, arrays, *, backward: bool
) -> pl.CostEstimate:
    """What the kernel costs, declared to XLA (which cannot see into a Mosaic call: without it the
    compiled cost analysis counts the kernel as free and the scheduler cannot overlap around it).

    Matmul FLOPs of one chunk of the forward: `k k^T`, `q k^T`, `w` (6 C^2 K), `u` and the
    intra-chunk output (4 C^2 V), `w S`, `q S`, `k^T v_new` (6 C K V), and the inverse's merges
    (two C^3 products per doubling of the block size from 16). The backward recomputes the chunk
    and takes two products per product of it: three times the forward. `exp`: `C^2` per chunk
    (`Gamma`). `arrays`: every operand and result, for the HBM bytes.
    """
    merges = max(0, math.ceil(math.log2(c / chunk.INVERSE_BLOCK)))
    flops = 6 * c * c * dk + 4 * c * c * dv + 6 * c * dk * dv + 4 * c**3 * merges
    passes = 3 if backward else 1
    programs = math.prod(grid)
    return pl.CostEstimate(
        flops=passes * programs * flops,
        transcendentals=programs * c * c,
        bytes_accessed=sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays),
    )


def _load_chunk(q_ref, k_ref, v_ref, gc_ref, gr_ref, bc_ref, sc_ref, sr_ref):
    f32 = jnp.float32
    return (
        q_ref[...].astype(f32),
        k_ref[...].astype(f32),
        v_ref[...].astype(f32),
        gc_ref[...],
        gr_ref[...],
        bc_ref[...],
        sc_ref[...],
        sr_ref[...],
    )


def _forward_kernel(*refs, save_states: bool):
    inputs, (h0_ref,), rest = refs[:8], refs[8:9], refs[9:]
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
    q, k, v, gc, gr, bc, sc, sr = _load_chunk(*inputs)
    o, state = chunk.chunk_step(state, q, k, v, gc, gr, bc, sc, sr, operands=inputs[0].dtype)
    o_ref[...] = o.astype(o_ref.dtype)
    s_scratch[...] = state
    # Written at every step, not only the last: the block stays resident across the chunk axis
    # (its index does not change), and jax 0.11's interpret mode does not keep a block written
    # only at the last step (observed: a wrong dh0 in the backward below).
    hf_ref[...] = state


@functools.partial(jax.jit, static_argnames=("chunk_size", "save_states", "interpret"))
def forward(q, k, v, gamma, beta, seg, h0, *, chunk_size: int, save_states: bool, interpret: bool):
    """Chunked forward. `q, k: [B, H, T, K]`, `v: [B, H, T, V]`, `gamma, beta: [B, H, N, C]`,
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
    operands = (q, k, v, *_token_inputs(gamma, beta, seg), h0)
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
        name="gated_delta_fwd",
    )(*operands)
    return outs[0], outs[1], outs[2] if save_states else None


def _backward_kernel(*refs):
    inputs, (state_ref, do_ref, dht_ref), outs = refs[:8], refs[8:11], refs[11:]
    dq_ref, dk_ref, dv_ref, dgc_ref, dgr_ref, dbc_ref, dh0_ref, ds_scratch = outs
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        ds_scratch[...] = dht_ref[...]

    q, k, v, gc, gr, bc, sc, sr = _load_chunk(*inputs)

    def step(state, q, k, v, gc, gr, bc):
        return chunk.chunk_step(state, q, k, v, gc, gr, bc, sc, sr, operands=inputs[0].dtype)

    _, pullback = jax.vjp(step, state_ref[...], q, k, v, gc, gr, bc)
    d_state, dq, dk, dv, dgc, dgr, dbc = pullback(
        (do_ref[...].astype(jnp.float32), ds_scratch[...])
    )
    dq_ref[...] = dq
    dk_ref[...] = dk
    dv_ref[...] = dv
    dgc_ref[...] = dgc
    dgr_ref[...] = dgr
    dbc_ref[...] = dbc
    ds_scratch[...] = d_state
    dh0_ref[...] = d_state  # at every step, as hf_ref in the forward


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret"))
def backward(q, k, v, gamma, beta, seg, states, do, dh_final, *, chunk_size: int, interpret: bool):
    """Reverse chunk scan of the cotangents. Returns `(dq, dk [B, H, T, K], dv [B, H, T, V],
    dgamma, dbeta [B, H, N, C], dh0 [B, H, K, V])`, all float32."""
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    n_chunks = t // c

    def rev(n):
        return n_chunks - 1 - n

    state_spec = _block((None, None, dk, dv), lambda b_, h_, n: (b_, h_, 0, 0))
    f32 = jnp.float32
    token_shape = (b, h, n_chunks, c)
    out_shape = [
        jax.ShapeDtypeStruct(q.shape, f32),
        jax.ShapeDtypeStruct(k.shape, f32),
        jax.ShapeDtypeStruct(v.shape, f32),
        jax.ShapeDtypeStruct((*token_shape, 1), f32),
        jax.ShapeDtypeStruct((*token_shape[:3], 1, c), f32),
        jax.ShapeDtypeStruct((*token_shape, 1), f32),
        jax.ShapeDtypeStruct((b, h, dk, dv), f32),
    ]
    operands = (q, k, v, *_token_inputs(gamma, beta, seg), states, do, dh_final)
    dq, dk_, dv_, dgc, dgr, dbc, dh0 = pl.pallas_call(
        _backward_kernel,
        grid=(b, h, n_chunks),
        in_specs=[
            *_specs(c, dk, dv, rev),
            _block((None, None, None, dk, dv), lambda b_, h_, n: (b_, h_, rev(n), 0, 0)),
            _block((None, None, c, dv), lambda b_, h_, n: (b_, h_, rev(n), 0)),
            state_spec,
        ],
        out_specs=[
            *_specs(c, dk, dv, rev)[:6],
            state_spec,
        ],
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((dk, dv), f32)],
        compiler_params=_compiler_params(),
        interpret=_interpret(interpret),
        cost_estimate=_cost((b, h, n_chunks), c, dk, dv, (*operands, *out_shape), backward=True),
        name="gated_delta_bwd",
    )(*operands)
    dgamma = dgc[..., 0] + dgr[..., 0, :]
    return dq, dk_, dv_, dgamma, dbc[..., 0], dh0
