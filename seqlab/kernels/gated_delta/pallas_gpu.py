"""Mosaic GPU (Hopper) kernel of the state pass of the chunked gated delta rule.

Only the state passing is sequential in the chunked form; everything inside a chunk (`k k^T`,
the triangular inverse, `w`, `u`, the output's intra-chunk part) is chunk-parallel and runs
batched over all chunks in XLA (`seqlab.ops.gated_delta`). This kernel carries the state
through the chunks with two matmuls per chunk. Per (batch, head), with `S_0 = h0`:

    out_n     = x_n + a_n S_n                  a_n: [C, K],  x_n, out_n: [C, V]
    S_{n+1}   = d_n S_n + b_n out_n (+ y_n)    b_n: [K, C],  d_n scalar,  y_n: [K, V]

returning every `S_n` (the state entering chunk n), every `out_n` and `S_N`. The same kernel
run over the chunks in reverse is the backward of the forward pass (`vjp.state_scan`): the
forward uses `a = -w, b = k_end^T, x = u` (so `out = v_new`), the backward
`a = k_end, b = -w^T, x = dv_new, y = dS` with the state cotangent as its state.

Grid `(B, H, V / block_v)`: one warpgroup per (batch, head, value block) keeps the float32
`[K, block_v]` state in registers (value columns evolve independently). Chunk inputs arrive by
TMA into `slots` buffers, the next chunk loading while this one computes whenever shared memory
holds two. Every product is `plgpu.wgmma` on bfloat16 operands from shared memory with float32
accumulation; float32 values are split `x = hi + lo` (two bfloat16 parts, ~2^-16 relative) and
multiplied as `hi hi' + hi lo' + lo hi'`, so the state pass is float32-accurate. The register
values the products need (`S_n`, `out_n`) are written as `hi, lo` parts and those same buffers go
to HBM by TMA (XLA joins them), so saving states and outputs costs no extra shared memory.
Operands are never transposed on chip (XLA supplies `b` as `[K, C]`), which keeps the kernel
runnable in the Mosaic GPU interpret mode on CPU.

The kernel is written for Mosaic GPU's Lane lowering semantics (explicit register layouts),
requested explicitly: jax 0.11 made Warpgroup semantics (layout inference) the default.
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

OPERAND = jnp.bfloat16
HEAD_DIMS = (64, 128)  # supported K (V: any multiple of block_v); api.py pads others
BLOCK_VS = (64,)  # value columns per program
CHUNKS = (64, 128)  # tokens per chunk: multiples of the 64-row wgmma tile
SMEM_BYTES = 220 * 1024  # of the 227 KiB per block on sm_90, a margin for barriers
# Interpret mode checks: race detection, uninitialized memory filled with NaN (read = test failure).
INTERPRET_PARAMS = InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
COMPILER_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
DECAY_LANES = 32  # d_n travels as a [32] float32 row (128 bytes: one per thread of the warpgroup)
_SWIZZLE = 128  # bytes; wgmma operands are tiled (8, 128 / itemsize) and swizzled
_WGMMA = plgpu.Layout.WGMMA


def _smem(shape, dtype):
    """A tiled, swizzled shared-memory buffer: what wgmma, TMA and tiled loads expect."""
    tile = _SWIZZLE // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, tile)), plgpu.SwizzleTransform(_SWIZZLE))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 `x` as bfloat16 `(hi, lo)` with `x ~ hi + lo` (~2^-16 relative), in registers."""
    hi = x.astype(OPERAND)
    return hi, (x.astype(jnp.float32) - hi.astype(jnp.float32)).astype(OPERAND)


