"""Device mesh with `data`, `fsdp` and `seq` axes, and the `NamedSharding` placement of a run's
arrays.

Batches `[B, T]` are split along B over `data` and `fsdp` and along T over `seq`
(`P(("data", "fsdp"), "seq")`: every device sees a distinct block of sequences and tokens).
Parameters and optimizer state are sharded FSDP-style over `fsdp` along their largest axis that it
divides, and replicated over `data` and `seq`; arrays no axis of which `fsdp` divides (scalars,
small vectors) are replicated. With `fsdp = seq = 1` this is plain data parallelism. With
`seq > 1` (sequence parallelism) the model runs on each device's piece of the time axis inside
`jax.shard_map` (`seqlab.train.step.batch_sums`); T must be a multiple of `seq`.

Several hosts (GPU nodes, TPU pod slices): call `initialize_distributed()` first on every host; the
mesh then spans the devices of all hosts, and every host builds the same global batch from
`(seed, step)` and hands over only its own slices (`place_batch`).
"""

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "seq")
BATCH_AXES = ("data", "fsdp")  # the axes that split B; "seq" splits T


def initialize_distributed() -> None:
    """`jax.distributed.initialize()`: on TPU pods and SLURM/Open MPI clusters it finds the
    coordinator itself; elsewhere set `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and
    `JAX_PROCESS_ID` (or pass them on the launcher's command line)."""
    jax.distributed.initialize()


def _check_size(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def make_mesh(data: int, fsdp: int, seq: int = 1, devices=None) -> Mesh:
    """A `(data, fsdp, seq)` mesh over the first `data * fsdp * seq` of `devices` (default
    `jax.devices()`).

    `data = -1` takes every device left after `fsdp * seq`.
    """
    devices = list(jax.devices() if devices is None else devices)
    _check_size("mesh.fsdp", fsdp)
    _check_size("mesh.seq", seq)
    if data == -1:
        if len(devices) % (fsdp * seq):
            raise ValueError(
                f"mesh.fsdp * mesh.seq = {fsdp * seq} must divide the {len(devices)} devices"
            )
        data = len(devices) // (fsdp * seq)
    if isinstance(data, bool) or not isinstance(data, int) or data <= 0:
        raise ValueError(f"mesh.data must be a positive int or -1, got {data!r}")
    if data * fsdp * seq > len(devices):
        raise ValueError(
            f"mesh.data * mesh.fsdp * mesh.seq = {data * fsdp * seq} exceeds the {len(devices)} "
            "devices available"
        )
    grid = np.asarray(devices[: data * fsdp * seq], dtype=object).reshape(data, fsdp, seq)
    return Mesh(grid, AXES)


def num_devices(mesh: Mesh) -> int:
    return math.prod(mesh.shape.values())


def batch_devices(mesh: Mesh) -> int:
    """The number of pieces a batch's B axis is split into: `data * fsdp`."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def check_seq_len(seq_len: int, mesh: Mesh) -> None:
    """`seq_len` (T of the batches) must be a multiple of the mesh's `seq` axis."""
    seq = mesh.shape["seq"]
    if seq_len % seq:
        raise ValueError(f"mesh.seq = {seq} must divide seq_len = {seq_len}")


def leaf_spec(shape: tuple[int, ...], fsdp: int) -> PartitionSpec:
    """Shard the largest axis of `shape` that `fsdp` divides over `fsdp`; replicate otherwise."""
    if fsdp > 1:
        for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
            if shape[axis] % fsdp == 0:
                return PartitionSpec(*(("fsdp" if a == axis else None) for a in range(len(shape))))
    return PartitionSpec()


def state_shardings(abstract_state, mesh: Mesh):
    """A `NamedSharding` for every leaf of `abstract_state` (arrays or `ShapeDtypeStruct`s)."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: NamedSharding(mesh, leaf_spec(np.shape(x), fsdp)), abstract_state)


BATCH_SPEC = PartitionSpec(BATCH_AXES, "seq")


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches `[B, T]` split along B over `data` and `fsdp` and along T over `seq`."""
    return NamedSharding(mesh, BATCH_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def place_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Global arrays from the host copy of the global batch; each host transfers only the slices
    of its own devices (so this works unchanged on several hosts)."""
    return {
        name: jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[index])
        for name, x in batch.items()
    }
