"""Wall time and backward memory of the delta-rule family on CPU, `seqlab.ops.kda`, `gdn2` and
`gated_delta_product` (two writes per token): "chunked" (chunk 64) against "recurrent", float32,
K = V = 64, B x H = 1 x 4, T in {2048, 8192}; the gated delta rule measured beside them.

    python benchmarks/delta_family_cpu.py                  # full table
    python benchmarks/delta_family_cpu.py --quick          # tiny smoke run
    python benchmarks/delta_family_cpu.py --write-results  # also replace the section in RESULTS.md

Times are medians over `--repeats` calls after one warm-up call (compilation excluded), each ended
with `block_until_ready`. Forward+backward is `jit(grad(sum(o)))` with respect to every input.
Backward memory is `temp + output` bytes of the compiled forward+backward executable, read without
running it.
"""

import argparse
import datetime
import functools
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import cpu_model, replace_section
from gated_delta_cpu import memory_table, timing_table

from seqlab.ops import gated_delta_product, gated_delta_rule, gdn2, kda

SECTION = "## delta-rule family: kda, gdn2, gated_delta_product (CPU)"
WRITES = 2  # Householder writes per token of gated_delta_product


def make_inputs(op, batch, length, heads, dim):
    """Unit-norm keys, write strengths in (0, 1), log-gates in log(0.9..1); float32."""
    rng = np.random.default_rng(0)
    rows = length * WRITES if op == "gated_delta_product" else length

    def keys(t):
        k = rng.standard_normal((batch, t, heads, dim))
        return k / np.linalg.norm(k, axis=-1, keepdims=True)

    def gate(*shape):
        return np.log(rng.uniform(0.9, 1.0, (batch, length, heads, *shape)))

    x = dict(q=rng.standard_normal((batch, length, heads, dim)), k=keys(rows))
    x["v"] = rng.standard_normal((batch, rows, heads, dim))
    if op == "gdn2":
        x.update(g=gate(dim), b=rng.uniform(0, 1, (batch, length, heads, dim)))
        x["w"] = rng.uniform(0, 1, (batch, length, heads, dim))
    else:
        x["g"] = gate(dim) if op == "kda" else gate()
        x["beta"] = rng.uniform(0.0, 1.0, (batch, rows, heads))
    return {n: jnp.asarray(a, jnp.float32) for n, a in x.items()}


OPS = {
    "gated_delta_rule": gated_delta_rule,
    "kda": kda,
    "gdn2": gdn2,
    "gated_delta_product": functools.partial(gated_delta_product, num_householder=WRITES),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write-results", action="store_true")
    parser.add_argument(
        "--max-recurrent-bwd-gib",
        type=float,
        default=4.0,
        help="skip running the recurrent backward when its compiled memory exceeds this",
    )
    args = parser.parse_args()
    ops = list(OPS.items())
    dim = 64
    if args.quick:
        lengths, shapes, repeats = (256, 512), ((1, 4),), 1
    else:
        lengths, shapes, repeats = (2048, 8192), ((1, 4),), args.repeats
    max_bytes = args.max_recurrent_bwd_gib * 2**30
    timing = timing_table(ops, make_inputs, lengths, shapes, dim, repeats, max_bytes)
    memory = memory_table(ops, make_inputs, (*lengths, 2 * lengths[-1]), 1, 4, dim)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    text = "\n".join(
        [
            SECTION,
            "",
            f"{datetime.date.today().isoformat()}; {cpu_model()}; jax {jax.__version__};"
            f" `{command}`.",
            f"float32, K = V = {dim}, chunk 64, H = HV, {WRITES} writes per token for"
            f" gated_delta_product; medians of {repeats} after a warm-up. `nan`: the recurrent"
            " backward was not run because its compiled memory exceeds"
            f" {args.max_recurrent_bwd_gib} GiB.",
            "",
            *timing,
            "",
            "Backward (forward+backward executable) memory, temp + output bytes, B x H = 1 x 4:"
            " chunked grows like T (K + V) (constant last-but-one column; T counts tokens, so"
            " gated_delta_product's two writes per token show as twice the constant), the"
            " autodiff of the recurrent scan like T K V (it saves every per-token state).",
            "",
            *memory,
            "",
        ]
    )
    if args.write_results:
        replace_section(SECTION, text)
    print(text)


if __name__ == "__main__":
    main()
