"""One chunk of the gated delta rule on 2-D float32 values, the body of the TPU kernels.

Written for Mosaic TPU: only 2-D arrays, matmuls, `exp`, `where` and iota masks. Per-token
vectors come in both layouts, as a column `[C, 1]` and a row `[1, C]` (two free reshapes of the
same `[C]` array), so that no transposes are needed. With the incoming state `S: [K, V]`,
chunk-local cumulative log-gate `gamma`, segment counter `seg` (the kernel contract in
README.md), `i, j` token indices of the chunk:

    Gamma_ij = exp(gamma_i - gamma_j)  if i >= j and seg_i == seg_j, else 0
    A        = (I + strict_lower(diag(beta) (k k^T * Gamma)))^{-1}
    u        = A (beta v),   w = A (beta exp(gamma) [seg == 0] k)
    v_new    = u - w S
    o        = (q exp(gamma) [seg == 0]) S + ((q k^T) * Gamma) v_new
    S'       = exp(gamma_last) [seg_last == 0] S
               + (k exp(gamma_last - gamma) [seg == seg_last])^T v_new
"""

import jax
import jax.numpy as jnp
from jax import lax

# Diagonal blocks of the triangular inverse, solved exactly by forward substitution.
INVERSE_BLOCK = 16


def _dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """`a @ b` with optional transposes folded into the contraction, float32, full precision."""
    contract = ((0,) if trans_a else (1,), (1,) if trans_b else (0,))
    return lax.dot_general(
        a,
        b,
        (contract, ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _iota(c: int, axis: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, (c, c), axis)


def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """`(I + L)^{-1}` for strictly lower-triangular `L: [..., C, C]` (any C), in L's dtype.

    Every intermediate is itself the inverse of a unit-lower part of `I + L`, so its entries stay
    as bounded as the answer's (a product of matrix powers, `(I - N)(I + N^2)(I + N^4)...`, has
    entries that grow to ~1e3 on correlated keys while the inverse stays O(1); rounding then
    swamps it). Two stages, written with iota masks, reductions and matmuls only, so that the
    same code runs batched in XLA and on 2-D values inside the Mosaic TPU kernels:

    1. The diagonal 16 x 16 blocks `D` of `I + L`, all at once, by column-oriented forward
       substitution: `I + L_D = E_0 E_1 ... E_14` with `E_j = I + l_j e_j^T` (`l_j` the j-th
       column of each block), so `X = E_14^{-1} ... E_0^{-1}`, `E_j^{-1} X = X - l_j (e_j^T X)`.
    2. Merge neighbouring blocks: with `X_s` the inverse of the diagonal s x s blocks and `F` the
       part of `L` inside the 2s-blocks but outside the s-blocks (`(X_s F)^2 = 0`),
       `X_2s = (I + X_s F)^{-1} X_s = X_s - X_s F X_s`; s = 16, 32, ... until s >= C.
    """
    c = lower.shape[-1]
    row, col = _iota(c, 0), _iota(c, 1)
    # lax.div / lax.rem, not // and %: jnp's floor forms lower through `sign`, which Mosaic
    # lowers per chip.
    blk = min(INVERSE_BLOCK, c)

    def block_of(idx, size):
        return lax.div(idx, jnp.int32(size))

    in_block = block_of(row, blk) == block_of(col, blk)
    diag = jnp.where(in_block, lower, 0.0)
    x = jnp.broadcast_to(jnp.where(row == col, 1.0, 0.0).astype(lower.dtype), lower.shape)
    row_in, col_in = lax.rem(row, jnp.int32(blk)), lax.rem(col, jnp.int32(blk))
    for j in range(blk - 1):
        l_j = jnp.sum(jnp.where(col_in == j, diag, 0.0), axis=-1, keepdims=True)  # [..., C, 1]
        x_j = jnp.sum(jnp.where(row_in == j, x, 0.0), axis=-2, keepdims=True)  # [..., 1, C]
        x = x - jnp.where(in_block, l_j * x_j, 0.0)
    size = blk
    while size < c:
        pair = block_of(row, 2 * size) == block_of(col, 2 * size)
        off = jnp.where(pair & (block_of(row, size) != block_of(col, size)), lower, 0.0)
        x = x - _matmul(x, _matmul(off, x))
        size *= 2
    return x


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` over the last two axes, full precision, in the operands' dtype."""
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def chunk_step(
    state: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    gamma_col: jax.Array,
    gamma_row: jax.Array,
    beta_col: jax.Array,
    seg_col: jax.Array,
    seg_row: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One chunk: `(o: [C, V], next_state: [K, V])`, all float32.

    Args:
      state: `[K, V]` incoming state.
      q, k: `[C, K]` (q pre-scaled); v: `[C, V]`.
      gamma_col, gamma_row: `[C, 1]`, `[1, C]` chunk-local inclusive cumsum of the log-gate.
      beta_col: `[C, 1]`.
      seg_col, seg_row: `[C, 1]`, `[1, C]` chunk-local segment counters (0 = the state's segment).
    """
    c = q.shape[0]
    causal = _iota(c, 0) >= _iota(c, 1)
    mask = causal & (seg_col == seg_row)
    # exp only where masked in: gamma_i - gamma_j >= 0 elsewhere can overflow.
    gamma_ij = jnp.where(mask, jnp.exp(jnp.where(mask, gamma_col - gamma_row, 0.0)), 0.0)
    lower = jnp.where(
        _iota(c, 0) > _iota(c, 1), beta_col * _dot(k, k, trans_b=True) * gamma_ij, 0.0
    )
    inverse = unit_lower_inverse(lower)
    from_state = jnp.where(seg_col == 0, jnp.exp(gamma_col), 0.0)  # [C, 1]
    u = _dot(inverse, beta_col * v)
    w = _dot(inverse, (beta_col * from_state) * k)
    v_new = u - _dot(w, state)
    o = _dot(q * from_state, state) + _dot(_dot(q, k, trans_b=True) * gamma_ij, v_new)
    # The last token's values as [1, 1] by a masked sum, not a slice at an unaligned sublane.
    is_last = lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1
    gamma_last = jnp.sum(jnp.where(is_last, gamma_col, 0.0), axis=0, keepdims=True)
    seg_last = jnp.sum(jnp.where(is_last, seg_col, 0.0), axis=0, keepdims=True)
    keep = jnp.where(seg_last == 0, jnp.exp(gamma_last), 0.0)
    to_end = jnp.where(seg_col == seg_last, jnp.exp(gamma_last - gamma_col), 0.0)  # [C, 1]
    return o, keep * state + _dot(k * to_end, v_new, trans_a=True)
