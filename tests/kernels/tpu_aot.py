"""The gated delta rule's TPU kernels compiled for one chip of a TPU topology, from any machine
(libtpu's abstract devices). Imported by `test_gated_delta_tpu_aot.py` and by
`benchmarks/tpu_kernels.py`; it imports nothing from the test configuration."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from seqlab.ops import gated_delta_rule
from seqlab.train import aot

SHAPE = dict(b=2, t=1024, h=4)  # batch, tokens, heads of every compile


@functools.cache
def one_chip(topology: str) -> Mesh:
    """A one-device mesh on the first chip of `topology`."""
    return Mesh(np.asarray(aot.topology_devices(topology)[:1]), ("data",))


def abstract_inputs(mesh, dtype, k, v, *, b, t, h):
    """Abstract `(q, k, v, g, beta)` of `gated_delta_rule`: `[B, T, H, K]`, ..., `[B, T, H]`."""
    sharding = NamedSharding(mesh, PartitionSpec())

    def spec(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    f32 = jnp.float32
    return (
        spec((b, t, h, k), dtype),
        spec((b, t, h, k), dtype),
        spec((b, t, h, v), dtype),
        spec((b, t, h), f32),
        spec((b, t, h), f32),
    )


def compile_kernels(topology, dtype, k, v, chunk, *, grad: bool) -> aot.Compiled:
    """`gated_delta_rule(impl="pallas_tpu")` compiled for one chip of `topology`: the forward
    alone, or (`grad`) the gradient of every input (the forward that saves states, and the
    backward kernel)."""

    def forward(q, k_, v_, g, beta):
        return gated_delta_rule(q, k_, v_, g, beta, chunk_size=chunk, impl="pallas_tpu")[0]

    def loss(*args):
        return jnp.sum(forward(*args).astype(jnp.float32))

    fn = jax.grad(loss, argnums=range(5)) if grad else forward
    mesh = one_chip(topology)
    args = abstract_inputs(mesh, dtype, k, v, **SHAPE)
    return aot.compile_step("grad" if grad else "forward", jax.jit(fn), args, mesh)
