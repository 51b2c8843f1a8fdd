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

import functools

import jax
import jax.numpy as jnp
from jax import lax

# Diagonal blocks of the triangular inverse, solved exactly by forward substitution.
INVERSE_BLOCK = 16


def _dot(
    a: jax.Array,
    b: jax.Array,
    operands: jnp.dtype,
    *,
    trans_a: bool = False,
    trans_b: bool = False,
) -> jax.Array:
    """`a @ b` with optional transposes folded into the contraction, float32 result.

    `operands`: float32 (full precision: several MXU passes per product on TPU) or bfloat16
    (`a` and `b` rounded to bf16, one pass, float32 accumulation; so are the two products of its
    VJP, whose results also stay float32, see `_bf16_dot`).
    """
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    if jnp.dtype(operands) == jnp.float32:
        return lax.dot_general(
            a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )
    return _bf16_dot(a, b, trans_a, trans_b)


def _bf16_product(a, b, dims):
    bf16 = jnp.bfloat16
    return lax.dot_general(a.astype(bf16), b.astype(bf16), dims, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _bf16_dot(a: jax.Array, b: jax.Array, trans_a: bool, trans_b: bool) -> jax.Array:
    """`op(a) @ op(b)` on bf16 operands, float32 result, for 2-D `a`, `b`.

    Its VJP is written out because autodiff's would round the cotangents of `a` and `b` to bf16
    *results* (the transpose of a bf16 product is a bf16 product): on identical keys and strong
    gates that rounding made the gate gradient 5x less accurate than the float32 form's (relative
    RMS 7.9e-2 against 1.5e-2). Here the cotangent products take bf16 operands and keep float32
    results: with `A = op(a)`, `B = op(b)`, `dA = g B^T`, `dB = A^T g`.
    """
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return _bf16_product(a, b, dims)


def _bf16_dot_fwd(a, b, trans_a, trans_b):
    return _bf16_dot(a, b, trans_a, trans_b), (a, b)


def _bf16_dot_bwd(trans_a, trans_b, residuals, g):
    a, b = residuals
    # dA = g B^T: contract g's columns with B's columns (b's rows when trans_b); da = dA or dA^T.
    da = _bf16_product(g, b, (((1,), (0,) if trans_b else (1,)), ((), ())))
    # dB = A^T g: contract A's rows (a's columns when trans_a) with g's rows.
    db = _bf16_product(a, g, (((1,) if trans_a else (0,), (0,)), ((), ())))
    return (da.T if trans_a else da), (db.T if trans_b else db)


_bf16_dot.defvjp(_bf16_dot_fwd, _bf16_dot_bwd)


def _masked(keep: jax.Array, x: jax.Array) -> jax.Array:
    """`x` where `keep`, else 0, in x's dtype. A literal 0.0 would be a float64 constant under
    `jax_enable_x64`, which Mosaic TPU rejects (its layouts take at most 32-bit types)."""
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


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
    diag = _masked(in_block, lower)
    x = jnp.broadcast_to((row == col).astype(lower.dtype), lower.shape)
    row_in, col_in = lax.rem(row, jnp.int32(blk)), lax.rem(col, jnp.int32(blk))
    for j in range(blk - 1):
        l_j = jnp.sum(_masked(col_in == j, diag), axis=-1, keepdims=True)  # [..., C, 1]
        x_j = jnp.sum(_masked(row_in == j, x), axis=-2, keepdims=True)  # [..., 1, C]
        x = x - _masked(in_block, l_j * x_j)
    size = blk
    while size < c:
        pair = block_of(row, 2 * size) == block_of(col, 2 * size)
        off = _masked(pair & (block_of(row, size) != block_of(col, size)), lower)
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
    operands: jnp.dtype = jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """One chunk: `(o: [C, V], next_state: [K, V])`, all float32.

    Args:
      state: `[K, V]` incoming state.
      q, k: `[C, K]` (q pre-scaled); v: `[C, V]`.
      gamma_col, gamma_row: `[C, 1]`, `[1, C]` chunk-local inclusive cumsum of the log-gate.
      beta_col: `[C, 1]`.
      seg_col, seg_row: `[C, 1]`, `[1, C]` chunk-local segment counters (0 = the state's segment).
      operands: the matmul operand dtype. float32: every product at full precision. bfloat16
        (the kernels' choice for bf16 inputs): six of the eight products take bf16 operands
        with float32 accumulation (`k k^T` and `q k^T` are then exact, k and q being bf16
        already; `w`, `S`, `v_new` and the intra-chunk scores are rounded); `u = A (beta v)`,
        the state update `k^T v_new`, the triangular inverse and the state stay float32.
        Measured on identical keys with strong gates (`tests/ops/trained_like.py`), all eight in
        bf16 left the gate gradient at 3.9x the float32 form's error (relative RMS 5.9e-2
        against 1.5e-2: `u` and the state update carry the delta rule's cancellation,
        `v_new = u - w S`); with these two in float32 it is 1.54e-2.
    """
    c = q.shape[0]
    causal = _iota(c, 0) >= _iota(c, 1)
    mask = causal & (seg_col == seg_row)
    # exp only where masked in: gamma_i - gamma_j >= 0 elsewhere can overflow.
    gamma_ij = _masked(mask, jnp.exp(_masked(mask, gamma_col - gamma_row)))
    lower = _masked(
        _iota(c, 0) > _iota(c, 1), beta_col * _dot(k, k, operands, trans_b=True) * gamma_ij
    )
    inverse = unit_lower_inverse(lower)
    from_state = _masked(seg_col == 0, jnp.exp(gamma_col))  # [C, 1]
    # u and the state update stay float32 whatever `operands` is (see chunk_step's docstring).
    u = _dot(inverse, beta_col * v, jnp.float32)
    w = _dot(inverse, (beta_col * from_state) * k, operands)
    v_new = u - _dot(w, state, operands)
    qk = _dot(q, k, operands, trans_b=True) * gamma_ij
    o = _dot(q * from_state, state, operands) + _dot(qk, v_new, operands)
    # The last token's values as [1, 1] by a masked sum, not a slice at an unaligned sublane.
    is_last = lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1
    gamma_last = jnp.sum(_masked(is_last, gamma_col), axis=0, keepdims=True)
    seg_last = jnp.sum(_masked(is_last, seg_col), axis=0, keepdims=True)
    keep = _masked(seg_last == 0, jnp.exp(gamma_last))
    to_end = _masked(seg_col == seg_last, jnp.exp(gamma_last - gamma_col))  # [C, 1]
    return o, keep * state + _dot(k * to_end, v_new, jnp.float32, trans_a=True)
