"""Normalization layers."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqlab.ops.norm import gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a learned scale (initialized to 1). `x: [..., D]`."""

    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, gate: jax.Array | None = None) -> jax.Array:
        """`rms_norm(x) * weight`, times `silu(gate)` when a gate `[..., D]` is given."""
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        if gate is None:
            return rms_norm(x, weight, eps=self.eps)
        return gated_rms_norm(x, gate, weight, eps=self.eps)
