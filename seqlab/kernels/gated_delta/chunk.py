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

# Within-block powers stay short (<= 15) and so does float32 cancellation; see
# `seqlab.ops.gated_delta._unit_lower_inverse` for the same factorization in XLA.
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


def _nilpotent_inverse(n: jax.Array, order: int) -> jax.Array:
    """`(I + N)^{-1} = (I - N)(I + N^2)(I + N^4)...` for `N: [C, C]` with `N^order = 0`."""
    eye = jnp.where(_iota(n.shape[0], 0) == _iota(n.shape[0], 1), 1.0, 0.0).astype(n.dtype)
    power = -n
    inverse = eye + power
    for _ in range(max(order - 1, 1).bit_length() - 1):
        power = _dot(power, power)
        inverse = inverse + _dot(inverse, power)
    return inverse


def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """`(I + L)^{-1}` for strictly lower-triangular `L: [C, C]`, `C` a multiple of 16.

    `I + L = D (I + M)` with `D` the identity plus the diagonal 16 x 16 blocks of `L` and
    `M = D^{-1} (L - blocks)` strictly block-lower; both factors by the nilpotent product.
    """
    c = lower.shape[0]
    blocks = min(INVERSE_BLOCK, c)
    # lax.div, not //: jnp's floor division lowers through `sign`, which Mosaic lowers per chip.
    size = jnp.int32(blocks)
    in_block = lax.div(_iota(c, 0), size) == lax.div(_iota(c, 1), size)
    d_inv = _nilpotent_inverse(jnp.where(in_block, lower, 0.0), blocks)
    m = _dot(d_inv, jnp.where(in_block, 0.0, lower))
    return _dot(_nilpotent_inverse(m, c // blocks), d_inv)


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
