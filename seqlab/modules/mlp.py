"""Gated feed-forward layers."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_positive_int


class SwiGLU(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): `down(silu(gate(x)) * up(x))`, no biases.

    `x: [..., d_model]` -> `[..., d_model]`, hidden width `d_ff`.
    """

    d_model: int
    d_ff: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        check_positive_int("d_model", self.d_model)
        check_positive_int("d_ff", self.d_ff)
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape [..., d_model = {self.d_model}], got {x.shape}")

        def dense(features: int, name: str) -> nn.Dense:
            return nn.Dense(
                features, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, name=name
            )

        hidden = nn.silu(dense(self.d_ff, "gate")(x)) * dense(self.d_ff, "up")(x)
        return dense(self.d_model, "down")(hidden)
