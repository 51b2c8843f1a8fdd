"""Mosaic GPU (Hopper) kernels of the chunked gated delta rule, forward and backward.

Grid `(B, H, V / 64)`: one warpgroup per (batch, head, block of 64 value columns) walks the chunks
in order (forward) or in reverse (backward), keeping the float32 `[K, 64]` state (or the
transposed state cotangent) on chip. The value columns of the state evolve independently given
k, beta and gamma, so the blocks need no communication; the backward's sums over value columns
(dq, dk, dgamma, dbeta) are added over the blocks afterwards in XLA.

Every matmul is `plgpu.wgmma` on bfloat16 operands staged in shared memory with float32
accumulation. float32 values are split as `x = hi + lo` (two bfloat16 parts, ~17 significant
bits) and multiplied as `hi hi' + hi lo' + lo hi'` (the lo lo' term, ~2^-18 relative, is
dropped): float32 inputs get this for every product, bfloat16 inputs for the triangular inverse
only (the rest multiplies bfloat16 inputs, and the state in bfloat16, as the peers do). Operands
are never transposed on chip: the transposed copies the products need (`k^T`, `q^T`, `v^T`,
`do^T`, `S^T`) are made by XLA before the call, and the backward produces some gradients
transposed (`dq^T`, part of `dk^T`, `dv^T`, the state cotangent `dS^T`), turned back by XLA.
This keeps the kernels runnable in the Mosaic GPU interpret mode, which has no transposed refs.

Argument layout: the kernel contract in README.md. Per chunk (`i, j` token indices, `S: [K, V]`):

    Gamma_ij = exp(gamma_i - gamma_j) [i >= j, seg_i == seg_j],   a_i = exp(gamma_i) [seg_i == 0]
    b_i = exp(gamma_last - gamma_i) [seg_i == seg_last],          d = exp(gamma_last) [seg_last == 0]
    L = strict_lower(diag(beta) (k k^T * Gamma)),                 A = (I + L)^{-1}
    u = A (beta v),   w = A (beta a k),   v_new = u - w S
    o = (a q) S + ((q k^T) * Gamma) v_new,   S' = d S + (b k)^T v_new
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

try:  # public from jax 0.11
    InterpretGPUParams = plgpu.InterpretGPUParams
except AttributeError:  # jax 0.10
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

CHUNK = 64  # tokens per chunk: one wgmma M tile
BLOCK_V = 64  # value columns per program
HEAD_DIMS = (64, 128)  # supported K and V
INVERSE_BLOCK = 16  # diagonal blocks of the triangular inverse (as chunk.unit_lower_inverse)
OPERAND = jnp.bfloat16
_SWIZZLE = 128  # bytes; wgmma operands are tiled (8, 128 / itemsize) and swizzled
_WGMMA = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)  # [C] vector indexed by the row of a [C, *] tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # [C] vector indexed by the column of a [*, C] tile


def _smem(shape, dtype):
    """A tiled, swizzled shared-memory buffer: what wgmma, TMA and tiled loads expect."""
    tile = _SWIZZLE // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, tile)), plgpu.SwizzleTransform(_SWIZZLE))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _operand_types(shape, with_lo: bool):
    return (_smem(shape, OPERAND), _smem(shape, OPERAND) if with_lo else None)


def split_hi_lo(x: jax.Array, with_lo: bool):
    """`x` as bfloat16 `(hi, lo)` with `x ~ hi + lo`; `lo` is None when not `with_lo`."""
    hi = x.astype(OPERAND)
    if not with_lo:
        return hi, None
    return hi, (x.astype(jnp.float32) - hi.astype(jnp.float32)).astype(OPERAND)


@dataclasses.dataclass(frozen=True)
class _Operand:
    """A matmul operand in shared memory: bfloat16 `hi` and optional `lo` refs."""

    hi: Any
    lo: Any = None

    def load(self) -> jax.Array:
        x = self.hi[...].astype(jnp.float32)
        return x if self.lo is None else x + self.lo[...].astype(jnp.float32)

    def put(self, x: jax.Array) -> None:
        hi = x.astype(OPERAND)
        self.hi[...] = hi
        if self.lo is not None:
            self.lo[...] = (x - hi.astype(jnp.float32)).astype(OPERAND)

    @property
    def refs(self):
        return (self.hi,) if self.lo is None else (self.hi, self.lo)


def _matmul(a: _Operand, b: _Operand) -> jax.Array:
    """`a @ b` in float32 from split operands: `hi hi' (+ hi lo') (+ lo hi')`."""
    plgpu.commit_smem()  # register stores -> visible to the async proxy that wgmma reads with
    m, n = a.hi.shape[0], b.hi.shape[1]

    def body(acc):
        plgpu.wgmma(acc, a.hi, b.hi)
        if b.lo is not None:
            plgpu.wgmma(acc, a.hi, b.lo)
        if a.lo is not None:
            plgpu.wgmma(acc, a.lo, b.hi)
        return acc[...]

    return pl.run_scoped(body, plgpu.ACC((m, n), jnp.float32))


@dataclasses.dataclass(frozen=True)
class _Layouts:
    """Register layouts, or nothing in interpret mode (which has no layouts to cast to)."""

    interpret: bool

    def cast(self, x, layout):
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def iota(self, shape, axis):
        return self.cast(lax.broadcasted_iota(jnp.int32, shape, axis), _WGMMA)

    def row(self, ref):
        return self.cast(ref[...], _ROW)

    def col(self, ref):
        return self.cast(ref[...], _COL)

    def tile(self, ref):
        return self.cast(ref[...], _WGMMA)


def _rows(vec, n):
    """`[C]` (row layout) -> `[C, n]`, constant along each row."""
    return lax.broadcast_in_dim(vec, (vec.shape[0], n), [0])


def _cols(vec, m):
    """`[C]` (column layout) -> `[m, C]`, constant along each column."""
    return lax.broadcast_in_dim(vec, (m, vec.shape[0]), [1])


def _nilpotent_inverse(n, order, eye, power_op: _Operand, inverse_op: _Operand):
    """`(I + N)^{-1} = (I - N)(I + N^2)(I + N^4)...` for `N^order = 0`, `N: [C, C]` float32."""
    power = -n
    inverse = eye + power
    for _ in range(max(order - 1, 1).bit_length() - 1):
        power_op.put(power)
        power = _matmul(power_op, power_op)
        power_op.put(power)
        inverse_op.put(inverse)
        inverse = inverse + _matmul(inverse_op, power_op)
    return inverse


def _unit_lower_inverse(lower, ii, jj, scratch):
    """`(I + L)^{-1}` for strictly lower `L: [C, C]`, blocked as `chunk.unit_lower_inverse`:
    `I + L = D (I + M)`, `D` the identity plus the diagonal 16 x 16 blocks of `L`,
    `M = D^{-1} (L - blocks)`; both inverses by the nilpotent product. `scratch`: three
    `[C, C]` operands (with lo parts)."""
    c = lower.shape[0]
    one, other, third = scratch
    eye = jnp.where(ii == jj, 1.0, 0.0)
    size = jnp.int32(INVERSE_BLOCK)
    in_block = lax.div(ii, size) == lax.div(jj, size)
    d_inv = _nilpotent_inverse(jnp.where(in_block, lower, 0.0), INVERSE_BLOCK, eye, one, other)
    other.put(d_inv)
    one.put(jnp.where(in_block, 0.0, lower))
    m = _matmul(other, one)
    third.put(_nilpotent_inverse(m, c // INVERSE_BLOCK, eye, one, third))
    return _matmul(third, other)


@dataclasses.dataclass(frozen=True)
class _Gates:
    """Per-chunk gate quantities in registers, from the `[C]` gamma/beta/seg buffers."""

    gamma_row: Any
    gamma_col: Any
    beta_row: Any
    beta_col: Any
    seg_row: Any
    seg_col: Any
    gamma_last: Any  # scalar
    seg_last: Any  # scalar
    ii: Any  # [C, C] row index
    jj: Any  # [C, C] column index

    @classmethod
    def load(cls, lay: _Layouts, gamma_ref, beta_ref, seg_ref):
        c = gamma_ref.shape[0]
        return cls(
            gamma_row=lay.row(gamma_ref),
            gamma_col=lay.col(gamma_ref),
            beta_row=lay.row(beta_ref),
            beta_col=lay.col(beta_ref),
            seg_row=lay.row(seg_ref),
            seg_col=lay.col(seg_ref),
            gamma_last=gamma_ref[c - 1],
            seg_last=seg_ref[c - 1],
            ii=lay.iota((c, c), 0),
            jj=lay.iota((c, c), 1),
        )

    def decay(self):
        """`Gamma: [C, C]`, `Gamma_ij = exp(gamma_i - gamma_j)` for `i >= j` in one segment."""
        c = self.ii.shape[0]
        mask = (self.ii >= self.jj) & (_rows(self.seg_row, c) == _cols(self.seg_col, c))
        # exp only where masked in: gamma_i - gamma_j for i < j can overflow.
        diff = jnp.where(mask, _rows(self.gamma_row, c) - _cols(self.gamma_col, c), 0.0)
        return jnp.where(mask, jnp.exp(diff), 0.0)

    def decay_t(self):
        """`Gamma^T: [C, C]`, built directly (no transposes on chip)."""
        c = self.ii.shape[0]
        mask = (self.ii <= self.jj) & (_rows(self.seg_row, c) == _cols(self.seg_col, c))
        diff = jnp.where(mask, _cols(self.gamma_col, c) - _rows(self.gamma_row, c), 0.0)
        return jnp.where(mask, jnp.exp(diff), 0.0)

    def lower(self, kk, decay):
        """`L = strict_lower(diag(beta) (k k^T * Gamma))`."""
        c = self.ii.shape[0]
        return jnp.where(self.ii > self.jj, _rows(self.beta_row, c) * kk * decay, 0.0)

    def from_state(self, vec_gamma, vec_seg):
        """`a = exp(gamma) [seg == 0]` in the layout of the given vectors."""
        return jnp.where(vec_seg == 0.0, jnp.exp(vec_gamma), 0.0)

    def to_end(self, vec_gamma, vec_seg):
        """`b = exp(gamma_last - gamma) [seg == seg_last]`."""
        return jnp.where(vec_seg == self.seg_last, jnp.exp(self.gamma_last - vec_gamma), 0.0)

    def keep(self):
        """`d = exp(gamma_last) [seg_last == 0]` (scalar)."""
        return jnp.where(self.seg_last == 0.0, jnp.exp(self.gamma_last), 0.0)


def _check(q, k, v, gamma, beta, seg, chunk_size):
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    if chunk_size != CHUNK:
        raise NotImplementedError(f"chunk_size={chunk_size}: the GPU kernels use {CHUNK}")
    if dk not in HEAD_DIMS or dv not in HEAD_DIMS:
        raise NotImplementedError(f"K={dk}, V={dv}: the GPU kernels take K, V in {HEAD_DIMS}")
    if k.shape != q.shape or v.shape != (b, h, t, dv):
        raise ValueError(f"q, k: [B, H, T, K], v: [B, H, T, V]; got {q.shape}, {k.shape}, {v.shape}")
    if t % chunk_size:
        raise ValueError(f"T_pad={t} must be a multiple of chunk_size={chunk_size}")
    n = t // chunk_size
    if gamma.shape != (b, h, n, chunk_size) or beta.shape != gamma.shape:
        raise ValueError(f"gamma, beta: [B, H, N, C] = {(b, h, n, chunk_size)}")
    if seg.shape != (b, n, chunk_size):
        raise ValueError(f"seg: [B, N, C] = {(b, n, chunk_size)}, got {seg.shape}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (jnp.float32, jnp.bfloat16):
        raise NotImplementedError(f"q, k, v must share float32 or bfloat16, got {q.dtype}")
    return b, h, n, dk, dv


def _interpret_params(interpret: bool):
    return InterpretGPUParams() if interpret else None


def _split_inputs(arrays, with_lo):
    """Flat `(hi, lo, hi, lo, ...)` bfloat16 arrays (lo omitted when not `with_lo`)."""
    flat = []
    for x in arrays:
        hi, lo = split_hi_lo(x, with_lo)
        flat += [hi] if lo is None else [hi, lo]
    return flat


def _take(refs, count):
    return refs[:count], refs[count:]


# ------------------------------------------------------------------------------------ forward


def _forward_kernel(*refs, n_chunks, dk, with_lo, save_states, interpret):
    c, bv = CHUNK, BLOCK_V
    lay = _Layouts(interpret)
    per = 2 if with_lo else 1
    parts, refs = _take(refs, 4 * per)
    q_g, k_g, kt_g, v_g = (parts[i : i + per] for i in range(0, 4 * per, per))
    (gamma_g, beta_g, seg_g, h0_g, o_g, hf_g), refs = _take(refs, 6)
    (states_g,), refs = _take(refs, 1) if save_states else ((None,), refs)
    q_op, k_op, kt_op, v_op, s_op, *inverse_ops = (_Operand(*pair) for pair in refs[:8])
    gamma_s, beta_s, seg_s, state_s, o_s, loads, h0_bar = refs[8:]

    b, h, vb = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("vb")
    cols = pl.ds(vb * bv, bv)

    plgpu.copy_gmem_to_smem(h0_g.at[b, h, :, cols], state_s, h0_bar)
    plgpu.barrier_wait(h0_bar)

    def step(n, state):
        rows = pl.ds(n * c, c)
        plgpu.commit_smem()
        copies = [
            *((src.at[b, h, rows], dst) for src, dst in zip(q_g, q_op.refs, strict=True)),
            *((src.at[b, h, rows], dst) for src, dst in zip(k_g, k_op.refs, strict=True)),
            *((src.at[b, h, :, rows], dst) for src, dst in zip(kt_g, kt_op.refs, strict=True)),
            *((src.at[b, h, rows, cols], dst) for src, dst in zip(v_g, v_op.refs, strict=True)),
            (gamma_g.at[b, h, n], gamma_s),
            (beta_g.at[b, h, n], beta_s),
            (seg_g.at[b, n], seg_s),
        ]
        for src, dst in copies:
            plgpu.copy_gmem_to_smem(src, dst, loads)
        if save_states:
            state_s[...] = state
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(state_s, states_g.at[b, h, n, :, cols])
        plgpu.barrier_wait(loads)

        gates = _Gates.load(lay, gamma_s, beta_s, seg_s)
        decay = gates.decay()
        kk = _matmul(k_op, kt_op)
        scores = _matmul(q_op, kt_op) * decay  # (q k^T) * Gamma
        inverse = _unit_lower_inverse(gates.lower(kk, decay), gates.ii, gates.jj, inverse_ops)
        a_row = gates.from_state(gates.gamma_row, gates.seg_row)

        a_op = inverse_ops[0]
        a_op.put(inverse)
        v_op.put(_rows(gates.beta_row, bv) * v_op.load())  # beta v
        u = _matmul(a_op, v_op)
        k_op.put(_rows(gates.beta_row * a_row, dk) * k_op.load())  # beta a k
        k_op.put(_matmul(a_op, k_op))  # w
        s_op.put(state)
        v_new = u - _matmul(k_op, s_op)
        q_op.put(_rows(a_row, dk) * q_op.load())  # a q
        scores_op = inverse_ops[1]
        scores_op.put(scores)
        v_op.put(v_new)
        o = _matmul(q_op, s_op) + _matmul(scores_op, v_op)

        b_col = gates.to_end(gates.gamma_col, gates.seg_col)
        kt_op.put(kt_op.load() * _cols(b_col, dk))  # (b k)^T
        state = gates.keep() * state + _matmul(kt_op, v_op)

        o_s[...] = o.astype(o_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[b, h, rows, cols])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        return state

    state = lax.fori_loop(0, n_chunks, step, lay.tile(state_s))
    state_s[...] = state
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(state_s, hf_g.at[b, h, :, cols])
    plgpu.wait_smem_to_gmem(0)


def forward(q, k, v, gamma, beta, seg, h0, *, chunk_size, save_states, interpret):
    """Forward kernel of the contract (README.md): returns `(o, h_final, states or None)`.

    Args:
      q, k: `[B, H, T_pad, K]`, v: `[B, H, T_pad, V]`, float32 or bfloat16 (q pre-scaled).
      gamma, beta: `[B, H, N, C]` float32; seg: `[B, N, C]` float32; h0: `[B, H, K, V]` float32.
    Returns:
      `o: [B, H, T_pad, V]` in v.dtype, `h_final: [B, H, K, V]` float32, and
      `states: [B, H, N, K, V]` float32 (state at the start of each chunk) when `save_states`.
    """
    b, h, n, dk, dv = _check(q, k, v, gamma, beta, seg, chunk_size)
    if h0.shape != (b, h, dk, dv):
        raise ValueError(f"h0: [B, H, K, V] = {(b, h, dk, dv)}, got {h0.shape}")
    with_lo = q.dtype == jnp.float32
    c, t = chunk_size, q.shape[2]
    f32 = jnp.float32
    operands = _split_inputs((q, k, jnp.swapaxes(k, 2, 3), v), with_lo)
    out_type = [
        jax.ShapeDtypeStruct((b, h, t, dv), v.dtype),
        jax.ShapeDtypeStruct((b, h, dk, dv), f32),
    ]
    if save_states:
        out_type.append(jax.ShapeDtypeStruct((b, h, n, dk, dv), f32))
    n_loads = 4 * (2 if with_lo else 1) + 3
    scratch = [
        _operand_types((c, dk), with_lo),  # q
        _operand_types((c, dk), with_lo),  # k
        _operand_types((dk, c), with_lo),  # k^T
        _operand_types((c, BLOCK_V), with_lo),  # v
        _operand_types((dk, BLOCK_V), with_lo),  # S
        *(_operand_types((c, c), True) for _ in range(3)),  # inverse, scores
        plgpu.SMEM((c,), f32),  # gamma
        plgpu.SMEM((c,), f32),  # beta
        plgpu.SMEM((c,), f32),  # seg
        _smem((dk, BLOCK_V), f32),  # state staging
        _smem((c, BLOCK_V), v.dtype),  # o staging
        plgpu.Barrier(num_arrivals=n_loads),
        plgpu.Barrier(num_arrivals=1),
    ]
    kernel = functools.partial(
        _forward_kernel,
        n_chunks=n,
        dk=dk,
        with_lo=with_lo,
        save_states=save_states,
        interpret=interpret,
    )
    outs = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(b, h, dv // BLOCK_V),
        grid_names=("b", "h", "vb"),
        interpret=_interpret_params(interpret),
    )(*operands, gamma.astype(f32), beta.astype(f32), seg.astype(f32), h0.astype(f32))
    o, h_final = outs[:2]
    return o, h_final, outs[2] if save_states else None
