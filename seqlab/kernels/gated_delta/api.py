"""Entry points of the gated delta rule kernels: platform choice, block sizes, sharding.

`seqlab.ops.gated_delta_rule` calls, for `impl="pallas_tpu"`, `chunked_scan` on the TPU kernel
layout of README.md ("TPU kernel contract"); for `impl="pallas_gpu"`, `scan_chunk_states` (the
state pass of its chunked form, everything else chunk-parallel in XLA). Under a mesh (set with
`jax.set_mesh`), they run per shard through `per_shard` (`jax.shard_map`): batch over the mesh
axes named in `BATCH_AXES`, heads over those in `HEAD_AXES`; every other axis sees replicated
data. The recurrence is independent per (batch, head), so no communication is needed.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from seqlab.kernels.gated_delta import pallas_gpu, vjp

BATCH_AXES = ("data", "fsdp")
"""Mesh axes that split the batch of the kernels' inputs (the names present in the mesh)."""
HEAD_AXES = ("heads",)
"""Mesh axes that split the heads of the kernels' inputs."""
INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
"""The dtypes of q, k, v that the kernels take."""


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Block sizes of the kernels.

    chunk: tokens per chunk, a multiple of 16 (TPU; the GPU kernel takes 64 or 128).
    block_v: value columns per program of the GPU kernel (its state block is `[K, block_v]`).
    """

    chunk: int = 64
    block_v: int = 64

    def __post_init__(self):
        if self.chunk < 16 or self.chunk % 16:
            raise NotImplementedError(
                f"chunk_size={self.chunk}: the Pallas kernels need a positive multiple of 16 "
                "(impl=None picks them on TPU and Hopper GPUs; else pass impl='chunked')"
            )


def check_supported(dtype: jnp.dtype) -> None:
    """Raise `NotImplementedError` for what the kernels cannot run (never a silent fallback)."""
    if jnp.dtype(dtype) not in INPUT_DTYPES:
        raise NotImplementedError(
            f"the Pallas gated delta kernels take float32 or bfloat16 q/k/v, got {jnp.dtype(dtype)}"
            " (TPU and GPU kernels have no float64); use impl='chunked' or 'recurrent'"
        )


def unsupported(impl: str, dtype, dk: int, dv: int, chunk: int) -> str | None:
    """Why kernel `impl` ("pallas_tpu" or "pallas_gpu") cannot run q/k/v of `dtype` with head
    widths `K = dk`, `V = dv` in chunks of `chunk` tokens; None when it can.

    Both kernels take float32 and bfloat16 and chunks that are positive multiples of 16; the GPU
    kernel takes chunks in `pallas_gpu.CHUNKS` and `K <= max(pallas_gpu.HEAD_DIMS)` (smaller K and
    every V are zero-padded, which is exact). `seqlab.ops.gated_delta_rule` raises
    `NotImplementedError` with this reason for an explicit kernel name, and `impl=None` takes
    `"chunked"` where the platform's kernel cannot run.
    """
    if jnp.dtype(dtype) not in INPUT_DTYPES:
        return f"the Pallas kernels take float32 or bfloat16 q/k/v, got {jnp.dtype(dtype)}"
    if chunk < 16 or chunk % 16:
        return f"chunk_size={chunk}: the Pallas kernels need a positive multiple of 16"
    if impl == "pallas_gpu":
        if chunk not in pallas_gpu.CHUNKS:
            return f"chunk_size={chunk}: the GPU kernel takes chunks in {pallas_gpu.CHUNKS}"
        if dk > max(pallas_gpu.HEAD_DIMS):
            return (
                f"K={dk}: the GPU kernel keeps a [K, 64] float32 state block in registers and "
                f"takes K <= {max(pallas_gpu.HEAD_DIMS)}"
            )
    return None


def _mesh_axes(mesh, names: tuple[str, ...]) -> tuple[str, ...] | None:
    axes = tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)
    return axes or None


def chunked_scan(q, k, v, gamma, beta, seg, h0, *, block_sizes: BlockSizes, interpret: bool):
    """Run the TPU kernels, under `shard_map` when a mesh is set.

    Args: the kernel contract of README.md (`q, k: [B, H, T, K]`, `v: [B, H, T, V]`,
      `gamma, beta: [B, H, N, C]`, `seg: [B, N, C]`, `h0: [B, H, K, V]`).
    Returns: `(o [B, H, T, V], h_final [B, H, K, V] float32)`, differentiable.
    """
    check_supported(q.dtype)

    def run(q, k, v, gamma, beta, seg, h0):
        return vjp.chunked_scan(block_sizes.chunk, interpret, q, k, v, gamma, beta, seg, h0)

    head_major = ((BATCH, HEADS),) * 5
    specs = (*head_major, (BATCH,), (BATCH, HEADS))
    return per_shard(run, (q, k, v, gamma, beta, seg, h0), specs, ((BATCH, HEADS),) * 2)


def scan_chunk_states(state, k_end, u, w, state_to_end, *, block_sizes: BlockSizes, interpret):
    """The state pass of the chunked gated delta rule by the GPU kernel (call it per shard:
    `seqlab.ops.gated_delta_rule` wraps the whole op in `per_shard`).

    The contract of `seqlab.ops._chunked.scan_chunk_states` (`v_new = u - w S_n`,
    `S_{n+1} = state_to_end S_n + k_end^T v_new`): `state: [B, HV, K, V]`,
    `k_end, w: [B, N, C, HV, K]`, `u: [B, N, C, HV, V]`, `state_to_end: [B, N, HV]`, float32.
    Returns `(final [B, HV, K, V], states [B, N, HV, K, V], v_new [B, N, C, HV, V])`.

    K is zero-padded to the next width in `pallas_gpu.HEAD_DIMS` and V to a multiple of
    `block_v`: zero key columns leave `w S` and `k_end^T v_new` unchanged and keep the padded
    state rows at zero, and zero value columns stay zero, so the padding is exact.
    """
    check_supported(u.dtype)
    dk, dv = state.shape[-2:]
    kp = min((d for d in pallas_gpu.HEAD_DIMS if d >= dk), default=dk)  # the kernel rejects > max
    vp = -(-dv // block_sizes.block_v) * block_sizes.block_v

    def heads_major(x, width):  # [B, N, C, HV, D] -> [B, HV, N, C, width], zero-padded
        return _pad_last(jnp.moveaxis(x, 3, 1), width)

    states, v_new, final = vjp.state_scan(
        block_sizes.block_v,
        interpret,
        -heads_major(w, kp),
        jnp.swapaxes(heads_major(k_end, kp), -1, -2),
        heads_major(u, vp),
        jnp.moveaxis(state_to_end, 2, 1),
        jnp.pad(state, ((0, 0), (0, 0), (0, kp - dk), (0, vp - dv))),
    )
    states, v_new, final = states[..., :dk, :dv], v_new[..., :dv], final[..., :dk, :dv]
    return final, jnp.moveaxis(states, 1, 2), jnp.moveaxis(v_new, 1, 3)


def _pad_last(x, width):
    """`x` with its last axis zero-padded to `width`."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


