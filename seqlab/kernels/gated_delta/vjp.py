"""`jax.custom_vjp` tying a platform's forward and backward kernels together.

The forward saves the chunk-start states (`[B, H, N, K, V]` float32); the backward kernel walks
the chunks in reverse from them. Both are Pallas kernels: no XLA autodiff of the forward runs.
"""

import functools
from types import ModuleType

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def chunked_scan(
    kernels: ModuleType, chunk_size: int, interpret: bool, q, k, v, gamma, beta, seg, h0
):
    """`(o [B, H, T, V], h_final [B, H, K, V])` from the kernel contract's inputs (README.md).

    `kernels` is the platform's kernel module (`pallas_tpu` or `pallas_gpu`): it provides
    `forward(...)` and `backward(...)`.
    """
    o, h_final, _ = kernels.forward(
        q, k, v, gamma, beta, seg, h0, chunk_size=chunk_size, save_states=False, interpret=interpret
    )
    return o, h_final


def _fwd(kernels, chunk_size, interpret, q, k, v, gamma, beta, seg, h0):
    o, h_final, states = kernels.forward(
        q, k, v, gamma, beta, seg, h0, chunk_size=chunk_size, save_states=True, interpret=interpret
    )
    return (o, h_final), (q, k, v, gamma, beta, seg, states)


def _bwd(kernels, chunk_size, interpret, residuals, cotangents):
    q, k, v, gamma, beta, seg, states = residuals
    do, dh_final = cotangents
    dq, dk, dv, dgamma, dbeta, dh0 = kernels.backward(
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
