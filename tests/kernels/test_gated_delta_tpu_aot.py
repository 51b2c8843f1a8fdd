"""The TPU kernels of the gated delta rule compiled by the real TPU compiler (XLA and Mosaic) for
v5e and v6e chips, without a TPU: libtpu's abstract devices (`seqlab.train.aot`). Forward alone
(inference) and forward with backward (a gradient), float32 and bfloat16, at model shapes.

Marked `aot`: run with `pytest -m aot` after `pip install -e ".[dev,tpu]"` (CI does).
"""

import jax.numpy as jnp
import pytest

from seqlab.kernels.gated_delta import pallas_tpu
from seqlab.train import aot
from tests.kernels.tpu_aot import SHAPE, compile_kernels

pytestmark = pytest.mark.aot

CHIPS = ("v5e:2x2", "v6e:2x2")
# (K, V): square heads, and Gated DeltaNet's expand_v = 2 at head_dim 128 (the 0.4B presets).
HEADS = ((64, 64), (128, 128), (256, 256), (128, 256))


def declared_flops(k, v, chunk, *, backward: bool) -> int:
    b, t, h = SHAPE["b"], SHAPE["t"], SHAPE["h"]
    n = t // chunk
    return pallas_tpu._cost((b, h, n), chunk, k, v, (), backward=backward).flops


@pytest.mark.parametrize("chunk", (64, 128))
@pytest.mark.parametrize("k, v", HEADS, ids=[f"k{k}v{v}" for k, v in HEADS])
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=("f32", "bf16"))
@pytest.mark.parametrize("topology", CHIPS)
def test_forward_and_backward_compile(topology, dtype, k, v, chunk):
    inference = compile_kernels(topology, dtype, k, v, chunk, grad=False)
    assert [name for name, _ in inference.kernels] == ["gated_delta_fwd"]
    training = compile_kernels(topology, dtype, k, v, chunk, grad=True)
    assert sorted(name for name, _ in training.kernels) == ["gated_delta_bwd", "gated_delta_fwd"]
    for name, vmem in (*inference.kernels, *training.kernels):
        assert vmem > 0, name  # the compiler allotted the kernel its VMEM
    # The kernels' declared cost reaches the compiled cost analysis (XLA's own ops add more).
    fwd = declared_flops(k, v, chunk, backward=False)
    assert inference.flops >= fwd
    assert training.flops >= fwd + declared_flops(k, v, chunk, backward=True)


def test_unknown_topology_names_itself():
    with pytest.raises(ValueError, match="v9z:2x2"):
        aot.topology_devices("v9z:2x2")
