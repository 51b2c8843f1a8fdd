"""Ahead-of-time compilation of a run's steps for devices that are not here: TPU pod slices.

With libtpu installed (`pip install -e ".[tpu]"`), `topology_devices("v5e:4x8")` gives the
abstract devices of a TPU topology on any machine, TPUs or not, and `compile_steps` compiles the
train and eval steps for them with the run's real shardings, by the real TPU compiler (XLA and
Mosaic, so the Pallas kernels too). What the compiled modules say of themselves is returned per
device: the HBM their arguments, outputs and temporaries take, against the chip's HBM, and the
FLOPs and bytes of the compiled cost analysis. (libtpu prints a warning about TPU worker hostnames
on a machine without TPUs; it is harmless.)
"""

import dataclasses
import functools
import os
import re
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from seqlab.train import mesh as mesh_lib
from seqlab.train.step import batch_sums, check_sequence_parallel, create_state, jit_steps

GiB = 1 << 30
"""Bytes in a gibibyte."""
HBM_BYTES = {
    "TPU v4": 32 * GiB,
    "TPU v5 lite": 16 * GiB,  # v5e
    "TPU v5": 95 * GiB,  # v5p
    "TPU v6 lite": 32 * GiB,  # v6e (Trillium)
}
"""HBM bytes per chip by `device_kind` (Google Cloud TPU documentation, "TPU versions")."""
# What the TPU compiler says when a program does not fit in HBM.
_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|Ran out of memory|exceeds the memory", re.I)
# A Mosaic kernel in the compiled HLO, and the scoped memory the compiler gave it (space 1: VMEM).
_KERNEL = re.compile(r"^\s*%([\w-]+?)(?:\.\d+)? = .*custom_call_target=\"tpu_custom_call\"")
_VMEM = re.compile(r'\{"memory_space":"1","offset":"\d+","size":"(\d+)"\}')


def topology_devices(name: str) -> list:
    """The devices of the TPU topology `name` as jax spells it (`"v5e:2x2"`, `"v5p:2x4x4"`,
    `"v6e:16x16"`; chips per dimension), all hosts' worth, from libtpu without any TPU."""
    from jax.experimental import topologies

    # libtpu takes a machine-wide lock for a process that drives TPUs; compiling drives none, so
    # let several processes (test workers, a benchmark) compile at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return list(topologies.get_topology_desc(name, platform="tpu").devices)
    except Exception as error:  # libtpu missing, or a name it does not know
        raise ValueError(
            f"topology {name!r}: {str(error).splitlines()[0]} (TPU topologies need libtpu: "
            'pip install -e ".[tpu]"; names as "v5e:4x8", "v5p:2x4x4", "v6e:16x16")'
        ) from error


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One compiled step, per device (the SPMD-partitioned program each device runs).

    Bytes: `arguments`, `outputs`, `aliased` (outputs written over donated arguments),
    `temporaries`, `code`; `flops` and `bytes_accessed` from the compiled cost analysis (a
    Pallas kernel counts as what its `pl.CostEstimate` declares); `hbm`: the chip's HBM, or None
    for a device kind not in `HBM_BYTES`; `kernels`: `(name, VMEM bytes)` of every Mosaic TPU
    kernel call in the compiled module, as the compiler allotted it.
    """

    name: str
    seconds: float
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    code: int
    flops: float
    bytes_accessed: float
    hbm: int | None
    kernels: tuple[tuple[str, int], ...] = ()

    @property
    def peak(self) -> int:
        """HBM the program holds at once: arguments, outputs not aliased, temporaries, code."""
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

    @property
    def fits(self) -> bool:
        return self.hbm is None or self.peak <= self.hbm


class CompileError(Exception):
    """A step the compiler rejected; `out_of_memory` when the reason is HBM."""

    def __init__(self, step: str, error: Exception):
        self.step, self.out_of_memory = step, bool(_OUT_OF_MEMORY.search(str(error)))
        super().__init__(f"the {step} step does not compile: {error}")


def abstract(tree, shardings):
    """`ShapeDtypeStruct`s of `tree`'s leaves placed with `shardings` (a matching tree)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def compile_step(name: str, fn: Callable, args: Sequence, mesh) -> Compiled:
    """Lower and compile the jitted `fn` on abstract `args` under `mesh` (so that the ops see
    the mesh's platform: `seqlab.ops` picks the TPU kernels for a TPU mesh)."""
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            compiled = fn.lower(*args).compile()
    except Exception as error:  # the compiler's own errors have no common type
        raise CompileError(name, error) from error
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list of one on some jax versions
    kind = mesh.devices.flat[0].device_kind
    return Compiled(
        name=name,
        seconds=seconds,
        arguments=memory.argument_size_in_bytes,
        outputs=memory.output_size_in_bytes,
        aliased=memory.alias_size_in_bytes,
        temporaries=memory.temp_size_in_bytes,
        code=memory.generated_code_size_in_bytes,
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        hbm=HBM_BYTES.get(kind),
        kernels=kernel_vmem(compiled.as_text()),
    )


