"""Normalization layers."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqlab.ops.norm import gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a learned scale. `x: [..., D]`, returns `x.dtype`.

    `y = x / sqrt(mean(x^2) + eps) * s`, times `silu(gate)` when a gate `[..., D]` is given, with
    the scale `s` from the parameter `weight: [D]`:

      zero_centered=False: `s = weight`, `weight` initialized to ones (Llama, Qwen3);
      zero_centered=True:  `s = 1 + weight`, `weight` initialized to zeros (Qwen3-Next's
                           `Qwen3NextRMSNorm`; weight decay then pulls the scale towards 1).

    `1 + weight` is formed in float32 (float64 when `x` or `weight` is float64), the dtype the ops
    compute in, so a low-precision `weight` does not round the scale.
    """

    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32
    zero_centered: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, gate: jax.Array | None = None) -> jax.Array:
        """`rms_norm(x) * s`, times `silu(gate)` when a gate `[..., D]` is given."""
        init = nn.initializers.zeros if self.zero_centered else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.param_dtype)
        if self.zero_centered:
            acc = jnp.promote_types(jnp.promote_types(x.dtype, weight.dtype), jnp.float32)
            weight = 1 + weight.astype(acc)
        if gate is None:
            return rms_norm(x, weight, eps=self.eps)
        return gated_rms_norm(x, gate, weight, eps=self.eps)
