"""Softmax attention with causal and sliding-window masks by position, and rotary embeddings.

One function serves training (queries and keys are the same `T` tokens) and decoding (one query
against a cache of keys): the mask is computed from the absolute positions of queries and keys, so a
ring-buffer cache only has to carry the position of each slot.
"""

import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_floating, check_positive_int, check_shape


def _check_positions(name: str, positions, batch: int, length: int, layout: str) -> jax.Array:
    """Validate integer positions `[L]` or `[B, L]` and return them as `[B or 1, L]`."""
    if not jnp.issubdtype(jnp.result_type(positions), jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {jnp.result_type(positions)}")
    positions = jnp.asarray(positions)
    if positions.ndim == 1:
        check_shape(name, positions, (length,), layout.replace("B, ", ""))
        return positions[None]
    check_shape(name, positions, (batch, length), layout)
    return positions


def rope(
    x: jax.Array,
    positions: jax.Array,
    *,
    theta: float = 10000.0,
    rotary_dim: int | None = None,
) -> jax.Array:
    """Rotary position embedding (half-split layout, as in GPT-NeoX and Llama).

    Channel pairs `(i, i + R/2)` of the first `R = rotary_dim` channels (all `D` by default)
    rotate by the angle `p * theta^(-2i/R)`, so that the dot product of a rotated query at position
    `p` and a rotated key at position `s` depends on `p - s` only; channels from `R` on pass
    through (partial rotary, transformers' `partial_rotary_factor = R / D`).

    Args:
      x: `[B, T, H, D]`, `D` even unless `rotary_dim` is set.
      positions: `[B, T]` or `[T]`, integer.
      theta: the base of the frequencies.
      rotary_dim: None (the whole head) or an even `R` in `[2, D]`.

    Returns:
      `[B, T, H, D]` in `x.dtype`; the rotation is computed in float32 (float64 for float64 inputs).
    """
    check_floating("x", x)
    check_shape("x", x, (None, None, None, None), "[B, T, H, D]")
    batch, length, _, dim = x.shape
    if rotary_dim is not None and rotary_dim != dim:
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
            raise ValueError(f"rotary_dim must be an int, got {rotary_dim!r}")
        if rotary_dim % 2 or not 2 <= rotary_dim <= dim:
            raise ValueError(f"rotary_dim must be an even int in [2, D = {dim}], got {rotary_dim}")
        rotated = rope(x[..., :rotary_dim], positions, theta=theta)
        return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)
    if dim % 2:
        raise ValueError(f"x must have an even head dimension D in [B, T, H, D], got {x.shape}")
    positions = _check_positions("positions", positions, batch, length, "[B, T]")

    acc = jnp.promote_types(x.dtype, jnp.float32)
    inv_freq = theta ** -(jnp.arange(0, dim, 2, dtype=acc) / dim)  # [D/2]
    angle = positions.astype(acc)[..., None] * inv_freq  # [B or 1, T, D/2]
    cos = jnp.cos(angle)[:, :, None, :]  # [B or 1, T, 1, D/2]
    sin = jnp.sin(angle)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(acc), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    k_positions: jax.Array,
    window: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Causal softmax attention by positions, optionally restricted to a sliding window.

    Query `t` attends to key `s` iff `k_pos[s] <= q_pos[t]` and, with a window `w`,
    `q_pos[t] - k_pos[s] < w` (the query itself and the `w - 1` keys before it):
    `o_t = sum_s softmax_s(scale * q_t . k_s) v_s` over the visible keys. A key slot that must never
    be seen (an unwritten cache slot) carries a position larger than every query position. A query
    that sees no key at all returns zeros.

    Grouped-query attention: query head `h` reads key/value head `h // (H // HKV)`.

    Args:
      q: `[B, T, H, D]`.
      k: `[B, S, HKV, D]`, with `H` a multiple of `HKV`.
      v: `[B, S, HKV, DV]`.
      q_positions: `[B, T]` or `[T]`, integer.
      k_positions: `[B, S]` or `[S]`, integer.
      window: None for global causal attention, or the window length `w >= 1`.
      scale: the score scale, default `D ** -0.5`.

    Returns:
      `[B, T, H, DV]` in `q.dtype`; scores and softmax in float32 (float64 for float64 inputs).
    """
    check_floating("q", q)
    check_floating("k", k)
    check_floating("v", v)
    check_shape("q", q, (None, None, None, None), "[B, T, H, D]")
    batch, length, heads, dim = q.shape
    check_shape("k", k, (batch, None, None, dim), "[B, S, HKV, D]")
    _, keys, kv_heads, _ = k.shape
    check_shape("v", v, (batch, keys, kv_heads, None), "[B, S, HKV, DV]")
    if heads % kv_heads:
        raise ValueError(
            f"k must have a head count HKV dividing the H = {heads} query heads, got {kv_heads}"
        )
    q_positions = _check_positions("q_positions", q_positions, batch, length, "[B, T]")
    k_positions = _check_positions("k_positions", k_positions, batch, keys, "[B, S]")
    if window is not None:
        check_positive_int("window", window)
    scale = dim**-0.5 if scale is None else scale

    acc = jnp.promote_types(q.dtype, jnp.float32)
    groups = heads // kv_heads
    qg = q.reshape(batch, length, kv_heads, groups, dim).astype(acc)  # [B, T, HKV, R, D]
    scores = scale * jnp.einsum("btgrd,bsgd->bgrts", qg, k.astype(acc))  # [B, HKV, R, T, S]

    offset = q_positions[:, :, None] - k_positions[:, None, :]  # [B or 1, T, S]
    visible = offset >= 0
    if window is not None:
        visible &= offset < window
    visible = visible[:, None, None]  # [B or 1, 1, 1, T, S]

    # Softmax over the visible keys; masked scores are -inf before the exponential (exp(-inf) = 0)
    # and a row with no visible key keeps a finite maximum and a zero sum.
    scores = jnp.where(visible, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    weights = jnp.exp(scores - row_max)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)

    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v.astype(acc))  # [B, T, HKV, R, DV]
    return out.reshape(batch, length, heads, v.shape[-1]).astype(q.dtype)
