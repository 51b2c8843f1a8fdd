"""KDA's TPU kernels (`seqlab.ops.kda(impl="pallas_tpu")`) compiled for one chip of a TPU
topology from any machine (libtpu's abstract devices). Imported by `test_kda_tpu_aot.py`; it
imports `seqlab.train` (the training stack, for its ahead-of-time compiler) only when compiling.
"""

import jax
import jax.numpy as jnp

from seqlab.ops import kda

__all__ = ["SHAPE", "compile_kernels"]

SHAPE = dict(b=2, t=1024, h=4)  # batch, tokens, heads of every compile (as the gated delta's)


def abstract_inputs(mesh, dtype, k, v, *, b, t, h):
    """Abstract `(q, k, v, g, beta)`: `[B, T, H, K]` x 2, `[B, T, H, V]`, `[B, T, H, K]`,
    `[B, T, H]`."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def spec(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    f32 = jnp.float32
    return (
        spec((b, t, h, k), dtype),
        spec((b, t, h, k), dtype),
        spec((b, t, h, v), dtype),
        spec((b, t, h, k), f32),
        spec((b, t, h), f32),
    )


def compile_kernels(topology, dtype, k, v, chunk, *, grad: bool):
    """`seqlab.ops.kda(impl="pallas_tpu")` compiled for one chip of `topology` (a
    `seqlab.train.aot.Compiled`): the forward alone, or (`grad`) the gradient of every input
    (the forward that saves states, and the backward kernel)."""
    from seqlab.train import aot
    from tests.kernels.tpu_aot import one_chip

    def forward(q, k_, v_, g, beta):
        return kda(q, k_, v_, g, beta, chunk_size=chunk, impl="pallas_tpu")[0]

    def loss(*args):
        return jnp.sum(forward(*args).astype(jnp.float32))

    fn = jax.grad(loss, argnums=range(5)) if grad else forward
    mesh = one_chip(topology)
    args = abstract_inputs(mesh, dtype, k, v, **SHAPE)
    return aot.compile_step("grad" if grad else "forward", jax.jit(fn), args, mesh)
