"""Entry point of the gated delta rule kernels: platform choice, block sizes, sharding.

`seqlab.ops.gated_delta_rule(impl="pallas_tpu" | "pallas_gpu" | "pallas")` prepares the kernel
layout of README.md ("Kernel contract") and calls `chunked_scan` here. Under a mesh (set with
`jax.set_mesh`), the kernels run per shard through `jax.shard_map`: batch over the mesh axes named
in `BATCH_AXES`, heads over those in `HEAD_AXES`; every other axis sees replicated data. The
recurrence is independent per (batch, head), so no communication is needed.
"""

import dataclasses
import importlib
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from seqlab.kernels.gated_delta import vjp

BATCH_AXES = ("data", "fsdp")
HEAD_AXES = ("heads",)
KERNEL_MODULES = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}
INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Block sizes of the kernels. `chunk`: tokens per chunk, a multiple of 16 (the blocked
    triangular inverse works on 16 x 16 diagonal blocks)."""

    chunk: int = 64

    def __post_init__(self):
        if self.chunk < 16 or self.chunk % 16:
            raise NotImplementedError(
                f"chunk_size={self.chunk}: the Pallas kernels need a positive multiple of 16"
            )


def check_supported(platform: str, dtype: jnp.dtype) -> None:
    """Raise `NotImplementedError` for what the kernels cannot run (never a silent fallback)."""
    if platform not in KERNEL_MODULES:
        raise ValueError(f"platform must be one of {sorted(KERNEL_MODULES)}, got {platform!r}")
    if jnp.dtype(dtype) not in INPUT_DTYPES:
        raise NotImplementedError(
            f"the Pallas gated delta kernels take float32 or bfloat16 q/k/v, got {jnp.dtype(dtype)}"
            " (TPU and GPU kernels have no float64); use impl='chunked' or 'recurrent'"
        )


def _mesh_axes(mesh, names: tuple[str, ...]) -> tuple[str, ...] | None:
    axes = tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)
    return axes or None


def chunked_scan(
    q, k, v, gamma, beta, seg, h0, *, platform: str, block_sizes: BlockSizes, interpret: bool
):
    """Run the platform's kernels, under `shard_map` when a mesh is set.

    Args: the kernel contract of README.md (`q, k: [B, H, T, K]`, `v: [B, H, T, V]`,
      `gamma, beta: [B, H, N, C]`, `seg: [B, N, C]`, `h0: [B, H, K, V]`).
    Returns: `(o [B, H, T, V], h_final [B, H, K, V] float32)`, differentiable.
    """
    check_supported(platform, q.dtype)
    kernels = importlib.import_module(f"seqlab.kernels.gated_delta.{KERNEL_MODULES[platform]}")

    def run(q, k, v, gamma, beta, seg, h0):
        return vjp.chunked_scan(
            kernels, block_sizes.chunk, interpret, q, k, v, gamma, beta, seg, h0
        )

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return run(q, k, v, gamma, beta, seg, h0)
    batch, heads = _mesh_axes(mesh, BATCH_AXES), _mesh_axes(mesh, HEAD_AXES)
    for name, size, axes in (("batch", q.shape[0], batch), ("heads", q.shape[1], heads)):
        parts = math.prod(mesh.shape[a] for a in axes or ())
        if size % parts:
            raise ValueError(
                f"{name} size {size} is not divisible by the mesh axes {axes} ({parts})"
            )
    per_head = P(batch, heads)
    specs = (per_head, per_head, per_head, per_head, per_head, P(batch), per_head)
    args = (q, k, v, gamma, beta, seg, h0)
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        # Explicit axes: shard_map takes the arguments' own shardings, so lay them out first.
        args = tuple(jax.reshard(x, spec) for x, spec in zip(args, specs, strict=True))
    sharded = jax.shard_map(
        run, mesh=mesh, in_specs=specs, out_specs=(per_head, per_head), check_vma=False
    )
    return sharded(*args)
