"""The KDA TPU kernels compiled by the real TPU compiler (XLA and Mosaic) for v5e and v6e chips,
without a TPU: libtpu's abstract devices (`seqlab.train.aot`). Forward alone (inference) and
forward with backward (a gradient), float32 and bfloat16, at model shapes.

Marked `aot`: run with `pytest -m aot` after `pip install -e ".[dev,tpu]"` (CI does).
"""

import jax.numpy as jnp
import pytest

from seqlab.kernels.kda import pallas_tpu
from tests.kernels.kda_tpu_aot import SHAPE, compile_kernels

pytestmark = pytest.mark.aot

CHIPS = ("v5e:2x2", "v6e:2x2")
# (chip, dtype, K, V, chunk): Kimi Linear's heads (128 x 128) in chunks of 64 (fla's) on both
# chips and dtypes; the shapes around them once each (each case compiles for ~10 s, on both CI
# lines).
CASES = [
    *((chip, dtype, 128, 128, 64) for chip in CHIPS for dtype in ("f32", "bf16")),
    ("v6e:2x2", "bf16", 64, 64, 64),
    ("v5e:2x2", "f32", 128, 128, 128),
    ("v6e:2x2", "bf16", 128, 256, 64),
    ("v5e:2x2", "bf16", 256, 256, 64),
]
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def declared_flops(k, v, chunk, *, backward: bool) -> int:
    b, t, h = SHAPE["b"], SHAPE["t"], SHAPE["h"]
    n = t // chunk
    return pallas_tpu._cost((b, h, n), chunk, k, v, (), backward=backward).flops


@pytest.mark.parametrize(
    ("topology", "dtype", "k", "v", "chunk"),
    [pytest.param(*case, id="-".join(map(str, case))) for case in CASES],
)
def test_forward_and_backward_compile(topology, dtype, k, v, chunk):
    dtype = DTYPES[dtype]
    inference = compile_kernels(topology, dtype, k, v, chunk, grad=False)
    assert [name for name, _ in inference.kernels] == ["kda_fwd"]
    training = compile_kernels(topology, dtype, k, v, chunk, grad=True)
    assert sorted(name for name, _ in training.kernels) == ["kda_bwd", "kda_fwd"]
    for name, vmem in (*inference.kernels, *training.kernels):
        assert vmem > 0, name  # the compiler allotted the kernel its VMEM
    # The kernels' declared cost reaches the compiled cost analysis (XLA's own ops add more).
    fwd = declared_flops(k, v, chunk, backward=False)
    assert inference.flops >= fwd
    assert training.flops >= fwd + declared_flops(k, v, chunk, backward=True)
