"""Causal depthwise 1-D convolution (the short convolution of Mamba, Mamba-2 and Gated DeltaNet)."""

import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_floating, check_shape


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    *,
    initial_state: jax.Array | None = None,
    return_final_state: bool = False,
):
    """Depthwise causal convolution along time.

    `y[b, t, d] = bias[d] + sum_{i<W} weight[i, d] * x[b, t - (W - 1) + i, d]`, where inputs before
    `t = 0` come from `initial_state` (zeros by default).

    Args:
      x: `[B, T, D]`.
      weight: `[W, D]`, the last tap multiplies the current token.
      bias: `[D]` or None.
      initial_state: `[B, W - 1, D]`, the `W - 1` inputs preceding `x[:, 0]`.
      return_final_state: also return the last `W - 1` inputs, `[B, W - 1, D]`, for decoding.

    Returns:
      `y: [B, T, D]` in `x.dtype`, and the final state when `return_final_state`.
    """
    check_floating("x", x)
    check_shape("x", x, (None, None, None), "[B, T, D]")
    batch, _, dim = x.shape
    check_shape("weight", weight, (None, dim), "[W, D]")
    width = weight.shape[0]
    if bias is not None:
        check_shape("bias", bias, (dim,), "[D]")
    if initial_state is None:
        initial_state = jnp.zeros((batch, width - 1, dim), x.dtype)
    check_shape("initial_state", initial_state, (batch, width - 1, dim), "[B, W - 1, D]")

    acc = jnp.promote_types(x.dtype, jnp.float32)
    xp = jnp.concatenate([initial_state.astype(x.dtype), x], axis=1).astype(acc)
    y = jax.lax.conv_general_dilated(
        xp,
        weight.astype(acc)[:, None, :],  # [W, 1, D]: depthwise kernel
        window_strides=(1,),
        padding="VALID",
        dimension_numbers=("NWC", "WIO", "NWC"),
        feature_group_count=dim,
    )
    if bias is not None:
        y = y + bias.astype(acc)
    y = y.astype(x.dtype)
    if return_final_state:
        return y, xp[:, xp.shape[1] - (width - 1) :].astype(x.dtype)
    return y


def causal_conv1d_step(
    x_t: jax.Array, state: jax.Array, weight: jax.Array, bias: jax.Array | None = None
):
    """One decoding step of `causal_conv1d`.

    Args:
      x_t: `[B, D]`, the new input.
      state: `[B, W - 1, D]`, the previous `W - 1` inputs.
      weight: `[W, D]`; bias: `[D]` or None.

    Returns:
      `(y_t: [B, D] in x_t.dtype, new_state: [B, W - 1, D])`.
    """
    check_shape("x_t", x_t, (None, None), "[B, D]")
    batch, dim = x_t.shape
    check_shape("weight", weight, (None, dim), "[W, D]")
    check_shape("state", state, (batch, weight.shape[0] - 1, dim), "[B, W - 1, D]")
    acc = jnp.promote_types(x_t.dtype, jnp.float32)
    window = jnp.concatenate([state.astype(x_t.dtype), x_t[:, None]], axis=1)  # [B, W, D]
    y = jnp.einsum("bwd,wd->bd", window.astype(acc), weight.astype(acc))
    if bias is not None:
        y = y + bias.astype(acc)
    return y.astype(x_t.dtype), window[:, 1:]
