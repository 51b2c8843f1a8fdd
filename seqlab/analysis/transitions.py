"""State transitions of a Mamba-1 layer: `A_bar[b, t, d, n] = exp(dt[b, t, d] * A[d, n])`.

`dt = softplus(delta + delta_bias)` as in `seqlab.ops.selective_scan`. Wang et al. (arXiv
2501.00658) tie recency to the largest transition `A_max` (influence decays like
`A_max^distance`) and over-smoothing to the smallest; the per-channel range `A_max - A_min` shows
how much a channel's memory actually varies with the input.

Both functions take the keyword arguments of `selective_scan` (as `Mamba.op_inputs` returns
them; only `delta`, `delta_bias`, `A` and `delta_softplus` are read).
"""

import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_shape


def transitions(inputs: dict) -> jax.Array:
    """`A_bar: [B, T, D, N]` in float32 (float64 for float64 inputs)."""
    delta, A = inputs["delta"], inputs["A"]
    check_shape("delta", delta, (None, None, A.shape[0]), "[B, T, D]")
    acc = jnp.promote_types(delta.dtype, jnp.float32)
    dt = delta.astype(acc)
    if inputs.get("delta_bias") is not None:
        dt = dt + inputs["delta_bias"].astype(acc)
    if inputs.get("delta_softplus", False):
        dt = jax.nn.softplus(dt)
    return jnp.exp(dt[..., None] * A.astype(acc))


def transition_range(inputs: dict) -> tuple[jax.Array, jax.Array]:
    """`(A_min, A_max)`, each `[D, N]`: the extreme transitions of every channel over batch and
    time. `A_max - A_min` is the per-channel transition range."""
    a_bar = transitions(inputs)
    return jnp.min(a_bar, axis=(0, 1)), jnp.max(a_bar, axis=(0, 1))
