"""The `jax.custom_vjp` tying the KDA TPU kernels' forward and backward passes together.

The forward kernel saves the chunk-start states (`[B, H, N, K, V]` float32); the backward kernel
walks the chunks in reverse from them. Both are Pallas kernels: no XLA autodiff of the forward
runs.
"""

import functools

import jax
import jax.numpy as jnp

from seqlab.kernels.kda import pallas_tpu


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def chunked_scan(chunk_size: int, interpret: bool, q, k, v, gamma, beta, seg, h0):
    """`(o [B, H, T, V], h_final [B, H, K, V])` from the kernel contract (README.md)."""
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
