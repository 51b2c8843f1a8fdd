"""Mosaic GPU (Hopper) kernels of the chunked gated delta rule, forward and backward.

Grid `(B, H, V / 64)`: one warpgroup per (batch, head, block of 64 value columns) walks the chunks
in order (forward) or in reverse (backward), keeping the float32 `[K, 64]` state (or the
transposed state cotangent) in registers. The value columns of the state evolve independently
given k, beta and gamma, so the blocks need no communication; the backward's sums over value
columns (dq, dk, dgamma, dbeta) are added over the blocks afterwards in XLA. Chunk inputs arrive
by TMA; the forward loads chunk n + 1 while it computes chunk n (two buffer slots) except for
float32 with K = 128, where shared memory only holds one.

Every matmul is `plgpu.wgmma` on bfloat16 operands staged in shared memory with float32
accumulation. float32 values are split as `x = hi + lo` (two bfloat16 parts, ~17 significant
bits) and multiplied as `hi hi' + hi lo' + lo hi'` (the lo lo' term, ~2^-18 relative, is
dropped): float32 inputs get this for every product, bfloat16 inputs for the products with the
state and its cotangent only (other intermediates, such as v_new, w and the triangular inverse,
are rounded to bfloat16 for the tensor cores, as the peers do). Operands are never transposed on
chip: the transposed copies the products need (`k^T`; in the backward also `q^T`, `v^T`, `dO^T`)
are made by XLA before the call, and the backward computes some quantities transposed (`dq^T`,
part of `dk^T`, `dv^T`, the state cotangent `dS^T`), written as bfloat16 `hi (+ lo)` parts and
turned back by XLA. This keeps the kernels runnable in the Mosaic GPU interpret mode, which
supports neither transposed refs nor wgmma operands in registers, nor float32 (tf32) wgmma,
which needs transposed refs.

Argument layout: the kernel contract in README.md. Per chunk (`i, j` token indices, `S: [K, V]`):

    Gamma_ij = exp(gamma_i - gamma_j) [i >= j, seg_i == seg_j],   a_i = exp(gamma_i) [seg_i == 0]
    b_i = exp(gamma_last - gamma_i) [seg_i == seg_last],   d = exp(gamma_last) [seg_last == 0]
    L = strict_lower(diag(beta) (k k^T * Gamma)),          A = (I + L)^{-1}
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
# Interpret mode checks: race detection, uninitialized memory filled with NaN (read = test failure).
INTERPRET_PARAMS = InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
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


def _split_hi_lo(x: jax.Array, with_lo: bool):
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
        """The float32 value `hi (+ lo)` in registers (WGMMA layout)."""
        x = self.hi[...].astype(jnp.float32)
        return x if self.lo is None else x + self.lo[...].astype(jnp.float32)

    def put(self, x: jax.Array) -> None:
        """Store the float32 register value `x` as `hi (+ lo)`."""
        hi, lo = _split_hi_lo(x, self.lo is not None)
        self.hi[...] = hi
        if lo is not None:
            self.lo[...] = lo

    @property
    def refs(self):
        return (self.hi,) if self.lo is None else (self.hi, self.lo)

    def at(self, *index) -> "_Operand":
        """The operand in a slice of the buffers, e.g. one slot of a `[slots, M, N]` pair."""
        return _Operand(*(None if r is None else r.at[index] for r in (self.hi, self.lo)))


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
    `[C, C]` operands."""
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
        raise ValueError(f"q, k: [B, H, T, K], v: [B, H, T, V]; got {q.shape}, {v.shape}")
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
    return INTERPRET_PARAMS if interpret else None


def _split_inputs(arrays, with_lo):
    """Flat `(hi, lo, hi, lo, ...)` bfloat16 arrays (lo omitted when not `with_lo`)."""
    flat = []
    for x in arrays:
        hi, lo = _split_hi_lo(x, with_lo)
        flat += [hi] if lo is None else [hi, lo]
    return flat


def _take(refs, count):
    return refs[:count], refs[count:]


# ------------------------------------------------------------------------------------ forward