BATCH, HEADS = "batch", "heads"  # in specs: the mesh axes of BATCH_AXES / HEAD_AXES


def per_shard(run, args, specs, out_specs):
    """`run(*args)`, under `jax.shard_map` when a mesh is set, else as it is.

    `specs` and `out_specs` give, per argument and per output, the partitioning of its leading
    axes as a tuple of `BATCH`, `HEADS` or None; `BATCH` and `HEADS` stand for the mesh axes of
    `BATCH_AXES` and `HEAD_AXES` present in the mesh. The gated delta rule is independent per
    (batch, head), so the shards need no communication.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return run(*args)
    axes = {BATCH: _mesh_axes(mesh, BATCH_AXES), HEADS: _mesh_axes(mesh, HEAD_AXES), None: None}
    for x, spec in zip(args, specs, strict=True):
        for size, key in zip(x.shape, spec, strict=False):
            parts = math.prod(mesh.shape[a] for a in axes[key] or ())
            if size % parts:
                raise ValueError(
                    f"{key} size {size} is not divisible by the mesh axes {axes[key]} ({parts})"
                )
    specs, out_specs = (tuple(P(*(axes[p] for p in s)) for s in ss) for ss in (specs, out_specs))
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        # Explicit axes: shard_map takes the arguments' own shardings, so lay them out first.
        args = tuple(jax.reshard(x, spec) for x, spec in zip(args, specs, strict=True))
    sharded = jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)
    return sharded(*args)
