"""Normalization ops: RMSNorm, the SiLU-gated RMSNorm of Mamba-2 and Gated DeltaNet, and the L2
normalization of Gated DeltaNet's queries and keys."""

import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_floating, check_shape


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float = 1e-6) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 (float64 for float64 inputs).

    `y = x / sqrt(mean(x^2) + eps) * weight`. `x: [..., D]`, `weight: [D]`; returns `x.dtype`.
    """
    check_floating("x", x)
    check_shape("weight", weight, (x.shape[-1],), "[D]")
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.astype(acc)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(acc)).astype(x.dtype)


def gated_rms_norm(
    x: jax.Array, gate: jax.Array, weight: jax.Array, *, eps: float = 1e-6
) -> jax.Array:
    """Gated RMSNorm: `rms_norm(x, weight) * silu(gate)` (norm before gate, as in Gated DeltaNet).

    `x, gate: [..., D]`, `weight: [D]`; returns `x.dtype`.
    """
    check_shape("gate", gate, x.shape, "like x")
    acc = jnp.promote_types(x.dtype, jnp.float32)
    y = rms_norm(x.astype(acc), weight, eps=eps) * jax.nn.silu(gate.astype(acc))
    return y.astype(x.dtype)


def l2_normalize(x: jax.Array, *, eps: float = 1e-6) -> jax.Array:
    """`x / sqrt(||x||^2 + eps)` over the last axis (fla's `l2norm`), computed in float32 (float64
    for float64 inputs). `x: [..., D]`; returns `x.dtype`."""
    check_floating("x", x)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.astype(acc)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
