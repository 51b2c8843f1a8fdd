"""The pre-norm residual block every model in seqlab is made of."""

import flax.linen as nn
import jax

from seqlab.modules.mamba import Mamba
from seqlab.modules.norm import RMSNorm


class Block(nn.Module):
    """`x = x + mixer(RMSNorm(x))`, then `x = x + mlp(RMSNorm(x))` when there is an MLP.

    `x: [B, T, D]`. The mixer implements `__call__(x [B, T, D])`, `init_cache(batch_size, max_len)`
    and `step(x_t [B, D], cache) -> (y_t, cache)` (Mamba, Mamba2, GatedDeltaNet, Attention); the MLP
    acts on the last axis, so it applies per token during decoding too.

    Attributes:
      mixer: the sequence mixer.
      mlp: the channel MLP (`SwiGLU`, `MoE`), or None (Mamba-1 blocks have none).
      norm_eps: epsilon of both RMSNorms.
      zero_centered_norm: zero-centred RMSNorms (scale `1 + weight`, Qwen3-Next).
    """

    mixer: nn.Module
    mlp: nn.Module | None = None
    norm_eps: float = 1e-6
    zero_centered_norm: bool = False

    def setup(self):
        norm = dict(eps=self.norm_eps, zero_centered=self.zero_centered_norm)
        self.mixer_norm = RMSNorm(**norm)
        self.mlp_norm = None if self.mlp is None else RMSNorm(**norm)

    def _mlp_residual(self, x: jax.Array) -> jax.Array:
        return x if self.mlp is None else x + self.mlp(self.mlp_norm(x))

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x: [B, T, D] -> [B, T, D]`."""
        return self._mlp_residual(x + self.mixer(self.mixer_norm(x)))

    def init_cache(self, batch_size: int, max_len: int):
        """The mixer's zero decoding cache (the norms and the MLP keep no state)."""
        return self.mixer.init_cache(batch_size, max_len)

    def step(self, x_t: jax.Array, cache) -> tuple[jax.Array, object]:
        """One decoding step: `x_t: [B, D] -> (y_t: [B, D], new cache)`, as `__call__` per token."""
        y_t, cache = self.mixer.step(self.mixer_norm(x_t), cache)
        return self._mlp_residual(x_t + y_t), cache


def MambaBlock(d_model: int, *, norm_eps: float = 1e-6, **mamba_kwargs) -> Block:
    """A Mamba-1 block: `Block(mixer=Mamba(d_model, **mamba_kwargs))`, no MLP."""
    return Block(mixer=Mamba(d_model=d_model, **mamba_kwargs), norm_eps=norm_eps)
