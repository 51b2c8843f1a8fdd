"""The token embedding and its tied readout, shared by every language model in seqlab."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqlab.modules import initializers
from seqlab.modules.norm import RMSNorm
from seqlab.ops.checks import accumulation_dtype, check_choice, check_shape

NORMS = ("rms", "layer")


class TiedEmbedding(nn.Module):
    """Token embedding `E: [vocab_size, d_model]` (`N(0, 0.02^2)`) and the tied readout
    `logits = norm(h) E^T`, or with `tie=False` a readout of its own, `logits = norm(h) W^T`
    (`W: [vocab_size, d_model]`, the untied `lm_head` of Mamba-2 and Qwen3-Next checkpoints).

    `norm` is "rms" (RMSNorm with a learned scale, `LanguageModel`; zero-centred, scale
    `1 + weight`, with `zero_centered`) or "layer" (LayerNorm with a scale and no bias, the
    neural-ODE transformers). The readout runs in float32 (float64 for a float64 model) whatever
    the compute dtype. Parameters: `embedding`, `head` (untied only), and `norm/weight` (rms) or
    `norm/scale` (layer).
    """

    vocab_size: int
    d_model: int
    norm: str = "rms"
    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    tie: bool = True
    zero_centered: bool = False

    def setup(self):
        check_choice("norm", self.norm, NORMS)
        shape = (self.vocab_size, self.d_model)
        self.embedding = self.param("embedding", initializers.normal(0.02), shape, self.param_dtype)
        if not self.tie:
            self.head = self.param("head", initializers.normal(0.02), shape, self.param_dtype)
        acc = accumulation_dtype(self.dtype)
        if self.zero_centered and self.norm != "rms":
            raise ValueError(f"zero_centered needs norm='rms', got norm={self.norm!r}")
        if self.norm == "rms":
            self.final_norm = RMSNorm(
                eps=self.eps,
                param_dtype=self.param_dtype,
                zero_centered=self.zero_centered,
                name="norm",
            )
        else:
            self.final_norm = nn.LayerNorm(
                epsilon=self.eps,
                use_bias=False,
                dtype=acc,
                param_dtype=self.param_dtype,
                name="norm",
            )

    def embed(self, tokens: jax.Array) -> jax.Array:
        """`tokens: [B, T]` (or `[B]`) int -> `E[tokens]: [..., d_model]` in the compute dtype."""
        if not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
            raise ValueError(
                f"tokens must be an integer array, got dtype {jnp.result_type(tokens)}"
            )
        return jnp.take(self.embedding.astype(self.dtype), tokens, axis=0)

    def readout(self, h: jax.Array) -> jax.Array:
        """`h: [..., d_model]` -> logits `norm(h) E^T` (`norm(h) W^T` untied): `[..., vocab_size]`
        in float32 (float64 for a float64 model)."""
        check_shape("h", h, (*h.shape[:-1], self.d_model), "[..., d_model]")
        acc = accumulation_dtype(self.dtype)
        head = self.embedding if self.tie else self.head
        return self.final_norm(h.astype(acc)).astype(acc) @ head.astype(acc).T
