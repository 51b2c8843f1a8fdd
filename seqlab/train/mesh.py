"""Device mesh with `data` and `fsdp` axes, and the `NamedSharding` placement of a run's arrays.

Batches are split along their first axis over both axes (`P(("data", "fsdp"))`: every device sees
a distinct slice). Parameters and optimizer state are sharded FSDP-style over `fsdp` along their
largest axis that it divides, and replicated over `data`; arrays no axis of which `fsdp` divides
(scalars, small vectors) are replicated. With `fsdp = 1` this is plain data parallelism.

Several hosts (GPU nodes, TPU pod slices): call `initialize_distributed()` first on every host; the
mesh then spans the devices of all hosts, and every host builds the same global batch from
`(seed, step)` and hands over only its own slices (`place_batch`).
"""

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp")


def initialize_distributed() -> None:
    """`jax.distributed.initialize()`: on TPU pods and SLURM/Open MPI clusters it finds the
    coordinator itself; elsewhere set `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and
    `JAX_PROCESS_ID` (or pass them on the launcher's command line)."""
    jax.distributed.initialize()


def make_mesh(data: int, fsdp: int, devices=None) -> Mesh:
    """A `(data, fsdp)` mesh over the first `data * fsdp` of `devices` (default `jax.devices()`).

    `data = -1` takes every device left after `fsdp`.
    """
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(fsdp, bool) or not isinstance(fsdp, int) or fsdp <= 0:
        raise ValueError(f"mesh.fsdp must be a positive int, got {fsdp!r}")
    if data == -1:
        if len(devices) % fsdp:
            raise ValueError(f"mesh.fsdp = {fsdp} must divide the {len(devices)} devices")
        data = len(devices) // fsdp
    if isinstance(data, bool) or not isinstance(data, int) or data <= 0:
        raise ValueError(f"mesh.data must be a positive int or -1, got {data!r}")
    if data * fsdp > len(devices):
        raise ValueError(
            f"mesh.data * mesh.fsdp = {data * fsdp} exceeds the {len(devices)} devices available"
        )
    return Mesh(np.asarray(devices[: data * fsdp], dtype=object).reshape(data, fsdp), AXES)


def num_devices(mesh: Mesh) -> int:
    return math.prod(mesh.shape.values())


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


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches `[B, ...]` split along B over every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec(AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def place_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Global arrays from the host copy of the global batch; each host transfers only the slices
    of its own devices (so this works unchanged on several hosts)."""
    return {
        name: jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[index])
        for name, x in batch.items()
    }