def kernel_vmem(hlo: str) -> tuple[tuple[str, int], ...]:
    """`(name, VMEM bytes)` of every Mosaic TPU custom call in the compiled HLO text `hlo`."""
    found = []
    for line in hlo.splitlines():
        if match := _KERNEL.match(line):
            found.append((match.group(1), sum(int(n) for n in _VMEM.findall(line))))
    return tuple(found)


def batch_spec(batch_size: int, seq_len: int, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The abstract batch `{"inputs", "targets"}`, `[B, T] int32`, split over the mesh."""
    sharding = mesh_lib.batch_sharding(mesh)
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=sharding)
    return {"inputs": tokens, "targets": tokens}


def size(n: float) -> str:
    """Bytes in KiB, MiB or GiB, three significant figures."""
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def format_report(steps: Sequence[Compiled], header: str) -> str:
    """A table of the compiled steps, one row each, per device; then their Mosaic kernels."""
    columns = ("arguments", "outputs", "aliased", "temporaries", "peak")
    lines = [
        header,
        f"{'step':6s} {'compile':>8s} " + " ".join(f"{c:>10s}" for c in columns)
        + f" {'of HBM':>7s} {'FLOPs':>9s} {'HBM bytes':>10s}",
    ]  # fmt: skip
    for s in steps:
        share = f"{100 * s.peak / s.hbm:.0f}%" if s.hbm else "?"
        lines.append(
            f"{s.name:6s} {s.seconds:7.1f}s "
            + " ".join(f"{size(getattr(s, c)):>10s}" for c in columns)
            + f" {share:>7s} {s.flops:9.3g} {size(s.bytes_accessed):>10s}"
        )
    for s in steps:
        if s.kernels:
            calls = ", ".join(f"{name} {size(vmem)}" for name, vmem in s.kernels)
            lines.append(f"{s.name} step, Mosaic kernels (VMEM): {calls}")
    return "\n".join(lines)


def compile_steps(
    model, tx, *, mesh, batch_size: int, seq_len: int, steps: Sequence[str] = ("train", "eval")
) -> list[Compiled]:
    """Compile the train and eval steps (those named in `steps`) of `model` and optimizer `tx` on
    `[batch_size, seq_len]` batches for the devices of `mesh`, placed as `seqlab.train.mesh`
    places a run's arrays.

    Raises `ValueError` for a `seq_len` the mesh's `seq` axis does not divide, `CompileError` for
    a step the compiler rejects. Nothing is allocated: parameters, optimizer state and batches
    are abstract.
    """
    check_sequence_parallel(model, mesh, seq_len)
    init = functools.partial(create_state, model, tx, seq_len=seq_len)
    state = jax.eval_shape(init, jax.random.key(0))
    shardings = mesh_lib.state_shardings(state, mesh)
    train_fn, eval_fn = jit_steps(model.apply, shardings, mesh, sums_fn=batch_sums(model, mesh))
    state, batch = abstract(state, shardings), batch_spec(batch_size, seq_len, mesh)
    args = {"train": (train_fn, (state, batch)), "eval": (eval_fn, (state.params, batch))}
    return [compile_step(name, *args[name], mesh) for name in steps]
