"""Wall time and backward memory of seqlab.ops.gated_delta_rule and seqlab.ops.ssd on CPU:
"chunked" (chunk 64) against "recurrent", float32, K = V = 64, T in {1024, 4096, 16384},
(B, H) in {(1, 4), (2, 16)} (B*H in {4, 32}), grouped layout H = HV.

    python benchmarks/gated_delta_cpu.py                  # full table
    python benchmarks/gated_delta_cpu.py --quick          # tiny smoke run
    python benchmarks/gated_delta_cpu.py --write-results  # also replace the section in RESULTS.md

Times are medians over `--repeats` calls after one warm-up call (compilation excluded), each ended
with `block_until_ready`. Forward+backward is `jit(grad(sum(o)))` with respect to every input.
Backward memory is `temp + output` bytes of the compiled forward+backward executable
(`jax.jit(f).lower(*args).compile().memory_analysis()`); it is read without running, so it is
reported also where running the recurrent backward would not fit in memory.
"""

import argparse
import datetime
import functools
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import cpu_model, median_seconds, replace_section

from seqlab.ops.gated_delta import gated_delta_rule
from seqlab.ops.ssd import ssd

SECTION = "## gated_delta_rule / ssd (CPU)"
MiB = 2**20


def make_inputs(batch, length, heads, dim, *, beta):
    """Unit-norm keys, beta in (0, 1), log-gates in log(0.9..1); float32."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((batch, length, heads, dim))
    x = dict(
        q=rng.standard_normal((batch, length, heads, dim)),
        k=k / np.linalg.norm(k, axis=-1, keepdims=True),
        v=rng.standard_normal((batch, length, heads, dim)),
        g=np.log(rng.uniform(0.9, 1.0, (batch, length, heads))),
    )
    if beta:
        x["beta"] = rng.uniform(0.0, 1.0, (batch, length, heads))
    return {n: jnp.asarray(a, jnp.float32) for n, a in x.items()}


def functions(op, impl):
    """Jitted forward and forward+backward of `op` with `impl` (keyword inputs)."""
    fwd = functools.partial(op, impl=impl, chunk_size=64)

    def loss(x):
        return jnp.sum(fwd(**x)[0])

    return jax.jit(lambda x: fwd(**x)[0]), jax.jit(jax.grad(loss))


def backward_bytes(grad_fn, x):
    stats = grad_fn.lower(x).compile().memory_analysis()
    return stats.temp_size_in_bytes + stats.output_size_in_bytes


def timing_table(ops, make, lengths, shapes, dim, repeats, max_recurrent_bwd_bytes):
    """Rows of wall times, recurrent vs chunked; `make(name, batch, length, heads, dim)` gives an
    op's keyword inputs (also used by `delta_family_cpu.py`)."""
    rows = []
    for name, op in ops:
        for batch, heads in shapes:
            for length in lengths:
                x = make(name, batch, length, heads, dim)
                t = {}
                for impl in ("recurrent", "chunked"):
                    fwd, bwd = functions(op, impl)
                    t[impl, "fwd"] = median_seconds(fwd, x, repeats=repeats)
                    need = backward_bytes(bwd, x)
                    if impl == "recurrent" and need > max_recurrent_bwd_bytes:
                        t[impl, "bwd"] = float("nan")  # would not fit: reported, not run
                    else:
                        t[impl, "bwd"] = median_seconds(bwd, x, repeats=repeats)
                row = (
                    f"| {name} | {batch}x{heads} | {length} | {t['recurrent', 'fwd'] * 1e3:.1f} |"
                    f" {t['chunked', 'fwd'] * 1e3:.1f} |"
                    f" {t['recurrent', 'fwd'] / t['chunked', 'fwd']:.2f} |"
                    f" {t['recurrent', 'bwd'] * 1e3:.1f} | {t['chunked', 'bwd'] * 1e3:.1f} |"
                    f" {t['recurrent', 'bwd'] / t['chunked', 'bwd']:.2f} |"
                )
                print(row, flush=True)
                rows.append(row)
    header = [
        "| op | BxH | T | recurrent fwd ms | chunked fwd ms | ratio | recurrent fwd+bwd ms |"
        " chunked fwd+bwd ms | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return header + rows


def memory_table(ops, make, lengths, batch, heads, dim):
    """Rows of compiled forward+backward memory, recurrent vs chunked."""
    rows = []
    for name, op in ops:
        for length in lengths:
            x = make(name, batch, length, heads, dim)
            mem = {
                impl: backward_bytes(functions(op, impl)[1], x) for impl in ("recurrent", "chunked")
            }
            tkv = length * (2 * dim) * batch * heads * 4  # T*(K+V) float32 bytes, all heads
            tkxv = length * dim * dim * batch * heads * 4  # T*K*V float32 bytes, all heads
            row = (
                f"| {name} | {length} | {mem['recurrent'] / MiB:.1f} | {mem['chunked'] / MiB:.1f} |"
                f" {mem['chunked'] / tkv:.1f} | {mem['recurrent'] / tkxv:.2f} |"
            )
            print(row, flush=True)
            rows.append(row)
    header = [
        "| op | T | recurrent MiB | chunked MiB | chunked / (T(K+V)) | recurrent / (TKV) |",
        "|---|---|---|---|---|---|",
    ]
    return header + rows


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
    ops = [("gated_delta_rule", gated_delta_rule), ("ssd", ssd)]
    dim = 64
    if args.quick:
        lengths, shapes, repeats = (256, 512), ((1, 4),), 1
    else:
        lengths, shapes, repeats = (1024, 4096, 16384), ((1, 4), (2, 16)), args.repeats

    def make(name, batch, length, heads, dim):
        return make_inputs(batch, length, heads, dim, beta=name == "gated_delta_rule")

    max_bytes = args.max_recurrent_bwd_gib * 2**30
    timing = timing_table(ops, make, lengths, shapes, dim, repeats, max_bytes)
    memory = memory_table(ops, make, lengths, 1, 4, dim)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    text = "\n".join(
        [
            SECTION,
            "",
            f"{datetime.date.today().isoformat()}; {cpu_model()}; jax {jax.__version__};"
            f" `{command}`.",
            f"float32, K = V = {dim}, chunk 64, H = HV; medians of {repeats} after a warm-up."
            " Measured while other jobs shared the CPU: the lead will re-run on an idle machine."
            " `nan`: the recurrent backward was not run because its compiled memory exceeds"
            f" {args.max_recurrent_bwd_gib} GiB.",
            "",
            *timing,
            "",
            "Backward (forward+backward executable) memory, temp + output bytes, B x H = 1 x 4:"
            " chunked grows like T (K + V) (constant last-but-one column), the autodiff of the"
            " recurrent scan like T K V (it saves every per-token state).",
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
