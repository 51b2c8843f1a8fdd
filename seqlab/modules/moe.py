"""Sparse mixture-of-experts feed-forward block: top-k routing and an optional gated shared expert.

The semantics are those of Qwen3-Next's MoE layer, Hugging Face transformers 4.57
`Qwen3NextSparseMoeBlock` (experts and shared expert are `Qwen3NextMLP`, a SwiGLU). For
`x: [..., d_model]`, `E = num_experts` experts of hidden width `d_ff`:

    logits = router(x)                                   # [..., E], x @ W_router
    p      = softmax(logits)                             # in float32 (float64 for float64 compute)
    w, e   = top_k(p, k)                                 # [..., k] values and expert ids
    w      = w / sum(w)            if norm_topk_prob     # the k weights sum to 1
    y      = sum_k w_k * SwiGLU_{e_k}(x)
    y     += sigmoid(shared_gate(x)) * shared_expert(x)  if shared_d_ff is not None

with `SwiGLU_e(x) = (silu(x @ gate[e]) * (x @ up[e])) @ down[e]`. As in transformers, the routing
weights are cast to the compute dtype before they scale the expert outputs.

Routing and dispatch are the ops `seqlab.ops.moe.top_k_routing` and `routed_swiglu` (no capacity,
no token dropped; `impl` "sorted" through `ragged_dot`, or "dense", the CPU default; see there).
"""

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqlab.modules.mlp import SwiGLU
from seqlab.ops.checks import (
    accumulation_dtype,
    check_choice,
    check_floating,
    check_positive_int,
)
from seqlab.ops.moe import IMPLS, routed_swiglu, top_k_routing

# nn.Dense's default kernel initializer applied to each expert's [in, out] matrix separately:
# truncated normal with variance 1 / in (fan-in of that matrix, the expert axis is a batch axis).
expert_kernel_init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts plus an optional gated shared expert (see the module docstring).

    `x: [..., d_model]` (any number of leading axes; a decoding step passes `[B, d_model]`) ->
    `[..., d_model]` in `dtype`.

    Attributes:
      d_model: model width.
      d_ff: hidden width of each routed expert.
      num_experts: number of routed experts `E`.
      top_k: experts per token `k`, `1 <= k <= E`.
      norm_topk_prob: renormalize the `k` chosen probabilities to sum 1 (Qwen3-Next: True).
      shared_d_ff: hidden width of the shared expert; None for no shared expert.
      impl: implementation of `seqlab.ops.moe.routed_swiglu` (None: auto; "sorted", "dense").
      dtype: compute dtype; the routing softmax accumulates in `promote_types(dtype, float32)`.
      param_dtype: dtype of the parameters.

    Parameters:
      router: `nn.Dense(E, use_bias=False)`, kernel `[d_model, E]`.
      gate, up: `[E, d_model, d_ff]`; down: `[E, d_ff, d_model]` (LeCun normal per expert).
      shared_expert: `SwiGLU(d_model, shared_d_ff)` (kernels `gate`, `up`, `down`), and
      shared_gate: `nn.Dense(1, use_bias=False)`, kernel `[d_model, 1]`; only with `shared_d_ff`.
    """

    d_model: int
    d_ff: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    shared_d_ff: int | None = None
    impl: str | None = None
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def __post_init__(self):
        self.check_fields()
        super().__post_init__()

    def check_fields(self) -> None:
        """Raise `ValueError` naming the first bad field."""
        check_positive_int("d_model", self.d_model)
        check_positive_int("d_ff", self.d_ff)
        check_positive_int("num_experts", self.num_experts)
        check_positive_int("top_k", self.top_k)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k must satisfy 1 <= top_k <= num_experts = {self.num_experts}, "
                f"got {self.top_k}"
            )
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        if self.shared_d_ff is not None:
            check_positive_int("shared_d_ff", self.shared_d_ff)
        check_choice("impl", self.impl, (None, *IMPLS))

    @property
    def acc_dtype(self) -> jnp.dtype:
        """The routing softmax: float32, or float64 for a float64 compute dtype."""
        return accumulation_dtype(self.dtype)

    def setup(self):
        dense = partial(nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
        e, d, f = self.num_experts, self.d_model, self.d_ff
        self.router = dense(e)
        self.gate = self.param("gate", expert_kernel_init, (e, d, f), self.param_dtype)
        self.up = self.param("up", expert_kernel_init, (e, d, f), self.param_dtype)
        self.down = self.param("down", expert_kernel_init, (e, f, d), self.param_dtype)
        if self.shared_d_ff is not None:
            self.shared_expert = SwiGLU(
                self.d_model, self.shared_d_ff, dtype=self.dtype, param_dtype=self.param_dtype
            )
            self.shared_gate = dense(1)

    def _check_x(self, x: jax.Array) -> None:
        check_floating("x", x)
        if x.ndim < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape [..., d_model = {self.d_model}], got {x.shape}")

    def router_logits(self, x: jax.Array) -> jax.Array:
        """`x: [..., d_model]` -> router logits `[..., E]` in `dtype`."""
        self._check_x(x)
        return self.router(x)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`x: [..., d_model]` -> `(weights [..., k] in acc_dtype, experts [..., k] int32)`.

        `weights` are the `k` largest softmax probabilities (in decreasing order), renormalized
        to sum 1 when `norm_topk_prob`; `experts` are their expert ids.
        """
        logits = self.router_logits(x).astype(self.acc_dtype)
        return top_k_routing(logits, self.top_k, normalize=self.norm_topk_prob)

    def __call__(self, x: jax.Array) -> jax.Array:
        self._check_x(x)
        lead, d = x.shape[:-1], self.d_model
        xf = x.reshape(-1, d).astype(self.dtype)  # [N, D]
        weights, experts = self.route(xf)  # [N, k], [N, k]
        out = routed_swiglu(xf, weights, experts, self.gate, self.up, self.down, impl=self.impl)
        if self.shared_d_ff is not None:
            out = out + nn.sigmoid(self.shared_gate(xf)) * self.shared_expert(xf)
        return out.reshape(*lead, d)
