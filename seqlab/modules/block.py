"""The pre-norm residual block every model in seqlab is made of."""

import flax.linen as nn
import jax

from seqlab.modules.mamba import Mamba
from seqlab.modules.norm import RMSNorm


class Block(nn.Module):
    """`x = x + mixer(RMSNorm(x))`, then `x = x + mlp(RMSNorm(x))` when there is an MLP.

    `x: [B, T, D]`. The mixer implements `__call__(x [B, T, D])`, `init_cache(batch_size, max_len)`,
    `step(x_t [B, D], cache) -> (y_t, cache)`, `extend`, `verify` and `accept` (the contract of
    `seqlab.modules.mixer`); the MLP acts on the last axis, so it applies per token during decoding
    too.

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

    def extend(self, x: jax.Array, cache, lengths=None) -> tuple[jax.Array, object]:
        """`x: [B, T, D]` continuing from `cache`, row `b`'s first `lengths[b]` tokens real:
        `(y: [B, T, D], cache after the real tokens)` (the mixer's `extend`)."""
        y, cache = self.mixer.extend(self.mixer_norm(x), cache, lengths)
        return self._mlp_residual(x + y), cache

    def verify(self, x: jax.Array, cache) -> tuple[jax.Array, object]:
        """`n` (draft) tokens `x: [B, n, D]` from `cache`: `(y: [B, n, D], trail)`, `y` equal to
        `step` token by token; `trail` as the mixer's `verify`."""
        y, trail = self.mixer.verify(self.mixer_norm(x), cache)
        return self._mlp_residual(x + y), trail

    def accept(self, trail, m: jax.Array):
        """The cache after each row's first `m[b]` tokens of the `verify` that made `trail`."""
        return self.mixer.accept(trail, m)


def MambaBlock(d_model: int, *, norm_eps: float = 1e-6, **mamba_kwargs) -> Block:
    """A Mamba-1 block: `Block(mixer=Mamba(d_model, **mamba_kwargs))`, no MLP."""
    return Block(mixer=Mamba(d_model=d_model, **mamba_kwargs), norm_eps=norm_eps)
