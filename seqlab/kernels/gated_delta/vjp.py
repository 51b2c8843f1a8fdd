"""`jax.custom_vjp`s tying the kernels' forward and backward passes together.

`chunked_scan` (TPU): the forward kernel saves the chunk-start states (`[B, H, N, K, V]` float32);
the backward kernel walks the chunks in reverse from them. Both are Pallas kernels: no XLA
autodiff of the forward runs.

`state_scan` (GPU): the state pass of `pallas_gpu`; its backward is the same kernel over the
chunks in reverse with transposed operands, plus three chunk-parallel products in XLA.
"""

import functools

import jax
import jax.numpy as jnp

from seqlab.kernels.gated_delta import pallas_gpu, pallas_tpu


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def chunked_scan(chunk_size: int, interpret: bool, q, k, v, gamma, beta, seg, h0):
    """`(o [B, H, T, V], h_final [B, H, K, V])` from the TPU kernel contract (README.md)."""
    o, h_final, _ = pallas_tpu.forward(
        q, k, v, gamma, beta, seg, h0, chunk_size=chunk_size, save_states=False, interpret=interpret
    )
    return o, h_final


def _fwd(chunk_size, interpret, q, k, v, gamma, beta, seg, h0):
    o, h_final, states = pallas_tpu.forward(
        q, k, v, gamma, beta, seg, h0, chunk_size=chunk_size, save_states=True, interpret=interpret
    )
    return (o, h_final), (q, k, v, gamma, beta, seg, states)


def _bwd(chunk_size, interpret, residuals, cotangents):
    q, k, v, gamma, beta, seg, states = residuals
    do, dh_final = cotangents
    dq, dk, dv, dgamma, dbeta, dh0 = pallas_tpu.backward(
        q, k, v, gamma, beta, seg, states, do, dh_final.astype(jnp.float32),
        chunk_size=chunk_size, interpret=interpret,
    )  # fmt: skip
    return (
        dq.astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        dgamma,
        dbeta,
        jnp.zeros_like(seg),
        dh0,
    )


chunked_scan.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def state_scan(block_v: int, interpret: bool, a, b, x, d, h0):
    """`(states, out, final)` of `pallas_gpu.state_scan` (in chunk order), differentiable.

    Shapes as there: `a: [B, H, N, C, K]`, `b: [B, H, N, K, C]`, `x: [B, H, N, C, V]`,
    `d: [B, H, N]`, `h0: [B, H, K, V]`, all float32.
    """
    return pallas_gpu.state_scan(
        a, b, x, d, h0, reverse=False, block_v=block_v, interpret=interpret
    )


def _state_scan_fwd(block_v, interpret, a, b, x, d, h0):
    states, out, final = state_scan(block_v, interpret, a, b, x, d, h0)
    return (states, out, final), (a, b, d, states, out)


def _state_scan_bwd(block_v, interpret, residuals, cotangents):
    """With `G_n` the cotangent of `S_{n+1}` (`G_{N-1} = dfinal`), chunks in reverse:

        dx_n = dout_n + b_n^T G_n,     G_{n-1} = d_n G_n + a_n^T dx_n + dstates_n

    (the forward kernel with `a' = b^T`, `b' = a^T`, `y = dstates`), then, chunk-parallel,
    `da_n = dx_n S_n^T`, `db_n = G_n out_n^T`, `dd_n = <G_n, S_n>`, `dh0 = G_{-1}`.
    """
    a, b, d, states, out = residuals
    dstates, dout, dfinal = cotangents
    swap = functools.partial(jnp.swapaxes, axis1=-1, axis2=-2)
    carried, dx, dh0 = pallas_gpu.state_scan(
        swap(b), swap(a), dout, d, dfinal, dstates,
        reverse=True, block_v=block_v, interpret=interpret,
    )  # fmt: skip
    hi = jax.lax.Precision.HIGHEST
    da = jnp.einsum("bhncv,bhnkv->bhnck", dx, states, precision=hi)
    db = jnp.einsum("bhnkv,bhncv->bhnkc", carried, out, precision=hi)
    dd = jnp.sum(carried * states, axis=(-2, -1))
    return da, db, dx, dd, dh0


state_scan.defvjp(_state_scan_fwd, _state_scan_bwd)
