"""The gated delta rule's TPU kernels as the TPU compiler sees them, from a CPU: VMEM per kernel,
generated code, the compiled cost analysis and compile time, float32 against bf16 inputs.

Each row compiles `gated_delta_rule(impl="pallas_tpu")` for one chip (`tests/kernels/tpu_aot.py`,
B = 2, T = 1024, H = 4): the forward alone (inference) and the gradient (forward saving states,
then the backward kernel). bf16 inputs select the bf16-operand kernels (one MXU pass per product;
float32 runs every product at full precision, several passes). FLOPs include what the kernels
declare (`pl.CostEstimate`), identical for both dtypes: the compiler cannot count inside a Mosaic
kernel, and without a TPU no time is measured.

    python benchmarks/tpu_kernels.py [--write-results]     # libtpu needed: pip install -e ".[tpu]"
"""

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp
from _common import cpu_model, replace_section

from seqlab.train import aot
from tests.kernels.tpu_aot import compile_kernels

CHIPS = ("v5e:2x2", "v6e:2x2")
SHAPES = ((128, 128, 64), (128, 256, 64), (256, 256, 128), (200, 400, 64))  # K, V, chunk


def rows():
    for topology in CHIPS:
        for k, v, chunk in SHAPES:
            for dtype in (jnp.float32, jnp.bfloat16):
                for grad in (False, True):
                    step = compile_kernels(topology, dtype, k, v, chunk, grad=grad)
                    vmem = ", ".join(f"{n} {aot.size(b)}" for n, b in step.kernels)
                    row = (
                        f"| {topology.split(':')[0]} | {jnp.dtype(dtype).name} | {k} x {v} | "
                        f"{chunk} | {'gradient' if grad else 'forward'} | {vmem} | "
                        f"{aot.size(step.code)} | {step.flops:.3g} | "
                        f"{aot.size(step.bytes_accessed)} | {step.seconds:.1f} s |"
                    )
                    print(row, flush=True)
                    yield row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    header = (
        "| chip | inputs | K x V | chunk | compiled | kernels: VMEM | code | FLOPs | HBM bytes "
        "| compile |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    print(header)
    text = header + "\n" + "\n".join(rows())
    if args.write_results:
        replace_section(
            "## TPU kernels (compiled from a CPU)",
            "## TPU kernels (compiled from a CPU)\n\n"
            f"{datetime.date.today()}, on {cpu_model()} (no TPU), libtpu from PyPI. Command: "
            "`python benchmarks/tpu_kernels.py --write-results`. "
            + __doc__.split("\n\n")[1].replace("\n", " ")
            + "\n\n"
            + text
            + "\n",
        )


if __name__ == "__main__":
    main()