def split_in_xla(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`split` for the kernel's XLA-side inputs: `hi` is `x` with its low 16 bits cleared
    (truncated to bfloat16, exactly representable), `lo = x - hi` rounded (~2^-15 relative).

    Not `split`: XLA's GPU pipeline may drop the float32 -> bfloat16 -> float32 round trip
    (`xla_allow_excess_precision`, on by default), which made `lo` zero and the kernel
    bfloat16-accurate on an H200 (float32 error 1.4e-2 against 1.5e-6 for "chunked"); integer
    bit operations are not simplified away.
    """
    x = x.astype(jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
    hi = lax.bitcast_convert_type(bits, jnp.float32)
    return hi.astype(OPERAND), (x - hi).astype(OPERAND)


def join(hi: jax.Array, lo: jax.Array) -> jax.Array:
    """The float32 value of a `(hi, lo)` pair."""
    return hi.astype(jnp.float32) + lo.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Pair:
    """A float32 value in shared memory as bfloat16 `hi` and `lo` refs (a wgmma operand)."""

    hi: Any
    lo: Any

    def put(self, x: jax.Array) -> None:
        self.hi[...], self.lo[...] = split(x)

    def load(self, cast) -> jax.Array:
        return join(cast(self.hi[...]), cast(self.lo[...]))

    def at(self, *index) -> "_Pair":
        return _Pair(self.hi.at[index], self.lo.at[index])

    def copy_from(self, src: "_Pair", barrier) -> None:
        plgpu.copy_gmem_to_smem(src.hi, self.hi, barrier)
        plgpu.copy_gmem_to_smem(src.lo, self.lo, barrier)

    def copy_to(self, dst: "_Pair") -> None:
        plgpu.copy_smem_to_gmem(self.hi, dst.hi)
        plgpu.copy_smem_to_gmem(self.lo, dst.lo)


def _matmul(a: _Pair, b: _Pair) -> jax.Array:
    """`a @ b` in float32 from split operands: `hi hi' + hi lo' + lo hi'`."""
    plgpu.commit_smem()  # register stores -> visible to the async proxy that wgmma reads with
    m, n = a.hi.shape[0], b.hi.shape[1]

    def body(acc):
        plgpu.wgmma(acc, a.hi, b.hi)
        plgpu.wgmma(acc, a.hi, b.lo)
        plgpu.wgmma(acc, a.lo, b.hi)
        return acc[...]

    return pl.run_scoped(body, plgpu.ACC((m, n), jnp.float32))


def _scan_kernel(*refs, names, n_chunks, reverse, slots, block_v, interpret, **scratch):
    """One (batch, head, value block): the chunks in order (or reversed), `S` in registers."""
    g = dict(zip(names, refs, strict=True))
    a_in, b_in = _Pair(g["a_hi"], g["a_lo"]), _Pair(g["b_hi"], g["b_lo"])
    a_s, b_s = _Pair(*scratch["a"]), _Pair(*scratch["b"])
    s_op, o_op = _Pair(*scratch["s"]), _Pair(*scratch["o"])
    x_s, d_s, y_s = scratch["x"], scratch["d"], scratch.get("y")
    loads, h0_bar = scratch["loads"], scratch["h0_bar"]

    def cast(x):  # interpret mode has no register layouts to cast to
        return x if interpret else plgpu.layout_cast(x, _WGMMA)

    b, h, vb = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("vb")
    cols = pl.ds(vb * block_v, block_v)

    def chunk(i):
        return n_chunks - 1 - i if reverse else i

    def load(i, slot):
        """Start the copies of the i-th chunk visited into buffer slot `slot`."""
        n, bar = chunk(i), loads.at[slot]
        a_s.at(slot).copy_from(a_in.at(b, h, n), bar)
        b_s.at(slot).copy_from(b_in.at(b, h, n), bar)
        plgpu.copy_gmem_to_smem(g["x"].at[b, h, n, :, cols], x_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(g["d"].at[b, h, n], d_s.at[slot], bar)
        if y_s is not None:
            plgpu.copy_gmem_to_smem(g["y"].at[b, h, n, :, cols], y_s.at[slot], bar)

    s_op.copy_from(_Pair(g["h0_hi"], g["h0_lo"]).at(b, h, slice(None), cols), h0_bar)
    if slots == 2:
        load(0, 0)
    plgpu.barrier_wait(h0_bar)

    def step(i, state):
        n = chunk(i)
        plgpu.commit_smem()  # this step's register writes ordered before the copies below
        if slots == 2:  # prefetch the next chunk into the other slot (free since step i - 1)
            slot = lax.rem(i, 2)
            pl.when(i + 1 < n_chunks)(lambda: load(i + 1, 1 - slot))
        else:
            slot = 0
            load(i, slot)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # s_op, o_op: last step's stores done
        s_op.put(state)
        plgpu.commit_smem()
        s_op.copy_to(_Pair(g["states_hi"], g["states_lo"]).at(b, h, n, slice(None), cols))
        plgpu.barrier_wait(loads.at[slot])
        out = cast(x_s.at[slot][...]) + _matmul(a_s.at(slot), s_op)
        o_op.put(out)
        plgpu.commit_smem()
        o_op.copy_to(_Pair(g["out_hi"], g["out_lo"]).at(b, h, n, slice(None), cols))
        state = d_s.at[slot][0] * state + _matmul(b_s.at(slot), o_op)
        return state if y_s is None else state + cast(y_s.at[slot][...])

    state = lax.fori_loop(0, n_chunks, step, s_op.load(cast))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    s_op.put(state)
    plgpu.commit_smem()
    s_op.copy_to(_Pair(g["final_hi"], g["final_lo"]).at(b, h, slice(None), cols))
    plgpu.wait_smem_to_gmem(0)


def _slots(c: int, dk: int, block_v: int, with_y: bool) -> int:
    """Two buffer slots (prefetch) when they fit in shared memory, else one."""
    pair = 2 * jnp.dtype(OPERAND).itemsize  # bytes of a (hi, lo) element
    per_slot = pair * 2 * c * dk + 4 * c * block_v + 4 * DECAY_LANES  # a, b, x, d
    per_slot += 4 * dk * block_v if with_y else 0
    fixed = pair * (dk + c) * block_v  # the S and out operands
    for slots in (2, 1):
        if slots * per_slot + fixed <= SMEM_BYTES:
            return slots
    raise NotImplementedError(
        f"K={dk}, chunk={c}, block_v={block_v}: one chunk's buffers exceed shared memory"
    )


def check(a, b, x, d, h0, y, *, block_v):
    """Validate the kernel's arguments; returns `(B, H, N, C, K, V)`."""
    bsz, h, n, c, dk = a.shape
    dv = x.shape[-1]
    if c not in CHUNKS:
        raise NotImplementedError(f"chunk_size={c}: the GPU kernel takes chunks in {CHUNKS}")
    if block_v not in BLOCK_VS:
        raise NotImplementedError(f"block_v={block_v}: the GPU kernel takes {BLOCK_VS}")
    if dk not in HEAD_DIMS or dv % block_v:
        raise NotImplementedError(
            f"K={dk}, V={dv}: the GPU kernel takes K in {HEAD_DIMS} and V a multiple of "
            f"block_v={block_v}"
        )
    expected = dict(b=(bsz, h, n, dk, c), x=(bsz, h, n, c, dv), d=(bsz, h, n), h0=(bsz, h, dk, dv))
    if y is not None:
        expected["y"] = (bsz, h, n, dk, dv)
    for name, shape in expected.items():
        got = dict(b=b, x=x, d=d, h0=h0, y=y)[name].shape
        if got != shape:
            raise ValueError(f"{name}: expected shape {shape} (a: {a.shape}), got {got}")
    return bsz, h, n, c, dk, dv


def state_scan(a, b, x, d, h0, y=None, *, reverse: bool, block_v: int = 64, interpret: bool):
    """The state pass of the module docstring, as one Mosaic GPU kernel.

    Args:
      a: `[B, H, N, C, K]`; b: `[B, H, N, K, C]`; x: `[B, H, N, C, V]`; d: `[B, H, N]`;
        h0: `[B, H, K, V]`; y: `[B, H, N, K, V]` or None. All float32.
      reverse: visit the chunks from last to first (`S_0 = h0` then enters chunk N - 1).
      block_v: value columns per program.
      interpret: run in the Mosaic GPU interpret mode (on CPU).

    Returns:
      `(states [B, H, N, K, V], out [B, H, N, C, V], final [B, H, K, V])`, float32; `states[n]`
      is the state entering chunk n (in visiting order: the state after chunk n + 1 in reverse).
    """
    bsz, h, n, c, dk, dv = check(a, b, x, d, h0, y, block_v=block_v)
    f32 = jnp.float32
    slots = _slots(c, dk, block_v, y is not None)
    a_hi, a_lo = split_in_xla(a)
    b_hi, b_lo = split_in_xla(b)
    h0_hi, h0_lo = split_in_xla(h0)
    inputs = dict(
        a_hi=a_hi, a_lo=a_lo, b_hi=b_hi, b_lo=b_lo, x=x.astype(f32),
        d=jnp.broadcast_to(d.astype(f32)[..., None], (bsz, h, n, DECAY_LANES)),
        h0_hi=h0_hi, h0_lo=h0_lo,
    )  # fmt: skip
    if y is not None:
        inputs["y"] = y.astype(f32)
    shapes = dict(states=(bsz, h, n, dk, dv), out=(bsz, h, n, c, dv), final=(bsz, h, dk, dv))
    outputs = {
        f"{name}_{part}": jax.ShapeDtypeStruct(shape, OPERAND)
        for name, shape in shapes.items()
        for part in ("hi", "lo")
    }
    scratch = dict(
        a=(_smem((slots, c, dk), OPERAND),) * 2,
        b=(_smem((slots, dk, c), OPERAND),) * 2,
        x=_smem((slots, c, block_v), f32),
        d=plgpu.SMEM((slots, DECAY_LANES), f32),
        s=(_smem((dk, block_v), OPERAND),) * 2,
        o=(_smem((c, block_v), OPERAND),) * 2,
        loads=plgpu.Barrier(num_arrivals=6 + (y is not None), num_barriers=slots),
        h0_bar=plgpu.Barrier(num_arrivals=2),
    )
    if y is not None:
        scratch["y"] = _smem((slots, dk, block_v), f32)
    kernel = functools.partial(
        _scan_kernel,
        names=(*inputs, *outputs),
        n_chunks=n,
        reverse=reverse,
        slots=slots,
        block_v=block_v,
        interpret=interpret,
    )
    outs = plgpu.kernel(
        kernel,
        out_type=tuple(outputs.values()),
        scratch_types=scratch,
        grid=(bsz, h, dv // block_v),
        grid_names=("b", "h", "vb"),
        compiler_params=COMPILER_PARAMS,
        interpret=INTERPRET_PARAMS if interpret else None,
    )(*inputs.values())
    states, out, final = (join(outs[i], outs[i + 1]) for i in range(0, 6, 2))
    return states, out, final
