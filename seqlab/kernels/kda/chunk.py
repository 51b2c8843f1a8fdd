"""One chunk of Kimi Delta Attention (KDA) on 2-D float32 values, the body of the TPU kernels.

KDA is the gated delta rule with a per-key-channel decay: `S_t = Diag(exp(g_t)) S_{t-1}`,
`S_t += k_t (beta_t (v_t - S_t^T k_t))^T`, `o_t = S_t^T q_t`. Written for Mosaic TPU: only 2-D
arrays, matmuls, `exp`, `where`, iota masks, reductions and sublane rolls (`pltpu.roll`). With
the incoming state `S: [K, V]`, the chunk-local inclusive cumsum `gamma: [C, K]` of the
log-gates (per channel), the segment counter `seg` (the kernel contract in README.md) and token
indices `i, j` of the chunk, `M_ij = (i >= j and seg_i == seg_j)`:

    P_ij  = beta_i sum_c k_ic k_jc exp(gamma_ic - gamma_jc)   (i > j, M_ij)   A = (I + P)^{-1}
    Q_ij  = sum_c q_ic k_jc exp(gamma_ic - gamma_jc)          (i >= j, M_ij)
    u     = A (beta v),   w = A (beta exp(gamma) [seg == 0] k)
    v_new = u - w S
    o     = (q exp(gamma) [seg == 0]) S + Q v_new
    S'    = Diag(exp(gamma_last) [seg_last == 0]) S
            + (k exp(gamma_last - gamma) [seg == seg_last])^T v_new

The per-channel factor `exp(gamma_ic - gamma_jc)` does not split into `exp(gamma_i) exp(-gamma_j)`
(cumulative log-gates reach -1e4 within a chunk: the second factor overflows). `intra_scores`
computes `Q` and `P` in sub-chunks of 16 tokens: across sub-chunks through the first token `r` of
the later one, `exp(gamma_i - gamma_r) exp(gamma_r - gamma_j)` (both exponents <= 0), and inside
a sub-chunk exactly per element, one diagonal offset at a time. Every exponent is masked to 0
before `exp` where it is not used, so no `inf` appears, in the values or in their gradients.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from seqlab.kernels.gated_delta.chunk import _dot, _masked, unit_lower_inverse

# Tokens per sub-chunk of the intra-chunk scores (the diagonal blocks computed per element).
SUB_CHUNK = 16


def _iota(shape: tuple[int, int], axis: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, shape, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _roll_rows(x: jax.Array, shift: int) -> jax.Array:
    """`jnp.roll(x, shift, axis=0)` (row `i` of the result is row `i - shift` of `x`, wrapping)
    as a Mosaic sublane rotation, for 2-D `x` and `0 < shift < rows`. The shift is an int32
    constant: a Python int is an int64 under `jax_enable_x64`, which Mosaic TPU rejects."""
    return pltpu.roll(x, np.int32(shift), 0)


def _roll_rows_fwd(x, shift):
    return _roll_rows(x, shift), None


def _roll_rows_bwd(shift, _, g):
    return (pltpu.roll(g, np.int32(g.shape[0] - shift), 0),)


_roll_rows.defvjp(_roll_rows_fwd, _roll_rows_bwd)


def intra_scores(
    lefts: tuple[jax.Array, ...], k: jax.Array, gamma: jax.Array, operands: jnp.dtype
) -> list[jax.Array]:
    """`X_ij = sum_c a_ic k_jc exp(gamma_ic - gamma_jc)` for `j <= i`, 0 for `j > i`, per `a` in
    `lefts` (each `[C, K]`), all float32 `[C, C]`. `gamma: [C, K]` must be non-increasing down
    each column (a cumsum of log-gates <= 0); segments are not masked here.

    Sub-chunks of 16 tokens (`SUB_CHUNK`; C a multiple of it):
    * `i` in sub-chunk I > 0, `j` in an earlier one: with `r = 16 I`, `gamma_i <= gamma_r <=
      gamma_j`, so `X_ij = sum_c (a_ic e^{gamma_ic - gamma_rc}) (k_jc e^{gamma_rc - gamma_jc})`,
      one `[C, K] x [K, C]` product per sub-chunk, the left factor zero outside I's rows and the
      right one zero at `j >= r`. With `operands` bfloat16 the product takes bf16 operands.
    * `i, j` in the same sub-chunk: for each offset `p = i - j` in 0..15, the rows `k_{i-p}` and
      `gamma_{i-p}` are `k`, `gamma` rolled down by p rows, `d_i = sum_c a_ic k_{i-p,c}
      e^{gamma_ic - gamma_{i-p,c}}` (float32, exact per element) where `i mod 16 >= p`, placed at
      column `i - p`.
    Exponents where the factor is not used (`i` outside I, `j >= r`, `i mod 16 < p`) are set to
    0 before `exp` and the factor to 0 after it.
    """
    c, dk = k.shape
    ck, cc = (c, dk), (c, c)
    row_k = _iota(ck, 0)
    row_c, col_c = _iota(cc, 0), _iota(cc, 1)
    sub = jnp.int32(SUB_CHUNK)
    outs = [jnp.zeros(cc, jnp.float32) for _ in lefts]
    # Earlier sub-chunks through the first token r of the later one.
    for first in range(SUB_CHUNK, c, SUB_CHUNK):
        gamma_r = jnp.sum(_masked(row_k == first, gamma), axis=0, keepdims=True)  # [1, K]
        in_sub = lax.div(row_k, sub) == first // SUB_CHUNK
        before = row_k < first
        to_row = _masked(in_sub, jnp.exp(_masked(in_sub, gamma - gamma_r)))
        from_col = _masked(before, jnp.exp(_masked(before, gamma_r - gamma)))
        right = k * from_col
        for n, a in enumerate(lefts):
            outs[n] = outs[n] + _dot(a * to_row, right, operands, trans_b=True)
    # The diagonal blocks, exactly, one offset p = i - j at a time.
    pos = lax.rem(row_k, sub)
    for p in range(SUB_CHUNK):
        if p == 0:
            right = k
        else:
            valid = pos >= p
            gap = _masked(valid, gamma - _roll_rows(gamma, p))
            right = _masked(valid, _roll_rows(k, p) * jnp.exp(gap))
        at = col_c == row_c - p
        for n, a in enumerate(lefts):
            d = jnp.sum(a * right, axis=1, keepdims=True)  # [C, 1]
            outs[n] = outs[n] + _masked(at, jnp.broadcast_to(d, cc))
    return outs


def _row_to_column(x: jax.Array) -> jax.Array:
    """`[1, K] -> [K, 1]` without a transpose: the diagonal of the broadcast `[K, K]`, summed
    along lanes."""
    dk = x.shape[1]
    eye = _iota((dk, dk), 0) == _iota((dk, dk), 1)
    return jnp.sum(_masked(eye, jnp.broadcast_to(x, (dk, dk))), axis=1, keepdims=True)


def chunk_step(
    state: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    gamma: jax.Array,
    beta_col: jax.Array,
    seg_col: jax.Array,
    seg_row: jax.Array,
    operands: jnp.dtype = jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """One chunk: `(o: [C, V], next_state: [K, V])`, all float32.

    Args:
      state: `[K, V]` incoming state.
      q, k: `[C, K]` (q pre-scaled); v: `[C, V]`.
      gamma: `[C, K]` chunk-local inclusive cumsum of the log-gates, per key channel.
      beta_col: `[C, 1]`.
      seg_col, seg_row: `[C, 1]`, `[1, C]` chunk-local segment counters (0 = the state's segment).
      operands: the matmul operand dtype. float32: every product at full precision. bfloat16
        (the kernels' choice for bf16 inputs): the products of `intra_scores`, `w`, `w S`,
        `q S` and `Q v_new` take bf16 operands with float32 accumulation; `u = A (beta v)`, the
        state update `k^T v_new`, the inverse and the state stay float32 (the gated delta
        kernel's policy, `seqlab.kernels.gated_delta.chunk.chunk_step`: those two carry the
        delta rule's cancellation `v_new = u - w S`). The diagonal 16 x 16 blocks of the
        scores are elementwise float32 whatever `operands` is.
    """
    c, dk = k.shape
    f32 = jnp.float32
    row_c, col_c = _iota((c, c), 0), _iota((c, c), 1)
    same = seg_col == seg_row
    scores_q, scores_k = intra_scores((q, k), k, gamma, operands)
    attend = _masked((row_c >= col_c) & same, scores_q)
    lower = beta_col * _masked((row_c > col_c) & same, scores_k)
    inverse = unit_lower_inverse(lower)
    from_state_seg = jnp.broadcast_to(seg_col, (c, dk)) == 0
    # exp(gamma) of the state's segment: gamma <= 0, masked anyway as every exponent here.
    from_state = _masked(from_state_seg, jnp.exp(_masked(from_state_seg, gamma)))  # [C, K]
    u = _dot(inverse, beta_col * v, f32)
    w = _dot(inverse, beta_col * (from_state * k), operands)
    v_new = u - _dot(w, state, operands)
    o = _dot(q * from_state, state, operands) + _dot(attend, v_new, operands)
    # The last token's rows by a masked sum, not a slice at an unaligned sublane.
    last_k = _iota((c, dk), 0) == c - 1
    gamma_last = jnp.sum(_masked(last_k, gamma), axis=0, keepdims=True)  # [1, K]
    is_last = _iota((c, 1), 0) == c - 1
    seg_last = jnp.sum(_masked(is_last, seg_col), axis=0, keepdims=True)  # [1, 1]
    keeps = jnp.broadcast_to(seg_last, (1, dk)) == 0
    keep = _masked(keeps, jnp.exp(_masked(keeps, gamma_last)))  # [1, K]
    ends = jnp.broadcast_to(seg_col, (c, dk)) == jnp.broadcast_to(seg_last, (c, dk))
    to_end = _masked(ends, jnp.exp(_masked(ends, gamma_last - gamma)))  # [C, K]
    next_state = _row_to_column(keep) * state + _dot(k * to_end, v_new, f32, trans_a=True)
    return o, next_state