def _forward_kernel(*refs, n_chunks, dk, with_lo, save_states, slots, interpret):
    """One (batch, head, value block): the chunks in order, `S: [K, BV]` float32 in registers.

    Per chunk (module docstring): `k k^T` and `q k^T` -> `L` -> `A` (blocked inverse) -> `u`, `w`
    -> `v_new = u - w S` -> `o = (a q) S + ((q k^T) * Gamma) v_new` -> `S' = d S + (b k)^T v_new`,
    with the row scalings (beta, a, b) applied in registers before the operands are stored.
    """
    c, bv = CHUNK, BLOCK_V
    lay = _Layouts(interpret)
    per = 2 if with_lo else 1
    parts, refs = _take(refs, 4 * per)
    q_g, k_g, kt_g, v_g = (parts[i : i + per] for i in range(0, 4 * per, per))
    (gamma_g, beta_g, seg_g, h0_g, o_g, hf_g), refs = _take(refs, 6)
    (states_g,), refs = _take(refs, 1) if save_states else ((None,), refs)
    inputs, refs = _take(refs, 7)  # q k k^T v gamma beta seg, each [slots, ...]
    s_op, a_op, scores_op, third = (None if p is None else _Operand(*p) for p in refs[:4])
    state_s, o_s, loads, h0_bar = refs[4:]
    if third is None:  # float32 inputs: shared memory is short, borrow the state operand
        third = s_op.at(pl.ds(0, c))
    if o_s is None:  # float32 output: stage it in the (then idle) state buffer
        o_s = state_s.at[pl.ds(0, c)]

    b, h, vb = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("vb")
    cols = pl.ds(vb * bv, bv)

    def load(n, slot):
        """Start the copies of chunk `n` into buffer slot `slot`."""
        rows = pl.ds(n * c, c)
        q_s, k_s, kt_s, v_s = (_Operand(*x).at(slot).refs for x in inputs[:4])
        gamma_s, beta_s, seg_s = (x.at[slot] for x in inputs[4:])
        copies = [
            *((src.at[b, h, rows], dst) for src, dst in zip(q_g, q_s, strict=True)),
            *((src.at[b, h, rows], dst) for src, dst in zip(k_g, k_s, strict=True)),
            *((src.at[b, h, :, rows], dst) for src, dst in zip(kt_g, kt_s, strict=True)),
            *((src.at[b, h, rows, cols], dst) for src, dst in zip(v_g, v_s, strict=True)),
            (gamma_g.at[b, h, n], gamma_s),
            (beta_g.at[b, h, n], beta_s),
            (seg_g.at[b, n], seg_s),
        ]
        for src, dst in copies:
            plgpu.copy_gmem_to_smem(src, dst, loads.at[slot])

    plgpu.copy_gmem_to_smem(h0_g.at[b, h, :, cols], state_s, h0_bar)
    if slots == 2:
        load(0, 0)
    plgpu.barrier_wait(h0_bar)

    def step(n, state):
        rows = pl.ds(n * c, c)
        plgpu.commit_smem()  # register writes to the buffers -> ordered before the copies
        if slots == 2:  # prefetch the next chunk into the other slot (free since chunk n - 1)
            slot = lax.rem(n, 2)
            pl.when(n + 1 < n_chunks)(lambda: load(n + 1, 1 - slot))
        else:
            slot = 0
            load(n, slot)
        if save_states:
            state_s[...] = state
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(state_s, states_g.at[b, h, n, :, cols])
        plgpu.barrier_wait(loads.at[slot])
        q_op, k_op, kt_op, v_op = (_Operand(*x).at(slot) for x in inputs[:4])
        gamma_s, beta_s, seg_s = (x.at[slot] for x in inputs[4:])

        gates = _Gates.load(lay, gamma_s, beta_s, seg_s)
        decay = gates.decay()
        kk = _matmul(k_op, kt_op)
        scores = _matmul(q_op, kt_op) * decay  # (q k^T) * Gamma
        inverse = _unit_lower_inverse(
            gates.lower(kk, decay), gates.ii, gates.jj, (a_op, scores_op, third)
        )
        a_row = gates.from_state(gates.gamma_row, gates.seg_row)

        a_op.put(inverse)
        v_op.put(_rows(gates.beta_row, bv) * v_op.load())  # beta v
        u = _matmul(a_op, v_op)
        k_op.put(_rows(gates.beta_row * a_row, dk) * k_op.load())  # beta a k
        k_op.put(_matmul(a_op, k_op))  # w
        s_op.put(state)
        v_new = u - _matmul(k_op, s_op)
        q_op.put(_rows(a_row, dk) * q_op.load())  # a q
        scores_op.put(scores)
        v_op.put(v_new)
        o = _matmul(q_op, s_op) + _matmul(scores_op, v_op)

        b_col = gates.to_end(gates.gamma_col, gates.seg_col)
        kt_op.put(kt_op.load() * _cols(b_col, dk))  # (b k)^T
        state = gates.keep() * state + _matmul(kt_op, v_op)

        if save_states and o_s.dtype == jnp.float32:  # o_s is state_s: wait for its copy
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
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
    # Two buffer slots (the next chunk loads during this one) unless shared memory is short.
    slots = 1 if with_lo and dk > 64 else 2
    scratch = [
        _operand_types((slots, c, dk), with_lo),  # q
        _operand_types((slots, c, dk), with_lo),  # k
        _operand_types((slots, dk, c), with_lo),  # k^T
        _operand_types((slots, c, BLOCK_V), with_lo),  # v
        plgpu.SMEM((slots, c), f32),  # gamma
        plgpu.SMEM((slots, c), f32),  # beta
        plgpu.SMEM((slots, c), f32),  # seg
        _operand_types((dk, BLOCK_V), True),  # S
        _operand_types((c, c), with_lo),  # inverse
        _operand_types((c, c), with_lo),  # scores
        None if with_lo else _operand_types((c, c), with_lo),  # third [C, C] (else in S)
        _smem((dk, BLOCK_V), f32),  # state staging
        None if v.dtype == f32 else _smem((c, BLOCK_V), v.dtype),  # o staging (else in state)
        plgpu.Barrier(num_arrivals=n_loads, num_barriers=slots),
        plgpu.Barrier(num_arrivals=1),
    ]
    kernel = functools.partial(
        _forward_kernel,
        n_chunks=n,
        dk=dk,
        with_lo=with_lo,
        save_states=save_states,
        slots=slots,
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


# ----------------------------------------------------------------------------------- backward


def _backward_kernel(*refs, n_chunks, dk, with_lo, interpret):
    """One (batch, head, value block): chunks in reverse with `Z = dS'^T: [BV, K]` in registers.

    With the per-chunk quantities of the module docstring, `dO` the output cotangent and `Z` the
    transposed cotangent of `S'` (transposed quantities are computed as such, never transposed):

        dv_new^T = dO^T P + (Z k^T) diag(b)              dP^T = v_new dO^T
        dq^T     = (S dO^T) diag(a) + k^T (dP^T * Gamma^T)
        x^T      = dv_new^T A,   dv^T = x^T diag(beta),   y = beta v - (beta a k) S
        dA^T     = y dv_new^T,   dL^T = -A dA^T A,   Q = strict_upper(dL^T * Gamma^T) diag(beta)
        dk       = (dP^T * Gamma^T) q + diag(b) v_new Z + Q k
        dk^T    += diag(beta a)-scaled columns of (-S x^T) + k^T Q
        Z_prev   = d Z + (dO^T diag(a)) q - dv_new^T w
    dgamma and dbeta collect the row and column sums of the elementwise terms (comments below).
    """
    c, bv = CHUNK, BLOCK_V
    lay = _Layouts(interpret)
    per = 2 if with_lo else 1
    parts, refs = _take(refs, 7 * per + 4)
    groups = [parts[i : i + per] for i in range(0, 7 * per, per)]
    q_g, k_g, qt_g, kt_g, v_g, vt_g, dot_g = groups
    s_g = parts[7 * per : 7 * per + 2]
    zf_g = parts[7 * per + 2 :]
    (gamma_g, beta_g, seg_g), refs = _take(refs, 3)
    outs, refs = _take(refs, 4 * per + 4)
    dqt_g, dkt_g, dk_g, dvt_g = (outs[i : i + per] for i in range(0, 4 * per, per))
    dgamma_g, dbeta_g, *dh0t_g = outs[4 * per :]
    ops, refs = _take(refs, 13)
    x1, x2, x3, y1, y2, v1, u1, u3, s1, z1, m1, m2, m3 = (_Operand(*pair) for pair in ops)
    gamma_s, beta_s, seg_s, vec_s, dgamma_s, dbeta_s, loads, vt_bar, z_bar = refs

    b, h, vb = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("vb")
    cols = pl.ds(vb * bv, bv)
    for src, dst in zip(zf_g, z1.refs, strict=True):
        plgpu.copy_gmem_to_smem(src.at[b, h, cols], dst, z_bar)
    plgpu.barrier_wait(z_bar)

    def store(op: _Operand, x, dsts):
        """Stage `x` (float32) in `op` as hi (+ lo) and copy the parts to `dsts`."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        op.put(x)
        plgpu.commit_smem()
        for src, dst in zip(op.refs, dsts, strict=True):
            plgpu.copy_smem_to_gmem(src, dst)

    def step(i, z):
        n = n_chunks - 1 - i
        rows = pl.ds(n * c, c)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.commit_smem()
        copies = [
            *((src.at[b, h, rows], dst) for src, dst in zip(q_g, x1.refs, strict=True)),
            *((src.at[b, h, rows], dst) for src, dst in zip(k_g, x2.refs, strict=True)),
            *((src.at[b, h, :, rows], dst) for src, dst in zip(kt_g, y1.refs, strict=True)),
            *((src.at[b, h, :, rows], dst) for src, dst in zip(qt_g, y2.refs, strict=True)),
            *((src.at[b, h, rows, cols], dst) for src, dst in zip(v_g, v1.refs, strict=True)),
            *((src.at[b, h, cols, rows], dst) for src, dst in zip(dot_g, u1.refs, strict=True)),
            *((src.at[b, h, n, :, cols], dst) for src, dst in zip(s_g, s1.refs, strict=True)),
            (gamma_g.at[b, h, n], gamma_s),
            (beta_g.at[b, h, n], beta_s),
            (seg_g.at[b, n], seg_s),
        ]
        for src, dst in copies:
            plgpu.copy_gmem_to_smem(src, dst, loads)
        plgpu.barrier_wait(loads)

        gates = _Gates.load(lay, gamma_s, beta_s, seg_s)
        ii, jj = gates.ii, gates.jj
        decay, decay_t = gates.decay(), gates.decay_t()
        a_row = gates.from_state(gates.gamma_row, gates.seg_row)
        a_col = gates.from_state(gates.gamma_col, gates.seg_col)
        b_row = gates.to_end(gates.gamma_row, gates.seg_row)
        b_col = gates.to_end(gates.gamma_col, gates.seg_col)
        keep = gates.keep()

        # Recompute the chunk: P, A, u, w, v_new, y.
        m1.put(_matmul(x1, y1) * decay)  # P = (q k^T) * Gamma
        dvn_t = _matmul(u1, m1)  # dO^T P, the first term of dv_new^T
        lower = gates.lower(_matmul(x2, y1), decay)
        m3.put(_unit_lower_inverse(lower, ii, jj, (m1, m2, m3)))  # A, kept in m3
        v1.put(_rows(gates.beta_row, bv) * v1.load())  # beta v
        u = _matmul(m3, v1)
        x3.put(_rows(gates.beta_row * a_row, dk) * x2.load())  # beta a k
        y = v1.load() - _matmul(x3, s1)
        x3.put(_matmul(m3, x3))  # w, kept in x3
        v_new = u - _matmul(x3, s1)

        # dv_new^T = dO^T P + (Z k^T) diag(b); dP^T = v_new dO^T.
        z1.put(z)
        dvn_t = dvn_t + _matmul(z1, y1) * _cols(b_col, bv)
        v1.put(v_new)
        dp_t = _matmul(v1, u1)
        # P_ij = (q k^T)_ij Gamma_ij: dgamma_i += sum_j dP_ij P_ij, dgamma_j -= the same, i.e.
        # + column sums and - row sums of dP^T * P^T.
        e_t = dp_t * _matmul(x2, y2) * decay_t
        dgamma_col = e_t.sum(axis=0)
        dgamma_row = -e_t.sum(axis=1)

        # dq^T = (S dO^T) diag(a) + k^T (dP^T * Gamma^T); da_i = sum_k q_ik (dO S^T)_ik.
        s_do = _matmul(s1, u1)
        da = (y2.load() * s_do).sum(axis=0)
        dgamma_col = dgamma_col + a_col * da
        m1.put(dp_t * decay_t)
        dq_t = s_do * _cols(a_col, dk) + _matmul(y1, m1)
        store(y2, dq_t, [g.at[b, h, vb, :, rows] for g in dqt_g])

        # dk (rows) from P and from S' = d S + (b k)^T v_new; db_i = sum_k k_ik (v_new Z)_ik.
        vn_z = _matmul(v1, z1)
        db = (x2.load() * vn_z).sum(axis=1)
        dgamma_row = dgamma_row - b_row * db
        last = _total(b_row * db) + keep * _trace(_matmul(s1, z1), lay)
        dk_rows = _matmul(m1, x1) + _rows(b_row, dk) * vn_z

        # Z_prev = d Z + (dO^T diag(a)) q - dv_new^T w.
        u1.put(u1.load() * _cols(a_col, bv))
        u3.put(dvn_t)
        z = keep * z + _matmul(u1, x1) - _matmul(u3, x3)

        # x^T = dv_new^T A, dv^T = x^T diag(beta), dA^T = y dv_new^T.
        x_t = _matmul(u3, m3)
        store(u1, x_t * _cols(gates.beta_col, bv), [g.at[b, h, cols, rows] for g in dvt_g])
        v1.put(y)
        da_t = _matmul(v1, u3)
        for src, dst in zip(vt_g, u3.refs, strict=True):
            plgpu.copy_gmem_to_smem(src.at[b, h, cols, rows], dst, vt_bar)
        plgpu.barrier_wait(vt_bar)
        dbeta = (u3.load() * x_t).sum(axis=0)  # d(beta v) = x: dbeta_i += sum_v v_iv x_iv

        # d(beta a k) = -x S^T, as its transpose -S x^T.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        u1.put(x_t)
        dkw_t = -_matmul(s1, u1)
        dk_cols = dkw_t * _cols(gates.beta_col * a_col, dk)
        kdk = (y1.load() * dkw_t).sum(axis=0)
        dbeta = dbeta + a_col * kdk
        dgamma_col = dgamma_col + gates.beta_col * a_col * kdk

        # dL^T = -A dA^T A on the strict upper triangle; L_ij = beta_i KK_ij Gamma_ij (i > j).
        m2.put(da_t)
        m2.put(_matmul(m3, m2))
        dl_t = jnp.where(ii < jj, -_matmul(m2, m3) * decay_t, 0.0)
        kk = _matmul(x2, y1)
        dbeta = dbeta + (dl_t * kk).sum(axis=0)
        q_mat = dl_t * _cols(gates.beta_col, c)  # dKK = Q^T
        f_t = q_mat * kk  # F^T, F_ij = dL_ij L_ij: dgamma_i += sum_j F_ij - sum_j F_ji
        dgamma_col = dgamma_col + f_t.sum(axis=0)
        dgamma_row = dgamma_row - f_t.sum(axis=1)
        m1.put(q_mat)
        dk_rows = dk_rows + _matmul(m1, x2)
        dk_cols = dk_cols + _matmul(y1, m1)
        store(x1, dk_rows, [g.at[b, h, vb, rows] for g in dk_g])
        store(y2, dk_cols, [g.at[b, h, vb, :, rows] for g in dkt_g])

        # The row-layout part of dgamma joins the column layout through shared memory.
        vec_s[...] = dgamma_row
        last_col = jnp.where(lay.cast(lax.iota(jnp.int32, c), _COL) == c - 1, last, 0.0)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        dgamma_s[...] = dgamma_col + lay.col(vec_s) + last_col
        dbeta_s[...] = dbeta
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dgamma_s, dgamma_g.at[b, h, vb, n])
        plgpu.copy_smem_to_gmem(dbeta_s, dbeta_g.at[b, h, vb, n])
        return z

    z = lax.fori_loop(0, n_chunks, step, z1.load())
    store(z1, z, [g.at[b, h, cols] for g in dh0t_g])
    plgpu.wait_smem_to_gmem(0)


def _trace(x, lay: _Layouts):
    """`sum_i x_ii` of a square `x`."""
    n = x.shape[0]
    return _total(jnp.where(lay.iota((n, n), 0) == lay.iota((n, n), 1), x, 0.0).sum(axis=1))


def _total(x):
    """Sum of a `[C]` vector (Mosaic GPU reduces one axis at a time)."""
    return x.sum(axis=0)


def _join(parts):
    """Sum of the float32 values of the bfloat16 parts `hi (+ lo)`."""
    return functools.reduce(jnp.add, (p.astype(jnp.float32) for p in parts))


def backward(q, k, v, gamma, beta, seg, states, do, dh_final, *, chunk_size, interpret):
    """Backward kernel of the contract (README.md).

    Args:
      q, k, v, gamma, beta, seg: as `forward`; states: `[B, H, N, K, V]` float32 from `forward`
      with `save_states`; do: `[B, H, T_pad, V]` (rounded to q's dtype: the kernel reads it as
      bfloat16 parts like q/k/v); dh_final: `[B, H, K, V]` float32.
    Returns:
      `(dq, dk: [B, H, T_pad, K], dv: [B, H, T_pad, V], dgamma, dbeta: [B, H, N, C], dh0:
      [B, H, K, V])`, all float32 (dq with respect to the pre-scaled q).
    """
    b, h, n, dk, dv = _check(q, k, v, gamma, beta, seg, chunk_size)
    if states.shape != (b, h, n, dk, dv) or dh_final.shape != (b, h, dk, dv):
        raise ValueError(f"states: [B, H, N, K, V], dh_final: [B, H, K, V]; got {states.shape}")
    if do.shape != v.shape:
        raise ValueError(f"do: [B, H, T_pad, V] = {v.shape}, got {do.shape}")
    with_lo = q.dtype == jnp.float32
    if with_lo and dk > 64:
        raise NotImplementedError(
            "float32 q/k/v with K > 64: the backward's split operands exceed the 227 KiB of "
            "shared memory; use bfloat16 inputs or impl='chunked'"
        )
    c, t, nv = chunk_size, q.shape[2], dv // BLOCK_V
    f32, dtype = jnp.float32, q.dtype
    tr = functools.partial(jnp.swapaxes, axis1=-1, axis2=-2)
    operands = _split_inputs((q, k, tr(q), tr(k), v, tr(v), tr(do.astype(dtype))), with_lo)
    operands += _split_inputs((states,), True)
    operands += _split_inputs((tr(dh_final),), True)
    operands += [gamma.astype(f32), beta.astype(f32), seg.astype(f32)]
    per = 2 if with_lo else 1

    def parts(shape):
        return [jax.ShapeDtypeStruct(shape, OPERAND)] * per

    out_type = [
        *parts((b, h, nv, dk, t)),  # dq^T
        *parts((b, h, nv, dk, t)),  # dk^T (column-side terms)
        *parts((b, h, nv, t, dk)),  # dk (row-side terms)
        *parts((b, h, dv, t)),  # dv^T
        jax.ShapeDtypeStruct((b, h, nv, n, c), f32),  # dgamma
        jax.ShapeDtypeStruct((b, h, nv, n, c), f32),  # dbeta
        *[jax.ShapeDtypeStruct((b, h, dv, dk), OPERAND)] * 2,  # dh0^T
    ]
    bv = BLOCK_V
    scratch = [
        _operand_types((c, dk), with_lo),  # x1: q, then dk staging
        _operand_types((c, dk), with_lo),  # x2: k
        _operand_types((c, dk), with_lo),  # x3: beta a k, then w
        _operand_types((dk, c), with_lo),  # y1: k^T
        _operand_types((dk, c), with_lo),  # y2: q^T, then dq^T / dk^T staging
        _operand_types((c, bv), with_lo),  # v1: v, beta v, v_new, y
        _operand_types((bv, c), with_lo),  # u1: dO^T, dO^T diag(a), dv^T staging, x^T
        _operand_types((bv, c), with_lo),  # u3: dv_new^T, then v^T
        _operand_types((dk, bv), True),  # s1: S
        _operand_types((bv, dk), True),  # z1: Z = dS'^T
        *(_operand_types((c, c), with_lo) for _ in range(3)),  # m1..m3: [C, C]
        *(plgpu.SMEM((c,), f32) for _ in range(6)),  # gamma beta seg, vec, dgamma dbeta
        plgpu.Barrier(num_arrivals=6 * per + 5),  # q k k^T q^T v dO^T (S: 2 parts), 3 vectors
        plgpu.Barrier(num_arrivals=per),
        plgpu.Barrier(num_arrivals=2),
    ]
    kernel = functools.partial(
        _backward_kernel, n_chunks=n, dk=dk, with_lo=with_lo, interpret=interpret
    )
    outs = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(b, h, nv),
        grid_names=("b", "h", "vb"),
        interpret=_interpret_params(interpret),
    )(*operands)
    dq_t, dk_t, dk_r, dv_t = (outs[i : i + per] for i in range(0, 4 * per, per))
    dgamma, dbeta, *dh0_t = outs[4 * per :]
    dq = tr(_join(dq_t).sum(axis=2))
    dk_out = _join(dk_r).sum(axis=2) + tr(_join(dk_t).sum(axis=2))
    return (
        dq,
        dk_out,
        tr(_join(dv_t)),
        dgamma.sum(axis=2),
        dbeta.sum(axis=2),
        tr(_join(dh0_t)),
    )
