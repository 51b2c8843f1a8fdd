"""Entry point of the KDA (Kimi Delta Attention) TPU kernels: checks, block sizes, sharding.

`seqlab.ops.kda(impl="pallas_tpu")` lays its inputs out as the kernel contract of README.md and
calls `chunked_scan`. Under a mesh (set with `jax.set_mesh`) the kernels run per shard through
the gated delta kernels' `per_shard` (`jax.shard_map`): batch over the mesh axes of
`BATCH_AXES`, heads over those of `HEAD_AXES`; the recurrence is independent per (batch, head),
so the shards need no communication. `BlockSizes` is the gated delta kernels' (only `chunk` is
read here).
"""

import jax.numpy as jnp

from seqlab.kernels.gated_delta.api import (
    BATCH,
    BATCH_AXES,
    HEAD_AXES,
    HEADS,
    INPUT_DTYPES,
    BlockSizes,
    per_shard,
)
from seqlab.kernels.kda import vjp

__all__ = [
    "BATCH_AXES",
    "HEAD_AXES",
    "INPUT_DTYPES",
    "BlockSizes",
    "check_supported",
    "chunked_scan",
    "unsupported",
]


def unsupported(dtype, chunk: int) -> str | None:
    """Why the KDA TPU kernels cannot run q/k/v of `dtype` in chunks of `chunk` tokens; None when
    they can (float32 or bfloat16, chunk a positive multiple of 16)."""
    if jnp.dtype(dtype) not in INPUT_DTYPES:
        return f"the Pallas KDA kernels take float32 or bfloat16 q/k/v, got {jnp.dtype(dtype)}"
    if chunk < 16 or chunk % 16:
        return f"chunk_size={chunk}: the Pallas KDA kernels need a positive multiple of 16"
    return None


def check_supported(dtype) -> None:
    """Raise `NotImplementedError` for q/k/v the kernels cannot take (never a silent fallback)."""
    if jnp.dtype(dtype) not in INPUT_DTYPES:
        raise NotImplementedError(
            f"the Pallas KDA kernels take float32 or bfloat16 q/k/v, got {jnp.dtype(dtype)} "
            "(TPU kernels have no float64); use impl='chunked' or 'recurrent'"
        )


def _check(q, k, v, gamma, beta, seg, h0, chunk: int) -> None:
    check_supported(q.dtype)
    if not (k.dtype == v.dtype == q.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, x in (("gamma", gamma), ("beta", beta), ("seg", seg), ("h0", h0)):
        if jnp.dtype(x.dtype) != jnp.float32:
            raise NotImplementedError(
                f"{name} must be float32 (the kernels' gates and states), got {x.dtype}"
            )
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    n = t // chunk
    expected = {
        "k": (k.shape, (b, h, t, dk)),
        "v": (v.shape, (b, h, t, dv)),
        "gamma": (gamma.shape, (b, h, t, dk)),
        "beta": (beta.shape, (b, h, n, chunk)),
        "seg": (seg.shape, (b, n, chunk)),
        "h0": (h0.shape, (b, h, dk, dv)),
    }
    if t % chunk:
        raise ValueError(f"q: T={t} must be a multiple of the chunk size {chunk}")
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(f"{name}: expected shape {want} [from q {q.shape}], got {tuple(got)}")


def chunked_scan(q, k, v, gamma, beta, seg, h0, *, block_sizes: BlockSizes, interpret: bool):
    """Run the KDA TPU kernels, under `shard_map` when a mesh is set.

    The arguments are the kernel contract of README.md: `q, k, gamma: [B, H, T, K]` (q
    pre-scaled, heads expanded, T a multiple of `block_sizes.chunk`; gamma float32, the
    chunk-local inclusive cumsum of the log-gates), `v: [B, H, T, V]` (q/k/v float32 or
    bfloat16), `beta: [B, H, N, C]`, `seg: [B, N, C]` (chunk-local segment counter),
    `h0: [B, H, K, V]`, all float32.
    Returns: `(o [B, H, T, V] in v.dtype, h_final [B, H, K, V] float32)`, differentiable in q, k,
      v, gamma, beta and h0.
    Raises: `NotImplementedError` for dtypes the kernels cannot take (float64).
    """
    _check(q, k, v, gamma, beta, seg, h0, block_sizes.chunk)

    def run(q, k, v, gamma, beta, seg, h0):
        return vjp.chunked_scan(block_sizes.chunk, interpret, q, k, v, gamma, beta, seg, h0)

    head_major = ((BATCH, HEADS),) * 5
    specs = (*head_major, (BATCH,), (BATCH, HEADS))
    return per_shard(run, (q, k, v, gamma, beta, seg, h0), specs, ((BATCH, HEADS),) * 2)
